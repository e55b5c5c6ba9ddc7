"""Prefill -> decode hand-off at the engine level: a prefill-role engine stops after the first
token, a decode-role engine continues (from copied KV, or by recomputing when the KV is
missing), and the tokens equal a colocated run, greedy and seeded."""

from __future__ import annotations

import pytest
from helpers.engine_util import prefill_engine, run_to_completion, token_ids
from transformers import AutoTokenizer

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.roles import make_role

PROMPTS = [list(range(5, 5 + n)) for n in (1, 7, 16, 33)]


def _configs(model_dir) -> tuple:
    return ModelConfig(str(model_dir)), CacheConfig(block_size=8, num_blocks=64)


@pytest.fixture(scope="module")
def engines(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    engines = {role: Engine(*_configs(llama_dir), tokenizer=tokenizer, role=make_role(role))
               for role in ("colocated", "decode")}
    # a decode worker that schedules each step while the one before runs (overlap.py)
    engines["decode-async"] = Engine(*_configs(llama_dir), None,
                                     SchedulerConfig(async_scheduling=True),
                                     tokenizer=tokenizer, role=make_role("decode"))
    assert engines["decode-async"].overlap is not None
    engines["prefill"], engines["saver"] = prefill_engine(*_configs(llama_dir),
                                                          tokenizer=tokenizer)
    yield engines
    for role in ("colocated", "prefill", "decode", "decode-async"):
        engines[role].shutdown()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10),
    SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=10),
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("with_kv", [True, False], ids=["kv-copied", "recompute"])
@pytest.mark.parametrize("decode_engine", ["decode", "decode-async"])
def test_handoff_continues_exactly(engines, params, with_kv, decode_engine):
    colocated, prefill, decode = engines["colocated"], engines["prefill"], engines[decode_engine]
    saver = engines["saver"]
    for i, prompt in enumerate(PROMPTS):
        colocated.add_request(prompt, params, f"c{i}")
        prefill.add_request(prompt, params, f"p{i}")
    expected = {rid: token_ids(outs)
                for rid, outs in run_to_completion(colocated).items()}
    prefilled = run_to_completion(prefill)
    for i, prompt in enumerate(PROMPTS):
        [last] = prefilled[f"p{i}"]
        assert last.outputs[0].finish_reason == "handoff"
        handoff = last.kv_handoff
        assert len(handoff.block_keys) == len(prompt) // 8  # full blocks only
        assert handoff.num_output_tokens == 1
        first = [handoff.first_token_id]
        assert last.outputs[0].token_ids == first
        if with_kv:
            block_ids = decode.add_prefilled_request(f"d{i}", prompt, params, first)
            decode.runner.write_kv_blocks(block_ids, saver.blocks.pop(f"p{i}"))
        else:
            decode.add_continued_request(f"d{i}", prompt, params, first)
    decoded = run_to_completion(decode)
    for i in range(len(PROMPTS)):
        first = prefilled[f"p{i}"][0].outputs[0].token_ids
        rest = token_ids(decoded[f"d{i}"])
        assert first + rest == expected[f"c{i}"]
    for engine in (colocated, prefill, decode):
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("num_resumed", [1, 4], ids=["handoff", "migration"])
def test_continued_request_reports_logprobs_for_every_token_it_samples(engines, num_resumed):
    """Outputs sampled elsewhere (a hand-off's first token, a migration's streamed ones) have
    no logprobs here; every token this engine samples has its entry, and the continuation
    equals the colocated run's tokens and logprobs."""
    colocated, decode = engines["colocated"], engines["decode"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    prompt = PROMPTS[2]
    colocated.add_request(prompt, params, "full")
    [full] = [outs for outs in run_to_completion(colocated).values()]
    tokens = token_ids(full)
    expected = [entry for out in full for entry in out.outputs[0].logprobs]
    decode.add_continued_request("cont", prompt, params, tokens[:num_resumed])
    outs = run_to_completion(decode)["cont"]
    assert token_ids(outs) == tokens[num_resumed:]
    for out in outs:
        assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
    got = [entry for out in outs for entry in out.outputs[0].logprobs]
    assert [e[t].logprob for e, t in zip(got, tokens[num_resumed:], strict=True)] == \
        pytest.approx([e[t].logprob for e, t in zip(expected[num_resumed:],
                                                    tokens[num_resumed:], strict=True)],
                      abs=1e-4)
