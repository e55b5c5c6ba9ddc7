"""Prefill attention over the paged KV cache (FlashAttention-2 forward, causal, GQA, ragged).

One program computes BLOCK_M query rows that share one KV head: BLOCK_Q tokens times the
num_queries_per_kv query heads of the group (padded to GROUP, a power of two), so every K/V
tile it gathers serves the whole group, and a decode row riding in a prefill batch fills
GROUP rows of its tile instead of one:

    row m  ->  token m // GROUP of the tile,  query head kv_head * num_queries_per_kv + m % GROUP
    BLOCK_M = BLOCK_Q * GROUP

A group wider than the tile (MLA's absorbed form: every query head shares one latent "KV
head", 128 of them in DeepSeek-V3) splits over head_splits programs per KV head, each taking
GROUP = BLOCK_M of its query heads for one token at a time.

The ragged batch is flattened into query tiles without a host-side schedule: sequence s owns
program ids [first_tile(s), first_tile(s + 1)) where

    first_tile(s) = cu_seqlens_q[s] // BLOCK_Q + s

which is strictly increasing and leaves every sequence at least ceil(q_len / BLOCK_Q) ids, so
a program finds its sequence by binary search over cu_seqlens_q and the grid is
T // BLOCK_Q + S tiles wide (a few programs exit at once).

Token i of sequence s sits at position p_i = seq_len - q_len + i (a cached prefix and this
step's new tokens are one call). Key tiles split in two loops:

    keys  0 ............ full_end ........ last_q_pos
          [ every row sees all ][ causal-masked tiles ]

Keys below the tile's first query position are visible to all rows, so those tiles skip
the mask arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .paged_tile import (
    MASK_CAUSAL,
    MASK_NONE,
    attend_paged_tile,
    check_cache_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
)
from .reference import check_prefill


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_seqs, num_queries_per_kv, head_splits,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_block, stride_slot, stride_kv_head, stride_table,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // head_splits
    first_in_group = (tl.program_id(1) % head_splits) * GROUP  # this program's query heads
    # Largest s with first_tile(s) <= tile (see the module docstring).
    lo = tl.zeros((), dtype=tl.int32)
    hi = tl.zeros((), dtype=tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block = tile - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return

    seq_len = tl.load(seq_lens_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token_in_seq = q_block * BLOCK_Q + offs_m // GROUP  # [BM]
    in_group = first_in_group + offs_m % GROUP  # [BM]
    head = kv_head * num_queries_per_kv + in_group
    row_valid = (token_in_seq < q_len) & (in_group < num_queries_per_kv)
    io_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    token = (q_start + token_in_seq).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
                + offs_d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    q_pos = seq_len - q_len + token_in_seq  # [BM]; rows past q_len sit past seq_len, see all
    first_q_pos = seq_len - q_len + q_block * BLOCK_Q
    kv_end = tl.minimum(first_q_pos + BLOCK_Q, seq_len)
    full_end = ((first_q_pos + 1) // BLOCK_N) * BLOCK_N
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_paged_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, start_n, seq_len, q_pos,
            kv_head, stride_block, stride_slot, stride_kv_head, qk_scale,
            PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, MASK_NONE, UPCAST, DOT_PRECISION,
        )
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_paged_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, start_n, seq_len, q_pos,
            kv_head, stride_block, stride_slot, stride_kv_head, qk_scale,
            PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, MASK_CAUSAL, UPCAST, DOT_PRECISION,
        )
    out = acc / l_i[:, None]
    tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


@dataclass(frozen=True)
class PrefillTiles:
    """Launch shape of the prefill kernel."""

    block_m: int  # query rows per program: tokens x query heads of one KV head
    block_n: int  # context positions per K/V tile
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def default_tiles(head_dim: int, dtype: torch.dtype, device: torch.device) -> PrefillTiles:
    """The interpreter's cost is per program and per loop step, so it gets 64x64 tiles. On
    GPU, 128 query rows per program amortise each gathered K/V tile over more rows. ptxas,
    for half types, head_dim 128, 8 warps: sm90 196 registers, no spills, ~96 KiB shared
    memory with 3 stages; sm80 needs 2 stages to stay unspilled; 4 warps or 128-wide K/V
    tiles spill. fp32 products are exact ("ieee"), which tensor cores cannot do, so they run
    on FMA units with registers to match: small tiles (head_dim 128 still spills ~600 bytes;
    fp32 on GPU is for fidelity runs, not speed). MLA's latent rows (576 wide, padded to
    1024) fit only 16 x 16 tiles in one stage (sm90: 200 registers, no spills, 65 KiB shared;
    the 64 x 32 two-stage default would need 384 KiB). See tests/kernels/test_kernels_compile.py."""
    if device.type != "cuda":
        return PrefillTiles(64, 64, 4, 1)
    if head_dim > 256:
        return PrefillTiles(16, 16, 8, 1)
    if dtype == torch.float32:
        return PrefillTiles(64, 32, 8, 2) if head_dim <= 64 else PrefillTiles(32, 32, 8, 2)
    num_stages = 3 if torch.cuda.get_device_capability(device)[0] >= 9 else 2
    if head_dim <= 128:
        return PrefillTiles(128, 64, 8, num_stages)
    return PrefillTiles(64, 32, 8, 2)


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      max_query_len: int, tiles: PrefillTiles | None = None,
                      key: torch.Tensor | None = None, value: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Triton version of reference.prefill_attention (same arguments and result).

    tiles overrides the launch shape (tests and benchmarks). key and value (the step's rows)
    are not needed: the kernel reads every row from the cache, on the device either way."""
    check_prefill(query, kv_cache, cu_seqlens_q, seq_lens, block_tables, max_query_len)
    interpreted = check_launchable(query, kv_cache, cu_seqlens_q, seq_lens, block_tables)
    check_last_dim_contiguous(query=query, kv_cache=kv_cache, block_tables=block_tables)
    check_cache_dtype(query, kv_cache)
    num_tokens, num_heads, head_dim = query.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    tiles = tiles or default_tiles(head_dim, query.dtype, query.device)
    # A tile holds whole tokens: all of a KV head's query heads (padded to a power of two),
    # or, for groups wider than the tile, block_m of them per program (head_splits programs).
    block_m = tiles.block_m
    group = triton.next_power_of_2(num_heads // num_kv_heads)
    head_splits = max(1, group // block_m)
    group //= head_splits
    block_tables = block_tables.to(torch.int32)
    grid = (num_tokens // (block_m // group) + num_seqs, num_kv_heads * head_splits)
    _prefill_attention_kernel[grid](
        query, kv_cache[0], kv_cache[1], out,
        cu_seqlens_q.to(torch.int32), seq_lens.to(torch.int32), block_tables,
        scale * math.log2(math.e), num_seqs, num_heads // num_kv_heads, head_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        PAGE_SIZE=page_size, BLOCK_M=block_m, GROUP=group, BLOCK_N=tiles.block_n,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), UPCAST=interpreted,
        DOT_PRECISION=dot_precision(query.dtype), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
