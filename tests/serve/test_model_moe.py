"""Mixtral and Qwen2-MoE logits against Hugging Face transformers on tiny seeded checkpoints.

The conftest-built models (pdserve/serve/default_model.py): Mixtral with 8 experts, 2 per token,
renormalised, every layer MoE; Qwen2-MoE with a dense layer 0 (mlp_only_layers), then 8
experts, 2 per token, not renormalised, and a sigmoid-gated shared expert. Every test runs
through ModelRunner on the torch backend (the attention is Llama's, which
test_model_fidelity covers on every backend).

Tolerance 1e-4 (fp32), as for Llama and DeepSeek: pdserve sums the k expert outputs and the
attention in another order than HF, which moves logits by under 1e-5 here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.engine_util import assert_tied_head
from helpers.model_util import load_hf
from helpers.model_walks import (
    prefill_then_decodes,
    ragged_chunked_then_decodes,
    randomise_biases,
    runner_for,
    two_prompts_in_two_chunks,
)

from pdserve.serve.default_model import build_random_model
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.models.llama_moe import MixtralForCausalLM, Qwen2MoeForCausalLM

ARCHITECTURES = ["mixtral", "qwen2_moe"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """Factory: moe_dir(architecture) -> the default tiny checkpoint, built once, with its
    Q/K/V biases (Qwen2-MoE) made random: HF zeroes them, which would hide a bias added on
    the wrong ranks."""
    cache: dict[str, Path] = {}

    def get(architecture: str) -> Path:
        if architecture not in cache:
            cache[architecture] = build_random_model(
                tmp_path_factory.mktemp(architecture), architecture, seed=3,
                tokenizer_dir=tokenizer_dir)
            randomise_biases(cache[architecture], seed=3)
        return cache[architecture]

    return get


def moe_block(runner, layer: int = 1):
    model = runner._rank.model
    return model.model.layers[layer].mlp


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_ragged_chunked_and_decode_steps_match_hf(architecture: str, moe_dir) -> None:
    """Step 1: a ragged prefill (5 and 17 tokens) plus the first 23 tokens of a 40-token
    prompt. Step 2: that prompt's other 17 tokens beside two decode rows. Then three
    decode-only steps. Block tables are shuffled over the pool."""
    block_size, num_decodes = 8, 3
    model_dir = moe_dir(architecture)
    hf = load_hf(model_dir)
    with runner_for(model_dir, block_size) as runner:
        ragged_chunked_then_decodes(runner, hf, block_size, num_decodes)


@pytest.mark.parametrize("architecture,overrides", [
    # one expert per token (its weight renormalises to 1), tied embeddings, explicit head_dim
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 1,
                 "tie_word_embeddings": True, "head_dim": 32}),
    # renormalised weights; MoE on every second layer (1, 3) by decoder_sparse_step alone; no
    # Q/K/V bias
    ("qwen2_moe", {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 2,
                   "num_hidden_layers": 4, "qkv_bias": False}),
], ids=["mixtral_top1_tied_head_dim", "qwen2_moe_sparse_step_normalised_no_bias"])
def test_config_variants_match_hf(architecture: str, overrides: dict, tmp_path: Path,
                                  tokenizer_dir: Path) -> None:
    model_dir = build_random_model(tmp_path / "m", architecture, seed=4,
                                   tokenizer_dir=tokenizer_dir, **overrides)
    hf = load_hf(model_dir)
    with runner_for(model_dir, block_size=8) as runner:
        model = runner._rank.model
        if architecture == "qwen2_moe":
            assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
                "GatedMLP", "Qwen2MoeSparseMoE", "GatedMLP", "Qwen2MoeSparseMoE"]
            assert model.model.layers[0].self_attn.qkv_proj.bias is None
        else:
            assert_tied_head(model)
        two_prompts_in_two_chunks(runner, hf)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tp2_matches_hf(architecture: str, moe_dir) -> None:
    """Heads, every expert, Qwen2-MoE's shared expert and dense MLP split over two gloo
    ranks; the MoE block all-reduces once."""
    model_dir = moe_dir(architecture)
    hf = load_hf(model_dir)
    with runner_for(model_dir, block_size=8, tp=2) as runner:
        moe = moe_block(runner)
        assert not moe.is_expert_parallel and len(moe.experts) == 8
        expert = moe.experts["0"]
        down = expert.w2 if architecture == "mixtral" else expert.down_proj
        assert down.weight.shape[1] == 16  # half of the expert's 32
        prefill_then_decodes(runner, hf, seed=4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_expert_parallel_tp2_matches_hf(architecture: str, moe_dir) -> None:
    """Whole experts on each of two ranks (4 of 8 each), rows moved by all-to-all: a ragged
    prefill, then single-token decodes (rank 0's token share is empty: it sends and receives
    nothing, and still joins every collective)."""
    model_dir = moe_dir(architecture)
    hf = load_hf(model_dir)
    with runner_for(model_dir, block_size=8, tp=2, expert_parallel=True) as runner:
        moe = moe_block(runner)
        # rank 0 loaded only its experts (the loader skipped the others), whole
        assert moe.is_expert_parallel and sorted(moe.experts) == ["0", "1", "2", "3"]
        expert = moe.experts["0"]
        down = expert.w2 if architecture == "mixtral" else expert.down_proj
        assert down.weight.shape[1] == 32
        if architecture == "qwen2_moe":  # the shared expert stays TP-split
            assert moe.shared_expert.down_proj.weight.shape[1] == 24
        prefill_then_decodes(runner, hf, seed=7)


def test_skips_only_other_ranks_experts(moe_dir) -> None:
    config = json.loads((moe_dir("mixtral") / "config.json").read_text())
    model = MixtralForCausalLM(config, 64, TPGroup(1, 2, expert_parallel=True), "torch")
    skips = model.skips_checkpoint_tensor
    assert skips("model.layers.0.block_sparse_moe.experts.3.w1.weight")
    assert not skips("model.layers.0.block_sparse_moe.experts.4.w1.weight")
    assert not skips("model.layers.0.block_sparse_moe.gate.weight")
    assert not skips("model.layers.0.self_attn.q_proj.weight")


def test_tensor_parallel_size_must_split_experts(moe_dir) -> None:
    mixtral = json.loads((moe_dir("mixtral") / "config.json").read_text())
    qwen = json.loads((moe_dir("qwen2_moe") / "config.json").read_text())
    wide = {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96}
    with pytest.raises(ValueError, match="intermediate_size=32 divisible"):
        MixtralForCausalLM({**mixtral, **wide}, 64, TPGroup(0, 3), "torch")
    with pytest.raises(ValueError, match="num_local_experts=8 divisible"):
        MixtralForCausalLM({**mixtral, **wide}, 64, TPGroup(0, 3, expert_parallel=True),
                           "torch")
    with pytest.raises(ValueError, match="num_experts=8 divisible"):
        Qwen2MoeForCausalLM({**qwen, **wide, "intermediate_size": 96}, 64,
                            TPGroup(0, 3, expert_parallel=True), "torch")
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=50 divisible"):
        Qwen2MoeForCausalLM({**qwen, **wide, "intermediate_size": 96,
                             "moe_intermediate_size": 36,
                             "shared_expert_intermediate_size": 50}, 64, TPGroup(0, 3), "torch")
