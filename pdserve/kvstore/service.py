"""What the store's socket loop (server.py) asks of a service behind one of its sockets.

Two services implement it: MasterService (master_service.py, the block index and node
membership) and DataService (data_service.py, the tiered store, leases and UCX clients). A
service maps each request TYPE of pdserve/protocol/store/ to a handler; a handler takes the
decoded request and the Peer it came from and returns an Answer: the typed reply, the payload
frames that follow it (get's blocks on the zmq path; usually none), and optionally work to do
once the reply is on its way (a UCX get's sends).

Handlers run concurrently. The types a service lists in `offloaded` (they may block on disk,
UCX or a child process) run on the server's worker threads; every other handler runs on the
socket loop itself and must stay cheap: a few dict operations under short locks. Each service
guards its own state with its own locks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import zmq

from pdserve.protocol.store.base import CheckReply, CheckRequest, StoreReply, StoreRequest


@dataclass(frozen=True)
class Peer:
    """Who sent a request, and what came with it."""

    identity: bytes
    """The client connection's ZeroMQ identity (a UCX client is known by it)."""
    payloads: list[zmq.Frame]
    """Frames after the header: put's blocks on the zmq path, else empty."""


class Answer(NamedTuple):
    reply: StoreReply
    frames: Sequence[Any] = ()
    """Payload frames sent after the reply (numpy arrays or ZeroMQ frames)."""
    after_reply: Callable[[], None] | None = None
    """Runs once the reply is handed to the socket loop (on the handler's thread)."""


Handler = Callable[[Any, Peer], Answer]


class StoreService(Protocol):
    name: str
    """Names the service in logs and errors ("master", "data")."""
    handlers: Mapping[type[StoreRequest], Handler]
    """The request types this service answers; any other is refused with an ErrorReply."""
    offloaded: frozenset[type[StoreRequest]]
    """Request types whose handlers may block (disk reads, big copies, UCX transfers, the
    address prober): they run on the server's worker threads, off the socket loop."""
    num_rejected: int
    """Malformed requests its socket received (the loop counts them; stats reports them)."""

    def tick(self) -> None:
        """Periodic work, each loop turn (expire leases or silent nodes)."""

    def check_integrity(self) -> None:
        """AssertionError naming the first invariant that does not hold."""

    def close(self) -> None: ...


def answer_check(request: CheckRequest, check_integrity: Callable[[], None]) -> Answer:
    """The reply to a `check`: what `check_integrity` found wrong, or None."""
    try:
        check_integrity()
    except AssertionError as e:
        return Answer(CheckReply(request.request_id, str(e)))
    return Answer(CheckReply(request.request_id, None))
