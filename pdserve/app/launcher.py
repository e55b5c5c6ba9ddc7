"""`pdserve up`: a whole cluster on one host, for a first look and for end-to-end tests.

Starts the KV store, the workers (prefill + decode, or colocated) and the router as child
processes on loopback, prints one status line per role as it becomes ready, then the URL.
Each role is an ordinary `pdserve <role>` command, so the same flags run one role per machine
in a real cluster.

It supervises them: a child that dies is restarted after a backoff (logged, and counted in
the router's /metrics as pdserve:process_restarts_total) while the others keep serving. It
stops everything only on Ctrl-C or SIGTERM (each role gets a few seconds to drain, then is
killed), or when one role keeps failing at start (RestartPolicy). Children die with it even
when it is SIGKILLed (pdserve/lifecycle.py), and a port some other process holds is named
before anything starts.

On a GPU host every worker gets its own GPUs through CUDA_VISIBLE_DEVICES in its environment,
handed out in start order from the GPUs this process sees:

    --num-prefill 2 --prefill-tp 2 --num-decode 1, 5 GPUs:
      prefill-0: 0,1    prefill-1: 2,3    decode-0: 4

More ranks than GPUs is an error, unless --allow-gpu-sharing wraps around (each worker then
gets --gpu-memory-utilization divided by the number of workers on its busiest GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve import discovery, security
from pdserve.lifecycle import parent_death_preexec
from pdserve.ports import PortInUse, check_port_free
from pdserve.router.server import (
    add_controller_arguments,
    add_max_tokens_arguments,
    add_tool_arguments,
    add_tracing_arguments,
    controller_argv,
    max_tokens_argv,
    tool_argv,
    tracing_argv,
)
from pdserve.serve.config import KV_CACHE_DTYPES, CacheConfig
from pdserve.serve.cpu.core_share import parse_core_list

GPU_QUERY_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0
"""How long each group of children may drain after SIGTERM before it is killed."""

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
    ports: list[tuple[str, int]] = field(default_factory=list)
    """(host, port) the child listens on: checked free before the cluster starts."""
    process: subprocess.Popen | None = None
    state: str = "starting"
    started_s: float = 0.0
    """time.monotonic() of the last start."""
    num_restarts: int = 0
    num_start_failures: int = 0
    """Exits within the start window in a row (RestartPolicy)."""
    restart_at_s: float | None = None
    """When a dead child is due to start again (None: not waiting to)."""

    def start(self) -> None:
        # A session of its own: Ctrl-C reaches only the launcher, which stops the children
        # in order (router, workers, store), so none waits on a peer that is already gone.
        # The parent-death signal and PDSERVE_LAUNCHER_PID make it die with the launcher.
        cpus = self.cpus
        # pinned before the child starts any thread (torch's pool is sized at import)
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.app.cli", *self.argv], start_new_session=True,
            env={**os.environ, **self.env, "PDSERVE_LAUNCHER_PID": str(os.getpid())},
            preexec_fn=parent_death_preexec(os.getpid(), pin))
        self.started_s = time.monotonic()
        self.state = "starting"
        self.restart_at_s = None

    @property
    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0
    """Wait before restarting a child that died; doubled for each failure at start in a
    row, up to max_backoff_s."""
    max_backoff_s: float = 30.0
    start_window_s: float = 60.0
    """A child that exits within this long of its start failed at start."""
    max_start_failures: int = 3
    """A role that fails at start this many times in a row stops the cluster."""

    def __post_init__(self) -> None:
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("need 0 <= backoff_s <= max_backoff_s")
        if self.start_window_s < 0 or self.max_start_failures < 1:
            raise ValueError("need start_window_s >= 0 and max_start_failures >= 1")


class RoleKeepsFailing(RuntimeError):
    """A role failed at start RestartPolicy.max_start_failures times in a row."""

    def __init__(self, child: Child, message: str) -> None:
        super().__init__(message)
        self.child = child


class Supervisor:
    """Restarts dead children by `policy`, counting restarts in a JSON file the router
    exports (router/metrics.py SupervisorCollector)."""

    def __init__(self, cluster: Cluster, policy: RestartPolicy, state_path: Path,
                 say: Callable[[str], None],
                 kill_group: Callable[[int], None] | None = None) -> None:
        """`kill_group(pid)` ends what a dead child left in its process group (default:
        SIGKILL to the group)."""
        self.cluster, self.policy, self.state_path, self.say = cluster, policy, state_path, say
        self.kill_group = kill_group or _kill_group
        self.write_state()

    def check(self, now_s: float) -> None:
        """Restart the children that are due; schedule a restart for each that died.
        Raises RoleKeepsFailing."""
        policy = self.policy
        for child in self.cluster.children:
            if child.restart_at_s is not None:
                if now_s >= child.restart_at_s:
                    child.start()
                    child.num_restarts += 1
                    self.write_state()
                    self.say(f"  {child.role:<12} restarted (pid {child.process.pid}, "
                             f"restart {child.num_restarts})")
                continue
            if not child.exited:
                continue
            self.kill_group(child.process.pid)  # what it left behind (TP ranks) goes too
            ran_s = now_s - child.started_s
            if ran_s < policy.start_window_s:
                child.num_start_failures += 1
            else:
                child.num_start_failures = 0
            code = child.process.returncode
            if child.num_start_failures >= policy.max_start_failures:
                raise RoleKeepsFailing(
                    child, f"{child.role} exited (code {code}) {child.num_start_failures} "
                    f"times in a row within {policy.start_window_s:.0f} s of starting")
            delay_s = min(policy.backoff_s * 2 ** max(child.num_start_failures - 1, 0),
                          policy.max_backoff_s)
            child.restart_at_s = now_s + delay_s
            child.state = "restarting"
            self.say(f"pdserve up: {child.role} exited with code {code} after {ran_s:.1f} s; "
                     f"restarting in {delay_s:.1f} s")

    def write_state(self) -> None:
        """Replaced whole (os.replace), so a reader never sees half a file."""
        restarts = {c.role: c.num_restarts for c in self.cluster.children}
        partial = self.state_path.with_suffix(".partial")
        partial.write_text(json.dumps({"restarts": restarts}))
        os.replace(partial, self.state_path)


@dataclass
class Cluster:
    children: list[Child] = field(default_factory=list)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the children in reverse start order, each group waited for in turn; a
        child still running grace_s later is killed with its whole process group (its TP
        ranks too)."""
        groups = [[c for c in self.children if c.role == "router"],
                  [c for c in self.children if c.role not in ("router", "store")],
                  [c for c in self.children if c.role == "store"]]
        for group in groups:
            running = [c.process for c in group if c.process and c.process.poll() is None]
            for process in running:
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for process in running:
                try:
                    process.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    logger.warning("pid %d still running %.0f s after SIGTERM: killing it",
                                   process.pid, grace_s)
                    _kill_group(process.pid)
                    process.wait(5)


