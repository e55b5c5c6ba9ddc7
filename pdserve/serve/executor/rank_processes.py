"""The other ranks as rank 0 sees them: processes, control channel, heartbeat; and a node's
ranks as the node k > 0 agent sees them.

    rank 0 (this process)                       ranks 1..N-1 (spawned here, or on node k by
                                                 `model_runner.serve_node`)
    RankProcesses.send(payload) ──broadcast──► receive: length (int64), then the bytes
    heartbeat thread: Ping when idle ────────► (keeps their receive inside its timeout)
    stop(): Stop message, join, terminate ───► leave the loop, destroy the process group

A local rank that dies is seen through its process handle; a rank on another node only
through the control group: the heartbeat's broadcast (or a step's collective) fails, and
`describe_lost` (the rendezvous's liveness counters, pdserve/serve/layers/distributed.py) names
the rank and
its node in the error the engine raises.
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
        self.describe_lost: Callable[[bool], str | None] | None = None
        """describe_lost(after_failure): names the ranks (and nodes) that are gone, or None;
        set once the group is up."""
        self.has_remote_ranks = False
        """Some ranks run on other nodes: no process handle shows their death, so the
        heartbeat also watches their liveness beats."""
        self.failure: str | None = None
        """Why the ranks cannot be used any more (the heartbeat found one gone)."""

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
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def _look_for_lost(self) -> str | None:
        if self.describe_lost is None or not self.has_remote_ranks:
            return None
        try:
            return self.describe_lost(False)
        except Exception:  # the store failing says nothing about the ranks
            logger.debug("could not read the ranks' liveness", exc_info=True)
            return None

    def explain(self, exc: BaseException) -> RuntimeError | None:
        """After a failed collective: an error naming the lost ranks, or None when no rank
        is known to be gone (the failure was something else)."""
        dead = [w.name for w in self.workers if not w.is_alive()]
        lost = None
        if self.describe_lost is not None:
            try:
                lost = self.describe_lost(True)
            except Exception:  # the store itself failing says nothing about the ranks
                logger.debug("could not read the ranks' liveness", exc_info=True)
        if lost is None and not dead:
            return None
        what = lost or f"tensor-parallel worker(s) {', '.join(dead)} died"
        self.failure = f"{what} ({type(exc).__name__}: {exc})".strip()
        return RuntimeError(self.failure)

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
            # A broadcast only sends: to a rank whose host vanished it may still "succeed".
            # The ranks' liveness beats say for sure, before anything is sent to them.
            lost = self._look_for_lost()
            if lost is not None:
                self.failure = lost
                logger.error("TP heartbeat: %s", lost)
                return
            if time.monotonic() - self.last_send_s < self.heartbeat_s:
                continue
            try:
                self.send(TP_PROTOCOL.encode(Ping()))
            except Exception as exc:  # a dead rank: the next execute() reports it
                error = self.explain(exc)
                if error is None:
                    self.failure = f"the heartbeat to the other ranks failed: {exc}"
                logger.error("TP heartbeat failed: %s", self.failure)
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
        # Ranks on other nodes have no handle here: the control group is what reaches them.
        graceful = (send_stop and not on_heartbeat and not self.is_broken
                    and self.failure is None and self.control is not None
                    and self.peers_alive())
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


def wait_node_ranks(procs: RankProcesses, stop: threading.Event, poll_s: float = 0.2) -> int:
    """Node k > 0: wait on this node's ranks (spawned into `procs`) until they leave (rank 0
    sent Stop: 0), one fails (it lost rank 0, or could not join: 1, the others stopped) or
    `stop` is set (a signal: 0, the ranks stopped)."""
    while not stop.wait(poll_s):
        codes = [w.exitcode for w in procs.workers]
        if all(code == 0 for code in codes):
            procs.workers = []
            return 0
        failed = [(w.name, code) for w, code in zip(procs.workers, codes, strict=True)
                  if code not in (None, 0)]
        if failed:
            logger.error("rank process(es) %s exited with %s: stopping this node",
                         ", ".join(name for name, _ in failed),
                         ", ".join(str(code) for _, code in failed))
            procs.stop(send_stop=False)
            return 1
    procs.stop(send_stop=False)
    return 0
