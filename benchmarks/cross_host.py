"""The stall after the first token across hosts (issue #56): 1P+1D on two emulated hosts
against a colocated worker, at three link rates and in two shapes; and a decode host's link
cut under a streamed load. Needs root (pdserve/benchmarks/hosts.py).

    sudo python -m benchmarks.cross_host [--model DIR] [--num-requests 24]
        [--links 10000 1000 100] [--shapes one-core spare-core] [--no-fault]

Stall study, per shape: host h1 runs the store, the prefill worker and the colocated worker,
host h2 the decode worker; the two routers (one over 1P+1D, one over the colocated worker)
and this client run outside, on this machine's namespace, the routers on h2's core, as
`pdserve up` shares services with decode. Every worker has --no-handoff-shm (no same-host
copy could cross hosts anyway) and one forward thread. For each link rate (every host's link
shaped both ways), one request at a time, fresh random prompts of --prompt-len tokens asking
for --max-tokens (ignore_eos, greedy), the colocated worker then 1P+1D, each after warm-up.
Shapes:
  one-core    h1's roles all on core 0, h2's on core 1 (each host one core)
  spare-core  h1's roles on cores 0 and 1 (its hand-off threads may run beside the forward,
              which is still one thread: a GPU host with CPU to spare), h2's on core 1
Reported per setup: median TTFT, mean TPOT, p99 and median inter-token gap, the median first
gap (first token to second: the stall), the bytes h1 sent and h2 received over their links,
and the CPU seconds of the prefill worker's nice-19 threads (its hand-off node's sends and the
store write-back) per GB that crossed. The wire time of a prompt's KV at the link's rate,
beside the first gap and the sender's CPU, says which limit a stall hits.

Fault study: h1 store + prefill, h2 and h3 one decode worker each, 1 Gbit/s links, a Poisson
stream; h2's link goes down for --fault-down-s seconds while it runs. Counted: completed and
failed requests, when the router saw decode-0 leave and come back, and what is held after
(workers' blocks, in-flight requests and hand-off leases, from the router's /status).

JSON and a plot go to --output-dir (default $PDSERVE_RESULTS_DIR/cross_host).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.benchmarks import server_process
from pdserve.benchmarks.arrivals import ArrivalConfig, arrival_offsets_s
from pdserve.benchmarks.bench_serve import run_load
from pdserve.benchmarks.client import (
    EndpointConfig,
    RequestOutcome,
    list_models,
    send_request,
)
from pdserve.benchmarks.datasets import BenchRequest, TokenCodec
from pdserve.benchmarks.hosts import EmulatedHosts, LinkBytes, why_unavailable
from pdserve.benchmarks.offline import mid_model_dir
from pdserve.benchmarks.output import add_output_dir, output_dir
from pdserve.benchmarks.plots import pyplot, save_figure, save_json
from pdserve.benchmarks.vllm_datasets import random_requests

SHAPES: dict[str, dict[str, list[int]]] = {
    "one-core": {"h1": [0], "h2": [1], "outside": [1]},
    "spare-core": {"h1": [0, 1], "h2": [1], "outside": [1]},
}
STORE_MASTER_PORT, STORE_DATA_PORT = 7600, 7601
PREFILL_PORT, DECODE_PORT, COLOCATED_PORT = 8100, 8101, 8110
NUM_WARMUP = 2
CLK_TCK = os.sysconf("SC_CLK_TCK")


def pdserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.app.cli", *args]


# ---- a fleet on emulated hosts ---------------------------------------------------------
@dataclass
class Fleet:
    hosts: EmulatedHosts
    log_dir: Path
    model: str
    cpu_tuning: bool = False
    """Each worker measures its CPU path at start (minutes on this box, and noisy enough to
    choose differently per worker); off, every worker serves the default path."""
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    routers: dict[str, str] = field(default_factory=dict)
    """setup -> router base URL"""
    router_processes: list[subprocess.Popen] = field(default_factory=list)

    def store_argv(self) -> list[str]:
        return ["--store", f"tcp://{self.hosts.address(0)}:{STORE_DATA_PORT}",
                "--store-master", f"tcp://{self.hosts.address(0)}:{STORE_MASTER_PORT}"]

    def start_store(self, cores: list[int]) -> None:
        self.workers["store"] = self.hosts.spawn(
            0, pdserve_argv("store", "--role", "all", "--host", self.hosts.address(0),
                            "--master-port", str(STORE_MASTER_PORT),
                            "--data-port", str(STORE_DATA_PORT)),
            cores, log=self.log_dir / "store.log")

    def start_worker(self, name: str, role: str, host: int, port: int, cores: list[int]
                     ) -> None:
        env = dict(os.environ)
        if not self.cpu_tuning:
            env["PDSERVE_CPU_TUNING"] = "0"
        argv = [role, "--model", self.model, "--host", self.hosts.address(host),
                "--port", str(port), "--worker-id", name, "--cpu-threads", "1",
                *self.store_argv()]
        if role != "colocated":
            argv.append("--no-handoff-shm")
        if role == "prefill":
            argv += ["--max-prefills-per-step", "1"]  # as `pdserve up` runs a CPU prefill
        self.workers[name] = self.hosts.spawn(host, pdserve_argv(*argv), cores, env=env,
                                              log=self.log_dir / f"{name}.log")

    def start_router(self, setup: str, port: int, worker_flags: list[str],
                     cores: list[int]) -> None:
        argv = ["taskset", "-c", ",".join(map(str, cores)), *pdserve_argv(
            "router", "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
            "--store-master", f"tcp://{self.hosts.address(0)}:{STORE_MASTER_PORT}",
            *worker_flags)]
        url = f"http://127.0.0.1:{port}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.router_processes.append(server_process.start(
            argv, self.log_dir / f"router-{setup}.log", f"{url}/health", timeout_s=600))
        self.routers[setup] = url

    def stop(self) -> None:
        server_process.stop_all(self.router_processes)
        for process in self.workers.values():
            self.hosts.stop(process)

    def role_pid(self, name: str) -> int | None:
        """The role's process as this machine numbers it."""
        return self.hosts.host_pid(self.workers[name])


