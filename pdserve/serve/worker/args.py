"""The flags of `pdserve prefill | decode | colocated`, and the engine configs they make.

The flags come in groups, each an `add_<group>_arguments(parser)`. `pdserve up` declares the
groups a whole pool shares (model, cache, scheduler, experts, hand-off, device) with the same
functions and hands them to every worker it starts through `<group>_argv(args)`, which writes
back only the values that differ from their defaults (a child's command line shows what was
asked for). So each flag is declared once, with one help text, whoever parses it. Defaults
come from the config dataclasses (pdserve/serve/config.py).

This module imports no torch: the launcher reads it to declare its own flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pdserve import discovery, envs
from pdserve.handoff.registry import AUTO, TRANSPORTS, WIRES
from pdserve.serve.config import (
    DTYPES,
    ENGINES,
    KV_CACHE_DTYPES,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SimConfig,
)
from pdserve.serve.cpu.core_share import Lender

# WorkerConfig's (pdserve/serve/worker/server.py) defaults, which tests/app checks these against:
# that module builds the engine, and the launcher must not import it.
STORE_TIMEOUT_S = 10.0
KV_LEASE_TTL_S = 30.0
HANDOFF_DRAM_GB = 1.0
KV_OFFLOAD_GB = 2.0
DISCOVERY_STORE_WAIT_S = 30.0
DRAIN_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of a worker process."""
    add = parser.add_argument
    add("--model", required=True, help="local Hugging Face checkpoint dir")
    add("--host", default="127.0.0.1", help="address to bind")
    add("--port", type=int, default=None,
        help="ZeroMQ port for the router (required, but on nodes with --node-rank > 0)")
    add("--worker-id", default=None, help="name in status and metrics")
    add_model_arguments(parser)
    add_device_arguments(parser)
    add_parallel_arguments(parser)
    add_expert_arguments(parser)
    add_cache_arguments(parser)
    add_scheduler_arguments(parser)
    add("--max-prefills-per-step", type=int,
        default=SchedulerConfig().max_prefills_per_step,
        help="prompts that get prefill tokens in one step (0: as many as the token budget "
             "holds); 1 on a CPU prefill worker gives the first prompt its token a batch "
             "sooner")
    add_store_arguments(parser)
    add_handoff_arguments(parser)
    add_core_sharing_arguments(parser)
    add_discovery_arguments(parser)


# ---- groups `pdserve up` shares --------------------------------------------------------------
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """How the checkpoint runs (every worker of a cluster alike)."""
    model = ModelConfig(model="")
    group = parser.add_argument_group("model")
    group.add_argument("--dtype", default=model.dtype, choices=DTYPES,
                       help="weights, activations and KV cache (auto: the checkpoint's)")
    group.add_argument("--max-model-len", type=int, default=model.max_model_len,
                       help="longest prompt + output in tokens (default: the checkpoint's)")
    group.add_argument("--seed", type=int, default=model.seed,
                       help="seed of the engine's default RNG (a request's own seed wins)")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, as vLLM: \'{"method": "mtp", '
                            '"num_speculative_tokens": 1}\' drafts with the checkpoint\'s '
                            "multi-token-prediction layer (DeepSeek-V3; a prefill worker "
                            "loads it for a role flip but never drafts)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly, without CUDA graphs (vLLM's flag; by "
                            "default a one-rank CUDA worker replays its decode steps from "
                            "graphs captured at start for batch sizes 1, 2, 4, then every 8 "
                            "up to --max-num-seqs)")
    add_sim_arguments(parser)


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulated engine (pdserve/serve/executor/sim_runner.py)."""
    sim = SimConfig(profile="-")
    group = parser.add_argument_group("simulated engine")
    group.add_argument("--engine", choices=ENGINES, default="torch",
                       help="torch: run the model; sim: run everything else of the worker "
                            "for real and replace each forward by a wait of --sim-profile's "
                            "predicted step time (no weights loaded; tokens from a seeded "
                            "generator, equal on every worker for the same prompt)")
    group.add_argument("--sim-profile", default=None, metavar="FILE|NAME",
                       help="--engine sim: the latency profile to simulate (the format of "
                            "`pdserve profile`, docs/planner.md), or a bundled one by name "
                            "(distserve-opt-13b-a100); --tensor-parallel-size picks its entry")
    group.add_argument("--sim-speedup", type=float, default=sim.speedup, metavar="K",
                       help="--engine sim: every step takes the profile's time divided by K")
    group.add_argument("--sim-kv-fraction", type=float, default=sim.kv_fraction, metavar="F",
                       help="--engine sim: real KV bytes a token, as a fraction of the "
                            "profile's; the pool keeps the simulated device's block count "
                            "(--kv-cache-memory-gb is the simulated budget), and the host "
                            "tier and hand-off DRAM shrink by F too so they hold as many "
                            "blocks as they would")


def sim_config_from_args(args: argparse.Namespace) -> SimConfig | None:
    """--engine sim's config (None for the torch engine); a ValueError names what is
    wrong."""
    if getattr(args, "engine", "torch") != "sim":
        if getattr(args, "sim_profile", None) is not None:
            raise ValueError("--sim-profile is for --engine sim")
        return None
    if args.sim_profile is None:
        raise ValueError("--engine sim needs --sim-profile FILE (a latency profile, "
                         "docs/planner.md) or a bundled profile's name")
    return SimConfig(profile=args.sim_profile, speedup=args.sim_speedup,
                     kv_fraction=args.sim_kv_fraction)


def model_argv(args: argparse.Namespace) -> list[str]:
    return _changed_argv(add_model_arguments, args)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the ranks run. `pdserve up` resolves these per worker (which GPUs, what share
    of them), so they have no `_argv`."""
    group = parser.add_argument_group("device")
    group.add_argument("--device", choices=("cuda", "cpu"), default=ParallelConfig().device,
                       help="where the ranks run (default: cuda when a GPU is found); rank r "
                            "of a TP group takes the r-th GPU of CUDA_VISIBLE_DEVICES, which "
                            "`pdserve up` sets to GPUs of each worker's own")
    group.add_argument("--gpu-memory-utilization", type=float,
                       default=CacheConfig().gpu_memory_utilization,
                       help="CUDA: fraction of each GPU's memory for weights, activations and "
                            "the KV cache; the KV cache gets what the weights and a profiling "
                            "step of --max-num-batched-tokens leave (vLLM's flag; `pdserve "
                            "up --allow-gpu-sharing` divides it among the workers of a GPU)")


