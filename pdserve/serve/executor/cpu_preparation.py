"""A one-rank CPU worker serves at once; a child process builds its kernels and measures its
CPU paths meanwhile, and the worker switches to the fast path between two steps.

    worker (ModelRunner)                          child (nice 19, the worker's cores and threads)
    start: kernels built and choice cached?
      yes: serve on it at once ("cached")
      no:  serve on what is ready now:            build the kernels (pdserve/kernels/cpu_ops.py)
           the portable path (plain torch, no     load the model, time every path
           C++ build), or the kernels' default    (cpu_tuning.tune_rank: one host measures
           path where they are built              at a time, the re-check, the cache)
    each step (and each idle turn of a worker's   write the choice (a cache entry, JSON), exit
    loop) asks whether the child is done;
    once it is, before the next step: ◄───────────┘
      kernels loaded, attention backend "cpu", weights packed again, the fused loop rebuilt:
      one log line, and /status cpu_path says which path serves

The first start on a fresh machine thus answers in seconds instead of minutes (the build takes
one to three on 2 cores), and no request sees the switch: it falls between steps, and every
path gives the same tokens (tests/serve/test_cpu_preparation.py). A measurement taken while the
worker serves may be disturbed: the re-check then keeps it out of the cache, and the next start
measures again. The child holds a second copy of the weights while it measures (its KV is a
small scratch pool): where memory is short, `pdserve tune` prepares it all ahead, and a start
with the choice cached starts no child.

The child is started from the worker itself and reads the job (the model's spec, the scheduler's
limits, the cores and threads the worker's choice is keyed by) from a file in a private
temporary folder: a pickle, since writer and reader are one program, the same user's.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve import envs
from pdserve.kernels import cpu_ops
from pdserve.serve.config import SchedulerConfig
from pdserve.serve.executor import cpu_tuning
from pdserve.serve.executor.cpu_path_choice import Tuning, candidate_paths
from pdserve.serve.layers import ops
from pdserve.serve.layers.distributed import TPGroup

if TYPE_CHECKING:
    from pdserve.serve.executor.loader import ModelSpec
    from pdserve.serve.executor.rank import Rank

logger = logging.getLogger(__name__)

PORTABLE = {"path": "portable", "source": "portable"}
"""The status of a worker on the plain-torch path (no compiled kernels)."""
STOP_GRACE_S = 5.0
BUILD_TIMEOUT_S = 3600.0
"""The child's limit on the kernels' build: nothing waits for it, and at nice 19 on a busy host
it outlasts a foreground build's limit (cpu_ops.BUILD_TIMEOUT_S): one took over 15 minutes
beside a load average of 20 on 2 cores."""


@dataclass(frozen=True)
class PreparationJob:
    """What the child needs to measure exactly the paths the worker would serve."""

    spec: ModelSpec
    block_size: int
    tp: TPGroup
    scheduler_config: SchedulerConfig
    with_mtp: bool
    cores: tuple[int, ...]
    threads: int
    machine: dict[str, Any]
    """The worker's cpu_tuning.machine_facts(), taken at its start: the child's must equal it."""
    cache_dir: Path
    """Where the choice is cached (the worker's cpu_tuning.cache_directory())."""
    parent_pid: int


class CpuPreparation:
    """The worker's view of its child: started at once, polled between steps, stopped with
    the worker."""

    def __init__(self, job: PreparationJob) -> None:
        self.job = job
        self.started_s = time.monotonic()
        self.finished_s: float | None = None
        self._folder = Path(tempfile.mkdtemp(prefix="pdserve-cpu-preparation-"))
        (self._folder / "job.pickle").write_bytes(pickle.dumps(job))
        # a process group of its own (not a session: it stays in the worker's scheduler
        # autogroup, where its nice puts it behind the worker), so that stopping it stops its
        # compiler too
        group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                                 else {"preexec_fn": os.setpgrp})
        self._process = subprocess.Popen(child_command(self._folder), stdin=subprocess.DEVNULL,
                                         env={**os.environ, "TQDM_DISABLE": "1"}, **group)

    @property
    def pid(self) -> int:
        return self._process.pid

    def is_done(self) -> bool:
        """Whether the child has exited (a cheap poll: asked before every step)."""
        if self.finished_s is None and self._process.poll() is not None:
            self.finished_s = time.monotonic()
        return self.finished_s is not None

    def result(self) -> dict[str, Any] | None:
        """What a finished child wrote (None: it wrote nothing, as when it failed)."""
        try:
            return json.loads((self._folder / "result.json").read_text())
        except (OSError, ValueError):
            return None

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    def describe(self) -> str:
        seconds = (self.finished_s or time.monotonic()) - self.started_s
        if self.finished_s is None:
            return (f"building the CPU kernels and measuring the CPU paths in the background "
                    f"(pid {self.pid}, {seconds:.0f} s so far)")
        if self.returncode:
            return (f"the background preparation failed after {seconds:.1f} s (exit code "
                    f"{self.returncode}; its log is the worker's)")
        return f"prepared in the background in {seconds:.1f} s"

    def stop(self) -> None:
        """End the child and its compiler if it still runs (the worker stops) and remove its
        folder."""
        if self._process.poll() is None:
            _signal_group(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self._process.pid, signal.SIGKILL)
                try:  # a SIGKILLed child is reaped at once; never hang a stopping worker on it
                    self._process.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    logger.warning("the CPU preparation child (pid %d) outlived SIGKILL",
                                   self._process.pid)
        shutil.rmtree(self._folder, ignore_errors=True)


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):  # gone already
        pass