def cpu_seconds(pid: int | None) -> tuple[float, float]:
    """(all threads, nice-19 threads) CPU seconds of process `pid` so far."""
    if pid is None:
        return 0.0, 0.0
    total = low = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after "pid (comm)": state is fields[0], utime [11], stime [12], nice [16]
        seconds = (int(fields[11]) + int(fields[12])) / CLK_TCK
        total += seconds
        if int(fields[16]) == 19:
            low += seconds
    return total, low


# ---- the stall study -------------------------------------------------------------------
def summarize(outcomes: Sequence[RequestOutcome], max_tokens: int) -> dict[str, Any]:
    ok = [o for o in outcomes if o.success]
    if not ok:
        raise RuntimeError(f"every request failed, e.g. {outcomes[0].error}")
    gaps = [g for o in ok for g in o.itl_s]
    tpots = [(o.latency_s - o.ttft_s) / (max_tokens - 1) for o in ok]
    return {
        "num_requests": len(outcomes), "num_failed": len(outcomes) - len(ok),
        "ttft_p50_ms": 1000 * statistics.median(o.ttft_s for o in ok),
        "tpot_mean_ms": 1000 * statistics.fmean(tpots),
        "itl_p99_ms": 1000 * float(np.percentile(gaps, 99)),
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "first_gap_p50_ms": 1000 * statistics.median(o.itl_s[0] for o in ok if o.itl_s),
        "latency_p50_ms": 1000 * statistics.median(o.latency_s for o in ok),
        "num_cached_tokens": sum(o.cached_tokens or 0 for o in ok),
    }


async def endpoint_of(http: httpx.AsyncClient, url: str) -> EndpointConfig:
    """Greedy, ignore_eos completions of the model the router serves."""
    model = (await list_models(http, url))[0]
    return EndpointConfig(url, model, ignore_eos=True, request_timeout_s=120,
                          extra_body={"temperature": 0})


async def one_at_a_time(url: str, requests: Sequence[BenchRequest]) -> list[RequestOutcome]:
    async with httpx.AsyncClient(timeout=120) as http:
        endpoint = await endpoint_of(http, url)
        return [await send_request(http, endpoint, r) for r in requests]


def handoff_sources(url: str) -> dict[str, float]:
    """The decode workers' hand-off choices so far (transfer, store, recompute: pdserve/
    handoff/link_policy.py) and the rates they measured per peer, from the router's /status."""
    workers = httpx.get(f"{url}/status", timeout=5).json()["workers"]
    return {name: value for w in workers if w["role"] == "decode"
            for name, value in w.get("kv_transfer", {}).items()
            if name.startswith(("handoff_source_", "link_bytes_per_s:",
                                "recompute_prefill_tokens_per_s"))}


