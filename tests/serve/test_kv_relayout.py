"""KV blocks move between different TP degrees: a TP=2 prefill hands off to a TP=1 decode
(whole-head blocks gathered from both ranks; an MLA latent, one plane and one "head", is whole
on rank 0), and the greedy tokens equal a TP=1 colocated run; a TP=2 pool written whole or a
layer at a time reads back as written."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_util import prefill_engine, run_to_completion, token_ids
from transformers import AutoTokenizer

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.engine.engine import Engine

PROMPTS = [list(range(3, 3 + n)) for n in (5, 19, 40)]


def _configs(model_dir, tp: int) -> tuple:
    return (ModelConfig(str(model_dir)), CacheConfig(block_size=16, num_blocks=32),
            ParallelConfig(tensor_parallel_size=tp))


def _engine(model_dir, tp: int) -> Engine:
    return Engine(*_configs(model_dir, tp), tokenizer=AutoTokenizer.from_pretrained(model_dir))


@pytest.mark.parametrize("architecture", ["llama", "deepseek_v3"])
def test_tp2_prefill_hands_off_to_tp1_decode(architecture, make_model_dir):
    model_dir = make_model_dir(architecture, **({} if architecture == "llama" else {"seed": 3}))
    params = SamplingParams(temperature=0, max_tokens=8)
    colocated = _engine(model_dir, 1)
    decode = _engine(model_dir, 1)  # a decode engine differs only in how requests come in
    prefill, saver = prefill_engine(*_configs(model_dir, 2),
                                    tokenizer=AutoTokenizer.from_pretrained(model_dir))
    try:
        for i, prompt in enumerate(PROMPTS):
            colocated.add_request(prompt, params, f"c{i}")
            prefill.add_request(prompt, params, f"p{i}")
        expected = {rid: token_ids(outs)
                    for rid, outs in run_to_completion(colocated).items()}
        handoffs = {rid: outs[-1] for rid, outs in run_to_completion(prefill).items()}
        for i, prompt in enumerate(PROMPTS):
            handoff = handoffs[f"p{i}"].kv_handoff
            num_blocks = -(-len(prompt) // 16)
            blocks = saver.blocks[f"p{i}"]  # read from both ranks as the request handed off
            # whole heads from both ranks: the TP=1 pool's layout
            planes = 2 if architecture == "llama" else 1
            assert blocks[0].shape == (planes, num_blocks, 16, prefill.spec.num_kv_heads,
                                       prefill.spec.head_dim)
            ids = decode.add_prefilled_request(f"d{i}", prompt, params,
                                               [handoff.first_token_id])
            decode.runner.write_kv_blocks(ids, blocks)
            # and back: the TP=1 copy equals what the TP=2 ranks held
            for a, b in zip(decode.runner.read_kv_blocks(ids), blocks, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        decoded = run_to_completion(decode)
        for i in range(len(PROMPTS)):
            first = handoffs[f"p{i}"].outputs[0].token_ids
            rest = token_ids(decoded[f"d{i}"])
            assert first + rest == expected[f"c{i}"]
        # a TP=2 pool written from whole-head blocks reads back identically
        ids = list(range(3))
        fresh = [torch.randn_like(b[:, :3]) for b in blocks]
        prefill.runner.write_kv_blocks(ids, fresh)
        for a, b in zip(prefill.runner.read_kv_blocks(ids), fresh, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # ...and so does one written a layer at a time (a followed hand-off's layers as they
        # land), each rank keeping its heads of each layer, the other blocks untouched
        assert prefill.runner.can_write_kv_layers and not prefill.runner.holds_whole_pool
        others = prefill.runner.read_kv_blocks([3, 4])
        layered = [torch.randn_like(b[:, :3]) for b in blocks]
        for layer, layer_blocks in enumerate(layered):
            prefill.runner.write_kv_layer(layer, [5, 1, 2], layer_blocks)
        for a, b in zip(prefill.runner.read_kv_blocks([5, 1, 2]), layered, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(prefill.runner.read_kv_blocks([3, 4]), others, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        for engine in (prefill, decode, colocated):
            engine.shutdown()
