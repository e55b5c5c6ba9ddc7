"""KV pool planning (pdserve/serve/executor/kv_cache.py, ModelRunner): the planner's numbers checked
by hand on
fake memory figures, the CPU budget and --num-kv-blocks on a real tiny model, the profiling
step's layout, and the served max_model_len capped to what the pool holds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from helpers.engine_util import run_to_completion, token_ids

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.executor import pool_sizing
from pdserve.serve.executor.kv_cache import (
    GIB,
    MemoryProfile,
    bytes_per_block,
    check_fits_host_memory,
    plan_kv_cache,
)
from pdserve.serve.executor.model_runner import ModelRunner
from pdserve.serve.executor.pool_sizing import profile_step
from pdserve.serve.worker.server import add_arguments, config_from_args

MIB = 1 << 20
# The tiny test Llama: 2 layers, 2 KV heads of 16, float32 -> 2 planes x 2 x 16 x 2 x 4 bytes
# = 512 bytes per token, 8192 per 16-token block.
LLAMA_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def _profile(**overrides: int) -> MemoryProfile:
    """An 80 GiB GPU: 79 GiB free at start, 63 GiB free once 16 GiB of weights and context
    are in, a 2 GiB activation peak for the largest step."""
    fields = dict(total_bytes=80 * GIB, free_before_load_bytes=79 * GIB,
                  free_after_profile_bytes=63 * GIB, peak_activation_bytes=2 * GIB,
                  num_profiled_tokens=2048)
    return MemoryProfile(**{**fields, **overrides})


def test_gpu_plan_from_a_profile_by_hand() -> None:
    per_block = 2 * MIB  # e.g. Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 planes x bf16 x 16
    plan = plan_kv_cache(CacheConfig(gpu_memory_utilization=0.9), per_block, 131072, "cuda",
                         _profile())
    # 0.9 x 80 GiB = 72 GiB; less (79 - 63) GiB loaded and 2 GiB of activations = 54 GiB
    # (63 - 2 = 61 GiB is free, so the fraction decides): 54 GiB / 2 MiB = 27648 blocks.
    assert plan.source == "gpu_memory_utilization"
    assert plan.num_blocks == 54 * 1024 // 2 == 27648
    assert plan.num_tokens == 27648 * 16
    assert plan.max_model_len == 131072 and not plan.is_capped  # 442368 tokens fit

    # Another process took 50 GiB first: only what is free counts (23 - 2 = 21 GiB).
    crowded = _profile(free_before_load_bytes=29 * GIB, free_after_profile_bytes=23 * GIB)
    plan = plan_kv_cache(CacheConfig(), per_block, 131072, "cuda", crowded)
    assert plan.num_blocks == 21 * 1024 // 2
    assert plan.max_model_len == 131072

    # A small pool caps the context: 0.25 x 80 = 20 GiB - 18 GiB = 2 GiB = 1024 blocks.
    plan = plan_kv_cache(CacheConfig(gpu_memory_utilization=0.25), per_block, 131072, "cuda",
                         _profile())
    assert plan.num_blocks == 1024
    assert plan.is_capped and plan.max_model_len == 1024 * 16 == 16384

    with pytest.raises(ValueError, match="no device memory left for the KV cache"):
        plan_kv_cache(CacheConfig(gpu_memory_utilization=0.2), per_block, 131072, "cuda",
                      _profile())


def test_num_blocks_wins_then_the_budget() -> None:
    per_block, profile = 2 * MIB, _profile()
    plan = plan_kv_cache(CacheConfig(num_blocks=100, kv_cache_memory_bytes=GIB), per_block,
                         4096, "cuda", profile)
    assert (plan.source, plan.num_blocks, plan.max_model_len) == ("num_blocks", 100, 1600)
    plan = plan_kv_cache(CacheConfig(kv_cache_memory_bytes=GIB + 1), per_block, 4096, "cuda",
                         profile)
    assert (plan.source, plan.num_blocks, plan.max_model_len) == (
        "kv_cache_memory_bytes", 512, 4096)
    # CPU: no profile; the 512 MiB default budget
    plan = plan_kv_cache(CacheConfig(), per_block, 4096, "cpu")
    assert (plan.source, plan.num_blocks) == ("kv_cache_memory_bytes", 256)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        plan_kv_cache(CacheConfig(kv_cache_memory_bytes=MIB), per_block, 4096, "cpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_host_memory_check() -> None:
    plan = plan_kv_cache(CacheConfig(kv_cache_memory_bytes=GIB), MIB, 4096, "cpu")
    check_fits_host_memory(plan, 2, 2 * GIB)
    check_fits_host_memory(plan, 2, None)  # unknown: warns, does not refuse
    with pytest.raises(ValueError, match=r"needs 2\.00 GiB .* 1\.50 GiB available"):
        check_fits_host_memory(plan, 2, 3 * GIB // 2)


def test_profile_step_is_the_largest_step_the_scheduler_builds() -> None:
    step = profile_step(num_tokens=40, max_num_seqs=4, max_model_len=16, block_size=8,
                        vocab_size=1000)
    # 3 decodes of one token, then 37 prompt tokens split at max_model_len: 16 + 16 + 5
    assert [len(c.token_ids) for c in step.chunks] == [1, 1, 1, 16, 16, 5]
    assert [c.block_table for c in step.chunks] == [[0], [1], [2], [3, 4], [5, 6], [7]]
    assert all(c.need_logits and c.start_pos == 0 for c in step.chunks)
    assert step.num_tokens == 40
    one = profile_step(num_tokens=3, max_num_seqs=64, max_model_len=2048, block_size=16,
                       vocab_size=10)
    assert [len(c.token_ids) for c in one.chunks] == [1, 1, 1]


def test_cpu_pool_from_the_budget_caps_max_model_len(llama_dir: Path, caplog) -> None:
    per_block = bytes_per_block(2, 16, 2, 16, torch.float32)
    assert per_block == 16 * LLAMA_BYTES_PER_TOKEN
    budget = 100 * per_block + 1000  # 100 blocks and change
    with caplog.at_level("INFO", logger="pdserve.serve.executor.model_runner"), ModelRunner(
            ModelConfig(str(llama_dir)), CacheConfig(kv_cache_memory_bytes=budget),
            ParallelConfig(device="cpu")) as runner:
        assert runner.num_blocks == 100 and runner.kv_pool.num_blocks == 100
        assert runner.plan.source == "kv_cache_memory_bytes"
        assert runner.kv_pool.num_bytes == 100 * per_block
        assert runner.max_model_len == runner.spec.max_model_len == 1600  # not 2048
    assert "max_model_len capped from 2048 to 1600 tokens" in caplog.text

    # --num-kv-blocks wins over the budget
    with ModelRunner(ModelConfig(str(llama_dir)),
                     CacheConfig(num_blocks=7, kv_cache_memory_bytes=budget),
                     ParallelConfig(device="cpu")) as runner:
        assert (runner.num_blocks, runner.max_model_len) == (7, 112)
    # an explicit max_model_len below the pool stays
    with ModelRunner(ModelConfig(str(llama_dir), max_model_len=64),
                     CacheConfig(num_blocks=7), ParallelConfig(device="cpu")) as runner:
        assert runner.max_model_len == 64 and not runner.plan.is_capped


def test_cpu_pool_larger_than_host_memory_is_refused(llama_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(pool_sizing, "available_host_memory_bytes", lambda: 64 * MIB)
    with pytest.raises(ValueError, match="host has 0.06 GiB available"):
        ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(kv_cache_memory_bytes=GIB),
                    ParallelConfig(device="cpu"))


def test_profile_run_executes_the_largest_step(llama_dir: Path) -> None:
    """The forward the CUDA planner measures runs on CPU too (here only run, not measured)."""
    with ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(num_blocks=4),
                     ParallelConfig(device="cpu")) as runner:
        scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=300)
        assert pool_sizing.profile_run(runner._rank, scheduler) == 300


def test_unset_max_tokens_gets_the_room_left(llama_dir: Path) -> None:
    """max_tokens=None: max_model_len - prompt_len, with the pool-capped max_model_len; the
    request fits the pool, so it is admitted (it was refused before the cap)."""
    engine = Engine(ModelConfig(str(llama_dir)), CacheConfig(block_size=8, num_blocks=6),
                    ParallelConfig(device="cpu"))
    try:
        assert engine.max_model_len == 48
        prompt = list(range(3, 23))  # 20 tokens
        request = engine.add_request(prompt, SamplingParams(max_tokens=None, temperature=0,
                                                            ignore_eos=True))
        assert request.max_tokens == 48 - 20
        outputs = run_to_completion(engine)[request.request_id]
        assert len(token_ids(outputs)) == 28
        assert outputs[-1].outputs[0].finish_reason == "length"
        assert engine.block_manager.num_free_blocks == 6
        engine.block_manager.check_integrity()
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pool_sized_by_utilization(llama_dir: Path) -> None:
    free_before, total = torch.cuda.mem_get_info()
    with ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(gpu_memory_utilization=0.05),
                     ParallelConfig(device="cuda")) as runner:
        plan = runner.plan
        assert plan.source == "gpu_memory_utilization"
        assert 0 < plan.num_bytes <= 0.05 * total
        free_after, _ = torch.cuda.mem_get_info()
        assert free_before - free_after <= 0.05 * total + 64 * MIB  # allocator slack


def test_worker_flags_make_the_cache_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", "/m", "--port", "8100"]
    args = parser.parse_args(base)
    args.command = "decode"
    default = config_from_args(args)
    # a worker has a host DRAM tier below its pool unless told otherwise (the library: not)
    assert default.cache == CacheConfig(kv_offload_bytes=2 * GIB)
    assert default.parallel.device is None
    args = parser.parse_args(base + ["--device", "cpu", "--kv-cache-memory-gb", "1.5",
                                     "--gpu-memory-utilization", "0.5", "--num-kv-blocks", "9",
                                     "--kv-offload-gb", "0"])
    args.command = "prefill"
    config = config_from_args(args)
    assert config.parallel.device == "cpu"
    assert config.cache.kv_cache_memory_bytes == 3 * GIB // 2
    assert config.cache.gpu_memory_utilization == 0.5 and config.cache.num_blocks == 9
    assert config.cache.kv_offload_bytes == 0
