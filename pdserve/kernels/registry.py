"""Every kernel op, its implementations by name, and the one place that chooses among them.

    op                     torch (reference.py)  cpu                    triton           other
    write_kv_cache         yes                   cpu_attention          kv_cache_write
    prefill_attention      yes                   cpu_attention          prefill_attention
    decode_attention       yes                   cpu_attention          decode_attention
    mla_decode_attention   yes                   cpu_attention          mla_decode
    mla_prefill_attention  yes                                          mla_prefill
    write_latent_cache     yes                                          kv_cache_write
    block_attention        yes                   cpu_block_attention    block_attention
    rms_norm               yes                   cpu_layer_ops
    silu_and_mul           yes                   cpu_layer_ops
    rotary                 yes                   cpu_layer_ops
    linear                 yes                   cpu_linear                              amx, onednn
    prepack                yes                   cpu_linear                              onednn

Every op's "torch" implementation is its plain-torch reference in pdserve/kernels/reference.py,
which also documents its arguments; the others take the same arguments and give the same results
(to the tolerance their tests state). An implementation is imported only when asked for, so
Triton loads only where a "triton" one is chosen, the C++ library only where a CPU one is.

`choose(op, candidates)` is the one decision: the caller (the engine, pdserve/serve/layers/ops.py)
names the implementations it allows, best first, and today the first one this machine can
run wins. It is also the seam where a choice by measurement goes (time each candidate once
on the machine at hand, cache the winner): callers need not change.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "write_kv_cache": {"torch": "reference", "cpu": "cpu_attention",
                       "triton": "kv_cache_write"},
    "prefill_attention": {"torch": "reference", "cpu": "cpu_attention",
                          "triton": "prefill_attention"},
    "decode_attention": {"torch": "reference", "cpu": "cpu_attention",
                         "triton": "decode_attention"},
    "mla_decode_attention": {"torch": "reference", "cpu": "cpu_attention",
                             "triton": "mla_decode"},
    "mla_prefill_attention": {"torch": "reference", "triton": "mla_prefill"},
    "write_latent_cache": {"torch": "reference", "triton": "kv_cache_write"},
    "block_attention": {"torch": "reference", "cpu": "cpu_block_attention",
                        "triton": "block_attention"},
    "rms_norm": {"torch": "reference", "cpu": "cpu_layer_ops"},
    "silu_and_mul": {"torch": "reference", "cpu": "cpu_layer_ops"},
    "rotary": {"torch": "reference", "cpu": "cpu_layer_ops"},
    "linear": {"torch": "reference", "cpu": "cpu_linear", "amx": "cpu_linear:amx_linear",
               "onednn": "cpu_linear:onednn_linear"},
    "prepack": {"torch": "reference", "cpu": "cpu_linear",
                "onednn": "cpu_linear:onednn_prepack"},
}
"""op -> implementation name -> "module" (the function is named as the op) or
"module:function", the module in this package."""


def implementations(op: str) -> tuple[str, ...]:
    """The names of op's implementations."""
    return tuple(_entries(op))


def is_available(implementation: str) -> bool:
    """Whether this machine can run implementations of that name (not imported here)."""
    if implementation in ("cpu", "amx"):
        from . import cpu_ops

        if cpu_ops.load() is None:
            return False
        if implementation == "amx":
            from . import cpu_linear

            return cpu_linear.amx_min_rows() != float("inf")
        return True
    if implementation == "onednn":
        import torch

        return bool(torch.backends.mkldnn.is_available())
    if implementation == "triton":
        return importlib.util.find_spec("triton") is not None
    return implementation == "torch"


def choose(op: str, candidates: Sequence[str]) -> str:
    """The implementation of `op` to run, out of `candidates` (best first): the first that op
    has and this machine can run. Raises ValueError when there is none."""
    entries = _entries(op)
    for name in candidates:
        if name in entries and is_available(name):
            return name
    raise ValueError(f"no implementation of {op!r} among {tuple(candidates)} runs here; "
                     f"it has {tuple(entries)}")


def resolve(op: str, candidates: Sequence[str]) -> Callable[..., Any]:
    """The function that implements `op`, chosen out of `candidates`."""
    return implementation(op, choose(op, candidates))


@functools.cache
def implementation(op: str, name: str) -> Callable[..., Any]:
    """The function of op's implementation `name`, imported on first use (ValueError for an
    op or name the registry does not know)."""
    target = _entries(op).get(name)
    if target is None:
        raise ValueError(f"{op!r} has no {name!r} implementation; it has "
                         f"{tuple(_entries(op))}")
    module_name, _, function = target.partition(":")
    if name == "triton":
        from . import _enable_interpreter_without_cuda

        _enable_interpreter_without_cuda()
    module = importlib.import_module(f"{__package__}.{module_name}")
    return getattr(module, function or op)


def _entries(op: str) -> dict[str, str]:
    entries = IMPLEMENTATIONS.get(op)
    if entries is None:
        raise ValueError(f"unknown kernel op {op!r}; the ops are {tuple(IMPLEMENTATIONS)}")
    return entries
