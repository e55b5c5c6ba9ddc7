"""Decode attention over the paged KV cache: split-K flash-decoding, grouped by KV head.

One query token per sequence. A program owns (sequence, KV head, split): it loads the
num_queries_per_kv query heads that share the KV head as one [BLOCK_G, D] tile, so each KV
block is read once per step for the whole group (GQA), and walks its split of the context:

    context   [ split 0 ][ split 1 ][ split 2 ][ split 3 ]     tokens_per_split =
                                                               ceil(seq_len / splits)
                                                               rounded up to BLOCK_N

Long contexts with few sequences need the splits to fill the GPU. Each split leaves a
normalised partial output and its log-sum-exp (base 2); `combine_splits_kernel` merges them:

    out = sum_i 2^(lse_i - max lse) * out_i / sum_i 2^(lse_i - max lse)

With one split the kernel writes the final output itself and no partials exist.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .paged_tile import (
    MASK_KV_LEN,
    attend_paged_tile,
    check_cache_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
)
from .reference import check_decode

MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256  # below this, a split's fixed cost outweighs the parallelism
TARGET_PROGRAMS = 528  # ~4 programs per SM on an H100/H200 (132 SMs)


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
    seq_lens_ptr, block_tables_ptr,
    qk_scale, num_heads, num_queries_per_kv, num_splits,
    stride_q_seq, stride_q_head, stride_out_seq, stride_out_head,
    stride_block, stride_slot, stride_kv_head, stride_table,
    PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * num_queries_per_kv + offs_g  # [BG]
    io_mask = (offs_g < num_queries_per_kv)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head
                + offs_d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32)  # unused: decode needs no causal mask

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        acc, m_i, l_i = attend_paged_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, start_n, split_end, q_pos,
            kv_head, stride_block, stride_slot, stride_kv_head, qk_scale,
            PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, MASK_KV_LEN, UPCAST, DOT_PRECISION,
        )
    is_empty = l_i == 0.0  # a split past the end of a short context
    l_safe = tl.where(is_empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    if IS_SPLIT:
        # partials: [S, H, num_splits, BLOCK_D] fp32 and [S, H, num_splits] fp32
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # [BG]
        tl.store(partial_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out,
                 mask=io_mask)
        lse = tl.where(is_empty, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(partial_lse_ptr + row, lse, mask=offs_g < num_queries_per_kv)
    else:
        tl.store(out_ptr + seq.to(tl.int64) * stride_out_seq + heads[:, None] * stride_out_head
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def combine_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    num_heads, num_splits, stride_out_seq, stride_out_head,
    BLOCK_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (S, H): merge one head's split partials (layout as written above)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    row = (seq.to(tl.int64) * num_heads + head) * num_splits + offs_s  # [BS]
    lse = tl.load(partial_lse_ptr + row, mask=offs_s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.math.exp2(lse - lse_max)  # [BS]; empty splits weigh 0
    d_mask = offs_d < HEAD_DIM
    parts = tl.load(partial_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :],
                    mask=(offs_s < num_splits)[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq.to(tl.int64) * stride_out_seq + head * stride_out_head + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(num_seqs: int, num_programs_per_seq: int, max_context_len: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, no split shorter than
    MIN_TOKENS_PER_SPLIT, a power of two (each value is a separate specialisation)."""
    by_length = triton.cdiv(max_context_len, MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(1, num_seqs * num_programs_per_seq))
    splits = max(1, min(by_length, by_occupancy, MAX_SPLITS))
    return triton.next_power_of_2(splits) if splits & (splits - 1) else splits


def split_buffers(out: torch.Tensor, num_seqs: int, num_heads: int, num_splits: int,
                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial outputs [S, H, splits, width] and log-sum-exps [S, H, splits] in
    fp32, for combine_splits; without splits the kernel writes `out` and never touches them."""
    if num_splits == 1:
        return out, out
    partial_out = torch.empty(num_seqs, num_heads, num_splits, width, dtype=torch.float32,
                              device=out.device)
    partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                              device=out.device)
    return partial_out, partial_lse


def combine_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor,
                   out: torch.Tensor) -> None:
    """partial_out [S, H, splits, BLOCK_D] fp32, partial_lse [S, H, splits] -> out [S, H, D]."""
    num_seqs, num_heads, num_splits, block_d = partial_out.shape
    combine_splits_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, out, num_heads, num_splits, out.stride(0), out.stride(1),
        BLOCK_SPLITS=triton.next_power_of_2(num_splits), HEAD_DIM=out.shape[2], BLOCK_D=block_d,
    )


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, num_splits: int | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """Triton version of reference.decode_attention (same arguments and result).

    num_splits / block_n override the split count and KV tile (tests and benchmarks). The
    default split count uses block_tables' width as the context bound, so no device value is
    read on the host (no sync; CUDA-graph friendly)."""
    check_decode(query, kv_cache, seq_lens, block_tables)
    interpreted = check_launchable(query, kv_cache, seq_lens, block_tables)
    check_last_dim_contiguous(query=query, kv_cache=kv_cache, block_tables=block_tables)
    check_cache_dtype(query, kv_cache)
    num_seqs, num_heads, head_dim = query.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_tables = block_tables.to(torch.int32)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * page_size)
    # fp32 runs on FMA units (exact products), half types on tensor cores; both stay
    # unspilled on sm90 with these tiles (tests/kernels/test_kernels_compile.py).
    is_fp32_gpu = query.dtype == torch.float32 and not interpreted
    block_n = block_n or (64 if interpreted or (head_dim <= 128 and not is_fp32_gpu) else 32)
    # tl.dot needs at least 16 rows on GPU; the group's padding rows are masked out.
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    is_split = num_splits > 1
    partial_out, partial_lse = split_buffers(out, num_seqs, num_heads, num_splits, block_d)
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache[0], kv_cache[1], out, partial_out, partial_lse,
        seq_lens.to(torch.int32), block_tables,
        scale * math.log2(math.e), num_heads, group, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        PAGE_SIZE=page_size, BLOCK_G=block_g, BLOCK_N=block_n, HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        IS_SPLIT=is_split, UPCAST=interpreted, DOT_PRECISION=dot_precision(query.dtype),
        num_warps=8 if is_fp32_gpu else 4, num_stages=2,
    )
    if is_split:
        combine_splits(partial_out, partial_lse, out)
    return out
