"""The communication model (pdserve/serve/executor/comm_model.py) against hand derivations written
out here, and against the bytes a real TP 2 / EP 2 step hands its collectives (counted on rank 0,
which runs in this process)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from benchmarks.comm_table import DEEPSEEK_V3_CONFIG, LLAMA3_8B_CONFIG
from benchmarks.comm_table import main as comm_table_main
from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.executor.comm_model import (
    Layout,
    ModelShape,
    comm_table,
    kv_handoff_bytes,
    ring_all_reduce_bytes,
)
from pdserve.serve.executor.model_runner import ModelRunner
from pdserve.serve.layers.distributed import TPGroup

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}


def _rows(shape: ModelShape, layout: Layout) -> dict[str, object]:
    return {r.name: r for r in comm_table(shape, layout)}


def test_tp_all_reduce_by_hand() -> None:
    # Llama, 2 layers, hidden 64, fp32, TP 2, a 10-token step:
    #   payload of one all-reduce = 10 tokens x 64 x 4 B = 2560 B
    #   2 per layer x 2 layers = 4 calls; a ring all-reduce over 2 ranks sends
    #   2 (2 - 1) / 2 = 1 x payload per rank per call -> 4 x 2560 = 10240 B per rank
    shape = ModelShape.from_hf_config(TINY_LLAMA)
    rows = _rows(shape, Layout(tp=2, num_tokens=10, prompt_len=10))
    tp = rows["tp_all_reduce"]
    assert (tp.calls_per_step, tp.payload_bytes, tp.bytes_per_rank) == (4, 2560, 10240)
    assert rows["tp_embedding_all_reduce"].bytes_per_rank == 2560
    # TP 8: each rank sends 2 x 7 / 8 of the payload per call
    assert ring_all_reduce_bytes(8000, 8) == 14000
    assert "tp_all_reduce" not in _rows(shape, Layout(tp=1))  # nothing to reduce


def test_handoff_kv_gqa_against_mla_by_hand() -> None:
    # GQA Llama-3-8B-shaped: 32 layers x P tokens x (K + V) x 8 KV heads x 128 x 2 B
    llama = ModelShape.from_hf_config(LLAMA3_8B_CONFIG)
    assert kv_handoff_bytes(llama, 4096) == 32 * 4096 * 2 * 8 * 128 * 2 == 536_870_912
    # DeepSeek-V3: 61 layers x P tokens x (kv_lora_rank 512 + rope 64) x 2 B, whatever its
    # 128 heads: the latent is shared by all heads
    v3 = ModelShape.from_hf_config(DEEPSEEK_V3_CONFIG)
    assert v3.is_mla and v3.kv_row_numbers(tp=8) == 576
    assert kv_handoff_bytes(v3, 4096) == 61 * 4096 * 576 * 2 == 287_834_112
    # Expanded K/V for its 128 heads would be (192 + 128) numbers per head per token
    expanded = 61 * 4096 * 128 * (128 + 64 + 128) * 2
    assert expanded / kv_handoff_bytes(v3, 4096) == pytest.approx(71.1, abs=0.1)


def test_deepseek_v3_shape_from_its_config() -> None:
    v3 = ModelShape.from_hf_config(DEEPSEEK_V3_CONFIG)
    assert (v3.num_layers, v3.hidden_size, v3.num_experts, v3.num_experts_per_tok) == (
        61, 7168, 256, 8)
    assert v3.moe_layers == tuple(range(3, 61))  # first_k_dense_replace = 3
    assert v3.dtype_bytes == 2


def test_ep_all_to_all_by_hand() -> None:
    # DeepSeek-V3, TP 8 x EP 8, 4096 tokens: each rank dispatches its 4096 / 8 = 512 tokens
    # x top-8 rows of 7168 bf16 values = 512 x 8 x 7168 x 2 = 58,720,256 B; under uniform
    # routing 7 / 8 of it leaves the rank, and as much comes back in the combine. The count
    # exchange is 256 experts x 8 B, 7 / 8 off-rank = 1792 B. 58 MoE layers, 3 calls each.
    v3 = ModelShape.from_hf_config(DEEPSEEK_V3_CONFIG)
    ep = _rows(v3, Layout(tp=8, ep=8, num_tokens=4096))["ep_all_to_all"]
    assert ep.payload_bytes == 512 * 8 * 7168 * 2 == 58_720_256
    assert ep.calls_per_step == 3 * 58
    assert ep.bytes_per_rank == 58 * (2 * 58_720_256 * 7 // 8 + 1792)
    # PP 2 cuts the layers 31 + 30: the second stage holds 30 MoE layers, the busiest
    ep_pp = _rows(v3, Layout(tp=8, ep=8, pp=2, num_tokens=4096))["ep_all_to_all"]
    assert ep_pp.calls_per_step == 3 * 30


def test_pp_send_and_cp_ring_by_hand() -> None:
    v3 = ModelShape.from_hf_config(DEEPSEEK_V3_CONFIG)
    # PP: 4 micro-batches of 4096 / 4 = 1024 tokens; hidden and residual, bf16:
    # 2 x 1024 x 7168 x 2 B = 29,360,128 B per send, 4 per boundary per step
    pp = _rows(v3, Layout(pp=2, num_micro_batches=4, num_tokens=4096))["pp_send"]
    assert (pp.payload_bytes, pp.calls_per_step) == (29_360_128, 4)
    assert pp.bytes_per_rank == 4 * 29_360_128
    # CP 4 over 131072 tokens: each rank's 32768 latent rows of 576 bf16 values
    # (37,748,736 B) pass 3 hops in each of the 61 layers
    cp = _rows(v3, Layout(cp=4, num_tokens=131072))["cp_ring_rotation"]
    assert cp.payload_bytes == 32768 * 576 * 2 == 37_748_736
    assert cp.bytes_per_rank == 61 * 3 * 37_748_736
    # GQA under CP 2 x TP 2: a rank rings K and V of its 8 / 2 = 4 KV heads of 128
    llama = ModelShape.from_hf_config(LLAMA3_8B_CONFIG)
    cp_llama = _rows(llama, Layout(cp=2, tp=2, num_tokens=8192))["cp_ring_rotation"]
    assert cp_llama.payload_bytes == 4096 * (2 * 4 * 128) * 2


def _count(monkeypatch: pytest.MonkeyPatch, method: str) -> list[tuple[int, ...]]:
    """Wrap TPGroup.<method> in this process (rank 0): record each call's payload."""
    calls: list[tuple[int, ...]] = []
    original = getattr(TPGroup, method)

    def counted(self: TPGroup, x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append((x.numel() * x.element_size(), x.shape[0]))
        return original(self, x, *args)

    monkeypatch.setattr(TPGroup, method, counted)
    return calls


def test_tp2_all_reduce_bytes_counted_match_the_model(llama_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count(monkeypatch, "all_reduce")
    with ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(block_size=8, num_blocks=8),
                     ParallelConfig(tensor_parallel_size=2, device="cpu")) as runner:
        config = json.loads((llama_dir / "config.json").read_text())
        calls.clear()
        runner.execute(StepInput([SeqChunk("a", list(range(1, 14)), 0, [0, 1], True)]))
    shape = ModelShape.from_hf_config(config)
    rows = _rows(shape, Layout(tp=2, num_tokens=13))
    expected = (rows["tp_all_reduce"].calls_per_step * rows["tp_all_reduce"].payload_bytes
                + rows["tp_embedding_all_reduce"].payload_bytes)
    assert len(calls) == rows["tp_all_reduce"].calls_per_step + 1
    assert sum(nbytes for nbytes, _ in calls) == expected
    assert multiprocessing.active_children() == []


def test_ep2_dispatch_bytes_counted_match_the_model(make_model_dir,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_model_dir("deepseek_v3")
    config = json.loads((model_dir / "config.json").read_text())
    shape = ModelShape.from_hf_config(config)
    calls = _count(monkeypatch, "all_to_all")
    with ModelRunner(ModelConfig(str(model_dir)), CacheConfig(block_size=8, num_blocks=8),
                     ParallelConfig(tensor_parallel_size=2, device="cpu",
                                    enable_expert_parallel=True)) as runner:
        calls.clear()
        runner.execute(StepInput([SeqChunk("a", list(range(1, 13)), 0, [0, 1], True)]))
    ep = _rows(shape, Layout(tp=2, ep=2, num_tokens=12))["ep_all_to_all"]
    assert len(calls) == ep.calls_per_step == 3 * len(shape.moe_layers)
    counts, dispatches = calls[0::3], calls[1::3]
    # the count exchange: [ranks, experts per rank] int64 = every expert x 8 B
    assert all(nbytes == shape.num_experts * 8 for nbytes, _ in counts)
    # dispatch: rank 0's 12 / 2 tokens x top-k rows of hidden (fp32), exactly the model's
    assert all(nbytes == ep.payload_bytes for nbytes, _ in dispatches)


def test_benchmark_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "comm_table.json"
    assert comm_table_main(["--output", str(out)]) == 0
    result = json.loads(out.read_text())
    v3 = next(m for m in result["models"] if m["model"].startswith("deepseek-v3"))
    names = {c["name"] for e in v3["layouts"] for c in e["collectives"]}
    assert {"tp_all_reduce", "ep_all_to_all", "pp_send", "cp_ring_rotation",
            "kv_handoff_per_request"} <= names
