"""FP8 (e4m3): block-scaled weights as DeepSeek released them, and the FP8 KV cache.

Weights. A checkpoint whose config.json says

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

stores each quantized Linear as `weight` (float8_e4m3fn [out, in]) and `weight_scale_inv`
(float32 [ceil(out/128), ceil(in/128)]); the real weight is weight * scale, block by block:

              in:   0 ........ 127 | 128 ....... 255 | 256 .. in-1 (a partial edge block)
    out   0..127    scale[0, 0]    | scale[0, 1]     | scale[0, 2]
        128..255    scale[1, 0]    | scale[1, 1]     | scale[1, 2]

Which modules are quantized is read off the checkpoint (every `*.weight_scale_inv`); the
others (norms, embeddings, the MoE router, the LM head) load as before. The loader turns
those linear layers into FP8 ones before loading (`convert_linears`): the weight parameter
becomes float8_e4m3fn and a `weight_scale_inv` parameter joins it.

In memory the scale is kept per output row, [out_per_rank, ceil(in_per_rank/128)] (the grid
row of block i repeated for its 128 rows): a fused projection (q|k|v, gate|up) whose parts
are not multiples of 128 rows, or a column-parallel split at any row, stays exact, and the
extra memory is 4 bytes per 128 weight bytes (3%). Input columns are split (row-parallel
layers) only on 128-column boundaries: a TP degree that cuts a block is refused.

Compute. CPU has no FP8 matmul: each call dequantizes the layer's weight to the activation
dtype and multiplies (the weights stay FP8 in memory, a quarter of fp32: one layer's dense
copy lives only during its call). CUDA runs pdserve/kernels/fp8_gemm.py: activations are quantized
per token and 128-column group on the fly ("dynamic"), and a Triton GEMM multiplies FP8 by
FP8 and applies both scales per K block.

KV cache. `kv_cache_dtype="fp8"` (alias fp8_e4m3) keeps the paged pool in float8_e4m3fn,
half of bf16's bytes. The scale is per tensor and fixed at 1.0 (vLLM's default k_scale /
v_scale when a checkpoint carries none): values are clamped to e4m3's +-448 and rounded to
3 mantissa bits when written, and every attention path reads them back exactly. K/V and
MLA latents of the models served sit well inside that range (RMS-normed latents, rotary
keys), so the loss is the rounding, about 2^-4 relative.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.serve.config import KV_CACHE_DTYPES

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
WEIGHT_SCALE_NAME = "weight_scale_inv"



def kv_cache_dtype_name(kv_cache_dtype: str, model_dtype: str) -> str:
    """The torch dtype name the KV pool holds (e.g. "float8_e4m3fn"), from the config value."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                         f"{kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else "float8_e4m3fn"


# ---- FP8 weights -------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8WeightConfig:
    """A checkpoint's quantization_config, as DeepSeek-V3 writes it (only that form)."""

    block_size: tuple[int, int] = (128, 128)  # (rows, columns) of weight per scale

    @classmethod
    def from_hf(cls, quantization: Any, where: str) -> Fp8WeightConfig:
        """Parse and check config.json's quantization_config; ValueError names what is not
        supported."""
        if not isinstance(quantization, Mapping):
            raise ValueError(f"{where}: quantization_config must be an object, got "
                             f"{quantization!r}")
        method = quantization.get("quant_method")
        if method != "fp8":
            raise ValueError(f"{where} is a {method or 'quantized'} checkpoint; pdserve loads "
                             "fp8 (block-scaled, as DeepSeek released) or float32/bfloat16/"
                             "float16 weights")
        fmt = quantization.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{where}: fp8 fmt {fmt!r} is not supported (e4m3)")
        scheme = quantization.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"{where}: fp8 activation_scheme {scheme!r} is not supported "
                             "(dynamic)")
        block = quantization.get("weight_block_size")
        if (not isinstance(block, list | tuple) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}: fp8 needs weight_block_size [rows, columns] (per-tensor"
                             f" fp8 is not supported), got {block!r}")
        return cls(block_size=(int(block[0]), int(block[1])))


def block_quantize(weight: torch.Tensor, block_size: tuple[int, int] = (128, 128)
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [out, in] as the release stores it: (float8_e4m3fn [out, in],
    weight_scale_inv float32 [ceil(out/bn), ceil(in/bk)]) with weight ~= fp8 * scale per
    block, each block's largest magnitude mapped to 448. Tests build checkpoints with it."""
    bn, bk = block_size
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // bn), -(-in_features // bk)
    padded = weight.new_zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:out_features, :in_features] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [rows, cols]
    scale = amax / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (quantized.view(rows * bn, cols * bk)[:out_features, :in_features].contiguous(),
            scale)


