"""The experiments of benchmarks/sim_fleet (its __main__ says what each measures)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.sim_fleet.fleet import (
    Fleet,
    box_busy_seconds,
    cpu_seconds,
    group_cpu_seconds,
    histogram,
    histogram_quantile,
    kill,
    memory_mib,
    sim_model_dir,
    start_etcd,
    start_router,
    wait_until,
)
from benchmarks.sim_fleet.load import fresh_prompt, run_load
from pdserve.benchmarks import server_process
from pdserve.benchmarks.output import output_dir
from pdserve.benchmarks.plots import pyplot, save_figure, save_json

PROFILE = "distserve-opt-13b-a100"
ROUTER_ADDED = "pdserve:first_token_router_added_seconds"


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--profile", default=PROFILE, help="the latency profile the workers simulate")
    add("--speedup", type=float, default=10.0, help="--sim-speedup of every worker")
    add("--kv-fraction", type=float, default=0.001,
        help="--sim-kv-fraction: real KV bytes as a share of the profile's (a fleet of dozens "
             "on one host)")
    add("--num-kv-blocks", type=int, default=4096,
        help="each worker's pool in simulated blocks of 16 tokens")
    add("--port", type=int, default=8900)
    add("--seed", type=int, default=0)


def _fleet_flags(args: argparse.Namespace, num_prefill: int, num_decode: int,
                 *extra: str) -> list[str]:
    return ["--sim-profile", args.profile, "--sim-speedup", str(args.speedup),
            "--sim-kv-fraction", str(args.kv_fraction), "--num-kv-blocks",
            str(args.num_kv_blocks), "--num-prefill", str(num_prefill), "--num-decode",
            str(num_decode), *extra]


def _machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu_model": model, "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M")}


def _start(args: argparse.Namespace, name: str, *flags: str) -> Fleet:
    out = output_dir(args, "sim_fleet")
    out.mkdir(parents=True, exist_ok=True)
    model = sim_model_dir(out)
    print(f"[{name}] starting pdserve up --engine sim {' '.join(flags)}", flush=True)
    fleet = Fleet.start(model, out / f"{name}.log", args.port, *flags)
    print(f"[{name}] ready in {fleet.ready_s:.1f} s", flush=True)
    return fleet


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _write(args: argparse.Namespace, name: str, report: dict[str, Any]) -> Path:
    path = save_json(report, output_dir(args, "sim_fleet") / f"{name}.json")
    print(f"[{name}] wrote {path}", flush=True)
    return path


# ---- scale -----------------------------------------------------------------------------------
def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prefill", type=int, default=32)
    parser.add_argument("--num-decode", type=int, default=32)
    parser.add_argument("--rate", type=float, default=20.0, help="the short load's rate")
    parser.add_argument("--duration-s", type=float, default=20.0)


def scale(args: argparse.Namespace) -> int:
    """The fleet's start, memory and listing at --num-prefill + --num-decode workers."""
    fleet = _start(args, "scale", *_fleet_flags(args, args.num_prefill, args.num_decode))
    try:
        workers = fleet.workers()
        metrics = fleet.metrics()
        listed = sum(1 for w in workers if w["worker_id"] in metrics)
        processes = fleet.processes()
        memory = {name: memory_mib(pid) for name, pid in processes.items()}
        launcher = memory_mib(fleet.process.pid, with_children=False)
        worker_memory = [m for name, m in memory.items() if name not in ("router", "store")]
        load = run_load(fleet.base_url, fleet.model, args.rate, args.duration_s,
                        output_dir(args, "sim_fleet"), num_clients=1, seed=args.seed)
        ok = sum(r["ok"] for r in load["results"])
    finally:
        fleet.stop()

    def stats(key: str) -> dict[str, float]:
        values = [m[key] for m in worker_memory]
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    report = {"machine": _machine(), "num_workers": len(workers),
              "ready_workers": sum(w["is_ready"] for w in workers), "ready_s": fleet.ready_s,
              "listed_in_metrics": listed, "worker_mib": {k: stats(k) for k in
                                                          ("rss", "pss", "private")},
              "launcher_mib": launcher, "router_mib": memory.get("router"),
              "store_mib": memory.get("store"),
              "fleet_pss_mib": sum(m["pss"] for m in memory.values()) + launcher["pss"],
              "load": {"sent": load["sent"], "ok": ok, "rate": args.rate}}
    print(json.dumps(report, indent=1), flush=True)
    _write(args, "scale", report)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for key in ("rss", "pss", "private"):
        ax.plot(sorted(m[key] for m in worker_memory), label=key)
    ax.set_xlabel("worker (sorted)")
    ax.set_ylabel("MiB (worker + its UCX prober)")
    ax.set_title(f"{len(workers)} simulated workers, ready in {fleet.ready_s:.0f} s")
    ax.legend()
    save_figure(fig, plt, output_dir(args, "sim_fleet") / "scale.png")
    return 0 if ok == load["sent"] and listed == len(workers) else 1


