"""Block-scaled FP8 GEMM: y = x W^T for an e4m3 weight with 128-wide K blocks of scales.

DeepSeek-V3's FP8 linear layers (pdserve/serve/layers/fp8.py): the weight is float8_e4m3fn [N, K]
with a float32 scale per (row block, 128-column block); activations are quantized on the fly per
token and 128-column group ("dynamic"), so every K tile of the product has one scale per
row of A and one per row of B:

    A  [M, K] fp8, a_scale [M, K/128]            B [N, K] fp8, b_scale [N / SCALE_BLOCK_N, K/128]
    y[m, n] = sum_kb  a_scale[m, kb] * b_scale[n // SCALE_BLOCK_N, kb]
                      * sum_{k in block kb} A[m, k] B[n, k]

One program owns a BLOCK_M x BLOCK_N tile of y and walks K one 128-column block at a time:
the block's FP8 product accumulates in fp32 (tensor cores on sm89+), then both scales apply.
SCALE_BLOCK_N is 128 for the checkpoint's grid and 1 for pdserve's per-row scales (the
layout its loaders keep, see pdserve/serve/layers/fp8.py). In the interpreter (CPU tensors, tests)
tiles are upcast to fp32 after loading. `reference_block_gemm` is the plain-torch reference:
dequantize both, then one matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_tile import check_launchable

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP_K = 128  # the quantization block along K: one scale per row per GROUP_K columns


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_bn, stride_bk, stride_bsn, stride_bsk, stride_cm, stride_cn,
    SCALE_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    # B read as [BLOCK_K, BLOCK_N] tiles straight from its [N, K] rows: K-major, the operand
    # order the FP8 tensor-core product takes, with no transpose in registers (one spilled)
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
    a_scale_rows = a_scale_ptr + offs_m.to(tl.int64) * stride_asm
    b_scale_rows = b_scale_ptr + (offs_n // SCALE_BLOCK_N).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_block in range(0, tl.cdiv(K, BLOCK_K)):
        k = k_block * BLOCK_K + offs_k
        k_valid = k < K
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=m_valid[:, None] & k_valid[None, :],
                    other=0.0)
        b = tl.load(b_cols + k[:, None] * stride_bk, mask=k_valid[:, None] & n_valid[None, :],
                    other=0.0)
        a_scale = tl.load(a_scale_rows + k_block * stride_ask, mask=m_valid, other=0.0)
        b_scale = tl.load(b_scale_rows + k_block * stride_bsk, mask=n_valid, other=0.0)
        if UPCAST:  # the interpreter computes in numpy, which has no FP8
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        block = tl.dot(a, b)  # [BM, BN] fp32
        acc += block * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def quantize_per_token_group(x: torch.Tensor, group: int = GROUP_K
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]): each token's group of
    `group` columns scaled so its largest magnitude is 448 (the "dynamic" scheme)."""
    num_rows, num_cols = x.shape
    num_groups = -(-num_cols // group)
    padded = x.new_zeros(num_rows, num_groups * group, dtype=torch.float32)
    padded[:, :num_cols] = x
    groups = padded.view(num_rows, num_groups, group)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX  # [M, groups]
    quantized = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(num_rows, -1)[:, :num_cols].contiguous(), scale


def _tiles(device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the interpreter's cost is per program, so
    it gets few large ones; on GPU 64 x 128 with a 128-deep FP8 K tile, over 8 warps: each K
    block's product is a second 64 x 128 fp32 tile beside the accumulator, which 4 warps'
    registers cannot hold without spilling (ptxas, sm90: 380 bytes; 8 warps: none)."""
    if device.type != "cuda":
        return 32, 64, 4, 1
    return 64, 128, 8, 3


def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                   b_scale: torch.Tensor, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None, scale_block_n: int = 128) -> torch.Tensor:
    """a (e4m3 [M, K]) @ b (e4m3 [N, K])^T with a_scale [M, ceil(K/128)] and b_scale
    [ceil(N / scale_block_n), ceil(K/128)] -> [M, N] in out_dtype (+ bias [N])."""
    interpreted = check_launchable(a, a_scale, b, b_scale)
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise ValueError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] disagree: {tuple(a.shape)}, {tuple(b.shape)}")
    num_rows, num_cols = a.shape
    num_out = b.shape[0]
    num_k_blocks = -(-num_cols // GROUP_K)
    if a_scale.shape != (num_rows, num_k_blocks):
        raise ValueError(f"a_scale must be [{num_rows}, {num_k_blocks}], got "
                         f"{tuple(a_scale.shape)}")
    if b_scale.shape != (-(-num_out // scale_block_n), num_k_blocks):
        raise ValueError(f"b_scale must be [{-(-num_out // scale_block_n)}, {num_k_blocks}] "
                         f"(scale_block_n {scale_block_n}), got {tuple(b_scale.shape)}")
    if bias is not None and bias.shape != (num_out,):
        raise ValueError(f"bias must be [{num_out}], got {tuple(bias.shape)}")
    out = torch.empty(num_rows, num_out, dtype=out_dtype, device=a.device)
    if num_rows == 0 or num_out == 0:
        return out
    block_m, block_n, num_warps, num_stages = _tiles(a.device)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
    _fp8_block_gemm_kernel[grid](
        a, a_scale, b, b_scale, out, bias if bias is not None else out,
        num_rows, num_out, num_cols,
        a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1),
        b.stride(0), b.stride(1), b_scale.stride(0), b_scale.stride(1),
        out.stride(0), out.stride(1),
        SCALE_BLOCK_N=scale_block_n, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=GROUP_K, UPCAST=interpreted, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, scale_block_n: int = 128) -> torch.Tensor:
    """x [M, K] (any float dtype) times an FP8 weight [N, K]^T: x quantized per token and
    128-column group, then fp8_block_gemm; the result in x's dtype."""
    x_fp8, x_scale = quantize_per_token_group(x)
    return fp8_block_gemm(x_fp8, x_scale, weight, weight_scale.float(), x.dtype, bias,
                          scale_block_n)


def reference_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                         b_scale: torch.Tensor, out_dtype: torch.dtype,
                         bias: torch.Tensor | None = None,
                         scale_block_n: int = 128) -> torch.Tensor:
    """fp8_block_gemm in plain torch: dequantize both operands to fp32, one matmul."""
    def dequantize(t: torch.Tensor, scale: torch.Tensor, rows_per_scale: int) -> torch.Tensor:
        per_row = scale.float().repeat_interleave(rows_per_scale, dim=0)[:t.shape[0]]
        return t.float() * per_row.repeat_interleave(GROUP_K, dim=1)[:, :t.shape[1]]

    out = dequantize(a, a_scale, 1) @ dequantize(b, b_scale, scale_block_n).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
