"""The goodput controller on a shifting load: a simulated fleet whose load alternates between a
prefill-heavy phase (long prompts, short outputs) and a decode-heavy one (short prompts, long
outputs), served by the controller moving workers (`--controller flip`) and by fixed splits.

    python -m benchmarks.sim_fleet phases [--num-workers 8] [--phase-s 60] [--splits 2 4 6]

Each phase's rate is --load (0.8) of what the planner (pdserve/planner, on the simulated
profile) says the best split of that phase sustains; SLOs are simulated time (TTFT 400 ms,
TPOT 50 ms by default), so on the wall they are divided by --speedup, as every step is. The
phases run back to back, A B A B, fresh prompts throughout. Goodput is the requests that met
both SLOs per second of the whole run; the oracle is, per phase, the best fixed split's goodput
in that phase (it knows each phase's best split in advance and moves for free). The JSON has
every run's per-phase goodput and, for the controller, its split each second; the plot shows
the split over time against each phase's best, and goodput per phase.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from typing import Any

from benchmarks.sim_fleet import experiments as ex
from benchmarks.sim_fleet.fleet import Fleet
from benchmarks.sim_fleet.load import run_load
from pdserve.benchmarks.client import RequestOutcome
from pdserve.benchmarks.metrics import SLOConfig, meets_slo
from pdserve.planner.goodput_model import (
    PhaseModels,
    RequestShape,
    SimulationConfig,
    goodput_by_split,
)
from pdserve.planner.latency_profile import load_profile

TOKENS_PER_WORD = 2.3
"""The sim model's tokenizer: a fresh prompt's words (benchmarks/sim_fleet/load.py) in tokens."""


def add_phases_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--num-workers", type=int, default=8)
    add("--phase-s", type=float, default=60.0, help="wall seconds of each phase")
    add("--num-phases", type=int, default=4, help="A, B, A, B, ...")
    add("--prefill-heavy", type=int, nargs=2, default=(1024, 8), metavar=("IN", "OUT"),
        help="phase A: prompt and output tokens")
    add("--decode-heavy", type=int, nargs=2, default=(64, 128), metavar=("IN", "OUT"))
    add("--slo-ttft-ms", type=float, default=400.0, help="simulated time")
    add("--slo-tpot-ms", type=float, default=50.0, help="simulated time")
    add("--load", type=float, default=0.8, help="each phase's rate: this share of what its "
                                                "best split sustains (the planner's estimate)")
    add("--max-num-seqs", type=int, default=16, help="each decode worker's batch limit")
    add("--interval-s", type=float, default=2.0, help="the controller's interval (wall)")
    add("--window-s", type=float, default=6.0, help="the controller's load window (wall)")
    add("--cooldown-s", type=float, default=2.0,
        help="the controller's cooldown after a move (wall; a move with hand-over takes about "
             "half a second, so one interval)")
    add("--splits", type=int, nargs="*", default=None,
        help="fixed splits to run (prefill workers); default: each phase's best and their "
             "midpoint")
    add("--start-prefill", type=int, default=None,
        help="the controller's starting split (default: half the workers)")
    add("--clients", type=int, default=2)
    add("--hand-over", action=argparse.BooleanOptionalAction, default=True,
        help="--controller-hand-over: a decode worker that moves hands its requests over "
             "(--no-hand-over: it finishes them first, to measure what a move costs)")
    add("--model", default=None,
        help="serve this checkpoint on the real engine instead of simulating (then give "
             "--rates; --speedup is 1 and the SLOs are wall time)")
    add("--rates", type=float, nargs=2, default=None, metavar=("A", "B"),
        help="each phase's rate (req/s, wall) instead of --load of the planned best split's")


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Each phase's shape, the planner's goodput of every split, its best and its rate."""
    if args.model:
        return {name: {"prompt_tokens": prompt, "output_tokens": output, "best_prefill": None,
                       "rate": rate}
                for (name, (prompt, output)), rate in zip(
                    (("A", args.prefill_heavy), ("B", args.decode_heavy)), args.rates,
                    strict=True)}
    profile = load_profile(args.profile)
    models = PhaseModels(profile.prefill[1], profile.decode[1])
    sim = SimulationConfig(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000,
                           max_batched_tokens=profile.max_num_batched_tokens,
                           max_num_seqs=args.max_num_seqs)
    phases = {}
    for name, (prompt, output) in (("A", args.prefill_heavy), ("B", args.decode_heavy)):
        goodput = goodput_by_split([RequestShape(prompt, 0, output)], args.num_workers,
                                   models, sim)
        best = max(goodput, key=goodput.get)
        phases[name] = {"prompt_tokens": prompt, "output_tokens": output,
                        "planned_goodput": goodput, "best_prefill": best,
                        "rate": (args.rates[name == "B"] if args.rates
                                 else args.load * goodput[best] * args.speedup)}
    return phases


