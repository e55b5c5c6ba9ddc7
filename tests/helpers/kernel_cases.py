"""Paged attention inputs shared by the kernel tests (test_kernels_reference.py checks the
plain-torch reference against dense attention on them, test_kernels_triton.py the Triton kernels
against the reference).

Each case scatters every sequence's K/V (or MLA latent rows) into randomly permuted cache
blocks, pads block tables with out-of-range ids, and keeps the dense, unpaged K/V beside them
for a dense oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from pdserve import envs
from pdserve.kernels import cpu_ops
from pdserve.kernels import reference as ref


def cpu_ops_or_none() -> ModuleType | None:
    """pdserve's compiled CPU ops, or None where PDSERVE_CPU_KERNELS=0 switched them off (a CUDA
    run, benchmarks/gpu/run.sh: it builds none) or they cannot be built here."""
    return cpu_ops.load() if envs.cpu_kernels() else None


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, H, D], this step's queries, sequences back to back
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], the whole context, unpaged
    values: list[torch.Tensor]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with garbage
    slot_mapping: torch.Tensor  # [sum(seq_lens)] int64, every context position's slot
    max_query_len: int

    def to(self, device: str) -> PagedCase:
        return PagedCase(**{k: v.to(device) if isinstance(v, torch.Tensor) else
                            [t.to(device) for t in v] if isinstance(v, list) else v
                            for k, v in vars(self).items()})


def _block_tables(seq_lens: list[int], block_size: int, gen: torch.Generator
                  ) -> tuple[torch.Tensor, int]:
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 2
    # Padding entries hold out-of-range ids: kernels must never read past a sequence's blocks.
    tables = torch.full((len(seq_lens), max_blocks), 10**6, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    return tables, num_blocks


def _slots(tables: torch.Tensor, seq_lens: list[int], block_size: int) -> torch.Tensor:
    slots = []
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots.append(tables[s, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(slots)


def make_paged_case(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
                    seed: int = 0) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _block_tables(seq_lens, block_size, gen)
    slot_mapping = _slots(tables, seq_lens, block_size)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(dtype)
    ref.write_kv_cache(torch.cat(keys), torch.cat(values), kv_cache, slot_mapping)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return PagedCase(query, keys, values, kv_cache, cu, torch.tensor(seq_lens, dtype=torch.int32),
                     tables, slot_mapping, max(q_lens))


@dataclass
class MlaCase:
    q_latent: torch.Tensor  # [S, H, R]
    q_rope: torch.Tensor  # [S, H, P]
    rows: list[torch.Tensor]  # per sequence [seq_len, R + P], unpaged
    latent_cache: torch.Tensor  # [num_blocks, block_size, R + P]
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor

    def to(self, device: str) -> MlaCase:
        return MlaCase(**{k: v.to(device) if isinstance(v, torch.Tensor) else
                          [t.to(device) for t in v] for k, v in vars(self).items()})


def make_mla_case(seq_lens: list[int], num_heads: int, rank: int, rope_dim: int,
                  block_size: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> MlaCase:
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _block_tables(seq_lens, block_size, gen)
    slot_mapping = _slots(tables, seq_lens, block_size)
    rows = [torch.randn(n, rank + rope_dim, generator=gen).to(dtype) for n in seq_lens]
    latent_cache = torch.randn(num_blocks, block_size, rank + rope_dim, generator=gen).to(dtype)
    ref.write_latent_cache(torch.cat(rows), latent_cache, slot_mapping)
    num_seqs = len(seq_lens)
    q_latent = torch.randn(num_seqs, num_heads, rank, generator=gen).to(dtype)
    q_rope = torch.randn(num_seqs, num_heads, rope_dim, generator=gen).to(dtype)
    return MlaCase(q_latent, q_rope, rows, latent_cache,
                   torch.tensor(seq_lens, dtype=torch.int32), tables, slot_mapping)


@dataclass
class MlaPrefillCase:
    q_nope: torch.Tensor  # [T, H, N]
    q_rope: torch.Tensor  # [T, H, P]
    w_uk: torch.Tensor  # [H, N, R]
    w_uv: torch.Tensor  # [H, V, R]
    rows: list[torch.Tensor]  # per sequence [seq_len, R + P], unpaged
    latent_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int

    def args(self, scale: float) -> tuple:
        return (self.q_nope, self.q_rope, self.latent_cache, self.w_uk, self.w_uv,
                self.cu_seqlens_q, self.seq_lens, self.block_tables, scale, self.max_query_len)

    def to(self, device: str) -> MlaPrefillCase:
        return MlaPrefillCase(**{k: v.to(device) if isinstance(v, torch.Tensor) else
                                 [t.to(device) for t in v] if isinstance(v, list) else v
                                 for k, v in vars(self).items()})


def make_mla_prefill_case(q_lens: list[int], seq_lens: list[int], num_heads: int,
                          dims: tuple[int, int, int, int], block_size: int,
                          dtype: torch.dtype = torch.float32, seed: int = 0) -> MlaPrefillCase:
    """dims = (N nope, V value, R rank, P rope)."""
    nope, v_dim, rank, rope = dims
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _block_tables(seq_lens, block_size, gen)
    rows = [torch.randn(n, rank + rope, generator=gen).to(dtype) for n in seq_lens]
    latent_cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen).to(dtype)
    ref.write_latent_cache(torch.cat(rows), latent_cache, _slots(tables, seq_lens, block_size))
    num_tokens = sum(q_lens)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    return MlaPrefillCase(
        randn(num_tokens, num_heads, nope), randn(num_tokens, num_heads, rope),
        randn(num_heads, nope, rank, std=rank ** -0.5), randn(num_heads, v_dim, rank,
                                                              std=rank ** -0.5),
        rows, latent_cache, torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), tables, max(q_lens))