# ---- router capacity ---------------------------------------------------------------------
def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prefill", type=int, default=32)
    parser.add_argument("--num-decode", type=int, default=32)
    parser.add_argument("--rates", type=float, nargs="+", default=[50, 100, 200, 300, 400])
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=2, help="load client processes")
    parser.add_argument("--two-routers", action="store_true",
                        help="also run every rate through two routers (a second one that "
                             "finds the fleet through etcd, started here from PATH)")


def _level(fleet: Fleet, args: argparse.Namespace, rate: float, router_pids: list[int],
           seed: int, urls: list[str] | None = None) -> dict[str, Any]:
    """One offered rate: the load, the routers' CPU, and the router-added histogram's
    quantiles over what this level added (every router's summed)."""
    urls = urls or [fleet.base_url]

    def scrape() -> list[tuple[list[float], list[float]]]:
        return [histogram(httpx.get(f"{url}/metrics", timeout=30).text, ROUTER_ADDED)
                for url in urls]

    before = [counts for _, counts in scrape()]  # no lines before a router's first request
    processes = fleet.processes()
    groups_before, box_before = group_cpu_seconds(processes), box_busy_seconds()
    cpu_before, wall_before = sum(map(cpu_seconds, router_pids)), time.monotonic()
    load = run_load(urls, fleet.model, rate, args.duration_s, output_dir(args, "sim_fleet"),
                    max(args.clients, len(urls)), seed=seed)
    wall = time.monotonic() - wall_before
    router_cpu = (sum(map(cpu_seconds, router_pids)) - cpu_before) / wall
    # Where the host's cores went over the level: the fleet's groups, and the rest (the load
    # clients, the second router, anything else on the host).
    groups_after = group_cpu_seconds(processes)
    cpu = {name: (groups_after[name] - groups_before[name]) / wall for name in groups_after}
    cpu["rest"] = (box_busy_seconds() - box_before) / wall - sum(cpu.values())
    scraped = scrape()
    bounds = scraped[0][0]
    after = [sum(column) for column in zip(*(c for _, c in scraped), strict=True)]
    before = [sum(column) for column in
              zip(*(b or [0.0] * len(bounds) for b in before), strict=True)]
    results = load["results"]
    ok = [r for r in results if r["ok"]]
    span = max((r["start_s"] + r["latency_s"] for r in ok), default=1.0)
    causes: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            causes[r["cause"]] = causes.get(r["cause"], 0) + 1
    return {"routers": len(urls), "offered_rate": rate, "sent_rate": load["sent_rate"],
            "sent": load["sent"], "ok": len(ok), "achieved_rate": len(ok) / span,
            "failures": causes,
            "ttft_p50_ms": 1000 * _percentile([r["ttft_s"] for r in ok], 0.5),
            "ttft_p99_ms": 1000 * _percentile([r["ttft_s"] for r in ok], 0.99),
            "router_added_p50_ms": 1000 * histogram_quantile(bounds, before, after, 0.5),
            "router_added_p99_ms": 1000 * histogram_quantile(bounds, before, after, 0.99),
            "router_cpu_cores": router_cpu, "cpu_cores": cpu}


