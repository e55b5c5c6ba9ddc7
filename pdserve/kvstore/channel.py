"""A request/reply channel to one store socket: a ZeroMQ DEALER with ids and timeouts.

DEALER rather than REQ: a REQ socket is stuck forever after one lost reply, while here a timed
out request simply raises, and its late reply is recognised by its request id and dropped.
Requests and replies are the typed messages of pdserve/protocol/store/: the caller names the
request type and the reply type it expects, and gets that reply or an exception.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq

from pdserve import security
from pdserve.protocol.codec import WireError
from pdserve.protocol.store.base import (
    STORE_PROTOCOL,
    ErrorReply,
    StoreReply,
    StoreRequest,
    decode_store_message,
)

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=StoreReply)


class StoreUnavailable(TimeoutError):
    """The store did not answer in time (the KV cache treats this as a miss)."""


class StoreRequestError(RuntimeError):
    """The store answered with an error (or with a reply of the wrong type)."""


class ControlChannel:
    """Thread-safe: one request in flight at a time."""

    def __init__(self, ctx: zmq.Context, address: str, timeout_s: float):
        self.address = address
        self.timeout_s = timeout_s
        self._socket = ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        security.secure_client(self._socket)
        self._socket.connect(address)
        self._ids = itertools.count(1)
        self.lock = threading.Lock()  # also held by callers around a request + its UCX transfer

    def request(self, request_type: type[StoreRequest], reply_type: type[R], **fields: Any) -> R:
        """Send `request_type(request_id, **fields)` and wait for its reply of `reply_type`."""
        with self.lock:
            reply, _ = self.request_locked(request_type, reply_type, **fields)
            return reply

    def request_locked(self, request_type: type[StoreRequest], reply_type: type[R],
                       frames: Sequence[Any] = (), progress: Callable[[], None] | None = None,
                       **fields: Any) -> tuple[R, list[zmq.Frame]]:
        """request() for a caller holding self.lock, with payload `frames` after the header;
        returns the reply and the payload frames after it. `progress` runs while waiting (a
        UCX rendezvous send only completes while the sender's worker makes progress)."""
        request_id = next(self._ids)
        # Building the request checks its fields: a client bug raises here, at its source.
        header = STORE_PROTOCOL.encode(request_type(request_id=request_id, **fields))
        verb = request_type.TAG  # type: ignore[attr-defined]
        self._socket.send_multipart([header, *frames], copy=False)
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if progress is not None and remaining_ms > 0:
                progress()
                if not self._socket.poll(min(1, remaining_ms), zmq.POLLIN):
                    continue  # 1 ms slices: progress often enough, without spinning a core
            elif remaining_ms <= 0 or not self._socket.poll(remaining_ms, zmq.POLLIN):
                raise StoreUnavailable(
                    f"{verb} to {self.address}: no reply within {self.timeout_s} s")
            reply_frames = self._socket.recv_multipart(copy=False)
            try:
                reply = decode_store_message(reply_frames[0].bytes)
            except WireError as e:
                logger.warning("dropping a malformed reply from %s: %s", self.address, e)
                continue
            if not isinstance(reply, StoreReply):
                logger.warning("dropping a %s from %s: not a reply", type(reply).__name__,
                               self.address)
                continue
            if reply.request_id != request_id:
                if reply.request_id == 0 and isinstance(reply, ErrorReply):
                    raise StoreRequestError(reply.error)  # it could not decode our request
                continue  # a late reply to a request that already timed out
            if isinstance(reply, ErrorReply):
                raise StoreRequestError(f"{verb}: {reply.error}")
            if not isinstance(reply, reply_type):
                raise StoreRequestError(f"{verb}: expected a {reply_type.__name__}, got a "
                                        f"{type(reply).__name__}")
            return reply, reply_frames[1:]

    def close(self) -> None:
        self._socket.close(linger=0)
