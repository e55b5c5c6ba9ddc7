"""The paged KV pool: one tensor per layer, blocks addressed by id.

    layer l:  kv_caches[l]  [P, num_blocks, block_size, num_kv_heads_per_rank, head_dim]
              MHA (P = 2):  plane 0 = K, plane 1 = V
              MLA (P = 1):  one latent row [c_kv | k_rope] per token, one "head", the same
                            on every TP rank (DeepSeek-V2/V3, see serve/models/deepseek.py)
    token at position p of a request lives in block block_table[p // block_size],
    row p % block_size (see serve/attention.py for the slot arithmetic).

The block manager decides which ids are free; this module only owns the memory. Every TP
rank holds its own heads' slice of the same block ids, so the pool size must be equal on
all ranks (it is computed from configs and the spec alone, never from free memory).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.serve.config import CacheConfig


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, num_planes: int = 2) -> int:
    """KV bytes of one block id summed over layers and planes, on one rank."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return num_planes * num_layers * block_size * num_kv_heads * head_dim * element_bytes


def num_blocks_for(cache_config: CacheConfig, num_layers: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, num_planes: int = 2) -> int:
    """CacheConfig.num_blocks, or as many blocks as kv_cache_memory_bytes holds."""
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    per_block = bytes_per_block(num_layers, cache_config.block_size, num_kv_heads, head_dim,
                                dtype, num_planes)
    num_blocks = cache_config.kv_cache_memory_bytes // per_block
    if num_blocks <= 0:
        raise ValueError(f"kv_cache_memory_bytes={cache_config.kv_cache_memory_bytes} is "
                         f"smaller than one KV block ({per_block} bytes)")
    return int(num_blocks)


class KVCachePool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 num_planes: int = 2) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Zeroed, not empty: a padded block-table entry may be read (and masked) by a kernel,
        # and NaN garbage times a zero weight is still NaN.
        self.kv_caches: list[torch.Tensor] = [
            torch.zeros(num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                        device=device)
            for _ in range(num_layers)
        ]

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
        for cache, layer_blocks in zip(self.kv_caches, blocks, strict=True):
            expected = (cache.shape[0], index.numel(), *cache.shape[2:])
            if tuple(layer_blocks.shape) != expected:
                raise ValueError(f"blocks must be {expected}, got {tuple(layer_blocks.shape)}")
            cache.index_copy_(1, index, layer_blocks.to(device=cache.device, dtype=cache.dtype))
