"""`pdserve up`: a whole cluster on one host, for a first look and for end-to-end tests.

Starts the KV store, the workers (prefill + decode, or colocated) and the router as child
processes on loopback, prints one status line per role as it becomes ready, then the URL.
Ctrl-C (or SIGTERM) stops every process it started. Each role is an ordinary `pdserve <role>`
command, so the same flags run one role per machine in a real cluster.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.router.server import add_controller_arguments, controller_argv

logger = logging.getLogger(__name__)


@dataclass
class Child:
    role: str
    argv: list[str]
    process: subprocess.Popen | None = None
    state: str = "starting"

    def start(self) -> None:
        # A session of its own: Ctrl-C reaches only the launcher, which stops the children
        # in order (router, workers, store), so none waits on a peer that is already gone.
        self.process = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *self.argv],
                                        start_new_session=True)

    @property
    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None


@dataclass
class Cluster:
    children: list[Child] = field(default_factory=list)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the children in reverse start order, each group waited for in turn."""
        groups = [[c for c in self.children if c.role == "router"],
                  [c for c in self.children if c.role not in ("router", "store")],
                  [c for c in self.children if c.role == "store"]]
        for group in groups:
            running = [c.process for c in group if c.process and c.process.poll() is None]
            for process in running:
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for process in running:
                try:
                    process.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)


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
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE models: every worker spreads whole experts over its TP ranks")
    parser.add_argument("--worker-base-port", type=int, default=18100,
                        help="workers listen on consecutive ports from here")
    parser.add_argument("--store-port", type=int, default=18050,
                        help="KV store master port (the data server takes the next one)")
    parser.add_argument("--no-store", action="store_true",
                        help="run without the KV store (decode recomputes the prompt)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV blocks per worker (default: sized from memory)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    add_controller_arguments(parser)


def plan(args: argparse.Namespace, model_dir: str) -> Cluster:
    """The children `pdserve up` starts, in start order (store, workers, router)."""
    cluster = Cluster()
    store_addr = None
    if args.mode == "disagg" and not args.no_store:
        master_addr = f"tcp://127.0.0.1:{args.store_port}"
        store_addr = f"tcp://127.0.0.1:{args.store_port + 1}"
        cluster.children.append(Child("store", [
            "store", "--role", "all", "--master-port", str(args.store_port),
            "--data-port", str(args.store_port + 1)]))
    router_argv = ["router", "--model", model_dir, "--host", args.host, "--port", str(args.port),
                   *controller_argv(args)]
    if store_addr:
        router_argv += ["--store-master", master_addr]
    port = args.worker_base_port
    roles = ([("colocated", 1, args.prefill_tp)] if args.mode == "colocated" else
             [("prefill", args.num_prefill, args.prefill_tp),
              ("decode", args.num_decode, args.decode_tp)])
    # On a CPU host every rank of every worker shares the cores: give each its share, as
    # pinning does for real deployments, so one worker's burst does not starve another.
    num_ranks = sum(count * tp for _, count, tp in roles)
    cpu_threads = None if _has_cuda() else max(1, (os.cpu_count() or 1) // num_ranks)
    for role, count, tp in roles:
        for i in range(count):
            argv = [role, "--model", model_dir, "--port", str(port),
                    "--tensor-parallel-size", str(tp), "--worker-id", f"{role}-{i}"]
            if store_addr:
                argv += ["--store", store_addr, "--store-master", master_addr]
            if args.num_kv_blocks:
                argv += ["--num-kv-blocks", str(args.num_kv_blocks)]
            if args.enable_expert_parallel:
                argv.append("--enable-expert-parallel")
            if cpu_threads is not None:
                argv += ["--cpu-threads", str(cpu_threads)]
            cluster.children.append(Child(f"{role}-{i}", argv))
            router_argv += [f"--{role}", f"tcp://127.0.0.1:{port}"]
            port += 1
    cluster.children.append(Child("router", router_argv))
    return cluster


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _poll_states(cluster: Cluster, base_url: str) -> None:
    """Update each child's state from the router's /status (workers) and /health (router)."""
    try:
        status = httpx.get(f"{base_url}/status", timeout=1.0).json()
    except (httpx.HTTPError, ValueError):
        return
    by_id = {w.get("worker_id"): w for w in status.get("workers", [])}
    for child in cluster.children:
        if child.role == "router":
            child.state = "ready" if status.get("ready") else "waiting for workers"
        elif child.role == "store":
            child.state = "ready" if status.get("store_ready", True) else child.state
        elif child.role in by_id:
            child.state = "ready" if by_id[child.role].get("is_ready") else "loading"


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
    cluster = plan(args, model_dir)
    base_url = f"http://{args.host}:{args.port}"
    # SIGINT too: a shell starts background jobs with SIGINT ignored, and `kill -INT` must
    # still stop the cluster.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for child in cluster.children:
            child.start()
            print(f"  {child.role:<12} starting (pid {child.process.pid})", flush=True)
        deadline = time.monotonic() + args.ready_timeout_s
        shown = {c.role: "starting" for c in cluster.children}
        while True:
            dead = [c for c in cluster.children if c.exited]
            if dead:
                print(f"pdserve up: {dead[0].role} exited with code "
                      f"{dead[0].process.returncode}; stopping", file=sys.stderr, flush=True)
                return 1
            _poll_states(cluster, base_url)
            for child in cluster.children:
                if child.state != shown[child.role]:
                    shown[child.role] = child.state
                    print(f"  {child.role:<12} {child.state}", flush=True)
            if all(c.state == "ready" for c in cluster.children):
                break
            if time.monotonic() > deadline:
                print("pdserve up: not ready in time; stopping", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        print(f"pdserve is ready: {base_url}/v1  (Ctrl-C stops it)", flush=True)
        while not any(c.exited for c in cluster.children):
            time.sleep(0.5)
        dead = next(c for c in cluster.children if c.exited)
        print(f"pdserve up: {dead.role} exited; stopping", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("pdserve up: stopping", flush=True)
        return 0
    finally:
        cluster.stop()