def measure(fleet: Fleet, setup: str, requests: Sequence[BenchRequest],
            args: argparse.Namespace) -> dict[str, Any]:
    hosts = fleet.hosts
    name = "colocated" if setup == "colocated" else "prefill"
    pids = {role: fleet.role_pid(role) for role in (name, "decode-0") if role in fleet.workers}
    asyncio.run(one_at_a_time(fleet.routers[setup], requests[:NUM_WARMUP]))
    links_before = [hosts.link_bytes(i) for i in (0, 1)]
    cpu_before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    sources_before = handoff_sources(fleet.routers[setup])
    start_s = time.monotonic()
    outcomes = asyncio.run(one_at_a_time(fleet.routers[setup],
                                         requests[NUM_WARMUP:]))
    wall_s = time.monotonic() - start_s
    moved: list[LinkBytes] = [hosts.link_bytes(i) - links_before[i] for i in (0, 1)]
    result = summarize(outcomes, args.max_tokens)
    n = len(outcomes)
    result.update({
        "wall_s": wall_s,
        "h1_sent_mib_per_request": moved[0].sent / n / 2**20,
        "h1_received_mib_per_request": moved[0].received / n / 2**20,
        "h2_received_mib_per_request": moved[1].received / n / 2**20,
        "h2_sent_mib_per_request": moved[1].sent / n / 2**20,
    })
    for role, pid in pids.items():
        total, low = (a - b for a, b in zip(cpu_seconds(pid), cpu_before[role], strict=True))
        result[f"{role}_cpu_s_per_request"] = total / n
        result[f"{role}_nice19_cpu_s_per_request"] = low / n
    sources = handoff_sources(fleet.routers[setup])
    result["handoff_sources"] = {  # this run's choices, and the rates measured by its end
        name: value - sources_before.get(name, 0.0) if name.startswith("handoff_") else value
        for name, value in sources.items()}
    if setup == "disagg" and moved[0].sent:
        result["sender_nice19_cpu_s_per_gb"] = (
            result["prefill_nice19_cpu_s_per_request"] * n / (moved[0].sent / 1e9))
    return result


def start_stall_fleet(hosts: EmulatedHosts, shape: str, model: str, log_dir: Path,
                      base_port: int, cpu_tuning: bool) -> Fleet:
    cores = SHAPES[shape]
    fleet = Fleet(hosts, log_dir, model, cpu_tuning)
    fleet.start_store(cores["h1"])
    fleet.start_worker("prefill", "prefill", 0, PREFILL_PORT, cores["h1"])
    fleet.start_worker("colocated", "colocated", 0, COLOCATED_PORT, cores["h1"])
    fleet.start_worker("decode-0", "decode", 1, DECODE_PORT, cores["h2"])
    a1, a2 = hosts.address(0), hosts.address(1)
    fleet.start_router("disagg", base_port, ["--prefill", f"tcp://{a1}:{PREFILL_PORT}",
                                             "--decode", f"tcp://{a2}:{DECODE_PORT}"],
                       cores["outside"])
    fleet.start_router("colocated", base_port + 1,
                       ["--colocated", f"tcp://{a1}:{COLOCATED_PORT}"], cores["outside"])
    return fleet


