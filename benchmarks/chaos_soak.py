"""Chaos soak: every role of a fleet SIGKILLed in turn under a mixed load, and nobody notices.

    python -m benchmarks.chaos_soak [--model DIR] [--duration-s 600]
        [--capacity-fraction 0.7 | --rate R]

The fleet (the Fleet class below): every role its own `pdserve <role>` process on loopback, as
on hosts of their own, and the benchmark as their supervisor:

    master ── data-0, data-1          the store: each block on both nodes (--replicas 2)
    prefill-0, prefill-1              home data node: data-0, data-1 (reads try it first)
    decode-0, decode-1
    router-0, router-1                each knows every worker; clients try router-0 first

Each process logs to RUN_DIR/<name>.log and talks CurveZMQ under one cluster key; as `pdserve
up` does, the fleet keeps a standby of each ready process (pdserve/app/standby.py), and a
restart runs it; on a host of few cores every worker takes one thread, waiting passively. Every
--kill-every-s the benchmark SIGKILLs the next of prefill-0, decode-0, master, data-1, router-0
(in turn, round and round), starts it again --restart-after-s later (the launcher's backoff),
and times it to ready.

The load: Poisson arrivals at --capacity-fraction of the capacity measured first (a closed loop
of --calibration-clients over the same mix for --calibration-s), each request one of plain
completions, greedy streams, JSON-schema chat, seeded n = 2 streams and completions with
logprobs, every prompt fresh. A client tries router-0 and, where the connection is refused,
router-1 (as a load balancer in front of both would); a stream router-0 held when it was killed
is lost with it, and counted apart.

Reports: failed requests by cause; the greedy streams' text against the offline engine's greedy
run of the same prompts; each kill's restart-to-ready time; goodput (requests that completed
within --ttft-slo-ms and --tpot-slo-ms) per 5-second window, plotted with the kills; and after
the run every KV block, hand-off lease, store lease and pin, and the store's integrity. Prints a
table, writes JSON and the plot next to --output, and prints the JSON last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve import security
from pdserve.app.launcher import spawn, start_from, stop_standby
from pdserve.app.launcher.supervision import STANDBY_STAGGER_S
from pdserve.benchmarks import server_process
from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.benchmarks.plots import pyplot, save_figure

STORE = ("master", "data-0", "data-1")
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
ROUTERS = ("router-0", "router-1")
NAMES = STORE + WORKERS + ROUTERS


class Fleet:
    def __init__(self, model: str, run_dir: Path, base_port: int, num_kv_blocks: int = 256
                 ) -> None:
        self.model, self.run_dir, self.num_kv_blocks = model, run_dir, num_kv_blocks
        self.ports = {name: base_port + i for i, name in enumerate(NAMES)}
        self.key_path = security.ClusterKey.generate().save(run_dir / "cluster.key")
        self.processes: dict[str, subprocess.Popen] = {}
        self.standbys: dict[str, subprocess.Popen] = {}

    def address(self, name: str) -> str:
        scheme = "http" if name.startswith("router") else "tcp"
        return f"{scheme}://127.0.0.1:{self.ports[name]}"

    @property
    def router_urls(self) -> list[str]:
        return [self.address(name) for name in ROUTERS]

    def argv(self, name: str) -> list[str]:
        role, _, index = name.partition("-")
        if name == "master":
            return ["store", "--role", "master", "--master-port", str(self.ports[name]),
                    "--replicas", "2", "--node-ttl-s", "4", "--transport", "zmq"]
        if role == "data":
            return ["store", "--role", "data", "--data-port", str(self.ports[name]),
                    "--node-id", name, "--master-address", self.address("master"),
                    "--heartbeat-interval-s", "0.5", "--transport", "zmq"]
        if role in ("prefill", "decode"):
            return [role, "--model", self.model, "--port", str(self.ports[name]),
                    "--worker-id", name, "--num-kv-blocks", str(self.num_kv_blocks),
                    "--cpu-threads", "1", "--store", self.address(f"data-{index}"),
                    "--store-master", self.address("master"), "--store-timeout-s", "2"]
        workers = [arg for worker in WORKERS for arg in
                   (f"--{worker.partition('-')[0]}", self.address(worker))]
        return ["router", "--model", self.model, "--port", str(self.ports[name]), *workers,
                "--heartbeat-timeout-s", "3"]

    def start(self, name: str) -> None:
        """Run `name`'s standby if one waits, else start a fresh process."""
        with open(self.run_dir / f"{name}.log", "ab") as log:
            self.processes[name] = start_from(self.standbys.pop(name, None), self.argv(name),
                                              self._env(), stdout=log.fileno())

    def prepare_standby(self, name: str) -> None:
        with open(self.run_dir / f"{name}.log", "ab") as log:
            self.standbys[name] = spawn(self.argv(name), self._env(), standby=True,
                                        stdout=log.fileno())

    def _env(self) -> dict[str, str]:
        return dict(os.environ, PDSERVE_CLUSTER_KEY_FILE=str(self.key_path),
                    PDSERVE_LOG_LEVEL="INFO", OMP_WAIT_POLICY="PASSIVE")

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would."""
        process = self.processes[name]
        process.kill()
        process.wait(10)

    def is_ready(self, name: str) -> bool:
        """Ready as the fleet sees it: a router answers /health and sees every worker ready;
        a worker is ready in a live router's view; a store process answers, and the master
        has both data nodes registered."""
        if self.processes[name].poll() is not None:
            return False
        if name in ROUTERS:
            return self.router_sees_every_worker(name)
        if name in WORKERS:
            return any(self.worker_ready_at(router, name) for router in ROUTERS)
        stats = self.store_stats(name)
        return stats is not None and (self.store_stats("master") or {}).get("num_nodes") == 2

    def store_client(self, name: str, timeout_s: float) -> Any:
        """A StoreClient of the store process `name` (the master's verbs, or a data node's)."""
        from pdserve.kvstore.client import StoreClient

        address = self.address(name)
        with security.using(security.ClusterKey.load(self.key_path)):
            if name == "master":
                return StoreClient(None, address, transport="zmq", timeout_s=timeout_s)
            return StoreClient(address, transport="zmq", timeout_s=timeout_s)

    def store_stats(self, name: str) -> dict | None:
        client = self.store_client(name, timeout_s=2)
        try:
            return client.stats()
        except Exception:  # down or starting: not ready, whatever the error
            return None
        finally:
            client.close()

    def router_status(self, router: str) -> list[dict] | None:
        try:
            if httpx.get(f"{self.address(router)}/health", timeout=2).status_code != 200:
                return None
            return httpx.get(f"{self.address(router)}/status", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def worker_ready_at(self, router: str, worker: str) -> bool:
        workers = self.router_status(router) or []
        port = f":{self.ports[worker]}"
        return any(w["address"].endswith(port) and w["is_ready"] for w in workers)

    def router_sees_every_worker(self, name: str) -> bool:
        workers = self.router_status(name)
        return workers is not None and len(workers) == len(WORKERS) and all(
            w["is_ready"] for w in workers)

    def wait_ready(self, names: tuple[str, ...] | list[str], timeout_s: float) -> float:
        """Seconds until every one of `names` answers ready (TimeoutError past timeout_s)."""
        start = time.monotonic()
        waiting = list(names)
        while waiting:
            waiting = [name for name in waiting if not self.is_ready(name)]
            if waiting and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"not ready within {timeout_s:.0f} s: {waiting}")
            if waiting:
                time.sleep(0.1)
        return time.monotonic() - start

    def start_all(self, timeout_s: float = 600.0) -> None:
        """Start every process, wait until all are ready, then their standbys (one at a
        time, STANDBY_STAGGER_S apart, as the launcher does)."""
        for name in NAMES:
            self.start(name)
        self.wait_ready(NAMES, timeout_s)
        for name in NAMES:
            self.prepare_standby(name)
            time.sleep(STANDBY_STAGGER_S)

    def stop(self) -> None:
        for standby in self.standbys.values():
            stop_standby(standby)
        self.standbys.clear()
        server_process.stop_all(list(self.processes.values()), timeout_s=20)


VICTIMS = ("prefill-0", "decode-0", "master", "data-1", "router-0")
KINDS = ("plain", "stream", "json-schema", "n2", "logprobs")
WINDOW_S = 5.0
SCHEMA = {"type": "object", "required": ["name", "tags"], "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint dir (default: the embedded tiny random model)")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=None,
                        help="Poisson arrivals per second (default: --capacity-fraction of the "
                             "measured capacity)")
    parser.add_argument("--capacity-fraction", type=float, default=0.7)
    parser.add_argument("--calibration-s", type=float, default=40.0)
    parser.add_argument("--calibration-clients", type=int, default=8)
    parser.add_argument("--kill-every-s", type=float, default=45.0)
    parser.add_argument("--first-kill-s", type=float, default=30.0)
    parser.add_argument("--restart-after-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(16, 128),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=250.0)
    parser.add_argument("--base-port", type=int, default=19400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None,
                        help="the JSON file (default: chaos_soak.json in --output-dir)")
    add_output_dir(parser, "chaos_soak")


@dataclass
class Outcome:
    kind: str
    start_s: float
    end_s: float = 0.0
    ok: bool = False
    ttft_s: float | None = None
    num_tokens: int = 0
    router: int = 0
    error: str | None = None
    prompt: str = ""
    max_tokens: int = 0
    text: str | None = None
    """A greedy stream's text, compared with the offline engine's after the run."""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.num_tokens < 2:
            return None
        return (self.end_s - self.start_s - self.ttft_s) / (self.num_tokens - 1)


@dataclass
class Kill:
    victim: str
    at_s: float
    dead_at_s: float = 0.0
    """When the process was gone (SIGKILL sent at at_s, reaped by then)."""
    restarted_at_s: float = 0.0
    ready_after_s: float | None = None
    """Restart to ready, seconds (None: not ready within the wait)."""


@dataclass
class Soak:
    kills: list[Kill] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)


# ---- one request ---------------------------------------------------------------------------
def make_request(kind: str, rng: random.Random, args: argparse.Namespace
                 ) -> tuple[str, dict[str, Any]]:
    """(path, body) of a fresh request of this kind."""
    prompt = " ".join(f"w{rng.randrange(100_000)}" for _ in range(rng.randint(8, 120)))
    max_tokens = rng.randint(*args.max_tokens)
    if kind == "json-schema":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "response_format": {
                "type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}}
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if kind in ("stream", "n2"):
        body["stream"] = True
    if kind == "n2":
        body.update(n=2, temperature=1.0, seed=rng.randrange(1 << 30))
    if kind == "logprobs":
        body["logprobs"] = 2
    return "/v1/completions", body


async def send(client: httpx.AsyncClient, urls: list[str], kind: str, path: str,
               body: dict[str, Any], t0: float) -> Outcome:
    outcome = Outcome(kind, time.monotonic() - t0, prompt=body.get("prompt", ""),
                      max_tokens=body["max_tokens"])
    pieces: list[str] = []
    for router, url in enumerate(urls):  # the next router only where this one refuses
        outcome.router = router
        try:
            await _send_to(client, f"{url}{path}", body, outcome, pieces, t0)
            break
        except httpx.ConnectError as exc:
            outcome.error = f"ConnectError: {exc}"[:200]
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"[:200]
            break
    outcome.end_s = time.monotonic() - t0
    if outcome.ok and kind == "stream":
        outcome.text = "".join(pieces)
    return outcome


async def _send_to(client: httpx.AsyncClient, url: str, body: dict[str, Any], outcome: Outcome,
                   pieces: list[str], t0: float) -> None:
    start = time.monotonic()
    if not body.get("stream"):
        r = await client.post(url, json=body)
        if r.status_code != 200:
            outcome.error = f"HTTP {r.status_code}: {r.text[:160]}"
            return
        usage = r.json()["usage"]
        outcome.ttft_s = time.monotonic() - start  # the whole answer: its first token too
        outcome.num_tokens = usage["completion_tokens"]
        outcome.ok, outcome.error = True, None
        return
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            outcome.error = f"HTTP {r.status_code}: {(await r.aread())[:160]!r}"
            return
        finished = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                outcome.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                return
            for choice in chunk.get("choices", []):
                text = choice.get("text", choice.get("delta", {}).get("content"))
                if text:
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.monotonic() - start
                    outcome.num_tokens += 1
                    pieces.append(text)
                finished += choice.get("finish_reason") is not None
    expected = body.get("n", 1)
    outcome.ok = finished == expected
    outcome.error = None if outcome.ok else f"stream ended with {finished}/{expected} finished"


# ---- load, calibration, chaos --------------------------------------------------------------
async def calibrate(urls: list[str], args: argparse.Namespace) -> float:
    """Completed requests per second of a closed loop of --calibration-clients over the mix."""
    rng = random.Random(args.seed + 7)
    done = 0
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
        async def loop() -> None:
            nonlocal done
            while time.monotonic() - t0 < args.calibration_s:
                kind = rng.choice(KINDS)
                outcome = await send(client, urls, kind, *make_request(kind, rng, args), t0)
                done += outcome.ok
        await asyncio.gather(*(loop() for _ in range(args.calibration_clients)))
    return done / (time.monotonic() - t0)


async def load(urls: list[str], rate: float, args: argparse.Namespace, soak: Soak,
               t0: float) -> None:
    rng = random.Random(args.seed)
    tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
        while time.monotonic() - t0 < args.duration_s:
            kind = KINDS[len(tasks) % len(KINDS)]
            tasks.append(asyncio.create_task(
                send(client, urls, kind, *make_request(kind, rng, args), t0)))
            await asyncio.sleep(rng.expovariate(rate))
        soak.outcomes = list(await asyncio.gather(*tasks))


async def chaos(fleet: Fleet, args: argparse.Namespace, soak: Soak, t0: float) -> None:
    """Kill, restart, wait until ready, then the next victim, until the run's last stretch."""
    await asyncio.sleep(args.first_kill_s)
    turn = 0
    while time.monotonic() - t0 < args.duration_s - args.kill_every_s / 2:
        victim = VICTIMS[turn % len(VICTIMS)]
        turn += 1
        kill = Kill(victim, time.monotonic() - t0)
        await asyncio.to_thread(fleet.kill, victim)
        kill.dead_at_s = time.monotonic() - t0
        soak.kills.append(kill)
        print(f"[{kill.at_s:6.0f} s] SIGKILL {victim}", flush=True)
        await asyncio.sleep(args.restart_after_s)
        fleet.start(victim)
        kill.restarted_at_s = time.monotonic() - t0
        try:
            kill.ready_after_s = await asyncio.to_thread(fleet.wait_ready, [victim], 120.0)
        except TimeoutError:
            print(f"  {victim} not ready within 120 s", flush=True)
        print(f"  {victim} ready {kill.ready_after_s} s after its restart", flush=True)
        fleet.prepare_standby(victim)  # for its next kill, as the launcher would
        await asyncio.sleep(max(0.0, kill.at_s + args.kill_every_s - (time.monotonic() - t0)))


