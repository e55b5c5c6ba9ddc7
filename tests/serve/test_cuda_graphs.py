"""Decode steps through the CUDA-graph buffers (pdserve/serve/executor/cuda_graphs.py) give the
eager path's tokens.

On CPU nothing is captured: PDSERVE_CUDA_GRAPHS_ON_CPU=1 runs the same static buffers,
padding and captured callable eagerly, which proves the padding and buffer logic here. The
gpu-marked tests capture real graphs: the same tokens as --enforce-eager, and a replayed step
that never waits for the device. KV writes that skip a padding row's slot -1 are tested per
backend beside the other KV-write tests (tests/kernels).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.model_util import random_prompts

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve import LLM
from pdserve.serve.executor.cuda_graphs import DecodeGraphs, decode_batch_sizes

BATCHES = (1, 3, 5)  # none but 1 a bucket of max_num_seqs 8: 3 pads to 4, 5 to 8
PROMPTS = random_prompts([9, 17, 4, 30, 12], vocab_size=1000, seed=2)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=12,
                          ignore_eos=True)


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]),
    (8, [1, 2, 4, 8]),
    (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
])
def test_buckets_are_powers_of_two_to_8_then_every_8(max_num_seqs: int,
                                                     expected: list[int]) -> None:
    assert decode_batch_sizes(max_num_seqs) == expected


def test_a_step_is_padded_to_its_bucket_and_stale_rows_are_cleared() -> None:
    """What the captured callable sees: the step's rows, then harmless padding (slot -1,
    length 1, a table of zeros), tables cut to max_model_len's width and zeroed past each
    sequence's own blocks, also where an earlier step left longer ones."""
    seen: dict[str, list] = {}

    def decoder(input_ids, kv_caches, meta):
        seen.update(ids=input_ids.tolist(), positions=meta.positions.tolist(),
                    slots=meta.slot_mapping.tolist(), lens=meta.seq_lens.tolist(),
                    tables=meta.block_tables.tolist(), cu=meta.cu_seqlens_q.tolist(),
                    decode=(meta.is_decode_only, meta.max_query_len))
        return SimpleNamespace(hidden=input_ids[:, None].float())

    model = SimpleNamespace(model=decoder, compute_logits=lambda hidden: hidden)
    graphs = DecodeGraphs(model, max_num_seqs=8, max_model_len=64, block_size=16,  # width 4
                          device=torch.device("cpu"))
    assert graphs.capture([]) and not graphs.is_captured  # CPU: bound, never captured
    step = StepInput([SeqChunk("a", [11], 20, [3, 7], True),
                      SeqChunk("b", [12], 0, [5], True),
                      SeqChunk("c", [13], 47, [1, 2, 9, 4, 6], True)])  # a table past width
    assert graphs.can_run(step, None) and not graphs.can_run(step, lambda layer: None)
    logits = graphs.run(step)
    assert logits.tolist() == [[11.0], [12.0], [13.0]]
    assert seen == dict(ids=[11, 12, 13, 0], positions=[20, 0, 47, 0],
                        slots=[7 * 16 + 4, 5 * 16, 9 * 16 + 15, -1], lens=[21, 1, 48, 1],
                        tables=[[3, 7, 0, 0], [5, 0, 0, 0], [1, 2, 9, 4], [0, 0, 0, 0]],
                        cu=[0, 1, 2, 3, 4], decode=(True, 1))
    graphs.run(StepInput([SeqChunk("a", [21], 5, [3], True),
                          SeqChunk("d", [22], 3, [8], True)]))  # bucket 2, shorter tables
    assert (seen["ids"], seen["slots"], seen["tables"]) == (
        [21, 22], [3 * 16 + 5, 8 * 16 + 3], [[3, 0, 0, 0], [8, 0, 0, 0]])
    assert graphs.num_replays == 2
    prompt = StepInput([SeqChunk("e", [1, 2], 0, [3], True)])
    too_many = StepInput([SeqChunk(str(i), [1], 0, [i], True) for i in range(9)])
    assert not graphs.can_run(prompt, None) and not graphs.can_run(too_many, None)


def _run_batches(llama_dir, monkeypatch, enforce_eager: bool
                 ) -> tuple[list[list[int]], list[torch.Tensor], DecodeGraphs | None]:
    """Greedy then seeded sampled tokens of the BATCHES, the KV pool afterwards, and the
    engine's decode graphs, with PDSERVE_CUDA_GRAPHS_ON_CPU=1 (enforce_eager wins over it)."""
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS_ON_CPU", "1")
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", "0")
    tokens = []
    with LLM(llama_dir, num_kv_blocks=128, block_size=16, device="cpu", max_num_seqs=8,
             enforce_eager=enforce_eager) as llm:
        for n in BATCHES:
            for params in (GREEDY, [sampled(seed) for seed in range(n)]):
                outputs = llm.generate(PROMPTS[:n], params)
                tokens += [list(o.outputs[0].token_ids) for o in outputs]
        pool = [cache.clone() for cache in llm.engine.runner.kv_caches]
        graphs = llm.engine.runner._rank.decode_graphs
    return tokens, pool, graphs


