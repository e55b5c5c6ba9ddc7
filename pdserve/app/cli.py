"""The `pdserve` command: one subcommand per node role, plus the benchmark harness.

Each subcommand lives in its own module, imported only when that subcommand runs (so
`pdserve bench` never imports torch, and `pdserve store` never imports a model). A module
provides:

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> int          # the process exit code
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys
from types import ModuleType

from pdserve import __version__, envs

# name -> (module, one-line description). Add a role here when its module exists.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdserve.app.launcher", "start store, workers and router on this host"),
    "router": ("pdserve.router.server", "OpenAI-compatible HTTP router"),
    "prefill": ("pdserve.serve.worker.server", "prefill worker (stops after the first token)"),
    "decode": ("pdserve.serve.worker.server", "decode worker (continues from the KV store)"),
    "colocated": ("pdserve.serve.worker.server", "worker that runs prefill and decode"),
    "bench": ("pdserve.benchmarks.bench_serve", "goodput benchmark against any OpenAI server"),
    "profile": ("pdserve.app.profile", "measure step times, write a latency profile"),
    "plan": ("pdserve.app.plan", "size prefill/decode pools from a latency profile"),
    "tune": ("pdserve.app.tune", "build the CPU kernels and choose the fastest CPU path here"),
    "store": ("pdserve.kvstore.server", "tiered KV store: master and/or data server"),
    "keygen": ("pdserve.security", "write a cluster key file for the internal sockets"),
    "health": ("pdserve.app.health",
               "exit 0 when a worker, store or router answers ready (probes)"),
}
# Roles with internal ZeroMQ ports: CurveZMQ under the cluster key (pdserve/security.py).
SECURED_ROLES = ("router", "prefill", "decode", "colocated", "store")
# Roles whose process loads Triton, whose nanobind extension reports every object still
# alive at interpreter teardown as "leaked" (some 30 lines on stderr, for nothing: the
# process is ending). Run as a program, they leave as soon as the role has shut itself
# down, after the atexit handlers, before that teardown.
QUIET_EXIT_ROLES = ("prefill", "decode", "colocated", "profile", "tune")


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: pdserve <command> [options]   (pdserve {__version__})", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "`pdserve <command> --help` lists a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run a command; `argv` None: this process's own command line, the process is the
    command (and a worker role exits from here, see QUIET_EXIT_ROLES)."""
    is_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"pdserve {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"pdserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    launcher_pid = envs.take_launcher_pid()
    if launcher_pid is not None:  # a child of `pdserve up`: die with it
        from pdserve.lifecycle import exit_with_launcher

        exit_with_launcher(launcher_pid)
    module, parser = make_parser(name)
    args = parser.parse_args(argv[1:])
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: the registry's keepalives and watches (discovery.py)
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if getattr(args, "advertise_address", None) is not None:
        from pdserve import addresses

        try:
            addresses.advertise_as(args.advertise_address)
        except ValueError as exc:
            print(f"pdserve {name}: {exc}", file=sys.stderr)
            return 2
    if hasattr(args, "discovery_ca_file"):  # etcd's TLS files and password, read once
        from pdserve import discovery

        try:
            discovery.configure_access(args)
        except ValueError as exc:
            print(f"pdserve {name}: {exc}", file=sys.stderr)
            return 2
    if name in SECURED_ROLES:
        from pdserve import security

        try:
            security.configure_from_env(args.insecure_plaintext, f"pdserve {name}")
        except security.ClusterKeyError as exc:
            print(f"pdserve {name}: {exc}", file=sys.stderr)
            return 2
    try:
        code = int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bind that failed: name the process that holds the port
        from pdserve.ports import describe_address_in_use

        message = describe_address_in_use(exc, vars(args))
        if message is None:
            raise
        print(f"pdserve {name}: cannot listen: {message}", file=sys.stderr)
        return 2
    if is_program and name in QUIET_EXIT_ROLES:
        _exit_before_teardown(code)
    return code


def make_parser(name: str) -> tuple[ModuleType, argparse.ArgumentParser]:
    """The module of command `name` and its parser, every flag declared."""
    module_name, description = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"pdserve {name}", description=description)
    module.add_arguments(parser)
    if name in SECURED_ROLES:
        parser.add_argument(
            "--insecure-plaintext", action="store_true",
            help="run this role's internal ZeroMQ sockets unauthenticated and unencrypted "
                 "(default: CurveZMQ under the cluster key file in $PDSERVE_CLUSTER_KEY_FILE)")
    parser.set_defaults(command=name)
    return module, parser


def _exit_before_teardown(code: int) -> None:
    """Exit with `code` as sys.exit would, minus the interpreter's teardown: the atexit
    handlers run and the streams are flushed, then the process ends."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