def add_expert_arguments(parser: argparse.ArgumentParser) -> None:
    """Mixture-of-experts layers."""
    parallel = ParallelConfig()
    group = parser.add_argument_group("mixture of experts")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE models: whole experts spread over a worker's TP ranks, tokens "
                            "sent to them by all-to-all (default: every expert TP-split)")
    group.add_argument("--expert-capacity-factor", type=float,
                       default=parallel.expert_capacity_factor,
                       help="MoE: each expert takes at most ceil(F x tokens x top_k / experts) "
                            "assignments per step, the rest dropped (gates renormalised); "
                            "default: no limit (exact)")


def expert_argv(args: argparse.Namespace) -> list[str]:
    return _changed_argv(add_expert_arguments, args)


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The paged KV cache of each rank."""
    cache = CacheConfig()
    group = parser.add_argument_group("KV cache")
    group.add_argument("--block-size", type=int, default=cache.block_size,
                       help="tokens per KV block")
    group.add_argument("--num-kv-blocks", type=int, default=cache.num_blocks,
                       help="KV blocks per rank; overrides the memory-based sizing below")
    group.add_argument("--kv-cache-memory-gb", type=float, default=None,
                       help="KV cache size per rank in GiB (default: 0.5 on CPU, checked "
                            "against the host's available memory; on CUDA, sized by "
                            "--gpu-memory-utilization)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=cache.kv_cache_dtype,
                       help="what the KV cache holds: auto (the model dtype) or fp8 / fp8_e4m3 "
                            "(float8_e4m3fn, half of bf16's bytes in the pool, the store and "
                            "the hand-off; prefill and decode workers must agree)")
    group.add_argument("--no-prefix-caching", action="store_true",
                       help="recompute every prompt (no prefix-cache hits: not this worker's "
                            "pool, its host DRAM tier or the KV store): for benchmarks that "
                            "send the same prompts more than once")
    group.add_argument("--kv-offload-gb", type=float, default=KV_OFFLOAD_GB,
                       help="host DRAM below the KV pool, per worker: prefix blocks the pool "
                            "evicts wait there (then in the KV store, if any) and are copied "
                            "back instead of recomputed where that is faster (0: off; a "
                            "worker whose pool spans several ranks has none)")


def cache_argv(args: argparse.Namespace) -> list[str]:
    return _changed_argv(add_cache_arguments, args)


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """The continuous batch's limits."""
    sched = SchedulerConfig()
    group = parser.add_argument_group("scheduler")
    group.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs,
                       help="requests in one batch at most")
    group.add_argument("--max-num-batched-tokens", type=int,
                       default=sched.max_num_batched_tokens,
                       help="tokens one step computes at most (prompt chunks and decodes)")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=sched.async_scheduling,
                       help="schedule the next step and detokenize the last while a step "
                            "runs (default: on with one CUDA device, off on CPU)")


