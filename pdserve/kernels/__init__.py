"""pdserve.kernels: every kernel op (attention over the paged KV cache, block attention, the
small ops of a decoder block, linear products), each with its plain-torch reference in
pdserve/kernels/reference.py and its implementations by name in one registry
(pdserve/kernels/registry.py).

Attention ops come grouped by backend, the engine's unit of choice for them:

    get_attention_backend("torch")   plain torch (pdserve/kernels/reference.py): the reference
    get_attention_backend("cpu")     decode attention (decode steps and the decode rows of
                                     prefill steps) and KV writes from compiled C++ kernels
                                     that read and write the paged cache in place
                                     (pdserve/kernels/cpu_attention.py), the rest plain torch: the
                                     CPU default where they build
    get_attention_backend("triton")  Triton kernels; on a machine without CUDA they run in
                                     Triton's interpreter (TRITON_INTERPRET=1), for tests

Triton is imported only when a "triton" implementation is asked for, the C++ kernels only when
a CPU one is. This package imports nothing else of pdserve; the engine names the candidates
(pdserve/serve/layers/attention.py picks the backend: PDSERVE_ATTENTION_BACKEND, else triton on
CUDA and cpu on CPU; pdserve/serve/layers/ops.py the other ops).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKEND_NAMES = ("torch", "cpu", "triton")
# In import-dependency order (a module's Triton helpers come from the ones before it).
_TRITON_MODULES = ("paged_tile", "kv_cache_write", "prefill_attention", "decode_attention",
                   "mla_decode", "mla_prefill", "fp8_gemm", "block_attention")


@dataclass(frozen=True)
class AttentionBackend:
    """The six operations the engine needs; signatures in pdserve/kernels/reference.py."""

    name: str
    write_kv_cache: Callable[..., None]
    prefill_attention: Callable[..., torch.Tensor]
    decode_attention: Callable[..., torch.Tensor]
    mla_decode_attention: Callable[..., torch.Tensor]
    mla_prefill_attention: Callable[..., torch.Tensor]
    write_latent_cache: Callable[..., None]


def _enable_interpreter_without_cuda() -> None:
    """Without CUDA, Triton kernels can only run interpreted, and `triton.jit` decides that
    when a function is defined: set the flag, then redefine whatever was defined before."""
    if torch.cuda.is_available():
        return
    was_interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:
        _reinterpret_triton_language()
    if not was_interpreting:
        import importlib

        for name in _TRITON_MODULES:
            module = sys.modules.get(f"{__name__}.{name}")
            if module is not None:  # imported compiled, unusable here: define it again
                importlib.reload(module)


def _reinterpret_triton_language() -> None:
    """Redefine Triton's own @jit library functions (tl.max, tl.sum, tl.zeros, tl.cdiv, ...)
    as interpreted ones. Like every @jit function they chose compiled or interpreted when
    defined, and torch._dynamo (which transformers pulls in) imports triton long before an
    engine picks its attention backend; called from an interpreted kernel, a compiled one
    raises "Cannot call @triton.jit'd outside of the scope of a kernel". Reloading re-runs
    their definitions with the flag now set; tl's re-exports are then pointed at them."""
    import importlib

    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.standard.zeros, InterpretedFunction):
        return
    for module in (tl.standard, tl.random):
        for name, value in vars(importlib.reload(module)).items():
            if isinstance(value, InterpretedFunction) and hasattr(tl, name):
                setattr(tl, name, value)


ATTENTION_OPS = ("write_kv_cache", "prefill_attention", "decode_attention",
                 "mla_decode_attention", "mla_prefill_attention", "write_latent_cache")


@functools.cache
def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called `name` ("torch", "cpu" or "triton"): each of its ops the registry's
    implementation of that name, the torch one where the op has none
    (pdserve/kernels/registry.py)."""
    from . import registry

    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    if name == "cpu" and not registry.is_available("cpu"):
        raise RuntimeError("the cpu backend's kernel could not be built (see the log)")
    ops = {op: registry.implementation(
        op, name if name in registry.implementations(op) else "torch") for op in ATTENTION_OPS}
    return AttentionBackend(name=name, **ops)


def get_block_attention(backend_name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The block attention of an attention backend (pdserve/kernels/partials.py BlockAttention):
    Triton's kernel for "triton" (in the interpreter without CUDA), torch's CPU flash kernel
    for "cpu" (pdserve/kernels/cpu_block_attention.py), the plain-torch reference for "torch"."""
    from . import registry

    if backend_name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {backend_name!r}")
    return registry.implementation("block_attention", backend_name)
