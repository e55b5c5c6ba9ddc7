"""TP=2 (two gloo processes) against TP=1, and the shard arithmetic of each parallel layer.

Tolerance 1e-4: TP sums the O/down partial products in a different order (all-reduce of two
halves), which moves fp32 logits by ~1e-6 on these models.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.executor.loader import _default_weight_loader
from pdserve.serve.executor.model_runner import ModelRunner
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.layers.parallel import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

ATOL = 1e-4


def _steps(vocab_size: int) -> list[StepInput]:
    """Two prefills (one chunked), then a step mixing a decode row and the prompt's tail."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (23, 9))
    return [
        StepInput([SeqChunk("a", a[:13], 0, [5, 2], True), SeqChunk("b", b, 0, [7, 8], True)]),
        StepInput([SeqChunk("b", [b[0]], 9, [7, 8], True),
                   SeqChunk("a", a[13:], 13, [5, 2, 9], True)]),
        StepInput([SeqChunk("b", [b[1]], 10, [7, 8], True),
                   SeqChunk("a", [a[0]], 23, [5, 2, 9], True)]),
    ]


def _run(model_dir: Path, tp: int) -> list[torch.Tensor]:
    with ModelRunner(ModelConfig(str(model_dir)), CacheConfig(block_size=8, num_blocks=16),
                     ParallelConfig(tensor_parallel_size=tp, device="cpu")) as runner:
        assert runner.kv_caches[0].shape[3] == max(1, runner.spec.num_kv_heads // tp)
        return [runner.execute(step) for step in _steps(runner.spec.vocab_size)]


@pytest.mark.parametrize("variant", ["llama", "qwen2_odd_vocab_one_kv_head"])
def test_tp2_matches_tp1(variant: str, llama_dir: Path, make_model_dir) -> None:
    if variant == "llama":
        model_dir = llama_dir  # 2 KV heads: split one per rank
    else:
        # 1 KV head is replicated on both ranks; vocab 1001 pads the vocab split to 501 + 501;
        # qkv bias and tied embeddings go through the sharded loaders too.
        model_dir = make_model_dir("qwen2", seed=7, num_key_value_heads=1, vocab_size=1001,
                                   tie_word_embeddings=True)
    tp1, tp2 = _run(model_dir, 1), _run(model_dir, 2)
    for one, two in zip(tp1, tp2, strict=True):
        assert one.shape == two.shape and one.shape[0] == 2
        torch.testing.assert_close(two, one, atol=ATOL, rtol=0)
        assert torch.equal(two.argmax(-1), one.argmax(-1))
    assert multiprocessing.active_children() == []  # workers joined
    assert not dist.is_initialized()


def test_dead_worker_is_reported_and_shutdown_is_clean(llama_dir: Path) -> None:
    runner = ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(block_size=8, num_blocks=8),
                         ParallelConfig(tensor_parallel_size=2, device="cpu"))
    try:
        (worker,) = runner._workers
        worker.kill()
        worker.join(timeout=10)
        with pytest.raises(RuntimeError, match="died"):
            runner.execute(StepInput([SeqChunk("a", [1, 2], 0, [0], True)]))
    finally:
        runner.shutdown()
        runner.shutdown()  # idempotent
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


# ---- shard arithmetic, one rank at a time (no process group needed) ----------------------


def _shards(make, loader_calls, size: int) -> list[torch.nn.Module]:
    layers = []
    for rank in range(size):
        layer = make(TPGroup(rank, size))
        for param_name, tensor, *shard_id in loader_calls:
            param = getattr(layer, param_name)
            # as pdserve/serve/executor/loader.py does: the layer's loader, else the plain
            # shape-checked copy
            load = getattr(param, "weight_loader", _default_weight_loader)
            load(param, tensor, *shard_id)
        layers.append(layer)
    return layers


def test_qkv_split_and_kv_head_replication() -> None:
    head_dim, hidden = 2, 3
    q = torch.arange(8 * head_dim * hidden, dtype=torch.float32).view(8 * head_dim, hidden)
    k = -torch.arange(2 * head_dim * hidden, dtype=torch.float32).view(2 * head_dim, hidden)
    v = k - 1000
    calls = [("weight", q, "q"), ("weight", k, "k"), ("weight", v, "v")]
    # tp=4 > 2 KV heads: ranks 0,1 hold KV head 0; ranks 2,3 hold KV head 1.
    layers = _shards(lambda tp: QKVParallelLinear(hidden, head_dim, 8, 2, False, tp), calls, 4)
    for rank, layer in enumerate(layers):
        w = layer.weight
        assert w.shape == ((2 + 2 * 1) * head_dim, hidden)
        assert torch.equal(w[: 2 * head_dim], q[rank * 4 : (rank + 1) * 4])
        kv_head = rank // 2
        assert torch.equal(w[4:6], k[kv_head * 2 : kv_head * 2 + 2])
        assert torch.equal(w[6:8], v[kv_head * 2 : kv_head * 2 + 2])
    with pytest.raises(ValueError, match="not divisible"):
        QKVParallelLinear(hidden, head_dim, 8, 3, False, TPGroup(0, 2))