def capacity(args: argparse.Namespace) -> int:
    """The router's sustained rate and added latency at rising offered rates."""
    flags = _fleet_flags(args, args.num_prefill, args.num_decode)
    etcd = second = None
    if args.two_routers:
        etcd, url = start_etcd(Path(tempfile.mkdtemp(prefix="sim-fleet-etcd-")), args.port + 50)
        key = Path(tempfile.mkdtemp(prefix="sim-fleet-")) / "cluster.key"
        flags += ["--discovery", url, "--cluster-key-file", str(key)]
    levels: list[dict[str, Any]] = []
    try:
        fleet = _start(args, "capacity", *flags)
        try:
            router_pids = [fleet.processes()["router"]]
            urls = [fleet.base_url]
            if args.two_routers:
                second = start_router(fleet, url, key, args.port + 1,
                                      output_dir(args, "sim_fleet") / "capacity-router-2.log")
                router_pids.append(second.pid)
                urls.append(f"http://127.0.0.1:{args.port + 1}")
            for i, rate in enumerate(args.rates):
                for count in range(1, len(urls) + 1):
                    level = _level(fleet, args, rate, router_pids[:count], args.seed + i + 1,
                                   urls[:count])
                    levels.append(level)
                    _print_level(level)
                if all(lv["achieved_rate"] < 0.8 * rate for lv in levels[-len(urls):]):
                    break  # saturated: higher rates only queue
        finally:
            if second is not None:
                server_process.stop(second)
            fleet.stop()
    finally:
        if etcd is not None:
            server_process.stop(etcd)
    report = {"machine": _machine(), "workers": [args.num_prefill, args.num_decode],
              "speedup": args.speedup, "clients": args.clients, "levels": levels}
    _write(args, "capacity", report)
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for count in sorted({lv["routers"] for lv in levels}):
        mine = [lv for lv in levels if lv["routers"] == count]
        offered = [lv["offered_rate"] for lv in mine]
        left.plot(offered, [lv["achieved_rate"] for lv in mine], "o-",
                  label=f"achieved, {count} router(s)")
        for key_name, label in (("router_added_p50_ms", "added p50"),
                                ("router_added_p99_ms", "added p99")):
            right.plot(offered, [lv[key_name] for lv in mine], "o-", label=f"{label}, {count}")
    top = max(lv["offered_rate"] for lv in levels)
    left.plot([0, top], [0, top], ":", color="gray", label="offered")
    left.set_xlabel("offered req/s")
    left.set_ylabel("req/s")
    left.legend(fontsize=7)
    right.set_yscale("log")
    right.set_xlabel("offered req/s")
    right.set_ylabel("ms the router added to the TTFT")
    right.legend(fontsize=7)
    save_figure(fig, plt, output_dir(args, "sim_fleet") / "capacity.png")
    return 0


def _print_level(level: dict[str, Any]) -> None:
    print(f"[capacity] {level['routers']} router(s), offered {level['offered_rate']:.0f}/s: "
          f"sent {level['sent_rate']:.1f}/s, achieved {level['achieved_rate']:.1f}/s, failures "
          f"{level['failures']}, TTFT p50/p99 {level['ttft_p50_ms']:.1f}/"
          f"{level['ttft_p99_ms']:.1f} ms, router added p50/p99 "
          f"{level['router_added_p50_ms']:.2f}/{level['router_added_p99_ms']:.2f} ms, router "
          f"CPU {level['router_cpu_cores']:.2f} cores; host cores: " + ", ".join(
              f"{name} {cores:.2f}" for name, cores in level["cpu_cores"].items()), flush=True)


# ---- KV-aware routing on the Mooncake trace ------------------------------------------------
TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / \
    "mooncake_conversation_trace.jsonl"


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--time-scale", type=float, default=0.1,
                        help="trace timestamps x this (0.1: ten times faster)")
    parser.add_argument("--length-scale", type=float, default=1 / 32,
                        help="lengths x this (1/32: 512-token blocks become 16)")
    parser.add_argument("--num-prefill", type=int, default=16)
    parser.add_argument("--num-decode", type=int, default=8)
    parser.add_argument("--policies", nargs="+",
                        default=["cache-aware", "least-load", "round-robin"])


