"""`pdserve up`: a whole cluster on one host, for a first look and for end-to-end tests.

Starts the KV store, the workers (prefill + decode, or colocated) and the router as child
processes on loopback, prints one status line per role as it becomes ready, then the URL.
Ctrl-C (or SIGTERM) stops every process it started. Each role is an ordinary `pdserve <role>`
command, so the same flags run one role per machine in a real cluster.

On a GPU host every worker gets its own GPUs through CUDA_VISIBLE_DEVICES in its environment,
handed out in start order from the GPUs this process sees:

    --num-prefill 2 --prefill-tp 2 --num-decode 1, 5 GPUs:
      prefill-0: 0,1    prefill-1: 2,3    decode-0: 4

More ranks than GPUs is an error, unless --allow-gpu-sharing wraps around (each worker then
gets --gpu-memory-utilization divided by the number of workers on its busiest GPU).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.router.server import add_controller_arguments, controller_argv
from pdserve.serve.config import CacheConfig

GPU_QUERY_TIMEOUT_S = 60.0

logger = logging.getLogger(__name__)


@dataclass
class Child:
    role: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Set in the child's environment on top of the launcher's (CUDA_VISIBLE_DEVICES)."""
    cpus: list[int] | None = None
    """The cores the child (and its TP rank processes, which inherit it) runs on; None:
    any of the launcher's."""
    process: subprocess.Popen | None = None
    state: str = "starting"

    def start(self) -> None:
        # A session of its own: Ctrl-C reaches only the launcher, which stops the children
        # in order (router, workers, store), so none waits on a peer that is already gone.
        cpus = self.cpus
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *self.argv], start_new_session=True,
            env={**os.environ, **self.env} if self.env else None,
            # pinned before the child starts any thread (torch's pool is sized at import)
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

    @property
    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None


