"""Helpers for tests that drive Engine objects step by step."""

from __future__ import annotations

import torch

from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.request import RequestOutput
from pdserve.serve.engine.roles import PrefillRole
from pdserve.serve.layers.parallel import unpack


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


class CopyingSaver:
    """A prefill role's KV saver that copies each handed-off request's blocks out of the pool
    at the moment the engine hands it off (its blocks are freed right after), as a store
    save would; `blocks[request_id]` is then one whole-head tensor per layer."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.blocks: dict[str, list] = {}
        self.block_ids: dict[str, list[int]] = {}

    def start_layerwise_save(self, requests):
        return None

    def save_handoff(self, request, block_ids: list[int], block_keys: list[bytes]) -> None:
        assert self.engine is not None, "attach the saver: saver.engine = engine"
        num_blocks = -(-request.num_prompt_tokens // self.engine.block_manager.block_size)
        self.block_ids[request.request_id] = list(block_ids[:num_blocks])
        self.blocks[request.request_id] = self.engine.runner.read_kv_blocks(
            block_ids[:num_blocks])


def prefill_engine(*args, **kwargs) -> tuple[Engine, CopyingSaver]:
    """Engine(*args, **kwargs) in the prefill role, copying each hand-off's KV blocks."""
    saver = CopyingSaver()
    engine = Engine(*args, role=PrefillRole(saver), **kwargs)
    saver.engine = engine
    return engine, saver


def assert_tied_head(model) -> None:
    """A tied LM head reads the embedding's rows: the same tensor, plus (CPU prepacking,
    pdserve/serve/layers/parallel.py) a packed copy of exactly those rows."""
    head, embedding = model.lm_head, model.model.embed_tokens.weight
    assert head.weight is embedding
    assert head.packed is None or torch.equal(unpack(head.packed, embedding.shape), embedding)
