"""The KV connector: the only way a worker touches the store (lookup, load, save, poll).

The worker's device pool is one tensor per layer (serve/executor/kv_cache.py), with P planes: K and
V
(P = 2, layout kind "mha") or the MLA latent row alone (P = 1, kind "mla", one "head"):

    kv_caches[l]   [P, num_pool_blocks, block_size, num_kv_heads_per_rank, head_dim]

A stored block holds *all* layers and *all* KV heads, so blocks are independent of the TP
degree that wrote or reads them:

    stored block   [num_layers, P, block_size, num_kv_heads (all ranks), head_dim]  (bytes)

A reader at TP rank r of t takes heads [r*H/t, (r+1)*H/t) of each layer on load (a decode pool
at another TP degree re-lays blocks out for free); an MLA latent is whole on every rank.
Saving from a TP>1 MHA worker needs all heads, so the caller gathers heads to one rank first
(or saves at TP=1); a sharded save raises.

A worker serving hand-offs has its own data node (kvstore/handoff_node.py, `handoff_node`):
a save lands there, in process and pinned under a lease, and the hand-off names that node
(`source`), so the decode worker reads the blocks straight from the prefill worker's memory,
one hop. The fleet store (`backend`) then gets a write-back copy off the critical path: it
keeps the prefix for later requests, and a decode worker that cannot reach the source loads
from it instead. Without a node, saves go to the fleet store directly (the older two-hop
path), and without a fleet store, a worker still hands off through its node.

Loads and saves run on one background thread (but a save into this worker's own node, in
process, runs as its last layer is staged); the engine polls for completions, and a loop
with nothing else to do sleeps on `wakeup_fd`, readable once a completion waits. (A loop that
spun instead took half of a one-core decode worker from the load it waited for.) The KV
cache is a cache: a load that fails (store down, timeout, missing or malformed block) reports
the blocks it did place, possibly none, and the engine recomputes the rest.

    lookup(keys) -> n          start_load(req, keys[:n], block_ids, kv_caches, source)
    wait_for_layer_load(req, l)   save_layer(req, l, keys, block_ids, kv_caches[l])
    poll() -> [TransferResult]
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pdserve.kvstore.block_key import KVLayout
from pdserve.kvstore.master import PrefixLookup
from pdserve.kvstore.memory_tier import (
    BytesLike,
    as_uint8_tensor,
    back_to_back_runs,
    fp8_as_bytes,
    run_view,
)
from pdserve.kvstore.shm_segment import ShmReader
from pdserve.kvstore.tiered_store import TieredStore
from pdserve.protocol.store import ShmSegment, ShmSpan

logger = logging.getLogger(__name__)

MAX_FAILED_PEERS = 256  # failed node addresses remembered
FAILED_PEER_HOLD_S = 30.0  # how long a failed node address is not asked again
CLOSE_DRAIN_S = 2.0  # the longest close() waits for queued jobs


class BlockBackend(Protocol):
    """What the connector needs of a store: a TieredStore (in process) or a StoreClient."""

    def lookup_prefix(self, keys: Sequence[bytes]) -> int | PrefixLookup: ...
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> list[bool]: ...
    def get_many(self, keys: Sequence[bytes]) -> Sequence[BytesLike | None]: ...
    def prefetch(self, keys: Sequence[bytes]) -> int: ...


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    kind: str  # "load" | "save"
    num_blocks: int
    """Leading blocks placed in the pool (load) or stored (save)."""
    error: str | None = None
    lease_id: int | None = None
    """Save with a lease TTL: the store lease pinning the saved blocks (release it, or it
    expires), so they survive until the reader (a decode worker) has loaded them."""
    source: str = ""
    """Save: the data node holding the blocks and the lease ("": the fleet store)."""
    layers: list[torch.Tensor] | None = None
    """Load started without a pool: the placed blocks per layer, [P, num_blocks, block_size,
    this rank's heads, head_dim], views into one buffer (the caller installs them)."""
    shm_segment: ShmSegment | None = None
    """Save: the node's shared memory segment, when the saved blocks lie in it..."""
    shm_spans: list[ShmSpan] | None = None
    """...and where each of them does (a decode worker on this host maps them in place)."""


@dataclass
class _Load:
    num_layers: int
    layer_done: list[threading.Event] = field(default_factory=list)
    num_blocks: int = 0
    layers: list[torch.Tensor] | None = None  # loaded without a pool: the blocks, per layer

    def __post_init__(self) -> None:
        self.layer_done = [threading.Event() for _ in range(self.num_layers)]


@dataclass
class _Save:
    keys: list[bytes]
    staging: torch.Tensor  # [num_blocks, num_layers, 2, block_size, H, D] on the host
    layers_saved: set[int] = field(default_factory=set)
    copy_done: list[Any] = field(default_factory=list)  # CUDA events of the async copies
    span: ShmSpan | None = None  # where the staging lies in the node's segment
    announce_when_staged: bool = False  # on_staged declined at the start: ask once all are


def block_nbytes(layout: KVLayout) -> int:
    """Bytes of one stored block (every layer, every KV head)."""
    return math.prod(layout.block_shape()) * getattr(torch, layout.dtype).itemsize


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """[(start, stop, first block id)]: positions start..stop-1 hold block ids first,
    first + 1, ... (consecutive ids, so one slice of the pool covers them)."""
    runs: list[tuple[int, int, int]] = []
    for i, block_id in enumerate(block_ids):
        if runs and block_id == runs[-1][2] + i - runs[-1][0]:
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, block_id))
    return runs


