"""Where prompts run and how big the fleet is, on a simulated fleet (#55's placement and fleet
size).

    python -m benchmarks.sim_fleet placement  [--num-prefill 2 --num-decode 2 --local-tokens 64]
    python -m benchmarks.sim_fleet fleet-size [--rates 12 24 40 --shape 512 64]

placement   a mixed load, short and long prompts interleaved (two open-loop streams of fresh
            prompts), on one fixed fleet with `--local-prefill-max-tokens` at 0 (every prompt
            on a prefill worker) and at --local-tokens (short ones on the decode worker),
            alternated --rounds times with the same arrivals: goodput, TTFT and TPOT per
            stream, and what was placed where.
fleet-size  for each --rates (simulated req/s of --shape requests): the fleet the controller
            says the load needs (`controller.needed` in /status: the router runs in recommend
            mode on a --watch-prefill + --watch-decode fleet, fits its step models from the
            workers' samples, and predicts), then a sweep of served fleets: the needed one,
            then every split of one worker fewer while one of them meets the target (or of
            one more while none does), to the smallest total that meets it.

Rates, SLOs and step times are simulated time; on the wall every one is divided by --speedup,
as in phases. A fleet meets the target when --attainment of its requests met both SLOs.
JSON and a plot go to --output-dir, with `lscpu`'s model name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import Counter
from typing import Any

from benchmarks.sim_fleet import experiments as ex
from benchmarks.sim_fleet.load import run_load
from benchmarks.sim_fleet.phases import TOKENS_PER_WORD, meets_slos, plain_args
from pdserve.benchmarks.metrics import SLOConfig


def _slo(args: argparse.Namespace) -> SLOConfig:
    """The SLOs on the wall."""
    return SLOConfig(ttft_ms=args.slo_ttft_ms / args.speedup,
                     tpot_ms=args.slo_tpot_ms / args.speedup)


def _wall_flags(args: argparse.Namespace) -> list[str]:
    slo = _slo(args)
    return ["--max-num-seqs", str(args.max_num_seqs), "--slo-ttft-ms", str(slo.ttft_ms),
            "--slo-tpot-ms", str(slo.tpot_ms)]


def _words(tokens: int) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD))


def _summary(results: list[dict[str, Any]], slo: SLOConfig, duration_s: float
             ) -> dict[str, Any]:
    good = sum(1 for r in results if meets_slos(r, slo))
    ttfts = sorted(r["ttft_s"] for r in results if r["ok"] and r["ttft_s"] is not None)
    tpots = sorted((r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in results
                   if r["ok"] and r["ttft_s"] is not None and (r["tokens"] or 0) > 1)
    return {"sent": len(results), "good": good, "goodput": good / duration_s,
            "attainment": good / max(len(results), 1),
            "failed": sum(1 for r in results if not r["ok"]),
            "ttft_p50_ms": 1000 * ex._percentile(ttfts, 0.5),
            "ttft_p90_ms": 1000 * ex._percentile(ttfts, 0.9),
            "tpot_p50_ms": 1000 * ex._percentile(tpots, 0.5)}


# ---- placement -------------------------------------------------------------------------------
def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--num-prefill", type=int, default=2)
    add("--num-decode", type=int, default=2)
    add("--short", type=int, nargs=2, default=(32, 32), metavar=("IN", "OUT"))
    add("--long", type=int, nargs=2, default=(1024, 16), metavar=("IN", "OUT"))
    add("--short-rate", type=float, default=10.0, help="simulated req/s")
    add("--long-rate", type=float, default=12.0, help="simulated req/s")
    add("--local-tokens", type=int, default=64, help="--local-prefill-max-tokens when on")
    add("--duration-s", type=float, default=60.0, help="wall seconds of each run")
    add("--rounds", type=int, default=2)
    add("--slo-ttft-ms", type=float, default=400.0, help="simulated time")
    add("--slo-tpot-ms", type=float, default=50.0, help="simulated time")
    add("--max-num-seqs", type=int, default=16)


def _placement_run(args: argparse.Namespace, round_: int, local_tokens: int) -> dict[str, Any]:
    name = f"placement-{'local' if local_tokens else 'remote'}-{round_}"
    flags = ex._fleet_flags(args, args.num_prefill, args.num_decode, *_wall_flags(args),
                            "--controller", "off", "--local-prefill-max-tokens",
                            str(local_tokens))
    fleet = ex._start(args, name, *flags)
    out = ex.output_dir(args, "sim_fleet")
    streams = {"short": (args.short, args.short_rate), "long": (args.long, args.long_rate)}
    results: dict[str, list[dict[str, Any]]] = {}

    def stream(kind: str, seed: int) -> None:
        (prompt, output), rate = streams[kind]
        report = run_load(fleet.base_url, fleet.model, rate * args.speedup, args.duration_s,
                          out, 1, seed=seed, prompt_words=_words(prompt), max_tokens=output)
        results[kind] = report["results"]

    try:
        # the same seeds in both settings of a round: the same arrivals and prompts
        threads = [threading.Thread(target=stream, args=(kind, args.seed * 100 + round_ * 2 + k))
                   for k, kind in enumerate(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        placed = fleet.status()["placement"]
    finally:
        fleet.stop()
    slo = _slo(args)
    per_stream = {kind: _summary(results[kind], slo, args.duration_s) for kind in streams}
    good = sum(s["good"] for s in per_stream.values())
    run = {"name": name, "local_prefill_max_tokens": local_tokens, "round": round_,
           "streams": per_stream, "goodput": good / args.duration_s, "placement": placed}
    print(f"[{name}] goodput {run['goodput']:.2f} req/s (wall); " + "; ".join(
        f"{k}: {s['good']}/{s['sent']} met, TTFT p50/p90 {s['ttft_p50_ms']:.0f}/"
        f"{s['ttft_p90_ms']:.0f} ms, TPOT p50 {s['tpot_p50_ms']:.0f} ms, {s['failed']} failed"
        for k, s in per_stream.items()) + f"; placed {placed}", flush=True)
    return run


def placement(args: argparse.Namespace) -> int:
    """Goodput of placement per request against always-remote prefill on a mixed load."""
    runs = [_placement_run(args, r, local) for r in range(args.rounds)
            for local in (0, args.local_tokens)]
    ratios = [runs[2 * r + 1]["goodput"] / max(runs[2 * r]["goodput"], 1e-9)
              for r in range(args.rounds)]
    report = {"machine": ex._machine(), "args": plain_args(args), "runs": runs,
              "local_vs_remote": ratios}
    print(f"[placement] local / remote goodput per round: "
          f"{', '.join(f'{x:.2f}x' for x in ratios)}", flush=True)
    path = ex._write(args, "placement", report)
    plt = ex.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, kind in enumerate(("short", "long")):
        ax.bar([i + 0.4 * k for i in range(len(runs))],
               [run["streams"][kind]["goodput"] for run in runs], 0.4, label=kind)
    ax.set_xticks([i + 0.2 for i in range(len(runs))], [run["name"][10:] for run in runs])
    ax.set_ylabel("goodput (req/s, wall)")
    ax.legend()
    ex.save_figure(fig, plt, path.with_suffix(".png"))
    return 0


# ---- fleet size --------------------------------------------------------------------------
def add_fleet_size_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--rates", type=float, nargs="+", default=[12.0, 24.0, 40.0], help="simulated req/s")
    add("--shape", type=int, nargs=2, default=(512, 64), metavar=("IN", "OUT"))
    add("--watch-prefill", type=int, default=4)
    add("--watch-decode", type=int, default=4)
    add("--duration-s", type=float, default=45.0, help="wall seconds of each run")
    add("--max-total", type=int, default=12, help="the largest fleet the sweep tries")
    add("--attainment", type=float, default=0.9)
    add("--slo-ttft-ms", type=float, default=400.0, help="simulated time")
    add("--slo-tpot-ms", type=float, default=50.0, help="simulated time")
    add("--max-num-seqs", type=int, default=16)


def _load(args: argparse.Namespace, fleet, rate: float, seed: int) -> list[dict[str, Any]]:
    prompt, output = args.shape
    return run_load(fleet.base_url, fleet.model, rate * args.speedup, args.duration_s,
                    ex.output_dir(args, "sim_fleet"), 1, seed=seed,
                    prompt_words=_words(prompt), max_tokens=output)["results"]


def _needed(args: argparse.Namespace, rate: float) -> tuple[dict[str, int] | None, Any]:
    """What the controller, watching the load on a fixed fleet, says it needs."""
    flags = ex._fleet_flags(args, args.watch_prefill, args.watch_decode, *_wall_flags(args),
                            "--controller", "recommend", "--controller-interval-s", "2",
                            "--controller-window-s", str(min(20.0, args.duration_s / 2)))
    fleet = ex._start(args, f"fleet-size-watch-{rate:g}", *flags)
    readings: list[tuple[float, dict[str, Any]]] = []  # (seconds into the load, controller)
    stop = threading.Event()
    start_s = time.monotonic()

    def watch() -> None:
        while not stop.wait(2.0):
            try:
                readings.append((time.monotonic() - start_s, fleet.status()["controller"]))
            except Exception:  # a slow answer under load: the next one's
                continue

    try:
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _load(args, fleet, rate, seed=args.seed * 1000 + int(rate))
        stop.set()
    finally:
        fleet.stop()
    # What it said while the load arrived, in the load's second half (its window full): read
    # after the load, the window holds the drain, no arrivals, and a fleet sized for none.
    late = [c for t, c in readings if args.duration_s / 2 <= t <= args.duration_s]
    said = Counter(json.dumps(c.get("needed"), sort_keys=True) for c in late)
    needed = json.loads(said.most_common(1)[0][0]) if said else None
    rates = [c.get("arrival_rate") or 0.0 for c in late]
    arrival_rate = statistics.median(rates) if rates else None
    print(f"[fleet-size {rate:g}/s] the controller says {needed} (arrival rate "
          f"{arrival_rate}/s wall, the median of {len(late)} readings)", flush=True)
    return needed, {"readings": [{"t_s": t, "needed": c.get("needed"),
                                  "arrival_rate": c.get("arrival_rate")} for t, c in readings],
                    "arrival_rate": arrival_rate,
                    "models": late[-1].get("models") if late else None}


def _level(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """One rate: the controller's fleet size, then the sweep of served fleets."""
    slo = _slo(args)
    needed, seen = _needed(args, rate)
    trials: dict[tuple[int, int], dict[str, Any]] = {}

    def meets(prefill: int, decode: int) -> bool:
        if (prefill, decode) not in trials:
            flags = ex._fleet_flags(args, prefill, decode, *_wall_flags(args),
                                    "--controller", "off")
            fleet = ex._start(args, f"fleet-size-{rate:g}-{prefill}p{decode}d", *flags)
            try:
                results = _load(args, fleet, rate, seed=args.seed * 1000 + int(rate))
            finally:
                fleet.stop()
            summary = _summary(results, slo, args.duration_s)
            trials[(prefill, decode)] = summary
            print(f"[fleet-size {rate:g}/s] {prefill}P{decode}D: attainment "
                  f"{summary['attainment']:.1%}, TTFT p90 {summary['ttft_p90_ms']:.0f} ms, "
                  f"TPOT p50 {summary['tpot_p50_ms']:.0f} ms", flush=True)
        return trials[(prefill, decode)]["attainment"] >= args.attainment

    share = needed["prefill"] / (needed["prefill"] + needed["decode"]) if needed else 0.5

    def any_meets(total: int) -> bool:  # the splits nearest the needed share first
        splits = sorted(range(1, total), key=lambda p: abs(p - share * total))
        return any(meets(p, total - p) for p in splits)

    total = needed["prefill"] + needed["decode"] if needed else 2
    smallest: int | None = None
    if needed is not None and meets(needed["prefill"], needed["decode"]):
        smallest = total
        while smallest > 2 and any_meets(smallest - 1):
            smallest -= 1
    else:
        while total < args.max_total:
            total += 1
            if any_meets(total):
                smallest = total
                break
    level = {"rate": rate, "needed": needed, "controller": seen, "smallest_total": smallest,
             "trials": {f"{p}P{d}D": s for (p, d), s in sorted(trials.items())}}
    if needed is not None and smallest is not None:
        level["off_by"] = needed["prefill"] + needed["decode"] - smallest
    print(f"[fleet-size {rate:g}/s] needed {needed}, smallest that meets: {smallest} "
          f"workers", flush=True)
    return level


def fleet_size(args: argparse.Namespace) -> int:
    """The controller's fleet size against the smallest served fleet that meets the SLOs."""
    levels = [_level(args, rate) for rate in args.rates]
    report = {"machine": ex._machine(), "args": plain_args(args), "levels": levels}
    path = ex._write(args, "fleet_size", report)
    plt = ex.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [lv["rate"] for lv in levels]
    ax.plot(rates, [sum(lv["needed"].values()) if lv["needed"] else float("nan")
                    for lv in levels], "o-", label="controller's fleet size")
    ax.plot(rates, [lv["smallest_total"] or float("nan") for lv in levels], "s--",
            label="smallest served fleet meeting the SLOs")
    ax.set_xlabel("simulated req/s")
    ax.set_ylabel("workers")
    ax.legend()
    ex.save_figure(fig, plt, path.with_suffix(".png"))
    return 0

