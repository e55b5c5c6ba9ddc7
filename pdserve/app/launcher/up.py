"""`pdserve up`: its flags, and the run that starts the cluster and watches it.

Prints one status line per role as it becomes ready, then the URL; stops everything on
Ctrl-C or SIGTERM (supervision.py), or when one role keeps failing at start. A port some
other process holds is named before anything starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve import discovery, security
from pdserve.app.launcher.commands import plan
from pdserve.app.launcher.supervision import (
    Child,
    Cluster,
    RestartPolicy,
    RoleKeepsFailing,
    Supervisor,
)
from pdserve.ports import PortInUse, check_port_free
from pdserve.router.server import (
    add_controller_arguments,
    add_max_tokens_arguments,
    add_routing_arguments,
    add_tool_arguments,
    add_tracing_arguments,
)
from pdserve.serve.cpu.core_share import parse_core_list
from pdserve.serve.worker.args import (
    add_cache_arguments,
    add_device_arguments,
    add_expert_arguments,
    add_handoff_arguments,
    add_model_arguments,
    add_scheduler_arguments,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory; default: the "
                        "embedded tiny random-weight Llama (built once and cached)")
    parser.add_argument("--host", default="127.0.0.1", help="router bind address")
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0,
                        help="stop when the cluster is not ready this long after starting")
    _add_shape_arguments(parser)
    _add_placement_arguments(parser)
    # the workers' own groups, handed to every worker
    add_model_arguments(parser)
    add_device_arguments(parser)
    add_expert_arguments(parser)
    add_cache_arguments(parser)
    add_scheduler_arguments(parser)
    add_handoff_arguments(parser)
    discovery.add_arguments(parser)  # optional: `pdserve up` itself needs no etcd
    _add_security_arguments(parser)
    _add_supervision_arguments(parser)
    # the router's own groups, handed to the router
    add_max_tokens_arguments(parser)
    add_routing_arguments(parser)
    add_controller_arguments(parser)
    add_tracing_arguments(parser)
    add_tool_arguments(parser)


def _add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster shape")
    add = group.add_argument
    add("--mode", choices=("disagg", "colocated"), default="disagg",
        help="disagg: prefill and decode workers apart; colocated: one worker does both")
    add("--num-prefill", type=int, default=1, help="prefill workers (disagg)")
    add("--num-decode", type=int, default=1, help="decode workers (disagg)")
    add("--prefill-tp", type=int, default=1,
        help="tensor-parallel ranks of each prefill (or colocated) worker")
    add("--decode-tp", type=int, default=1, help="tensor-parallel ranks of each decode worker")
    add("--prefill-pp", type=int, default=1,
        help="pipeline stages of each prefill (or colocated) worker")
    add("--decode-pp", type=int, default=1, help="pipeline stages of each decode worker")
    add("--prefill-max-prefills-per-step", type=int, default=None, metavar="N",
        help="prompts a prefill worker computes in one step (0: as many as its token budget "
             "holds; default: 1 on a CPU host, where a prefill is compute-bound and batching "
             "prompts only delays the first, else 0)")
    add("--worker-base-port", type=int, default=18100,
        help="workers listen on consecutive ports from here")
    add("--store-port", type=int, default=18050,
        help="KV store master port (the data server takes the next one)")
    add("--no-store", action="store_true",
        help="run without the fleet KV store (prefill still hands its KV to decode directly; "
             "below each worker's host DRAM tier there is no shared prefix tier)")


def _add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("placement (GPUs and cores)")
    add = group.add_argument
    add("--allow-gpu-sharing", action="store_true",
        help="with more ranks than GPUs, put several workers on one GPU (each gets a share of "
             "--gpu-memory-utilization) instead of failing")
    add("--no-cpu-pinning", action="store_true",
        help="on a CPU host, let every role float over all cores (default: each worker rank "
             "gets cores of its own, and the router and store get a core the workers do not "
             "use where there are more than 4, else share the cores of the decode or "
             "colocated workers, never a prefill's, and never the first core of a one-rank "
             "worker on several: its main thread's)")
    for role in ("prefill", "decode"):
        add(f"--{role}-cores", type=parse_core_list, default=None, metavar="LIST",
            help=f"on a CPU host, the cores the {role} workers run on, shared out among their "
                 "ranks, with as many threads (default: cores of their own, see "
                 "--no-cpu-pinning). Prefill and decode cores may overlap: both then share "
                 "them, the overlapping ranks' threads waiting passively")
    add("--no-core-lending", action="store_true",
        help="on a CPU host, disaggregated: keep each worker on its own cores (default: while "
             "a decode worker holds no request, a one-rank prefill worker runs on its cores "
             "too, checked before each layer; and while that prefill worker holds none, a "
             "one-rank decode worker paired with it alone runs on its cores, checked before "
             "each step)")
    add("--service-cores", type=parse_core_list, default=None, metavar="LIST",
        help="on a CPU host, the cores the router and store run on, e.g. '1' or '6-7' "
             "(default: see --no-cpu-pinning)")


def _add_security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security")
    add = group.add_argument
    add("--api-key", default=None, help="the router requires `Authorization: Bearer KEY` on /v1")
    add("--ops-need-api-key", action="store_true", help="/metrics and /status need the API key too")
    add("--cluster-key-file", default=None, metavar="FILE",
        help="the key of the internal sockets (CurveZMQ), given to every child; written there "
             "when missing (default: a fresh key in a private directory, gone when pdserve up "
             "stops)")
    add("--insecure-plaintext", action="store_true",
        help="internal sockets unauthenticated and unencrypted (logged loudly)")


def _add_supervision_arguments(parser: argparse.ArgumentParser) -> None:
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
    group.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                       help="keep a standby process for each ready child, its imports done, "
                            "that a restart runs at once (pdserve/app/standby.py; each holds "
                            "an interpreter with torch imported)")


def _poll_states(cluster: Cluster, client: httpx.Client) -> None:
    """Update each child's state from the router's /status (workers) and /health (router)."""
    try:
        status = client.get("/status").json()
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


SUMMARY_AFTER_CHILDREN = 12
"""Above this many children, `pdserve up` shows counts per state instead of a line each."""


def _state_counts(children: list[Child]) -> str:
    """'workers: 30 ready, 2 loading; router: ready; store: ready'."""
    workers: dict[str, int] = {}
    others = []
    for child in children:
        if child.role in ("router", "store"):
            others.append(f"{child.role}: {child.state}")
        else:
            workers[child.state] = workers.get(child.state, 0) + 1
    parts = ", ".join(f"{n} {state}" for state, n in sorted(workers.items()))
    return "; ".join([f"workers: {parts}", *others])


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
        if any(child.fork for child in cluster.children):
            from pdserve.app.launcher.forking import preload

            _say("pdserve up: simulated workers: importing their modules once, then forking "
                 "each (pdserve/app/launcher/forking.py)")
            preload(model_dir)
        # A simulated worker is forked in milliseconds (and a standby of one would hold its
        # own copy of what the fork shares)
        standbys = args.standby and args.engine != "sim"
        return _supervise(args, cluster, Supervisor(cluster, policy, state_path, _say,
                                                    standbys=standbys))


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
    # A fleet of many workers is shown as counts per state (one line when they change), not
    # a line per worker and state.
    summarize = len(cluster.children) > SUMMARY_AFTER_CHILDREN
    # One client for every poll (a client per call builds an SSL context: ~10 ms of CPU).
    client = httpx.Client(base_url=base_url, headers=headers, timeout=1.0)
    try:
        for child in cluster.children:
            child.start()
            gpus = child.env.get("CUDA_VISIBLE_DEVICES")
            on = f", GPUs {gpus}" if gpus is not None else ""
            if not summarize:
                print(f"  {child.role:<12} starting (pid {child.process.pid}{on})", flush=True)
        if summarize:
            print(f"  {len(cluster.children)} processes starting", flush=True)
        start_s = time.monotonic()
        deadline = start_s + args.ready_timeout_s
        shown = {c.role: "starting" for c in cluster.children}
        shown_counts = ""
        is_ready = False
        while True:
            supervisor.check(time.monotonic())
            if any(c.state != "ready" for c in cluster.children):  # none to ask otherwise
                _poll_states(cluster, client)
            if summarize:
                counts = _state_counts(cluster.children)
                if counts != shown_counts:
                    shown_counts = counts
                    print(f"  [{time.monotonic() - start_s:5.1f}s] {counts}", flush=True)
            for child in cluster.children:
                if child.state != shown[child.role]:
                    shown[child.role] = child.state
                    if not summarize:
                        print(f"  {child.role:<12} {child.state}", flush=True)
            if not is_ready and all(c.state == "ready" for c in cluster.children):
                is_ready = True
                print(f"pdserve is ready: {base_url}/v1  (Ctrl-C stops it)", flush=True)
            if not is_ready and time.monotonic() > deadline:
                print("pdserve up: not ready in time; stopping", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5 if is_ready else 0.2)  # sooner while starting: tests wait on it
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
        client.close()
        cluster.stop()
