"""The simulated engine (pdserve/serve/executor/sim_runner.py): a step lasts the profile's
predicted time, and tokens depend only on the sequence, through the KV the blocks hold, so a
hand-off, a recompute and a colocated run give the same tokens, and a block that arrives
wrong changes them."""

from __future__ import annotations

import json

import pytest
from helpers.engine_util import prefill_engine, run_to_completion, token_ids

from pdserve.planner.latency_profile import ProfileError, load_profile
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SimConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.roles import make_role
from pdserve.serve.executor import sim_runner
from pdserve.serve.executor.sim_runner import SimRunner, StepFeatures, StepTimes

PROFILE = {
    "model": "test", "hardware": "test", "kv_bytes_per_token": 4096,
    "prefill": {"1": {"intercept_s": 0.010, "per_token_s": 1e-4, "per_attention_s": 1e-7},
                "2": {"intercept_s": 0.008, "per_token_s": 5e-5, "per_attention_s": 5e-8}},
    "decode": {"1": {"intercept_s": 0.020, "per_context_token_s": 1e-6,
                     "per_sequence_s": 3e-4},
               "2": {"intercept_s": 0.015, "per_context_token_s": 5e-7,
                     "per_sequence_s": 2e-4}},
}
PROMPTS = [list(range(5, 5 + n)) for n in (1, 7, 16, 33)]


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("sim") / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return str(path)


def _runner(llama_dir, profile_path, speedup=1.0, tp=1, kv_fraction=0.5) -> SimRunner:
    return SimRunner(ModelConfig(str(llama_dir)), CacheConfig(block_size=8, num_blocks=64),
                     ParallelConfig(tensor_parallel_size=tp),
                     SimConfig(profile_path, speedup=speedup, kv_fraction=kv_fraction))


def _engine(llama_dir, profile_path, role="colocated", **kwargs):
    runner = _runner(llama_dir, profile_path, **kwargs)
    configs = (ModelConfig(str(llama_dir)), CacheConfig(block_size=8, num_blocks=64))
    if role == "prefill":
        return prefill_engine(*configs, runner=runner)
    return Engine(*configs, runner=runner, role=make_role(role))


class FakeClock:
    """perf_counter and sleep of sim_runner's `time`: only sleeping moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _chunk(rid, tokens, start, need_logits=True) -> SeqChunk:
    blocks = list(range(-(-(start + len(tokens)) // 8)))
    offset = {"a": 0, "b": 16, "c": 32}[rid]
    return SeqChunk(rid, tokens, start, [offset + b for b in blocks], need_logits)


@pytest.mark.parametrize("speedup", [1.0, 4.0])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_step_lasts_the_profiles_time(llama_dir, profile_path, monkeypatch, speedup, tp):
    clock = FakeClock()
    monkeypatch.setattr(sim_runner, "time", clock)
    runner = _runner(llama_dir, profile_path, speedup=speedup, tp=tp)
    entry = load_profile(profile_path)
    prefill, decode = entry.prefill[tp], entry.decode[tp]
    steps = {
        # one prompt of 20 tokens, one of 12 after 8 cached: Σ q·k = 20·20 + 12·20
        "prefill": (StepInput([_chunk("a", list(range(20)), 0), _chunk("b", [1] * 12, 8)]),
                    prefill(32, 20 * 20 + 12 * 20)),
        "decode": (StepInput([_chunk("a", [3], 20), _chunk("c", [4], 40)]),
                   decode(21 + 41, 2)),
        # a prefill chunk beside a decode: the larger intercept, every marginal term
        "mixed": (StepInput([_chunk("b", [5] * 4, 20), _chunk("a", [6], 21)]),
                  max(prefill.intercept, decode.intercept)
                  + prefill.coefs[0] * 4 + prefill.coefs[1] * 4 * 24
                  + decode.coefs[0] * 22 + decode.coefs[1] * 1),
    }
    for name, (step, expected) in steps.items():
        start = clock.now
        logits = runner.execute(step)
        assert clock.now - start == pytest.approx(expected / speedup), name
        assert logits.shape == (2, runner.spec.vocab_size)
    assert runner.sim_stats()["steps"] == 3
    assert StepTimes(entry, tp).predict(StepFeatures()) == 0.0


def test_layer_callbacks_pace_the_step(llama_dir, profile_path, monkeypatch):
    """With a per-layer callback (the hand-off following the forward), layer i is handed
    over at (i + 1) / L of the step's time, after its KV is written."""
    clock = FakeClock()
    monkeypatch.setattr(sim_runner, "time", clock)
    runner = _runner(llama_dir, profile_path)
    step = StepInput([_chunk("a", list(range(16)), 0)])
    seconds = load_profile(profile_path).prefill[1](16, 256)
    start = clock.now
    seen = []

    def layer_done(layer: int) -> None:
        written = runner.read_kv_blocks([0, 1])[layer]
        seen.append((layer, clock.now - start, bool(written.abs().sum() > 0)))

    runner.execute(step, layer_done)
    num_layers = runner.spec.num_layers
    assert [(layer, pytest.approx(seconds * (layer + 1) / num_layers), True)
            for layer in range(num_layers)] == seen