def _kill_group(pid: int) -> None:
    """SIGKILL the process group a child leads (each child starts its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left in it
        pass


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
    parser.add_argument("--prefill-pp", type=int, default=1,
                        help="pipeline stages of each prefill (or colocated) worker")
    parser.add_argument("--decode-pp", type=int, default=1,
                        help="pipeline stages of each decode worker")
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
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="every worker's KV cache: auto (the model dtype) or fp8 "
                             "(float8_e4m3fn: half the bytes stored and handed off)")
    parser.add_argument("--prefill-max-prefills-per-step", type=int, default=None,
                        metavar="N",
                        help="prompts a prefill worker computes in one step (0: as many as "
                             "its token budget holds; default: 1 on a CPU host, where a "
                             "prefill is compute-bound and batching prompts only delays the "
                             "first, else 0)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="every worker recomputes every prompt (no prefix-cache hits): "
                             "for benchmarks that send the same prompts more than once")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='every worker\'s speculative decoding, as vLLM: \'{"method": '
                             '"mtp", "num_speculative_tokens": 1}\' (DeepSeek-V3\'s MTP layer '
                             'drafts; a prefill worker loads it for a role flip)')
    parser.add_argument("--allow-gpu-sharing", action="store_true",
                        help="with more ranks than GPUs, put several workers on one GPU "
                             "(each gets a share of --gpu-memory-utilization) instead of "
                             "failing")
    parser.add_argument("--no-cpu-pinning", action="store_true",
                        help="on a CPU host, let every role float over all cores (default: "
                             "each worker rank gets cores of its own, and the router and "
                             "store get a core the workers do not use where there are more "
                             "than 4, else share the cores of the decode or colocated "
                             "workers, never a prefill's, and never the first core of a "
                             "one-rank worker on several: its main thread's)")
    for role in ("prefill", "decode"):
        parser.add_argument(f"--{role}-cores", type=parse_core_list, default=None,
                            metavar="LIST",
                            help=f"on a CPU host, the cores the {role} workers run on, shared "
                                 "out among their ranks, with as many threads (default: "
                                 "cores of their own, see --no-cpu-pinning). Prefill and "
                                 "decode cores may overlap: both then share them, the "
                                 "overlapping ranks' threads waiting passively")
    parser.add_argument("--no-core-lending", action="store_true",
                        help="on a CPU host, disaggregated: keep each worker on its own "
                             "cores (default: while a decode worker holds no request, a "
                             "one-rank prefill worker runs on its cores too, checked before "
                             "each layer; and while that prefill worker holds none, a "
                             "one-rank decode worker paired with it alone runs on its cores, "
                             "checked before each step)")
    parser.add_argument("--service-cores", type=parse_core_list, default=None,
                        metavar="LIST",
                        help="on a CPU host, the cores the router and store run on, e.g. "
                             "'1' or '6-7' (default: see --no-cpu-pinning)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    discovery.add_arguments(parser)  # optional: `pdserve up` itself needs no etcd
    parser.add_argument("--api-key", default=None,
                        help="the router requires `Authorization: Bearer KEY` on /v1")
    parser.add_argument("--ops-need-api-key", action="store_true",
                        help="/metrics and /status need the API key too")
    parser.add_argument("--cluster-key-file", default=None, metavar="FILE",
                        help="the key of the internal sockets (CurveZMQ), given to every "
                             "child; written there when missing (default: a fresh key in a "
                             "private directory, gone when pdserve up stops)")
    parser.add_argument("--insecure-plaintext", action="store_true",
                        help="internal sockets unauthenticated and unencrypted (logged loudly)")
    policy = RestartPolicy()
    group = parser.add_argument_group("supervision")
    group.add_argument("--restart-backoff-s", type=float, default=policy.backoff_s,
                       help="wait before restarting a child that died (doubled for each "
                            "failure at start in a row)")
    group.add_argument("--start-window-s", type=float, default=policy.start_window_s,
                       help="a child that exits within this long of starting failed at start")
    group.add_argument("--max-start-failures", type=int, default=policy.max_start_failures,
                       help="stop the cluster when one role fails at start this many times "
                            "in a row")
    add_max_tokens_arguments(parser)
    add_controller_arguments(parser)
    add_tracing_arguments(parser)
    add_tool_arguments(parser)


def plan(args: argparse.Namespace, model_dir: str, gpus: list[str] | None = None,
         run_dir: Path | None = None) -> Cluster:
    """The children `pdserve up` starts, in start order (store, workers, router).

    `gpus`: the CUDA_VISIBLE_DEVICES entries to hand out (None: the GPUs this host has,
    see visible_gpus). Raises ValueError when the workers' ranks do not fit on them.
    `run_dir`: where the decode workers publish whether they are idle, for the prefill
    workers that borrow their cores (None: no core lending)."""
    if args.speculative_config is not None:  # refused here, not by every worker at start
        from pdserve.serve.engine.spec_decode import SpeculativeConfig

        SpeculativeConfig.parse(args.speculative_config)
    cluster = Cluster()
    store_addr = None
    if args.mode == "disagg" and not args.no_store:
        master_addr = f"tcp://127.0.0.1:{args.store_port}"
        store_addr = f"tcp://127.0.0.1:{args.store_port + 1}"
        cluster.children.append(Child("store", [
            "store", "--role", "all", "--master-port", str(args.store_port),
            "--data-port", str(args.store_port + 1)],
            ports=[("127.0.0.1", args.store_port), ("127.0.0.1", args.store_port + 1)]))
    router_argv = ["router", "--model", model_dir, "--host", args.host, "--port", str(args.port),
                   *controller_argv(args), *max_tokens_argv(args), *tracing_argv(args),
                   *tool_argv(args)]
    if args.api_key is not None:
        router_argv += ["--api-key", args.api_key]
    if args.ops_need_api_key:
        router_argv.append("--ops-need-api-key")
    if store_addr:
        router_argv += ["--store-master", master_addr]
    port = args.worker_base_port
    roles = ([("colocated", 1, args.prefill_tp, args.prefill_pp)] if args.mode == "colocated"
             else [("prefill", args.num_prefill, args.prefill_tp, args.prefill_pp),
                   ("decode", args.num_decode, args.decode_tp, args.decode_pp)])
    # (role, index, TP, PP): a worker runs TP x PP ranks, each placed like a TP rank
    workers = [(role, i, tp, pp) for role, count, tp, pp in roles for i in range(count)]
    device = args.device
    if device != "cpu":
        gpus = visible_gpus() if gpus is None else gpus
        if device == "cuda" and not gpus:
            raise ValueError("--device cuda, but no GPU is visible (nvidia-smi -L lists none, "
                             "or CUDA_VISIBLE_DEVICES is empty)")
        device = "cuda" if gpus else "cpu"
    placement: list[list[str]] = []
    if device == "cuda":
        placement = assign_gpus([tp * pp for _, _, tp, pp in workers], gpus or [],
                                args.allow_gpu_sharing)
    shares = Counter(gpu for worker_gpus in placement for gpu in worker_gpus)
    # On a CPU host each worker rank gets cores of its own (a prefill burst never steals a
    # decode step's core) and as many threads; without pinning, a share of the cores.
    num_ranks = sum(tp * pp for _, _, tp, pp in workers)
    cores = sorted(os.sched_getaffinity(0))
    worker_cores: list[list[int] | None] = [None] * len(workers)
    service_cores = None
    bound: dict[int, list[int]] = {}  # worker -> its cores, its main thread's first
    if device != "cuda" and not args.no_cpu_pinning:
        placed, service_cores = place_on_cores([tp * pp for _, _, tp, pp in workers], cores)
        worker_cores = list(placed) or worker_cores
        for role in ("prefill", "decode"):
            chosen = getattr(args, f"{role}_cores", None)
            if chosen is None or args.mode == "colocated":
                continue
            index = [i for i, (r, *_) in enumerate(workers) if r == role]
            shares = split_cores([workers[i][2] * workers[i][3] for i in index], chosen)
            if not shares:
                raise ValueError(f"--{role}-cores {','.join(map(str, chosen))}: fewer cores "
                                 f"than the {role} workers' {len(index)} worker(s) have ranks")
            for i, share in zip(index, shares, strict=True):
                worker_cores[i] = share
        if service_cores is None:
            # No core to spare: the services share the cores of the workers that stream
            # tokens (decode's, or the colocated worker's), never a prefill's: a prefill's
            # TTFT is its compute, and on 2 cores the router and store floating onto the
            # prefill core cost it (llama-mid-like, 8 req/s: benchmarks/results/README.md).
            hosts = [i for i, (role, *_) in enumerate(workers)
                     if role in ("decode", "colocated") and worker_cores[i]]
            service_cores, main_cores = share_with_services(
                [worker_cores[i] or [] for i in hosts],
                [workers[i][2] * workers[i][3] for i in hosts])
            bound = {hosts[k]: cores for k, cores in main_cores.items()}
        if args.service_cores is not None:
            service_cores, bound = args.service_cores, {}
    # Threads per rank: its cores where pinned, else a share of the host's.
    cpu_threads = [None if device == "cuda" else
                   max(1, len(cpus) // (tp * pp) if cpus else len(cores) // num_ranks)
                   for (_, _, tp, pp), cpus in zip(workers, worker_cores, strict=True)]
    # Workers whose cores overlap wait passively at their OpenMP barriers: a spinning
    # prefill thread would take the decode step's core it only borrows.
    overlapping = {i for i, a in enumerate(worker_cores) for j, b in enumerate(worker_cores)
                   if i != j and a and b and set(a) & set(b)}
    lending, start_cores = (
        lend_idle_cores(workers, worker_cores, run_dir)
        if run_dir is not None and args.mode == "disagg" and not args.no_core_lending
        else ({}, {}))
    for child in cluster.children:  # the store, started first
        child.cpus = service_cores
    for index, (role, i, tp, pp) in enumerate(workers):
        argv = [role, "--model", model_dir, "--port", str(port),
                "--tensor-parallel-size", str(tp), "--worker-id", f"{role}-{i}"]
        if pp > 1:
            argv += ["--pipeline-parallel-size", str(pp)]
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
        if args.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype", args.kv_cache_dtype]
        if args.no_prefix_caching:
            argv.append("--no-prefix-caching")
        if role == "prefill":
            per_step = args.prefill_max_prefills_per_step
            if per_step is not None and per_step < 0:
                raise ValueError("--prefill-max-prefills-per-step must be >= 0 (0: no limit)")
            if per_step is None and device != "cuda":
                per_step = 1  # 8 req/s on llama-mid-like, 2 cores: mean TTFT -18%, p99 -30%
            if per_step is not None:
                argv += ["--max-prefills-per-step", str(per_step)]
        if args.speculative_config is not None:
            argv += ["--speculative-config", args.speculative_config]
        if cpu_threads[index] is not None:
            argv += ["--cpu-threads", str(cpu_threads[index])]
        if index in overlapping:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        if index in bound:
            # OpenMP thread i on core i (libgomp): the main thread, which runs the engine's
            # Python between a step's parallel regions, on the core the services leave it;
            # the worker's ZeroMQ I/O thread on the others, beside the services
            env["GOMP_CPU_AFFINITY"] = ",".join(map(str, bound[index]))
            env["PDSERVE_IO_CORES"] = ",".join(map(str, bound[index][1:]))
        argv += lending.get(index, [])
        if "--borrow-idle-cores" in lending.get(index, []):
            # A borrower gives a core back between two layers or steps, and the thread left
            # on it waits in OpenMP's pool. Spinning there for libgomp's default count (300k
            # rounds, milliseconds on some hosts) it held the lender's core after the lender
            # took it back: with both roles borrowing, 2 cores, 2 req/s, TTFT rose 51 ->
            # 63-65 ms and the router, which shares decode's core, sent tokens in bunches
            # (ITL median 0.02 ms, p99 96-102). A forward's parallel regions follow each other
            # within microseconds: a short spin still covers them.
            env["GOMP_SPINCOUNT"] = "20000"
        if args.device is not None:
            argv += ["--device", device]
        if placement:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(placement[index])
            num_sharing = max(shares[gpu] for gpu in placement[index])
            argv += ["--gpu-memory-utilization",
                     f"{args.gpu_memory_utilization / num_sharing:.4g}"]
        cluster.children.append(Child(f"{role}-{i}", argv, env,
                                      start_cores.get(index, worker_cores[index]),
                                      ports=[("127.0.0.1", port)]))
        router_argv += [f"--{role}", f"tcp://127.0.0.1:{port}"]
        port += 1
    cluster.children.append(Child("router", router_argv, cpus=service_cores,
                                  ports=[(args.host, args.port)]))
    if args.discovery is not None:  # every child registers too (pdserve/discovery.py)
        for child in cluster.children:
            child.argv += ["--discovery", args.discovery,
                           "--discovery-ttl-s", str(args.discovery_ttl_s)]
    return cluster


def lend_idle_cores(workers: list[tuple[str, int, int, int]],
                    worker_cores: list[list[int] | None], run_dir: Path
                    ) -> tuple[dict[int, list[str]], dict[int, list[int]]]:
    """Core lending (serve/cpu/core_share.py): decode worker j lends its cores to one-rank prefill
    worker j mod (their number) while it holds no request; and where that pair is one to one
    (the prefill borrows from no other decode worker) and the decode worker is one rank too,
    the prefill worker lends its cores back while it holds no request. Only pinned workers
    whose cores do not overlap take part. Returns each worker's flags, and each borrower's
    cores to start on: its own and the lent ones (OpenMP sizes its waits from the cores it
    starts with; the worker narrows itself to its own at once)."""
    decode = [i for i, (role, *_) in enumerate(workers) if role == "decode"]
    borrowers = [i for i, (role, _, tp, pp) in enumerate(workers)
                 if role == "prefill" and tp * pp == 1]
    pairs = []  # (lender, borrower)
    for j, lender in enumerate(decode):
        if not borrowers:
            break
        borrower = borrowers[j % len(borrowers)]
        cores, own = worker_cores[lender], worker_cores[borrower]
        if cores and own and not set(cores) & set(own):
            pairs.append((lender, borrower))
    # the other way: a prefill lends to the one decode worker it borrows from (two decode
    # workers borrowing one prefill's cores would share them)
    partners = Counter(borrower for _, borrower in pairs)
    pairs += [(prefill, decoder) for decoder, prefill in pairs
              if partners[prefill] == 1 and workers[decoder][2] * workers[decoder][3] == 1]
    flags: dict[int, list[str]] = {}
    start_cores: dict[int, list[int]] = {}
    for lender, borrower in pairs:
        cores, own = worker_cores[lender] or [], worker_cores[borrower] or []
        path = run_dir / f"{workers[lender][0]}-{workers[lender][1]}.idle"
        flags.setdefault(lender, []).extend(["--lend-idle-flag", str(path)])
        flags.setdefault(borrower, []).extend(
            ["--borrow-idle-cores", f"{','.join(map(str, cores))}@{path}"])
        start_cores[borrower] = sorted({*start_cores.get(borrower, own), *cores})
    return flags, start_cores


def place_on_cores(tp_sizes: list[int], cores: list[int]
                   ) -> tuple[list[list[int]], list[int] | None]:
    """Each worker's cores (worker i with TP t takes t equal shares, disjoint from every
    other worker's), and the router's and store's: one core of their own where there are
    more than 4, else None (they float; they need little). ([], None) where the ranks
    outnumber the cores: nothing is pinned."""
    num_ranks = sum(tp_sizes)
    services = cores[-1:] if len(cores) > 4 and len(cores) - 1 >= num_ranks else None
    usable = cores[:-1] if services else cores
    placement = split_cores(tp_sizes, usable)
    return (placement, services) if placement else ([], None)


def share_with_services(host_cores: list[list[int]], ranks: list[int]
                        ) -> tuple[list[int] | None, dict[int, list[int]]]:
    """Where the router and store have no core of their own: the cores they share with the
    workers that stream tokens (`host_cores`, each with `ranks` ranks), and which of those
    workers keep their first core to their main thread ({index: its cores}).

    A one-rank worker on several cores runs its engine's Python (scheduling, sampling,
    detokenizing, sending each token) on its main thread between a step's parallel regions,
    while its other threads wait. A router woken by a token then displaces the main thread
    or a waiting one, as the scheduler happens to place it; the token's next step waits
    for it only in the first case. So such a worker keeps its first core: the services
    share its others (llama-mid-like, colocated on 2 cores, 2 req/s: mean TPOT 2.28-2.48 ->
    2.06 ms, benchmarks/results/README.md). A worker of one core, or of several ranks,
    shares all of its cores, as before. (None, {}) where there are no such cores."""
    shared: set[int] = set()
    main_cores: dict[int, list[int]] = {}
    for k, (cores, num_ranks) in enumerate(zip(host_cores, ranks, strict=True)):
        if num_ranks == 1 and len(cores) > 1:
            main_cores[k] = list(cores)
            shared.update(cores[1:])
        else:
            shared.update(cores)
    return (sorted(shared) or None), main_cores


def split_cores(tp_sizes: list[int], cores: list[int]) -> list[list[int]]:
    """Each worker's share of `cores` (worker i with TP t takes t equal shares, disjoint from
    the others'); [] where the ranks outnumber the cores."""
    num_ranks = sum(tp_sizes)
    per_rank = len(cores) // num_ranks
    if per_rank == 0:
        return []
    placement, start = [], 0
    for tp in tp_sizes:
        placement.append(cores[start:start + tp * per_rank])
        start += tp * per_rank
    return placement


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


