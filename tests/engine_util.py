"""Helpers for tests that drive Engine objects step by step."""

from __future__ import annotations

from pdserve.serve.engine import Engine
from pdserve.serve.request import RequestOutput


def run_to_completion(engine: Engine) -> dict[str, list[RequestOutput]]:
    """Step until every request finished; each request's outputs (deltas) in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def token_ids(outputs: list[RequestOutput]) -> list[int]:
    """All output tokens of one request's deltas."""
    return [t for out in outputs for t in out.outputs[0].token_ids]
