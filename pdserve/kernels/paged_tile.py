"""The step every paged-attention kernel repeats, and the checks every Triton wrapper makes.

`attend_paged_tile` gathers BLOCK_N consecutive context positions of one KV head from the
paged cache and folds them into a FlashAttention-2 online softmax held in registers:

    positions   start_n ... start_n + BLOCK_N - 1
    block       block_table[pos // PAGE_SIZE]          (one load per position, L1-cached)
    address     block * stride_block + (pos % PAGE_SIZE) * stride_slot + kv_head * stride_head

    m_new = max(m, rowmax(s))          s = q k^T * scale * log2(e)   (exp2 is the fast path)
    acc   = acc * 2^(m - m_new) + 2^(s - m_new) v
    l     = l   * 2^(m - m_new) + rowsum(2^(s - m_new))

BLOCK_N need not divide or be divided by PAGE_SIZE: each position finds its own block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# What may be masked away in one tile, fixed at compile time so full tiles pay for no masks.
MASK_NONE: tl.constexpr = tl.constexpr(0)  # every position < kv_len and visible to every row
MASK_KV_LEN: tl.constexpr = tl.constexpr(1)  # positions >= kv_len masked
MASK_CAUSAL: tl.constexpr = tl.constexpr(2)  # and position > the row's own position masked


@triton.jit
def attend_paged_tile(
    q, acc, m_i, l_i,  # [BM, BD] query tile; [BM, BD] fp32; [BM] fp32; [BM] fp32
    k_cache_ptr, v_cache_ptr, block_table_ptr,  # block_table_ptr: this sequence's row
    start_n, kv_len, q_pos,  # kv_len: positions >= it are masked; q_pos: [BM] row positions
    kv_head, stride_block, stride_slot, stride_head, qk_scale,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = offs_n < kv_len
    d_valid = offs_d < HEAD_DIM
    if MASK == MASK_NONE:
        block_ids = tl.load(block_table_ptr + offs_n // PAGE_SIZE)
    else:
        # Padding entries of the block table may be anything: never follow them.
        block_ids = tl.load(block_table_ptr + offs_n // PAGE_SIZE, mask=n_valid, other=0)
    row_offsets = (block_ids.to(tl.int64) * stride_block + (offs_n % PAGE_SIZE) * stride_slot
                   + kv_head * stride_head)  # [BN]
    kv_mask = n_valid[:, None] & d_valid[None, :]  # [BN, BD]
    k = tl.load(k_cache_ptr + row_offsets[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    # q's type: fp32 when UPCAST (the interpreter's bf16 arithmetic is wrong; fp32 is also
    # faster in numpy), and an FP8 cache's rows (scale 1.0) become the model dtype
    k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN] fp32
    if MASK == MASK_KV_LEN:
        s = tl.where(n_valid[None, :], s, float("-inf"))
    if MASK == MASK_CAUSAL:
        visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible position yet has m_new == -inf; keep its state at zero.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + row_offsets[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models get exact fp32 products ("ieee"), not TF32's 10-bit mantissa; half types
    ignore the setting (their products are exact in fp32 accumulation anyway)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_launchable(*tensors: torch.Tensor) -> bool:
    """Raise unless the tensors can go to a Triton kernel; returns whether the kernel runs in
    the interpreter (CPU tensors), where values are upcast to fp32 after loading."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cuda":
        return False
    if device.type != "cpu" or not triton.knobs.runtime.interpret:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
            f"before pdserve.kernels' Triton modules are imported (got {device})"
        )
    return True


def check_cache_dtype(query: torch.Tensor, cache: torch.Tensor) -> None:
    """The cache holds the query's dtype, or float8_e4m3fn (kv_cache_dtype fp8, scale 1.0),
    which the kernels upcast as they load it."""
    if cache.dtype not in (query.dtype, torch.float8_e4m3fn):
        raise ValueError(f"kv_cache is {cache.dtype} but query is {query.dtype} (a cache "
                         "holds the query's dtype or float8_e4m3fn)")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {t.stride()}")
