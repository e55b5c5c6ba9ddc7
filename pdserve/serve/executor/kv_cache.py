"""The paged KV pool: one tensor per layer, blocks addressed by id; and how big it is.

    layer l:  kv_caches[l]  [P, num_blocks, block_size, num_kv_heads_per_rank, head_dim]
              MHA (P = 2):  plane 0 = K, plane 1 = V
              MLA (P = 1):  one latent row [c_kv | k_rope] per token, one "head", the same
                            on every TP rank (DeepSeek-V2/V3, see pdserve/serve/models/deepseek.py)
    token at position p of a request lives in block block_table[p // block_size],
    row p % block_size (see pdserve/serve/layers/attention.py for the slot arithmetic).

The pool's dtype is the model's, or float8_e4m3fn with kv_cache_dtype fp8
(pdserve/serve/layers/fp8.py): one byte per value, which bytes_per_block counts, so the same
budget holds twice a bf16 pool's blocks.

The block manager decides which ids are free; this module only owns the memory. Every TP
rank holds its own heads' slice of the same block ids, so the pool size must be equal on
all ranks: each rank plans from its own memory and the ranks take the smallest count
(pdserve/serve/executor/model_runner.py).

How many blocks (CacheConfig's rules, as vLLM's), on one rank:

    CUDA, sized by gpu_memory_utilization (u), on one GPU:

    |<------------------------------- total ------------------------------->|
    |<----------------------- u x total --------------------->|
    | weights, CUDA context, | activation peak of | KV pool   | (1 - u): not |
    | library buffers        | the profiling step |           | touched      |

    weights, ...  = free memory before loading - free memory after the profiling step
    KV pool       = u x total - the two on its left, and at most what is free after the
                    profiling step less its peak (another process may hold memory too)

    kv_cache_memory_bytes (always on CPU, default 512 MiB): that budget, which on CPU must
    fit in the host's available memory; num_blocks: exactly that many.

A plan then caps max_model_len to what the pool holds (num_blocks x block_size): a request
longer than the whole pool could never run.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kvstore.connector import block_runs
from pdserve.kvstore.memory_tier import fp8_as_bytes
from pdserve.serve.config import DEFAULT_CPU_KV_CACHE_MEMORY_BYTES, CacheConfig
from pdserve.serve.cpu.huge_pages import huge_page_buffer

logger = logging.getLogger(__name__)

GIB = 1 << 30


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, num_planes: int = 2) -> int:
    """KV bytes of one block id summed over layers and planes, on one rank."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return num_planes * num_layers * block_size * num_kv_heads * head_dim * element_bytes


@dataclass(frozen=True)
class MemoryProfile:
    """One CUDA rank's memory, measured around loading the weights and the profiling
    forward (the largest step the scheduler can build), in bytes."""

    total_bytes: int
    free_before_load_bytes: int
    free_after_profile_bytes: int
    """Free once the forward's transient memory went back (weights still resident)."""
    peak_activation_bytes: int
    """The forward's peak above what was allocated when it started."""
    num_profiled_tokens: int = 0

    @property
    def non_kv_bytes(self) -> int:
        """What this rank uses besides the KV pool: weights, CUDA context and library
        buffers (the drop in free memory) plus room for the largest step's activations."""
        loaded = max(0, self.free_before_load_bytes - self.free_after_profile_bytes)
        return loaded + self.peak_activation_bytes


def kv_cache_bytes_from_profile(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """The KV budget under the utilisation fraction; never past what is actually free (less
    room for a step's activations), since another process may hold what the fraction
    counts on. May be <= 0: nothing is left."""
    budget = round(profile.total_bytes * gpu_memory_utilization) - profile.non_kv_bytes
    free = profile.free_after_profile_bytes - profile.peak_activation_bytes
    return min(budget, free)


@dataclass(frozen=True)
class KVCachePlan:
    """The pool's numbers, found at start; never written back into CacheConfig."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    """One block id, summed over layers and planes, on one rank."""
    model_max_len: int
    """The model's (or --max-model-len's) context limit, before the pool caps it."""
    source: str
    """What sized it: num_blocks | kv_cache_memory_bytes | gpu_memory_utilization."""

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError(f"a KV pool needs at least one block, got {self.num_blocks}")

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output served: the model's limit, or the pool's if smaller."""
        return min(self.model_max_len, self.num_tokens)

    @property
    def is_capped(self) -> bool:
        return self.max_model_len < self.model_max_len

    def describe(self) -> str:
        return (f"{self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} "
                f"tokens, {self.num_bytes / GIB:.2f} GiB per rank (sized by {self.source})")


