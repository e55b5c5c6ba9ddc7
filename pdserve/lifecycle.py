"""A role started by `pdserve up` dies with its launcher, however the launcher ends.

Two mechanisms, since neither covers every case alone:

- the parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`), set in the child between fork
  and exec (`parent_death_preexec`): the kernel sends SIGTERM the moment the launcher dies,
  SIGKILL and OOM kills included, and the role drains as it does on any SIGTERM;
- a watch thread in the child (`exit_with_launcher`, started by `pdserve.app.cli` when
  PDSERVE_LAUNCHER_PID is set): once the child's parent is no longer the launcher it sends
  itself SIGTERM, and if the role has not exited `grace_s` later, ends the process. It
  covers what the signal does not: a role whose SIGTERM handler does not return in time,
  and hosts without prctl.

And once a role has started, `freeze_startup_heap` keeps Python's cyclic garbage collector
off what startup built (modules, the model's and tokenizer's objects). Its background threads
whose work can wait (copies to a lower tier, the sends of a hand-off node) lower their own
priority (`lower_thread_priority`), so that on a busy core the engine's step goes first.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_GRACE_S = 5.0
"""How long a role may drain after SIGTERM before the watch ends it."""


def _prctl() -> Callable[..., int] | None:
    """libc's prctl (Linux), or None. Looked up in the launcher, before any fork: loading a
    library between fork and exec is not safe."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def parent_death_preexec(
    launcher_pid: int, then: Callable[[], None] | None = None
) -> Callable[[], None]:
    """A Popen preexec_fn: SIGTERM on the launcher's death, then `then` (e.g. CPU pinning).
    A launcher that died before the signal was set (the fork raced its death) would never
    send it: the child then exits before exec."""
    prctl = _prctl()

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != launcher_pid:
            os._exit(1)
        if then is not None:
            then()

    return preexec


def exit_with_launcher(
    launcher_pid: int, grace_s: float = EXIT_GRACE_S, poll_s: float = 0.5
) -> threading.Thread:
    """Start the watch thread (a daemon): when this process's parent stops being
    `launcher_pid`, SIGTERM this process, and end it `grace_s` later if it still runs."""

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(poll_s)
        logger.warning("the launcher (pid %d) is gone: stopping", launcher_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logger.error("still running %.0f s after the launcher died: exiting now", grace_s)
        logging.shutdown()
        os._exit(1)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
"""ioprio_set's syscall number (<asm/unistd.h>) on the machines pdserve runs on."""
_IOPRIO_IDLE = 3 << 13  # IOPRIO_CLASS_IDLE, level 0 (<linux/ioprio.h>)


def lower_thread_priority(nice: int = 19, idle_io: bool = False) -> None:
    """Run the calling thread at `nice` (Linux sets it per thread): on a busy core it gets
    what the others leave (CFS still gives it a little), on an idle one it runs at once.
    `idle_io`: its disk reads wait for everyone else's too (the idle I/O class, per thread).
    The threads it starts inherit both. Not Linux: it competes as any thread does."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass
    number = _IOPRIO_SET.get(os.uname().machine)
    if idle_io and number is not None and sys.platform == "linux":
        try:
            ctypes.CDLL(None, use_errno=True).syscall(number, 1, threading.get_native_id(),
                                                      _IOPRIO_IDLE)  # IOPRIO_WHO_PROCESS
        except (AttributeError, OSError):
            pass


def set_session_nice(nice: int) -> bool:
    """Set the nice of this process's scheduler autogroup (Linux with autogroups on: every
    session is one group, and the groups share the CPU by their own nice whatever the nice of
    their threads; a supervised child runs in a session of its own). Only by a process that
    leads its session (else it would lower its parent's and every sibling's too), and only
    where it can be set back: by root (an unprivileged process may raise it but never lower it
    again). Whether it was set."""
    if os.geteuid() != 0 or os.getsid(0) != os.getpid():
        return False
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write(str(nice))
        return True
    except OSError:  # no autogroups (a kernel without them, or a container hiding /proc)
        return False


def freeze_startup_heap(role: str) -> int:
    """Collect once, then move every object alive now into the collector's permanent
    generation (gc.freeze, as vLLM does after its engine starts), so the full collections
    that serving objects trigger now and then no longer walk what startup built. In a worker
    running llama-mid such a collection took 146-164 ms (2 in 25 s of serving at 8 req/s),
    a stall of every running request's next token. Call it once startup is done; returns the
    number of objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d startup objects frozen out of garbage collection", role, frozen)
    return frozen
