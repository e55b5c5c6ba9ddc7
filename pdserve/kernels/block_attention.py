"""Block attention with its log-sum-exp: one query chunk against one K/V chunk, the unit that
ring attention (pdserve/kernels/ring_attention.py) runs once per K/V block passing by.

    out[i, h] = sum_j softmax_j(scale q[i, h] . k[j, h // g]) v[j, h // g]     [Tq, H, Dv]
    lse[i, h] = log sum_j exp(scale q[i, h] . k[j, h // g])                     [Tq, H]

over the keys row i sees: every key (full mask), or, given positions, the keys with
k_pos[j] <= q_pos[i] (causal mask). Positions are absolute token positions, in any order, so
a zig-zag chunk pair or a block-striped cache shard is one call. A row that sees no key gets
out 0 and lse -inf, which merge_attention (ring_attention.py) treats as "nothing here".

(out, lse) in fp32 whatever the input dtype: they are partials, merged before rounding.

The Triton kernel is FlashAttention-2's forward with the running max and sum kept to the
end to form lse. One program owns BLOCK_M query rows of one head; K/V tiles whose smallest
position lies past the program's largest query position are skipped whole (with zig-zag
chunks half of a rank's key tiles in a ring step are).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .paged_tile import check_launchable, dot_precision
from .reference import check_block_attention


@triton.jit
def _block_attention_kernel(
    q_ptr, k_ptr, v_ptr, q_pos_ptr, k_pos_ptr, out_ptr, lse_ptr,
    num_q, num_k, qk_scale, num_queries_per_kv,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    stride_v_token, stride_v_head, stride_out_token, stride_out_head, stride_lse_token,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(1)
    kv_head = head // num_queries_per_kv
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_valid = offs_m < num_q
    q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * stride_q_token + head * stride_q_head
                + offs_d[None, :], mask=m_valid[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int64)
    last_q_pos = tl.zeros((), dtype=tl.int64)
    if CAUSAL:
        q_pos = tl.load(q_pos_ptr + offs_m, mask=m_valid, other=-1).to(tl.int64)
        last_q_pos = tl.max(q_pos, axis=0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(0, num_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < num_k
        k_pos = tl.zeros([BLOCK_N], dtype=tl.int64)
        first_k_pos = tl.zeros((), dtype=tl.int64)
        if CAUSAL:
            k_pos = tl.load(k_pos_ptr + offs_n, mask=n_valid, other=2**31 - 1).to(tl.int64)
            first_k_pos = tl.min(k_pos, axis=0)
        if first_k_pos <= last_q_pos:  # else the whole tile lies in the future: skip it
            rows = offs_n[:, None].to(tl.int64)
            k = tl.load(k_ptr + rows * stride_k_token + kv_head * stride_k_head
                        + offs_d[None, :],
                        mask=n_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
            v = tl.load(v_ptr + rows * stride_v_token + kv_head * stride_v_head
                        + offs_dv[None, :],
                        mask=n_valid[:, None] & (offs_dv[None, :] < V_DIM), other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2 units
            visible = n_valid[None, :] & m_valid[:, None]
            if CAUSAL:
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                                input_precision=DOT_PRECISION)
            m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_out_token
             + head * stride_out_head + offs_dv[None, :], out,
             mask=m_valid[:, None] & (offs_dv[None, :] < V_DIM))
    tl.store(lse_ptr + offs_m.to(tl.int64) * stride_lse_token + head, lse, mask=m_valid)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                    block_m: int | None = None, block_n: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of reference.block_attention (same arguments and
    result). block_m and block_n override the tiles (tests); the interpreter gets 64 x 64,
    whose cost is per program and loop step (FACTS.md)."""
    check_block_attention(q, k, v, q_pos, k_pos)
    interpreted = check_launchable(q, k, v)
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    num_q, num_heads, head_dim = q.shape
    v_dim = v.shape[2]
    out = q.new_zeros(num_q, num_heads, v_dim, dtype=torch.float32)
    lse = q.new_full((num_q, num_heads), float("-inf"), dtype=torch.float32)
    if num_q == 0 or k.shape[0] == 0:
        return out, lse
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    causal = q_pos is not None
    if q_pos is None or k_pos is None:  # unused by a full-mask launch: any int pointer
        q_pos = k_pos = torch.zeros(1, dtype=torch.int32, device=q.device)
    big = max(head_dim, v_dim) > 128 or q.dtype == torch.float32
    if block_m is None:
        block_m = 64 if interpreted else (32 if big else 64)
    if block_n is None:
        block_n = 64 if interpreted else (32 if big else 64)
    grid = (triton.cdiv(num_q, block_m), num_heads)
    _block_attention_kernel[grid](
        q, k, v, q_pos.to(torch.int32), k_pos.to(torch.int32), out, lse,
        num_q, k.shape[0], scale * math.log2(math.e), num_heads // k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), V_DIM=v_dim,
        BLOCK_DV=max(16, triton.next_power_of_2(v_dim)), UPCAST=interpreted,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=4 if interpreted else 8, num_stages=1,
    )
    return out, lse