def plan_kv_cache(cache_config: CacheConfig, bytes_per_block: int, model_max_len: int,
                  device_type: str = "cpu", profile: MemoryProfile | None = None
                  ) -> KVCachePlan:
    """This rank's pool by CacheConfig's rules; `profile` is needed only on CUDA when
    neither num_blocks nor kv_cache_memory_bytes is set. Raises ValueError when not even
    one block fits."""
    block_size = cache_config.block_size

    def plan(num_blocks: int, source: str) -> KVCachePlan:
        return KVCachePlan(num_blocks, block_size, bytes_per_block, model_max_len, source)

    if cache_config.num_blocks is not None:
        return plan(cache_config.num_blocks, "num_blocks")
    budget = cache_config.kv_cache_memory_bytes
    if budget is None and device_type == "cpu":
        budget = DEFAULT_CPU_KV_CACHE_MEMORY_BYTES
    if budget is not None:
        if budget < bytes_per_block:
            raise ValueError(f"kv_cache_memory_bytes={budget} is smaller than one KV block "
                             f"({bytes_per_block} bytes)")
        return plan(budget // bytes_per_block, "kv_cache_memory_bytes")
    if profile is None:
        raise ValueError("sizing the KV pool by gpu_memory_utilization needs a memory profile")
    kv_bytes = kv_cache_bytes_from_profile(profile, cache_config.gpu_memory_utilization)
    if kv_bytes < bytes_per_block:
        raise ValueError(
            f"no device memory left for the KV cache: {cache_config.gpu_memory_utilization} x "
            f"{profile.total_bytes / GIB:.2f} GiB, less {profile.non_kv_bytes / GIB:.2f} GiB "
            f"for the weights and a {profile.num_profiled_tokens}-token step's activations "
            f"({profile.free_after_profile_bytes / GIB:.2f} GiB free), leaves "
            f"{max(kv_bytes, 0) / GIB:.3f} GiB, less than one {bytes_per_block}-byte block; "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or split the "
            "model over more GPUs (--tensor-parallel-size)")
    return plan(kv_bytes // bytes_per_block, "gpu_memory_utilization")


def available_host_memory_bytes() -> int | None:
    """The kernel's MemAvailable (what can be allocated without swapping); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits_host_memory(plan: KVCachePlan, num_ranks: int,
                           available_bytes: int | None) -> None:
    """A CPU pool must fit in host memory (every rank's pool, all on this host): a clear
    error now beats the OOM killer later."""
    if available_bytes is None:
        logger.warning("cannot read the host's available memory; not checking that the KV "
                       "cache fits")
        return
    needed = plan.num_bytes * num_ranks
    if needed > available_bytes:
        raise ValueError(
            f"the KV cache needs {needed / GIB:.2f} GiB ({plan.describe()}, x {num_ranks} "
            f"rank(s)) but the host has {available_bytes / GIB:.2f} GiB available; lower "
            "--kv-cache-memory-gb or --num-kv-blocks")


class KVCachePool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 num_planes: int = 2) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Zeroed, not empty: a padded block-table entry may be read (and masked) by a kernel,
        # and NaN garbage times a zero weight is still NaN. On CPU each layer is a fresh
        # mapping asked to be huge before the zeroing touches it (pdserve/serve/cpu/huge_pages.py).
        shape = (num_planes, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches: list[torch.Tensor] = []
        for _ in range(num_layers):
            buffer = None
            if device.type == "cpu":
                buffer = huge_page_buffer(math.prod(shape) * dtype.itemsize)
            cache = (torch.empty(shape, dtype=dtype, device=device) if buffer is None
                     else buffer.view(dtype).view(shape))
            self.kv_caches.append(cache.zero_())

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        index = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise IndexError(f"block ids must be in [0, {self.num_blocks}), got "
                             f"{list(block_ids)}")
        return index.to(self.kv_caches[0].device) if self.kv_caches else index

    def read_blocks(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Copies of the given blocks, per layer [P, len(block_ids), block_size, Hkv, D]."""
        index = self._index(block_ids)
        return [cache.index_select(1, index) for cache in self.kv_caches]

    def write_blocks(self, block_ids: Sequence[int], blocks: Sequence[torch.Tensor]) -> None:
        """Inverse of read_blocks: per layer [P, len(block_ids), block_size, Hkv, D]."""
        if len(blocks) != len(self.kv_caches):
            raise ValueError(f"expected {len(self.kv_caches)} layers, got {len(blocks)}")
        index = self._index(block_ids)
        runs = block_runs(block_ids)
        for layer, layer_blocks in enumerate(blocks):
            self._write_layer(layer, index, runs, layer_blocks)

    def write_layer_blocks(self, layer: int, block_ids: Sequence[int],
                           blocks: torch.Tensor) -> None:
        """write_blocks for one layer: [P, len(block_ids), block_size, Hkv, D]."""
        self._write_layer(layer, self._index(block_ids), block_runs(block_ids), blocks)

    def _write_layer(self, layer: int, index: torch.Tensor, runs: list[tuple[int, int, int]],
                     layer_blocks: torch.Tensor) -> None:
        cache = self.kv_caches[layer]
        expected = (cache.shape[0], index.numel(), *cache.shape[2:])
        if tuple(layer_blocks.shape) != expected:
            raise ValueError(f"blocks must be {expected}, got {tuple(layer_blocks.shape)}")
        layer_blocks = fp8_as_bytes(layer_blocks.to(device=cache.device, dtype=cache.dtype))
        if len(runs) == 1:  # consecutive ids (fresh blocks mostly are): one slice copy
            fp8_as_bytes(cache).narrow(1, runs[0][2], index.numel()).copy_(layer_blocks)
        else:
            fp8_as_bytes(cache).index_copy_(1, index, layer_blocks)
