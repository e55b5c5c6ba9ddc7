"""The UCX data plane (ucxx core API): one worker, polling progress, endpoints from addresses.

Why this shape: endpoints made from an exchanged *worker address* (sent over the
ZeroMQ control channel) with error handling off are what let UCX pick shared memory / CMA on
one host; the listener path always runs over tcp. The core API's progress thread hung with
sm/cma, so the caller drives progress inside `wait`, with a timeout: by default in blocking
mode (epoll with a 1 ms cap), else by busy polling. UCX_TLS must be
set before ucxx is imported, so ucxx is imported here, lazily, on first use.

A UcxDataPlane is not thread-safe: its owner (the data service's UCX lock, or a client)
serialises calls. Before `connect` to an address a peer sent, a server asks a
UcxAddressProber (ucx_prober.py) whether UCX can parse it without aborting the process.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_SPIN_S = 200e-6  # poll this long before sleeping in epoll: short transfers finish spinning


class UcxUnavailable(RuntimeError):
    """UCX could not start (ucxx missing, no usable transport); use the TCP/ZeroMQ path."""


class UcxDataPlane:
    """A UCX worker that sends and receives tagged uint8 buffers."""

    def __init__(self, tls: str = "sm,cma,tcp,self", blocking: bool = True):
        # ucxx reads UCX_* at import; only the first data plane in a process sets them.
        os.environ.setdefault("UCX_TLS", tls)
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        try:
            import ucxx._lib.libucxx as ucx_api
            from ucxx._lib.arr import Array
        except Exception as e:  # ImportError, or a broken native library
            raise UcxUnavailable(f"cannot import ucxx: {e}") from e
        self._api = ucx_api
        self._array = Array
        try:
            features = (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP) if blocking else (
                ucx_api.Feature.TAG,)
            self._context = ucx_api.UCXContext(feature_flags=features)
            self._worker = ucx_api.UCXWorker(self._context)
            if blocking:
                self._worker.init_blocking_progress_mode()
            self.address = bytes(self._worker.address.tobytes())
        except Exception as e:
            raise UcxUnavailable(f"UCX context/worker failed: {e}") from e
        self._blocking = blocking
        self._endpoints: dict[int, Any] = {}
        self._next_endpoint_id = 0
        self.tls = os.environ["UCX_TLS"]

    def connect(self, peer_address: bytes) -> int:
        """An endpoint to the peer whose worker address we were sent; returns its handle."""
        address = self._api.UCXAddress.create_from_buffer(np.frombuffer(peer_address, np.uint8))
        endpoint = self._api.UCXEndpoint.create_from_worker_address(
            self._worker, address, endpoint_error_handling=False)
        handle = self._next_endpoint_id
        self._next_endpoint_id += 1
        self._endpoints[handle] = endpoint
        return handle

    def disconnect(self, handle: int) -> None:
        endpoint = self._endpoints.pop(handle, None)
        if endpoint is not None:
            try:
                endpoint.close()
            except Exception:  # a peer that already went away; nothing left to free
                logger.debug("ucx endpoint close failed", exc_info=True)

    def send(self, handle: int, buffer: np.ndarray, tag: int) -> Any:
        """Start sending a contiguous uint8 buffer; keep `buffer` alive until waited on."""
        return self._endpoints[handle].tag_send(self._array(buffer), tag=self._api.UCXXTag(tag))

    def recv(self, buffer: np.ndarray, tag: int) -> Any:
        """Start receiving a message with `tag` (from any peer) into a uint8 buffer."""
        return self._worker.tag_recv(self._array(buffer), tag=self._api.UCXXTag(tag))

    def cancel_in_flight(self) -> None:
        """Cancel every outstanding send and receive (after the peer gave up on them)."""
        self._worker.cancel_inflight_requests()

    def progress(self) -> None:
        self._worker.progress()

    def wait(self, requests: list[Any], timeout_s: float) -> None:
        """Drive progress until every request completes; TimeoutError (after cancelling the
        worker's in-flight requests) if they do not within timeout_s."""
        start_s = time.monotonic()
        deadline = start_s + timeout_s
        while not all(r.completed for r in requests):
            if self._blocking and time.monotonic() - start_s > _SPIN_S:
                # Then sleep in epoll (at most 1 ms) instead of spinning on: on a few shared
                # cores a spinning receiver starves the very sender it waits for.
                self._worker.progress_worker_event(1)
            else:
                self._worker.progress()
            if time.monotonic() > deadline:
                self.cancel_in_flight()
                raise TimeoutError(f"UCX transfer did not finish within {timeout_s} s")
        for r in requests:
            r.check_error()

    def close(self) -> None:
        for handle in list(self._endpoints):
            self.disconnect(handle)