def test_padded_decode_buffers_give_the_eager_tokens_on_cpu(llama_dir, monkeypatch) -> None:
    eager_tokens, eager_pool, no_graphs = _run_batches(llama_dir, monkeypatch, True)
    tokens, pool, graphs = _run_batches(llama_dir, monkeypatch, False)
    assert no_graphs is None  # enforce_eager turns them off even where forced on
    assert graphs is not None and not graphs.is_captured and graphs.batch_sizes == [1, 2, 4, 8]
    assert graphs.num_replays >= 3 * 11  # every decode step of every batch replayed
    assert tokens == eager_tokens
    # The padding rows wrote nothing: an eager run's untouched blocks (the pool's last one,
    # where a slot of -1 would land if indexed) are untouched here too. The rows' products ran
    # at a bucket's row count, so the written values agree to float32 rounding, not bits.
    for cache, eager_cache in zip(pool, eager_pool, strict=True):
        assert torch.equal(cache == 0, eager_cache == 0)
        torch.testing.assert_close(cache, eager_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_give_the_eager_tokens_on_cuda(llama_dir) -> None:
    results = {}
    for enforce_eager in (True, False):
        tokens = []
        with LLM(llama_dir, num_kv_blocks=128, device="cuda", max_num_seqs=8,
                 enforce_eager=enforce_eager) as llm:
            for n in BATCHES:
                for params in (GREEDY, [sampled(seed) for seed in range(n)]):
                    outputs = llm.generate(PROMPTS[:n], params)
                    tokens += [list(o.outputs[0].token_ids) for o in outputs]
            graphs = llm.engine.runner._rank.decode_graphs
            assert (graphs is None) == enforce_eager
            if graphs is not None:
                assert graphs.is_captured and graphs.num_replays >= 3 * 11
        results[enforce_eager] = tokens
    assert results[False] == results[True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_replayed_decode_step_never_waits_for_the_device(llama_dir) -> None:
    """The forward of a decode step, inputs to logits, with CUDA's sync check on: the inputs go
    up from pinned buffers without a wait and nothing comes back (sampling, which does read
    the sampled ids back, is not part of it)."""
    with LLM(llama_dir, num_kv_blocks=64, device="cuda", max_num_seqs=8) as llm:
        runner = llm.engine.runner
        graphs = runner._rank.decode_graphs
        assert graphs is not None and graphs.is_captured
        step = StepInput([SeqChunk(f"r{i}", [5 + i], 3 + i, [i], True) for i in range(3)])
        runner.execute(step)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = runner.execute(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert graphs.num_replays == 2 and logits.shape == (3, runner.spec.vocab_size)


@pytest.mark.parametrize("error", [ValueError("an op with no capture rule"),
                                   AssertionError("Torch not compiled with CUDA enabled"),
                                   RuntimeError("operation not permitted when capturing")])
def test_any_capture_failure_leaves_eager_decode_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: Exception) -> None:
    """Not only RuntimeError: whatever capturing raises, the step runs eagerly after it."""
    model = SimpleNamespace(model=lambda ids, caches, meta: SimpleNamespace(
        hidden=ids[:, None].float()), compute_logits=lambda hidden: hidden)
    graphs = DecodeGraphs(model, max_num_seqs=4, max_model_len=32, block_size=16,
                          device=torch.device("cpu"))
    graphs.device = torch.device("cuda")  # as built for a GPU; capture is stubbed below

    def fail() -> None:
        graphs._graphs[4] = "half-captured"  # type: ignore[assignment]
        raise error

    monkeypatch.setattr(graphs, "_capture_buckets", fail)
    with caplog.at_level("WARNING", logger="pdserve.serve.executor.cuda_graphs"):
        assert graphs.capture([]) is False
    assert not graphs.is_captured and graphs.kv_caches is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert type(error).__name__ in caplog.records[0].getMessage()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_bucket_warms_up_on_one_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    streams: list[int] = []
    model = SimpleNamespace(model=lambda ids, caches, meta: SimpleNamespace(
        hidden=ids[:, None].float()), compute_logits=lambda hidden: hidden * 2)
    graphs = DecodeGraphs(model, max_num_seqs=8, max_model_len=32, block_size=16,
                          device=torch.device("cuda"))
    original = graphs._warm_up

    def warm_up(size, stream):
        streams.append(stream.stream_id)
        original(size, stream)

    monkeypatch.setattr(graphs, "_warm_up", warm_up)
    assert graphs.capture([]) and graphs.is_captured
    assert len(streams) == len(graphs.batch_sizes) and len(set(streams)) == 1
