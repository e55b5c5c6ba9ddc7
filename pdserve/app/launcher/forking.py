"""Simulated workers forked from the launcher, which did their imports once.

A simulated worker (`--engine sim`, pdserve/serve/executor/sim_runner.py) holds no model: what
it costs is its interpreter, torch and pdserve's worker modules, about 350 MiB and 3-5 s of CPU
each when started afresh. A fleet of 64 on one host would take ~22 GiB and minutes of CPU
just to import. So for sim workers `pdserve up` imports what they import (PRELOAD) once, in
its own process, freezes that heap out of the garbage collector (gc.freeze: the collector of
each child then never writes to those pages) and forks each worker from it: the children
share those pages copy-on-write and start in milliseconds.

Forking is safe here because the launcher starts no thread and no torch work before it
forks: torch's thread pools start at their first parallel region, and UCX (which reads UCX_*
at import) is imported by each child itself. A child gets its own session, the parent-death
signal, its environment, and default signal handlers, then runs `pdserve <argv>` in process
and exits with its code. ForkedProcess gives the supervisor what it uses of a Popen.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback

from pdserve.lifecycle import parent_death_preexec

PRELOAD = ("torch", "pdserve.serve.worker.server", "pdserve.serve.engine.engine",
           "pdserve.serve.executor.sim_runner", "pdserve.handoff.connector",
           "pdserve.tokenizer")
"""What a simulated worker imports, done once in the launcher before it forks."""


def preload(model_dir: str) -> None:
    """Import what the simulated workers will, then freeze the heap (see the docstring)."""
    for name in PRELOAD:
        importlib.import_module(name)
    from pdserve.tokenizer import import_backend

    import_backend(model_dir)
    gc.collect()
    gc.freeze()


class ForkedProcess:
    """What the supervisor uses of subprocess.Popen, for a child forked by fork_child."""

    stdin = None

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, code unknown
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _name_process(argv: list[str]) -> None:
    """The child's name in ps, top and /proc/PID/comm: its --worker-id (a fork keeps the
    launcher's command line)."""
    name = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else argv[0]
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


def fork_child(argv: list[str], env: dict[str, str], cpus: list[int] | None = None
               ) -> ForkedProcess:
    """Run `pdserve <argv>` in a child forked from this process (after preload)."""
    launcher_pid = os.getpid()
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedProcess(pid, argv)
    code = 1
    try:  # the child: never returns into the launcher's code
        os.setsid()
        parent_death_preexec(launcher_pid, pin)()
        _name_process(argv)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["pdserve", *argv]
        from pdserve.app import cli

        code = int(cli.main(argv) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
