"""The router's side of one worker connection: a ZeroMQ DEALER socket, asyncio.

One background task reads every message the worker sends and routes it: outputs to the
queue of the request they belong to, status replies into `status`. A worker that misses
heartbeats for `heartbeat_timeout_s` is marked dead and every request it held gets an error
output, so no client waits forever on a crashed worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import NamedTuple

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from pdserve import security
from pdserve.protocol.codec import WireError
from pdserve.protocol.worker import (
    WORKER_PROTOCOL,
    AbortRequest,
    FollowPrefill,
    GenerateRequest,
    Output,
    SetRole,
    StatusRequest,
    StepSample,
    WorkerStatus,
)

logger = logging.getLogger(__name__)

RECEIVE_POLL_MS = 1000
RESERVATION_TTL_S = 10.0  # an admitted request is sent within this, or its slot frees


class WorkerDied(RuntimeError):
    """The worker stopped answering while a request was in flight."""


class WorkerLeft(WorkerDied):
    """The worker left its pool (the controller moved it) while a request was in flight:
    the request moves on as from a dead worker (pdserve/router/moves.py)."""


class Received(NamedTuple):
    """An Output and when the receive loop read it (time.monotonic seconds)."""

    output: Output
    received_s: float


class WorkerClient:
    def __init__(
        self,
        address: str,
        role: str,
        context: zmq.asyncio.Context,
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 30.0,
    ) -> None:
        self.address = address
        self.role = role  # what the router expects it to be: prefill | decode | colocated
        self.status: WorkerStatus | None = None
        self.status_received_s = 0.0
        """When `status` came (time.monotonic())."""
        self.last_seen_s = 0.0
        self.draining = False
        """Set while the controller moves this worker to the other role: no new requests."""
        self._step_samples: deque[StepSample] = deque(maxlen=1024)
        self._last_sample_seq = 0
        self._reservations: dict[str, float] = {}  # admitted, not yet sent: request -> time
        self._heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # The receive loop's bound: a recv with no message in this long raises zmq.Again
        # (a timer per recv; a poll before each recv cost as much as the recv itself)
        self._socket.setsockopt(zmq.RCVTIMEO, RECEIVE_POLL_MS)
        security.secure_client(self._socket)
        self._socket.connect(address)
        self._queues: dict[str, asyncio.Queue[Received | BaseException]] = {}
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_loop()),
                       asyncio.create_task(self._heartbeat_loop()),
                       asyncio.create_task(self._monitor_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self._socket.close(linger=0)

    @property
    def is_alive(self) -> bool:
        return (self.status is not None
                and time.monotonic() - self.last_seen_s < self._heartbeat_timeout_s)

    @property
    def is_ready(self) -> bool:
        return self.is_alive and self.status is not None and self.status.is_ready

    @property
    def accepting(self) -> bool:
        """Ready, and may be given new requests."""
        return self.is_ready and not self.draining

    @property
    def worker_id(self) -> str:
        return self.status.worker_id if self.status else self.address

    @property
    def num_inflight(self) -> int:
        """Requests sent to this worker and not finished, plus those admitted to it and about
        to be sent (so a burst of admissions sees each other)."""
        if self._reservations:
            stale = time.monotonic() - RESERVATION_TTL_S
            for request_id in [r for r, t in self._reservations.items() if t < stale]:
                del self._reservations[request_id]  # admitted but never sent (client left)
        return len(self._queues) + len(self._reservations)

    def reserve(self, request_id: str) -> None:
        """Count an admitted request against this worker until generate() sends it."""
        self._reservations[request_id] = time.monotonic()

    async def generate(self, request: GenerateRequest
                       ) -> asyncio.Queue[Received | BaseException]:
        """Send a request; its outputs (or a WorkerDied) arrive on the returned queue."""
        queue: asyncio.Queue[Received | BaseException] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._reservations.pop(request.request_id, None)
        await self._socket.send(WORKER_PROTOCOL.encode(request))
        return queue

    async def follow(self, message: FollowPrefill) -> None:
        """Tell a decode worker to follow a prefill on its host (no reply: the hand-off or an
        abort for the same request id comes next)."""
        with contextlib.suppress(zmq.ZMQError):
            await self._socket.send(WORKER_PROTOCOL.encode(message))

    def finish(self, request_id: str) -> None:
        """Forget a request (after its last output, an abort or an error)."""
        self._queues.pop(request_id, None)
        self._reservations.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self.finish(request_id)
        with contextlib.suppress(zmq.ZMQError):
            await self._socket.send(WORKER_PROTOCOL.encode(AbortRequest(request_id)))

    async def hand_over_inflight(self) -> int:
        """Give up every request in flight here: each one's stream gets WorkerLeft (its
        dispatcher resumes it on another worker of the pool) and the worker is told to abort
        it. Returns how many there were."""
        request_ids = list(self._queues)
        for request_id in request_ids:
            self._queues[request_id].put_nowait(
                WorkerLeft(f"worker {self.address} ({self.role}) left its pool"))
            await self.abort(request_id)
        return len(request_ids)

    async def set_role(self, role: str) -> None:
        """Ask the (drained) worker to switch roles; its next status says if it did."""
        with contextlib.suppress(zmq.ZMQError):
            await self._socket.send(WORKER_PROTOCOL.encode(SetRole(role)))

    def take_step_samples(self) -> list[StepSample]:
        """The step samples reported since the last call (each once)."""
        samples = list(self._step_samples)
        self._step_samples.clear()
        return samples

    def _on_status(self, status: WorkerStatus) -> None:
        if status.step_samples and status.step_samples[-1].seq < self._last_sample_seq:
            self._last_sample_seq = 0  # a restarted worker numbers its samples afresh
        self.status = status
        self.status_received_s = time.monotonic()
        for sample in status.step_samples:
            if sample.seq > self._last_sample_seq:
                self._step_samples.append(sample)
                self._last_sample_seq = sample.seq

    async def _receive_loop(self) -> None:
        while True:
            # A silent worker is caught by the heartbeat and disconnect monitors; this loop
            # only wakes each second (RCVTIMEO) to stay cancellable without a pending recv.
            try:
                raw = await self._socket.recv()
            except zmq.Again:
                continue
            try:
                message = WORKER_PROTOCOL.decode(raw)
            except WireError as exc:
                logger.warning("dropped a malformed message from %s: %s", self.address, exc)
                continue
            self.last_seen_s = time.monotonic()
            if isinstance(message, WorkerStatus):
                self._on_status(message)
            elif isinstance(message, Output):
                queue = self._queues.get(message.request_id)
                if queue is not None:  # else: aborted already; late outputs are dropped
                    queue.put_nowait(Received(message, self.last_seen_s))
            else:
                logger.warning("unexpected %s from %s", type(message).__name__, self.address)

    async def _heartbeat_loop(self) -> None:
        was_alive = False
        while True:
            with contextlib.suppress(zmq.ZMQError):
                await self._socket.send(WORKER_PROTOCOL.encode(StatusRequest()))
            await asyncio.sleep(self._heartbeat_interval_s)
            alive = self.is_alive
            if was_alive and not alive:
                logger.error("worker %s (%s) stopped answering", self.address, self.role)
                self._fail_inflight()
            elif alive and not was_alive:
                logger.info("worker %s (%s) is up", self.address, self.role)
            was_alive = alive

    async def _monitor_loop(self) -> None:
        """A dropped connection means a dead (or restarted) worker: fail its requests now
        rather than after the heartbeat timeout, which is for workers that hang."""
        monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = await recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED and self.status is not None:
                    logger.error("worker %s (%s) disconnected", self.address, self.role)
                    self.status = None
                    self._fail_inflight()
        finally:
            monitor.close(linger=0)

    def _fail_inflight(self) -> None:
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(WorkerDied(f"worker {self.address} ({self.role}) died"))
            self.finish(request_id)
