"""ModelRunner: runs one step (a ragged batch of chunks) on every TP rank, returns logits.

    engine process                           worker processes (spawned here)
    ┌──────────────────────────┐             ┌─────────────────────────┐
    │ ModelRunner (rank 0)      │ broadcast   │ rank 1..N-1 loop:        │
    │  execute(step):           │────────────►│  receive step            │
    │   send step (msgpack)     │ len, bytes  │  forward (all-reduces)   │
    │   forward + gather logits │◄═══════════►│  (no logits: rank 0 has) │
    └──────────────────────────┘ collectives └─────────────────────────┘

Steps and KV commands go to workers as pdserve/protocol/tp.py messages (checked msgpack) in a
uint8 tensor over a gloo "control" group (length first, then bytes), never pickled. The
control group is separate from the compute group so a heartbeat (sent while the engine is
idle, so workers' receive never times out) cannot interleave with a step's all-reduces. A
dead rank turns into an exception on the others: gloo notices the closed connection, and
every collective has a timeout.

Starting: every rank loads its shard; once all have, each plans its KV pool (on CUDA after a
profiling forward of the largest step the scheduler can build; serve/executor/kv_cache.py has the
rules) and the ranks take the smallest block count. The spawned ranks, the control channel
and the heartbeat are serve/executor/rank_processes.py; shutdown (explicit, a `with` block, or the
last reference dropped) stops them and destroys the process group, so another runner can
start in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pdserve import envs
from pdserve.kvstore.memory_tier import fp8_as_bytes
from pdserve.protocol.tp import TP_PROTOCOL, Ping, ReadKV, SeqChunk, StepInput, Stop, WriteKV
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.serve.cpu.fused_decode import FusedDecode
from pdserve.serve.engine.prompt_logprobs import logit_rows, samples_every_row
from pdserve.serve.executor.attention import build_attention_metadata, default_backend_name
from pdserve.serve.executor.context_parallel import (
    CPGroup,
    assemble_owned_blocks,
    read_owned_blocks,
    run_context_parallel_step,
    write_owned_blocks,
)
from pdserve.serve.executor.distributed import (
    SILENT_AFTER_S,
    Rendezvous,
    RendezvousError,
    TPGroup,
    init_tp_group,
)
from pdserve.serve.executor.fp8 import kv_cache_dtype_name
from pdserve.serve.executor.kv_cache import (
    KVCachePlan,
    KVCachePool,
    MemoryProfile,
    available_host_memory_bytes,
    bytes_per_block,
    check_fits_host_memory,
    plan_kv_cache,
)
from pdserve.serve.executor.loader import ModelSpec, load_model, load_model_spec
from pdserve.serve.executor.parallel import kv_heads_per_rank
from pdserve.serve.executor.pipeline import (
    PipelineStage,
    PipelineTimes,
    PPGroup,
    assemble_kv_blocks,
    pad_layers,
    run_pipelined_step,
    split_stages,
    stage_layer_range,
)
from pdserve.serve.executor.rank_processes import RankProcesses, wait_node_ranks
from pdserve.serve.models.moe import moe_load

logger = logging.getLogger(__name__)

DIST_TIMEOUT_S = 300.0  # every collective (a step, a heartbeat) must finish within this
START_TIMEOUT_S = 1800.0  # spawning workers and loading weights on every rank
HEARTBEAT_MAX_S = 5.0  # an idle engine pings its ranks at least this often
MAX_MESSAGE_BYTES = 1 << 30
LOGITS_ROWS_PER_CALL = 256
"""Most rows of logits computed at once when a step asks for more than one per chunk (prompt
logprobs): bounds that step's extra activation memory to this many rows x vocab."""


# ---- what every rank holds ---------------------------------------------------------------


