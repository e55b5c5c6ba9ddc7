"""MTP speculative decoding (pdserve/serve/engine/spec_decode.py) on tiny DeepSeek-V3 models with an
MTP layer: one whose MTP module reproduces the main model's next-token prediction ("mirror":
acceptance near 1) and one drawn at random (acceptance near 0).

The reference is pdserve's own greedy decoding without speculation (itself checked against
Hugging Face in test_deepseek_serving.py; HF ignores the MTP layer): speculation may change
how many tokens a step yields, never which. Sampling is checked statistically with fixed
seeds (so the outcome is deterministic): the accept/reject rule alone over many draws, and
the first verified token of many seeded requests against the target softmax."""

from __future__ import annotations

import argparse
import math
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
import torch
from helpers.cluster_util import start_cluster, wait_until
from helpers.engine_util import prefill_engine, run_to_completion, token_ids

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import WORKER_PROTOCOL, WorkerStatus
from pdserve.serve import LLM
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from pdserve.serve.default_model import build_random_model
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.roles import make_role
from pdserve.serve.engine.spec_decode import (
    SpecDecodeStats,
    add_mtp_layer,
    greedy_verify,
    rejection_sample,
)

PROMPTS = [list(range(5, 5 + n)) for n in (1, 7, 16, 33)]  # ragged, across block edges
GREEDY = SamplingParams(temperature=0, max_tokens=12)
SMALL_VOCAB = 16


def _mtp_model(tmp_path_factory, tokenizer_dir, name: str, mirror: bool, **overrides):
    out = tmp_path_factory.mktemp(f"mtp-{name}")
    build_random_model(out, "deepseek_v3", seed=3, tokenizer_dir=tokenizer_dir,
                       num_hidden_layers=2, **overrides)
    return add_mtp_layer(out, mirror=mirror, seed=5)


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory, tokenizer_dir):
    return {"mirror": _mtp_model(tmp_path_factory, tokenizer_dir, "mirror", True),
            "random": _mtp_model(tmp_path_factory, tokenizer_dir, "random", False)}


@pytest.fixture(scope="module")
def baseline(mtp_dirs):
    """Greedy tokens without speculation, per model."""
    tokens = {}
    for name, model_dir in mtp_dirs.items():
        with LLM(model_dir, block_size=8, num_kv_blocks=64) as llm:
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return tokens


def _spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


# ---- the rule ------------------------------------------------------------------------------


def test_greedy_verify_keeps_the_agreeing_prefix_then_the_target():
    assert greedy_verify([4, 5, 6], [4, 5]) == [4, 5, 6]  # all kept + bonus
    assert greedy_verify([4, 9, 6], [4, 5]) == [4, 9]  # second draft rejected
    assert greedy_verify([7, 5, 6], [4, 5]) == [7]


@pytest.mark.parametrize("one_hot_draft", [True, False], ids=["greedy-drafter", "sampled-q"])
def test_rejection_sampling_preserves_the_target_distribution(one_hot_draft):
    """Every output position is distributed as the target, whatever the drafter proposes
    (chi-square over 6 tokens, 8000 draws, fixed seed: p < 1e-6 under the null is a
    bound of 35 for 5 degrees of freedom). Always accepting would fail at once."""
    gen = torch.Generator().manual_seed(0)
    vocab, num_draws = 6, 8000
    target = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, dim=-1)  # k = 2
    draft_probs = torch.softmax(torch.randn(2, vocab, generator=gen) * 2.0, dim=-1)
    first, second = Counter(), Counter()
    num_kept = 0
    for _ in range(num_draws):
        if one_hot_draft:
            drafts = [int(torch.argmax(draft_probs[j])) for j in range(2)]
            q = None
        else:
            drafts = [int(torch.multinomial(draft_probs[j], 1, generator=gen))
                      for j in range(2)]
            q = draft_probs
        out = rejection_sample(target, drafts, q, gen)
        assert 1 <= len(out) <= 3
        num_kept += len(out) - 1
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert _chi_square(first, target[0], num_draws) < 35.0
    # Given a kept first draft the next token follows row 1 (with a one-hot q the second
    # position is only reached through the draft, so its conditional is row 1 too).
    assert _chi_square(second, target[1], sum(second.values())) < 35.0
    assert 0 < num_kept < 2 * num_draws