def test_kv_is_a_fraction_of_the_profiles(llama_dir, profile_path):
    runner = _runner(llama_dir, profile_path, kv_fraction=0.5)
    per_token = sum(c[:, 0, 0].nbytes for c in runner.kv_caches)
    assert per_token == 2048  # 0.5 x 4096
    assert runner.num_blocks == 64
    assert runner.spec.vocab_size > 0 and runner.spec.num_kv_heads == 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10),
    SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=10),
], ids=["greedy", "seeded"])
def test_same_tokens_on_any_worker_handed_off_or_recomputed(llama_dir, profile_path, params):
    colocated = _engine(llama_dir, profile_path, speedup=1000)
    other = _engine(llama_dir, profile_path, speedup=1000)
    prefill, saver = _engine(llama_dir, profile_path, "prefill", speedup=1000)
    decode = _engine(llama_dir, profile_path, "decode", speedup=1000)
    for i, prompt in enumerate(PROMPTS):
        colocated.add_request(prompt, params, f"c{i}")
        other.add_request(prompt, params, f"o{i}")
        prefill.add_request(prompt, params, f"p{i}")
    expected = {rid: token_ids(outs) for rid, outs in run_to_completion(colocated).items()}
    assert {rid[1:]: t for rid, t in expected.items()} == {
        rid[1:]: token_ids(outs) for rid, outs in run_to_completion(other).items()}
    assert len({tuple(t) for t in expected.values()}) == len(PROMPTS)  # prompts differ
    prefilled = run_to_completion(prefill)
    for i, prompt in enumerate(PROMPTS):
        first = [prefilled[f"p{i}"][-1].kv_handoff.first_token_id]
        if i % 2:  # the KV moved (as a hand-off or a migration moves it)
            block_ids = decode.add_prefilled_request(f"d{i}", prompt, params, first)
            decode.runner.write_kv_blocks(block_ids, saver.blocks.pop(f"p{i}"))
        else:  # the KV recomputed
            decode.add_continued_request(f"d{i}", prompt, params, first)
    decoded = run_to_completion(decode)
    for i in range(len(PROMPTS)):
        first = prefilled[f"p{i}"][0].outputs[0].token_ids
        assert first + token_ids(decoded[f"d{i}"]) == expected[f"c{i}"]
    for engine in (colocated, other, prefill, decode):
        assert engine.runner.sim_stats()["kv_mismatches"] == 0
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0


def test_a_block_that_arrives_wrong_changes_the_tokens(llama_dir, profile_path):
    params = SamplingParams(temperature=0, max_tokens=6)
    prompt = PROMPTS[3]
    colocated = _engine(llama_dir, profile_path, speedup=1000)
    colocated.add_request(prompt, params, "c")
    expected = token_ids(run_to_completion(colocated)["c"])
    prefill, saver = _engine(llama_dir, profile_path, "prefill", speedup=1000)
    decode = _engine(llama_dir, profile_path, "decode", speedup=1000)
    prefill.add_request(prompt, params, "p")
    first = [run_to_completion(prefill)["p"][-1].kv_handoff.first_token_id]
    blocks = saver.blocks.pop("p")
    blocks[-1].zero_()  # the last layer never arrived
    block_ids = decode.add_prefilled_request("d", prompt, params, first)
    decode.runner.write_kv_blocks(block_ids, blocks)
    got = first + token_ids(run_to_completion(decode)["d"])
    assert decode.runner.sim_stats()["kv_mismatches"] >= 1
    assert got != expected


def test_prompt_logprobs_rows(llama_dir, profile_path):
    """A step asking for prompt logprobs gets a row per prompt token too, finite."""
    engine = _engine(llama_dir, profile_path, speedup=1000)
    engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=2,
                                                   prompt_logprobs=1, logprobs=2), "r")
    outputs = run_to_completion(engine)["r"]
    [carrying] = [out for out in outputs if out.prompt_logprobs is not None]
    assert len(carrying.prompt_logprobs) == len(PROMPTS[2])
    assert all(entry is not None for entry in carrying.prompt_logprobs[1:])
    assert len(token_ids(outputs)) == 2


def test_bad_profiles_are_named(llama_dir, profile_path, tmp_path):
    with pytest.raises(ProfileError, match="TP 4"):
        _runner(llama_dir, profile_path, tp=4)
    with pytest.raises(ProfileError, match="bundled ones: distserve-opt-13b-a100"):
        _runner(llama_dir, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="speedup"):
        SimConfig(profile_path, speedup=0)
    bundled = load_profile("distserve-opt-13b-a100")
    assert bundled.kv_bytes_per_token == 819200 and sorted(bundled.prefill) == [1, 2, 4]