class KVConnector:
    def __init__(self, backend: BlockBackend | None, layout: KVLayout, tp_rank: int = 0,
                 tp_size: int = 1, timeout_s: float = 10.0, lease_ttl_s: float | None = None,
                 handoff_node: Any = None,
                 connect: Callable[[str], BlockBackend] | None = None):
        """`backend`: the fleet store (None: none). `lease_ttl_s`: pin every completed save
        under a lease of this TTL (the save target must have leases: `pin(keys, ttl_s)`,
        `release(lease_id)`). `handoff_node`: this worker's own data node (a HandoffNode),
        where saves land; `connect(address)` opens a client to another worker's node, the
        source of a load."""
        self._heads = layout.rank_heads(tp_rank, tp_size)  # raises on a bad rank or split
        self.backend = backend
        self.handoff_node = handoff_node
        self._connect = connect
        self._peers: dict[str, BlockBackend] = {}  # source address -> client (job thread)
        # Nodes that failed a request -> when (job thread), most recent last: a worker's node
        # dies with it and a restarted worker binds a new port, so for FAILED_PEER_HOLD_S a
        # failed address is not asked again (its hand-offs load from the fleet store, its
        # leases died with it) instead of costing every later load and release a timeout.
        self._failed_peers: OrderedDict[str, float] = OrderedDict()
        # segments of prefill workers on this host, mapped (None: cannot be), main thread only
        self._segments: OrderedDict[tuple[int, int, int], ShmReader | None] = OrderedDict()
        self.on_staged: Callable[[str, ShmSegment, ShmSpan, int, bool], bool] | None = None
        """Called (on the forward's thread) when a save starts staging in the node's segment:
        (request id, segment, span of its first block, number of blocks, False). Its header
        then counts the layers staged (ShmArena progress), for a decode worker to follow. If
        it returns False (not announced now), it is called again, with True, once every
        layer is staged."""
        self.layout = layout
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.timeout_s = timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        self.block_shape = layout.block_shape()  # [num_layers, P, block_size, H, D]
        self.block_bytes = block_nbytes(layout)
        self._loads: dict[str, _Load] = {}
        self._saves: dict[str, _Save] = {}
        self._results: list[TransferResult] = []
        self._lock = threading.Lock()
        # a byte is written for each completion, and poll() empties the pipe
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run_jobs, name="kv-connector", daemon=True)
        self._worker.start()

    # ---- lookup -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks the store holds (0 when it cannot be asked)."""
        if self.backend is None:
            return 0
        try:
            found = self.backend.lookup_prefix(list(keys))
        except Exception as e:  # a cache lookup must never fail a request
            logger.warning("kv connector: lookup failed (%s); treating as a miss", e)
            return 0
        return found if isinstance(found, int) else found.num_blocks

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Ask the store to bring a queued request's blocks up to DRAM before its load (fire
        and forget: a failure only means the load reads from disk)."""
        keys, backend = list(keys), self.backend
        if backend is None:
            return

        def job() -> None:
            try:
                backend.prefetch(keys)
            except Exception as e:  # a hint, never an error
                logger.debug("kv connector: prefetch failed (%s)", e)

        self._jobs.put(job)

    # ---- load -------------------------------------------------------------------------------
    def start_load(self, request_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                   kv_caches: Sequence[torch.Tensor] | None, source: str = "") -> None:
        """Fetch blocks `keys` into pool blocks `block_ids` of every layer, asynchronously:
        from the data node at `source` (a prefill worker's), else (or when that fails) from
        the fleet store. With `kv_caches` None the blocks are not placed anywhere: the
        TransferResult carries them per layer (`layers`), for a caller that allocates their
        pool blocks only once they arrived (no staging copy)."""
        if len(keys) != len(block_ids) or (
                kv_caches is not None and len(kv_caches) != self.layout.num_layers):
            raise ValueError("start_load: one block id per key and one cache per layer")
        with self._lock:
            if request_id in self._loads:
                raise ValueError(f"request {request_id!r} already has a load in flight")
            load = self._loads[request_id] = _Load(self.layout.num_layers)
        keys, block_ids = list(keys), list(block_ids)
        self._jobs.put(lambda: self._load(request_id, load, keys, block_ids, kv_caches, source))

    def _fetch(self, keys: list[bytes], source: str) -> list[BytesLike]:
        """The leading run of present, well-formed blocks, as the backend returned them: from
        `source`, else the fleet store (each failure logged and passed over)."""
        names = ([source] if source else []) + ([""] if self.backend is not None else [])
        best: list[BytesLike] = []
        for name in names:
            if self._recently_failed(name):
                continue
            try:
                backend = self._backend_for(name) if name else self.backend
                assert backend is not None
                blocks = backend.get_many(keys) if keys else []
            except Exception as e:
                logger.warning("kv connector: reading from %s failed (%s)", name or "the store",
                               e)
                if name:
                    self._peer_failed(name)
                continue
            usable = []
            for block in blocks:
                if block is None or as_uint8_tensor(block).numel() != self.block_bytes:
                    break
                usable.append(block)
            if len(usable) > len(best):
                best = usable
            if len(best) == len(keys):
                break
        return best

    def _backend_for(self, source: str) -> BlockBackend:
        """The client of the data node at `source` (this worker's own node in process)."""
        node = self.handoff_node
        if node is not None and source == node.address:
            return node
        peer = self._peers.get(source)
        if peer is None:
            if self._connect is None:
                raise RuntimeError(f"no way to reach data node {source}")
            peer = self._peers[source] = self._connect(source)
        return peer

    def _peer_failed(self, source: str) -> None:
        self._drop_peer(source)
        self._failed_peers.pop(source, None)
        self._failed_peers[source] = time.monotonic()
        while len(self._failed_peers) > MAX_FAILED_PEERS:
            self._failed_peers.popitem(last=False)

    def _recently_failed(self, source: str) -> bool:
        failed_s = self._failed_peers.get(source)
        return failed_s is not None and time.monotonic() - failed_s < FAILED_PEER_HOLD_S

    def _drop_peer(self, source: str) -> None:
        """Forget a failed peer's client (a later hand-off from it reconnects)."""
        peer = self._peers.pop(source, None)
        close = getattr(peer, "close", None)
        if close is not None:
            try:
                close()
            except Exception as e:  # it failed already; closing is best effort
                logger.debug("kv connector: closing the client of %s: %s", source, e)

    def _load(self, request_id: str, load: _Load, keys: list[bytes], block_ids: list[int],
              kv_caches: Sequence[torch.Tensor] | None, source: str) -> None:
        error = None
        try:
            usable = self._fetch(keys, source)
            if len(usable) < len(keys):
                error = f"{len(keys) - len(usable)} of {len(keys)} blocks missing"
            load.num_blocks = len(usable)  # before any layer is signalled as done
            if usable:
                layers = self._per_layer(usable, None if kv_caches is None
                                         else kv_caches[0].device)
                if kv_caches is None:  # the caller installs them
                    load.layers = layers
                else:
                    device = kv_caches[0].device
                    index = torch.tensor(block_ids[: len(usable)], dtype=torch.int64,
                                         device=device)
                    for layer, (cache, src) in enumerate(zip(kv_caches, layers, strict=True)):
                        fp8_as_bytes(cache).index_copy_(1, index,
                                                        fp8_as_bytes(src.to(cache.dtype)))
                        if device.type == "cuda":
                            torch.cuda.current_stream(device).synchronize()
                        load.layer_done[layer].set()
        except Exception as e:  # failure is a miss: the engine recomputes
            logger.warning("kv connector: load of %s failed (%s); recomputing", request_id, e)
            error, load.num_blocks, load.layers = repr(e), 0, None
        finally:
            for event in load.layer_done:
                event.set()
            with self._lock:
                self._results.append(TransferResult(request_id, "load", load.num_blocks, error,
                                                    layers=load.layers))
            self._wake()

    def _per_layer(self, blocks: Sequence[BytesLike],
                   device: torch.device | None = None) -> list[torch.Tensor]:
        """Whole stored blocks -> this rank's part of each layer, [P, n, block_size, h, D]:
        views, where the blocks lie back to back (a remote read lands them in one buffer; a
        local one, or a mapped segment, returns views of the save's staging), else stacked."""
        stacked = (run_view(list(blocks)) if len(back_to_back_runs(list(blocks))) == 1
                   else torch.stack([as_uint8_tensor(block) for block in blocks]))
        return self._layers(stacked if device is None else stacked.to(device), len(blocks))

    def _layers(self, stacked: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
        """[n, num_layers, P, block_size, H, D] (flat bytes) -> per layer [P, n, block_size,
        this rank's h, D], views."""
        stacked = stacked.view(self.dtype).view(num_blocks, *self.block_shape)
        return [stacked[:, layer, :, :, self._heads].transpose(0, 1)
                for layer in range(self.layout.num_layers)]

    def map_blocks(self, segment: ShmSegment, spans: list[ShmSpan]
                   ) -> tuple[list[torch.Tensor], Callable[[], bool]] | None:
        """Blocks that lie in another process's segment on this host (a prefill worker's
        hand-off), in place: per layer as `_per_layer` gives them, and a check to call once
        they were copied (False: one was freed meanwhile, the copy is not the blocks). None
        where the segment cannot be mapped here or a block is gone already."""
        key = (segment.pid, segment.fd, segment.inode)
        if key not in self._segments:
            self._drop_gone_segments()
            try:
                self._segments[key] = ShmReader(segment)
                logger.info("kv connector: hand-offs from process %d are copied in place, out "
                            "of its shared memory segment", segment.pid)
            except OSError as e:  # another host or container, or not allowed: load instead
                logger.info("kv connector: cannot map the segment of process %d (%s); "
                            "hand-offs from it load over the network", segment.pid, e)
                self._segments[key] = None
            while len(self._segments) > MAX_FAILED_PEERS:
                _, old = self._segments.popitem(last=False)
                if old is not None:
                    old.close()
        reader = self._segments[key]
        if reader is None:
            return None
        try:
            run = reader.run(spans, self.block_bytes)  # a save's blocks: one run
            blocks = None if run is not None else reader.views(spans, self.block_bytes)
        except ValueError as e:
            logger.warning("kv connector: a hand-off names blocks outside its segment (%s)", e)
            return None
        with warnings.catch_warnings():
            # the mapping is read-only, and its views are only ever read (copied from)
            warnings.simplefilter("ignore", UserWarning)
            if run is not None:
                layers = self._layers(torch.from_numpy(run), len(spans))
            elif blocks is not None:
                layers = self._per_layer(blocks)
            else:  # freed already
                return None
        return layers, lambda: all(reader.intact(spans))

    def staging_spans(self, span: ShmSpan, num_blocks: int) -> list[ShmSpan]:
        """Each block's span in a staging whose first block lies at `span` (back to back, one
        allocation): what the save's hand-off will name."""
        return [ShmSpan(span.offset + i * self.block_bytes, span.header, span.serial)
                for i in range(num_blocks)]

    def map_staging(self, segment: ShmSegment, span: ShmSpan, num_blocks: int
                    ) -> tuple[list[torch.Tensor], Callable[[], int], Callable[[], bool]] | None:
        """A save that another process on this host is staging now (on_staged there): per
        layer as map_blocks gives them, how many layers are staged so far, and the check to
        make once copied. None where it cannot be mapped or is gone already."""
        mapped = self.map_blocks(segment, self.staging_spans(span, num_blocks))
        reader = self._segments.get((segment.pid, segment.fd, segment.inode))
        if mapped is None or reader is None:
            return None
        layers, intact = mapped
        return layers, lambda: reader.progress(span), intact

    def _drop_gone_segments(self) -> None:
        """Unmap the segments of prefill workers that are gone (a mapping would keep their
        memory alive)."""
        for key, reader in list(self._segments.items()):
            pid, fd, inode = key
            try:
                alive = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
            except OSError:
                alive = False
            if not alive:
                del self._segments[key]
                if reader is not None:
                    reader.close()

    def wait_for_layer_load(self, request_id: str, layer: int,
                            timeout_s: float | None = None) -> int:
        """Block until layer `layer` of the load is in place; the number of leading blocks
        placed (0 on failure or timeout, and then the engine recomputes them). The load's
        TransferResult from poll() is authoritative (a later layer can still fail)."""
        with self._lock:
            load = self._loads.get(request_id)
        if load is None:
            raise KeyError(f"no load for request {request_id!r}")
        if not load.layer_done[layer].wait(self.timeout_s if timeout_s is None else timeout_s):
            return 0
        return load.num_blocks

    # ---- save -------------------------------------------------------------------------------
    def save_layer(self, request_id: str, layer: int, keys: Sequence[bytes],
                   block_ids: Sequence[int], kv_cache: torch.Tensor) -> None:
        """Stage layer `layer` of blocks `block_ids` (named `keys`); the put goes out once
        every layer is staged. The pool blocks may be reused as soon as this returns."""
        if self._heads != slice(0, self.layout.num_kv_heads):
            raise NotImplementedError("save needs all KV heads: gather to one rank first")
        if len(keys) != len(block_ids):
            raise ValueError("save_layer: one block id per key")
        with self._lock:
            save = self._saves.get(request_id)
            if save is None:
                staging = self._staging(len(keys), kv_cache.is_cuda)
                save = self._saves[request_id] = _Save(list(keys), staging)
                started = True
            else:
                started = False
        if started:
            self._announce(request_id, save)
        if list(keys) != save.keys or layer in save.layers_saved:
            raise ValueError(f"save_layer: keys changed or layer {layer} saved twice")
        # pool [P, num_blocks, block_size, H, D] -> staging[:, layer] [n, P, block_size, H, D],
        # one strided copy per run of consecutive block ids (a prompt's blocks mostly are one)
        for start, stop, first in block_runs(block_ids):
            save.staging[start:stop, layer].copy_(
                kv_cache[:, first:first + stop - start].transpose(0, 1),
                non_blocking=kv_cache.is_cuda)
        if kv_cache.is_cuda:
            event = torch.cuda.Event()
            event.record()
            save.copy_done.append(event)
        save.layers_saved.add(layer)
        if save.span is not None and layer + 1 == len(save.layers_saved):  # in order so far
            self.handoff_node.set_progress(save.span, layer + 1)  # after the data it counts
            if save.announce_when_staged and layer + 1 == self.layout.num_layers:
                self._announce(request_id, save, staged=True)
        if len(save.layers_saved) == self.layout.num_layers:
            with self._lock:
                del self._saves[request_id]
            if self.handoff_node is not None and not save.copy_done:
                # into this worker's own node: in process, no I/O, so at once (on the job
                # thread it waited for the GIL behind the next forward, 3.9 ms at 8 req/s)
                self._put(request_id, save)
            else:
                self._jobs.put(lambda: self._put(request_id, save))

    def _announce(self, request_id: str, save: _Save, staged: bool = False) -> None:
        """A save staging in the node's segment: say where (on_staged), so that a decode
        worker on this host can copy each layer as its progress counts it (`staged`: the
        second call, every layer is)."""
        node = self.handoff_node
        if node is None or self.on_staged is None or node.shm_segment is None:
            return
        if save.span is None:
            spans = node.locate([save.staging.view(-1)])
            if spans is None:  # staged outside the segment (it was full)
                return
            save.span = spans[0]
        try:
            announced = self.on_staged(request_id, node.shm_segment, save.span,
                                       len(save.keys), staged)
        except Exception as e:  # only an optimisation: the hand-off still says where
            logger.warning("kv connector: announcing the staging of %s failed (%s)",
                           request_id, e)
            return
        save.announce_when_staged = not announced and not staged

    def _staging(self, num_blocks: int, pinned: bool) -> torch.Tensor:
        """Host memory for a save's blocks [n, num_layers, P, block_size, H, D]: in the node's
        shared memory segment where it has room (a decode worker on this host copies them
        out of it), else plain (pinned for a CUDA pool's asynchronous copies)."""
        node = self.handoff_node
        if node is not None and not pinned:
            data = node.allocate_staging(num_blocks * self.block_bytes)
            if data is not None:
                return data.view(self.dtype).view(num_blocks, *self.block_shape)
        return torch.empty((num_blocks, *self.block_shape), dtype=self.dtype, pin_memory=pinned)

    def _put(self, request_id: str, save: _Save) -> None:
        """Store the staged blocks where decode reads them (this worker's node, else the
        fleet store), pinned; then, with a node, write them back to the fleet store after
        the result is out (off the hand-off's critical path)."""
        node = self.handoff_node
        target = node if node is not None else self.backend
        num_stored, error, lease_id, spans = 0, None, None, None
        blocks: list[torch.Tensor] = []
        try:
            if target is None:
                raise RuntimeError("no data node and no store to save to")
            for event in save.copy_done:
                event.synchronize()
            blocks = [save.staging[i].view(-1).view(torch.uint8) for i in range(len(save.keys))]
            stored = target.put_many(save.keys, blocks)
            num_stored = next((i for i, ok in enumerate(stored) if not ok), len(stored))
            if self.lease_ttl_s is not None and num_stored:
                lease_id, _ = target.pin(save.keys[:num_stored], self.lease_ttl_s)
            if node is not None and num_stored == len(blocks):
                spans = node.locate(blocks)
        except Exception as e:  # a lost save only costs a future recompute
            logger.warning("kv connector: save of %s failed (%s)", request_id, e)
            error = repr(e)
        with self._lock:
            self._results.append(TransferResult(
                request_id, "save", num_stored, error, lease_id,
                node.address if node is not None else "",
                shm_segment=node.shm_segment if spans else None, shm_spans=spans))
        self._wake()
        if node is not None and self.backend is not None and num_stored:
            backend, keys = self.backend, save.keys[:num_stored]

            def write_back() -> None:
                try:
                    backend.put_many(keys, blocks[:num_stored])
                except Exception as e:  # the store is a cache: the prefix is just not kept
                    logger.warning("kv connector: write-back of %s failed (%s)", request_id, e)

            self._jobs.put(write_back)

    def release(self, lease_id: int, source: str = "") -> None:
        """Give a save's lease back to the node holding it (asynchronously); a failure
        leaves it to expire."""
        def job() -> None:
            if self._recently_failed(source):
                return  # the node is gone, and its leases with it
            try:
                backend = self._backend_for(source) if source else self.backend
                if backend is not None:
                    backend.release(lease_id)
            except Exception as e:
                logger.warning("kv connector: releasing lease %d failed (%s); it will expire",
                               lease_id, e)
                if source:
                    self._peer_failed(source)
        self._jobs.put(job)

    # ---- completion -------------------------------------------------------------------------
    @property
    def wakeup_fd(self) -> int:
        """A file descriptor that is readable while finished transfers wait for poll()."""
        return self._wake_read

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:  # the pipe is full: the reader is woken already
            pass

    def poll(self) -> list[TransferResult]:
        """Transfers finished since the last poll; a reported load's state is freed."""
        try:
            while self._wake_write >= 0 and os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:  # emptied (before taking the results: a later one wakes again)
            pass
        with self._lock:
            results, self._results = self._results, []
            for r in results:
                if r.kind == "load":
                    self._loads.pop(r.request_id, None)
        return results

    def abort(self, request_id: str) -> None:
        """Forget a request's partial save (a finished load is freed by poll)."""
        with self._lock:
            self._saves.pop(request_id, None)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._loads) + len(self._saves) + self._jobs.qsize()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job ran; False on timeout."""
        done = threading.Event()
        self._jobs.put(done.set)
        return done.wait(self.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Finish queued jobs (write-backs, releases) for at most CLOSE_DRAIN_S: they are best
        effort, and a worker told to stop must stop within seconds."""
        self.drain(min(self.timeout_s, CLOSE_DRAIN_S))
        self._jobs.put(None)
        self._worker.join(timeout=CLOSE_DRAIN_S)
        for source in list(self._peers):
            self._drop_peer(source)
        for reader in self._segments.values():
            if reader is not None:
                reader.close()
        self._segments.clear()
        if not self._worker.is_alive() and self._wake_write >= 0:  # (a running job may write)
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_write = -1

    def _run_jobs(self) -> None:
        while True:
            job = self._jobs.get()  # in-process queue; close() enqueues None to end this thread
            if job is None:
                return
            job()
            del job  # not held while waiting: a save's job holds its staging memory


def make_in_process_connector(layout: KVLayout, dram_capacity_blocks: int,
                              disk_capacity_blocks: int = 0, disk_dir: str | None = None,
                              **kwargs: Any) -> KVConnector:
    """A connector over a private in-process TieredStore (tests, single-process runs)."""
    store = TieredStore.build(dram_capacity_blocks, disk_capacity_blocks, disk_dir)
    return KVConnector(store, layout, **kwargs)
