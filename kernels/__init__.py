"""pdserve.kernels: attention over the paged KV cache, by backend.

    get_attention_backend("torch")   plain torch (kernels/reference.py): the reference
    get_attention_backend("cpu")     the torch path, with decode attention (decode steps and
                                     the decode rows of prefill steps) and KV writes from
                                     compiled C++ kernels that read and write the paged cache
                                     in place (kernels/cpu_attention.py): the CPU default
                                     where they build
    get_attention_backend("triton")  Triton kernels; on a machine without CUDA they run in
                                     Triton's interpreter (TRITON_INTERPRET=1), for tests

Triton is imported only when the "triton" backend is asked for, the C++ kernel only when "cpu"
is. This package imports nothing
else of pdserve; the engine picks the name (serve/executor/attention.py: PDSERVE_ATTENTION_BACKEND,
else triton on CUDA and torch on CPU).
"""

from __future__ import annotations

import dataclasses
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
    """The six operations the engine needs; signatures in kernels/reference.py."""

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


@functools.cache
def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called `name` ("torch" or "triton")."""
    if name == "torch":
        from . import reference

        return AttentionBackend(
            name="torch",
            write_kv_cache=reference.write_kv_cache,
            prefill_attention=reference.prefill_attention,
            decode_attention=reference.decode_attention,
            mla_decode_attention=reference.mla_decode_attention,
            mla_prefill_attention=reference.mla_prefill_attention,
            write_latent_cache=reference.write_latent_cache,
        )
    if name == "cpu":
        from . import cpu_attention, cpu_ops

        if cpu_ops.load() is None:
            raise RuntimeError("the cpu backend's kernel could not be built (see the log)")
        return dataclasses.replace(
            get_attention_backend("torch"), name="cpu",
            write_kv_cache=cpu_attention.write_kv_cache,
            prefill_attention=cpu_attention.prefill_attention,
            decode_attention=cpu_attention.decode_attention,
            mla_decode_attention=cpu_attention.mla_decode_attention)
    if name == "triton":
        _enable_interpreter_without_cuda()
        from . import (
            decode_attention,
            kv_cache_write,
            mla_decode,
            mla_prefill,
            prefill_attention,
        )

        return AttentionBackend(
            name="triton",
            write_kv_cache=kv_cache_write.write_kv_cache,
            prefill_attention=prefill_attention.prefill_attention,
            decode_attention=decode_attention.decode_attention,
            mla_decode_attention=mla_decode.mla_decode_attention,
            mla_prefill_attention=mla_prefill.mla_prefill_attention,
            write_latent_cache=kv_cache_write.write_latent_cache,
        )
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")