def _chi_square(counts: Counter, probs: torch.Tensor, total: int) -> float:
    expected = probs.double() * total
    observed = torch.tensor([counts.get(i, 0) for i in range(len(probs))], dtype=torch.float64)
    return float(((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum())


# ---- greedy: identical tokens --------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("model", ["mirror", "random"])
def test_greedy_with_mtp_equals_greedy_without(mtp_dirs, baseline, model, k):
    with LLM(mtp_dirs[model], block_size=8, num_kv_blocks=64,
             speculative_config=_spec(k)) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        engine = llm.engine
        stats = engine.speculator.stats
        assert engine.block_manager.num_used_blocks == 0
        engine.block_manager.check_integrity()
    assert [o.outputs[0].token_ids for o in outs] == baseline[model]
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert len(stats.accepted_per_pos) == k
    if model == "mirror":  # the MTP predicts what the main model will: nearly all kept
        assert stats.acceptance_rate > 0.9
        assert stats.accepted_per_pos[0] >= 0.9 * stats.num_drafts
    else:  # a random drafter over ~1000 tokens is almost never right
        assert stats.acceptance_rate < 0.2


def test_budget_cut_drafts_and_parallel_sampling_stay_exact(mtp_dirs, baseline):
    """A token budget smaller than a batch's 1 + k rows cuts some sequences' drafts (they
    verify fewer), and n = 2 greedy children each draft on their own: every sequence still
    equals greedy decoding without speculation."""
    with LLM(mtp_dirs["random"], block_size=8, num_kv_blocks=128, max_num_batched_tokens=20,
             speculative_config=_spec(2)) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=12))
        assert llm.engine.block_manager.num_used_blocks == 0
        llm.engine.block_manager.check_integrity()
    for out, expected in zip(outs, baseline["random"], strict=True):
        assert [c.token_ids for c in out.outputs] == [expected, expected]


def test_rollback_frees_rejected_slots_step_by_step(mtp_dirs):
    """Walk one request with k = 2 on the random drafter (nearly every draft rejected): after
    every step the request holds exactly the blocks its computed tokens need, plus those its
    next drafts' chained MTP rows took; at the end nothing is held."""
    model_config = ModelConfig(str(mtp_dirs["random"]))
    engine = Engine(model_config, CacheConfig(block_size=4, num_blocks=32),
                    speculative_config=_spec(2))
    try:
        request = engine.add_request(list(range(5, 11)), GREEDY, "r")
        bm = engine.block_manager
        while engine.has_unfinished_requests():
            engine.step()
            bm.check_integrity()
            if request.is_finished:
                break
            drafts = len(request.spec_token_ids)
            # computed tokens, then the chained drafts' MTP rows (drafts - 1 positions)
            needed = bm.num_blocks_for(request.num_computed_tokens + max(drafts - 1, 0))
            assert len(bm.block_table("r")) == needed
        assert bm.num_used_blocks == 0
        assert engine.speculator.stats.num_draft_tokens > 0
    finally:
        engine.shutdown()


def test_decode_role_after_a_handoff_gives_the_same_tokens(mtp_dirs, baseline):
    """A plain prefill worker hands the prompt's KV to a decode worker with MTP: the decode
    worker prefills the MTP layer on the request's first step (spec_decode.py) and the
    tokens equal greedy decoding without speculation."""
    model_dir = mtp_dirs["mirror"]
    configs = (ModelConfig(str(model_dir)), CacheConfig(block_size=8, num_blocks=64))
    prefill, saver = prefill_engine(*configs)
    decode = Engine(*configs, role=make_role("decode"), speculative_config=_spec(2))
    try:
        for i, prompt in enumerate(PROMPTS):
            prefill.add_request(prompt, GREEDY, f"p{i}")
        prefilled = run_to_completion(prefill)
        for i, prompt in enumerate(PROMPTS):
            [last] = prefilled[f"p{i}"]
            first = [last.kv_handoff.first_token_id]
            block_ids = decode.add_prefilled_request(f"d{i}", prompt, GREEDY, first)
            decode.runner.write_kv_blocks(block_ids, saver.blocks.pop(f"p{i}"))
        decoded = run_to_completion(decode)
        for i in range(len(PROMPTS)):
            tokens = [prefilled[f"p{i}"][0].outputs[0].token_ids[0]] + token_ids(
                decoded[f"d{i}"])
            assert tokens == baseline["mirror"][i]
        assert decode.speculator.stats.acceptance_rate > 0.9
        assert decode.block_manager.num_used_blocks == 0
        decode.block_manager.check_integrity()
    finally:
        prefill.shutdown()
        decode.shutdown()


