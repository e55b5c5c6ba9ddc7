"""The children of `pdserve up` and their supervision.

A child that dies is restarted after a backoff (logged, and counted in the router's /metrics
as pdserve:process_restarts_total) while the others keep serving; a role that keeps failing
at start stops the cluster (RestartPolicy). Once a child is ready the supervisor starts its
standby (pdserve/app/standby.py: the same command with its imports done, waiting), one child
at a time, and a restart runs the standby instead of a fresh interpreter. Each child runs in
a session of its own and dies with the launcher even when the launcher is SIGKILLed
(pdserve/lifecycle.py); on stop, each role gets a few seconds to drain, then is killed with
its whole process group.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.app.launcher.forking import ForkedProcess, fork_child
from pdserve.app.standby import GO
from pdserve.lifecycle import parent_death_preexec

STOP_GRACE_S = 5.0
"""How long each group of children may drain after SIGTERM before it is killed."""
STANDBY_STAGGER_S = 2.0
"""Standbys start one at a time, this far apart: each is a second or two of imports, taken
from a host that is serving."""
MAX_STANDBY_FAILURES = 3
"""A child whose standby exits unasked this many times gets no more (each start costs CPU)."""

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
    process: subprocess.Popen | ForkedProcess | None = None
    state: str = "starting"
    started_s: float = 0.0
    """time.monotonic() of the last start."""
    num_restarts: int = 0
    num_start_failures: int = 0
    """Exits within the start window in a row (RestartPolicy)."""
    restart_at_s: float | None = None
    """When a dead child is due to start again (None: not waiting to)."""

    fork: bool = False
    """Fork it from the launcher, which did its imports (pdserve/app/launcher/forking.py:
    simulated workers), instead of starting a fresh interpreter; it has no standby."""
    standby: subprocess.Popen | None = None
    """The next incarnation, waiting with its imports done (None: none started)."""
    num_standby_failures: int = 0
    """Standbys that exited without being asked to run."""

    def start(self) -> None:
        """Run the standby if one is waiting, else start a fresh process."""
        standby, self.standby = self.standby, None
        if self.fork:
            self.process = fork_child(self.argv, self.environment(), self.cpus)
        else:
            self.process = start_from(standby, self.argv, self.environment(), self.cpus)
        self.started_s = time.monotonic()
        self.state = "starting"
        self.restart_at_s = None

    def environment(self) -> dict[str, str]:
        # PDSERVE_LAUNCHER_PID and the parent-death signal (spawn) make it die with the
        # launcher.
        return {**os.environ, **self.env, "PDSERVE_LAUNCHER_PID": str(os.getpid())}

    def prepare_standby(self) -> None:
        if self.fork:  # a fork starts in milliseconds: nothing to prepare
            return
        self.drop_standby()
        self.standby = spawn(self.argv, self.environment(), self.cpus, standby=True)

    def drop_standby(self) -> None:
        """End the standby, if any."""
        standby, self.standby = self.standby, None
        if standby is not None:
            stop_standby(standby)

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


def spawn(argv: list[str], env: dict[str, str], cpus: list[int] | None = None,
          standby: bool = False, stdout: int | None = None) -> subprocess.Popen:
    """Start `pdserve <argv>` (or, `standby`, the process that will run it when activated)
    as a supervised child: in a session of its own, so Ctrl-C reaches only the supervisor,
    which stops the children in order (router, workers, store) and none waits on a peer
    already gone; with the parent-death signal armed; on `cpus` (pinned before it starts a
    thread: torch sizes its pool at import). `stdout`: a file descriptor for its output and
    errors (default: the supervisor's)."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    module = "pdserve.app.standby" if standby else "pdserve.app.cli"
    return subprocess.Popen(
        [sys.executable, "-m", module, *argv], start_new_session=True, env=env,
        stdin=subprocess.PIPE if standby else None, stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        preexec_fn=parent_death_preexec(os.getpid(), pin))


def activate(standby: subprocess.Popen | None) -> bool:
    """Make a waiting standby run its role: False if there is none, or it is gone."""
    if standby is None or standby.poll() is not None or standby.stdin is None \
            or standby.stdin.closed:  # told already
        return False
    try:
        standby.stdin.write(GO)
        standby.stdin.close()
    except OSError:  # it died meanwhile (a broken pipe)
        return False
    return True


def start_from(standby: subprocess.Popen | None, argv: list[str], env: dict[str, str],
               cpus: list[int] | None = None, stdout: int | None = None) -> subprocess.Popen:
    """The process that runs `pdserve <argv>` now: `standby`, activated, if it still waits;
    else (it ended) a fresh one from spawn."""
    if activate(standby):
        return standby
    if standby is not None:
        stop_standby(standby)
    return spawn(argv, env, cpus, stdout=stdout)


def stop_standby(standby: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """End a standby: its input closed and a SIGTERM, on which it exits 0 at once though its
    imports still run (the end of its input alone waits for them: at nice 19 on a busy host,
    seconds), or by the default action where its interpreter has not set its handler yet;
    killed if it has not within timeout_s."""
    if standby.stdin is not None:
        try:
            standby.stdin.close()
        except OSError:
            pass
    if standby.poll() is None:
        standby.terminate()
    try:
        standby.wait(timeout_s)
    except subprocess.TimeoutExpired:
        standby.kill()
        standby.wait(5)


class RoleKeepsFailing(RuntimeError):
    """A role failed at start RestartPolicy.max_start_failures times in a row."""

    def __init__(self, child: Child, message: str) -> None:
        super().__init__(message)
        self.child = child


class Supervisor:
    """Restarts dead children by `policy`, counting restarts in a JSON file the router
    exports (pdserve/router/metrics.py SupervisorCollector)."""

    def __init__(self, cluster: Cluster, policy: RestartPolicy, state_path: Path,
                 say: Callable[[str], None],
                 kill_group: Callable[[int], None] | None = None,
                 standbys: bool = False) -> None:
        """`kill_group(pid)` ends what a dead child left in its process group (default:
        SIGKILL to the group). `standbys`: keep a standby for each ready child."""
        self.cluster, self.policy, self.state_path, self.say = cluster, policy, state_path, say
        self.kill_group = kill_group or kill_group_of
        self.standbys = standbys
        self._next_standby_s = 0.0
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
        if self.standbys:
            self._check_standbys(now_s)

    def _check_standbys(self, now_s: float) -> None:
        """Note the standbys that exited unasked (a child that cannot keep one stops trying
        after MAX_STANDBY_FAILURES, said once), then, once every child is ready, start the
        next one that is due."""
        for child in self.cluster.children:
            if child.standby is not None and child.standby.poll() is not None:
                code = child.standby.returncode
                child.drop_standby()
                child.num_standby_failures += 1
                if child.num_standby_failures == MAX_STANDBY_FAILURES:
                    self.say(f"pdserve up: {child.role}'s standby exited (code {code}) "
                             f"{MAX_STANDBY_FAILURES} times: its restarts start afresh")
        if now_s < self._next_standby_s:
            return
        if not all(c.state == "ready" for c in self.cluster.children):
            return  # not while the cluster starts or a child restarts: they need the cores
        waiting = [c for c in self.cluster.children if c.state == "ready"
                   and c.restart_at_s is None and c.standby is None
                   and c.num_standby_failures < MAX_STANDBY_FAILURES]
        if waiting:
            waiting[0].prepare_standby()
            self._next_standby_s = now_s + STANDBY_STAGGER_S

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
        """End the standbys (together), then SIGTERM the children in reverse start order, each
        group waited for in turn; a child still running grace_s later is killed with its whole
        process group (its TP ranks too)."""
        standbys = [c.standby for c in self.children if c.standby is not None]
        for child in self.children:
            child.standby = None
        for standby in standbys:  # all told at once, then waited for together
            if standby.poll() is None:
                standby.terminate()
        deadline = time.monotonic() + grace_s
        for standby in standbys:
            stop_standby(standby, max(deadline - time.monotonic(), 0.1))
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
                    kill_group_of(process.pid)
                    process.wait(5)


def kill_group_of(pid: int) -> None:
    """SIGKILL the process group a child leads (each child starts its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left in it
        pass
