"""The store client: batch verbs against one data server (and optionally the master).

Each verb sends one typed request of pdserve/protocol/store/ and reads its typed reply (a
refusal raises StoreRequestError). KV bytes move over UCX when both sides have it (tags
`client_no << 32 | seq`, so concurrent clients of one server never match each other's
messages), else as ZeroMQ frames; a client that asked for UCX and could not get it logs a
WARNING naming the fallback. A client on the data server's host reads the blocks that lie in
the server's shared memory segment (a hand-off node's staged prompts) straight out of it, in
one copy (pdserve/kvstore/shm_segment.py), when the server offers it at hello. Every call waits at
most `timeout_s` and raises StoreUnavailable past it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import zmq

from pdserve.kvstore.channel import ControlChannel, StoreRequestError, StoreUnavailable
from pdserve.kvstore.master import PrefixLookup
from pdserve.kvstore.shm_segment import ShmReader, host_identity
from pdserve.kvstore.ucx_transport import UcxDataPlane, UcxUnavailable
from pdserve.protocol.store.base import (
    CheckReply,
    CheckRequest,
    LookupPrefixReply,
    LookupPrefixRequest,
    StatsReply,
    StatsRequest,
)
from pdserve.protocol.store.data import (
    ByeReply,
    ByeRequest,
    EvictReply,
    EvictRequest,
    ExistsReply,
    ExistsRequest,
    GetLayersReply,
    GetLayersRequest,
    GetReply,
    GetRequest,
    HelloReply,
    HelloRequest,
    PinReply,
    PinRequest,
    PrefetchReply,
    PrefetchRequest,
    PutReply,
    PutRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
)
from pdserve.protocol.store.master import NodesReply, NodesRequest

if TYPE_CHECKING:  # torch: a router's store lookups never import it
    from pdserve.kvstore.memory_tier import BytesLike

logger = logging.getLogger(__name__)

BYE_TIMEOUT_S = 1.0  # the goodbye's wait at close (the server frees our UCX state)

_SEQ_MASK = (1 << 32) - 1


class StoreClient:
    def __init__(self, data_address: str | None, master_address: str | None = None,
                 transport: str = "ucx", ucx_tls: str = "sm,cma,tcp,self",
                 timeout_s: float = 10.0, holder: str | None = None,
                 max_keys_per_request: int = 1024, shm: bool = True):
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
        self._shm: ShmReader | None = None
        # over ZeroMQ nothing is sent before the first verb: the hello that may open the
        # shared memory path then waits for the first get
        self._hello_pending = transport != "ucx" and shm and self._data is not None
        if transport == "ucx" and self._data is not None:
            self._hello(True, ucx_tls, shm)
        self._name_transport()

    def _name_transport(self) -> None:
        self.transport = ("shm+" if self._shm is not None else "") + (
            "ucx" if self._ucx is not None else "zmq")

    def _hello(self, use_ucx: bool, ucx_tls: str, shm: bool) -> None:
        """Open the data paths the server and this client both have: UCX, and the server's
        shared memory segment when it has one on this host."""
        assert self._data is not None
        ucx = None
        if use_ucx:
            try:
                ucx = UcxDataPlane(ucx_tls)
            except UcxUnavailable as e:
                logger.warning("store client: UCX cannot start (%s); KV bytes go over "
                               "ZeroMQ/TCP", e)
        shm_host = host_identity() if shm else ""
        if ucx is None and not shm_host:
            return
        try:
            reply = self._data.request(HelloRequest, HelloReply, shm_host=shm_host,
                                       ucx_address=None if ucx is None else ucx.address)
        except StoreRequestError as e:
            logger.warning("store client: the server refused the hello (%s); KV bytes go "
                           "over ZeroMQ/TCP", e)
            if ucx is not None:
                ucx.close()
            return
        if reply.shm is not None:
            try:
                self._shm = ShmReader(reply.shm)
            except OSError as e:
                logger.info("store client: cannot map the shared memory of %s (%s); its "
                            "blocks come over %s", self._data.address, e,
                            "UCX" if ucx is not None else "ZeroMQ")
        if ucx is None:
            return
        if reply.ucx_address is None:
            logger.warning("store client: the server at %s has no UCX; KV bytes go over "
                           "ZeroMQ/TCP", self._data.address)
            ucx.close()
            return
        self._endpoint = ucx.connect(reply.ucx_address)
        self._client_no = reply.client_no
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
        from pdserve.kvstore.memory_tier import as_uint8_tensor

        arrays = [as_uint8_tensor(b).numpy() for b in blocks]
        sizes = [a.nbytes for a in arrays]
        with channel.lock:
            if self._ucx is None:
                reply, _ = channel.request_locked(PutRequest, PutReply, arrays, keys=list(keys),
                                                  sizes=sizes, ucx_tag=None)
            else:
                tag = self._next_tag(len(keys))
                sends = [self._ucx.send(self._endpoint, a, tag + i) for i, a in enumerate(arrays)]
                try:
                    reply, _ = channel.request_locked(
                        PutRequest, PutReply, progress=self._ucx.progress, keys=list(keys),
                        sizes=sizes, ucx_tag=tag)
                except Exception:
                    self._ucx.cancel_in_flight()  # the server will not take these blocks
                    raise
                self._ucx.wait(sends, self.timeout_s)
        return _one_per_key(reply.stored, "stored", len(keys))

    def get_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """The blocks (uint8 arrays), None for each block the store does not have."""
        if len(keys) > self.max_keys_per_request:
            step = self.max_keys_per_request
            return [b for i in range(0, len(keys), step)
                    for b in self.get_many(keys[i:i + step])]
        channel = self._data_channel()
        self._hello_once()
        shm = self._shm is not None
        with channel.lock:
            if self._ucx is None:
                reply, frames = channel.request_locked(GetRequest, GetReply, keys=list(keys),
                                                       ucx_tag=None, shm=shm)
                found = _one_per_key(reply.found, "found", len(keys))
                payloads = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]
            else:
                tag = self._next_tag(len(keys))
                reply, _ = channel.request_locked(GetRequest, GetReply, keys=list(keys),
                                                  ucx_tag=tag, shm=shm)
                found = _one_per_key(reply.found, "found", len(keys))
            if reply.shm_spans:
                return self._copy_shm(reply, found)
            if self._ucx is not None:
                # One buffer for every found block (GetReply bounds each size, so a server
                # cannot make us allocate wildly), each message landing in its run's slice:
                # the blocks come back to back, as a decode worker stacks them anyway.
                received, payloads = _landing(reply.sizes, found)
                runs = reply.runs or [1] * len(payloads)
                bounds = np.cumsum([0, *runs]).tolist()
                offsets = np.cumsum([0, *(p.nbytes for p in payloads)]).tolist()
                self._ucx.wait([self._ucx.recv(received[offsets[bounds[j]]:
                                                        offsets[bounds[j + 1]]], tag + j)
                                for j in range(len(runs))], self.timeout_s)
        if sum(found) != len(payloads):
            raise ValueError("get: the server sent a different number of blocks than found")
        it = iter(payloads)
        return [next(it) if ok else None for ok in found]

    def _hello_once(self) -> None:
        """A client that said no hello at start (it reads a segment where it can) says it
        before its first read."""
        if self._hello_pending:
            self._hello_pending = False
            try:
                self._hello(False, "", True)
            except StoreUnavailable:  # the read that follows says so
                pass
            self._name_transport()

    def get_layers(self, staging_id: int, keys: Sequence[bytes], first_block: int,
                   first_layer: int, num_layers: int, layer_bytes: int, wait_s: float
                   ) -> tuple[int, np.ndarray | None, bool]:
        """Layers `first_layer` on of blocks `keys` of a prompt the node's worker is staging
        now (GetLayersRequest): (how many layers came, their bytes [len(keys), layers,
        layer_bytes] flat, whether the staging is gone). (0, None, False): none was staged
        within `wait_s`."""
        channel = self._data_channel()
        self._hello_once()
        fields = dict(staging_id=staging_id, keys=list(keys), first_block=first_block,
                      first_layer=first_layer, num_layers=num_layers, wait_s=wait_s)
        with channel.lock:
            tag = None if self._ucx is None else self._next_tag(1)
            reply, frames = channel.request_locked(GetLayersRequest, GetLayersReply,
                                                   ucx_tag=tag, **fields)
            if not reply.num_layers:
                return 0, None, reply.gone
            nbytes = len(keys) * reply.num_layers * layer_bytes
            if reply.num_layers > num_layers - first_layer or reply.nbytes != nbytes:
                raise ValueError("get_layers: the server sent other layers than asked for")
            if self._ucx is None:
                if len(frames) != 1 or len(frames[0].buffer) != nbytes:
                    raise ValueError("get_layers: one payload frame of the stated size")
                return reply.num_layers, np.frombuffer(frames[0].buffer, np.uint8), False
            payload = np.empty(nbytes, dtype=np.uint8)
            self._ucx.wait([self._ucx.recv(payload, tag)], self.timeout_s)
        return reply.num_layers, payload, False

    def _copy_shm(self, reply: GetReply, found: list[bool]) -> list[np.ndarray | None]:
        """The found blocks, copied out of the server's segment where its reply says they
        lie; a block freed before the copy ended is None (not found)."""
        if self._shm is None:
            raise ValueError("get: shm spans in the reply of a client that maps no segment")
        received, payloads = _landing(reply.sizes, found)
        intact = self._shm.copy(reply.shm_spans, [p.nbytes for p in payloads], received)
        blocks = iter(zip(payloads, intact, strict=True))
        result: list[np.ndarray | None] = []
        for ok in found:
            block, whole = next(blocks) if ok else (None, False)
            result.append(block if whole else None)
        return result

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        reply = self._data_channel().request(ExistsRequest, ExistsReply, keys=list(keys))
        return _one_per_key(reply.found, "found", len(keys))

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixLookup:
        """Leading blocks cached: anywhere in the fleet when this client knows the master,
        else on its data server."""
        channel = self._master if self._master is not None else self._data_channel()
        reply = channel.request(LookupPrefixRequest, LookupPrefixReply, keys=list(keys))
        if reply.num_blocks > len(keys):
            raise ValueError("lookup_prefix: more blocks found than asked for")
        holders = [[(h.node_id, h.tier) for h in hs] for hs in reply.holders]
        return PrefixLookup(reply.num_blocks, holders, dict(reply.addresses))

    def pin(self, keys: Sequence[bytes], ttl_s: float) -> tuple[int, list[bool]]:
        """Pin present blocks under a lease: (lease_id, pinned per key)."""
        reply = self._data_channel().request(PinRequest, PinReply, keys=list(keys),
                                             holder=self.holder, ttl_s=float(ttl_s))
        return reply.lease_id, _one_per_key(reply.pinned, "pinned", len(keys))

    def renew(self, lease_id: int, ttl_s: float) -> bool:
        reply = self._data_channel().request(RenewRequest, RenewReply, lease_id=lease_id,
                                             ttl_s=float(ttl_s))
        return reply.known

    def release(self, lease_id: int) -> bool:
        reply = self._data_channel().request(ReleaseRequest, ReleaseReply, lease_id=lease_id)
        return reply.known

    def evict(self, keys: Sequence[bytes]) -> int:
        reply = self._data_channel().request(EvictRequest, EvictReply, keys=list(keys))
        return reply.num_evicted

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Bring blocks up to the server's DRAM ahead of a load."""
        reply = self._data_channel().request(PrefetchRequest, PrefetchReply, keys=list(keys))
        return reply.num_moved

    def stats(self) -> dict[str, int]:
        """The data server's counters (the master's when this client knows no data server)."""
        channel = self._data if self._data is not None else self._master
        assert channel is not None
        return dict(channel.request(StatsRequest, StatsReply).stats)

    def check_integrity(self) -> None:
        """AssertionError with the server's description if its invariants do not hold."""
        for channel in (self._data, self._master):
            if channel is not None:
                reply = channel.request(CheckRequest, CheckReply)
                if reply.problem is not None:
                    raise AssertionError(f"{channel.address}: {reply.problem}")

    def nodes(self) -> dict[str, str]:
        if self._master is None:
            raise ValueError("this client has no master address")
        return dict(self._master.request(NodesRequest, NodesReply).nodes)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._ucx is not None and self._data is not None:
            # a live server answers in milliseconds; a gone one must not hold up a shutdown
            self._data.timeout_s = min(self._data.timeout_s, BYE_TIMEOUT_S)
            try:
                self._data.request(ByeRequest, ByeReply)
            except Exception:  # the server may be gone already; nothing to free there then
                logger.debug("store client: bye failed", exc_info=True)
            self._ucx.close()
            self._ucx = None
        for channel in (self._data, self._master):
            if channel is not None:
                channel.close()
        self._ctx.term()


def _landing(sizes: list[int], found: list[bool]) -> tuple[np.ndarray, list[np.ndarray]]:
    """One buffer for a get's found blocks, back to back, and each block's slice of it."""
    sizes = [size for size, ok in zip(sizes, found, strict=True) if ok]
    received = np.empty(sum(sizes), np.uint8)
    offsets = np.cumsum([0, *sizes]).tolist()
    return received, [received[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]


def _one_per_key(values: list[bool], name: str, num_keys: int) -> list[bool]:
    """A reply's per-key list, checked to hold one entry per key asked about."""
    if len(values) != num_keys:
        raise ValueError(f"reply field {name!r} has {len(values)} entries for {num_keys} keys")
    return values