# ---- sampling: the distribution is the target's -------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory, tokenizer_dir):
    return _mtp_model(tmp_path_factory, tokenizer_dir, "small-vocab", False,
                      vocab_size=SMALL_VOCAB)


def test_first_verified_token_follows_the_target_softmax(small_vocab_dir):
    """Many seeded requests on a 16-token vocabulary, k = 2 with a random drafter (drafts
    kept and rejected both happen): output token 1 (the first the verify step yields) is
    distributed as softmax(logits / T) given the prompt and output token 0. Fixed seeds: the
    outcome is deterministic; a chi-square over 16 tokens below 60 (15 degrees of freedom:
    p < 1e-6 under the null) holds, and accepting drafts blindly would break it."""
    prompt, temperature, num_draws = [3, 7, 1, 12], 0.8, 400
    with LLM(small_vocab_dir, block_size=8, num_kv_blocks=1024, max_num_seqs=512,
             max_num_batched_tokens=4096, speculative_config=_spec(2)) as llm:
        params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=4,
                                 ignore_eos=True) for seed in range(num_draws)]
        outs = llm.generate([prompt] * num_draws, params)
        stats = llm.engine.speculator.stats
        again = llm.generate([prompt] * 8, params[:8])  # seeded: reproducible
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids
                                                       for o in outs[:8]]
    pairs = [o.outputs[0].token_ids for o in outs]
    assert all(len(p) == 4 for p in pairs)
    with LLM(small_vocab_dir, block_size=8, num_kv_blocks=256) as llm:  # no speculation
        firsts = sorted({p[0] for p in pairs})
        rows = llm.generate([prompt + [t] for t in firsts],
                            SamplingParams(temperature=0, max_tokens=1, logprobs=SMALL_VOCAB))
    target_of = {}
    for first, out in zip(firsts, rows, strict=True):
        logprobs = torch.full((SMALL_VOCAB,), -math.inf, dtype=torch.float64)
        for token_id, entry in out.outputs[0].logprobs[0].items():
            logprobs[token_id] = entry.logprob
        target_of[first] = torch.softmax(logprobs / temperature, dim=-1)
    expected = sum(target_of[p[0]] for p in pairs)  # the mixture over output token 0
    observed = Counter(p[1] for p in pairs)
    chi_square = _chi_square(observed, expected / num_draws, num_draws)
    assert chi_square < 60.0, (chi_square, observed)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths were taken


# ---- configuration and metrics -------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "eagle"}', "method must be one of"),
    ('{"method": "mtp", "draft_model": "x"}', "unknown speculative config keys"),
    ("{not json", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"num_speculative_tokens": 2}', "needs \"method\""),
])
def test_bad_speculative_config_is_a_clear_error(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_cli_flag_parses_and_validates(mtp_dirs):
    from pdserve.serve.worker.server import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", str(mtp_dirs["mirror"]), "--port", "5555"]
    args = parser.parse_args(base + ["--speculative-config",
                                     '{"method":"mtp","num_speculative_tokens":2}'])
    args.command = "decode"
    assert config_from_args(args).speculative == SpeculativeConfig("mtp", 2)
    args = parser.parse_args(base + ["--speculative-config", '{"method":"mtp",'])
    args.command = "decode"
    with pytest.raises(ValueError, match="not valid JSON"):
        config_from_args(args)


def test_a_model_without_mtp_weights_is_refused(make_model_dir):
    v3 = make_model_dir("deepseek_v3", seed=3)  # no MTP layer, num_nextn_predict_layers 0
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        LLM(v3, num_kv_blocks=16, speculative_config=_spec(1))
    llama = make_model_dir("llama")
    with pytest.raises(ValueError, match="no multi-token-prediction module"):
        LLM(llama, num_kv_blocks=16, speculative_config=_spec(1))
    with pytest.raises(ValueError, match="one rank"):
        Engine(ModelConfig(str(v3)), CacheConfig(num_blocks=16),
               ParallelConfig(tensor_parallel_size=2), speculative_config=_spec(1))


def test_worker_status_carries_the_counters(mtp_dirs):
    """The worker's status heartbeat (the path to the router's /metrics) reports the
    engine's spec-decode totals."""
    from pdserve.serve.worker.server import Worker

    engine = Engine(ModelConfig(str(mtp_dirs["mirror"])), CacheConfig(block_size=8,
                                                                      num_blocks=64),
                    speculative_config=_spec(1))
    worker = None
    try:
        worker = Worker(engine, "colocated", "tcp://127.0.0.1:*", "c0")
        engine.add_request(PROMPTS[1], GREEDY, "r")
        run_to_completion(engine)
        totals = worker.status().spec_decode
        stats = engine.speculator.stats
        assert totals["num_drafts"] == stats.num_drafts > 0
        assert totals["num_accepted_tokens"] == stats.num_accepted_tokens > 0
        assert totals["accepted_pos_0"] == stats.accepted_per_pos[0]
        assert WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(worker.status())).spec_decode \
            == totals
    finally:
        if worker is not None:
            worker.close()
        engine.shutdown()


