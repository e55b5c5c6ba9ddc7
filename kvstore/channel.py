"""A request/reply channel to one store socket: a ZeroMQ DEALER with ids and timeouts.

DEALER rather than REQ: a REQ socket is stuck forever after one lost reply, while here a timed
out request simply raises, and its late reply is recognised by its request id and dropped.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from pdserve.kvstore import messages

logger = logging.getLogger(__name__)


class StoreUnavailable(TimeoutError):
    """The store did not answer in time (the KV cache treats this as a miss)."""


class StoreRequestError(RuntimeError):
    """The store answered with an error."""


class ControlChannel:
    """Thread-safe: one request in flight at a time."""

    def __init__(self, ctx: zmq.Context, address: str, timeout_s: float):
        self.address = address
        self.timeout_s = timeout_s
        self._socket = ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._ids = itertools.count(1)
        self.lock = threading.Lock()  # also held by callers around a request + its UCX transfer

    def request(self, type_: str, frames: Sequence[Any] = (), **fields: Any
                ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Send one request and wait for its reply: (reply fields, payload frames)."""
        with self.lock:
            return self.request_locked(type_, frames, **fields)

    def request_locked(self, type_: str, frames: Sequence[Any] = (),
                       progress: Callable[[], None] | None = None, **fields: Any
                       ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """request() for a caller holding self.lock; `progress` runs while waiting (a UCX
        rendezvous send only completes while the sender's worker makes progress)."""
        request_id = next(self._ids)
        header = messages.encode(type_, request_id, **fields)
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
                    f"{type_} to {self.address}: no reply within {self.timeout_s} s")
            reply_frames = self._socket.recv_multipart(copy=False)
            try:
                reply = messages.decode_reply(reply_frames[0].bytes)
            except messages.MessageError as e:
                logger.warning("dropping a malformed reply from %s: %s", self.address, e)
                continue
            if reply.request_id != request_id:
                if reply.request_id == 0 and not reply.fields["ok"]:
                    raise StoreRequestError(str(reply.fields.get("error")))
                continue  # a late reply to a request that already timed out
            if not reply.fields["ok"]:
                raise StoreRequestError(f"{type_}: {reply.fields.get('error')}")
            return reply.fields, reply_frames[1:]

    def close(self) -> None:
        self._socket.close(linger=0)