def _poll_states(cluster: Cluster, base_url: str, headers: dict[str, str]) -> None:
    """Update each child's state from the router's /status (workers) and /health (router)."""
    try:
        status = httpx.get(f"{base_url}/status", headers=headers, timeout=1.0).json()
    except (httpx.HTTPError, ValueError):
        return
    by_id = {w.get("worker_id"): w for w in status.get("workers", [])}
    for child in cluster.children:
        if child.restart_at_s is not None or child.exited:
            continue  # "restarting" until it runs again
        if child.role == "router":
            child.state = "ready" if status.get("ready") else "waiting for workers"
        elif child.role == "store":
            child.state = "ready" if status.get("store_ready", True) else child.state
        elif child.role in by_id:
            child.state = "ready" if by_id[child.role].get("is_ready") else "loading"


def _ports_in_use(children: list[Child]) -> list[PortInUse]:
    """Each port one of `children` would listen on that another process holds (named where
    /proc shows it)."""
    taken = []
    for child in children:
        for host, port in child.ports:
            try:
                check_port_free(host, port)
            except PortInUse as exc:
                taken.append(exc)
            except OSError:  # e.g. a privileged port: the child itself will say
                continue
    return taken


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
        policy = RestartPolicy(backoff_s=args.restart_backoff_s,
                               max_backoff_s=max(args.restart_backoff_s, 30.0),
                               start_window_s=args.start_window_s,
                               max_start_failures=args.max_start_failures)
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as run_dir:
        try:
            cluster = plan(args, model_dir, run_dir=Path(run_dir))
        except ValueError as exc:
            print(f"pdserve up: {exc}", file=sys.stderr)
            return 2
        taken = _ports_in_use(cluster.children)
        if taken:
            for exc in taken:
                print(f"pdserve up: {exc}", file=sys.stderr)
            return 2
        try:
            provide_cluster_key(args, Path(run_dir))
        except (security.ClusterKeyError, OSError) as exc:
            print(f"pdserve up: {exc}", file=sys.stderr)
            return 2
        state_path = Path(run_dir) / "supervisor.json"
        router = next(c for c in cluster.children if c.role == "router")
        router.argv += ["--supervisor-state-file", str(state_path)]
        return _supervise(args, cluster, Supervisor(cluster, policy, state_path, _say))


