"""DeepSeek-V2/V3 (MLA + MoE) logits against Hugging Face transformers on tiny seeded checkpoints.

The conftest-built models (pdserve/serve/default_model.py) cover both query paths (V2 q_proj, V3
q_lora), both routers (V2 softmax group-limited, V3 sigmoid with a random
e_score_correction_bias, group-limited), a dense first layer and MoE layers with a shared
expert. Every test runs through ModelRunner, so the runner's MLA cache layout is what the
model sees.

Tolerance 1e-4 (fp32), as for Llama: decode (both backends) and Triton's prefill compute
attention in absorbed form (W_UK folded into the query, W_UV applied after attention) where HF
expands per-head K/V, as the torch prefill does; only the order of float32 sums differs,
which moves logits by ~1e-5 here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.engine_util import assert_tied_head
from helpers.model_util import hf_logits, load_hf, random_prompts
from helpers.model_walks import (
    NUM_BLOCKS,
    assert_rows_match,
    prefill_then_decodes,
    ragged_chunked_then_decodes,
    randomise_biases,
    runner_for,
    two_prompts_in_two_chunks,
)

from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.default_model import build_random_model
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM


@pytest.mark.parametrize("backend,block_size,num_decodes", [
    ("torch", 8, 3),
    ("torch", 16, 3),
    ("cpu", 16, 3),  # the C++ MLA decode kernel reading the latent cache in place
    ("triton", 16, 2),  # the interpreter is slow: one block size, fewer decode steps
])
@pytest.mark.parametrize("architecture", ["deepseek_v2", "deepseek_v3"])
def test_ragged_chunked_and_decode_steps_match_hf(architecture: str, backend: str,
                                                  block_size: int, num_decodes: int,
                                                  make_model_dir, monkeypatch) -> None:
    """Step 1: a ragged prefill (5 and 17 tokens) plus the first 23 tokens of a 40-token
    prompt. Step 2: that prompt's other 17 tokens beside two decode rows (the prefill path
    over a cached prefix). Then decode-only steps (the MLA decode path). Block tables are
    shuffled, so the latent rows of one sequence are scattered over the pool."""
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", backend)
    model_dir = make_model_dir(architecture, seed=3)
    hf = load_hf(model_dir)
    with runner_for(model_dir, block_size) as runner:
        assert runner.kv_caches[0].shape == (1, NUM_BLOCKS, block_size, 1, runner.spec.head_dim)
        attn = runner._rank.model.model.layers[0].self_attn.attn
        assert attn.backend.name == backend
        done: list[int] = []
        ragged_chunked_then_decodes(runner, hf, block_size, num_decodes, layer_done=done.append)
        assert done == list(range(runner.spec.num_layers))


@pytest.mark.parametrize("architecture,overrides", [
    # greedy routing, tied embeddings, attention biases, a small q_lora on V2
    ("deepseek_v2", {"topk_method": "greedy", "tie_word_embeddings": True,
                     "attention_bias": True, "mlp_bias": True, "q_lora_rank": 24}),
    # YaRN as the released checkpoints use it; mscale != mscale_all_dim makes both the cos/sin
    # factor and the softmax-scale correction differ from 1
    ("deepseek_v3", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}}),
    # rotate-half rope on V3, unnormalised top-k weights, two shared experts
    ("deepseek_v3", {"rope_interleave": False, "norm_topk_prob": False,
                     "n_shared_experts": 2}),
], ids=["v2_greedy_tied_bias_qlora", "v3_yarn", "v3_neox_rope_unnormalised"])
def test_config_variants_match_hf(architecture: str, overrides: dict, tmp_path: Path,
                                  tokenizer_dir: Path) -> None:
    model_dir = build_random_model(tmp_path / "m", architecture, seed=4,
                                   tokenizer_dir=tokenizer_dir, **overrides)
    randomise_biases(model_dir, seed=4)
    hf = load_hf(model_dir)
    with runner_for(model_dir, block_size=8) as runner:
        two_prompts_in_two_chunks(runner, hf)
        if overrides.get("tie_word_embeddings"):
            model = runner._rank.model
            assert_tied_head(model)


@pytest.mark.parametrize("architecture,overrides", [
    ("deepseek_v3", {}),
    # biases on the replicated latent projection, the row-parallel o_proj and the shared
    # expert whose down projection skips the reduce (rank 0 alone adds the bias)
    ("deepseek_v2", {"attention_bias": True, "mlp_bias": True}),
], ids=["v3", "v2_biases"])
def test_tp2_matches_hf(architecture: str, overrides: dict, tmp_path: Path,
                        tokenizer_dir: Path) -> None:
    """Heads, every expert and the dense MLP split over two gloo ranks; the MoE block
    all-reduces once."""
    model_dir = build_random_model(tmp_path / "m", architecture, seed=5,
                                   tokenizer_dir=tokenizer_dir, **overrides)
    randomise_biases(model_dir, seed=5)
    hf = load_hf(model_dir)
    with runner_for(model_dir, block_size=8, tp=2) as runner:
        prompts = random_prompts([19, 6], runner.spec.vocab_size, seed=4)
        tables = [[2, 11, 5], [0]]
        expected = [hf_logits(hf, p) for p in prompts]
        logits = runner.execute(StepInput([SeqChunk("a", prompts[0][:18], 0, tables[0], True),
                                           SeqChunk("b", prompts[1][:5], 0, tables[1], True)]))
        assert_rows_match(logits, [expected[0][17], expected[1][4]])
        logits = runner.execute(StepInput([SeqChunk("a", prompts[0][18:], 18, tables[0], True),
                                           SeqChunk("b", prompts[1][5:], 5, tables[1], True)]))
        assert_rows_match(logits, [expected[0][18], expected[1][5]])


@pytest.mark.parametrize("architecture", ["deepseek_v2", "deepseek_v3"])
def test_expert_parallel_tp2_matches_hf(architecture: str, make_model_dir) -> None:
    """Whole experts on each of two ranks (4 of 8 each), rows moved by all-to-all: a ragged
    prefill, then single-token decodes (rank 0's token share is empty: it sends nothing, and
    still joins every collective)."""
    model_dir = make_model_dir(architecture, seed=3)
    hf = load_hf(model_dir)
    with runner_for(model_dir, block_size=8, tp=2, expert_parallel=True) as runner:
        moe = runner._rank.model.model.layers[1].mlp
        assert moe.is_expert_parallel and sorted(moe.experts) == ["0", "1", "2", "3"]
        # rank 0 loaded only its experts, whole
        assert moe.experts["0"].down_proj.weight.shape[1] == 32
        prefill_then_decodes(runner, hf, seed=7)


def test_tensor_parallel_size_must_split_heads_and_experts(make_model_dir) -> None:
    import json

    hf_config = json.loads((make_model_dir("deepseek_v3", seed=3) / "config.json").read_text())
    with pytest.raises(ValueError, match="num_attention_heads=4 divisible"):
        DeepseekV3ForCausalLM(hf_config, 64, TPGroup(0, 3), "torch")
    with pytest.raises(ValueError, match="moe_intermediate_size=32 divisible"):
        DeepseekV2ForCausalLM({**hf_config, "topk_method": "greedy", "num_attention_heads": 6,
                               "intermediate_size": 96},
                              64, TPGroup(0, 3), "torch")
    with pytest.raises(ValueError, match="n_routed_experts=8 divisible"):
        DeepseekV2ForCausalLM({**hf_config, "topk_method": "greedy", "num_attention_heads": 6,
                               "intermediate_size": 96,
                               "moe_intermediate_size": 36},
                              64, TPGroup(0, 3, expert_parallel=True), "torch")


def test_worker_with_a_tp_degree_the_model_cannot_take_exits_with_one_clear_line(
        make_model_dir) -> None:
    """Every rank fails on the same check; rank 0 reports it, the others exit quietly."""
    import subprocess
    import sys

    model_dir = make_model_dir("deepseek_v3", seed=3)
    done = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "prefill", "--model",
                           str(model_dir), "--tp", "3", "--port", "1", "--insecure-plaintext"],
                          capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2
    assert "num_attention_heads=4 divisible by tensor_parallel_size=3" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