def ideal_hit_tokens(entries: list[dict], block_size: int, length_scale: float) -> tuple[int, int]:
    """(prompt tokens, tokens one unbounded cache would reuse) of the scaled trace: a request
    reuses its leading blocks already seen, up to its last token (which is always computed)."""
    seen: set[int] = set()
    total = hits = 0
    for entry in entries:
        ids = entry["hash_ids"]
        length = min(len(ids) * block_size,
                     max((len(ids) - 1) * block_size + 1,
                         round(entry["input_length"] * length_scale)))
        leading = 0
        for hash_id in ids:
            if hash_id not in seen:
                break
            leading += 1
        total += length
        hits += min(leading * block_size, (length - 1) // block_size * block_size)
        seen.update(ids)
    return total, hits


def routing(args: argparse.Namespace) -> int:
    """Prefix reuse and load balance of each --prefill-routing on the Mooncake trace."""
    entries = [json.loads(line) for line in args.trace.read_text().splitlines()[
        :args.num_requests]]
    block_size = max(1, round(512 * args.length_scale))
    total, ideal = ideal_hit_tokens(entries, block_size, args.length_scale)
    runs = {}
    out = output_dir(args, "sim_fleet")
    for policy in args.policies:
        fleet = _start(args, f"routing-{policy}",
                       *_fleet_flags(args, args.num_prefill, args.num_decode,
                                     "--prefill-routing", policy))
        try:
            result = out / f"routing-{policy}-bench.json"
            bench = [sys.executable, "-m", "pdserve.app.cli", "bench", "--base-url",
                     fleet.base_url, "--model", fleet.model, "--tokenizer",
                     str(sim_model_dir(out)), "--dataset-name", "mooncake", "--dataset-path",
                     str(args.trace), "--num-prompts", str(args.num_requests), "--time-scale",
                     str(args.time_scale), "--length-scale", str(args.length_scale),
                     "--ignore-eos", "--temperature", "0", "--save-result",
                     "--result-filename", str(result)]
            subprocess.run(bench, check=True)
            workers = [w for w in fleet.workers() if w["role"] == "prefill"]
            tiers = {key: sum(float(w["kv_tiers"].get(f"{key}_hit_tokens", 0)) for w in workers)
                     for key in ("device", "host", "store")}
            loads = [int(w["sim"]["prefill_tokens"]) for w in workers]
            text = fleet.metrics()
        finally:
            fleet.stop()
        cached = _counter(text, "pdserve:prompt_tokens_cached_total")
        prompt = _counter(text, "pdserve:prompt_tokens_total")
        runs[policy] = {"hit_tokens_by_tier": tiers, "cached_tokens": cached,
                        "prompt_tokens": prompt,
                        "hit_vs_ideal": cached / ideal if ideal else float("nan"),
                        "prefill_tokens_per_worker": loads,
                        "busiest_vs_mean": max(loads) / statistics.mean(loads),
                        "bench": json.loads(result.read_text()) if result.exists() else None}
        print(f"[routing] {policy}: cached {cached:.0f} of {prompt:.0f} prompt tokens "
              f"({cached / ideal:.1%} of the ideal {ideal}), by tier {tiers}, busiest worker "
              f"{runs[policy]['busiest_vs_mean']:.2f}x the mean", flush=True)
    report = {"machine": _machine(), "trace": str(args.trace), "num_requests": len(entries),
              "block_size": block_size, "prompt_tokens": total, "ideal_hit_tokens": ideal,
              "ideal_hit_ratio": ideal / total, "runs": runs}
    _write(args, "routing", report)
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(runs)
    left.bar(names, [runs[n]["hit_vs_ideal"] for n in names])
    left.axhline(0.9, color="gray", ls=":")
    left.set_ylabel("reused tokens / ideal")
    right.bar(names, [runs[n]["busiest_vs_mean"] for n in names])
    right.axhline(1.5, color="gray", ls=":")
    right.set_ylabel("busiest worker / mean (prompt tokens)")
    save_figure(fig, plt, out / "routing.png")
    return 0


def _counter(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


# ---- chaos ---------------------------------------------------------------------------------
def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-workers", type=int, default=32, help="half prefill, half decode")
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--kill-share", type=float, default=0.1)
    parser.add_argument("--load", type=float, default=0.7, help="share of the measured capacity")
    parser.add_argument("--capacity-rate", type=float, default=None,
                        help="skip the capacity probe: the fleet's capacity in req/s")
    parser.add_argument("--probe-rate", type=float, default=60.0,
                        help="without --capacity-rate: the capacity is what the fleet serves of "
                             "this offered rate for 15 s (above what it can serve, below what "
                             "the clients can send: at 1000 req/s they took the cores)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--clients", type=int, default=2)


def chaos(args: argparse.Namespace) -> int:
    """Random SIGKILLs of a tenth of the workers every 30 s under a 70% load."""
    half = args.num_workers // 2
    out = output_dir(args, "sim_fleet")
    key = Path(tempfile.mkdtemp(prefix="sim-fleet-")) / "cluster.key"
    fleet = _start(args, "chaos", *_fleet_flags(args, half, args.num_workers - half),
                   "--cluster-key-file", str(key))
    rng = random.Random(args.seed)
    try:
        prompts = [fresh_prompt(rng, 48) for _ in range(args.num_prompts)]
        prompts_path = out / "chaos-prompts.json"
        prompts_path.write_text(json.dumps(prompts))
        # the undisturbed texts: every prompt once, before anything is killed
        reference = run_load(fleet.base_url, fleet.model, 20.0, 0.0, out, 1, seed=args.seed,
                             prompts=prompts_path, each_once=True)
        expected = {r["prompt"]: r["text"] for r in reference["results"] if r["ok"]}
        capacity_rate = args.capacity_rate
        if capacity_rate is None:
            probe = _level(fleet, argparse.Namespace(**{**vars(args), "duration_s": 15.0}),
                           args.probe_rate, [fleet.processes()["router"]], args.seed + 1)
            capacity_rate = probe["achieved_rate"]
        rate = args.load * capacity_rate
        print(f"[chaos] capacity {capacity_rate:.1f} req/s; load {rate:.1f} req/s for "
              f"{args.duration_s:.0f} s", flush=True)
        kills: list[dict[str, Any]] = []
        stop = threading.Event()
        killer = threading.Thread(target=_kill_loop, args=(fleet, args, rng, kills, stop))
        killer.start()
        try:
            load = run_load(fleet.base_url, fleet.model, rate, args.duration_s, out,
                            args.clients, seed=args.seed + 7, prompts=prompts_path)
        finally:
            stop.set()
            killer.join()
        leaks = _leaks(fleet, key)
    finally:
        fleet.stop()
    results = load["results"]
    failures: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            failures[r["cause"]] = failures.get(r["cause"], 0) + 1
    checked = [r for r in results if r["ok"] and r["prompt"] in expected]
    differing = [r["i"] for r in checked if r["text"] != expected[r["prompt"]]]
    report = {"machine": _machine(), "num_workers": args.num_workers, "speedup": args.speedup,
              "capacity_rate": capacity_rate, "rate": rate, "sent_rate": load["sent_rate"],
              "sent": load["sent"], "ok": sum(r["ok"] for r in results), "failures": failures,
              "first_errors": [r["error"] for r in results if not r["ok"]][:5],
              "streams_checked": len(checked), "streams_differing": len(differing),
              "kills": kills, "leaks": leaks}
    print(json.dumps({k: v for k, v in report.items() if k != "kills"}, indent=1), flush=True)
    _write(args, "chaos", report)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    ax.plot([r["start_s"] for r in results if r["ok"]],
            [1000 * r["ttft_s"] for r in results if r["ok"]], ".", ms=2, label="TTFT")
    for kill_at in kills:
        ax.axvline(kill_at["at_s"], color="red", alpha=0.4)
    ax.set_yscale("log")
    ax.set_xlabel("s (red: a tenth of the workers SIGKILLed)")
    ax.set_ylabel("TTFT ms")
    save_figure(fig, plt, out / "chaos.png")
    return 0 if not failures and not differing and not leaks else 1


def _kill_loop(fleet: Fleet, args: argparse.Namespace, rng: random.Random,
               kills: list[dict[str, Any]], stop: threading.Event) -> None:
    start = time.monotonic()
    while not stop.wait(args.kill_every_s):
        workers = {name: pid for name, pid in fleet.processes().items()
                   if name.startswith(("prefill-", "decode-"))}
        victims = rng.sample(sorted(workers), max(1, round(args.kill_share * len(workers))))
        for name in victims:
            kill(workers[name])
        kills.append({"at_s": time.monotonic() - start, "victims": victims})
        print(f"[chaos] {time.monotonic() - start:5.0f} s: SIGKILL {', '.join(victims)}",
              flush=True)


def _leaks(fleet: Fleet, key: Path) -> dict[str, Any]:
    """What is still held once the load is over: workers not idle or holding blocks, store
    leases and pins (empty: nothing)."""
    from pdserve import security
    from pdserve.kvstore.client import StoreClient

    def idle() -> bool:
        return all(w["is_alive"] and w.get("is_idle") and w["num_inflight"] == 0
                   and w["num_free_blocks"] == w["num_total_blocks"] for w in fleet.workers())

    leaks: dict[str, Any] = {}
    if not wait_until(idle, 90.0):
        leaks["workers"] = [w["worker_id"] for w in fleet.workers()
                            if not (w["is_alive"] and w.get("is_idle"))]
    with security.using(security.ClusterKey.load(key)):
        port = fleet_store_port(fleet)  # the master's; the data node's is the next
        store = StoreClient(f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{port}",
                            transport="zmq", timeout_s=10)
    try:
        if not wait_until(lambda: _released(store), 60.0):
            stats = store.stats()
            leaks["store"] = {"leases": stats["num_leases"], "pinned": stats["num_pinned"]}
    finally:
        store.close()
    return leaks


def _released(store: Any) -> bool:
    stats = store.stats()
    return stats["num_leases"] == 0 and stats["num_pinned"] == 0


def fleet_store_port(fleet: Fleet) -> int:
    return int(fleet.base_url.rsplit(":", 1)[1]) + 10


EXPERIMENTS: dict[str, Callable[[argparse.Namespace], int]] = {
    "scale": scale, "capacity": capacity, "routing": routing, "chaos": chaos}
ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "scale": add_scale_arguments, "capacity": add_capacity_arguments,
    "routing": add_routing_arguments, "chaos": add_chaos_arguments}
