"""The "cpu" implementations of a decoder block's small ops: pdserve/kernels/csrc/fused_ops.cpp's
add_rms_norm, silu_and_mul and rotary_neox_, one compiled call each instead of several torch
dispatches (pdserve/kernels/cpu_ops.py builds them).

Each takes the arguments of its reference (pdserve/kernels/reference.py) and runs the compiled
kernel where it applies, fp32 rows on the CPU in the layout the kernel reads; any other call (a CUDA
tensor, another dtype, a strided view, interleaved rotary) runs the reference, so choosing
this implementation never changes what an op accepts.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import cpu_ops, reference


def _fp32_cpu_library(x: torch.Tensor) -> ModuleType | None:
    """The compiled ops when they apply to x (an fp32 CPU tensor), else None."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return cpu_ops.load()


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    library = _fp32_cpu_library(x)
    if library is not None and x.dim() == 2 and weight.dtype == torch.float32:
        normed, residual = library.add_rms_norm(x, residual, weight, eps)
        return normed, residual
    return reference.rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    library = _fp32_cpu_library(x)
    if library is not None and x.dim() == 2 and x.stride(-1) == 1:
        return library.silu_and_mul(x)
    return reference.silu_and_mul(x)


def rotary(query: torch.Tensor, key: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
           rotary_dim: int, is_interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rotary's contract; the NeoX layout in fp32 rotates in place, in the caller's
    tensors."""
    library = _fp32_cpu_library(query)
    if (library is not None and not is_interleaved and key.dtype == torch.float32
            and query.stride(-1) == 1 and key.stride(-1) == 1):
        cos, sin = (t.reshape(t.shape[0], t.shape[-1]) for t in cos_sin)
        library.rotary_neox_(query, cos, sin, rotary_dim)
        library.rotary_neox_(key, cos, sin, rotary_dim)
        return query, key
    return reference.rotary(query, key, cos_sin, rotary_dim, is_interleaved)
