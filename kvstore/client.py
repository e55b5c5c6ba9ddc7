"""The store client: batch verbs against one data server (and optionally the master).

KV bytes move over UCX when both sides have it (tags `client_no << 32 | seq`, so concurrent
clients of one server never match each other's messages), else as ZeroMQ frames; a client
that asked for UCX and could not get it logs a WARNING naming the fallback. Every call waits
at most `timeout_s` and raises StoreUnavailable past it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import zmq

from pdserve.kvstore.channel import ControlChannel, StoreRequestError
from pdserve.kvstore.master import PrefixLookup
from pdserve.kvstore.memory_tier import BytesLike, as_uint8_tensor
from pdserve.kvstore.ucx_transport import UcxDataPlane, UcxUnavailable

logger = logging.getLogger(__name__)

_SEQ_MASK = (1 << 32) - 1


class StoreClient:
    def __init__(self, data_address: str | None, master_address: str | None = None,
                 transport: str = "ucx", ucx_tls: str = "sm,cma,tcp,self",
                 timeout_s: float = 10.0, holder: str | None = None,
                 max_keys_per_request: int = 1024):
        if data_address is None and master_address is None:
            raise ValueError("a StoreClient needs a data or a master address")
        self._ctx = zmq.Context()
        self.timeout_s = timeout_s
        # Larger batches are split (the server refuses more than its max_keys_per_message).
        self.max_keys_per_request = max_keys_per_request
        self.holder = holder or f"client-{os.getpid()}-{id(self):x}"
        self._data = None if data_address is None else ControlChannel(
            self._ctx, data_address, timeout_s)
        self._master = None if master_address is None else ControlChannel(
            self._ctx, master_address, timeout_s)
        self._ucx: UcxDataPlane | None = None
        self._endpoint = 0  # handle of our UCX endpoint to the server, once connected
        self._client_no = 0
        self._seq = 0
        if transport == "ucx" and self._data is not None:
            self._start_ucx(ucx_tls)
        self.transport = "ucx" if self._ucx is not None else "zmq"

    def _start_ucx(self, ucx_tls: str) -> None:
        assert self._data is not None
        try:
            ucx = UcxDataPlane(ucx_tls)
        except UcxUnavailable as e:
            logger.warning("store client: UCX cannot start (%s); KV bytes go over ZeroMQ/TCP", e)
            return
        try:
            reply, _ = self._data.request("hello", ucx_address=ucx.address)
        except StoreRequestError as e:
            logger.warning("store client: the server refused UCX (%s); KV bytes go over "
                           "ZeroMQ/TCP", e)
            ucx.close()
            return
        address = reply.get("ucx_address")
        if not isinstance(address, bytes):
            logger.warning("store client: the server at %s has no UCX; KV bytes go over "
                           "ZeroMQ/TCP", self._data.address)
            ucx.close()
            return
        self._endpoint = ucx.connect(address)
        self._client_no = int(reply["client_no"])
        self._ucx = ucx

    def _next_tag(self, num_blocks: int) -> int:
        self._seq = (self._seq + num_blocks + 1) & _SEQ_MASK
        if self._seq + num_blocks > _SEQ_MASK:
            self._seq = 0
        return (self._client_no << 32) | self._seq

    def _data_channel(self) -> ControlChannel:
        if self._data is None:
            raise ValueError("this client has no data server address")
        return self._data

    # ---- data verbs -------------------------------------------------------------------------
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[BytesLike]) -> list[bool]:
        """Store blocks; one bool per key (False: the server had no room)."""
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        if len(keys) > self.max_keys_per_request:
            step = self.max_keys_per_request
            return [ok for i in range(0, len(keys), step)
                    for ok in self.put_many(keys[i:i + step], blocks[i:i + step])]
        channel = self._data_channel()
        arrays = [as_uint8_tensor(b).numpy() for b in blocks]
        sizes = [a.nbytes for a in arrays]
        with channel.lock:
            if self._ucx is None:
                reply, _ = channel.request_locked("put", arrays, keys=list(keys), sizes=sizes,
                                                  ucx_tag=None)
            else:
                tag = self._next_tag(len(keys))
                sends = [self._ucx.send(self._endpoint, a, tag + i) for i, a in enumerate(arrays)]
                try:
                    reply, _ = channel.request_locked("put", keys=list(keys), sizes=sizes,
                                                      ucx_tag=tag, progress=self._ucx.progress)
                except Exception:
                    self._ucx.cancel_in_flight()  # the server will not take these blocks
                    raise
                self._ucx.wait(sends, self.timeout_s)
        return _bools(reply, "stored", len(keys))

    def get_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """The blocks (uint8 arrays), None for each block the store does not have."""
        if len(keys) > self.max_keys_per_request:
            step = self.max_keys_per_request
            return [b for i in range(0, len(keys), step)
                    for b in self.get_many(keys[i:i + step])]
        channel = self._data_channel()
        with channel.lock:
            if self._ucx is None:
                reply, frames = channel.request_locked("get", keys=list(keys), ucx_tag=None)
                payloads = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]
            else:
                tag = self._next_tag(len(keys))
                reply, frames = channel.request_locked("get", keys=list(keys), ucx_tag=tag)
                found, sizes = _bools(reply, "found", len(keys)), reply.get("sizes")
                if not isinstance(sizes, list) or len(sizes) != len(keys) or not all(
                        isinstance(s, int) and 0 <= s <= (1 << 40) for s in sizes):
                    raise ValueError("get: bad sizes in reply")
                payloads = [np.empty(s, np.uint8) for s, ok in zip(sizes, found, strict=True)
                            if ok]
                self._ucx.wait([self._ucx.recv(p, tag + i) for i, p in enumerate(payloads)],
                               self.timeout_s)
        found = _bools(reply, "found", len(keys))
        if sum(found) != len(payloads):
            raise ValueError("get: the server sent a different number of blocks than found")
        it = iter(payloads)
        return [next(it) if ok else None for ok in found]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        reply, _ = self._data_channel().request("exists", keys=list(keys))
        return _bools(reply, "found", len(keys))

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixLookup:
        """Leading blocks cached anywhere (asks the master when this client knows one)."""
        channel = self._master if self._master is not None else self._data_channel()
        reply, _ = channel.request("lookup_prefix", keys=list(keys))
        num_blocks = reply.get("num_blocks")
        if not isinstance(num_blocks, int) or not 0 <= num_blocks <= len(keys):
            raise ValueError("lookup_prefix: bad num_blocks in reply")
        holders = [[(str(n), str(t)) for n, t in hs] for hs in reply.get("holders", [])]
        return PrefixLookup(num_blocks, holders)

    def pin(self, keys: Sequence[bytes], ttl_s: float) -> tuple[int, list[bool]]:
        """Pin present blocks under a lease: (lease_id, pinned per key)."""
        reply, _ = self._data_channel().request("pin", keys=list(keys), holder=self.holder,
                                                ttl_s=float(ttl_s))
        return int(reply["lease_id"]), _bools(reply, "pinned", len(keys))

    def renew(self, lease_id: int, ttl_s: float) -> bool:
        reply, _ = self._data_channel().request("renew", lease_id=lease_id, ttl_s=float(ttl_s))
        return reply.get("known") is True

    def release(self, lease_id: int) -> bool:
        reply, _ = self._data_channel().request("release", lease_id=lease_id)
        return reply.get("known") is True

    def evict(self, keys: Sequence[bytes]) -> int:
        reply, _ = self._data_channel().request("evict", keys=list(keys))
        return int(reply["num_evicted"])

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Bring blocks up to the server's DRAM ahead of a load."""
        reply, _ = self._data_channel().request("prefetch", keys=list(keys))
        return int(reply["num_moved"])

    def stats(self) -> dict[str, int]:
        channel = self._data if self._data is not None else self._master
        assert channel is not None
        reply, _ = channel.request("stats")
        return dict(reply["stats"])

    def check_integrity(self) -> None:
        """AssertionError with the server's description if its invariants do not hold."""
        for channel in (self._data, self._master):
            if channel is not None:
                reply, _ = channel.request("check")
                if reply.get("problem") is not None:
                    raise AssertionError(f"{channel.address}: {reply['problem']}")

    def nodes(self) -> dict[str, str]:
        if self._master is None:
            raise ValueError("this client has no master address")
        reply, _ = self._master.request("nodes")
        return dict(reply["nodes"])

    def close(self) -> None:
        if self._ucx is not None and self._data is not None:
            try:
                self._data.request("bye")
            except Exception:  # the server may be gone already; nothing to free there then
                logger.debug("store client: bye failed", exc_info=True)
            self._ucx.close()
            self._ucx = None
        for channel in (self._data, self._master):
            if channel is not None:
                channel.close()
        self._ctx.term()


def _bools(reply: dict, name: str, n: int) -> list[bool]:
    value = reply.get(name)
    if not isinstance(value, list) or len(value) != n or not all(
            isinstance(v, bool) for v in value):
        raise ValueError(f"reply field {name!r} is not {n} bools")
    return value

