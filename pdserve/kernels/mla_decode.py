"""MLA decode (DeepSeek-V2/V3) in the absorbed form, over the paged latent cache.

With W_UK absorbed into the query and W_UV applied after attention, every head attends over
the same compressed rows, so the cache holds one row per token and no head axis:

    latent_cache [num_blocks, block_size, R + P]     row = [c_kv (R = kv_lora_rank) | k_rope (P)]
    score[h, j]  = scale * (q_latent[h] . c_kv[j] + q_rope[h] . k_rope[j])
    out[h]       = sum_j softmax(score[h])_j c_kv[j]                         -> [S, H, R]

A program owns (BLOCK_H heads, sequence, split): all its heads share each loaded latent tile,
the way decode_attention groups a KV head's query heads. Splits merge with
decode_attention.combine_splits. R = 512, P = 64 in the real models; other sizes are padded
to powers of two and masked.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode_attention import choose_num_splits, combine_splits, split_buffers
from .paged_tile import (
    check_cache_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
)
from .reference import check_mla_decode


@triton.jit
def _mla_decode_kernel(
    q_latent_ptr, q_rope_ptr, cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
    seq_lens_ptr, block_tables_ptr,
    qk_scale, num_heads, num_splits,
    stride_ql_seq, stride_ql_head, stride_qr_seq, stride_qr_head,
    stride_out_seq, stride_out_head, stride_block, stride_slot, stride_table,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    IS_SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    h_valid = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_valid = offs_r < RANK
    p_valid = offs_p < ROPE_DIM
    seq64 = seq.to(tl.int64)
    q_latent = tl.load(q_latent_ptr + seq64 * stride_ql_seq + heads[:, None] * stride_ql_head
                       + offs_r[None, :], mask=h_valid[:, None] & r_valid[None, :], other=0.0)
    q_rope = tl.load(q_rope_ptr + seq64 * stride_qr_seq + heads[:, None] * stride_qr_head
                     + offs_p[None, :], mask=h_valid[:, None] & p_valid[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 arithmetic is wrong
        q_latent = q_latent.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    table_row = block_tables_ptr + seq64 * stride_table

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < split_end
        block_ids = tl.load(table_row + offs_n // PAGE_SIZE, mask=n_valid, other=0)
        row = block_ids.to(tl.int64) * stride_block + (offs_n % PAGE_SIZE) * stride_slot
        c_kv = tl.load(cache_ptr + row[:, None] + offs_r[None, :],
                       mask=n_valid[:, None] & r_valid[None, :], other=0.0)  # [BN, BR]
        k_rope = tl.load(cache_ptr + row[:, None] + RANK + offs_p[None, :],
                         mask=n_valid[:, None] & p_valid[None, :], other=0.0)  # [BN, BP]
        c_kv = c_kv.to(q_latent.dtype)  # fp32 when UPCAST; an FP8 cache's rows upcast too
        k_rope = k_rope.to(q_latent.dtype)
        s = tl.dot(q_latent, tl.trans(c_kv), input_precision=DOT_PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PRECISION)
        s = tl.where(n_valid[None, :], s * qk_scale, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid position
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c_kv.dtype), c_kv, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    is_empty = l_i == 0.0  # a split past the end of a short context
    l_safe = tl.where(is_empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    io_mask = h_valid[:, None] & r_valid[None, :]
    if IS_SPLIT:
        # partials: [S, H, num_splits, BLOCK_R] fp32 and [S, H, num_splits] fp32
        part = (seq64 * num_heads + heads) * num_splits + split  # [BH]
        tl.store(partial_out_ptr + part[:, None] * BLOCK_R + offs_r[None, :], out, mask=io_mask)
        lse = tl.where(is_empty, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(partial_lse_ptr + part, lse, mask=h_valid)
    else:
        tl.store(out_ptr + seq64 * stride_out_seq + heads[:, None] * stride_out_head
                 + offs_r[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _head_and_context_tiles(num_heads: int, block_r: int, dtype: torch.dtype,
                            interpreted: bool) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_N). Every head block reads the whole latent context, so more heads per
    program means fewer reads: 64 heads (DeepSeek-V3 with all 128 heads on a rank) take 2
    blocks, not 8. 16 is tl.dot's minimum. ptxas on sm90 with R = 512, 8 warps, bf16:
    16 x 32 uses 108 registers, 32 x 32 184, 64 x 16 255, none spilling; fp32 (FMA products)
    stays at 16 x 32 (158). A [32, 512] bf16 latent tile is 32 KiB of shared memory."""
    if interpreted:
        return 16, 64
    if block_r < 256:
        return 16, 64
    if dtype == torch.float32 or num_heads <= 16:
        return 16, 32
    return (32, 32) if num_heads <= 32 else (64, 16)


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor,
                         latent_cache: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, scale: float,
                         num_splits: int | None = None) -> torch.Tensor:
    """Triton version of reference.mla_decode_attention (same arguments and result).

    num_splits overrides the split count (tests and benchmarks)."""
    check_mla_decode(q_latent, q_rope, latent_cache, seq_lens, block_tables)
    interpreted = check_launchable(q_latent, q_rope, latent_cache, seq_lens, block_tables)
    check_last_dim_contiguous(q_latent=q_latent, q_rope=q_rope, latent_cache=latent_cache,
                              block_tables=block_tables)
    if q_latent.dtype != q_rope.dtype:
        raise ValueError(f"dtypes differ: q_latent {q_latent.dtype}, q_rope {q_rope.dtype}")
    check_cache_dtype(q_latent, latent_cache)
    num_seqs, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[2]
    page_size = latent_cache.shape[1]
    out = torch.empty_like(q_latent)
    if num_seqs == 0:
        return out
    block_tables = block_tables.to(torch.int32)
    block_r = max(16, triton.next_power_of_2(rank))
    block_h, block_n = _head_and_context_tiles(num_heads, block_r, q_latent.dtype, interpreted)
    num_head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_head_blocks,
                                       block_tables.shape[1] * page_size)
    is_split = num_splits > 1
    partial_out, partial_lse = split_buffers(out, num_seqs, num_heads, num_splits, block_r)
    # Head blocks of one (sequence, split) are neighbours in launch order, so they run
    # together and share each latent tile through L2 instead of each reading it from HBM.
    _mla_decode_kernel[(num_head_blocks, num_seqs, num_splits)](
        q_latent, q_rope, latent_cache, out, partial_out, partial_lse,
        seq_lens.to(torch.int32), block_tables,
        scale * math.log2(math.e), num_heads, num_splits,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        out.stride(0), out.stride(1), latent_cache.stride(0), latent_cache.stride(1),
        block_tables.stride(0),
        PAGE_SIZE=page_size, BLOCK_H=block_h, BLOCK_N=block_n, RANK=rank,
        ROPE_DIM=rope_dim, BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope_dim)), IS_SPLIT=is_split,
        UPCAST=interpreted, DOT_PRECISION=dot_precision(q_latent.dtype),
        num_warps=8, num_stages=2,
    )
    if is_split:
        combine_splits(partial_out, partial_lse, out)
    return out