@dataclass
class Cluster:
    children: list[Child] = field(default_factory=list)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the children in reverse start order, each group waited for in turn."""
        groups = [[c for c in self.children if c.role == "router"],
                  [c for c in self.children if c.role not in ("router", "store")],
                  [c for c in self.children if c.role == "store"]]
        for group in groups:
            running = [c.process for c in group if c.process and c.process.poll() is None]
            for process in running:
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for process in running:
                try:
                    process.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory; default: the "
                        "embedded tiny random-weight Llama (built once and cached)")
    parser.add_argument("--host", default="127.0.0.1", help="router bind address")
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument("--mode", choices=("disagg", "colocated"), default="disagg")
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE models: every worker spreads whole experts over its TP ranks")
    parser.add_argument("--worker-base-port", type=int, default=18100,
                        help="workers listen on consecutive ports from here")
    parser.add_argument("--store-port", type=int, default=18050,
                        help="KV store master port (the data server takes the next one)")
    parser.add_argument("--no-store", action="store_true",
                        help="run without the fleet KV store (prefill still hands its KV to "
                             "decode directly; no shared prefix tier)")
    parser.add_argument("--handoff-dram-gb", type=float, default=None,
                        help="host DRAM of each worker's own hand-off node (default 1; 0: "
                             "hand off through the store)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV blocks per worker (default: sized from memory)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where the workers run (default: cuda when a GPU is found)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=CacheConfig().gpu_memory_utilization,
                        help="each worker's fraction of its GPUs' memory (weights, "
                             "activations, KV cache)")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="KV cache per worker rank in GiB (default: 0.5 on CPU; on GPUs, "
                             "sized by --gpu-memory-utilization)")
    parser.add_argument("--allow-gpu-sharing", action="store_true",
                        help="with more ranks than GPUs, put several workers on one GPU "
                             "(each gets a share of --gpu-memory-utilization) instead of "
                             "failing")
    parser.add_argument("--no-cpu-pinning", action="store_true",
                        help="on a CPU host, let every role float over all cores (default: "
                             "each worker rank gets cores of its own, and the router and "
                             "store get cores the workers do not use where there are more "
                             "than 4)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    add_controller_arguments(parser)


def plan(args: argparse.Namespace, model_dir: str, gpus: list[str] | None = None) -> Cluster:
    """The children `pdserve up` starts, in start order (store, workers, router).

    `gpus`: the CUDA_VISIBLE_DEVICES entries to hand out (None: the GPUs this host has,
    see visible_gpus). Raises ValueError when the workers' ranks do not fit on them."""
    cluster = Cluster()
    store_addr = None
    if args.mode == "disagg" and not args.no_store:
        master_addr = f"tcp://127.0.0.1:{args.store_port}"
        store_addr = f"tcp://127.0.0.1:{args.store_port + 1}"
        cluster.children.append(Child("store", [
            "store", "--role", "all", "--master-port", str(args.store_port),
            "--data-port", str(args.store_port + 1)]))
    router_argv = ["router", "--model", model_dir, "--host", args.host, "--port", str(args.port),
                   *controller_argv(args)]
    if store_addr:
        router_argv += ["--store-master", master_addr]
    port = args.worker_base_port
    roles = ([("colocated", 1, args.prefill_tp)] if args.mode == "colocated" else
             [("prefill", args.num_prefill, args.prefill_tp),
              ("decode", args.num_decode, args.decode_tp)])
    workers = [(role, i, tp) for role, count, tp in roles for i in range(count)]
    device = args.device
    if device != "cpu":
        gpus = visible_gpus() if gpus is None else gpus
        if device == "cuda" and not gpus:
            raise ValueError("--device cuda, but no GPU is visible (nvidia-smi -L lists none, "
                             "or CUDA_VISIBLE_DEVICES is empty)")
        device = "cuda" if gpus else "cpu"
    placement: list[list[str]] = []
    if device == "cuda":
        placement = assign_gpus([tp for _, _, tp in workers], gpus or [],
                                args.allow_gpu_sharing)
    shares = Counter(gpu for worker_gpus in placement for gpu in worker_gpus)
    # On a CPU host each worker rank gets cores of its own (a prefill burst never steals a
    # decode step's core) and as many threads; without pinning, a share of the cores.
    num_ranks = sum(tp for _, _, tp in workers)
    cores = sorted(os.sched_getaffinity(0))
    cpu_threads, worker_cores, service_cores = None, [], None
    if device != "cuda":
        cpu_threads = max(1, len(cores) // num_ranks)
        if not args.no_cpu_pinning:
            worker_cores, service_cores = place_on_cores([tp for _, _, tp in workers], cores)
            if worker_cores:
                cpu_threads = len(worker_cores[0]) // workers[0][2]
    for child in cluster.children:  # the store, started first
        child.cpus = service_cores
    for index, (role, i, tp) in enumerate(workers):
        argv = [role, "--model", model_dir, "--port", str(port),
                "--tensor-parallel-size", str(tp), "--worker-id", f"{role}-{i}"]
        env: dict[str, str] = {}
        if store_addr:
            argv += ["--store", store_addr, "--store-master", master_addr]
        if args.num_kv_blocks:
            argv += ["--num-kv-blocks", str(args.num_kv_blocks)]
        if args.handoff_dram_gb is not None and role != "colocated":
            argv += ["--handoff-dram-gb", str(args.handoff_dram_gb)]
        if args.kv_cache_memory_gb is not None:
            argv += ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
        if args.enable_expert_parallel:
            argv.append("--enable-expert-parallel")
        if cpu_threads is not None:
            argv += ["--cpu-threads", str(cpu_threads)]
        if args.device is not None:
            argv += ["--device", device]
        if placement:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(placement[index])
            num_sharing = max(shares[gpu] for gpu in placement[index])
            argv += ["--gpu-memory-utilization",
                     f"{args.gpu_memory_utilization / num_sharing:.4g}"]
        cluster.children.append(Child(f"{role}-{i}", argv, env,
                                      worker_cores[index] if worker_cores else None))
        router_argv += [f"--{role}", f"tcp://127.0.0.1:{port}"]
        port += 1
    cluster.children.append(Child("router", router_argv, cpus=service_cores))
    return cluster


def place_on_cores(tp_sizes: list[int], cores: list[int]
                   ) -> tuple[list[list[int]], list[int] | None]:
    """Each worker's cores (worker i with TP t takes t equal shares, disjoint from every
    other worker's), and the router's and store's: one core of their own where there are
    more than 4, else None (they float; they need little). ([], None) where the ranks
    outnumber the cores: nothing is pinned."""
    num_ranks = sum(tp_sizes)
    services = cores[-1:] if len(cores) > 4 and len(cores) - 1 >= num_ranks else None
    usable = cores[:-1] if services else cores
    per_rank = len(usable) // num_ranks
    if per_rank == 0:
        return [], None
    placement, start = [], 0
    for tp in tp_sizes:
        placement.append(usable[start:start + tp * per_rank])
        start += tp * per_rank
    return placement, services


def assign_gpus(tp_sizes: list[int], gpus: list[str], allow_sharing: bool = False
                ) -> list[list[str]]:
    """Each worker's GPUs, in order: worker i with TP t takes the next t of `gpus`
    (wrapping around only with allow_sharing; a worker's own ranks never share one)."""
    num_ranks = sum(tp_sizes)
    if num_ranks > len(gpus) and not allow_sharing:
        raise ValueError(
            f"the workers need {num_ranks} GPUs (TP sizes {' + '.join(map(str, tp_sizes))}) "
            f"but {len(gpus)} are visible ({','.join(gpus) or 'none'}): start fewer or "
            "smaller workers, or pass --allow-gpu-sharing to put several workers on a GPU")
    placement, next_gpu = [], 0
    for tp in tp_sizes:
        if tp > len(gpus):
            raise ValueError(f"a worker with TP {tp} needs {tp} GPUs of its own but "
                             f"{len(gpus)} are visible")
        placement.append([gpus[(next_gpu + r) % len(gpus)] for r in range(tp)])
        next_gpu += tp
    return placement


def visible_gpus() -> list[str]:
    """The GPUs children may use, as CUDA_VISIBLE_DEVICES entries: this process's
    CUDA_VISIBLE_DEVICES if set, else one index per GPU that `nvidia-smi -L` lists (without
    nvidia-smi: torch.cuda.device_count() in a subprocess, so the launcher never imports
    torch)."""
    num_gpus = _count_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if num_gpus == 0 or visible is None:
        return [str(i) for i in range(num_gpus)]
    return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]