def _run(args: argparse.Namespace, name: str, phases: dict[str, Any], num_prefill: int,
         controller: bool) -> dict[str, Any]:
    ttft_s, tpot_s = (args.slo_ttft_ms / 1000 / args.speedup,
                      args.slo_tpot_ms / 1000 / args.speedup)
    slo = SLOConfig(ttft_ms=ttft_s * 1000, tpot_ms=tpot_s * 1000)
    common = ["--max-num-seqs", str(args.max_num_seqs),
              "--controller", "flip" if controller else "off",
              "--slo-ttft-ms", str(ttft_s * 1000), "--slo-tpot-ms", str(tpot_s * 1000),
              "--controller-interval-s", str(args.interval_s),
              "--controller-window-s", str(args.window_s),
              "--controller-cooldown-s", str(args.cooldown_s),
              "--controller-hand-over" if args.hand_over else "--no-controller-hand-over"]
    out = ex.output_dir(args, "sim_fleet")
    if args.model:
        out.mkdir(parents=True, exist_ok=True)
        fleet = Fleet.start(args.model, out / f"{name}.log", args.port, "--num-prefill",
                            str(num_prefill), "--num-decode",
                            str(args.num_workers - num_prefill), *common, engine=None)
    else:
        fleet = ex._start(args, name, *ex._fleet_flags(
            args, num_prefill, args.num_workers - num_prefill, *common))
    order = ["A" if i % 2 == 0 else "B" for i in range(args.num_phases)]
    results: list[list[dict[str, Any]]] = [[] for _ in order]
    timeline: list[dict[str, Any]] = []
    stop = threading.Event()

    def phase(i: int, started: float) -> None:
        time.sleep(max(0.0, started + i * args.phase_s - time.monotonic()))
        shape = phases[order[i]]
        report = run_load(fleet.base_url, fleet.model, shape["rate"], args.phase_s, out,
                          args.clients, seed=args.seed * 100 + i,
                          prompt_words=max(1, round(shape["prompt_tokens"] / TOKENS_PER_WORD)),
                          max_tokens=shape["output_tokens"])
        results[i] = report["results"]

    def watch(started: float) -> None:
        while not stop.wait(1.0):
            try:
                status = fleet.status()
            except Exception:  # a slow answer under load: the next second's
                continue
            roles = [w["role"] for w in status["workers"]]
            timeline.append({"t_s": time.monotonic() - started,
                             "prefill": roles.count("prefill"),
                             "state": status["controller"]["state"]})

    try:
        started = time.monotonic()
        threads = [threading.Thread(target=phase, args=(i, started)) for i in range(len(order))]
        watcher = threading.Thread(target=watch, args=(started,), daemon=True)
        for thread in [*threads, watcher]:
            thread.start()
        for thread in threads:
            thread.join()
        stop.set()
        controller_status = fleet.status()["controller"]
        flips = controller_status["num_flips"]
    finally:
        fleet.stop()
    per_phase = []
    for i, phase_results in enumerate(results):
        good = sum(1 for r in phase_results if meets_slos(r, slo))
        failed = [r for r in phase_results if not r["ok"]]
        causes = Counter(f"{r['cause']}: {r['error'][:80]}" for r in failed)
        per_phase.append({"phase": order[i], "sent": len(phase_results), "good": good,
                          "failed": len(failed), "failures": dict(causes.most_common(5)),
                          "goodput": good / args.phase_s})
        print(f"[{name}] phase {i} ({order[i]}): {len(phase_results)} sent, {good} met the "
              f"SLOs, {len(failed)} failed {dict(causes.most_common(3))}", flush=True)
    total = sum(p["good"] for p in per_phase) / (args.phase_s * len(order))
    print(f"[{name}] goodput {total:.2f} req/s (wall), {flips} flips", flush=True)
    run = {"name": name, "start_prefill": num_prefill, "controller": controller,
           "phases": per_phase, "goodput": total, "num_flips": flips, "timeline": timeline}
    if controller:
        run["last_moves"] = controller_status.get("last_moves", [])
        run["moves"] = moves_by_phase(timeline, args.phase_s, len(order))
        print(f"[{name}] moves: " + "; ".join(
            f"phase {m['phase']}: first after {m['first_move_s']} s, {m['num_changes']} "
            f"changes, split {m['splits']}" for m in run["moves"]), flush=True)
    return run


