"""Context parallelism at the engine level: greedy tokens of CP 2 and CP 4 workers (ring
attention over gloo ranks, each rank holding its blocks' KV) equal Hugging Face's, on Llama
(GQA) and DeepSeek-V3 (MLA), with ragged batches, chunked prefills and prefix hits; a prompt
longer than one rank's pool; a CP 2 prefill handed off to a CP 1 decode; nothing leaks.

Greedy tokens must be identical: the ring only reorders fp32 sums (~1e-6 on these models'
logits, whose top-1 margins are ~1e-2 with initializer_range 0.2).
"""

from __future__ import annotations

import argparse
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from helpers.engine_util import prefill_engine, run_to_completion, token_ids
from helpers.model_util import hf_greedy
from transformers import AutoTokenizer

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.roles import make_role
from pdserve.serve.executor.context_parallel import CPGroup
from pdserve.serve.llm import LLM
from pdserve.serve.worker.server import add_arguments, parallel_config_from_args

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 200, (n,), generator=gen).tolist() for n in lengths]



def _assert_clean(engine: Engine) -> None:
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0


def _assert_shut_down() -> None:
    assert multiprocessing.active_children() == []  # every CP rank joined
    assert not dist.is_initialized()


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def model_dir(request, make_model_dir):
    return make_model_dir(request.param, seed=3)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_greedy_tokens_match_hf(model_dir, cp_size):
    """A ragged batch (a one-token prompt, short and long ones), prefills chunked by a
    24-token step budget beside decode rows, then a prompt that shares a cached prefix: the
    tokens equal HF's, and the pool ends empty."""
    prompts = _prompts([1, 5, 23, 41])
    shared = prompts[3][:32] + [7, 9, 11]  # 8 full 4-token blocks cached from prompt 3
    expected = hf_greedy(model_dir, prompts + [shared], MAX_TOKENS)
    with LLM(model_dir, context_parallel_size=cp_size, device="cpu", block_size=4,
             num_kv_blocks=64 // cp_size, max_num_batched_tokens=24) as llm:
        assert llm.engine.runner.context_parallel_size == cp_size
        assert llm.engine.block_manager.num_blocks == 64  # every rank's pool
        outs = llm.generate(prompts, GREEDY)
        again = llm.generate([shared], GREEDY)[0]
        assert again.num_cached_tokens == 32
        _assert_clean(llm.engine)
    for out, tokens in zip([*outs, again], expected, strict=True):
        assert out.outputs[0].token_ids == tokens
    _assert_shut_down()


def test_prompt_longer_than_one_ranks_pool(make_model_dir):
    """8 blocks of 4 tokens per rank: one rank holds 32 tokens, CP 2 holds 64. A 50-token
    prompt (plus 6 generated) is refused by one rank and served by two, as HF would."""
    model_dir = make_model_dir("llama", seed=3)
    prompt = _prompts([50], seed=5)[0]
    with LLM(model_dir, device="cpu", block_size=4, num_kv_blocks=8) as llm:
        assert llm.engine.runner.max_model_len == 32
        with pytest.raises(ValueError, match="max_model_len|exceed|too long"):
            llm.generate([prompt], GREEDY)
    with LLM(model_dir, context_parallel_size=2, device="cpu", block_size=4,
             num_kv_blocks=8) as llm:
        assert llm.engine.runner.max_model_len == 64
        assert llm.engine.runner.kv_caches[0].shape[1] == 8  # rank 0's own pool: 8 blocks
        assert llm.engine.block_manager.num_blocks == 16  # the pool the engine schedules
        out = llm.generate([prompt], GREEDY)[0]
        assert llm.engine.block_manager.max_num_used_blocks == 14  # > one rank's 8
        _assert_clean(llm.engine)
    assert out.outputs[0].token_ids == hf_greedy(model_dir, [prompt], MAX_TOKENS)[0]
    _assert_shut_down()


def _assert_handoff_gives_hf_tokens(model_dir, prompts, prefill, saver, decode) -> None:
    """Prefill every prompt, write each one's saved blocks into the decode engine, decode:
    the tokens are HF's, both engines end clean, and both shut down."""
    try:
        for i, prompt in enumerate(prompts):
            prefill.add_request(prompt, GREEDY, f"p{i}")
        prefilled = run_to_completion(prefill)
        for i, prompt in enumerate(prompts):
            [last] = prefilled[f"p{i}"]
            assert last.outputs[0].finish_reason == "handoff"
            first = last.outputs[0].token_ids
            block_ids = decode.add_prefilled_request(f"d{i}", prompt, GREEDY, first)
            decode.runner.write_kv_blocks(block_ids, saver.blocks.pop(f"p{i}"))
        decoded = run_to_completion(decode)
        results = [prefilled[f"p{i}"][0].outputs[0].token_ids + token_ids(decoded[f"d{i}"])
                   for i in range(len(prompts))]
        _assert_clean(prefill)
        _assert_clean(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert results == hf_greedy(model_dir, prompts, MAX_TOKENS)
    _assert_shut_down()


def test_cp2_prefill_hands_off_to_cp1_decode(model_dir):
    """A prefill-role CP 2 engine computes the prompts (their KV striped over two pools) and
    hands off; read_kv_blocks gathers each request's blocks from their owners in token order,
    and a CP 1 decode engine continues from them to HF's tokens."""
    prompts = _prompts([3, 17, 30], seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_config = ModelConfig(str(model_dir))
    prefill, saver = prefill_engine(
        model_config, CacheConfig(block_size=4, num_blocks=16),
        ParallelConfig(context_parallel_size=2, device="cpu"), SchedulerConfig(),
        tokenizer=tokenizer)
    decode = Engine(model_config, CacheConfig(block_size=4, num_blocks=64),
                    ParallelConfig(device="cpu"), tokenizer=tokenizer,
                    role=make_role("decode"))
    _assert_handoff_gives_hf_tokens(model_dir, prompts, prefill, saver, decode)


def test_cp1_prefill_hands_off_to_cp2_decode(make_model_dir):
    """The other way: whole blocks from a CP 1 prefill, written into a CP 2 decode (each
    rank keeps the blocks it owns), decode merging the two shards' partials."""
    model_dir = make_model_dir("llama", seed=3)
    prompts = _prompts([9, 26], seed=4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_config = ModelConfig(str(model_dir))
    prefill, saver = prefill_engine(model_config, CacheConfig(block_size=4, num_blocks=32),
                                    ParallelConfig(device="cpu"), tokenizer=tokenizer)
    decode = Engine(model_config, CacheConfig(block_size=4, num_blocks=16),
                    ParallelConfig(context_parallel_size=2, device="cpu"),
                    tokenizer=tokenizer, role=make_role("decode"))
    _assert_handoff_gives_hf_tokens(model_dir, prompts, prefill, saver, decode)


def test_triton_ring_attention_in_the_engine(model_dir, monkeypatch):
    """The Triton backend (interpreted without CUDA): block attention kernels round the
    ring (MLA: on the expanded blocks, and absorbed for decode), paged KV and latent writes
    by the Triton kernels; tokens equal HF's."""
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "triton")
    prompts = _prompts([2, 19], seed=2)
    with LLM(model_dir, context_parallel_size=2, device="cpu", block_size=4,
             num_kv_blocks=16) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3,
                                                    ignore_eos=True))
        _assert_clean(llm.engine)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, prompts, 3)
    _assert_shut_down()


def test_bad_context_parallel_settings_are_clear_errors(llama_dir):
    with pytest.raises(ValueError, match="context_parallel_size must be positive"):
        ParallelConfig(context_parallel_size=0)
    with pytest.raises(ValueError, match="does not combine with tensor or pipeline"):
        LLM(llama_dir, context_parallel_size=2, tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="bad CP rank"):
        CPGroup(rank=2, size=2)
    _assert_shut_down()


def test_worker_flag_builds_the_parallel_config(llama_dir):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", str(llama_dir), "--port", "5555"]
    config = parallel_config_from_args(parser.parse_args([*base, "--context-parallel-size", "2"]))
    assert config.context_parallel_size == 2 and config.world_size == 2
    assert parallel_config_from_args(parser.parse_args([*base, "--cp", "4"])).world_size == 4
    with pytest.raises(ValueError, match="does not combine with tensor or pipeline"):
        parallel_config_from_args(parser.parse_args([*base, "--cp", "2", "--tp", "2"]))
