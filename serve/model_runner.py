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
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve import envs
from pdserve.protocol.tp import TP_PROTOCOL, Ping, ReadKV, StepInput, Stop, WriteKV
from pdserve.serve.attention import build_attention_metadata, default_backend_name
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.distributed import Rendezvous, TPGroup, init_tp_group
from pdserve.serve.kv_cache import KVCachePool, num_blocks_for
from pdserve.serve.loader import ModelSpec, load_model, load_model_spec
from pdserve.serve.parallel import kv_heads_per_rank

logger = logging.getLogger(__name__)

DIST_TIMEOUT_S = 300.0  # every collective (a step, a heartbeat) must finish within this
START_TIMEOUT_S = 1800.0  # spawning workers and loading weights on every rank
JOIN_TIMEOUT_S = 10.0  # how long shutdown waits for a worker before terminating it
MAX_MESSAGE_BYTES = 1 << 30


# ---- what every rank holds ---------------------------------------------------------------


class _Rank:
    """One TP rank's model and KV pool, and the step it runs (identical on every rank)."""

    def __init__(self, spec: ModelSpec, cache_config: CacheConfig, tp: TPGroup,
                 device: torch.device) -> None:
        self.spec = spec
        self.tp = tp
        self.device = device
        self.block_size = cache_config.block_size
        backend_name = default_backend_name(device)
        self.model = load_model(spec, tp, device, backend_name, show_progress=tp.rank == 0)
        self.layout = spec.kv_layout(self.block_size)
        planes = self.layout.num_planes
        # An MLA latent is replicated; GQA heads split (or replicate past num_kv_heads ranks).
        kv_heads = (spec.num_kv_heads if self.layout.kind == "mla"
                    else kv_heads_per_rank(spec.num_kv_heads, tp.size))
        # Sized from configs and the spec only, so every rank gets the same count.
        self.num_blocks = num_blocks_for(cache_config, spec.num_layers, kv_heads,
                                         spec.head_dim, spec.torch_dtype, planes)
        self.pool = KVCachePool(spec.num_layers, self.num_blocks, self.block_size, kv_heads,
                                spec.head_dim, spec.torch_dtype, device, planes)

    @torch.inference_mode()
    def execute(self, step: StepInput, layer_done: Callable[[int], None] | None = None
                ) -> torch.Tensor | None:
        meta = build_attention_metadata(step, self.block_size, self.device)
        token_ids = np.fromiter(  # chain iterates in C: no Python work per token
            itertools.chain.from_iterable(c.token_ids for c in step.chunks), dtype=np.int64,
            count=step.num_tokens,
        )
        input_ids = torch.from_numpy(token_ids).to(self.device)
        # The last row of each chunk that samples: [number of chunks with need_logits]
        chunk_ends = np.cumsum([len(c.token_ids) for c in step.chunks]) - 1
        need = np.array([c.need_logits for c in step.chunks], dtype=bool)
        logits_rows = torch.from_numpy(chunk_ends[need]).to(self.device)
        hidden = self.model(input_ids, self.pool.kv_caches, meta, layer_done)  # [T, hidden]
        if logits_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, logits_rows))

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


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _setup_rank(rank: int, model_config: ModelConfig, cache_config: CacheConfig,
                parallel_config: ParallelConfig, timeout_s: float, start_timeout_s: float,
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
    spec = load_model_spec(model_config)
    state = _Rank(spec, cache_config, tp, device)
    if rendezvous is not None:
        # Every rank loaded before any waits on a step: loading may outlast a collective.
        rendezvous.arrive_and_wait("loaded", peers_alive)
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
                 parallel_config: ParallelConfig, timeout_s: float, start_timeout_s: float
                 ) -> None:
    logging.basicConfig(level=envs.log_level())
    try:
        state, control = _setup_rank(rank, model_config, cache_config, parallel_config,
                                     timeout_s, start_timeout_s)
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
    """Loads the model on every TP rank and runs steps; rank 0 lives in this process."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 parallel_config: ParallelConfig | None = None,
                 dist_timeout_s: float = DIST_TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        parallel_config = parallel_config or ParallelConfig()
        size = parallel_config.tensor_parallel_size
        if parallel_config.master_port is None:
            parallel_config = dataclasses.replace(
                parallel_config, master_port=_free_port(parallel_config.master_addr)
            )
        self._workers: list[Any] = []
        self._closed = False
        self._is_broken = False
        self._send_lock = threading.Lock()
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_s = dist_timeout_s / 4
        self._last_send_s = time.monotonic()
        self._tp_size = size
        self._num_threads = torch.get_num_threads()  # _setup_rank lowers it under CPU TP
        try:
            context = mp.get_context("spawn")
            for rank in range(1, size):
                worker = context.Process(
                    target=_worker_main, name=f"pdserve-tp{rank}", daemon=True,
                    args=(rank, model_config, cache_config, parallel_config, dist_timeout_s,
                          start_timeout_s),
                )
                worker.start()
                self._workers.append(worker)
            self._rank, self._control = _setup_rank(
                0, model_config, cache_config, parallel_config, dist_timeout_s, start_timeout_s,
                peers_alive=lambda: all(w.is_alive() for w in self._workers),
            )
        except BaseException:
            self._stop_workers(send_stop=False)
            raise
        self.spec: ModelSpec = self._rank.spec
        self.num_blocks: int = self._rank.num_blocks
        self.block_size: int = cache_config.block_size
        self.device: torch.device = self._rank.device
        self.kv_pool: KVCachePool = self._rank.pool
        self.kv_caches: list[torch.Tensor] = self._rank.pool.kv_caches
        if size > 1:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop,
                                               name="pdserve-tp-heartbeat", daemon=True)
            self._heartbeat.start()

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp_size

    def execute(self, step: StepInput, layer_done: Callable[[int], None] | None = None
                ) -> torch.Tensor:
        """float32 CPU logits [number of chunks with need_logits, vocab_size], in chunk order.

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
                self._send(TP_PROTOCOL.encode(step))
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
        with self._collective(), self._send_lock:
            self._send_locked(TP_PROTOCOL.encode(ReadKV(list(block_ids))))
            parts = [torch.empty_like(local, device="cpu") for _ in range(self._tp_size)]
            dist.gather(local.cpu(), parts, dst=0, group=self._control)
        return list(torch.cat(parts, dim=4).unbind(0))

    def write_kv_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        """Inverse of read_kv_blocks: per layer [P, n, block_size, num_kv_heads, head_dim];
        every rank keeps its own heads (so the writer's TP degree does not matter)."""
        full = torch.stack([b.to(self.spec.torch_dtype) for b in blocks]).cpu().contiguous()
        if self._tp_size > 1:
            self._check_kv_split()
            with self._collective(), self._send_lock:
                self._send_locked(TP_PROTOCOL.encode(WriteKV(list(block_ids))))
                dist.broadcast(full, src=0, group=self._control)
        self._rank.write_kv(list(block_ids), full.to(self.device))

    def _check_kv_split(self) -> None:
        if self._rank.layout.kind == "mha" and self.spec.num_kv_heads % self._tp_size:
            raise ValueError(f"moving KV blocks needs num_kv_heads ({self.spec.num_kv_heads}) "
                             f"divisible by the TP size ({self._tp_size})")

    def shutdown(self) -> None:
        """Stop workers (stop message, join, terminate) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        self._stop_workers(send_stop=True)

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("ModelRunner is shut down")
        if self._is_broken:
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
            self._is_broken = self._tp_size > 1
            raise

    def _send(self, payload: bytes) -> None:
        with self._send_lock:
            self._send_locked(payload)

    def _send_locked(self, payload: bytes) -> None:
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0,
                       group=self._control)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0,
                       group=self._control)
        self._last_send_s = time.monotonic()

    def _heartbeat_loop(self) -> None:
        while not self._stop_heartbeat.wait(self._heartbeat_s / 2):
            if time.monotonic() - self._last_send_s < self._heartbeat_s:
                continue
            try:
                self._send(TP_PROTOCOL.encode(Ping()))
            except Exception:  # a dead worker: execute() reports it
                logger.exception("TP heartbeat failed")
                return

    def _check_workers(self) -> None:
        dead = [w.name for w in self._workers if not w.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) {', '.join(dead)} died")

    def _stop_workers(self, send_stop: bool) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=JOIN_TIMEOUT_S)
        graceful = (send_stop and not self._is_broken and bool(self._workers)
                    and all(w.is_alive() for w in self._workers))
        if graceful:
            try:
                self._send(TP_PROTOCOL.encode(Stop()))
            except Exception:
                logger.exception("could not send stop to TP workers")
                graceful = False
        for worker in self._workers:
            # Without a stop message a worker may sit in a wait that only a timeout ends.
            if graceful:
                worker.join(timeout=JOIN_TIMEOUT_S)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=JOIN_TIMEOUT_S)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=JOIN_TIMEOUT_S)  # SIGKILL cannot be ignored
        self._workers = []
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._num_threads)
