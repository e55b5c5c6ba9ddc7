"""x W^T on the CPU: the "cpu", "amx" and "onednn" implementations of the registry's linear
and prepack ops (their reference: pdserve/kernels/reference.py linear, prepack).

A linear layer keeps its plain weight [out, in] and, once loaded, a packed copy that `prepack`
makes (the same implementation family must then multiply by it):

    "cpu"     pdserve's panels (`pack_panels`) where the kernels compiled for AVX-512: every
              row count multiplies from them (pdserve/kernels/csrc/skinny_gemm.cpp panel_linear);
              elsewhere oneDNN's blocked layout for the many rows of a prefill, while a decode
              step's few rows (up to `skinny_max_rows`) stream the plain weight through the
              skinny kernel
    "amx"     "cpu", and from `amx_min_rows` rows on, bf16 panels multiply on AMX
              (pdserve/kernels/csrc/amx_gemm.cpp: x split in three bf16 pieces, fp32 sums)
    "onednn"  oneDNN's blocked layout for every row count (torch's own CPU matmul library)

Which one runs is the registry's choice (pdserve/kernels/registry.py choose).
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch
import torch.nn.functional as F

from . import cpu_ops


def library() -> ModuleType:
    """The compiled CPU ops; only called where the registry found them built."""
    module = cpu_ops.load()
    assert module is not None, "the cpu linear implementations need the compiled CPU ops"
    return module


@functools.cache
def skinny_max_rows() -> int:
    """Up to this many rows the skinny product reads the plain weight; past it oneDNN's packed
    layout is the faster. A property of the build (its vector width), reported by it."""
    module = cpu_ops.load()
    return int(module.skinny_max_rows()) if module is not None else 0


@functools.cache
def amx_min_rows() -> float:
    """From this many rows on, bf16 panels multiply on AMX; infinity where the CPU or the
    build has none. A step below it keeps the panels (the fused decode loop decides alike,
    pdserve/serve/layers/fused_decode.py), so a row's bits change only where its step crosses it."""
    module = cpu_ops.load()
    if module is None or not hasattr(module, "amx_available") or not module.amx_available():
        return math.inf
    return int(module.amx_min_rows())


def panel_width() -> int:
    """Columns per panel; 0 where the kernels did not compile for AVX-512 (no panels)."""
    module = cpu_ops.load()
    return int(module.panel_width()) if module is not None else 0


def panel_dtype(weight: torch.Tensor) -> torch.dtype:
    """What the panels store: bf16 or fp16 where every value of the fp32 weight is exactly one
    of theirs (a half-precision checkpoint run in float32, see pdserve/serve/executor/loader.py
    resolve_dtype), else fp32. The kernel widens them exactly and multiplies in fp32, so the
    products are the same bits either way, read in half the bytes."""
    for half in (torch.bfloat16, torch.float16):
        narrowed = weight.detach().to(half)
        if torch.equal(narrowed.to(weight.dtype), weight.detach()):
            return half
    return weight.dtype


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """W [N, K] in the panel layout of pdserve/kernels/csrc/skinny_gemm.cpp `panel_linear`: panel p
    is columns [width p, width p + w) of W^T stored k-major ([K, w] contiguous; w = width
    but for the last panel's N mod width), the panels one after another in one flat tensor
    of N K floats."""
    n, k = weight.shape
    full = n // width * width
    parts = [weight[:full].reshape(-1, width, k).transpose(1, 2).reshape(-1)]
    if full < n:
        parts.append(weight[full:].t().reshape(-1))
    return torch.cat(parts)


def unpack(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The plain [out, in] weight back from either packed layout (tests compare it)."""
    if packed.is_mkldnn:
        return packed.to_dense()
    n, k = shape
    width = panel_width()
    full = n // width * width
    packed = packed.float()  # panels may store bf16 or fp16 (panel_dtype)
    head = packed[: full * k].view(-1, k, width).transpose(1, 2).reshape(full, k)
    return torch.cat([head, packed[full * k:].view(k, n - full).t()])


def onednn_prepack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of W (an opaque mkldnn tensor of the same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """The "cpu" packed copy: panels where the build has them, else oneDNN's layout."""
    width = panel_width()
    if width:
        return pack_panels(weight.detach(), width).to(panel_dtype(weight))
    return onednn_prepack(weight)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b from oneDNN's packed copy where there is one, else torch's."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """The "cpu" product: the panels when W has them (any row count), else the skinny kernel
    for a decode step's few rows (plain fp32 W, fp32 x on the CPU), else onednn_linear."""
    return _linear(x, weight, bias, packed, math.inf)


def amx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
    """The "amx" product: `linear`, with bf16 panels on AMX from amx_min_rows rows on."""
    return _linear(x, weight, bias, packed, amx_min_rows())


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: torch.Tensor | None, amx_from: float) -> torch.Tensor:
    if packed is not None and not packed.is_mkldnn:  # panels
        if x.dtype != torch.float32:
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.stride(1) == 1 else rows.contiguous()
        module = library()
        if packed.dtype == torch.bfloat16 and amx_from <= rows.shape[0]:
            y = module.amx_panel_linear(rows, packed, bias)
        else:
            y = module.panel_linear(rows, packed, bias)
        return y.view(*x.shape[:-1], y.shape[-1])
    if (x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"
            and weight.dtype == torch.float32 and weight.is_contiguous()
            and x.shape[0] <= skinny_max_rows()):
        return library().skinny_linear(x if x.stride(1) == 1 else x.contiguous(), weight, bias)
    return onednn_linear(x, weight, bias, packed)