class _Rank:
    """One TP rank's model and KV pool, and the step it runs (identical on every rank)."""

    cp: CPGroup = CPGroup()  # context parallelism: set by _setup_rank

    def __init__(self, spec: ModelSpec, block_size: int, tp: TPGroup,
                 device: torch.device, pp: PPGroup | None = None) -> None:
        """Load this rank's shard (its pipeline stage's layers); the pool comes after every
        rank loaded (allocate_pool)."""
        self.tp = tp
        self.pp = pp or PPGroup(PipelineStage(0, 1, spec.num_layers, spec.tie_word_embeddings))
        self.pipeline_times = PipelineTimes()
        self.rendezvous: Rendezvous | None = None  # set by _setup_rank once the group is up
        self.device = device
        self.block_size = block_size
        self.spec = spec
        self._free_before_load = _free_device_memory(device)
        self.model = load_model(spec, tp, device, default_backend_name(device),
                                show_progress=tp.rank == 0, stage=self.pp.stage)
        self.num_local_layers = len(self.pp.stage.layers)  # the KV pool holds these
        self.num_mtp_layers = 0  # 1 once add_mtp built the drafter (speculative decoding)
        self.layout = spec.kv_layout(block_size)
        # An MLA latent is replicated; GQA heads split (or replicate past num_kv_heads ranks).
        self.num_kv_heads_per_rank = (spec.num_kv_heads if self.layout.kind == "mla"
                                      else kv_heads_per_rank(spec.num_kv_heads, tp.size))

    def add_mtp(self) -> None:
        """Build and load the checkpoint's MTP module (before allocate_pool, which then
        plans one more layer of KV for it)."""
        from pdserve.serve.engine.spec_decode import load_mtp_weights
        from pdserve.serve.executor.loader import _default_dtype_and_device

        build = getattr(self.model, "build_mtp", None)
        if build is None:
            raise ValueError(f"{self.spec.architecture} has no multi-token-prediction module:"
                             " MTP speculative decoding needs a DeepSeek-V3 checkpoint")
        with _default_dtype_and_device(self.spec.torch_dtype, self.device):
            build()
        load_mtp_weights(self.model, self.spec.model_dir)
        self.model.mtp.eval()
        self.num_mtp_layers = 1

    @torch.inference_mode()
    def propose(self, chunks: list[Any]) -> list[list[int]]:
        """The MTP pass over spec_decode.DraftChunks after the step that computed
        last_hidden: writes the MTP layer's KV of every row; returns each chunk's greedy
        drafts (its last row's argmax, then the MTP chained on its own output)."""
        from pdserve.serve.engine.spec_decode import MAX_SPECULATIVE_TOKENS

        mtp, embed = self.model.mtp, self.model.model.embed_tokens
        rotary = self.model.model.rotary_emb
        rows = torch.cat([torch.arange(c.hidden_start, c.hidden_start + len(c.token_ids))
                          for c in chunks]).to(self.device)
        previous = self.last_hidden.index_select(0, rows)  # [T', hidden]
        # Rows of a sequence that verified drafts are as few: marked so, the attention
        # takes them as decode rows (serve/executor/attention.py); a prompt chunk's go to prefill.
        short = all(len(c.token_ids) <= 1 + MAX_SPECULATIVE_TOKENS for c in chunks)
        step = StepInput([SeqChunk(c.request_id, c.token_ids, c.start_pos, c.block_table,
                                   c.num_drafts > 0,
                                   num_draft_tokens=len(c.token_ids) - 1 if short else 0)
                          for c in chunks])
        drafting = [i for i, c in enumerate(chunks) if c.num_drafts > 0]
        drafts: list[list[int]] = [[] for _ in chunks]
        positions = [chunks[i].start_pos + len(chunks[i].token_ids) - 1 for i in drafting]
        last = previous  # the MTP's output rows of the sequences drafting, set below
        for j in range(max((chunks[i].num_drafts for i in drafting), default=1)):
            if j > 0:  # chained: one row per sequence still drafting, one position on
                keep = [n for n, i in enumerate(drafting) if chunks[i].num_drafts > j]
                if not keep:
                    break
                drafting = [drafting[n] for n in keep]
                positions = [positions[n] + 1 for n in keep]
                previous = last.index_select(0, torch.tensor(keep, device=self.device))
                step = StepInput([SeqChunk(chunks[i].request_id, [drafts[i][-1]], pos,
                                           chunks[i].block_table, True)
                                  for i, pos in zip(drafting, positions, strict=True)])
            meta = build_attention_metadata(step, self.block_size, self.device)
            input_ids = torch.tensor([t for c in step.chunks for t in c.token_ids],
                                     dtype=torch.int64, device=self.device)
            hidden = mtp.propose(embed(input_ids), previous, self.mtp_kv_cache, meta,
                                 rotary.cos_sin(meta.positions, previous.dtype))
            if not drafting:
                break  # a pass that only writes the MTP layer's KV
            ends = meta.cu_seqlens_q[1:].long() - 1
            if j == 0:
                ends = ends[torch.tensor(drafting, device=self.device)]
            last = hidden.index_select(0, ends)  # [drafting, hidden]
            tokens = mtp.compute_logits(last).argmax(dim=-1).tolist()
            for i, token in zip(drafting, tokens, strict=True):
                drafts[i].append(int(token))
        return drafts

    def allocate_pool(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                      min_over_ranks: Callable[[int], int] = lambda n: n) -> None:
        """Plan the pool (profiling the largest step on CUDA), agree on the block count with
        the other ranks (collectives: call on every rank together), allocate it."""
        spec, device = self.spec, self.device
        per_block = bytes_per_block(self.num_local_layers + self.num_mtp_layers,
                                    self.block_size,
                                    self.num_kv_heads_per_rank, spec.head_dim,
                                    spec.kv_torch_dtype, self.layout.num_planes)
        plan: KVCachePlan | None = None
        error: ValueError | None = None
        try:
            profile = None
            if (device.type == "cuda" and cache_config.num_blocks is None
                    and cache_config.kv_cache_memory_bytes is None):
                profile = self.profile_memory(scheduler_config)
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
        if device.type == "cpu" and self.tp.rank == 0:  # every rank's pool is on this host
            check_fits_host_memory(plan, self.tp.size * self.pp.size * self.cp.size,
                                   available_host_memory_bytes())
        self.plan: KVCachePlan = plan
        self.num_blocks = plan.num_blocks
        # The served context is what the pool holds: a longer request could never run.
        self.spec = dataclasses.replace(spec, max_model_len=plan.max_model_len)
        self.pool = self._new_pool(self.num_blocks)
        if self.num_mtp_layers:  # the MTP layer's own cache, same block ids (spec_decode.py)
            self.mtp_kv_cache: torch.Tensor = self._new_pool_of(
                1, self.num_blocks).kv_caches[0].zero_()

    def _new_pool(self, num_blocks: int) -> KVCachePool:
        return self._new_pool_of(self.num_local_layers, num_blocks)

    def _new_pool_of(self, num_layers: int, num_blocks: int) -> KVCachePool:
        spec = self.spec
        return KVCachePool(num_layers, num_blocks, self.block_size,
                           self.num_kv_heads_per_rank, spec.head_dim, spec.kv_torch_dtype,
                           self.device, self.layout.num_planes)

    @torch.inference_mode()
    def execute(self, step: StepInput, layer_done: Callable[[int], None] | None = None
                ) -> torch.Tensor | None:
        return self._forward(step, self.pool.kv_caches, layer_done)

    def _forward(self, step: StepInput, kv_caches: list[torch.Tensor],
                 layer_done: Callable[[int], None] | None = None) -> torch.Tensor | None:
        if self.cp.size > 1:  # this rank's share of the tokens, attention round the ring
            return run_context_parallel_step(self.model, step, kv_caches, self.block_size,
                                             self.cp, self.device,
                                             default_backend_name(self.device), logit_rows(step))
        if self.pp.size > 1:  # this stage's layers over the step's micro-batches
            spec = self.spec
            return run_pipelined_step(self, step, kv_caches, spec.hidden_size,
                                      spec.torch_dtype, len(logit_rows(step)), spec.vocab_size,
                                      self.pipeline_times)
        hidden = self.run_model(step, kv_caches, layer_done)  # [T, hidden]
        if self.num_mtp_layers:
            self.last_hidden = hidden  # the MTP pass after sampling reads its rows
        return self.compute_logits(hidden, step)

    def run_model(self, step: StepInput, kv_caches: list[torch.Tensor],
                  layer_done: Callable[[int], None] | None = None,
                  carried: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """The model over one step (or micro-batch): the final hidden states [T, hidden], or
        on a pipeline stage before the last, (hidden, residual) for the next stage."""
        meta = build_attention_metadata(step, self.block_size, self.device)
        token_ids = np.fromiter(  # chain iterates in C: no Python work per token
            itertools.chain.from_iterable(c.token_ids for c in step.chunks), dtype=np.int64,
            count=step.num_tokens,
        )
        input_ids = torch.from_numpy(token_ids).to(self.device)
        return self.model(input_ids, kv_caches, meta, layer_done, carried)

    def compute_logits(self, hidden: torch.Tensor, step: StepInput) -> torch.Tensor | None:
        """The step's logit rows from its final hidden states (None off the logits rank)."""
        if samples_every_row(step):  # a decode step: every row, in order
            return self.model.compute_logits(hidden)
        # The last row of each chunk that samples, then the rows of prompt logprobs
        logits_rows = torch.from_numpy(logit_rows(step)).to(self.device)
        if logits_rows.numel() == 0:
            return None
        # A step without prompt logprobs has at most a row per chunk: one call. Prompt rows
        # (a whole chunk's) would be [rows, vocab] that no memory profile counted: in slices,
        # each to the host before the next (every rank slices alike: lm_head is collective)
        per_call = max(LOGITS_ROWS_PER_CALL, len(step.chunks))
        if logits_rows.numel() <= per_call:
            return self.model.compute_logits(hidden.index_select(0, logits_rows))
        parts = []
        for rows in logits_rows.split(per_call):
            part = self.model.compute_logits(hidden.index_select(0, rows))
            parts.append(None if part is None else part.float().cpu())
        return None if parts[0] is None else torch.cat(parts)

    @torch.inference_mode()
    def profile_run(self, scheduler_config: SchedulerConfig) -> int:
        """Run the largest step the scheduler can build (profile_step) on a scratch pool just
        big enough for it; returns its number of tokens. Every TP rank runs it together."""
        step = profile_step(scheduler_config.max_num_batched_tokens,
                            scheduler_config.max_num_seqs, self.spec.max_model_len,
                            self.block_size, self.spec.vocab_size)
        scratch = self._new_pool(sum(len(c.block_table) for c in step.chunks))
        self._forward(step, scratch.kv_caches)
        return step.num_tokens

    def profile_memory(self, scheduler_config: SchedulerConfig) -> MemoryProfile:
        """CUDA: what the weights took and what the largest step's activations peak at."""
        assert self._free_before_load is not None, "profiling measures CUDA memory"
        free_before, total = self._free_before_load
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        # The scratch pool is allocated inside: its bytes count as activations, which only
        # errs on the safe side (it is a few blocks).
        num_tokens = self.profile_run(scheduler_config)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - baseline
        free_after, _ = _free_device_memory(self.device) or (0, 0)
        profile = MemoryProfile(total, free_before, free_after, peak, num_tokens)
        logger.debug("rank %d memory profile: %s", self.tp.rank, profile)
        return profile

    def read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's heads of the blocks, for its stage's layers:
        [stage layers, P, n, block_size, local heads, dim]. Under CP: the blocks this rank
        owns, zeros for the others (every rank's summed is the whole)."""
        if self.cp.size > 1:
            return read_owned_blocks(self.pool, block_ids, self.cp)
        return torch.stack(self.pool.read_blocks(block_ids))

    def read_kv_for_gather(self, block_ids: list[int]) -> torch.Tensor:
        """read_kv on the host, padded to the largest stage's layer count (one gather shape
        on every rank; serve/executor/pipeline.py assemble_kv_blocks drops the padding)."""
        local = self.read_kv(block_ids).cpu()
        if self.pp.size == 1:
            return local
        return pad_layers(local, max(len(r) for r in self.pp.layer_ranges()))

    def write_kv(self, block_ids: list[int], full: torch.Tensor) -> None:
        """Write this rank's layers and head slice of whole-model, whole-head blocks
        [layers, P, n, bs, heads, dim]. Under CP: the blocks this rank owns."""
        if self.cp.size > 1:
            write_owned_blocks(self.pool, block_ids, full, self.cp)
            return
        layers = self.pp.stage.layers
        mine = full[layers.start:layers.stop, :, :, :,
                    self.layout.rank_heads(self.tp.rank, self.tp.size)]
        self.pool.write_blocks(block_ids, list(mine.unbind(0)))

    def serve_kv_command(self, command: ReadKV | WriteKV, control: Any) -> None:
        """A non-zero rank's part of ModelRunner.read_kv_blocks / write_kv_blocks."""
        if isinstance(command, ReadKV):
            dist.gather(fp8_as_bytes(self.read_kv_for_gather(command.block_ids)), None, dst=0,
                        group=control)
        else:
            spec, layout = self.spec, self.layout
            full = torch.empty(spec.num_layers, layout.num_planes, len(command.block_ids),
                               self.block_size, spec.num_kv_heads, spec.head_dim,
                               dtype=spec.kv_torch_dtype)
            dist.broadcast(fp8_as_bytes(full), src=0, group=control)
            self.write_kv(command.block_ids, full.to(self.device))

    def validate(self, step: StepInput) -> None:
        """Reject a step rank 0 cannot run before any rank starts it (no half-done steps)."""
        max_slot = self.num_blocks
        for c in step.chunks:
            if not c.token_ids:
                raise ValueError(f"request {c.request_id}: empty chunk")
            if c.start_pos < 0 or c.start_pos + len(c.token_ids) > self.spec.max_model_len:
                raise ValueError(f"request {c.request_id}: positions up to "
                                 f"{c.start_pos + len(c.token_ids)} exceed max_model_len="
                                 f"{self.spec.max_model_len}")
            if min(c.token_ids) < 0 or max(c.token_ids) >= self.spec.vocab_size:
                raise ValueError(f"request {c.request_id}: token id out of vocabulary")
            needed = -(-(c.start_pos + len(c.token_ids)) // self.block_size)
            if len(c.block_table) < needed:
                raise ValueError(f"request {c.request_id}: block_table has "
                                 f"{len(c.block_table)} blocks, positions need {needed}")
            if min(c.block_table) < 0 or max(c.block_table) >= max_slot:
                raise ValueError(f"request {c.request_id}: block id out of [0, {max_slot})")


def _device_for(parallel_config: ParallelConfig, rank: int) -> torch.device:
    """Rank r takes its node's (r mod ranks per node)-th visible GPU."""
    kind = parallel_config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = rank % parallel_config.ranks_per_node
    return torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")


def _free_device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device, its allocator's cache emptied; None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


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


def _min_over_ranks(value: int, control: Any) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=control)
    return int(tensor.item())


def _setup_rank(rank: int, model_config: ModelConfig, cache_config: CacheConfig,
                scheduler_config: SchedulerConfig, parallel_config: ParallelConfig,
                timeout_s: float, start_timeout_s: float,
                peers_alive: Callable[[], bool] | None = None,
                with_mtp: bool = False,
                rendezvous: Rendezvous | None = None) -> tuple[_Rank, Any]:
    """Join the group, load this rank's shard; returns the rank and its control group.
    `rendezvous`: rank 0's store when the caller already hosts it (on a port it picked)."""
    size = parallel_config.world_size  # TP x PP ranks
    device = _device_for(parallel_config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif parallel_config.cpu_threads is not None:
        torch.set_num_threads(parallel_config.cpu_threads)
    elif size > 1:  # this node's cores among this node's ranks
        local_size = min(size, parallel_config.ranks_per_node)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    backend = parallel_config.backend or ("nccl" if device.type == "cuda" else "gloo")
    if parallel_config.dist_interface is not None:  # read by gloo / NCCL at group creation
        os.environ["GLOO_SOCKET_IFNAME"] = parallel_config.dist_interface
        os.environ["NCCL_SOCKET_IFNAME"] = parallel_config.dist_interface
    if size > 1 and rendezvous is None:
        assert parallel_config.master_port is not None
        # Over several nodes, a node that never comes is an error within the collective
        # timeout, not after the (long) loading one.
        join_timeout_s = timeout_s if parallel_config.nnodes > 1 else start_timeout_s
        rendezvous = Rendezvous(rank, size, parallel_config.master_addr,
                                parallel_config.master_port, start_timeout_s,
                                join_timeout_s, parallel_config.ranks_per_node)
    world = init_tp_group(rendezvous, backend, timeout_s, peers_alive)
    cp = CPGroup()
    if parallel_config.context_parallel_size > 1:  # every CP rank holds the whole model
        world, cp = TPGroup(), CPGroup(world.rank, world.size)
    tp, stage = split_stages(world, parallel_config.tensor_parallel_size,
                             parallel_config.pipeline_parallel_size, timeout_s)
    tp = dataclasses.replace(tp, expert_parallel=parallel_config.enable_expert_parallel,
                             expert_capacity_factor=parallel_config.expert_capacity_factor)
    control = None
    if rendezvous is not None:
        control = dist.new_group(backend="gloo",
                                 timeout=datetime.timedelta(seconds=timeout_s))
    spec = load_model_spec(model_config, device.type)
    spec = dataclasses.replace(spec, kv_cache_dtype=kv_cache_dtype_name(
        cache_config.kv_cache_dtype, spec.dtype))
    pp_size = parallel_config.pipeline_parallel_size
    pp = PPGroup(PipelineStage(stage, pp_size, spec.num_layers, spec.tie_word_embeddings),
                 tp.rank, tp.size, parallel_config.pipeline_micro_batches or pp_size,
                 timeout_s)
    state = _Rank(spec, cache_config.block_size, tp, device, pp)
    if with_mtp:  # speculative decoding's drafter (rank 0 of a one-rank worker)
        state.add_mtp()
    if rendezvous is not None:
        # Every rank loaded before any enters a collective (the profiling forward, the
        # block-count agreement, a step): loading may outlast a collective's timeout.
        rendezvous.arrive_and_wait("loaded", peers_alive)
    state.cp = cp
    state.allocate_pool(cache_config, scheduler_config,
                        (lambda n: _min_over_ranks(n, control)) if control is not None
                        else (lambda n: n))
    if cp.size > 1:  # the engine's pool spans the ranks: global block g on rank g % CP
        state.plan = dataclasses.replace(state.plan, num_blocks=state.num_blocks * cp.size)
        state.num_blocks = state.plan.num_blocks
        state.spec = dataclasses.replace(state.spec, max_model_len=state.plan.max_model_len)
    state.rendezvous = rendezvous
    return state, control


def _receive(control: Any) -> bytes:
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src=0, group=control)
    num_bytes = int(length.item())
    if not 0 < num_bytes <= MAX_MESSAGE_BYTES:
        raise ValueError(f"bad control message length {num_bytes}")
    data = torch.empty(num_bytes, dtype=torch.uint8)
    dist.broadcast(data, src=0, group=control)
    return data.numpy().tobytes()


def _worker_main(rank: int, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, parallel_config: ParallelConfig,
                 timeout_s: float, start_timeout_s: float) -> None:
    logging.basicConfig(level=envs.log_level())
    try:
        state, control = _setup_rank(rank, model_config, cache_config, scheduler_config,
                                     parallel_config, timeout_s, start_timeout_s)
    except (ValueError, FileNotFoundError) as exc:
        # A checkpoint or config this TP degree cannot take fails rank 0 alike, which reports
        # it to the user: no second copy, and no traceback, from here.
        logger.debug("TP rank %d cannot start: %s", rank, exc)
        raise SystemExit(1) from None
    except RendezvousError as exc:  # on another node nobody else would say it
        logger.error("%s", exc)
        raise SystemExit(1) from None
    try:
        while True:
            # A malformed message raises WireError: this rank leaves, and rank 0 sees it die.
            match TP_PROTOCOL.decode(_receive(control)):
                case StepInput() as step:
                    state.execute(step)
                case ReadKV() | WriteKV() as command:
                    state.serve_kv_command(command, control)
                case Ping():
                    pass
                case Stop():
                    break
    except RuntimeError as exc:  # mostly a collective that failed: rank 0 or a peer is gone
        logger.error("rank %d (node %d) leaves the group: %s", rank,
                     parallel_config.node_of(rank), exc)
        raise SystemExit(1) from None
    finally:
        if state.rendezvous is not None:
            state.rendezvous.stop_beating()
        dist.destroy_process_group()


def _describe_lost(rendezvous: Rendezvous, after_failure: bool) -> str | None:
    """Which ranks are gone: right after a failed collective (watch a few seconds, a short
    silence is enough), or on the idle heartbeat's look (no wait, a long silence)."""
    if after_failure:
        lost = rendezvous.lost_ranks()
    else:
        lost = rendezvous.lost_ranks(wait_s=0.0, lost_after_s=SILENT_AFTER_S)
    if not lost:
        return None
    return f"lost {rendezvous.describe_ranks(lost)}: its liveness beat stopped"


def serve_node(model_config: ModelConfig, cache_config: CacheConfig,
               parallel_config: ParallelConfig, scheduler_config: SchedulerConfig | None = None,
               stop: threading.Event | None = None,
               start_timeout_s: float = START_TIMEOUT_S) -> int:
    """Node k > 0 of a worker over several nodes: start this node's ranks, which join the
    rendezvous at master_addr:master_port and serve rank 0's steps, and wait on them. Returns
    0 when rank 0 stopped them (or `stop` was set), 1 when one failed (rank 0 gone, or it
    could not join within the timeout)."""
    if parallel_config.node_rank == 0:
        raise ValueError("node 0 runs the engine (ModelRunner), not serve_node")
    if parallel_config.master_port is None:
        raise ValueError("serve_node needs the rendezvous port of node 0 (master_port)")
    dist_timeout_s = parallel_config.dist_timeout_s or DIST_TIMEOUT_S
    procs = RankProcesses(heartbeat_s=dist_timeout_s / 4)
    for rank in parallel_config.local_ranks:
        procs.spawn(_worker_main, rank, model_config, cache_config,
                    scheduler_config or SchedulerConfig(), parallel_config, dist_timeout_s,
                    start_timeout_s)
    logger.info("node %d of %d: ranks %s joining the rendezvous at %s:%d",
                parallel_config.node_rank, parallel_config.nnodes,
                list(parallel_config.local_ranks), parallel_config.master_addr,
                parallel_config.master_port)
    return wait_node_ranks(procs, stop or threading.Event())


# ---- the engine-facing runner ------------------------------------------------------------


class ModelRunner:
    """Loads the model on every TP rank and runs steps; rank 0 lives in this process.

    `shutdown()` (also on `with` exit, and when the last reference goes) stops the other
    ranks and destroys the process group, so another runner can start in this process."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 parallel_config: ParallelConfig | None = None,
                 dist_timeout_s: float = DIST_TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S,
                 scheduler_config: SchedulerConfig | None = None,
                 speculative_config: Any = None) -> None:
        """speculative_config (serve/spec_decode.SpeculativeConfig): load the checkpoint's
        MTP module as the drafter; one rank only."""
        parallel_config = parallel_config or ParallelConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        size = parallel_config.world_size  # every rank: TP x PP
        if speculative_config is not None and size > 1:
            raise ValueError("MTP speculative decoding runs on one rank: tensor and pipeline "
                             "parallel size must be 1")
        if parallel_config.pipeline_parallel_size > 1:  # before any process starts
            stage_layer_range(load_model_spec(model_config).num_layers,
                              parallel_config.pipeline_parallel_size, 0)
            if getattr(parallel_config, "context_parallel_size", 1) > 1:
                raise ValueError("pipeline_parallel_size > 1 with context_parallel_size > 1 "
                                 "is not supported: use one of the two")
        if parallel_config.node_rank != 0:
            raise ValueError("the engine runs on node 0; node_rank > 0 runs only its ranks "
                             "(serve_node)")
        if parallel_config.dist_timeout_s is not None:
            dist_timeout_s = parallel_config.dist_timeout_s
        _check_devices(parallel_config)
        if size > 1 and dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed process group (another LLM or "
                "ModelRunner with tensor_parallel_size > 1 still open?): shut it down first "
                "(llm.shutdown(), a `with` block, or drop its last reference)")
        hosted = None
        if size > 1 and parallel_config.master_port is None:
            # Host the store before spawning, on a port the kernel picks as it listens: a
            # port found free first and bound later can be taken in between (EADDRINUSE).
            hosted = Rendezvous(0, size, parallel_config.master_addr, 0, start_timeout_s,
                                ranks_per_node=parallel_config.ranks_per_node)
            parallel_config = dataclasses.replace(parallel_config,
                                                  master_port=hosted.master_port)
        self._closed = False
        self._tp_size = parallel_config.tensor_parallel_size
        self._pp_size = parallel_config.pipeline_parallel_size
        self._world_size = size
        # Idle ranks need a message within the timeout; a remote rank's death is noticed
        # by the next one, so send one every few seconds however long the timeout is.
        self._procs = RankProcesses(heartbeat_s=min(dist_timeout_s / 4, HEARTBEAT_MAX_S))
        procs = self._procs
        try:
            for rank in parallel_config.local_ranks[1:]:  # the other nodes start their own
                procs.spawn(_worker_main, rank, model_config, cache_config, scheduler_config,
                            parallel_config, dist_timeout_s, start_timeout_s)
            procs.owns_process_group = size > 1
            self._rank, procs.control = _setup_rank(
                0, model_config, cache_config, scheduler_config, parallel_config,
                dist_timeout_s, start_timeout_s, peers_alive=procs.peers_alive,
                with_mtp=speculative_config is not None, rendezvous=hosted,
            )
        except BaseException:
            procs.stop(send_stop=False)
            raise
        rendezvous = self._rank.rendezvous
        if rendezvous is not None:
            procs.describe_lost = lambda after_failure: _describe_lost(rendezvous,
                                                                      after_failure)
            procs.has_remote_ranks = parallel_config.nnodes > 1
        self._finalizer = weakref.finalize(self, procs.stop, True)
        self.plan: KVCachePlan = self._rank.plan
        """The pool's numbers: blocks, bytes, and the served max_model_len."""
        self.spec: ModelSpec = self._rank.spec  # max_model_len capped to the pool
        self.num_blocks: int = self._rank.num_blocks
        self.block_size: int = cache_config.block_size
        self.device: torch.device = self._rank.device
        self.kv_pool: KVCachePool = self._rank.pool
        self.kv_caches: list[torch.Tensor] = self._rank.pool.kv_caches
        _log_plan(self.plan, model_config)
        if size > 1:
            procs.start_heartbeat()

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp_size

    def propose_drafts(self, chunks: list[Any]) -> list[list[int]]:
        """The MTP pass after a step (serve/engine/spec_decode.py): each DraftChunk's drafts."""
        with self._collective():
            return self._rank.propose(chunks)

    @property
    def context_parallel_size(self) -> int:
        return self._rank.cp.size

    @property
    def pipeline_parallel_size(self) -> int:
        return self._pp_size

    @property
    def pipeline_times(self) -> PipelineTimes:
        """Rank 0's busy and step time in pipelined steps (its measured bubble)."""
        return self._rank.pipeline_times

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    def moe_load(self) -> tuple[list[int], int] | None:
        """(assignments per routed expert, dropped past capacity) since start, over rank 0's
        MoE layers (its pipeline stage's; under CP its share of the tokens); None without
        MoE layers. Every TP/EP rank routes every token alike, so rank 0's counts are the
        group's."""
        return moe_load(self._rank.model)

    @property
    def _workers(self) -> list[Any]:
        return self._procs.workers

    def execute(self, step: StepInput, layer_done: Callable[[int], None] | None = None
                ) -> torch.Tensor:
        """float32 CPU logits [number of chunks with need_logits, vocab_size], in chunk order,
        then the chunks' prompt-logprob rows (serve/engine/prompt_logprobs.py) when any asks.

        `layer_done(i)` runs on rank 0 as soon as layer i wrote this step's KV; with TP > 1
        an MHA rank 0 holds only its own heads, so whole-head users (the KV hand-off) gather
        after the step instead (read_kv_blocks) and pass no callback. An MLA latent is whole
        on rank 0 at any TP degree. Under pipeline parallelism rank 0 holds only the first
        stage's layers: no callback either."""
        if layer_done is not None and self._tp_size > 1 and self._rank.layout.kind == "mha":
            raise ValueError("per-layer callbacks see only rank 0's heads: TP must be 1")
        if layer_done is not None and self._rank.cp.size > 1:
            raise ValueError("per-layer callbacks see only rank 0's blocks: CP must be 1")
        if layer_done is not None and self._pp_size > 1:
            raise ValueError("per-layer callbacks see only the first stage's layers: PP must "
                             "be 1")
        self._rank.validate(step)
        if not step.chunks:
            self._check_usable()
            return torch.empty(0, self.spec.vocab_size, dtype=torch.float32)
        with self._collective():
            if self._world_size > 1:
                self._procs.send(TP_PROTOCOL.encode(step))
            logits = self._rank.execute(step, layer_done)
        if logits is None:
            return torch.empty(0, self.spec.vocab_size, dtype=torch.float32)
        return logits.float().cpu()

    def fused_decode(self) -> FusedDecode | None:
        """The in-process rank's fused decode loop (serve/fused_decode.FusedDecode), or None
        where its model has none or other processes hold ranks (benchmarks/step_roofline.py
        times its parts)."""
        if self._world_size > 1:
            return None
        build = getattr(getattr(self._rank.model, "model", None), "fused_decode", None)
        return build() if build is not None else None

    def call_before_each_layer(self, hook: Callable[[], None]) -> None:
        """hook() runs before each decoder layer of every forward (serve/cpu/core_share.py moves
        the threads of a one-rank prefill worker there); one rank only: a TP or PP rank's
        threads live in other processes."""
        if self._world_size > 1:
            raise ValueError("a per-layer hook sees rank 0's process only: TP and PP must be 1")
        for layer in self._rank.model.model.layers:
            layer.register_forward_pre_hook(lambda _module, _args: hook())

    def read_kv_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of the blocks with every KV head (all ranks' shards gathered), per layer
        [P, n, block_size, num_kv_heads, head_dim] on the host: the TP-independent layout
        the KV hand-off moves (every pipeline stage's layers, in order)."""
        is_mla = self._rank.layout.kind == "mla"
        is_cp = self._rank.cp.size > 1
        if self._pp_size == 1 and (self._tp_size == 1 or is_mla) and not is_cp:  # all on rank 0
            local = self._rank.read_kv(list(block_ids))  # [L, P, n, bs, local heads, D]
            return list(local.cpu().unbind(0))
        self._check_kv_split()
        local = self._rank.read_kv_for_gather(list(block_ids))
        procs = self._procs
        with self._collective(), procs.send_lock:
            procs.send_locked(TP_PROTOCOL.encode(ReadKV(list(block_ids))))
            parts = [torch.empty_like(local) for _ in range(self._world_size)]
            dist.gather(fp8_as_bytes(local), [fp8_as_bytes(p) for p in parts], dst=0,
                        group=procs.control)
        if self._pp_size > 1:
            return assemble_kv_blocks(parts, self._rank.pp, is_mla)
        if is_cp:  # each block from the rank that owns it
            return assemble_owned_blocks(parts, block_ids)
        return list(torch.cat(parts, dim=4).unbind(0))

    def write_kv_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        """Inverse of read_kv_blocks: per layer [P, n, block_size, num_kv_heads, head_dim];
        every rank keeps its own heads (so the writer's TP degree does not matter)."""
        if self._world_size == 1:  # one rank holds every layer and head: straight into its pool
            self._rank.pool.write_blocks(list(block_ids), blocks)
            return
        full = torch.stack([b.to(self.spec.kv_torch_dtype) for b in blocks]).cpu().contiguous()
        self._check_kv_split()
        procs = self._procs
        with self._collective(), procs.send_lock:
            procs.send_locked(TP_PROTOCOL.encode(WriteKV(list(block_ids))))
            dist.broadcast(fp8_as_bytes(full), src=0, group=procs.control)
        self._rank.write_kv(list(block_ids), full.to(self.device))

    @property
    def can_write_kv_layers(self) -> bool:
        """One rank holds every layer and head: a layer's blocks go straight into its pool."""
        return self._world_size == 1

    def write_kv_layer(self, layer: int, block_ids: list[int], blocks: torch.Tensor) -> None:
        """write_kv_blocks of one layer, [P, n, block_size, num_kv_heads, head_dim]; only
        where can_write_kv_layers."""
        if not self.can_write_kv_layers:
            raise RuntimeError("a layer at a time needs one rank holding the whole pool")
        self._rank.pool.write_layer_blocks(layer, list(block_ids), blocks)

    def _check_kv_split(self) -> None:
        if self._rank.layout.kind == "mha" and self.spec.num_kv_heads % self._tp_size:
            raise ValueError(f"moving KV blocks needs num_kv_heads ({self.spec.num_kv_heads}) "
                             f"divisible by the TP size ({self._tp_size})")

    def shutdown(self) -> None:
        """Stop workers (stop message, join, terminate) and leave the process group.
        Idempotent; also what happens when the last reference to the runner goes."""
        self._closed = True
        self._finalizer()  # runs RankProcesses.stop once, whoever calls first

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("ModelRunner is shut down")
        if self._procs.is_broken:
            raise RuntimeError("ModelRunner failed in an earlier step; shut it down"
                               + (f" ({self._procs.failure})" if self._procs.failure else ""))
        self._check_workers()

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """Work every rank takes part in. A failure inside leaves the ranks out of step (a
        worker may sit mid-collective), so the runner never talks to them again."""
        self._check_usable()
        try:
            yield
        except BaseException as exc:
            # One rank has nobody to fall out of step with: it stays usable.
            self._procs.is_broken = self._world_size > 1
            lost = self._procs.explain(exc) if self._world_size > 1 else None
            if lost is not None:  # name the rank (and node) that is gone
                raise lost from exc
            raise

    def _check_workers(self) -> None:
        self._procs.check_alive()

    def _send(self, payload: bytes) -> None:
        """Raw bytes to the other ranks' receive loop (tests send malformed ones)."""
        self._procs.send(payload)


def _check_devices(parallel_config: ParallelConfig) -> None:
    """Fail before spawning anything when the devices asked for are not there."""
    if _device_for(parallel_config, 0).type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but no CUDA device is visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    size = min(parallel_config.world_size, parallel_config.ranks_per_node)  # TP x PP
    visible = torch.cuda.device_count()
    if size > visible:
        raise ValueError(
            f"tensor_parallel_size={parallel_config.tensor_parallel_size} x "
            f"pipeline_parallel_size={parallel_config.pipeline_parallel_size} needs {size} "
            f"GPUs on this node but {visible} are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")


def _log_plan(plan: KVCachePlan, model_config: ModelConfig) -> None:
    logger.info("KV cache: %s; max_model_len %d", plan.describe(), plan.max_model_len)
    if plan.is_capped:
        # An explicit --max-model-len the pool cannot hold is worth a warning; the model's
        # own (often very long) context being capped is expected.
        log = logger.warning if model_config.max_model_len else logger.info
        log("max_model_len capped from %d to %d tokens: the KV cache holds only %d blocks x "
            "%d tokens; for longer contexts raise --gpu-memory-utilization, "
            "--kv-cache-memory-gb or --num-kv-blocks", plan.model_max_len, plan.max_model_len,
            plan.num_blocks, plan.block_size)
