"""The tiers below a worker's paged KV pool: a prefix block that leaves the pool comes back
instead of being recomputed (SGLang's HiCache, vLLM's offloading connector, Dynamo's KV block
manager).

    device   the paged pool (BlockManager): cached blocks, evicted by LRU
      │ write-down: a full block that becomes cached is copied to host DRAM by a thread,
      ▼ never by the step (bounded; dropped and counted when the queue is full)
    host     HostTier: this worker's DRAM, whole blocks in the store's format, LRU
      │ a block evicted from it goes to the fleet store (KVTransfer.write_down), if any
      ▼
    store    the fleet KV store: its DRAM, then its SSD (pdserve/kvstore/)

A waiting request whose prefix continues past the pool's hits in the host tier gets fresh
blocks for those and the scheduler copies them in before the step that computes the rest
(on CUDA a non-blocking copy from pinned memory on the step's stream: no host sync). The
store tier is read by the worker's gateway (KVTransfer.store_prefix_keys). Either load happens
only where TierCosts says loading is faster than recomputing.

The write-down reads a block the engine may evict and overwrite meanwhile, so it checks the
block's eviction count (Block.epoch) before and after the copy: unchanged, no step can have
written the block (a step writes only blocks allocated after their eviction), and the copy
is published; changed, it is dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.kvstore.memory_tier import fp8_as_bytes
from pdserve.lifecycle import lower_thread_priority
from pdserve.serve.engine.block_manager import BlockManager
from pdserve.serve.engine.request import Request

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "store")
"""Where a prompt's prefix KV can be found, nearest first."""
PRIOR_READ_BYTES_PER_S = {"host": 4e9, "store": 0.5e9}
"""Read bandwidth assumed for a tier until one of its loads is measured."""
PRIOR_STORE_LATENCY_S = 2e-3
"""A store read's round trip, assumed until measured."""
EMA = 0.2
"""Weight of a new measurement in the running estimates."""


@dataclass
class TierCounters:
    """Per tier, since start: what `/status` shows and `/metrics` exports."""

    hit_tokens: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    evictions: int = 0
    writes_dropped: int = 0