def moves_by_phase(timeline: list[dict[str, Any]], phase_s: float, num_phases: int
                   ) -> list[dict[str, Any]]:
    """Per phase, from the controller run's split each second: the seconds from the phase's
    start to the first change of the split (None: none), how many times it changed, and the
    splits it went through."""
    out = []
    for i in range(num_phases):
        start, end = i * phase_s, (i + 1) * phase_s
        before = [p["prefill"] for p in timeline if p["t_s"] < start]
        points = [p for p in timeline if start <= p["t_s"] < end]
        current = before[-1] if before else (points[0]["prefill"] if points else None)
        first = None
        splits, changes = [current], 0
        for point in points:
            if point["prefill"] != splits[-1]:
                changes += 1
                splits.append(point["prefill"])
                if first is None:
                    first = round(point["t_s"] - start, 1)
        out.append({"phase": i, "first_move_s": first, "num_changes": changes,
                    "splits": splits})
    return out


def plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's values as JSON takes them."""
    return {k: v if isinstance(v, (int, float, str, list, tuple, type(None))) else str(v)
            for k, v in vars(args).items()}


def meets_slos(result: dict[str, Any], slo: SLOConfig) -> bool:
    """Whether a load client's result (benchmarks/sim_fleet/load.py) met both SLOs."""
    outcome = RequestOutcome(0, success=result["ok"] and result["ttft_s"] is not None,
                             ttft_s=result["ttft_s"] or 0.0, latency_s=result["latency_s"])
    return meets_slo(outcome, result["tokens"] or 0, slo)


def phases(args: argparse.Namespace) -> int:
    """Goodput of the controller moving workers under alternating phases, against fixed splits
    and a per-phase oracle."""
    if args.model:
        if args.rates is None:
            raise SystemExit("--model needs --rates (each phase's req/s on this host)")
        args.speedup = 1.0  # the real engine's steps: the SLOs are wall time
    planned = plan(args)
    for name, phase in planned.items():
        print(f"[phases] {name}: {phase['prompt_tokens']} in / {phase['output_tokens']} out, "
              f"planned best split {phase['best_prefill']}P, rate {phase['rate']:.1f} req/s (wall)",
              flush=True)
    if args.model:  # no plan: every split
        splits = args.splits or list(range(1, args.num_workers))
    else:
        best = sorted({planned["A"]["best_prefill"], planned["B"]["best_prefill"]})
        splits = args.splits or sorted({*best, (best[0] + best[-1]) // 2})
    start = args.start_prefill or args.num_workers // 2
    runs = [_run(args, "phases-controller", planned, start, controller=True)]
    runs += [_run(args, f"phases-fixed-{p}p", planned, p, controller=False) for p in splits]
    fixed = [r for r in runs if not r["controller"]]
    best_fixed = max(fixed, key=lambda r: r["goodput"])
    oracle = sum(max(r["phases"][i]["good"] for r in fixed)
                 for i in range(args.num_phases)) / (args.phase_s * args.num_phases)
    ctl = runs[0]
    report = {"machine": ex._machine(),
              "args": plain_args(args),
              "plan": planned, "runs": runs,
              "best_fixed": best_fixed["name"],
              "controller_vs_best_fixed": ctl["goodput"] / max(best_fixed["goodput"], 1e-9),
              "controller_vs_oracle": ctl["goodput"] / max(oracle, 1e-9),
              "oracle_goodput": oracle}
    print(f"[phases] controller {ctl['goodput']:.2f} req/s, best fixed "
          f"({best_fixed['name']}) {best_fixed['goodput']:.2f}, oracle {oracle:.2f}: "
          f"{report['controller_vs_best_fixed']:.2f}x the best fixed split, "
          f"{report['controller_vs_oracle']:.0%} of the oracle", flush=True)
    path = ex._write(args, "phases", report)
    _plot(report, args, path.with_suffix(".png"))
    return 0


def _plot(report: dict[str, Any], args: argparse.Namespace, path) -> None:
    plt = ex.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7))
    ctl = report["runs"][0]
    top.step([p["t_s"] for p in ctl["timeline"]], [p["prefill"] for p in ctl["timeline"]],
             where="post", label="controller's prefill workers")
    for i in range(args.num_phases):
        name = "A" if i % 2 == 0 else "B"
        best = report["plan"][name]["best_prefill"]
        if best is None:  # (the real engine: no plan)
            continue
        top.hlines(best, i * args.phase_s, (i + 1) * args.phase_s, colors="gray",
                   linestyles="dashed", label="each phase's planned best" if i == 0 else None)
    top.set_xlabel("wall seconds")
    top.set_ylabel("prefill workers")
    top.legend()
    width = 0.8 / len(report["runs"])
    for k, run in enumerate(report["runs"]):
        bottom.bar([i + k * width for i in range(args.num_phases)],
                   [p["goodput"] for p in run["phases"]], width, label=run["name"])
    bottom.set_xticks([i + 0.4 - width / 2 for i in range(args.num_phases)],
                      ["A" if i % 2 == 0 else "B" for i in range(args.num_phases)])
    bottom.set_ylabel("goodput per phase (req/s, wall)")
    bottom.legend(fontsize=7)
    ex.save_figure(fig, plt, path)
