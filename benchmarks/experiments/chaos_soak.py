"""Chaos soak: mixed streaming load on `pdserve up` (2 prefill + 2 decode workers and the
store, loopback only) while a worker or the store is SIGKILLed every 30-60 s and the
launcher restarts it.

    python -m pdserve.benchmarks.experiments.chaos_soak [--model DIR] [--duration-s 600] [--rate 2]

What it shows: requests survive their workers. A decode worker killed mid-stream hands its
streams to the other (router/dispatch.py migration: prompt + outputs so far, recomputed); a
prefill worker killed mid-prompt has its requests retried on the other; a killed store costs
prefix hits, not requests. It reports requests completed, migrated (the router's
pdserve:request_migrations_total), failed (with their errors: there should be none while a
worker of each pool is left), restarts (pdserve:process_restarts_total) and TTFT, and after
the run checks that nothing leaked: every worker idle with all KV blocks free and no hand-off
lease, the store holding no lease or pin, and the store's own integrity check passing.
Prints a table, writes JSON and a timeline plot next to --output, and prints the JSON last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.benchmarks.plots import pyplot, save_figure

VICTIMS = ("prefill-0", "prefill-1", "decode-0", "decode-1", "store")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint dir (default: the embedded tiny random model)")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--kill-every-s", type=float, nargs=2, default=(30.0, 60.0),
                        metavar=("MIN", "MAX"), help="seconds between kills, uniform")
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(16, 256),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--base-port", type=int, default=19400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None,
                        help="the JSON file (default: chaos_soak.json in --output-dir)")
    add_output_dir(parser, "chaos_soak")
    parser.add_argument("--log", default="/tmp/pdserve-chaos-soak.log",
                        help="where `pdserve up` and its children log")


@dataclass
class Outcome:
    start_s: float
    ok: bool
    ttft_s: float | None = None
    num_tokens: int = 0
    error: str | None = None


@dataclass
class Soak:
    kills: list[tuple[float, str]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)


# ---- the cluster ---------------------------------------------------------------------------
def start_up(args: argparse.Namespace, run_dir: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pdserve.app.cli", "up", "--num-prefill", "2", "--num-decode",
            "2", "--port", str(args.base_port), "--store-port", str(args.base_port + 10),
            "--worker-base-port", str(args.base_port + 20), "--restart-backoff-s", "1",
            "--cluster-key-file", str(run_dir / "cluster.key")]
    if args.model:
        argv += ["--model", args.model]
    log = open(args.log, "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def children(up_pid: int) -> dict[str, int]:
    """The launcher's children by role name (prefill-0, ..., store, router) -> pid."""
    found: dict[str, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            argv = Path(entry.path, "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != up_pid or "pdserve.app.cli" not in argv:
            continue
        role = argv[argv.index("pdserve.app.cli") + 1]
        if "--worker-id" in argv:
            role = argv[argv.index("--worker-id") + 1]
        found[role] = int(entry.name)
    return found


def wait_ready(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            workers = httpx.get(f"{base_url}/status", timeout=2).json()["workers"]
            if len(workers) == 4 and all(w["is_ready"] for w in workers):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the cluster was not ready within {timeout_s:.0f} s")


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


# ---- load and chaos ------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, t0: float,
                      args: argparse.Namespace) -> Outcome:
    words = " ".join(f"w{rng.randrange(10_000)}" for _ in range(rng.randint(8, 200)))
    body = {"prompt": words, "max_tokens": rng.randint(*args.max_tokens), "stream": True,
            "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    outcome = Outcome(start - t0, ok=False)
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                outcome.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return outcome
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return outcome
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - start
                outcome.num_tokens += 1
        outcome.ok = outcome.num_tokens == body["max_tokens"]
        if not outcome.ok:
            outcome.error = f"stream ended after {outcome.num_tokens}/{body['max_tokens']}"
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
    return outcome


async def load(base_url: str, args: argparse.Namespace, soak: Soak, t0: float) -> None:
    rng = random.Random(args.seed)
    url = f"{base_url}/v1/completions"
    tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        while time.monotonic() - t0 < args.duration_s:
            tasks.append(asyncio.create_task(one_request(client, url, rng, t0, args)))
            await asyncio.sleep(rng.expovariate(args.rate))
        soak.outcomes = list(await asyncio.gather(*tasks))


async def chaos(up_pid: int, args: argparse.Namespace, soak: Soak, t0: float) -> None:
    rng = random.Random(args.seed + 1)
    while True:
        await asyncio.sleep(rng.uniform(*args.kill_every_s))
        if time.monotonic() - t0 >= args.duration_s - 10:
            return
        victim = rng.choice(VICTIMS)
        pid = children(up_pid).get(victim)
        if pid is None:
            continue  # still restarting from the last kill
        os.kill(pid, signal.SIGKILL)
        soak.kills.append((time.monotonic() - t0, victim))
        print(f"[{time.monotonic() - t0:6.0f} s] SIGKILL {victim} (pid {pid})", flush=True)


async def soak_run(base_url: str, up_pid: int, args: argparse.Namespace) -> Soak:
    soak, t0 = Soak(), time.monotonic()
    chaos_task = asyncio.create_task(chaos(up_pid, args, soak, t0))
    await load(base_url, args, soak, t0)
    chaos_task.cancel()
    return soak


# ---- after the run -------------------------------------------------------------------------
def leak_check(base_url: str, key_path: Path, store_port: int, timeout_s: float = 60.0
               ) -> dict[str, Any]:
    from pdserve import security
    from pdserve.kvstore.client import StoreClient

    deadline = time.monotonic() + timeout_s
    workers: list[dict] = []
    while time.monotonic() < deadline:
        workers = httpx.get(f"{base_url}/status", timeout=5).json()["workers"]
        if all(w["is_alive"] and w["num_inflight"] == 0
               and w["num_free_blocks"] == w["num_total_blocks"]
               and w.get("kv_transfer", {}).get("num_handoff_leases", 0) == 0 for w in workers):
            break
        time.sleep(1.0)
    with security.using(security.ClusterKey.load(key_path)):
        store = StoreClient(f"tcp://127.0.0.1:{store_port + 1}",
                            f"tcp://127.0.0.1:{store_port}", transport="zmq", timeout_s=10)
    try:
        while True:
            stats = store.stats()
            if (stats["num_leases"] == 0 and stats["num_pinned"] == 0) \
                    or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        integrity = "ok"
        try:
            store.check_integrity()
        except Exception as exc:  # the point is to report it
            integrity = f"failed: {exc}"
    finally:
        store.close()
    return {
        "workers_idle": all(w["is_alive"] and w["num_inflight"] == 0 for w in workers),
        "blocks_held": sum(w["num_total_blocks"] - w["num_free_blocks"] for w in workers),
        "handoff_leases": sum(w.get("kv_transfer", {}).get("num_handoff_leases", 0)
                              for w in workers),
        "store_leases": stats["num_leases"], "store_pinned": stats["num_pinned"],
        "store_integrity": integrity,
    }


def failure_cause(error: str) -> str:
    """A failure's kind: no worker of a pool was left (what the issue allows), or another."""
    if "no other" in error or "worker is ready" in error:
        return "no worker of the pool left"
    if error.startswith("HTTP "):
        return error.split(":", 1)[0]
    if error.startswith("stream ended"):
        return "stream ended early"
    return error.split(":", 1)[0]


def summarise(soak: Soak, base_url: str, leaks: dict[str, Any], args: argparse.Namespace
              ) -> dict[str, Any]:
    done = [o for o in soak.outcomes if o.ok]
    failed = [o for o in soak.outcomes if not o.ok]
    ttfts = np.array([o.ttft_s for o in done if o.ttft_s is not None]) * 1e3
    return {
        "duration_s": args.duration_s, "rate": args.rate,
        "requests": len(soak.outcomes), "completed": len(done), "failed": len(failed),
        "migrated": metric(base_url, "pdserve:request_migrations_total"),
        "restarts": metric(base_url, "pdserve:process_restarts_total"),
        "kills": [{"at_s": round(t, 1), "victim": v} for t, v in soak.kills],
        "ttft_ms": {"mean": float(ttfts.mean()) if ttfts.size else None,
                    "p50": float(np.percentile(ttfts, 50)) if ttfts.size else None,
                    "p99": float(np.percentile(ttfts, 99)) if ttfts.size else None},
        "failed_by_cause": dict(Counter(failure_cause(o.error or "") for o in failed)),
        "errors": [{"at_s": round(o.start_s, 1), "error": o.error} for o in failed][:50],
        "log": args.log,
        "after_the_run": leaks,
        "outcomes": [asdict(o) for o in soak.outcomes],
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    outcomes = result["outcomes"]
    ok = [(o["start_s"], o["ttft_s"] * 1e3) for o in outcomes if o["ok"] and o["ttft_s"]]
    bad = [o["start_s"] for o in outcomes if not o["ok"]]
    if ok:
        ax.scatter(*zip(*ok, strict=True), s=8, label="completed: TTFT", color="tab:blue")
    top = max((t for _, t in ok), default=1000.0)
    if bad:
        ax.scatter(bad, [top] * len(bad), marker="x", color="tab:red", label="failed")
    for kill in result["kills"]:
        ax.axvline(kill["at_s"], color="gray", linestyle=":")
        ax.text(kill["at_s"], 0.02, kill["victim"], rotation=90, fontsize=7, va="bottom",
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("request start (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"chaos soak: {result['completed']}/{result['requests']} completed, "
                 f"{result['migrated']:.0f} migrated, {len(result['kills'])} kills")
    ax.legend(loc="lower right")
    return save_figure(fig, plt, path)


def print_table(result: dict[str, Any]) -> None:
    ttft = result["ttft_ms"]
    print(f"requests {result['requests']}  completed {result['completed']}  failed "
          f"{result['failed']}  migrated {result['migrated']:.0f}  kills {len(result['kills'])}"
          f"  restarts {result['restarts']:.0f}")
    if ttft["mean"] is not None:
        print(f"TTFT ms: mean {ttft['mean']:.0f}  p50 {ttft['p50']:.0f}  p99 {ttft['p99']:.0f}")
    print("failed by cause:", json.dumps(result["failed_by_cause"]))
    for error in result["errors"][:5]:
        print(f"  failed at {error['at_s']} s: {error['error']}")
    print("after the run:", json.dumps(result["after_the_run"]))


def run(args: argparse.Namespace) -> int:
    base_url = f"http://127.0.0.1:{args.base_port}"
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
        run_dir = Path(tmp)
        up = start_up(args, run_dir)
        try:
            wait_ready(base_url, 600)
            print(f"cluster ready: {children(up.pid)}; soaking for {args.duration_s:.0f} s",
                  flush=True)
            soak = asyncio.run(soak_run(base_url, up.pid, args))
            wait_ready(base_url, 120)  # the last victim back
            leaks = leak_check(base_url, run_dir / "cluster.key", args.base_port + 10)
            result = summarise(soak, base_url, leaks, args)
        finally:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
    output = output_path(args, "chaos_soak", "chaos_soak.json", args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    print_table(result)
    print(f"plot: {plot(result, output.with_suffix('.png'))}")
    output.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "outcomes"}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