def scheduler_argv(args: argparse.Namespace) -> list[str]:
    return _changed_argv(add_scheduler_arguments, args)


def add_handoff_arguments(parser: argparse.ArgumentParser) -> None:
    """How a prompt's KV crosses from prefill to decode (disaggregated workers)."""
    group = parser.add_argument_group("KV hand-off")
    group.add_argument("--kv-handoff", default=AUTO, choices=[AUTO, *sorted(TRANSPORTS)],
                       help="how a prompt's KV crosses from prefill to decode: node (the "
                            "worker's own hand-off node, read in one hop), store (through "
                            "the fleet store, two hops); auto: node with --handoff-dram-gb > "
                            "0, else store")
    group.add_argument("--handoff-shm", action=argparse.BooleanOptionalAction,
                       default=envs.handoff_shm_default(),
                       help="same host: the node stages prompts in a shared memory segment "
                            "and decode copies them straight out of it (default: on; off: "
                            "every hand-off crosses the network; PDSERVE_HANDOFF_SHM is a "
                            "deprecated alias that sets this default)")
    group.add_argument("--handoff-follow", action=argparse.BooleanOptionalAction,
                       default=envs.handoff_follow_default(),
                       help="decode copies each layer of a prompt as prefill stages it "
                            "(default: on; off: only once handed off; PDSERVE_HANDOFF_FOLLOW "
                            "is a deprecated alias that sets this default)")
    group.add_argument("--handoff-wire", default=WIRES[0], choices=list(WIRES),
                       help="how this worker's hand-off node sends a prompt's KV: raw (the "
                            "pool's bytes), or fp8 (1 byte a value plus a scale per layer's K "
                            "and V of each block, for slow links between hosts; turns "
                            "--handoff-follow off). Decode workers read either")
    group.add_argument("--save-answers", action=argparse.BooleanOptionalAction, default=True,
                       help="decode writes a finished answer's full KV blocks through to the "
                            "fleet store, so the prefill of a conversation's next turn (whose "
                            "prompt holds the answer) loads them instead of recomputing them "
                            "(default: on; needs a store)")
    group.add_argument("--handoff-dram-gb", type=float, default=HANDOFF_DRAM_GB,
                       help="host DRAM of each prefill or decode worker's own hand-off node: "
                            "prefill saves a prompt's KV there and decode workers read it "
                            "directly, one hop (0: hand off through the store)")
    group.add_argument("--store-timeout-s", type=float, default=STORE_TIMEOUT_S,
                       help="longest wait on the store; past it a transfer is a miss")
    group.add_argument("--kv-lease-ttl-s", type=float, default=KV_LEASE_TTL_S,
                       help="prefill pins a hand-off's blocks in the store this long at most "
                            "(the decode worker releases them once loaded)")


def handoff_argv(args: argparse.Namespace) -> list[str]:
    return _changed_argv(add_handoff_arguments, args)


# ---- the worker's own ------------------------------------------------------------------------
def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """How one worker's ranks split the model, and over which hosts."""
    parallel = ParallelConfig()
    group = parser.add_argument_group("parallelism")
    add = group.add_argument
    add("--tensor-parallel-size", "--tp", type=int, default=parallel.tensor_parallel_size)
    add("--pipeline-parallel-size", "--pp", type=int, default=parallel.pipeline_parallel_size,
        help="stages the layers are split into, each of --tensor-parallel-size ranks (PP x TP "
             "ranks in all); activations pass stage to stage")
    add("--pipeline-micro-batches", type=int, default=parallel.pipeline_micro_batches,
        help="micro-batches a step is split into so the stages overlap (bubble "
             "(PP-1)/(M+PP-1) of a step; default: one per stage)")
    add("--context-parallel-size", "--cp", type=int, default=parallel.context_parallel_size,
        help="ranks each prompt's tokens are split over (zig-zag), attention as ring "
             "attention; each rank holds its blocks' KV, so prompts longer than one rank's "
             "pool prefill (not combined with --tp or --pp yet)")
    add("--cpu-threads", type=int, default=parallel.cpu_threads,
        help="torch threads per TP rank on CPU (default: cores / ranks)")
    add("--nnodes", type=int, default=parallel.nnodes,
        help="hosts this worker's ranks spread over, evenly (torchrun's flag); start the same "
             "command on each with its --node-rank")
    add("--node-rank", type=int, default=parallel.node_rank,
        help="this host's index: 0 runs the engine and hosts the rendezvous, k > 0 runs only "
             "its ranks, which join node 0 at --master-addr:--master-port")
    add("--master-addr", default=parallel.master_addr,
        help="address of node 0's rendezvous, as the other nodes reach it")
    add("--master-port", type=int, default=parallel.master_port,
        help="port of the rendezvous (required with --nnodes > 1; default: a free one)")
    add("--dist-timeout-s", type=float, default=parallel.dist_timeout_s,
        help="longest wait of a collective, and of node 0 for the other nodes to join "
             "(default 300)")
    add("--dist-interface", default=parallel.dist_interface,
        help="network interface for the ranks' gloo/NCCL connections (default: the one the "
             "host name resolves to)")


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV store")
    group.add_argument("--store", default=None, metavar="ADDR",
                       help="KV store data server (prefill saves, decode loads); none: decode "
                            "recomputes the prompt")
    group.add_argument("--store-master", default=None, metavar="ADDR",
                       help="KV store master (metadata service)")


