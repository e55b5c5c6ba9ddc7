"""A rank's process: join the group, load the shard, plan the pool (setup_rank), then serve
rank 0's messages until told to stop (worker_main). Rank 0 runs setup_rank inside the engine
(pdserve/serve/executor/model_runner.py); ranks 1..N-1 run worker_main in processes that
RankProcesses spawned (pdserve/serve/executor/rank_processes.py), and a node k > 0 of a worker over
several nodes starts its own with serve_node.

Steps and KV commands arrive as pdserve/protocol/tp.py messages (checked msgpack) in a uint8
tensor over the gloo "control" group, length first, then bytes; never pickled.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pdserve import envs
from pdserve.protocol.tp import TP_PROTOCOL, Ping, ReadKV, StepInput, Stop, WriteKV
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.serve.executor.context_parallel import CPGroup
from pdserve.serve.executor.loader import load_model_spec
from pdserve.serve.executor.rank import Rank
from pdserve.serve.executor.rank_processes import RankProcesses, wait_node_ranks
from pdserve.serve.layers.distributed import (
    SILENT_AFTER_S,
    Rendezvous,
    RendezvousError,
    TPGroup,
    init_tp_group,
)
from pdserve.serve.layers.fp8 import kv_cache_dtype_name
from pdserve.serve.layers.pipeline import PipelineStage, PPGroup, split_stages

logger = logging.getLogger(__name__)

DIST_TIMEOUT_S = 300.0  # every collective (a step, a heartbeat) must finish within this
START_TIMEOUT_S = 1800.0  # spawning workers and loading weights on every rank
MAX_MESSAGE_BYTES = 1 << 30


def device_for(parallel_config: ParallelConfig, rank: int) -> torch.device:
    """Rank r takes its node's (r mod ranks per node)-th visible GPU."""
    kind = parallel_config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = rank % parallel_config.ranks_per_node
    return torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")



def _min_over_ranks(value: int, control: Any) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=control)
    return int(tensor.item())


def setup_rank(rank: int, model_config: ModelConfig, cache_config: CacheConfig,
                scheduler_config: SchedulerConfig, parallel_config: ParallelConfig,
                timeout_s: float, start_timeout_s: float,
                peers_alive: Callable[[], bool] | None = None,
                with_mtp: bool = False,
                rendezvous: Rendezvous | None = None) -> tuple[Rank, Any]:
    """Join the group, load this rank's shard; returns the rank and its control group.
    `rendezvous`: rank 0's store when the caller already hosts it (on a port it picked)."""
    size = parallel_config.world_size  # TP x PP ranks
    device = device_for(parallel_config, rank)
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
    state = Rank(spec, cache_config.block_size, tp, device, pp)
    if with_mtp:  # speculative decoding's drafter (rank 0 of a one-rank worker)
        state.add_mtp()
    if rendezvous is not None:
        # Every rank loaded before any enters a collective (the profiling forward, the
        # block-count agreement, a step): loading may outlast a collective's timeout.
        rendezvous.arrive_and_wait("loaded", peers_alive)
    state.cp = cp
    state.plan_decode_graphs(model_config.enforce_eager, is_one_rank=size == 1)
    state.allocate_pool(cache_config, scheduler_config,
                        (lambda n: _min_over_ranks(n, control)) if control is not None
                        else (lambda n: n))
    state.capture_decode_graphs(scheduler_config.max_num_seqs)
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


def worker_main(rank: int, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, parallel_config: ParallelConfig,
                 timeout_s: float, start_timeout_s: float) -> None:
    logging.basicConfig(level=envs.log_level())
    try:
        state, control = setup_rank(rank, model_config, cache_config, scheduler_config,
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


def describe_lost(rendezvous: Rendezvous, after_failure: bool) -> str | None:
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
        procs.spawn(worker_main, rank, model_config, cache_config,
                    scheduler_config or SchedulerConfig(), parallel_config, dist_timeout_s,
                    start_timeout_s)
    logger.info("node %d of %d: ranks %s joining the rendezvous at %s:%d",
                parallel_config.node_rank, parallel_config.nnodes,
                list(parallel_config.local_ranks), parallel_config.master_addr,
                parallel_config.master_port)
    return wait_node_ranks(procs, stop or threading.Event())
