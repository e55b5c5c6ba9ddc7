"""Expert capacity (pdserve/serve/models/moe.py apply_capacity): ceil(factor x tokens x top_k /
experts) assignments per expert per step, the overflow dropped and the token's other gates
renormalised; per-expert load and drops counted and exported to /metrics.

Reference points: capacity None (and a capacity no step can reach) is Hugging Face's exact
routing; a tiny capacity drops, counts and stays finite, and no expert (so no EP rank)
receives more than its capacity; EP and TP agree under the same capacity (every rank routes
every token alike, so all drop the same assignments). Tolerance 1e-4 between TP 1 and EP 2,
as tests/serve/test_tensor_parallel.py: the all-reduce sums partial products in another order.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.model_util import hf_greedy, random_prompts

from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.protocol.worker import WORKER_PROTOCOL, WorkerStatus
from pdserve.serve import LLM, SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.executor.model_runner import ModelRunner
from pdserve.serve.models.moe import SparseMoE, apply_capacity, expert_capacity

NUM_TOKENS = 24
TINY_FACTOR = 0.25  # 8 experts, top-2, 24 tokens: capacity ceil(0.25 x 24 x 2 / 8) = 2


def test_capacity_drops_in_token_order_and_renormalises() -> None:
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.7, 0.3], [0.9, 0.1]])
    assert expert_capacity(4, 2, 4, 1.0) == 2  # ceil(1 x 4 x 2 / 4)
    new_weights, kept = apply_capacity(weights, ids, 4, 1.0)
    # expert 0 is the hot one: its 3rd and 4th assignments (tokens 2 and 3) are dropped
    assert kept.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert torch.allclose(new_weights, torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.0, 1.0],
                                                     [1.0, 0.0]]))
    # every token's gates keep their sum; a token with every slot dropped gets none
    scaled = weights[:3] * 2.5  # e.g. routed_scaling_factor
    new_weights, kept = apply_capacity(scaled, torch.tensor([[0, 1], [0, 1], [0, 1]]), 2, 0.5)
    assert expert_capacity(3, 2, 2, 0.5) == 2
    assert kept.tolist() == [[True, True], [True, True], [False, False]]
    assert torch.allclose(new_weights.sum(-1), torch.tensor([2.5, 2.5, 0.0]))



@pytest.mark.parametrize("factor", [None, 4.0])  # 4.0 = experts / top_k: capacity = T
def test_unreachable_capacity_is_hf_exact(make_model_dir, factor: float | None) -> None:
    model_dir = make_model_dir("deepseek_v3")
    prompts = random_prompts([7, 13, 4], vocab_size=1000, seed=5)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with LLM(model_dir, num_kv_blocks=32, block_size=8, device="cpu",
             expert_capacity_factor=factor) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        routed, dropped = llm.engine.runner.moe_load()
    assert tokens == hf_greedy(model_dir, prompts, 5)
    assert dropped == 0 and sum(routed) > 0


def _step(vocab_size: int) -> StepInput:
    (tokens,) = random_prompts([NUM_TOKENS], vocab_size, seed=9)
    return StepInput([SeqChunk("a", tokens, 0, [0, 1, 2], True)])


def _run(model_dir: Path, parallel: ParallelConfig, monkeypatch: pytest.MonkeyPatch
         ) -> tuple[torch.Tensor, list[tuple[list[int], int]], list[list[int]]]:
    """One 24-token prefill: logits, each MoE layer's (routed per expert, dropped), and the
    rows per expert that rank 0's experts received in each MoE layer call."""
    received: list[list[int]] = []
    original = SparseMoE._apply_experts

    def counted(self, rows, expert_ids, row_of=None):
        # an id of num_experts is a dropped assignment, which no expert computes
        received.append(torch.bincount(expert_ids, minlength=self.gate.num_experts + 1)
                        [:self.gate.num_experts].tolist())
        return original(self, rows, expert_ids, row_of)

    monkeypatch.setattr(SparseMoE, "_apply_experts", counted)
    with ModelRunner(ModelConfig(str(model_dir)), CacheConfig(block_size=8, num_blocks=8),
                     parallel) as runner:
        logits = runner.execute(_step(runner.spec.vocab_size))
        layers = [m.load.totals() for m in runner._rank.model.modules()
                  if isinstance(m, SparseMoE)]
    return logits, layers, received


def test_tiny_capacity_drops_counts_and_ep_matches_tp(make_model_dir,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_model_dir("deepseek_v3")
    capacity = expert_capacity(NUM_TOKENS, 2, 8, TINY_FACTOR)
    assert capacity == 2
    tp_logits, tp_layers, tp_received = _run(
        model_dir, ParallelConfig(device="cpu", expert_capacity_factor=TINY_FACTOR),
        monkeypatch)
    assert torch.isfinite(tp_logits).all()
    for routed, dropped in tp_layers:
        assert max(routed) <= capacity  # no expert computed more than its capacity
        assert sum(routed) + dropped == NUM_TOKENS * 2  # every assignment routed or dropped
        assert dropped > 0  # 48 assignments, 8 experts x 2 slots: at least 32 dropped
    assert all(max(rows) <= capacity for rows in tp_received)

    ep_logits, ep_layers, ep_received = _run(
        model_dir, ParallelConfig(tensor_parallel_size=2, device="cpu",
                                  enable_expert_parallel=True,
                                  expert_capacity_factor=TINY_FACTOR), monkeypatch)
    # rank 0 holds experts 0..3: the rows it received per expert stay within capacity, and
    # the group's counts (the same on every rank) say the same of rank 1's experts
    assert ep_received and all(max(rows) <= capacity for rows in ep_received)
    assert all(sum(rows[4:]) == 0 for rows in ep_received)
    assert ep_layers == tp_layers  # the same assignments dropped
    torch.testing.assert_close(ep_logits, tp_logits, atol=1e-4, rtol=0)
    assert torch.equal(ep_logits.argmax(-1), tp_logits.argmax(-1))
    assert multiprocessing.active_children() == []


def test_load_reaches_worker_status_and_router_metrics(make_model_dir) -> None:
    from pdserve.router.metrics import RouterMetrics
    from pdserve.serve.engine.engine import Engine
    from pdserve.serve.worker.server import _moe_load

    model_dir = make_model_dir("deepseek_v3")
    engine = Engine(ModelConfig(str(model_dir)), CacheConfig(block_size=8, num_blocks=8),
                    ParallelConfig(device="cpu", expert_capacity_factor=TINY_FACTOR))
    try:
        engine.runner.execute(_step(engine.spec.vocab_size))
        load = _moe_load(engine)
    finally:
        engine.shutdown()
    assert len(load["moe_expert_tokens"]) == 8 and load["moe_dropped_tokens"] > 0
    status = WorkerStatus(worker_id="c0", role="colocated", model="m", max_model_len=64,
                          is_ready=True, num_running=0, num_waiting=0, num_free_blocks=8,
                          num_total_blocks=8, block_size=8, **load)
    status = WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(status))  # over the wire
    worker = SimpleNamespace(status=status, worker_id="c0", role="colocated")
    text = RouterMetrics("m").render([worker]).decode()
    routed = load["moe_expert_tokens"]
    assert (f'pdserve:moe_expert_tokens_total{{expert="3",model_name="m",role="colocated",'
            f'worker="c0"}} {float(routed[3])}') in text
    assert (f'pdserve:moe_dropped_tokens_total{{model_name="m",role="colocated",worker="c0"}} '
            f'{float(load["moe_dropped_tokens"])}') in text