def provide_cluster_key(args: argparse.Namespace, run_dir: Path) -> None:
    """Every child inherits PDSERVE_CLUSTER_KEY_FILE (or, asked for, plaintext): the key of
    --cluster-key-file, made there if missing, else a fresh one in the private run dir."""
    if args.insecure_plaintext:
        os.environ[security.PLAINTEXT_ENV] = "1"
        os.environ.pop(security.KEY_FILE_ENV, None)
        _say("pdserve up: INSECURE: internal sockets in plaintext (--insecure-plaintext)")
        return
    path = Path(args.cluster_key_file or run_dir / "cluster.key")
    if path.exists():
        security.ClusterKey.load(path)  # fail here, not in every child
    else:
        security.ClusterKey.generate().save(path)
    os.environ[security.KEY_FILE_ENV] = str(path)


def _say(line: str) -> None:
    print(line, flush=True)


def _supervise(args: argparse.Namespace, cluster: Cluster, supervisor: Supervisor) -> int:
    """Start the children, report their states, restart the dead, until Ctrl-C/SIGTERM
    (exit 0) or a role that keeps failing at start or a cluster not ready in time (1)."""
    base_url = f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
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
        is_ready = False
        while True:
            supervisor.check(time.monotonic())
            if any(c.state != "ready" for c in cluster.children):  # none to ask otherwise
                _poll_states(cluster, base_url, headers)
            for child in cluster.children:
                if child.state != shown[child.role]:
                    shown[child.role] = child.state
                    print(f"  {child.role:<12} {child.state}", flush=True)
            if not is_ready and all(c.state == "ready" for c in cluster.children):
                is_ready = True
                print(f"pdserve is ready: {base_url}/v1  (Ctrl-C stops it)", flush=True)
            if not is_ready and time.monotonic() > deadline:
                print("pdserve up: not ready in time; stopping", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
    except RoleKeepsFailing as exc:
        print(f"pdserve up: {exc}; stopping", file=sys.stderr, flush=True)
        for taken in _ports_in_use([exc.child]):  # the likeliest reason it cannot start
            print(f"pdserve up: {taken}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("pdserve up: stopping", flush=True)
        return 0
    finally:
        # A second Ctrl-C or SIGTERM must not cut the stop short and leave children behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
