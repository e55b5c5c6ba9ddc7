"""Where `pdserve up`'s workers run: their GPUs on a GPU host, their cores on a CPU host.

On a GPU host every worker gets GPUs of its own through CUDA_VISIBLE_DEVICES, handed out in
start order from the GPUs this process sees:

    --num-prefill 2 --prefill-tp 2 --num-decode 1, 5 GPUs:
      prefill-0: 0,1    prefill-1: 2,3    decode-0: 4

More ranks than GPUs is an error, unless --allow-gpu-sharing wraps around (each worker then
gets --gpu-memory-utilization divided by the number of workers on its busiest GPU).

On a CPU host every worker rank gets cores of its own and as many threads (a prefill burst
never steals a decode step's core); the router and store get a core of their own where
there are more than 4, else share the cores of the workers that stream tokens. Idle decode
and prefill workers lend each other their cores (pdserve/serve/cpu/core_share.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

GPU_QUERY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WorkerSlot:
    """One worker `pdserve up` starts."""

    role: str
    index: int
    """Its number among the workers of its role."""
    tp: int
    pp: int

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def num_ranks(self) -> int:
        """TP x PP: each rank is placed like a TP rank."""
        return self.tp * self.pp


@dataclass
class WorkerPlace:
    """Where one worker runs, as its launcher sets it up."""

    cpus: list[int] | None = None
    """The cores it starts on (None: it floats over the launcher's)."""
    cpu_threads: int | None = None
    """Threads per rank (None on GPUs)."""
    gpus: list[str] = field(default_factory=list)
    """Its CUDA_VISIBLE_DEVICES entries ([] on a CPU host)."""
    gpu_memory_utilization: float | None = None
    """Its share of each of its GPUs (None on a CPU host)."""
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    """The core-lending flags (--lend-idle-flag, --borrow-idle-cores)."""


@dataclass
class Placement:
    device: str
    """cuda | cpu, as resolved for every worker."""
    workers: list[WorkerPlace]
    """One per slot, in order."""
    service_cores: list[int] | None = None
    """The router's and the store's cores (None: they float)."""


def place_workers(args: argparse.Namespace, slots: list[WorkerSlot], gpus: list[str] | None,
                  run_dir: Path | None) -> Placement:
    """`gpus`: the CUDA_VISIBLE_DEVICES entries to hand out (None: this host's, see
    visible_gpus). `run_dir`: where lenders publish whether they are idle (None: no core
    lending). Raises ValueError when the ranks do not fit."""
    if getattr(args, "engine", "torch") == "sim":
        # A simulated worker waits out its steps: one thread, no GPU, no cores of its own
        # (a fleet of dozens shares the host's), no core lending.
        return Placement("cpu", [WorkerPlace(cpu_threads=1) for _ in slots])
    if args.device != "cpu" and gpus is None:
        gpus = visible_gpus()
    device = resolve_device(args.device, gpus or [])
    if device == "cuda":
        return Placement(device, _gpu_places(args, slots, gpus or []))
    places, service_cores = _core_places(args, slots, run_dir)
    return Placement(device, places, service_cores)


def resolve_device(requested: str | None, gpus: list[str]) -> str:
    """cpu when asked for or when no GPU is visible; cuda (an error without a GPU) else."""
    if requested == "cpu":
        return "cpu"
    if requested == "cuda" and not gpus:
        raise ValueError("--device cuda, but no GPU is visible (nvidia-smi -L lists none, "
                         "or CUDA_VISIBLE_DEVICES is empty)")
    return "cuda" if gpus else "cpu"


def _gpu_places(args: argparse.Namespace, slots: list[WorkerSlot], gpus: list[str]
                ) -> list[WorkerPlace]:
    assigned = assign_gpus([s.num_ranks for s in slots], gpus, args.allow_gpu_sharing)
    num_workers_on = Counter(gpu for worker_gpus in assigned for gpu in worker_gpus)
    places = []
    for worker_gpus in assigned:
        num_sharing = max(num_workers_on[gpu] for gpu in worker_gpus)
        places.append(WorkerPlace(
            gpus=worker_gpus,
            gpu_memory_utilization=args.gpu_memory_utilization / num_sharing,
            env={"CUDA_VISIBLE_DEVICES": ",".join(worker_gpus)}))
    return places


def _core_places(args: argparse.Namespace, slots: list[WorkerSlot], run_dir: Path | None
                 ) -> tuple[list[WorkerPlace], list[int] | None]:
    cores = sorted(os.sched_getaffinity(0))
    worker_cores: list[list[int] | None] = [None] * len(slots)
    service_cores = None
    main_cores: dict[int, list[int]] = {}  # worker -> its cores, its main thread's first
    if not args.no_cpu_pinning:
        worker_cores, service_cores, main_cores = _pin(args, slots, cores)
    num_ranks = sum(s.num_ranks for s in slots)
    # Workers whose cores overlap wait passively at their OpenMP barriers: a spinning
    # prefill thread would take the decode step's core it only borrows.
    overlapping = {i for i, a in enumerate(worker_cores) for j, b in enumerate(worker_cores)
                   if i != j and a and b and set(a) & set(b)}
    lending, start_cores = (
        lend_idle_cores(slots, worker_cores, run_dir)
        if run_dir is not None and args.mode == "disagg" and not args.no_core_lending
        else ({}, {}))
    places = []
    for index, (slot, cpus) in enumerate(zip(slots, worker_cores, strict=True)):
        # threads per rank: its cores where pinned, else a share of the host's
        threads = max(1, len(cpus) // slot.num_ranks if cpus else len(cores) // num_ranks)
        place = WorkerPlace(cpus=start_cores.get(index, cpus), cpu_threads=threads,
                            argv=lending.get(index, []))
        if index in overlapping:
            place.env["OMP_WAIT_POLICY"] = "PASSIVE"
        if index in main_cores:
            # OpenMP thread i on core i (libgomp): the main thread, which runs the engine's
            # Python between a step's parallel regions, on the core the services leave it;
            # the worker's ZeroMQ I/O thread on the others, beside the services
            place.env["GOMP_CPU_AFFINITY"] = ",".join(map(str, main_cores[index]))
            place.env["PDSERVE_IO_CORES"] = ",".join(map(str, main_cores[index][1:]))
        if "--borrow-idle-cores" in place.argv:
            # A borrower gives a core back between two layers or steps, and the thread left
            # on it waits in OpenMP's pool; spinning there for libgomp's default count it
            # would hold the lender's core after the lender took it back. A forward's
            # parallel regions follow each other within microseconds: a short spin still
            # covers them.
            place.env["GOMP_SPINCOUNT"] = "20000"
        places.append(place)
    return places, service_cores


def _pin(args: argparse.Namespace, slots: list[WorkerSlot], cores: list[int]
         ) -> tuple[list[list[int] | None], list[int] | None, dict[int, list[int]]]:
    """Each worker's cores, the services' cores, and the workers that keep their first core
    to their main thread: from the host's cores, then --prefill-cores / --decode-cores /
    --service-cores where given."""
    placed, service_cores = place_on_cores([s.num_ranks for s in slots], cores)
    worker_cores: list[list[int] | None] = list(placed) or [None] * len(slots)
    for role in ("prefill", "decode"):
        chosen = getattr(args, f"{role}_cores", None)
        if chosen is None or args.mode == "colocated":
            continue
        index = [i for i, s in enumerate(slots) if s.role == role]
        shares = split_cores([slots[i].num_ranks for i in index], chosen)
        if not shares:
            raise ValueError(f"--{role}-cores {','.join(map(str, chosen))}: fewer cores "
                             f"than the {role} workers' {len(index)} worker(s) have ranks")
        for i, share in zip(index, shares, strict=True):
            worker_cores[i] = share
    main_cores: dict[int, list[int]] = {}
    if service_cores is None:
        # No core to spare: the services share the cores of the workers that stream
        # tokens (decode's, or the colocated worker's), never a prefill's: a prefill's TTFT
        # is its compute, and a router woken on its core delays it.
        hosts = [i for i, s in enumerate(slots)
                 if s.role in ("decode", "colocated") and worker_cores[i]]
        service_cores, kept = share_with_services([worker_cores[i] or [] for i in hosts],
                                                  [slots[i].num_ranks for i in hosts])
        main_cores = {hosts[k]: cores for k, cores in kept.items()}
    if args.service_cores is not None:
        service_cores, main_cores = args.service_cores, {}
    return worker_cores, service_cores, main_cores


def lend_idle_cores(slots: list[WorkerSlot], worker_cores: list[list[int] | None],
                    run_dir: Path) -> tuple[dict[int, list[str]], dict[int, list[int]]]:
    """Core lending (pdserve/serve/cpu/core_share.py): decode worker j lends its cores to one-rank
    prefill worker j mod (their number) while it holds no request; and where that pair is
    one to one (the prefill borrows from no other decode worker) and the decode worker is
    one rank too, the prefill worker lends its cores back while it holds no request. Only
    pinned workers whose cores do not overlap take part. Returns each worker's flags, and
    each borrower's cores to start on: its own and the lent ones (OpenMP sizes its waits
    from the cores it starts with; the worker narrows itself to its own at once)."""
    decode = [i for i, slot in enumerate(slots) if slot.role == "decode"]
    borrowers = [i for i, slot in enumerate(slots)
                 if slot.role == "prefill" and slot.num_ranks == 1]
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
              if partners[prefill] == 1 and slots[decoder].num_ranks == 1]
    flags: dict[int, list[str]] = {}
    start_cores: dict[int, list[int]] = {}
    for lender, borrower in pairs:
        cores, own = worker_cores[lender] or [], worker_cores[borrower] or []
        path = run_dir / f"{slots[lender].name}.idle"
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
    for it only in the first case. So such a worker keeps its first core and the services
    share its others. A worker of one core, or of several ranks, shares all of its cores.
    (None, {}) where there are no such cores."""
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
    torch; none where no GPU driver is loaded, without the subprocess: importing torch costs
    seconds of CPU before the first child starts)."""
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
    if not _gpu_driver_loaded():
        return 0
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S, check=True)
        return int(done.stdout.strip() or 0)
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0


def _gpu_driver_loaded() -> bool:
    """Whether a GPU driver torch could use is loaded: NVIDIA's (its /proc entry, or its
    device nodes in a container that hides /proc/driver) or AMD's (ROCm's /dev/kfd)."""
    return (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")
            or os.path.exists("/dev/kfd") or sys.platform != "linux")