class BackgroundCpuPath:
    """A one-rank CPU worker's CPU path: made before its model loads (so that nothing waits
    for a compiler), started after, switched between steps, closed with the worker."""

    def __init__(self) -> None:
        cpu_ops.build_elsewhere()
        self._is_waiting_for_build = True
        self.tuning: Tuning | None = None
        """The choice that serves (None: the portable path)."""
        self.preparation: CpuPreparation | None = None
        self._rank: Rank | None = None
        self._scheduler_config: SchedulerConfig | None = None
        self._lock = threading.Lock()
        self._has_switched = False

    def start(self, rank: Rank, scheduler_config: SchedulerConfig) -> None:
        """Serve on the known choice where there is one (the kernels built, or switched off,
        and the choice cached); else on what is ready (the portable path, or the kernels'
        default path where they are built) and start the child that prepares the rest."""
        self._rank, self._scheduler_config = rank, scheduler_config
        machine = cpu_tuning.machine_facts()
        if not envs.cpu_kernels() or cpu_ops.is_built():
            self._end_wait()  # nothing to wait for: load() imports it (milliseconds)
            refresh_kernels(rank)
            step_points, _ = cpu_tuning.rank_timer(rank, scheduler_config)
            known = cpu_tuning.known_choice(rank.model, step_points,
                                            *cpu_tuning.abilities(rank.model), machine=machine,
                                            cache_dir=cpu_tuning.cache_directory())
            self.tuning = known or Tuning(ops.default_path(), source="default")
            cpu_tuning.apply(rank.model, self.tuning.chosen)
            if known is not None:
                logger.info("%s", known.summary())
                return
        self.preparation = CpuPreparation(PreparationJob(
            rank.spec, rank.block_size,
            TPGroup(0, 1, rank.tp.expert_parallel, rank.tp.expert_capacity_factor),
            scheduler_config, rank.num_mtp_layers > 0, tuple(sorted(os.sched_getaffinity(0))),
            machine["threads"], machine, cpu_tuning.cache_directory(), os.getpid()))
        logger.info("cpu path: serving on %s at once; the CPU kernels build and the paths are "
                    "measured in the background (pid %d)", self._serving(),
                    self.preparation.pid)

    def switch_if_ready(self) -> bool:
        """Between two steps: switch to what the child found once it is done (a poll
        otherwise). Whether it switched now."""
        preparation = self.preparation
        if preparation is None or self._has_switched or not preparation.is_done():
            return False
        with self._lock:
            if self._has_switched:
                return False
            assert self._rank is not None and self._scheduler_config is not None
            self._has_switched = True
            try:
                self.tuning = self._switch(self._rank, self._scheduler_config, preparation)
            except Exception:  # the step that asked must not fail for it
                logger.exception("cpu path: the switch failed; serving the default path")
                self.tuning = Tuning(ops.default_path(), source="default")
                cpu_tuning.apply(self._rank.model, self.tuning.chosen)
        preparation.stop()  # its folder
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the child is done, then switch (a benchmark times the path a worker
        ends on, not the one it starts on). False: still preparing after timeout_s."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.preparation is not None and not self.preparation.is_done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        self.switch_if_ready()
        return True

    def _switch(self, rank: Rank, scheduler_config: SchedulerConfig,
                preparation: CpuPreparation) -> Tuning | None:
        """Serve on what the child found: its choice, or the kernels' default path where its
        choice does not fit this worker; stay where it is when the child found nothing and
        the kernels could not be built. Say so in one line."""
        result = preparation.result() or {}
        if envs.cpu_kernels() and not result.get("kernels") and not cpu_ops.is_built():
            cpu_ops.built_elsewhere(f"the background build failed (the child's exit code "
                                    f"{preparation.returncode}; see the log above)")
            self._is_waiting_for_build = False
            if "entry" not in result:
                logger.warning("cpu path: staying on %s: %s", self._serving(),
                               preparation.describe())
                return self.tuning
        self._end_wait()
        refresh_kernels(rank)
        step_points, _ = cpu_tuning.rank_timer(rank, scheduler_config)
        abilities = cpu_tuning.abilities(rank.model)
        candidates = candidate_paths(*abilities)
        facts = cpu_tuning.key_facts(rank.model, step_points, candidates,
                                     preparation.job.machine)
        tuning = None
        if "entry" in result:
            tuning = cpu_tuning.from_entry(result["entry"], facts, candidates, step_points,
                                           result.get("source", "measured"),
                                           Path(result.get("cache_file", "")))
            if tuning is None:
                logger.warning("the background measurement does not fit this worker (another "
                               "model, cores or threads?)")
        if tuning is None:
            tuning = cpu_tuning.known_choice(rank.model, step_points, *abilities,
                                             machine=preparation.job.machine,
                                             cache_dir=preparation.job.cache_dir) \
                or Tuning(ops.default_path(), source="default")
        tuning.facts = facts
        cpu_tuning.apply(rank.model, tuning.chosen)
        logger.info("cpu path: switched from %s to %s, %s: %s", self._serving(),
                    tuning.chosen.label, preparation.describe(), tuning.summary())
        return tuning

    def _serving(self) -> str:
        return ("the portable path (plain torch)" if self.tuning is None
                else self.tuning.chosen.label)

    def status(self) -> dict[str, str]:
        """What /status shows as cpu_path: the path that serves and its source (PORTABLE where
        no kernel serves yet), and what the background does or took."""
        shown = dict(PORTABLE) if self.tuning is None else self.tuning.as_status()
        if self.preparation is not None:
            shown["background"] = self.preparation.describe()
        return shown

    def close(self) -> None:
        """The worker stops: end the child if it still runs, and the wait for its build."""
        if self.preparation is not None:
            self.preparation.stop()
        self._end_wait()

    def _end_wait(self) -> None:
        if self._is_waiting_for_build:
            self._is_waiting_for_build = False
            cpu_ops.built_elsewhere()


