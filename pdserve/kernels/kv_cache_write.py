"""Scatter this step's K/V (or MLA latent) rows into the paged cache by slot index.

    slot_mapping[t] = block_id * block_size + offset     -> cache[block_id, offset, :, :]

One program copies one token's [heads, dim] row (BLOCK_H heads at a time), converting to the
cache's dtype (an FP8 cache: clamped to +-448, then rounded). The same kernel
serves K, V and the latent cache (a latent row is a single "head" of R + P values). A token
whose slot is negative is padding (a decode graph's bucket past the step's sequences,
pdserve/serve/executor/cuda_graphs.py) and writes nothing: the slot is read on the device, so a
captured graph's padding rows need no host-side decision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_tile import check_launchable
from .reference import (
    FP8_MAX,
    check_kv_cache_write,
    check_latent_cache_write,
    is_fp8,
    to_cache_dtype,
)

MAX_TILE_ELEMENTS = 4096  # per program: enough bytes in flight, modest registers


@triton.jit
def _scatter_rows_kernel(
    src_ptr, cache_ptr, slot_mapping_ptr,
    num_heads, page_size,
    stride_src_token, stride_src_head, stride_block, stride_slot, stride_cache_head,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SATURATE: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    row_heads = tl.where(slot >= 0, num_heads, 0)  # a padding row (slot < 0) has none to copy
    mask = (heads < row_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = tl.load(src_ptr + token.to(tl.int64) * stride_src_token
                   + heads[:, None] * stride_src_head + offs_d[None, :], mask=mask)
    dst = (cache_ptr + (slot // page_size) * stride_block + (slot % page_size) * stride_slot
           + heads[:, None] * stride_cache_head + offs_d[None, :])
    if SATURATE > 0:  # an FP8 cache: clamp to its range first, as every backend does
        out = tl.minimum(tl.maximum(rows.to(tl.float32), -SATURATE), SATURATE)
        out = out.to(cache_ptr.dtype.element_ty)
    else:
        out = rows.to(cache_ptr.dtype.element_ty)
    tl.store(dst, out, mask=mask)


def _scatter_rows(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """src [T, H, D] -> cache [num_blocks, page_size, H, D] at slot_mapping [T]."""
    interpreted = check_launchable(src, cache, slot_mapping)
    if interpreted and is_fp8(cache.dtype):
        # Triton's interpreter rounds fp32 -> e4m3 wrongly where the mantissa carries into the
        # exponent (measured: 124.0 stored as 64.0, torch and sm90's cvt give 128.0): convert
        # with torch first; the kernel then copies bytes
        src = to_cache_dtype(src, cache.dtype)
    if src.stride(2) != 1 or cache.stride(3) != 1:
        raise ValueError(f"rows must be contiguous in their last dimension, got strides "
                         f"{src.stride()} and {cache.stride()}")
    num_tokens, num_heads, head_dim = src.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, MAX_TILE_ELEMENTS // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _scatter_rows_kernel[grid](
        src, cache, slot_mapping, num_heads, cache.shape[1],
        src.stride(0), src.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        SATURATE=FP8_MAX if is_fp8(cache.dtype) else 0.0, num_warps=4,
    )


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Triton version of reference.write_kv_cache; key/value [T, Hkv, D] may be strided
    views (e.g. slices of a fused QKV projection) as long as each row's last dim is dense."""
    check_kv_cache_write(key, value, kv_cache, slot_mapping)
    _scatter_rows(key, kv_cache[0], slot_mapping)
    _scatter_rows(value, kv_cache[1], slot_mapping)


def write_latent_cache(latent: torch.Tensor, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Triton version of reference.write_latent_cache."""
    check_latent_cache_write(latent, latent_cache, slot_mapping)
    _scatter_rows(latent[:, None, :], latent_cache[:, :, None, :], slot_mapping)
