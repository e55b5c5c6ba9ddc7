"""The fused MoE's grouped GEMM (pdserve/kernels/moe_gemm.py) against the expert-by-expert loop, in
Triton's interpreter without CUDA. Tolerances: fp32 differs only in summation order (1e-5);
fp16 rounds the gate/up product and the activation to fp16 in both paths (2e-3); bf16 keeps 8
bits of mantissa (an ulp is 2^-8 of the value), the kernel rounds its gate/up product to bf16
where the reference keeps fp32, and the interpreter truncates its fp32 -> bf16 casts
(FACTS.md): measured within 2.5 ulps, 3e-2 (the kernel upcasts after loading, as the
interpreter's bf16 arithmetic is wrong)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.kernels.moe_gemm import (  # noqa: E402
    expert_layout,
    fused_experts,
    reference_fused_experts,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_layout_pads_each_experts_run_to_whole_blocks() -> None:
    ids = torch.tensor([2, 0, 2, 1, 0, 2, 2])
    layout = expert_layout(ids, num_experts=3, block_m=4)
    # blocks: expert 0 (1, 4), expert 1 (3), expert 2 (0, 2, 5, 6); then the bound's spare
    # ones (ceil(7 / 4) + 3 = 5 in all)
    assert layout.block_expert.tolist() == [0, 1, 2, -1, -1]
    assert layout.sorted_slots[:12].tolist() == [1, 4, -1, -1, 3, -1, -1, -1, 0, 2, 5, 6]
    assert (layout.sorted_slots[12:] == -1).all()


def test_an_expert_with_no_rows_gets_no_block() -> None:
    layout = expert_layout(torch.tensor([3, 3, 0]), num_experts=4, block_m=2)
    assert layout.block_expert.tolist()[:2] == [0, 3]
    assert (layout.block_expert[2:] == -1).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3),
                                       (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (37, 2), (70, 3)])
def test_fused_experts_equal_the_loop(dtype, tol, num_tokens: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    num_experts, hidden_size, inter = 8, 48, 40  # neither a multiple of the 64-wide tiles
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) / 7).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden_size, inter, generator=gen) / 6).to(DEVICE, dtype)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                              for _ in range(num_tokens)]).flatten().to(DEVICE)
    row_of = torch.arange(num_tokens, device=DEVICE).repeat_interleave(top_k)
    got = fused_experts(hidden, expert_ids, w13, w2, row_of)
    expected = reference_fused_experts(hidden, expert_ids, w13, w2, row_of)
    assert got.shape == (num_tokens * top_k, hidden_size) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_rows_already_gathered_need_no_index() -> None:
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(9, 32, generator=gen, device=DEVICE)
    w13 = torch.randn(3, 16, 32, generator=gen, device=DEVICE)
    w2 = torch.randn(3, 32, 8, generator=gen, device=DEVICE)
    ids = torch.tensor([0, 2, 2, 1, 0, 0, 2, 1, 1], device=DEVICE)
    torch.testing.assert_close(fused_experts(rows, ids, w13, w2),
                               reference_fused_experts(rows, ids, w13, w2), atol=1e-4,
                               rtol=1e-5)


def test_shapes_are_checked() -> None:
    hidden = torch.randn(4, 16, device=DEVICE)
    w13 = torch.randn(2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_experts(hidden, torch.zeros(4, dtype=torch.long, device=DEVICE), w13,
                      torch.randn(2, 16, 5, device=DEVICE))


@pytest.mark.parametrize("architecture", ["mixtral", "deepseek_v3"])
def test_an_moe_model_on_the_grouped_gemm_gives_hf_tokens(make_model_dir, architecture) -> None:
    """The engine's MoE layers on the fused kernel (forced here; CUDA's default), their
    experts' weights stacked into one tensor each: Hugging Face's greedy tokens."""
    from helpers.model_util import hf_greedy, random_prompts

    from pdserve.protocol.sampling import SamplingParams
    from pdserve.serve import LLM
    from pdserve.serve.models.moe import SparseMoE

    model_dir = make_model_dir(architecture)
    prompts = random_prompts([6, 13], vocab_size=1000, seed=7)
    with LLM(model_dir, num_kv_blocks=32, block_size=8, device=DEVICE) as llm:
        layers = [m for m in llm.engine.runner._rank.model.modules()
                  if isinstance(m, SparseMoE)]
        assert layers
        for layer in layers:
            layer.use_fused_kernel = True
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert all(layer._stacked is not None for layer in layers)
        first = layers[0]
        expert = first.experts[str(first.local_experts[0])]
        gate_up = expert._modules[expert.gate_up_name].weight
        assert gate_up.data_ptr() == first._stacked[0][0].data_ptr()  # a view, not a copy
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 5)


def test_dropped_assignments_get_no_block_and_no_output() -> None:
    """An id of num_experts is a dropped assignment: in no block, its row never computed."""
    ids = torch.tensor([2, 3, 0, 3, 2, 1, 3], device=DEVICE)
    layout = expert_layout(ids, num_experts=3, block_m=2)
    assert layout.block_expert.tolist() == [0, 1, 2, -1, -1, -1, -1]
    assert layout.sorted_slots[:6].tolist() == [2, -1, 5, -1, 0, 4]
    assert (layout.sorted_slots[6:] == -1).all()
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(7, 32, generator=gen).to(DEVICE)
    w13 = torch.randn(3, 16, 32, generator=gen).to(DEVICE)
    w2 = torch.randn(3, 32, 8, generator=gen).to(DEVICE)
    kept = ids < 3
    got = fused_experts(rows, ids, w13, w2)[kept]
    expected = reference_fused_experts(rows[kept], ids[kept], w13, w2)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_building_the_layout_reads_nothing_back() -> None:
    from helpers.host_reads import host_reads

    ids = torch.tensor([2, 0, 2, 1, 0, 4, 2], device=DEVICE)
    with host_reads(ids) as seen:
        expert_layout(ids, num_experts=4, block_m=4)
    assert list(seen) == [], seen


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_an_moe_layer_on_the_grouped_gemm_reads_nothing_back(make_model_dir, monkeypatch,
                                                              capacity_factor) -> None:
    """Routing, capacity, the expert layout, the kernels and the load counts: with the layer's
    parameters and input tagged as on the device, nothing is read back to the host. (The
    shared expert, a dense MLP, is left out: the CPU's own linear kernels make tensors the
    recorder cannot follow.)"""
    from helpers.host_reads import host_reads

    from pdserve.serve import LLM
    from pdserve.serve.models.moe import SparseMoE

    with LLM(make_model_dir("deepseek_v3"), num_kv_blocks=8, block_size=8, device=DEVICE,
             expert_capacity_factor=capacity_factor) as llm:
        layer = next(m for m in llm.engine.runner._rank.model.modules()
                     if isinstance(m, SparseMoE))
        layer.use_fused_kernel = True
        monkeypatch.setattr(layer, "shared_output", lambda hidden: None)
        hidden = torch.randn(12, layer.gate.weight.shape[1], device=DEVICE)
        expected = layer(hidden)
        # every tensor the layer holds: parameters, the weights packed or stacked from them
        # after loading, the counts of the first call
        holders = [*layer.modules(), layer.load]
        held = [t for holder in holders for t in vars(holder).values()
                if isinstance(t, torch.Tensor)]
        stacked = list(layer._stacked or ())
        with host_reads(hidden, *layer.parameters(), *held, *stacked) as seen:
            got = layer(hidden)
        torch.testing.assert_close(got, expected)
        routed, dropped = layer.load.totals()
    assert list(seen) == [], seen
    assert sum(routed) + dropped == 2 * 12 * layer.gate.top_k
    assert (dropped > 0) == (capacity_factor is not None)
