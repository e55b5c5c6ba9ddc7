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
profiling forward of the largest step the scheduler can build; pdserve/serve/executor/kv_cache.py
has the rules) and the ranks take the smallest block count. The spawned ranks, the control channel
and the heartbeat are pdserve/serve/executor/rank_processes.py; shutdown (explicit, a `with` block,
or the last reference dropped) stops them and destroys the process group, so another runner can
start in this process.

Each rank's step is pdserve/serve/executor/rank.py, a rank's process
pdserve/serve/executor/rank_worker.py, the pool's size pdserve/serve/executor/pool_sizing.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from pdserve import envs
from pdserve.kvstore.memory_tier import fp8_as_bytes
from pdserve.protocol.tp import TP_PROTOCOL, ReadKV, StepInput, WriteKV
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.serve.executor.context_parallel import assemble_owned_blocks
from pdserve.serve.executor.cpu_preparation import BackgroundCpuPath, refresh_kernels
from pdserve.serve.executor.cpu_tuning import Tuning, tune_rank
from pdserve.serve.executor.kv_cache import KVCachePlan, KVCachePool
from pdserve.serve.executor.loader import ModelSpec, load_model_spec
from pdserve.serve.executor.rank_processes import RankProcesses
from pdserve.serve.executor.rank_worker import (
    DIST_TIMEOUT_S,
    START_TIMEOUT_S,
    describe_lost,
    device_for,
    serve_node,
    setup_rank,
    worker_main,
)
from pdserve.serve.layers.distributed import Rendezvous
from pdserve.serve.layers.fused_decode import FusedDecode
from pdserve.serve.layers.pipeline import PipelineTimes, assemble_kv_blocks, stage_layer_range
from pdserve.serve.models.moe import moe_load

__all__ = ["DIST_TIMEOUT_S", "START_TIMEOUT_S", "ModelRunner", "serve_node"]

logger = logging.getLogger(__name__)