class TierCosts:
    """Fetch or recompute: a prefix is loaded from a tier only where reading it is faster
    than computing it, both from what this worker measured (read seconds per byte of each
    tier, round trips included; prefill seconds per token). Priors stand in until then."""

    def __init__(self) -> None:
        self.read_s_per_byte = {tier: 1.0 / bw for tier, bw in PRIOR_READ_BYTES_PER_S.items()}
        self.latency_s = {"host": 0.0, "store": PRIOR_STORE_LATENCY_S}
        self.prefill_s_per_token: float | None = None
        self.measured = {"host": False, "store": False, "prefill": False}
        self.loads = 0
        self.recomputes = 0

    def note_read(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = seconds / nbytes
        if not self.measured[tier]:
            self.read_s_per_byte[tier], self.measured[tier] = rate, True
        else:
            self.read_s_per_byte[tier] += EMA * (rate - self.read_s_per_byte[tier])

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that computed `num_tokens` prompt tokens (and no decode) in `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = seconds / num_tokens
        if self.prefill_s_per_token is None:
            self.prefill_s_per_token, self.measured["prefill"] = rate, True
        else:
            self.prefill_s_per_token += EMA * (rate - self.prefill_s_per_token)

    def load_s(self, tier: str, nbytes: int) -> float:
        """Seconds to read `nbytes` from `tier`; a measured rate includes the round trip."""
        latency = 0.0 if self.measured[tier] else self.latency_s.get(tier, 0.0)
        return latency + nbytes * self.read_s_per_byte[tier]

    def token_credit(self, tier: str, bytes_per_token: float) -> float:
        """The share of a token's prefill that loading its KV from `tier` saves (1 - read
        time / compute time, at least 0; 1 until a prefill is measured): what the router
        credits a prefix found there with."""
        if not self.prefill_s_per_token:
            return 1.0
        read_s = bytes_per_token * self.read_s_per_byte[tier]
        return max(0.0, 1.0 - read_s / self.prefill_s_per_token)

    def worth_loading(self, tier: str, num_tokens: int, nbytes: int) -> bool:
        """Load (True) or recompute; counted. Until a prefill is measured: load."""
        load = (self.prefill_s_per_token is None
                or self.load_s(tier, nbytes) < num_tokens * self.prefill_s_per_token)
        if load:
            self.loads += 1
        else:
            self.recomputes += 1
        return load

    def as_status(self) -> dict[str, float]:
        status = {f"{tier}_read_gb_per_s": 1e-9 / s for tier, s in self.read_s_per_byte.items()}
        status["store_latency_ms"] = self.latency_s["store"] * 1e3
        status["prefill_tokens_per_s"] = (1.0 / self.prefill_s_per_token
                                          if self.prefill_s_per_token else 0.0)
        status["loads_chosen"] = float(self.loads)
        status["recomputes_chosen"] = float(self.recomputes)
        for name, measured in self.measured.items():
            status[f"{name}_measured"] = float(measured)
        return status


class HostTier:
    """Host DRAM slots holding whole blocks, [num_layers, P, block_size, heads, head_dim]
    each (the store's format), by block key, least recently used first out. Slots being
    copied into the pool are pinned and never reused until the copy is done. Thread safe."""

    def __init__(self, num_slots: int, block_shape: Sequence[int], dtype: torch.dtype,
                 pin_memory: bool = False) -> None:
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.num_slots = num_slots
        self.block_nbytes = self.data[0].nbytes
        self._lock = threading.Lock()
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, this tier holds."""
        with self._lock:
            count = 0
            for key in keys:
                if key not in self._slots:
                    break
                count += 1
            return count

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of the leading `keys` held here, pinned (touched as recently used)."""
        with self._lock:
            slots = []
            for key in keys:
                slot = self._slots.get(key)
                if slot is None:
                    break
                self._slots.move_to_end(key)
                self._pins[slot] = self._pins.get(slot, 0) + 1
                slots.append(slot)
            return slots

    def unpin(self, slots: Sequence[int]) -> None:
        with self._lock:
            for slot in slots:
                left = self._pins[slot] - 1
                if left:
                    self._pins[slot] = left
                else:
                    del self._pins[slot]

    def take_slot(self) -> tuple[int, bytes | None] | None:
        """A slot to write into: a free one, else the least recently used unpinned one,
        whose key leaves (returned, for the tier below); None when every slot is pinned."""
        with self._lock:
            if self._free:
                return self._free.pop(), None
            for key, slot in self._slots.items():
                if slot not in self._pins:
                    del self._slots[key]
                    return slot, key
            return None

    def publish(self, key: bytes, slot: int) -> None:
        with self._lock:
            if key in self._slots:  # written twice meanwhile: keep the first
                self._free.append(slot)
                return
            self._slots[key] = slot

    def give_back(self, slot: int) -> None:
        """A slot taken but not published (the copy was dropped)."""
        with self._lock:
            self._free.append(slot)

    def check_integrity(self) -> None:
        with self._lock:
            held = list(self._slots.values())
            if len(set(held)) != len(held) or set(held) & set(self._free) or \
                    len(held) + len(self._free) != self.num_slots:
                raise RuntimeError(f"host tier: {len(held)} held + {len(self._free)} free "
                                   f"!= {self.num_slots} slots, or a slot twice")


@dataclass
class HostLoad:
    """A planned load from the host tier: the blocks' keys and their pinned slots."""

    keys: list[bytes]
    slots: list[int]


WriteDown = Callable[[list[bytes], list[torch.Tensor]], bool]
"""Hands blocks evicted from the host tier to the fleet store; False: dropped (busy)."""


class KVOffload:
    """The host tier behind one engine's pool: the write-down thread, and the loads the
    scheduler plans (see the module docstring). Only where one process holds the whole pool
    (every layer and head): a TP or PP worker's ranks live in other processes."""

    MAX_PENDING = 1024
    """Write-downs queued at most; past it a block is dropped (counted)."""
    MAX_BATCH = 256
    """Queued write-downs copied together at most."""

    def __init__(self, kv_caches: list[torch.Tensor], block_manager: BlockManager,
                 num_slots: int, write_down: WriteDown | None = None) -> None:
        kv_caches = [fp8_as_bytes(cache) for cache in kv_caches]  # (CPU torch: no FP8 ops)
        first = kv_caches[0]  # [P, num_blocks, block_size, heads, head_dim] per layer
        self.kv_caches = kv_caches
        self.block_manager = block_manager
        self.device = first.device
        self.tier = HostTier(num_slots, (len(kv_caches), first.shape[0], *first.shape[2:]),
                             first.dtype, pin_memory=first.is_cuda)
        self.write_down = write_down
        self.costs = TierCosts()
        self.counters = {tier: TierCounters() for tier in TIERS[1:]}
        """host: hits, reads, write-downs, evictions; store: what the write-down sent there."""
        if not first.is_cuda:  # byte views of the pool and the tier, for the write-down
            self._cache_bytes = [c.view(torch.uint8).numpy() for c in kv_caches]
            self._tier_bytes = self.tier.data.view(torch.uint8).numpy()
        self._queue: queue.Queue = queue.Queue(self.MAX_PENDING)
        self._stream = torch.cuda.Stream(self.device) if first.is_cuda else None
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        block_manager.on_cached = self._on_cached
        self._thread = threading.Thread(target=self._run, name="kv-write-down", daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, runner, block_manager: BlockManager, nbytes: int,
              write_down: WriteDown | None = None) -> KVOffload | None:
        """A host tier of `nbytes` behind `runner`'s pool; None where it cannot have one
        (off, no prefix caching, or the pool spread over several processes)."""
        if nbytes <= 0 or not block_manager.enable_prefix_caching:
            return None
        if not getattr(runner, "holds_whole_pool", False):
            logger.info("host KV tier off: the pool is spread over this worker's ranks")
            return None
        caches = runner.kv_caches
        block_bytes = sum(c[:, 0].nbytes for c in caches)
        num_slots = nbytes // max(block_bytes, 1)
        if num_slots <= 0:
            return None
        offload = cls(caches, block_manager, int(num_slots), write_down)
        logger.info("host KV tier: %d blocks (%.2f GiB) below a pool of %d",
                    num_slots, num_slots * block_bytes / (1 << 30), block_manager.num_blocks)
        return offload

    # ---- write-down ------------------------------------------------------------------------
    def _on_cached(self, block_id: int, key: bytes) -> None:
        """Block manager hook (engine thread): a full block became cached."""
        if key in self.tier:
            return
        event = None
        if self._stream is not None:  # the step that wrote it may still be running
            event = torch.cuda.Event()
            event.record()
        epoch = self.block_manager.block_epoch(block_id)
        try:
            self._idle.clear()
            self._queue.put_nowait((block_id, key, epoch, event))
        except queue.Full:
            self.counters["host"].writes_dropped += 1

    def _run(self) -> None:
        # its copies take a core the engine leaves idle rather than slowing a step, or the
        # send of a first token that a prompt's write-down would otherwise race; a backlog
        # past MAX_PENDING is dropped and counted
        lower_thread_priority()
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                self._idle.set()
                continue
            batch = [item]
            while item is not None and len(batch) < self.MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
            stop = batch[-1] is None
            try:
                self._write([entry for entry in batch if entry is not None])
            except Exception as exc:  # never lose the thread: a block not written is a miss
                logger.warning("host KV tier: a write-down failed (%s)", exc)
                self.counters["host"].writes_dropped += len(batch) - stop
            if stop:
                break
            if self._queue.empty():
                self._idle.set()

    def _write(self, items: list[tuple[int, bytes, int, Any]]) -> None:
        """Copy the queued blocks still cached into host slots. On CPU, one gather per layer
        for the whole batch (a prompt's blocks come together) through numpy views: a plain
        copy that releases the GIL and runs on this thread alone. One small torch copy per
        block and layer took the GIL hundreds of times for a long prompt, and a batched
        torch copy would start a second OpenMP team beside the engine's (libgomp then
        throttles the engine's spin-waits): either delayed the engine's thread. A batch
        larger than the tier goes in the tier's size at a time, so its later blocks evict its
        earlier ones (to the store), as one block at a time would."""
        size = max(1, self.tier.num_slots)
        for start in range(0, len(items), size):
            self._write_batch(items[start:start + size])

    def _write_batch(self, items: list[tuple[int, bytes, int, Any]]) -> None:
        bm, counters = self.block_manager, self.counters["host"]
        taken: list[tuple[int, bytes, int, int, Any]] = []  # block, key, epoch, slot, event
        for block_id, key, epoch, event in items:
            if bm.block_epoch(block_id) != epoch or key in self.tier:  # evicted, or held
                counters.writes_dropped += key not in self.tier
                continue
            slot_and_evicted = self.tier.take_slot()
            if slot_and_evicted is None:
                counters.writes_dropped += 1
                continue
            slot, evicted = slot_and_evicted
            if evicted is not None:
                self._evict_below(evicted, slot)
            taken.append((block_id, key, epoch, slot, event))
        if not taken:
            return
        if self._stream is not None:
            for block_id, _, _, slot, event in taken:
                self._stream.wait_event(event)
                with torch.cuda.stream(self._stream):
                    for layer, cache in enumerate(self.kv_caches):
                        self.tier.data[slot, layer].copy_(cache[:, block_id], non_blocking=True)
            self._stream.synchronize()
        else:
            block_ids = np.array([t[0] for t in taken])
            slots = np.array([t[3] for t in taken])
            for layer, cache in enumerate(self._cache_bytes):  # [P, n, ...] -> [n, P, ...]
                self._tier_bytes[slots, layer] = cache[:, block_ids].swapaxes(0, 1)
        for block_id, key, epoch, slot, _ in taken:
            if bm.block_epoch(block_id) != epoch:  # evicted during the copy: it may be torn
                self.tier.give_back(slot)
                counters.writes_dropped += 1
                continue
            self.tier.publish(key, slot)
            counters.written_bytes += self.tier.block_nbytes

    def _evict_below(self, key: bytes, slot: int) -> None:
        """The LRU block leaves the host tier: a copy goes to the store, if there is one."""
        counters = self.counters["host"]
        counters.evictions += 1
        if self.write_down is None:
            return
        block = self.tier.data[slot].clone()
        if self.write_down([key], [block]):
            self.counters["store"].written_bytes += block.nbytes
        else:
            self.counters["store"].writes_dropped += 1

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write-down is done (tests, a graceful stop)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.empty() and self._idle.wait(0.05) and self._queue.empty():
                return True
        return False

    # ---- load-back -------------------------------------------------------------------------
    def plan(self, request: Request, num_device_tokens: int) -> HostLoad | None:
        """The blocks of `request`'s prefix past its `num_device_tokens` pool hits that the
        host tier holds, pinned, if loading them beats recomputing them; None otherwise.
        Give it to load() once the blocks are allocated, or to cancel()."""
        bm = self.block_manager
        max_blocks = (request.num_tokens - 1) // bm.block_size  # one token left to compute
        keys = bm.update_block_keys(request)[num_device_tokens // bm.block_size:max_blocks]
        num = self.tier.count_prefix(keys)
        if num == 0:
            return None
        if not self.costs.worth_loading("host", num * bm.block_size,
                                        num * self.tier.block_nbytes):
            return None
        return self.pin(keys[:num])

    def pin(self, keys: Sequence[bytes]) -> HostLoad | None:
        """The leading `keys` this tier holds, pinned for load() (or cancel()); None: none."""
        slots = self.tier.pin(keys)
        return HostLoad(list(keys[:len(slots)]), slots) if slots else None

    def cancel(self, load: HostLoad) -> None:
        self.tier.unpin(load.slots)

    def load(self, load: HostLoad, block_ids: Sequence[int]) -> None:
        """Copy the planned blocks into the pool blocks `block_ids` (engine thread, before
        the step that computes the rest of the prompt). On CUDA the gathered blocks are
        pinned and cross on the step's stream without a host sync; the slots are free to
        reuse as soon as they are gathered."""
        start_s = time.perf_counter()
        try:
            blocks = self.tier.data.index_select(0, torch.tensor(load.slots))  # [n, L, P, ...]
        finally:
            self.tier.unpin(load.slots)
        cuda = self.device.type == "cuda"
        if cuda:  # one pinned, contiguous [L, n, P, ...] batch: a single async copy
            staged = blocks.transpose(0, 1).contiguous().pin_memory().to(self.device,
                                                                         non_blocking=True)
            layers = [staged[layer].transpose(0, 1) for layer in range(len(self.kv_caches))]
        else:
            layers = [blocks[:, layer].transpose(0, 1) for layer in range(len(self.kv_caches))]
        targets = torch.tensor(list(block_ids), device=self.device)
        for cache, layer_blocks in zip(self.kv_caches, layers, strict=True):
            cache.index_copy_(1, targets, layer_blocks)
        if not cuda:  # (on CUDA the copy is still queued: the prior stands)
            self.costs.note_read("host", blocks.nbytes, time.perf_counter() - start_s)
        counters = self.counters["host"]
        counters.hit_tokens += len(load.keys) * self.block_manager.block_size
        counters.read_bytes += blocks.nbytes

    def count_prefix(self, request: Request, num_device_tokens: int) -> int:
        """Leading prompt tokens held by the pool and then the host tier, no side effects."""
        bm = self.block_manager
        keys = bm.update_block_keys(request)[num_device_tokens // bm.block_size:]
        return num_device_tokens + self.tier.count_prefix(keys) * bm.block_size

    # ---- status ----------------------------------------------------------------------------
    def as_status(self) -> dict[str, float]:
        """Flat numbers for WorkerStatus.kv_tiers: per tier counters, the host tier's fill,
        and the cost rule's inputs and decisions."""
        status: dict[str, float] = {}
        for tier, counters in self.counters.items():
            for name, value in vars(counters).items():
                status[f"{tier}_{name}"] = float(value)
        bytes_per_token = self.tier.block_nbytes / self.block_manager.block_size
        for tier in ("host", "store"):
            status[f"{tier}_token_credit"] = self.costs.token_credit(tier, bytes_per_token)
        status["host_blocks"] = float(self.tier.num_blocks)
        status["host_capacity_blocks"] = float(self.tier.num_slots)
        status.update(self.costs.as_status())
        return status

    def close(self) -> None:
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=5)
        self.block_manager.on_cached = None