def add_core_sharing_arguments(parser: argparse.ArgumentParser) -> None:
    """Core lending between a prefill and a decode worker on one CPU host (`pdserve up`
    pairs them; pdserve/serve/cpu/core_share.py)."""
    group = parser.add_argument_group("core sharing (CPU)")
    group.add_argument("--lend-idle-flag", default=None, metavar="PATH",
                       help="publish in this file whether the worker holds a request, so that "
                            "a worker of the other role on the same host "
                            "(--borrow-idle-cores) runs on its cores too while it holds none")
    group.add_argument("--borrow-idle-cores", type=Lender.parse, action="append", default=[],
                       metavar="CORES@PATH",
                       help="one rank: also run on CORES (and with as many more threads) "
                            "while the worker publishing in PATH holds no request; checked "
                            "before each step, and by a prefill before each layer "
                            "(repeatable)")


def add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    discovery.add_arguments(parser)
    parser.add_argument("--discovery-store-wait-s", type=float, default=DISCOVERY_STORE_WAIT_S,
                        help="with --discovery and no --store: wait this long for a store "
                             "data node to register, then exit with an error (0: use one if "
                             "registered, else run without)")
    parser.add_argument("--drain-timeout-s", type=float, default=DRAIN_TIMEOUT_S,
                        help="with --discovery, on SIGTERM: leave the registry, then finish "
                             "the requests held for at most this long before exiting")


# ---- flags -> configs ------------------------------------------------------------------------
def engine_configs_from_args(args: argparse.Namespace
                             ) -> tuple[ModelConfig, CacheConfig, ParallelConfig,
                                        SchedulerConfig]:
    """The engine's four configs: what every node of a worker must be started with alike."""
    return (
        ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                    seed=args.seed, enforce_eager=args.enforce_eager),
        CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                    kv_cache_memory_bytes=_gib_to_bytes(args.kv_cache_memory_gb),
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    enable_prefix_caching=not args.no_prefix_caching,
                    kv_offload_bytes=_offload_bytes(args.kv_offload_gb),
                    kv_cache_dtype=args.kv_cache_dtype),
        parallel_config_from_args(args),
        SchedulerConfig(max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_prefills_per_step=args.max_prefills_per_step,
                        async_scheduling=args.async_scheduling),
    )


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                          cpu_threads=args.cpu_threads, device=args.device,
                          enable_expert_parallel=args.enable_expert_parallel,
                          expert_capacity_factor=args.expert_capacity_factor,
                          nnodes=args.nnodes, node_rank=args.node_rank,
                          master_addr=args.master_addr, master_port=args.master_port,
                          dist_timeout_s=args.dist_timeout_s,
                          dist_interface=args.dist_interface,
                          pipeline_parallel_size=args.pipeline_parallel_size,
                          pipeline_micro_batches=args.pipeline_micro_batches,
                          context_parallel_size=args.context_parallel_size)


def _offload_bytes(gib: float) -> int:
    if gib < 0:
        raise ValueError(f"--kv-offload-gb must be >= 0, got {gib}")
    return int(gib * (1 << 30))


def _gib_to_bytes(gib: float | None) -> int | None:
    if gib is None:
        return None
    if gib <= 0:
        raise ValueError(f"--kv-cache-memory-gb must be positive, got {gib}")
    return int(gib * (1 << 30))


def _changed_argv(add_group: Callable[[argparse.ArgumentParser], None],
                  args: argparse.Namespace) -> list[str]:
    """The flags `add_group` declares whose value in `args` is not their default, as a
    command line (each under its first name): read off the declarations themselves, so a
    flag added to a group reaches `pdserve up`'s workers with nothing else to change."""
    parser = argparse.ArgumentParser(add_help=False)
    add_group(parser)
    argv: list[str] = []
    for action in parser._actions:  # argparse keeps its declarations only here
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true, or --x / --no-x (BooleanOptionalAction)
            argv.append(flag if value else action.option_strings[-1])
        elif isinstance(value, list):  # action="append"
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv
