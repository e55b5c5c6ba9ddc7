"""A process started ahead of need: the next incarnation of one supervised child.

Most of a role's start is imports: torch alone is over a second of CPU, and on a host busy
serving a restarted worker waits several seconds for it. So a supervisor (`pdserve up`, the
chaos benchmark's fleet) keeps a standby for each child once the child is ready: a process
with the child's command line, environment and cores that imports what the role imports
(PRELOAD, and the model's tokenizer backend), then waits on its stdin. When the child dies
the supervisor writes GO and the standby runs the role at once; the end of its input (the
supervisor closed the pipe, or died) makes it exit without serving. The imports run on a
thread of their own at the lowest CPU and I/O priority, and (as root) the standby's whole
session, a scheduler autogroup of its own, at nice 19 until GO, so a standby started beside
serving processes takes only what they leave; the main thread, which runs the role, keeps its
normal priority. Without root the session's nice cannot be set back, so it is left alone, and
on a host with autogroups the imports then compete as the serving processes do. Nothing is forked: a
standby is an ordinary process that did its imports early, so nothing depends on what is
safe to fork, and an environment read at import (OMP_*, CUDA_*) is the child's own.

    python -m pdserve.app.standby <command> [options]     (the child's own arguments)
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

from pdserve import lifecycle
from pdserve.app import cli

GO = b"go\n"
"""What the supervisor writes to make the standby run its role."""

_WORKER = ("pdserve.serve.engine.engine", "pdserve.serve.executor.loader")
PRELOAD: dict[str, tuple[str, ...]] = {
    "router": ("uvicorn", "pdserve.router.app"),
    "prefill": _WORKER,
    "decode": _WORKER,
    "colocated": _WORKER,
    "store": (),
}
"""The commands a standby can take and, beyond the command's module, what its run imports.
UCX is left out on purpose: ucxx reads UCX_* when imported, which the roles set first."""


def preload(argv: list[str]) -> None:
    """Import what `pdserve <argv>` will; raises ValueError for a command with no standby."""
    if not argv or argv[0] not in PRELOAD:
        raise ValueError(f"no standby for {argv[:1]}: one of {', '.join(PRELOAD)}")
    _, parser = cli.make_parser(argv[0])  # (imports the command's module)
    for name in PRELOAD[argv[0]]:
        importlib.import_module(name)
    args, _ = parser.parse_known_args(argv[1:])
    if getattr(args, "model", None):
        from pdserve.tokenizer import import_backend

        import_backend(args.model)


_role_started = False
"""Set just before the role runs: until then a stop has nothing to undo."""


def _stop(signum: int, _frame: object) -> None:
    # Before the role runs (importing, waiting, or parsing its arguments) nothing is bound or
    # written, so the standby ends at once: a normal exit would first wait for the imports'
    # thread (at nice 19 on a busy host, for as long as the host stays busy) and run atexit
    # hooks the imports registered. Once the role runs, it has installed its own handlers;
    # this one only covers the moment between, where SystemExit unwinds as usual.
    if not _role_started:
        os._exit(0)
    raise SystemExit(0)


def preload_quietly(argv: list[str]) -> str | None:
    """preload(argv) on a thread at the lowest CPU and I/O priority; its error, if any."""
    errors: list[str] = []

    def run() -> None:
        lifecycle.lower_thread_priority(19, idle_io=True)
        try:
            preload(argv)
        except ValueError as exc:
            errors.append(str(exc))

    loader = threading.Thread(target=run, name="standby-preload", daemon=True)
    loader.start()
    loader.join()  # no timeout: imports end, and a stop or the supervisor's death ends this
    return errors[0] if errors else None


def main() -> int:
    # A SIGTERM or SIGINT before the role has its own handlers (while importing, waiting, or
    # as the role begins: each role installs its handlers before it binds anything) ends the
    # standby cleanly, with nothing to undo, instead of by the default action.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    argv = sys.argv[1:]
    # The standby is a session, hence a scheduler autogroup, of its own: a thread's nice
    # counts only inside it, so the whole group waits behind the serving processes too.
    lowered = lifecycle.set_session_nice(19)
    error = preload_quietly(argv)
    if error is not None:
        print(f"pdserve standby: {error}", file=sys.stderr)
        return 2
    # No timeout: waiting is a standby's whole job, and it ends with the supervisor (end of
    # input, and the parent-death signal the supervisor arms).
    if sys.stdin.buffer.readline() != GO:
        return 0  # the supervisor closed the pipe or went away: nothing to serve
    if lowered:
        lifecycle.set_session_nice(0)  # the role competes as any started child does
    devnull = os.open(os.devnull, os.O_RDONLY)  # the role's stdin, as a started child's
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = [sys.argv[0], *argv]
    global _role_started
    _role_started = True
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