HEARTBEAT_MAX_S = 5.0  # an idle engine pings its ranks at least this often


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
        """speculative_config (pdserve/serve/config.py SpeculativeConfig): load the checkpoint's
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
        self._can_tune = (size == 1 and device_for(parallel_config, 0).type == "cpu"
                          and getattr(parallel_config, "context_parallel_size", 1) == 1)
        # made before the model loads, so that nothing there waits for the kernels' build
        self._cpu_path = (BackgroundCpuPath() if self._can_tune and envs.cpu_tuning()
                          else None)
        try:
            for rank in parallel_config.local_ranks[1:]:  # the other nodes start their own
                procs.spawn(worker_main, rank, model_config, cache_config, scheduler_config,
                            parallel_config, dist_timeout_s, start_timeout_s)
            procs.owns_process_group = size > 1
            self._rank, procs.control = setup_rank(
                0, model_config, cache_config, scheduler_config, parallel_config,
                dist_timeout_s, start_timeout_s, peers_alive=procs.peers_alive,
                with_mtp=speculative_config is not None, rendezvous=hosted,
            )
        except BaseException:
            procs.stop(send_stop=False)
            if self._cpu_path is not None:
                self._cpu_path.close()
            raise
        rendezvous = self._rank.rendezvous
        if rendezvous is not None:
            procs.describe_lost = lambda after_failure: describe_lost(rendezvous,
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
        self._tuned: Tuning | None = None  # tune_cpu_path's
        self._scheduler_config = scheduler_config
        if self._cpu_path is not None:
            self._cpu_path.start(self._rank, scheduler_config)
            weakref.finalize(self, self._cpu_path.close)
        if size > 1:
            procs.start_heartbeat()

    @property
    def cpu_tuning(self) -> Tuning | None:
        """The CPU path this worker serves with and the times it was chosen by (one-rank CPU
        workers; None elsewhere, and while the portable path serves)."""
        return self._cpu_path.tuning if self._cpu_path is not None else self._tuned

    def cpu_path_status(self) -> dict[str, str]:
        """/status's cpu_path: the path that serves, its source, every path's times, and
        what is under way in the background (pdserve/serve/executor/cpu_preparation.py)."""
        if self._cpu_path is not None:
            return self._cpu_path.status()
        return self._tuned.as_status() if self._tuned is not None else {}

    def switch_cpu_path_if_ready(self) -> bool:
        """Switch to the fast CPU path once its background preparation is done (a cheap poll
        until then): called before every step, and by an idle worker's loop. Whether it
        switched now."""
        return self._cpu_path is not None and self._cpu_path.switch_if_ready()

    def wait_for_cpu_path(self, timeout_s: float | None = None) -> bool:
        """Block until the background preparation is done and serve on its path (offline
        benchmarks time that path). False: still preparing after timeout_s."""
        return self._cpu_path is None or self._cpu_path.wait(timeout_s)

    def tune_cpu_path(self, use_cache: bool = True,
                      progress: Callable[[int, int, str], None] | None = None) -> Tuning:
        """Choose the CPU path by measuring every candidate on this model, in the foreground
        (or read the choice back from the cache), apply it and log it
        (pdserve/serve/executor/cpu_tuning.py; `pdserve tune`). One-rank CPU workers only: a
        TP or PP group's ranks would each have to agree on one."""
        if not self._can_tune:
            raise RuntimeError("the CPU path is measured on a one-rank CPU worker only")
        if self._cpu_path is not None:  # measured here instead, on the kernels built here
            self._cpu_path.close()
            self._cpu_path = None
            refresh_kernels(self._rank)
        self._tuned = tune_rank(self._rank, self._scheduler_config, use_cache, progress)
        logger.info("%s", self._tuned.summary())
        return self._tuned

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp_size

    def propose_drafts(self, chunks: list[Any]) -> list[list[int]]:
        """The MTP pass after a step (pdserve/serve/engine/spec_decode.py): each DraftChunk's
        drafts."""
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

    def execute(self, step: StepInput, layer_done: Callable[[int], None] | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [number of chunks with need_logits, vocab_size] on the model's
        device (the sampler samples there: only the sampled ids come back to the host), in
        chunk order, then the chunks' prompt-logprob rows (pdserve/serve/engine/prompt_logprobs.py)
        when any asks.

        `layer_done(i)` runs on rank 0 as soon as layer i wrote this step's KV; with TP > 1
        an MHA rank 0 holds only its own heads, so whole-head users (the KV hand-off) gather
        after the step instead (read_kv_blocks) and pass no callback. An MLA latent is whole
        on rank 0 at any TP degree. Under pipeline parallelism rank 0 holds only the first
        stage's layers: no callback either.

        `input_ids` (one rank only): the step's token ids, int64 [num_tokens] on the device,
        for a step whose chunks hold placeholders (async scheduling,
        pdserve/serve/engine/overlap.py)."""
        if input_ids is not None and self._world_size > 1:
            raise ValueError("device input ids reach rank 0 only: one rank must hold the model")
        if layer_done is not None and self._tp_size > 1 and self._rank.layout.kind == "mha":
            raise ValueError("per-layer callbacks see only rank 0's heads: TP must be 1")
        if layer_done is not None and self._rank.cp.size > 1:
            raise ValueError("per-layer callbacks see only rank 0's blocks: CP must be 1")
        if layer_done is not None and self._pp_size > 1:
            raise ValueError("per-layer callbacks see only the first stage's layers: PP must "
                             "be 1")
        self._rank.validate(step)
        if self._cpu_path is not None:  # between two steps
            self._cpu_path.switch_if_ready()
        if not step.chunks:
            self._check_usable()
            return torch.empty(0, self.spec.vocab_size, dtype=torch.float32, device=self.device)
        with self._collective():
            if self._world_size > 1:
                self._procs.send(TP_PROTOCOL.encode(step))
            logits = self._rank.execute(step, layer_done, input_ids)
        if logits is None:
            return torch.empty(0, self.spec.vocab_size, dtype=torch.float32, device=self.device)
        return logits.float()

    def fused_decode(self, num_rows: int | None = None) -> FusedDecode | None:
        """The in-process rank's fused decode loop for a step of `num_rows` rows
        (pdserve/serve/layers/fused_decode.FusedDecode), or None where its model has none or other
        processes hold ranks (benchmarks/step_roofline.py times its parts)."""
        if self._world_size > 1:
            return None
        build = getattr(self._rank.model, "fused_decode", None)
        return build(num_rows) if build is not None else None

    def call_before_each_layer(self, hook: Callable[[], None]) -> None:
        """hook() runs before each decoder layer of every forward
        (pdserve/serve/cpu/core_share.py moves the threads of a one-rank prefill worker there);
        one rank only: a TP or PP rank's threads live in other processes."""
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
        self._broadcast_kv(WriteKV(list(block_ids)), full)
        self._rank.write_kv(list(block_ids), full.to(self.device))

    @property
    def holds_whole_pool(self) -> bool:
        """One process holds every layer and head of the pool (the host KV tier needs it)."""
        return self._world_size == 1

    @property
    def can_write_kv_layers(self) -> bool:
        """A layer's blocks can be written alone: one rank holds every layer and head (they
        go straight into its pool), or TP ranks each hold every layer (each takes its heads
        of a broadcast layer); not across pipeline stages or context-parallel owners."""
        return self._world_size == 1 or (self._pp_size == 1 and self._rank.cp.size == 1)

    def write_kv_layer(self, layer: int, block_ids: list[int], blocks: torch.Tensor) -> None:
        """write_kv_blocks of one layer, [P, n, block_size, num_kv_heads, head_dim]; only
        where can_write_kv_layers. With TP, every rank keeps its own heads of it (a TP-m
        prefill's hand-off re-laid out for this TP-n decode, a layer at a time)."""
        if not self.can_write_kv_layers:
            raise RuntimeError("a layer at a time needs every rank to hold every layer")
        if self._world_size == 1:
            self._rank.pool.write_layer_blocks(layer, list(block_ids), blocks)
            return
        full = blocks.to(self.spec.kv_torch_dtype).cpu().contiguous()
        self._broadcast_kv(WriteKV(list(block_ids), layer), full)
        self._rank.write_kv_layer(layer, list(block_ids), full.to(self.device))

    def _broadcast_kv(self, command: WriteKV, full: torch.Tensor) -> None:
        """Send the other ranks `command` and the whole-head blocks it writes (each keeps its
        own heads; rank 0 writes its part after)."""
        self._check_kv_split()
        procs = self._procs
        with self._collective(), procs.send_lock:
            procs.send_locked(TP_PROTOCOL.encode(command))
            dist.broadcast(fp8_as_bytes(full), src=0, group=procs.control)

    def _check_kv_split(self) -> None:
        if self._rank.layout.kind == "mha" and self.spec.num_kv_heads % self._tp_size:
            raise ValueError(f"moving KV blocks needs num_kv_heads ({self.spec.num_kv_heads}) "
                             f"divisible by the TP size ({self._tp_size})")

    def shutdown(self) -> None:
        """Stop workers (stop message, join, terminate) and leave the process group.
        Idempotent; also what happens when the last reference to the runner goes."""
        self._closed = True
        if self._cpu_path is not None:
            self._cpu_path.close()
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
    if device_for(parallel_config, 0).type != "cuda":
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