def test_merged_row_and_vocab_shards_reassemble() -> None:
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    merged = _shards(lambda tp: MergedColumnParallelLinear(4, [6, 6], False, tp),
                     [("weight", gate, 0), ("weight", up, 1)], 2)
    assert torch.equal(torch.cat([m.weight[:3] for m in merged]), gate)
    assert torch.equal(torch.cat([m.weight[3:] for m in merged]), up)

    down = torch.randn(4, 6)
    rows = _shards(lambda tp: RowParallelLinear(6, 4, False, tp), [("weight", down)], 2)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), down)

    table = torch.randn(5, 3)  # vocab 5 over 2 ranks: 3 + 3 rows, the last one zero padding
    emb = _shards(lambda tp: VocabParallelEmbedding(5, 3, tp), [("weight", table)], 2)
    assert torch.equal(torch.cat([e.weight for e in emb])[:5], table)
    assert torch.count_nonzero(emb[1].weight[2]) == 0


def test_unreduced_row_shards_sum_to_the_full_layer_with_one_bias() -> None:
    """reduce=False: the caller sums the ranks' partial outputs (the MoE block's one
    all-reduce); the bias must be in that sum exactly once. ReplicatedLinear loads it all."""
    weight, bias, x = torch.randn(4, 6), torch.randn(4), torch.randn(3, 6)
    rows = _shards(lambda tp: RowParallelLinear(6, 4, True, tp, reduce=False),
                   [("weight", weight), ("bias", bias)], 2)
    partial = [row(x[:, r * 3:(r + 1) * 3]) for r, row in enumerate(rows)]
    torch.testing.assert_close(partial[0] + partial[1], x @ weight.T + bias)
    (replicated,) = _shards(lambda tp: ReplicatedLinear(6, 4, True),
                            [("weight", weight), ("bias", bias)], 1)
    # (a decode-sized x takes the skinny kernel, whose sums run in another order than torch's)
    torch.testing.assert_close(replicated(x), x @ weight.T + bias, atol=1e-5, rtol=1e-5)


def test_idle_longer_than_collective_timeout_keeps_workers(llama_dir: Path) -> None:
    """Workers block in a receive between steps; heartbeats keep that under the timeout."""
    step = StepInput([SeqChunk("a", [1, 2, 3], 0, [0], True)])
    with ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(block_size=8, num_blocks=4),
                     ParallelConfig(tensor_parallel_size=2, device="cpu"),
                     dist_timeout_s=3.0) as runner:
        first = runner.execute(step)
        time.sleep(4.5)  # > dist_timeout_s with no step: only heartbeats cross
        runner._check_workers()
        torch.testing.assert_close(runner.execute(step), first, atol=0, rtol=0)
    assert multiprocessing.active_children() == []


def test_failed_start_leaves_no_workers(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "no-weights"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(ModelConfig(str(model_dir)), CacheConfig(num_blocks=4),
                    ParallelConfig(tensor_parallel_size=2, device="cpu"))
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_runner_refuses_steps_after_a_failed_one(llama_dir: Path, monkeypatch) -> None:
    """A TP step that fails on rank 0 leaves the worker mid-collective: no further step is
    sent, and shutdown still ends the stuck worker. A single rank simply carries on."""
    step = StepInput([SeqChunk("a", [1, 2], 0, [0], True)])

    def explode(*args: object) -> None:
        raise RuntimeError("boom")

    for tp in (1, 2):
        with ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(num_blocks=4),
                         ParallelConfig(tensor_parallel_size=tp, device="cpu")) as runner:
            expected = runner.execute(step)
            monkeypatch.setattr(runner._rank, "execute", explode)
            with pytest.raises(RuntimeError, match="boom"):
                runner.execute(step)
            monkeypatch.undo()
            if tp == 1:
                torch.testing.assert_close(runner.execute(step), expected, atol=0, rtol=0)
            else:
                with pytest.raises(RuntimeError, match="earlier step"):
                    runner.execute(step)
        assert multiprocessing.active_children() == []