async def soak_run(fleet: Fleet, rate: float, args: argparse.Namespace) -> Soak:
    soak, t0 = Soak(), time.monotonic()
    chaos_task = asyncio.create_task(chaos(fleet, args, soak, t0))
    await load(fleet.router_urls, rate, args, soak, t0)
    await chaos_task
    return soak


# ---- after the run -------------------------------------------------------------------------
def greedy_reference(model: str, outcomes: list[Outcome]) -> dict[int, str]:
    """The offline engine's greedy text of every completed greedy stream, by outcome index."""
    from pdserve.serve import LLM, SamplingParams

    picked = [(i, o) for i, o in enumerate(outcomes) if o.text is not None]
    if not picked:
        return {}
    with LLM(model) as llm:
        outs = llm.generate([o.prompt for _, o in picked],
                            [SamplingParams(temperature=0, max_tokens=o.max_tokens,
                                            ignore_eos=True) for _, o in picked])
    return {i: out.outputs[0].text for (i, _), out in zip(picked, outs, strict=True)}


def leak_check(fleet: Fleet, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    workers: list[dict] = []
    while time.monotonic() < deadline:
        workers = httpx.get(f"{fleet.router_urls[1]}/status", timeout=5).json()["workers"]
        if all(w["is_alive"] and w["num_inflight"] == 0
               and w["num_free_blocks"] == w["num_total_blocks"]
               and w.get("kv_transfer", {}).get("num_handoff_leases", 0) == 0 for w in workers):
            break
        time.sleep(1.0)
    store: dict[str, Any] = {}
    for name in ("data-0", "data-1", "master"):
        client = fleet.store_client(name, timeout_s=10)
        try:
            stats = client.stats()
            while name != "master" and (stats["num_leases"] or stats["num_pinned"]) \
                    and time.monotonic() < deadline:
                time.sleep(1.0)
                stats = client.stats()
            try:
                client.check_integrity()
                integrity = "ok"
            except AssertionError as exc:  # the point is to report it
                integrity = f"failed: {exc}"
            store[name] = {"integrity": integrity, **{
                k: stats[k] for k in ("num_leases", "num_pinned", "num_lease_groups")
                if k in stats}}
        finally:
            client.close()
    return {"workers_idle": all(w["is_alive"] and w["num_inflight"] == 0 for w in workers),
            "blocks_held": sum(w["num_total_blocks"] - w["num_free_blocks"] for w in workers),
            "handoff_leases": sum(w.get("kv_transfer", {}).get("num_handoff_leases", 0)
                                  for w in workers),
            "store": store}


def held_by_killed_router(outcome: Outcome, kills: list[Kill]) -> bool:
    """A request router-0 held when it was killed (lost with it, as the issue allows): sent
    to it before it was gone, and not over before the SIGKILL."""
    return outcome.router == 0 and any(
        k.victim == ROUTERS[0] and outcome.start_s <= max(k.dead_at_s, k.at_s)
        and outcome.end_s >= k.at_s for k in kills)


def goodput_windows(outcomes: list[Outcome], args: argparse.Namespace) -> list[float]:
    """Requests per second completed within both SLOs, per WINDOW_S window of completion."""
    windows = [0.0] * (int(args.duration_s // WINDOW_S) + 1)
    for o in outcomes:
        tpot = o.tpot_s
        if o.ok and o.ttft_s is not None and o.ttft_s * 1e3 <= args.ttft_slo_ms and (
                tpot is None or tpot * 1e3 <= args.tpot_slo_ms):
            index = min(int(o.end_s // WINDOW_S), len(windows) - 1)
            windows[index] += 1 / WINDOW_S
    return windows


def summarise(soak: Soak, reference: dict[int, str], leaks: dict[str, Any], rate: float,
              capacity: float | None, args: argparse.Namespace) -> dict[str, Any]:
    failed = [o for o in soak.outcomes if not o.ok]
    lost = [o for o in failed if held_by_killed_router(o, soak.kills)]
    other = [o for o in failed if o not in lost]
    mismatched = [i for i, text in reference.items() if soak.outcomes[i].text != text]
    return {
        "duration_s": args.duration_s, "rate": rate, "capacity_req_s": capacity,
        "capacity_fraction": None if capacity is None else rate / capacity,
        "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
        "requests": len(soak.outcomes), "by_kind": dict(Counter(o.kind for o in soak.outcomes)),
        "completed": len(soak.outcomes) - len(failed), "failed": len(other),
        "lost_with_killed_router": len(lost),
        "failed_by_kind": dict(Counter(o.kind for o in other)),
        "errors": [{"at_s": round(o.start_s, 1), "kind": o.kind, "error": o.error}
                   for o in other][:50],
        "greedy_streams_compared": len(reference), "greedy_streams_differing": len(mismatched),
        "kills": [asdict(k) for k in soak.kills],
        "goodput_window_s": WINDOW_S, "goodput_per_window": goodput_windows(soak.outcomes, args),
        "after_the_run": leaks,
        "outcomes": [asdict(o) for o in soak.outcomes],
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4))
    windows = result["goodput_per_window"]
    times = [(i + 0.5) * result["goodput_window_s"] for i in range(len(windows))]
    ax.plot(times, windows, color="tab:blue", label="goodput (req/s within SLOs)")
    ax.axhline(result["rate"], color="tab:gray", linestyle="--", label="offered rate")
    for kill in result["kills"]:
        ax.axvline(kill["at_s"], color="tab:red", linestyle=":")
        ready = kill["ready_after_s"]
        label = f"{kill['victim']} ({ready:.1f} s)" if ready is not None else kill["victim"]
        ax.text(kill["at_s"], 0.98, label, rotation=90, fontsize=7, va="top",
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests / s")
    ax.set_title(f"chaos soak: {result['failed']} failed of {result['requests']}, "
                 f"{result['greedy_streams_differing']} of {result['greedy_streams_compared']} "
                 "greedy streams differ")
    ax.legend(loc="lower left")
    return save_figure(fig, plt, path)


def print_table(result: dict[str, Any]) -> None:
    print(f"rate {result['rate']:.2f} req/s (capacity {result['capacity_req_s']}), "
          f"{result['requests']} requests {result['by_kind']}")
    print(f"completed {result['completed']}  failed {result['failed']}  lost with the killed "
          f"router {result['lost_with_killed_router']}  greedy streams differing "
          f"{result['greedy_streams_differing']}/{result['greedy_streams_compared']}")
    for kill in result["kills"]:
        print(f"  {kill['at_s']:6.0f} s  {kill['victim']:<10} ready "
              f"{kill['ready_after_s']} s after its restart")
    for error in result["errors"][:5]:
        print(f"  failed at {error['at_s']} s ({error['kind']}): {error['error']}")
    print("after the run:", json.dumps(result["after_the_run"]))


def run(args: argparse.Namespace) -> int:
    from pdserve.serve.default_model import default_model_dir

    model = args.model or str(default_model_dir())
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        fleet = Fleet(model, Path(tmp), args.base_port)
        try:
            fleet.start_all()
            capacity = None
            rate = args.rate
            if rate is None:
                capacity = asyncio.run(calibrate(fleet.router_urls, args))
                rate = args.capacity_fraction * capacity
                print(f"capacity {capacity:.2f} req/s: load at {rate:.2f} req/s", flush=True)
            soak = asyncio.run(soak_run(fleet, rate, args))
            fleet.wait_ready(list(fleet.processes), 120)  # the last victim back
            leaks = leak_check(fleet)
        finally:
            fleet.stop()
    reference = greedy_reference(model, soak.outcomes)
    result = summarise(soak, reference, leaks, rate, capacity, args)
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
