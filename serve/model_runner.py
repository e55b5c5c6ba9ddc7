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
profiling forward of the largest step the scheduler can build; serve/kv_cache.py has the
rules) and the ranks take the smallest block count. The spawned ranks, the control channel
and the heartbeat are serve/rank_processes.py; shutdown (explicit, a `with` block, or the
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
import socket
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pdserve import envs
from pdserve.protocol.tp import TP_PROTOCOL, Ping, ReadKV, SeqChunk, StepInput, Stop, WriteKV
from pdserve.serve.attention import build_attention_metadata, default_backend_name
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.serve.distributed import Rendezvous, TPGroup, init_tp_group
from pdserve.serve.kv_cache import (
    KVCachePlan,
    KVCachePool,
    MemoryProfile,
    available_host_memory_bytes,
    bytes_per_block,
    check_fits_host_memory,
    plan_kv_cache,
)
from pdserve.serve.loader import ModelSpec, load_model, load_model_spec
from pdserve.serve.parallel import kv_heads_per_rank
from pdserve.serve.prompt_logprobs import logit_rows
from pdserve.serve.rank_processes import RankProcesses

logger = logging.getLogger(__name__)

DIST_TIMEOUT_S = 300.0  # every collective (a step, a heartbeat) must finish within this
START_TIMEOUT_S = 1800.0  # spawning workers and loading weights on every rank
MAX_MESSAGE_BYTES = 1 << 30
LOGITS_ROWS_PER_CALL = 256
"""Most rows of logits computed at once when a step asks for more than one per chunk (prompt
logprobs): bounds that step's extra activation memory to this many rows x vocab."""


# ---- what every rank holds ---------------------------------------------------------------


class _Rank:
    """One TP rank's model and KV pool, and the step it runs (identical on every rank)."""

    def __init__(self, spec: ModelSpec, block_size: int, tp: TPGroup,
                 device: torch.device) -> None:
        """Load this rank's shard; the pool comes after every rank loaded (allocate_pool)."""
        self.tp = tp
        self.device = device
        self.block_size = block_size
        self.spec = spec
        self._free_before_load = _free_device_memory(device)
        self.model = load_model(spec, tp, device, default_backend_name(device),
                                show_progress=tp.rank == 0)
        self.layout = spec.kv_layout(block_size)
        # An MLA latent is replicated; GQA heads split (or replicate past num_kv_heads ranks).
        self.num_kv_heads_per_rank = (spec.num_kv_heads if self.layout.kind == "mla"
                                      else kv_heads_per_rank(spec.num_kv_heads, tp.size))

    def allocate_pool(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                      min_over_ranks: Callable[[int], int] = lambda n: n) -> None:
        """Plan the pool (profiling the largest step on CUDA), agree on the block count with
        the other ranks (collectives: call on every rank together), allocate it."""
        spec, device = self.spec, self.device
        per_block = bytes_per_block(spec.num_layers, self.block_size,
                                    self.num_kv_heads_per_rank, spec.head_dim,
                                    spec.torch_dtype, self.layout.num_planes)
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
            check_fits_host_memory(plan, self.tp.size, available_host_memory_bytes())
        self.plan: KVCachePlan = plan
        self.num_blocks = plan.num_blocks
        # The served context is what the pool holds: a longer request could never run.
        self.spec = dataclasses.replace(spec, max_model_len=plan.max_model_len)
        self.pool = self._new_pool(self.num_blocks)

    def _new_pool(self, num_blocks: int) -> KVCachePool:
        spec = self.spec
        return KVCachePool(spec.num_layers, num_blocks, self.block_size,
                           self.num_kv_heads_per_rank, spec.head_dim, spec.torch_dtype,
                           self.device, self.layout.num_planes)

    @torch.inference_mode()
    def execute(self, step: StepInput, layer_done: Callable[[int], None] | None = None
                ) -> torch.Tensor | None:
        return self._forward(step, self.pool.kv_caches, layer_done)

    def _forward(self, step: StepInput, kv_caches: list[torch.Tensor],
                 layer_done: Callable[[int], None] | None = None) -> torch.Tensor | None:
        meta = build_attention_metadata(step, self.block_size, self.device)
        token_ids = np.fromiter(  # chain iterates in C: no Python work per token
            itertools.chain.from_iterable(c.token_ids for c in step.chunks), dtype=np.int64,
            count=step.num_tokens,
        )
        input_ids = torch.from_numpy(token_ids).to(self.device)
        # The last row of each chunk that samples, then the rows of prompt logprobs
        logits_rows = torch.from_numpy(logit_rows(step)).to(self.device)
        hidden = self.model(input_ids, kv_caches, meta, layer_done)  # [T, hidden]
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
        """This rank's heads of the blocks: [layers, P, n, block_size, local heads, dim]."""
        return torch.stack(self.pool.read_blocks(block_ids))

    def write_kv(self, block_ids: list[int], full: torch.Tensor) -> None:
        """Write this rank's head slice of whole-head blocks [layers, P, n, bs, heads, dim]."""
        mine = full[:, :, :, :, self.layout.rank_heads(self.tp.rank, self.tp.size)]
        self.pool.write_blocks(block_ids, list(mine.unbind(0)))

    def serve_kv_command(self, command: ReadKV | WriteKV, control: Any) -> None:
        """A non-zero rank's part of ModelRunner.read_kv_blocks / write_kv_blocks."""
        if isinstance(command, ReadKV):
            dist.gather(self.read_kv(command.block_ids).cpu(), None, dst=0, group=control)
        else:
            spec, layout = self.spec, self.layout
            full = torch.empty(spec.num_layers, layout.num_planes, len(command.block_ids),
                               self.block_size, spec.num_kv_heads, spec.head_dim,
                               dtype=spec.torch_dtype)
            dist.broadcast(full, src=0, group=control)
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
    kind = parallel_config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")


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


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _setup_rank(rank: int, model_config: ModelConfig, cache_config: CacheConfig,
                scheduler_config: SchedulerConfig, parallel_config: ParallelConfig,
                timeout_s: float, start_timeout_s: float,
                peers_alive: Callable[[], bool] | None = None) -> tuple[_Rank, Any]:
    """Join the group, load this rank's shard; returns the rank and its control group."""
    size = parallel_config.tensor_parallel_size
    device = _device_for(parallel_config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif parallel_config.cpu_threads is not None:
        torch.set_num_threads(parallel_config.cpu_threads)
    elif size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    backend = parallel_config.backend or ("nccl" if device.type == "cuda" else "gloo")
    rendezvous = None
    if size > 1:
        assert parallel_config.master_port is not None
        rendezvous = Rendezvous(rank, size, parallel_config.master_addr,
                                parallel_config.master_port, start_timeout_s)
    tp = dataclasses.replace(init_tp_group(rendezvous, backend, timeout_s, peers_alive),
                             expert_parallel=parallel_config.enable_expert_parallel)
    control = None
    if rendezvous is not None:
        control = dist.new_group(backend="gloo",
                                 timeout=datetime.timedelta(seconds=timeout_s))
    spec = load_model_spec(model_config, device.type)
    state = _Rank(spec, cache_config.block_size, tp, device)
    if rendezvous is not None:
        # Every rank loaded before any enters a collective (the profiling forward, the
        # block-count agreement, a step): loading may outlast a collective's timeout.
        rendezvous.arrive_and_wait("loaded", peers_alive)
    state.allocate_pool(cache_config, scheduler_config,
                        (lambda n: _min_over_ranks(n, control)) if control is not None
                        else (lambda n: n))
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
    finally:
        dist.destroy_process_group()


# ---- the engine-facing runner ------------------------------------------------------------


class ModelRunner:
    """Loads the model on every TP rank and runs steps; rank 0 lives in this process.

    `shutdown()` (also on `with` exit, and when the last reference goes) stops the other
    ranks and destroys the process group, so another runner can start in this process."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 parallel_config: ParallelConfig | None = None,
                 dist_timeout_s: float = DIST_TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S,
                 scheduler_config: SchedulerConfig | None = None) -> None:
        parallel_config = parallel_config or ParallelConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        size = parallel_config.tensor_parallel_size
        _check_devices(parallel_config)
        if size > 1 and dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed process group (another LLM or "
                "ModelRunner with tensor_parallel_size > 1 still open?): shut it down first "
                "(llm.shutdown(), a `with` block, or drop its last reference)")
        if parallel_config.master_port is None:
            parallel_config = dataclasses.replace(
                parallel_config, master_port=_free_port(parallel_config.master_addr)
            )
        self._closed = False
        self._tp_size = size
        self._procs = RankProcesses(heartbeat_s=dist_timeout_s / 4)
        procs = self._procs
        try:
            for rank in range(1, size):
                procs.spawn(_worker_main, rank, model_config, cache_config, scheduler_config,
                            parallel_config, dist_timeout_s, start_timeout_s)
            procs.owns_process_group = size > 1
            self._rank, procs.control = _setup_rank(
                0, model_config, cache_config, scheduler_config, parallel_config,
                dist_timeout_s, start_timeout_s, peers_alive=procs.peers_alive,
            )
        except BaseException:
            procs.stop(send_stop=False)
            raise
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

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    @property
    def _workers(self) -> list[Any]:
        return self._procs.workers

    def execute(self, step: StepInput, layer_done: Callable[[int], None] | None = None
                ) -> torch.Tensor:
        """float32 CPU logits [number of chunks with need_logits, vocab_size], in chunk order,
        then the chunks' prompt-logprob rows (serve/prompt_logprobs.py) when any asks.

        `layer_done(i)` runs on rank 0 as soon as layer i wrote this step's KV; with TP > 1
        an MHA rank 0 holds only its own heads, so whole-head users (the KV hand-off) gather
        after the step instead (read_kv_blocks) and pass no callback. An MLA latent is whole
        on rank 0 at any TP degree."""
        if layer_done is not None and self._tp_size > 1 and self._rank.layout.kind == "mha":
            raise ValueError("per-layer callbacks see only rank 0's heads: TP must be 1")
        self._rank.validate(step)
        if not step.chunks:
            self._check_usable()
            return torch.empty(0, self.spec.vocab_size, dtype=torch.float32)
        with self._collective():
            if self._tp_size > 1:
                self._procs.send(TP_PROTOCOL.encode(step))
            logits = self._rank.execute(step, layer_done)
        if logits is None:
            return torch.empty(0, self.spec.vocab_size, dtype=torch.float32)
        return logits.float().cpu()

    def read_kv_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of the blocks with every KV head (all ranks' shards gathered), per layer
        [P, n, block_size, num_kv_heads, head_dim] on the host: the TP-independent layout
        the KV hand-off moves."""
        local = self._rank.read_kv(list(block_ids))  # [L, P, n, bs, local heads, D]
        if self._tp_size == 1 or self._rank.layout.kind == "mla":  # rank 0 holds it all
            return list(local.cpu().unbind(0))
        self._check_kv_split()
        procs = self._procs
        with self._collective(), procs.send_lock:
            procs.send_locked(TP_PROTOCOL.encode(ReadKV(list(block_ids))))
            parts = [torch.empty_like(local, device="cpu") for _ in range(self._tp_size)]
            dist.gather(local.cpu(), parts, dst=0, group=procs.control)
        return list(torch.cat(parts, dim=4).unbind(0))

    def write_kv_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        """Inverse of read_kv_blocks: per layer [P, n, block_size, num_kv_heads, head_dim];
        every rank keeps its own heads (so the writer's TP degree does not matter)."""
        full = torch.stack([b.to(self.spec.torch_dtype) for b in blocks]).cpu().contiguous()
        if self._tp_size > 1:
            self._check_kv_split()
            procs = self._procs
            with self._collective(), procs.send_lock:
                procs.send_locked(TP_PROTOCOL.encode(WriteKV(list(block_ids))))
                dist.broadcast(full, src=0, group=procs.control)
        self._rank.write_kv(list(block_ids), full.to(self.device))

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
            raise RuntimeError("ModelRunner failed in an earlier step; shut it down")
        self._check_workers()

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """Work every rank takes part in. A failure inside leaves the ranks out of step (a
        worker may sit mid-collective), so the runner never talks to them again."""
        self._check_usable()
        try:
            yield
        except BaseException:
            # One rank has nobody to fall out of step with: it stays usable.
            self._procs.is_broken = self._tp_size > 1
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
    size, visible = parallel_config.tensor_parallel_size, torch.cuda.device_count()
    if size > visible:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs but {visible} are visible "
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