def run_stall(args: argparse.Namespace, codec: TokenCodec, log_dir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    seed = args.seed
    for shape in args.shapes:
        print(f"== shape {shape}", flush=True)
        with EmulatedHosts(2) as hosts:
            fleet = start_stall_fleet(hosts, shape, args.model, log_dir / shape, args.base_port,
                                      args.cpu_tuning)
            try:
                for rate in args.links:
                    hosts.set_all_rates(rate)
                    for setup in ("colocated", "disagg"):
                        seed += 1
                        requests = random_requests(codec, NUM_WARMUP + args.num_requests,
                                                   args.prompt_len, args.max_tokens, seed=seed)
                        run = measure(fleet, setup, requests, args)
                        run["link_mbit"] = rate
                        run["kv_wire_ms"] = (args.kv_mib * 2**20 * 8 / (rate * 1e6)) * 1000
                        results.setdefault(shape, {}).setdefault(str(rate), {})[setup] = run
                        print(f"  {rate:>6} Mbit/s {setup:<9} " + format_run(run), flush=True)
            finally:
                fleet.stop()
    return results


def format_run(run: dict[str, Any]) -> str:
    text = (f"TTFT p50 {run['ttft_p50_ms']:.0f} ms, TPOT {run['tpot_mean_ms']:.1f} ms, "
            f"gap p99 {run['itl_p99_ms']:.0f} ms, first gap p50 {run['first_gap_p50_ms']:.0f}"
            f" ms, h1 sent {run['h1_sent_mib_per_request']:.1f} MiB/req")
    if "sender_nice19_cpu_s_per_gb" in run:
        text += f", sender {run['sender_nice19_cpu_s_per_gb']:.2f} CPU s/GB"
    chosen = {name.removeprefix("handoff_source_"): int(value)
              for name, value in run.get("handoff_sources", {}).items()
              if name.startswith("handoff_source_") and value}
    if chosen:
        text += f", latency p50 {run['latency_p50_ms']:.0f} ms, KV source {chosen}"
    if run["num_failed"]:
        text += f", {run['num_failed']} FAILED"
    return text


# ---- the fault study -------------------------------------------------------------------
async def watch_worker(url: str, worker: str, t0: float, stop: asyncio.Event
                       ) -> list[tuple[float, bool]]:
    """(seconds since t0, is_alive) of `worker` in the router's /status, on every change."""
    changes: list[tuple[float, bool]] = []
    async with httpx.AsyncClient(timeout=5) as http:
        while not stop.is_set():
            try:
                workers = (await http.get(f"{url}/status")).json()["workers"]
                alive = any(w["worker_id"] == worker and w["is_alive"]
                            for w in workers)
            except (httpx.HTTPError, ValueError, KeyError):
                alive = None
            if alive is not None and (not changes or changes[-1][1] != alive):
                changes.append((round(time.monotonic() - t0, 2), alive))
            await asyncio.sleep(0.25)
    return changes


def held_after(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        workers = httpx.get(f"{url}/status", timeout=5).json()["workers"]
        held = {
            "workers_alive": all(w["is_alive"] for w in workers),
            "inflight": sum(w["num_inflight"] for w in workers),
            "blocks_held": sum(w["num_total_blocks"] - w["num_free_blocks"] for w in workers),
            "handoff_leases": sum(w.get("kv_transfer", {}).get("num_handoff_leases", 0)
                                  for w in workers)}
        if (held["workers_alive"] and not held["inflight"] and not held["blocks_held"]
                and not held["handoff_leases"]) or time.monotonic() > deadline:
            return held
        time.sleep(1.0)


async def fault_load(fleet: Fleet, requests: Sequence[BenchRequest], args: argparse.Namespace
                     ) -> dict[str, Any]:
    url = fleet.routers["disagg"]
    offsets = arrival_offsets_s(len(requests), ArrivalConfig(args.fault_rate, seed=args.seed))
    t0 = time.monotonic()
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_worker(url, "decode-0", t0, stop))

    async def cut() -> tuple[float, float]:
        await asyncio.sleep(args.fault_at_s)
        down_s = time.monotonic() - t0
        thread = fleet.hosts.link_down_for(1, args.fault_down_s)
        await asyncio.to_thread(thread.join)
        return down_s, time.monotonic() - t0

    cutter = asyncio.create_task(cut())
    async with httpx.AsyncClient(timeout=120) as http:
        endpoint = await endpoint_of(http, url)
        outcomes, duration_s = await run_load(http, endpoint, requests, offsets)
    down_s, up_s = await cutter
    await asyncio.sleep(max(0.0, up_s + 15 - (time.monotonic() - t0)))  # see it come back
    stop.set()
    changes = await watcher
    back = [t for t, alive in changes if alive and t > up_s]
    failed = [o for o in outcomes if not o.success]
    return {"num_requests": len(outcomes), "num_completed": len(outcomes) - len(failed),
            "failures": sorted({f"{o.error_cause}: {o.error[:120]}" for o in failed}),
            "link_down_at_s": round(down_s, 2), "link_up_at_s": round(up_s, 2),
            "duration_s": round(duration_s, 2), "decode_0_alive_changes": changes,
            "decode_0_back_after_link_s": round(back[0] - up_s, 2) if back else None,
            **summarize(outcomes, args.fault_max_tokens)}


def run_fault(args: argparse.Namespace, codec: TokenCodec, log_dir: Path) -> dict[str, Any]:
    print(f"== fault: h2's link down {args.fault_down_s:g} s under a stream", flush=True)
    with EmulatedHosts(3, rate_mbit=args.fault_link_mbit) as hosts:
        fleet = Fleet(hosts, log_dir / "fault", args.model, args.cpu_tuning)
        fleet.start_store([0])
        fleet.start_worker("prefill", "prefill", 0, PREFILL_PORT, [0])
        fleet.start_worker("decode-0", "decode", 1, DECODE_PORT, [1])
        fleet.start_worker("decode-1", "decode", 2, DECODE_PORT, [1])
        a1, a2, a3 = (hosts.address(i) for i in range(3))
        try:
            fleet.start_router("disagg", args.base_port + 2, [
                "--prefill", f"tcp://{a1}:{PREFILL_PORT}", "--decode",
                f"tcp://{a2}:{DECODE_PORT}", "--decode", f"tcp://{a3}:{DECODE_PORT}"], [1])
            requests = random_requests(codec, NUM_WARMUP + args.fault_requests,
                                       args.fault_prompt_len, args.fault_max_tokens,
                                       seed=args.seed + 999)
            asyncio.run(one_at_a_time(fleet.routers["disagg"], requests[:NUM_WARMUP]))
            result = asyncio.run(fault_load(fleet, requests[NUM_WARMUP:], args))
            result["held_after"] = held_after(fleet.routers["disagg"])
        finally:
            fleet.stop()
    print(f"  {result['num_completed']} of {result['num_requests']} completed; decode-0 back "
          f"{result['decode_0_back_after_link_s']} s after the link; held after: "
          f"{result['held_after']}", flush=True)
    return result


# ---- plot and entry point --------------------------------------------------------------
def plot(results: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    metrics = (("ttft_p50_ms", "median TTFT (ms)"), ("tpot_mean_ms", "mean TPOT (ms)"),
               ("itl_p99_ms", "p99 inter-token gap (ms)"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for shape, by_link in results.items():
            links = sorted(by_link, key=float, reverse=True)
            for setup, style in (("colocated", "--"), ("disagg", "-")):
                ax.plot([float(r) for r in links], [by_link[r][setup][key] for r in links],
                        style, marker="o", label=f"{setup}, {shape}")
        ax.set_xscale("log")
        ax.set_xlabel("link (Mbit/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("1P+1D across emulated hosts against colocated, one request at a time")
    return save_figure(fig, plt, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="checkpoint directory (default: the llama-mid-like "
        "random model of pdserve/benchmarks/offline.py, fp32)")
    add("--num-requests", type=int, default=24, help="measured requests per setup and link")
    add("--prompt-len", type=int, default=1536)
    add("--max-tokens", type=int, default=16)
    add("--links", type=float, nargs="+", default=[10000, 1000, 100],
        help="link rates in Mbit/s")
    add("--shapes", nargs="+", choices=sorted(SHAPES), default=["one-core", "spare-core"])
    add("--kv-mib", type=float, default=24.0,
        help="a prompt's KV in MiB, for the wire time reported beside the stall")
    add("--no-stall", action="store_true", help="skip the stall study")
    add("--no-fault", action="store_true", help="skip the fault study")
    add("--fault-requests", type=int, default=60)
    add("--fault-rate", type=float, default=1.0, help="req/s of the fault study's stream")
    add("--fault-prompt-len", type=int, default=256)
    add("--fault-max-tokens", type=int, default=64)
    add("--fault-at-s", type=float, default=10.0)
    add("--fault-down-s", type=float, default=10.0)
    add("--fault-link-mbit", type=float, default=1000.0)
    add("--cpu-tuning", action="store_true", help="let every worker measure its CPU path at "
        "start (default: PDSERVE_CPU_TUNING=0, the default path on every worker)")
    add("--base-port", type=int, default=18400, help="the routers' ports (3 from here)")
    add("--seed", type=int, default=0)
    add_output_dir(parser, "cross_host")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cross_host",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    reason = why_unavailable()
    if reason is not None:
        parser.error(reason)
    args.model = args.model or str(mid_model_dir())
    codec = TokenCodec.load(args.model)
    out = output_dir(args, "cross_host")
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="cross_host-", dir=out))
    key = log_dir / "cluster.key"
    subprocess.run(pdserve_argv("keygen", str(key)), check=True, capture_output=True)
    os.environ["PDSERVE_CLUSTER_KEY_FILE"] = str(key)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                              "logs": str(log_dir)}
    if not args.no_stall:
        report["stall"] = run_stall(args, codec, log_dir)
        save_json(report, out / "cross_host.json")
        print(f"plot: {plot(report['stall'], out / 'cross_host.png')}")
    if not args.no_fault:
        report["fault"] = run_fault(args, codec, log_dir)
    print(f"results: {save_json(report, out / 'cross_host.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
