"""pdserve.serve: the engine inside every worker.

`from pdserve.serve import LLM, SamplingParams` works without importing torch or transformers
until one of them is used (names resolve lazily, PEP 562).

Its floors, bottom to top; a floor imports only those below it (tests/repo/test_architecture.py):

    config    config.py, default_model.py: frozen dataclasses, the embedded model's files
    cpu       huge pages and core lending: what a CPU host needs of its memory and cores
    layers    parallel linears and their weight loaders, attention, norms and rotary,
              pipeline stages, FP8, collectives, the kernel-op choice, the CPU fused loop
    models    architectures with checkpoint names, built from the layers
    executor  loads a model (the MTP layer too), owns the KV pool, runs a step on every rank
    engine    requests, the token scheduler, the block manager, sampling, the roles' ends
    worker    the process: an engine behind a socket and the hand-off (pdserve.handoff)
    llm       the offline LLM API (and this package's re-exports)

Why this order, as vLLM's: sharding lives in the layers (a model names parameters, its
layers cut them), so the layers sit below the models and know none; the executor builds a
model from a checkpoint and runs it, so it sits above the models and knows no request: what
it needs of a step (which rows get logits, how many drafts a verify row may hold) it reads
from the step message and the config; the engine schedules requests onto the executor; the
worker serves an engine over the wire; the offline LLM drives an engine in-process and is
what a user imports, so nothing below imports it. The CPU paths sit beside what they speed:
the fused decode loop with the layers it fuses, the measured path choice with the rank it
times (executor/cpu_tuning.py); what is left in cpu/ knows no model, so it sits low.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.serve.engine.engine import Engine
    from pdserve.serve.engine.request import CompletionOutput, RequestOutput
    from pdserve.serve.llm import LLM

_LAZY = {
    "LLM": "pdserve.serve.llm",
    "Engine": "pdserve.serve.engine.engine",
    "SamplingParams": "pdserve.protocol.sampling",
    "RequestOutput": "pdserve.serve.engine.request",
    "CompletionOutput": "pdserve.serve.engine.request",
}

__all__ = ["LLM", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