def block_dequantize(weight: torch.Tensor, scale: torch.Tensor,
                     block_size: tuple[int, int] = (128, 128),
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight * scale per block, scale the checkpoint grid [ceil(out/bn), ceil(in/bk)]."""
    out_features, in_features = weight.shape
    bn, bk = block_size
    per_row = scale.float().repeat_interleave(bn, dim=0)[:out_features]
    per_element = per_row.repeat_interleave(bk, dim=1)[:, :in_features]
    return (weight.float() * per_element).to(dtype)


def scale_shard(grid: Any, row_start: int, num_rows: int, col_start: int, num_cols: int,
                block_size: tuple[int, int], what: str) -> torch.Tensor:
    """The per-row scales [num_rows, ceil(num_cols/bk)] of weight rows [row_start, +num_rows)
    and columns [col_start, +num_cols), read from a checkpoint grid (a tensor or the lazy
    safetensors view: only the grid rows/columns needed are read). Columns must start on a
    block boundary and cover whole blocks (or run to the end of the weight)."""
    bn, bk = block_size
    grid_rows, grid_cols = int(grid.shape[0]), int(grid.shape[1])
    ends_in_last_block = col_start + num_cols > (grid_cols - 1) * bk
    if col_start % bk or (num_cols % bk and not ends_in_last_block):
        raise ValueError(
            f"{what}: an FP8 weight split at input column {col_start} (+{num_cols}) cuts its "
            f"{bn}x{bk} scale blocks; choose a tensor_parallel_size that splits the input "
            f"columns on {bk}-column boundaries")
    first_row, last_row = row_start // bn, (row_start + num_rows - 1) // bn
    first_col, num_col_blocks = col_start // bk, -(-num_cols // bk)
    if last_row >= grid_rows or first_col + num_col_blocks > grid_cols:
        raise ValueError(f"{what}: weight_scale_inv {grid_rows}x{grid_cols} does not cover "
                         f"rows [{row_start}, {row_start + num_rows}) and columns "
                         f"[{col_start}, {col_start + num_cols})")
    part = grid.narrow(0, first_row, last_row - first_row + 1)
    part = torch.as_tensor(part).narrow(1, first_col, num_col_blocks).float()
    per_row = part.repeat_interleave(bn, dim=0)
    offset = row_start - first_row * bn
    return per_row[offset:offset + num_rows]


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    block_k: int) -> torch.Tensor:
    """weight (FP8 [N, K]) times its per-row scales [N, ceil(K/block_k)], in `dtype`."""
    num_cols = weight.shape[1]
    per_element = scale.repeat_interleave(block_k, dim=1)[:, :num_cols]
    return (weight.to(torch.float32) * per_element).to(dtype)


def has_fp8_matmul(device: torch.device) -> bool:
    """FP8 tensor-core products: sm89 (Ada) and later."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, block_k: int) -> torch.Tensor:
    """x W^T + b for an FP8 W with per-row block scales: Triton FP8 GEMM on CUDA (block_k
    128), dequantize-then-matmul elsewhere."""
    if x.is_cuda and block_k == 128 and x.dim() == 2 and has_fp8_matmul(x.device):
        from pdserve.kernels.fp8_gemm import fp8_linear as triton_fp8_linear

        return triton_fp8_linear(x, weight, scale, bias, scale_block_n=1)
    return torch.nn.functional.linear(x, dequantize_rows(weight, scale, x.dtype, block_k), bias)


# ---- turning a built model's linear layers into FP8 ones ----------------------------------


def quantized_module_names(tensor_names: Iterable[str],
                           packed: Mapping[str, tuple[str, str | int]]) -> set[str]:
    """Module names (the model's, fused parts renamed) of every checkpoint weight that has a
    weight_scale_inv beside it: `...self_attn.q_proj.weight_scale_inv` -> `...qkv_proj`."""
    suffix = "." + WEIGHT_SCALE_NAME
    names = set()
    for name in tensor_names:
        if not name.endswith(suffix):
            continue
        module = name[: -len(suffix)]
        for checkpoint_part, (fused_part, _) in packed.items():
            if module.endswith("." + checkpoint_part):
                module = module[: -len(checkpoint_part)] + fused_part
                break
        names.add(module)
    return names


def convert_linears(model: nn.Module, module_names: set[str], config: Fp8WeightConfig,
                    skips: Any = lambda name: False) -> int:
    """Make each named linear layer an FP8 one: weight float8_e4m3fn, plus weight_scale_inv
    [rows, ceil(columns / block)] fp32, each with its layer's weight_loader. Names the model
    lacks must be ones the loader skips (skips(name + ".weight")); returns the count."""
    from pdserve.serve.layers.parallel import PrepackedLinear, fp8_linear_types

    modules = dict(model.named_modules())
    converted = 0
    for name in sorted(module_names):
        module = modules.get(name)
        if module is None:
            if skips(f"{name}.weight"):
                continue
            raise ValueError(f"the checkpoint has FP8 scales for {name!r}, which the model "
                             "does not have")
        if not isinstance(module, PrepackedLinear) or type(module) not in fp8_linear_types():
            raise ValueError(f"{name!r} ({type(module).__name__}) is FP8 in the checkpoint, "
                             "but pdserve runs only its linear layers in FP8")
        weight = module.weight
        weight.data = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        rows, cols = weight.shape
        scale = nn.Parameter(torch.empty(rows, math.ceil(cols / config.block_size[1]),
                                         dtype=torch.float32, device=weight.device),
                             requires_grad=False)
        scale.fp8_block_size = config.block_size  # marks it for the weight loaders
        scale.weight_loader = getattr(weight, "weight_loader", module.scale_loader)
        module.weight_scale_inv = scale
        module.fp8_block_k = config.block_size[1]
        converted += 1
    return converted