def test_disaggregated_cluster_speculates_on_decode(mtp_dirs, tmp_path_factory):
    """`pdserve up --mode disagg --speculative-config ...`: the decode worker speculates
    after the hand-off, the text equals the offline engine's without speculation, and the
    decode worker's counters reach the router's /metrics under vLLM's names."""
    model_dir = mtp_dirs["mirror"]
    prompts = ["def fibonacci(n):", "import os\nimport sys"]
    params = SamplingParams(temperature=0, max_tokens=10)
    with LLM(model_dir, num_kv_blocks=128) as llm:
        expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    cluster = start_cluster(model_dir, tmp_path_factory.mktemp("mtp-logs"), "--mode",
                            "disagg", "--num-kv-blocks", "128", "--speculative-config",
                            '{"method": "mtp", "num_speculative_tokens": 2}')
    try:
        for prompt, text in zip(prompts, expected, strict=True):
            r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 10, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text

        def decode_drafts() -> float:
            metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
            lines = [line for line in metrics.splitlines() if line.startswith(
                "pdserve:spec_decode_num_accepted_tokens_total{") and 'role="decode"' in line]
            return float(lines[0].split()[-1]) if lines else 0.0

        assert wait_until(lambda: decode_drafts() > 0), cluster.status()
        cluster.assert_nothing_leaked()
    finally:
        assert cluster.stop() == 0, cluster.log()


def test_pdserve_up_hands_the_flag_to_every_worker_and_checks_it():
    from pdserve.app.launcher import add_arguments, plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flag = '{"method": "mtp", "num_speculative_tokens": 2}'
    args = parser.parse_args(["--mode", "disagg", "--device", "cpu",
                              "--speculative-config", flag])
    workers = [c.argv for c in plan(args, "/models/m").children
               if c.argv[0] in ("prefill", "decode")]
    assert len(workers) == 2
    assert all(argv[argv.index("--speculative-config") + 1] == flag for argv in workers)
    args = parser.parse_args(["--device", "cpu", "--speculative-config", '{"method": "x"}'])
    with pytest.raises(ValueError, match="method must be one of"):
        plan(args, "/models/m")


def test_router_metrics_carry_vllm_spec_decode_names():
    from pdserve.router.metrics import RouterMetrics

    stats = SpecDecodeStats()
    stats.observe(2, 2)
    stats.observe(2, 0)
    status = WorkerStatus(worker_id="d0", role="decode", model="m", max_model_len=64,
                          is_ready=True, num_running=0, num_waiting=0, num_free_blocks=8,
                          num_total_blocks=8, block_size=16, spec_decode=stats.as_dict())
    worker = SimpleNamespace(status=status, worker_id="d0", role="decode")
    text = RouterMetrics("m").render([worker]).decode()
    labels = 'model_name="m",role="decode",worker="d0"'
    assert f"pdserve:spec_decode_num_drafts_total{{{labels}}} 2.0" in text
    assert f"pdserve:spec_decode_num_draft_tokens_total{{{labels}}} 4.0" in text
    assert f"pdserve:spec_decode_num_accepted_tokens_total{{{labels}}} 2.0" in text
    assert ('pdserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
            'position="1",role="decode",worker="d0"} 1.0') in text
