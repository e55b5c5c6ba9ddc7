"""How big a rank's KV pool is: on CUDA a profiling forward of the largest step the scheduler
can build measures the activations' peak (profile_memory), pdserve/serve/executor/kv_cache.py turns
that and the device's free memory into a plan, and the ranks agree on the smallest block
count (plan_pool). On CPU the plan comes from the configuration, checked against the host's
memory for every rank's pool together. Where the rank will capture decode CUDA graphs
(pdserve/serve/executor/cuda_graphs.py), the profile also leaves room for their memory pool.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import CacheConfig, SchedulerConfig
from pdserve.serve.executor.cuda_graphs import DecodeGraphs
from pdserve.serve.executor.kv_cache import (
    KVCachePlan,
    MemoryProfile,
    available_host_memory_bytes,
    bytes_per_block,
    check_fits_host_memory,
    plan_kv_cache,
)

if TYPE_CHECKING:
    from pdserve.serve.executor.rank import Rank

logger = logging.getLogger(__name__)


def plan_pool(rank: Rank, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
              min_over_ranks: Callable[[int], int] = lambda n: n) -> KVCachePlan:
    """A rank's pool plan (profiling the largest step on CUDA), its block count agreed with
    the other ranks (collectives: call on every rank together)."""
    spec, device = rank.spec, rank.device
    per_block = bytes_per_block(rank.num_local_layers + rank.num_mtp_layers, rank.block_size,
                                rank.num_kv_heads_per_rank, spec.head_dim,
                                spec.kv_torch_dtype, rank.layout.num_planes)
    plan: KVCachePlan | None = None
    error: ValueError | None = None
    try:
        profile = None
        if (device.type == "cuda" and cache_config.num_blocks is None
                and cache_config.kv_cache_memory_bytes is None):
            profile = profile_memory(rank, scheduler_config)
        plan = plan_kv_cache(cache_config, per_block, spec.max_model_len, device.type,
                             profile)
    except ValueError as exc:  # still take part in the agreement, then fail together
        error = exc
    # Every rank must hold the same block ids: the smallest rank's count wins.
    num_blocks = min_over_ranks(plan.num_blocks if plan is not None else 0)
    if plan is None or num_blocks == 0:
        raise error or ValueError("another tensor-parallel rank has no memory for the KV "
                                  "cache (see its log)")
    plan = dataclasses.replace(plan, num_blocks=num_blocks)
    if device.type == "cpu" and rank.tp.rank == 0:  # every rank's pool is on this host
        check_fits_host_memory(plan, rank.tp.size * rank.pp.size * rank.cp.size,
                               available_host_memory_bytes())
    return plan


@torch.inference_mode()
def profile_run(rank: Rank, scheduler_config: SchedulerConfig) -> int:
    """Run the largest step the scheduler can build (profile_step) on a scratch pool just
    big enough for it; returns its number of tokens. Every TP rank runs it together."""
    step = profile_step(scheduler_config.max_num_batched_tokens,
                        scheduler_config.max_num_seqs, rank.spec.max_model_len,
                        rank.block_size, rank.spec.vocab_size)
    scratch = rank.new_pool(sum(len(c.block_table) for c in step.chunks))
    rank.forward(step, scratch.kv_caches)
    return step.num_tokens


def profile_memory(rank: Rank, scheduler_config: SchedulerConfig) -> MemoryProfile:
    """CUDA: what the weights took and what the largest step's activations peak at."""
    assert rank.free_before_load is not None, "profiling measures CUDA memory"
    free_before, total = rank.free_before_load
    torch.cuda.reset_peak_memory_stats(rank.device)
    baseline = torch.cuda.memory_allocated(rank.device)
    # The scratch pool is allocated inside: its bytes count as activations, which only
    # errs on the safe side (it is a few blocks).
    num_tokens = profile_run(rank, scheduler_config)
    torch.cuda.synchronize(rank.device)
    peak = torch.cuda.max_memory_allocated(rank.device) - baseline
    if rank.wants_decode_graphs:  # held for good beside the pool, as well as a step's peak
        peak += decode_graphs_bytes(rank, scheduler_config.max_num_seqs)
    free_after, _ = free_device_memory(rank.device) or (0, 0)
    profile = MemoryProfile(total, free_before, free_after, peak, num_tokens)
    logger.debug("rank %d memory profile: %s", rank.tp.rank, profile)
    return profile


def decode_graphs_bytes(rank: Rank, max_num_seqs: int) -> int:
    """CUDA: what the decode graphs keep once captured. They share one memory pool, which
    holds the largest bucket's activations (the smaller ones reuse them), so: the peak of one
    eager decode forward at the largest bucket over the graphs' own buffers (counted too),
    plus the logits every smaller bucket's graph keeps as its output."""
    scratch = rank.new_pool(1)  # every row is padding: it reads block 0 and writes nothing
    torch.cuda.reset_peak_memory_stats(rank.device)
    baseline = torch.cuda.memory_allocated(rank.device)
    graphs = DecodeGraphs(rank.model, max_num_seqs, rank.spec.max_model_len, rank.block_size,
                          rank.device)
    logits = graphs.profile_forward(scratch.kv_caches)
    torch.cuda.synchronize(rank.device)
    peak = torch.cuda.max_memory_allocated(rank.device) - baseline
    kept_rows = sum(graphs.batch_sizes[:-1])
    return peak + kept_rows * logits.shape[1] * logits.element_size()


def profile_step(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 vocab_size: int) -> StepInput:
    """The largest step the scheduler can build, to measure a step's peak memory:

        max_num_seqs - 1 decodes (one token each: one logits row each)
        + the rest of the token budget as one prompt chunk (split at max_model_len)

    so both the widest attention (one long prompt) and the most logits rows are in it.
    Blocks are numbered afresh from 0 (a scratch pool of exactly that many)."""
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    lengths = [1] * (num_seqs - 1)
    rest = num_tokens - len(lengths)
    while rest > 0:
        lengths.append(min(rest, max_model_len))
        rest -= lengths[-1]
    chunks, next_block = [], 0
    for i, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        token_ids = [(i + t) % vocab_size for t in range(length)]
        chunks.append(SeqChunk(f"profile-{i}", token_ids, 0,
                               list(range(next_block, next_block + num_blocks)), True))
        next_block += num_blocks
    return StepInput(chunks)


def free_device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device, its allocator's cache emptied; None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)