def refresh_kernels(rank: Rank) -> None:
    """Every op and attention layer on what this process would choose now (the kernels where
    they are loaded)."""
    ops.use_device(rank.device.type)
    _use_attention_backend(rank)


def _use_attention_backend(rank: Rank) -> None:
    """Every attention layer on the backend this process would choose now (the "cpu" one once
    the kernels are loaded); a forced PDSERVE_ATTENTION_BACKEND is what it was already."""
    from pdserve.kernels import AttentionBackend, get_attention_backend
    from pdserve.serve.layers.attention import default_backend_name

    backend = get_attention_backend(default_backend_name(rank.device))
    for module in rank.model.modules():
        if isinstance(getattr(module, "backend", None), AttentionBackend):
            module.backend = backend


# ---- the child -------------------------------------------------------------------------------


def child_command(folder: Path) -> list[str]:
    """The child's command line (tests hold it back behind a gate)."""
    return [sys.executable, "-m", __name__, str(folder)]


def _exit_with_parent(parent_pid: int) -> None:
    """The worker died without stopping this child: stop too (its work is for that worker)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    _end_group()


def _end_group(*_: object) -> None:
    """This child and what it started (a compiler), at once: nothing of it is worth keeping
    half done (a build's lock left behind is cleared by the next build, cpu_ops._build)."""
    if os.getpgrp() == os.getpid():  # the group is this child's own (CpuPreparation made it)
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def prepare(folder: Path) -> int:
    """The child: build the kernels, measure (or read back) the paths, write the result."""
    from pdserve import lifecycle

    job: PreparationJob = pickle.loads((folder / "job.pickle").read_bytes())
    lifecycle.lower_thread_priority(19, idle_io=True)  # before any thread: they inherit it
    signal.signal(signal.SIGTERM, _end_group)
    threading.Thread(target=_exit_with_parent, args=(job.parent_pid,), daemon=True).start()
    logging.basicConfig(level=envs.log_level(),
                        format="%(asctime)s %(levelname)s cpu-preparation: %(message)s")
    import torch

    from pdserve.serve.executor.rank import Rank

    os.sched_setaffinity(0, job.cores)
    torch.set_num_threads(job.threads)
    if envs.cpu_kernels():  # the build, in a child of this one (cpu_ops._build)
        cpu_ops.load(build_timeout_s=BUILD_TIMEOUT_S)
    kernels = ops.cpu_kernels()
    rank = Rank(job.spec, job.block_size, job.tp, torch.device("cpu"))
    if job.with_mtp:
        rank.add_mtp()
    tuning = cpu_tuning.tune_rank(rank, job.scheduler_config, cache_dir=job.cache_dir)
    result: dict[str, Any] = {"kernels": kernels is not None, "source": tuning.source,
                              "cache_file": tuning.cache_file}
    if tuning.facts:
        result["entry"] = cpu_tuning.cache_entry(tuning.facts, tuning)
    scratch = folder / "result.json.tmp"
    scratch.write_text(json.dumps(result))
    scratch.replace(folder / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(prepare(Path(sys.argv[1])))
