"""The children `pdserve up` starts, each an ordinary `pdserve <role>` command line built
from the launcher's flags: the store, the workers, then the router that knows them all.

The flags a pool of workers shares (pdserve/serve/worker/args.py) and the router's own groups
(pdserve/router/server.py) pass through unchanged; what differs per worker (its port, its share of
the GPUs or cores) comes from placement.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdserve import discovery
from pdserve.app.launcher.placement import Placement, WorkerPlace, WorkerSlot, place_workers
from pdserve.app.launcher.supervision import Child, Cluster
from pdserve.router.server import (
    controller_argv,
    max_tokens_argv,
    routing_argv,
    tool_argv,
    tracing_argv,
)
from pdserve.serve.worker.args import (
    cache_argv,
    expert_argv,
    handoff_argv,
    model_argv,
    scheduler_argv,
    sim_config_from_args,
)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class StoreAddresses:
    master: str
    data: str


def plan(args: argparse.Namespace, model_dir: str, gpus: list[str] | None = None,
         run_dir: Path | None = None) -> Cluster:
    """The children `pdserve up` starts, in start order (store, workers, router).

    `gpus`: the CUDA_VISIBLE_DEVICES entries to hand out (None: the GPUs this host has,
    see placement.visible_gpus). Raises ValueError when the workers' ranks do not fit on
    them, or a flag is refused here rather than by every child at start.
    `run_dir`: where the decode workers publish whether they are idle, for the prefill
    workers that borrow their cores (None: no core lending)."""
    check_flags(args)
    slots = worker_slots(args)
    placement = place_workers(args, slots, gpus, run_dir)
    cluster = Cluster()
    store = None
    if not args.no_store:  # colocated too: the tier below each worker's host DRAM
        store = StoreAddresses(f"tcp://{LOOPBACK}:{args.store_port}",
                               f"tcp://{LOOPBACK}:{args.store_port + 1}")
        cluster.children.append(store_child(args, placement.service_cores))
    for offset, (slot, place) in enumerate(zip(slots, placement.workers, strict=True)):
        port = args.worker_base_port + offset
        cluster.children.append(Child(
            slot.name, worker_argv(args, model_dir, slot, place, placement, port, store),
            place.env, place.cpus, ports=[(LOOPBACK, port)],
            fork=getattr(args, "engine", "torch") == "sim"))
    workers = cluster.children[1 if store else 0:]
    cluster.children.append(Child(
        "router", router_argv(args, model_dir, workers, store), cpus=placement.service_cores,
        ports=[(args.host, args.port)]))
    if args.discovery is not None:  # every child registers too (pdserve/discovery.py)
        for child in cluster.children:
            child.argv += ["--discovery", args.discovery,
                           "--discovery-ttl-s", str(args.discovery_ttl_s),
                           *discovery.access_argv(args)]
    if args.advertise_address is not None:  # one host: every child is reached there
        for child in cluster.children:
            child.argv += ["--advertise-address", args.advertise_address]
    return cluster


def check_flags(args: argparse.Namespace) -> None:
    """What every worker would refuse at start, refused once, before anything starts."""
    if args.speculative_config is not None:
        from pdserve.serve.config import SpeculativeConfig

        SpeculativeConfig.parse(args.speculative_config)
    sim_config_from_args(args)
    per_step = args.prefill_max_prefills_per_step
    if per_step is not None and per_step < 0:
        raise ValueError("--prefill-max-prefills-per-step must be >= 0 (0: no limit)")


def worker_slots(args: argparse.Namespace) -> list[WorkerSlot]:
    """The workers in start order: one colocated worker, or the prefill then the decode
    workers."""
    if args.mode == "colocated":
        return [WorkerSlot("colocated", 0, args.prefill_tp, args.prefill_pp)]
    return ([WorkerSlot("prefill", i, args.prefill_tp, args.prefill_pp)
             for i in range(args.num_prefill)]
            + [WorkerSlot("decode", i, args.decode_tp, args.decode_pp)
               for i in range(args.num_decode)])


def store_child(args: argparse.Namespace, cpus: list[int] | None) -> Child:
    """Master and data server in one process, on --store-port and the next port."""
    master_port, data_port = args.store_port, args.store_port + 1
    return Child("store", ["store", "--role", "all", "--master-port", str(master_port),
                           "--data-port", str(data_port)],
                 cpus=cpus, ports=[(LOOPBACK, master_port), (LOOPBACK, data_port)])


def worker_argv(args: argparse.Namespace, model_dir: str, slot: WorkerSlot,
                place: WorkerPlace, placement: Placement, port: int,
                store: StoreAddresses | None) -> list[str]:
    argv = [slot.role, "--model", model_dir, "--port", str(port),
            "--tensor-parallel-size", str(slot.tp), "--worker-id", slot.name]
    if slot.pp > 1:
        argv += ["--pipeline-parallel-size", str(slot.pp)]
    if store is not None:
        argv += ["--store", store.data, "--store-master", store.master]
    argv += [*model_argv(args), *expert_argv(args), *cache_argv(args), *scheduler_argv(args)]
    if slot.role != "colocated":
        argv += handoff_argv(args)
    if slot.role == "prefill" and getattr(args, "engine", "torch") != "sim":
        per_step = prefill_steps(args, placement.device)
        if per_step is not None:
            argv += ["--max-prefills-per-step", str(per_step)]
    if place.cpu_threads is not None:
        argv += ["--cpu-threads", str(place.cpu_threads)]
    argv += place.argv
    if args.device is not None:
        argv += ["--device", placement.device]
    if place.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", f"{place.gpu_memory_utilization:.4g}"]
    return argv


def prefill_steps(args: argparse.Namespace, device: str) -> int | None:
    """A prefill worker's --max-prefills-per-step: as asked, else 1 on a CPU host, where a
    prefill is compute-bound and batching prompts only delays the first (None: the
    worker's default)."""
    if args.prefill_max_prefills_per_step is not None:
        return args.prefill_max_prefills_per_step
    return 1 if device != "cuda" else None


def router_argv(args: argparse.Namespace, model_dir: str, workers: list[Child],
                store: StoreAddresses | None) -> list[str]:
    argv = ["router", "--model", model_dir, "--host", args.host, "--port", str(args.port),
            *routing_argv(args), *controller_argv(args), *max_tokens_argv(args),
            *tracing_argv(args),
            *tool_argv(args)]
    if args.api_key is not None:
        argv += ["--api-key", args.api_key]
    if args.ops_need_api_key:
        argv.append("--ops-need-api-key")
    if store is not None:
        argv += ["--store-master", store.master]
    for worker in workers:
        role = worker.argv[0]
        argv += [f"--{role}", f"tcp://{LOOPBACK}:{worker.ports[0][1]}"]
    return argv
