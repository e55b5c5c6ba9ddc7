"""A server a benchmark starts for itself (`pdserve up`, vLLM): started in a session of its
own, waited for until a URL answers 200, and stopped with its whole process group. It never
outlives the benchmark: its parent-death signal (SIGTERM) is armed, so a benchmark killed by a
time limit takes its servers, and their GPU memory and port, with it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from pdserve.lifecycle import parent_death_preexec


def start(command: list[str], log: Path, ready_url: str, timeout_s: float,
          poll_s: float = 0.5, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Run `command` (its output to `log`; `env` added to this process's environment) and
    wait until `ready_url` answers 200; stopped again and RuntimeError (naming the log) when
    it exits or is not ready in `timeout_s`."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   env={**os.environ, **env} if env else None,
                                   preexec_fn=parent_death_preexec(os.getpid()))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}: see {log}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    stop(process)
    raise RuntimeError(f"{command[0]} was not ready within {timeout_s:.0f} s: see {log}")


def stop(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after `timeout_s`."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(10)


def stop_all(processes: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM every process still running, then wait for each, SIGKILL past `timeout_s`
    (all asked first: they shut down side by side)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
