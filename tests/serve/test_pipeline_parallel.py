"""Pipeline parallelism (pdserve/serve/layers/pipeline.py): PP 2 and PP 2 x TP 2 against Hugging
Face, each
stage holding only its layers, the KV hand-off between PP and TP shapes, and the split
arithmetic (stages, micro-batches, bubble).

Models have 3 layers, so PP 2 splits them unevenly: stage 0 layers [0, 2), stage 1 [2, 3).
Ragged batches of several prompts make the scheduler's steps hold several sequences, so
steps really run as several micro-batches in flight. Worlds stay at 4 ranks at most (gloo
on CPU); the served test (`pdserve up --prefill-pp 2`) is marked slow.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.engine_util import prefill_engine, run_to_completion, token_ids
from helpers.model_util import hf_greedy, load_hf, random_prompts
from helpers.model_walks import NUM_BLOCKS, ragged_chunked_then_decodes
from transformers import AutoTokenizer

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve import LLM
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.roles import make_role
from pdserve.serve.executor.loader import load_model, load_model_spec
from pdserve.serve.executor.model_runner import ModelRunner
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.layers.pipeline import (
    MissingLayer,
    PipelineStage,
    bubble_fraction,
    split_micro_batches,
    stage_layer_range,
)

GREEDY = SamplingParams(temperature=0, max_tokens=6)
LENGTHS = [3, 11, 26, 17]  # several prompts at once, every length different


@pytest.fixture(scope="module")
def llama3_dir(make_model_dir) -> Path:
    """Tiny Llama, GQA (4 query heads, 2 KV heads), 3 layers."""
    return make_model_dir("llama", seed=5, num_hidden_layers=3)


@pytest.fixture(scope="module")
def deepseek3_dir(make_model_dir) -> Path:
    """Tiny DeepSeek-V3: MLA, layer 0 dense, layers 1-2 MoE; 3 layers."""
    return make_model_dir("deepseek_v3", seed=3)



# ---- the arithmetic ----------------------------------------------------------------------


def test_stage_split_is_even_then_front_loaded_and_pp_past_layers_is_an_error() -> None:
    assert [stage_layer_range(10, 4, s) for s in range(4)] == [
        range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert [stage_layer_range(3, 2, s) for s in range(2)] == [range(0, 2), range(2, 3)]
    assert [stage_layer_range(4, 4, s) for s in range(4)] == [range(s, s + 1) for s in range(4)]
    with pytest.raises(ValueError, match="exceeds the model's 3 layers"):
        stage_layer_range(3, 4, 0)
    stage = PipelineStage(1, 2, 3, tie_word_embeddings=True)
    assert stage.is_last and stage.holds_embedding and not stage.holds_layer(1)
    assert stage.skips_checkpoint_tensor("model.layers.1.mlp.down_proj.weight")
    assert not stage.skips_checkpoint_tensor("model.layers.2.mlp.down_proj.weight")
    assert not stage.skips_checkpoint_tensor("model.embed_tokens.weight")  # the tied head's
    first = PipelineStage(0, 2, 3)
    assert first.skips_checkpoint_tensor("lm_head.weight")
    assert first.skips_checkpoint_tensor("model.norm.weight")
    assert not first.skips_checkpoint_tensor("model.embed_tokens.weight")


def test_micro_batches_cut_whole_sequences_balanced_by_tokens() -> None:
    def step(*lengths: int) -> StepInput:
        return StepInput([SeqChunk(f"r{i}", [1] * n, 0, [0], True)
                          for i, n in enumerate(lengths)])

    def cut(s: StepInput, m: int) -> list[list[str]]:
        return [[c.request_id for c in mb.chunks] for mb in split_micro_batches(s, m)]

    assert cut(step(1, 1, 1, 1), 2) == [["r0", "r1"], ["r2", "r3"]]  # decodes: halves
    assert cut(step(40, 1, 1, 1), 2) == [["r0"], ["r1", "r2", "r3"]]  # a long prompt alone
    assert cut(step(1, 1, 1, 40), 2) == [["r0", "r1", "r2"], ["r3"]]
    assert cut(step(5, 5, 5), 4) == [["r0"], ["r1"], ["r2"]]  # at most one per sequence
    assert cut(step(7), 2) == [["r0"]]  # one sequence cannot overlap
    every = step(3, 9, 1, 4, 4, 2)
    for m in (1, 2, 3, 6):
        parts = split_micro_batches(every, m)
        assert len(parts) == m and all(p.chunks for p in parts)
        assert [c for p in parts for c in p.chunks] == every.chunks  # order kept
    assert bubble_fraction(2, 2) == pytest.approx(1 / 3)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 1) == 0


def test_each_stage_builds_and_loads_only_its_layers(llama3_dir, deepseek3_dir) -> None:
    """In process, one stage at a time (no process group: TP 1): the parameter names a stage
    holds are its layers' (global indices), the embedding on the first, norm and head on
    the last; the loader skipped every other tensor (and found no gap in its own)."""
    for model_dir in (llama3_dir, deepseek3_dir):
        spec = load_model_spec(ModelConfig(str(model_dir)), "cpu")
        whole = {n for n, _ in load_model(spec, TPGroup(), torch.device("cpu"), "torch",
                                          show_progress=False).named_parameters()}
        held = []
        for index in range(2):
            stage = PipelineStage(index, 2, spec.num_layers)
            model = load_model(spec, TPGroup(), torch.device("cpu"), "torch",
                               show_progress=False, stage=stage)
            names = {n for n, _ in model.named_parameters()}
            layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
            assert layers == set(stage.layers)
            assert ("model.embed_tokens.weight" in names) == (index == 0)
            assert ("lm_head.weight" in names) == ("model.norm.weight" in names) == (index == 1)
            assert isinstance(model.model.layers[2 if index == 0 else 0], MissingLayer)
            held.append(names)
        assert held[0].isdisjoint(held[1]) and held[0] | held[1] == whole


@torch.inference_mode()
def test_stages_in_sequence_equal_the_whole_model_with_a_tied_head(make_model_dir) -> None:
    """In process: stage 0's (hidden, residual) fed to stage 1 gives the whole model's logits
    exactly; a tied head on the last stage reads its own copy of the embedding rows."""
    from pdserve.serve.executor.kv_cache import KVCachePool
    from pdserve.serve.layers.attention import build_attention_metadata

    model_dir = make_model_dir("qwen2", seed=1, num_hidden_layers=3, tie_word_embeddings=True)
    spec = load_model_spec(ModelConfig(str(model_dir)), "cpu")
    cpu = torch.device("cpu")
    step = StepInput([SeqChunk("a", list(range(3, 14)), 0, [2, 0], True),
                      SeqChunk("b", list(range(40, 45)), 0, [1], True)])
    meta = build_attention_metadata(step, 8, cpu)
    input_ids = torch.tensor([t for c in step.chunks for t in c.token_ids])
    rows = torch.tensor([10, 15])

    def pool(num_layers: int) -> list[torch.Tensor]:
        return KVCachePool(num_layers, 3, 8, spec.num_kv_heads, spec.head_dim, torch.float32,
                           cpu).kv_caches

    whole = load_model(spec, TPGroup(), cpu, "torch", show_progress=False)
    expected = whole.compute_logits(whole(input_ids, pool(3), meta).hidden.index_select(0, rows))
    first, last = (load_model(spec, TPGroup(), cpu, "torch", show_progress=False,
                              stage=PipelineStage(i, 2, 3, True)) for i in range(2))
    assert first.lm_head is None and last.model.embed_tokens is not None
    assert last.lm_head.weight is last.model.embed_tokens.weight
    carried = first(input_ids, pool(2), meta).carried
    assert isinstance(carried, tuple) and carried[0].shape == (16, spec.hidden_size)
    hidden = last(input_ids, pool(1), meta, None, carried).hidden
    torch.testing.assert_close(last.compute_logits(hidden.index_select(0, rows)), expected,
                               atol=0, rtol=0)


# ---- against Hugging Face ----------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "pp2xtp2"])
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_pipeline_greedy_tokens_match_hf(arch: str, tp: int, llama3_dir, deepseek3_dir
                                         ) -> None:
    """The engine's greedy tokens (M = 2 micro-batches at PP 2 x TP 2, 3 at PP 2). At PP 2 the
    runner then also walks logits (1e-4, fp32) through tests/helpers/model_walks.py's steps: two
    sampling prompts beside a chunk that does not sample, a chunk over a cached prefix beside
    decodes, decode-only steps, block tables shuffled over the pool."""
    model_dir = llama3_dir if arch == "llama" else deepseek3_dir
    prompts = random_prompts(LENGTHS, 200, seed=11)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens, stop_at_eos=True)
    micro_batches = 3 if tp == 1 else 2
    with LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=2, device="cpu",
             block_size=8, num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=40,
             pipeline_micro_batches=micro_batches) as llm:
        runner = llm.engine.runner
        assert runner.pipeline_parallel_size == 2 and runner.tensor_parallel_size == tp
        assert len(runner.kv_caches) == 2  # rank 0 (stage 0) caches layers 0 and 1 only
        outs = llm.generate(prompts, GREEDY)
        times = runner.pipeline_times
        # several sequences a step: micro-batches in flight in most steps
        assert times.num_micro_batches > times.num_steps
        assert llm.engine.block_manager.num_used_blocks == 0
        llm.engine.block_manager.check_integrity()
        if tp == 1:  # (the engine is idle: its cached blocks may be overwritten)
            before = dataclasses.replace(times)
            ragged_chunked_then_decodes(runner, load_hf(model_dir), 8, 2)
            assert times.num_steps - before.num_steps == 4
            assert times.num_micro_batches - before.num_micro_batches == 12  # 3 a step
    for out, want in zip(outs, expected, strict=True):
        got = out.outputs[0].token_ids
        assert got and got == want[:len(got)]  # (a sampled eos ends a request early)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


# ---- the hand-off between shapes ---------------------------------------------------------


def _configs(model_dir: Path) -> tuple:
    return ModelConfig(str(model_dir)), CacheConfig(block_size=8, num_blocks=64)


@pytest.mark.parametrize("prefill_pp,decode_pp", [(2, 1), (1, 2)],
                         ids=["pp2-prefill-to-tp1-decode", "tp1-prefill-to-pp2-decode"])
def test_handoff_between_pipeline_and_single_rank_gives_colocated_tokens(
        llama3_dir, prefill_pp: int, decode_pp: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama3_dir)
    prompts = random_prompts([5, 16, 21], 200, seed=3)

    def parallel(pp: int) -> ParallelConfig:
        return ParallelConfig(pipeline_parallel_size=pp, device="cpu")

    engines = []
    try:
        colocated = Engine(*_configs(llama3_dir), tokenizer=tokenizer,
                           role=make_role("colocated"))
        engines.append(colocated)
        prefill, saver = prefill_engine(*_configs(llama3_dir), parallel(prefill_pp),
                                        tokenizer=tokenizer)
        engines.append(prefill)
        decode = Engine(*_configs(llama3_dir), parallel(decode_pp), tokenizer=tokenizer,
                        role=make_role("decode"))
        engines.append(decode)
        for i, prompt in enumerate(prompts):
            colocated.add_request(prompt, GREEDY, f"c{i}")
            prefill.add_request(prompt, GREEDY, f"p{i}")
        expected = {rid: token_ids(outs) for rid, outs in run_to_completion(colocated).items()}
        prefilled = run_to_completion(prefill)
        for i, prompt in enumerate(prompts):
            [last] = prefilled[f"p{i}"]
            first = last.outputs[0].token_ids
            blocks = saver.blocks.pop(f"p{i}")
            assert len(blocks) == 3  # every stage's layers, whole heads
            block_ids = decode.add_prefilled_request(f"d{i}", prompt, GREEDY, first)
            decode.runner.write_kv_blocks(block_ids, blocks)
        decoded = run_to_completion(decode)
        for i in range(len(prompts)):
            first = prefilled[f"p{i}"][0].outputs[0].token_ids
            assert first + token_ids(decoded[f"d{i}"]) == expected[f"c{i}"]
        for engine in engines:
            engine.block_manager.check_integrity()
            assert engine.block_manager.num_used_blocks == 0
    finally:
        for engine in engines:
            engine.shutdown()
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_read_write_kv_round_trip_over_stages(llama3_dir) -> None:
    """read_kv_blocks of a PP 2 (and a PP 3) runner gives every layer; writing them into
    other blocks and reading back is exact, and equals a PP 1 runner's blocks for the same
    step (whose logits, prompt-logprob rows included, equal PP 1's too)."""
    step = StepInput([SeqChunk("a", list(range(3, 20)), 0, [4, 1, 6], True),
                      SeqChunk("b", list(range(30, 39)), 0, [9, 2], True,
                               num_prompt_logits=5)])

    def run(pp: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with ModelRunner(ModelConfig(str(llama3_dir)), CacheConfig(block_size=8, num_blocks=12),
                         ParallelConfig(pipeline_parallel_size=pp, device="cpu")) as runner:
            logits = runner.execute(step)
            blocks = runner.read_kv_blocks([4, 1, 6, 9, 2])
            runner.write_kv_blocks([0, 3, 5, 7, 8], blocks)
            again = runner.read_kv_blocks([0, 3, 5, 7, 8])
            assert all(torch.equal(a, b) for a, b in zip(blocks, again, strict=True))
            return logits, blocks

    one_logits, one = run(1)
    assert one_logits.shape[0] == 2 + 5 and len(one) == 3  # sampled, then prompt rows
    for pp in (2, 3):  # PP 3: a middle stage that receives and sends
        logits, blocks = run(pp)
        assert len(blocks) == 3
        for a, b in zip(one, blocks, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(logits, one_logits, atol=1e-4, rtol=0)


def test_pipeline_errors_are_clear(llama3_dir, monkeypatch) -> None:
    with monkeypatch.context() as m:  # a host with 2 GPUs cannot hold PP 2 x TP 2
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: 2)
        with pytest.raises(ValueError, match="needs 4 GPUs on this node but 2 are visible"):
            ModelRunner(ModelConfig(str(llama3_dir)), CacheConfig(num_blocks=4),
                        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                                       device="cuda"))
    with pytest.raises(ValueError, match="exceeds the model's 3 layers"):
        ModelRunner(ModelConfig(str(llama3_dir)), CacheConfig(num_blocks=4),
                    ParallelConfig(pipeline_parallel_size=4, device="cpu"))
    with pytest.raises(ValueError, match="pipeline_parallel_size must be positive"):
        ParallelConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_micro_batches must be positive"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_micro_batches=0)
    runner = ModelRunner(ModelConfig(str(llama3_dir)), CacheConfig(block_size=8, num_blocks=4),
                         ParallelConfig(pipeline_parallel_size=2, device="cpu"))
    try:
        step = StepInput([SeqChunk("a", [1, 2], 0, [0], True)])
        with pytest.raises(ValueError, match="PP must be 1"):
            runner.execute(step, lambda i: None)
        (stage1,) = runner._workers  # the last stage dies: the next step says so
        stage1.kill()
        stage1.join(timeout=10)
        with pytest.raises(RuntimeError, match="died"):
            runner.execute(step)
    finally:
        runner.shutdown()
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_pdserve_up_places_pp_x_tp_ranks_and_passes_the_flag() -> None:
    import argparse

    from pdserve.app import launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--prefill-pp", "2", "--prefill-tp", "2", "--decode-pp", "1"])
    cluster = launcher.plan(args, "/m", gpus=[str(g) for g in range(5)])
    workers = {c.role: c for c in cluster.children if c.role not in ("store", "router")}
    assert workers["prefill-0"].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # 2 stages x 2
    assert workers["decode-0"].env["CUDA_VISIBLE_DEVICES"] == "4"
    prefill_argv = workers["prefill-0"].argv
    assert prefill_argv[prefill_argv.index("--pipeline-parallel-size") + 1] == "2"
    assert "--pipeline-parallel-size" not in workers["decode-0"].argv
    with pytest.raises(ValueError, match="GPUs"):
        launcher.plan(args, "/m", gpus=["0", "1", "2", "3"])


@pytest.mark.slow
def test_served_pp2_prefill_hands_off_to_tp1_decode(llama3_dir, tmp_path_factory) -> None:
    """`pdserve up --prefill-pp 2`: the prefill worker's two stages gather every layer's KV
    for the hand-off (no per-layer save under PP), the TP 1 decode worker loads it, and the
    text equals the offline single-rank engine's."""
    import httpx
    from helpers.cluster_util import assert_nothing_leaked, start_cluster, wait_until

    prompts = ["def fibonacci(n):", "import os\nimport sys\n\nclass Config:", "x"]
    with LLM(llama3_dir, num_kv_blocks=128) as llm:
        expected = [o.outputs[0].text for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=8))]
    cluster = start_cluster(llama3_dir, tmp_path_factory.mktemp("pp-logs"), "--mode", "disagg",
                            "--prefill-pp", "2", "--decode-tp", "1", "--num-kv-blocks", "128")
    try:
        for prompt, text in zip(prompts, expected, strict=True):
            r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text

        def totals(role: str) -> dict:
            (worker,) = [w for w in cluster.status()["workers"] if w["role"] == role]
            return worker.get("kv_transfer", {})

        n = len(prompts)
        assert wait_until(lambda: totals("prefill").get("save_count") == n
                          and totals("decode").get("load_count") == n), cluster.status()
        assert totals("prefill")["layerwise_save_count"] == 0
        assert totals("prefill")["saved_bytes"] == totals("decode")["loaded_bytes"] > 0
        assert totals("decode")["in_place_count"] == n  # one host: out of the segment
        assert_nothing_leaked(cluster.base_url)
    finally:
        cluster.stop()
