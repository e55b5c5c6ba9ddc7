"""The other tensor-parallel ranks as rank 0 sees them: processes, control channel, heartbeat.

    rank 0 (this process)                       ranks 1..N-1 (spawned, see model_runner.py)
    RankProcesses.send(payload) ──broadcast──► receive: length (int64), then the bytes
    heartbeat thread: Ping when idle ────────► (keeps their receive inside its timeout)
    stop(): Stop message, join, terminate ───► leave the loop, destroy the process group
            destroy this process's group

It holds no reference to the ModelRunner, so a runner nobody references can be collected
and its finalizer (stop) releases the ranks and the process group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.protocol.tp import TP_PROTOCOL, Ping, Stop

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # how long stopping waits for a worker before terminating it


class RankProcesses:
    """Ranks 1..N-1 as rank 0 sees them: their processes, the control group that carries
    steps to them, the heartbeat, and whether this process owns the torch.distributed
    group. It holds no reference to the runner, so a runner nobody references is collected
    and its finalizer (stop) releases all of it."""

    def __init__(self, heartbeat_s: float) -> None:
        self.workers: list[Any] = []
        self.control: Any = None
        self.owns_process_group = False
        self.is_broken = False
        """A collective failed: the ranks may be out of step, never talk to them again."""
        self.send_lock = threading.Lock()
        self.heartbeat_s = heartbeat_s
        self.last_send_s = time.monotonic()
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._num_threads = torch.get_num_threads()  # _setup_rank lowers it under CPU TP

    def spawn(self, main: Callable[..., None], rank: int, *args: Any) -> None:
        """Start rank `rank` as a fresh process running main(rank, *args)."""
        worker = mp.get_context("spawn").Process(
            target=main, name=f"pdserve-tp{rank}", daemon=True, args=(rank, *args))
        worker.start()
        self.workers.append(worker)

    def peers_alive(self) -> bool:
        return all(w.is_alive() for w in self.workers)

    def check_alive(self) -> None:
        dead = [w.name for w in self.workers if not w.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) {', '.join(dead)} died")

    def send(self, payload: bytes) -> None:
        with self.send_lock:
            self.send_locked(payload)

    def send_locked(self, payload: bytes) -> None:
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0,
                       group=self.control)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0,
                       group=self.control)
        self.last_send_s = time.monotonic()

    def start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._heartbeat_loop,
                                           name="pdserve-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop_heartbeat.wait(self.heartbeat_s / 2):
            if time.monotonic() - self.last_send_s < self.heartbeat_s:
                continue
            try:
                self.send(TP_PROTOCOL.encode(Ping()))
            except Exception:  # a dead worker: execute() reports it
                logger.exception("TP heartbeat failed")
                return

    def stop(self, send_stop: bool) -> None:
        """Stop the workers (stop message, join, terminate) and leave the process group.
        Safe to call more than once."""
        self._stop_heartbeat.set()
        # The garbage collector may run a finalizer on any thread, the heartbeat's included:
        # that thread cannot join itself, and may be between a message's two broadcasts.
        on_heartbeat = threading.current_thread() is self._heartbeat
        if self._heartbeat is not None and not on_heartbeat:
            self._heartbeat.join(timeout=JOIN_TIMEOUT_S)
        graceful = (send_stop and not on_heartbeat and not self.is_broken
                    and bool(self.workers) and self.peers_alive())
        if graceful:
            try:
                self.send(TP_PROTOCOL.encode(Stop()))
            except Exception:
                logger.exception("could not send stop to TP workers")
                graceful = False
        for worker in self.workers:
            # Without a stop message a worker may sit in a wait that only a timeout ends.
            if graceful:
                worker.join(timeout=JOIN_TIMEOUT_S)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=JOIN_TIMEOUT_S)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=JOIN_TIMEOUT_S)  # SIGKILL cannot be ignored
        self.workers = []
        # Only the group this runner started: a TP=1 runner leaves the caller's alone.
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()  # every group: the default and the control group
        self.owns_process_group = False
        self.control = None
        torch.set_num_threads(self._num_threads)