def _count_gpus() -> int:
    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                     timeout=GPU_QUERY_TIMEOUT_S, check=True).stdout
        except (OSError, subprocess.SubprocessError):  # no driver loaded
            return 0
        return sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S, check=True)
        return int(done.stdout.strip() or 0)
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0


def _poll_states(cluster: Cluster, base_url: str) -> None:
    """Update each child's state from the router's /status (workers) and /health (router)."""
    try:
        status = httpx.get(f"{base_url}/status", timeout=1.0).json()
    except (httpx.HTTPError, ValueError):
        return
    by_id = {w.get("worker_id"): w for w in status.get("workers", [])}
    for child in cluster.children:
        if child.role == "router":
            child.state = "ready" if status.get("ready") else "waiting for workers"
        elif child.role == "store":
            child.state = "ready" if status.get("store_ready", True) else child.state
        elif child.role in by_id:
            child.state = "ready" if by_id[child.role].get("is_ready") else "loading"


def run(args: argparse.Namespace) -> int:
    from pdserve.serve.default_model import DEFAULT_MODEL_NAME, default_model_dir

    if args.model is None:
        model_dir = str(default_model_dir())
        print(f"pdserve up: no --model given: serving {DEFAULT_MODEL_NAME}, a tiny model with "
              f"RANDOM WEIGHTS (its text is gibberish) at {model_dir}", flush=True)
    else:
        model_dir = args.model
        if not (Path(model_dir) / "config.json").is_file():
            print(f"pdserve up: {model_dir} is not a checkpoint directory (no config.json)",
                  file=sys.stderr)
            return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness polls
    try:
        cluster = plan(args, model_dir)
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    base_url = f"http://{args.host}:{args.port}"
    # SIGINT too: a shell starts background jobs with SIGINT ignored, and `kill -INT` must
    # still stop the cluster.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for child in cluster.children:
            child.start()
            gpus = child.env.get("CUDA_VISIBLE_DEVICES")
            on = f", GPUs {gpus}" if gpus is not None else ""
            print(f"  {child.role:<12} starting (pid {child.process.pid}{on})", flush=True)
        deadline = time.monotonic() + args.ready_timeout_s
        shown = {c.role: "starting" for c in cluster.children}
        while True:
            dead = [c for c in cluster.children if c.exited]
            if dead:
                print(f"pdserve up: {dead[0].role} exited with code "
                      f"{dead[0].process.returncode}; stopping", file=sys.stderr, flush=True)
                return 1
            _poll_states(cluster, base_url)
            for child in cluster.children:
                if child.state != shown[child.role]:
                    shown[child.role] = child.state
                    print(f"  {child.role:<12} {child.state}", flush=True)
            if all(c.state == "ready" for c in cluster.children):
                break
            if time.monotonic() > deadline:
                print("pdserve up: not ready in time; stopping", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        print(f"pdserve is ready: {base_url}/v1  (Ctrl-C stops it)", flush=True)
        while not any(c.exited for c in cluster.children):
            time.sleep(0.5)
        dead = next(c for c in cluster.children if c.exited)
        print(f"pdserve up: {dead.role} exited; stopping", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("pdserve up: stopping", flush=True)
        return 0
    finally:
        cluster.stop()
