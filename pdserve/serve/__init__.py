"""pdserve.serve: the engine inside every worker.

`from pdserve.serve import LLM, SamplingParams` works without importing torch or transformers
until one of them is used (names resolve lazily, PEP 562).
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
