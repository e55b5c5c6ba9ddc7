"""The store connector: the only way a worker touches the store (lookup, load, save, poll).

The worker's device pool is one tensor per layer (pdserve/serve/executor/kv_cache.py), with P
planes: K and V (P = 2, layout kind "mha") or the MLA latent row alone (P = 1, kind "mla", one
"head"):

    kv_caches[l]   [P, num_pool_blocks, block_size, num_kv_heads_per_rank, head_dim]

A stored block holds *all* layers and *all* KV heads, so blocks are independent of the TP
degree that wrote or reads them:

    stored block   [num_layers, P, block_size, num_kv_heads (all ranks), head_dim]  (bytes)

A reader at TP rank r of t takes heads [r*H/t, (r+1)*H/t) of each layer on load (a decode pool
at another TP degree re-lays blocks out for free); an MLA latent is whole on every rank.
Saving from a TP>1 MHA worker needs all heads, so the caller gathers heads to one rank first
(or saves at TP=1); a sharded save raises.

Loads, saves and releases run on one background thread, and the fills of the fleet store (the
host tier's write-downs, a hand-off's write-back) on a second one at the lowest priority; the
engine polls for completions, and a loop with nothing else to do sleeps on `wakeup_fd`,
readable once a completion waits (a loop that spun would take the core from the load it
waits for). The KV cache is a cache: a load that fails (store down, timeout, missing or
malformed block) reports the blocks it did place, possibly none, and the engine recomputes
the rest.

    lookup(keys) -> n          start_load(req, keys[:n], block_ids, kv_caches)
    wait_for_layer_load(req, l)   save_layer(req, l, keys, block_ids, kv_caches[l])
    poll() -> [TransferResult]

The prefill -> decode hand-off extends this class (pdserve/handoff/connector.py): its saves
land in a worker's own data node or the store, are offered under a lease, and its loads read
the node a hand-off names first; the hooks it overrides are the `_`-methods marked "hook".
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
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
from pdserve.lifecycle import lower_thread_priority
from pdserve.protocol.store.data import ShmSegment, ShmSpan

logger = logging.getLogger(__name__)

CLOSE_DRAIN_S = 2.0  # the longest close() waits for queued jobs


class BlockBackend(Protocol):
    """What the connector needs of a store: a TieredStore (in process) or a StoreClient."""

    def lookup_prefix(self, keys: Sequence[bytes]) -> int | PrefixLookup: ...
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> list[bool]: ...
    def get_many(self, keys: Sequence[bytes]) -> Sequence[BytesLike | None]: ...
    def prefetch(self, keys: Sequence[bytes]) -> int: ...


@dataclass(frozen=True)
class TransferResult:
    """A finished load or save, as poll() reports it."""

    request_id: str
    kind: str  # "load" | "save" | "put"
    num_blocks: int
    """Leading blocks placed in the pool (load) or stored (save, put)."""
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
    write_back: Callable[[], None] | None = None
    """Save: the copy into the fleet store, for the caller to start (`fill`) once the
    hand-off is out: run at once it would take the CPU and the GIL from the step that samples
    the first token and from sending it."""


@dataclass
class _Load:
    num_layers: int
    layer_done: list[threading.Event] = field(default_factory=list)
    num_blocks: int = 0
    layers: list[torch.Tensor] | None = None  # loaded without a pool: the blocks, per layer

    def __post_init__(self) -> None:
        self.layer_done = [threading.Event() for _ in range(self.num_layers)]


@dataclass
class Save:
    """A save being staged, layer by layer, in host memory."""

    keys: list[bytes]
    staging: torch.Tensor  # [num_blocks, num_layers, 2, block_size, H, D] on the host
    layers_saved: set[int] = field(default_factory=set)
    copy_done: list[Any] = field(default_factory=list)  # CUDA events of the async copies
    span: ShmSpan | None = None  # where the staging lies in a node's segment (hand-off)
    announce_when_staged: bool = False  # on_staged declined at the start: ask once all are
    staging_id: int = 0  # names the staging (0: none; a hand-off connector numbers them)


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


def usable_prefix(blocks: Sequence[BytesLike | None], block_bytes: int) -> list[BytesLike]:
    """The leading run of present, well-formed blocks of a read."""
    usable = []
    for block in blocks:
        if block is None or as_uint8_tensor(block).numel() != block_bytes:
            break
        usable.append(block)
    return usable


class StoreConnector:
    """A worker's client of the fleet store: prefix lookups, per-layer loads into its pool,
    per-layer saves from it, and the write-downs of its host tier, in the background."""

    def __init__(self, backend: BlockBackend | None, layout: KVLayout, tp_rank: int = 0,
                 tp_size: int = 1, timeout_s: float = 10.0,
                 lease_ttl_s: float | None = None) -> None:
        """`backend`: the fleet store (None: none). `lease_ttl_s`: pin every completed save
        under a lease of this TTL (the save target must have leases: `pin(keys, ttl_s)`,
        `release(lease_id)`)."""
        self._heads = layout.rank_heads(tp_rank, tp_size)  # raises on a bad rank or split
        self.backend = backend
        self.layout = layout
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.timeout_s = timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        self.block_shape = layout.block_shape()  # [num_layers, P, block_size, H, D]
        self.block_bytes = block_nbytes(layout)
        self._loads: dict[str, _Load] = {}
        self._saves: dict[str, Save] = {}
        self._results: list[TransferResult] = []
        self._num_write_downs = 0
        self._lock = threading.Lock()
        # a byte is written for each completion, and poll() empties the pipe
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._fills: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run_jobs, args=(self._jobs, False),
                             name="kv-connector", daemon=True),
            threading.Thread(target=self._run_jobs, args=(self._fills, True),
                             name="kv-store-fill", daemon=True)]
        for thread in self._threads:
            thread.start()

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

    # ---- write-down -------------------------------------------------------------------------
    MAX_WRITE_DOWNS = 64
    """Write-downs queued at most; past it one is refused (the caller counts it dropped)."""

    def write_down(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> bool:
        """Put whole blocks (the store's format, owned by this call) into the fleet store in
        the background: what a worker's host tier evicts (pdserve/serve/engine/kv_tiers.py).
        False, and nothing sent, without a store or while MAX_WRITE_DOWNS are queued."""
        backend = self.backend
        if backend is None or self._num_write_downs >= self.MAX_WRITE_DOWNS:
            return False
        with self._lock:
            self._num_write_downs += 1
        keys = list(keys)
        payload = [block.contiguous().view(-1).view(torch.uint8).numpy() for block in blocks]

        def job() -> None:
            try:
                backend.put_many(keys, payload)
            except Exception as e:  # a lost write-down only costs a future recompute
                logger.debug("kv connector: write-down failed (%s)", e)
            finally:
                with self._lock:
                    self._num_write_downs -= 1

        self._fills.put(job)
        return True

    def put_blocks(self, request_id: str, keys: Sequence[bytes],
                   blocks: Sequence[torch.Tensor]) -> None:
        """Put whole blocks (the store's format, owned by this call) into the fleet store on
        the job thread, for a caller that waits for them: poll() reports a TransferResult of
        kind "put" (the leading blocks stored). Unlike write_down, never refused."""
        keys = list(keys)
        payload = [block.contiguous().view(-1).view(torch.uint8).numpy() for block in blocks]

        def job() -> None:
            num_stored, error = 0, None
            try:
                if self.backend is None:
                    raise RuntimeError("no store to put to")
                stored = self.backend.put_many(keys, payload)
                num_stored = next((i for i, ok in enumerate(stored) if not ok), len(stored))
            except Exception as e:  # a lost put only costs a future recompute
                error = repr(e)
            with self._lock:
                self._results.append(TransferResult(request_id, "put", num_stored, error))
            self._wake()

        self._jobs.put(job)

    # ---- load -------------------------------------------------------------------------------
    def start_load(self, request_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                   kv_caches: Sequence[torch.Tensor] | None, source: str = "") -> None:
        """Fetch blocks `keys` into pool blocks `block_ids` of every layer, asynchronously
        (`source`: a data node to read first, for a hand-off connector; here the fleet store
        is read). With `kv_caches` None the blocks are not placed anywhere: the
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
        """Hook: the leading usable blocks of `keys`, from the fleet store."""
        if self.backend is None or not keys:
            return []
        try:
            return usable_prefix(self.backend.get_many(keys), self.block_bytes)
        except Exception as e:
            logger.warning("kv connector: reading from the store failed (%s)", e)
            return []

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
                save = self._saves[request_id] = Save(list(keys), staging)
                started = True
            else:
                started = False
        if started:
            self._save_started(request_id, save)
        if list(keys) != save.keys or layer in save.layers_saved:
            raise ValueError(f"save_layer: keys changed or layer {layer} saved twice")
        # pool [P, num_blocks, block_size, H, D] -> staging[:, layer] [n, P, block_size, H, D],
        # one strided copy per run of consecutive block ids (a prompt's blocks mostly are one)
        for start, stop, first in block_runs(block_ids):
            save.staging[start:stop, layer].copy_(
                kv_cache[:, first:first + stop - start].transpose(0, 1),
                non_blocking=kv_cache.is_cuda)
        event = None
        if kv_cache.is_cuda:
            event = torch.cuda.Event()
            event.record()
            save.copy_done.append(event)
        save.layers_saved.add(layer)
        if layer + 1 == len(save.layers_saved):  # in order so far: count it, after its data
            self._layers_staged(request_id, save, layer + 1, event)
        if len(save.layers_saved) == self.layout.num_layers:
            with self._lock:
                del self._saves[request_id]
            if self._puts_in_process and not save.copy_done:
                # no I/O, so at once (on the job thread it would wait for the GIL behind the
                # next forward)
                self._put(request_id, save)
            else:
                self._jobs.put(lambda: self._put(request_id, save))

    _puts_in_process = False
    """Hook: a put does no I/O (a worker's own node), so the last save_layer runs it."""

    def _staging(self, num_blocks: int, pinned: bool) -> torch.Tensor:
        """Hook: host memory for a save's blocks [n, num_layers, P, block_size, H, D] (pinned
        for a CUDA pool's asynchronous copies)."""
        return torch.empty((num_blocks, *self.block_shape), dtype=self.dtype, pin_memory=pinned)

    def _save_started(self, request_id: str, save: Save) -> None:
        """Hook: a save's first layer is about to be staged."""

    def _layers_staged(self, request_id: str, save: Save, num_staged: int, event: Any) -> None:
        """Hook: the save's first `num_staged` layers are staged (their copies recorded in
        `event` on CUDA)."""

    def _end_staging(self, save: Save) -> None:
        """Hook: the save's staging is no longer read from (put, or aborted)."""

    def _offer(self, request_id: str, keys: list[bytes], blocks: list[torch.Tensor]
               ) -> TransferResult:
        """Hook: store a save's staged blocks, pinned under a lease of `lease_ttl_s`."""
        num_stored, lease_id = 0, None
        try:
            if self.backend is None:
                raise RuntimeError("no store to save to")
            stored = self.backend.put_many(keys, blocks)
            num_stored = next((i for i, ok in enumerate(stored) if not ok), len(stored))
            if self.lease_ttl_s is not None and num_stored:
                lease_id, _ = self.backend.pin(keys[:num_stored], self.lease_ttl_s)
        except Exception as e:  # a lost save only costs a future recompute
            return TransferResult(request_id, "save", num_stored, repr(e), lease_id)
        return TransferResult(request_id, "save", num_stored, None, lease_id)

    def _put(self, request_id: str, save: Save) -> None:
        """Store the staged blocks (the `_offer` hook), pinned; the result's write-back (a
        hand-off's) goes to the caller, to start once the hand-off is out."""
        try:
            for event in save.copy_done:
                event.synchronize()
        except Exception as e:  # a lost save only costs a future recompute
            result = TransferResult(request_id, "save", 0, repr(e))
        else:
            blocks = [save.staging[i].view(-1).view(torch.uint8) for i in range(len(save.keys))]
            result = self._offer(request_id, save.keys, blocks)
        self._end_staging(save)  # (a pull reads what is left from the node's store now)
        if result.error is not None:
            logger.warning("kv connector: save of %s failed (%s)", request_id, result.error)
        with self._lock:
            self._results.append(result)
        self._wake()

    def run_job(self, job: Callable[[], None]) -> None:
        """Run `job` on the connector's job thread."""
        self._jobs.put(job)

    def fill(self, job: Callable[[], None]) -> None:
        """Run a store fill (a save's write-back) on the fill thread: at the lowest priority,
        beside the job thread, so that a cache copy never holds up a load, a pull or the
        hand-off node's send of a prompt decode waits for."""
        self._fills.put(job)

    def release(self, lease_id: int, source: str = "") -> None:
        """Give a save's lease back (asynchronously); a failure leaves it to expire."""
        self._jobs.put(lambda: self._release(lease_id, source))

    def _release(self, lease_id: int, source: str) -> None:
        """Hook: give a lease back to the store."""
        try:
            if self.backend is not None:
                self.backend.release(lease_id)
        except Exception as e:
            logger.warning("kv connector: releasing lease %d failed (%s); it will expire",
                           lease_id, e)

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
            save = self._saves.pop(request_id, None)
        if save is not None:
            self._end_staging(save)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return (len(self._loads) + len(self._saves) + self._jobs.qsize()
                    + self._fills.qsize())

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job and fill ran; False on timeout."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for jobs in (self._jobs, self._fills):
            done = threading.Event()
            jobs.put(done.set)
            if not done.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def close(self) -> None:
        """Finish queued jobs (write-backs, releases) for at most CLOSE_DRAIN_S: they are best
        effort, and a worker told to stop must stop within seconds."""
        self.drain(min(self.timeout_s, CLOSE_DRAIN_S))
        for jobs in (self._jobs, self._fills):
            jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=CLOSE_DRAIN_S)
        self._closed()
        if not self._threads[0].is_alive() and self._wake_write >= 0:  # (a job may write)
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_write = -1

    def _closed(self) -> None:
        """Hook: the job threads ended; close what the subclass opened."""

    @staticmethod
    def _run_jobs(jobs: queue.Queue[Callable[[], None] | None], fills: bool) -> None:
        if fills:
            lower_thread_priority()
        while True:
            job = jobs.get()  # in-process queue; close() enqueues None to end this thread
            if job is None:
                return
            job()
            del job  # not held while waiting: a save's job holds its staging memory
