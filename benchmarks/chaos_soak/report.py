"""The soak's result: the load offered and sent, failures by cause, answers checked by kind,
each kill's restart to ready, goodput per window, and the leak check after the run."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.chaos_soak.checks import LOST_WITH_KILLED_ROUTER, Kill, cause_of, overlapping_kills
from benchmarks.chaos_soak.workload import KINDS, Outcome
from pdserve.benchmarks.plots import pyplot, save_figure

WINDOW_S = 5.0


def goodput_windows(outcomes: list[Outcome], duration_s: float, ttft_slo_ms: float,
                    tpot_slo_ms: float) -> list[float]:
    """Requests per second completed right and within both SLOs, per WINDOW_S window of
    completion."""
    windows = [0.0] * (int(duration_s // WINDOW_S) + 1)
    for o in outcomes:
        tpot = o.tpot_s
        if o.ok and o.wrong is None and o.ttft_s is not None and \
                o.ttft_s * 1e3 <= ttft_slo_ms and (tpot is None or tpot * 1e3 <= tpot_slo_ms):
            index = min(int(o.end_s // WINDOW_S), len(windows) - 1)
            windows[index] += 1 / WINDOW_S
    return windows


def send_stats(outcomes: list[Outcome], offered_rate: float, duration_s: float
               ) -> dict[str, Any]:
    """The rate the clients really sent at beside the one asked for. planned_rate: the
    schedule's arrivals over the duration (a Poisson draw of offered_rate); sent_rate: the
    requests sent before the duration was over, over the duration (a client that fell behind
    sends the rest late); and how late sends were."""
    if not outcomes:
        return {"offered_rate": offered_rate, "planned_rate": 0.0, "num_sent": 0,
                "sent_rate": 0.0}
    lags = sorted(o.start_s - o.at_s for o in outcomes)
    return {"offered_rate": offered_rate, "planned_rate": len(outcomes) / duration_s,
            "num_sent": len(outcomes),
            "sent_rate": sum(o.start_s < duration_s for o in outcomes) / duration_s,
            "send_lag_p50_s": lags[len(lags) // 2],
            "send_lag_p99_s": lags[min(len(lags) - 1, int(0.99 * len(lags)))],
            "send_lag_max_s": lags[-1]}


def kill_rows(outcomes: list[Outcome], kills: list[Kill]) -> list[dict[str, Any]]:
    """Each kill, with the requests its outage overlapped and how many of those failed."""
    rows = []
    for kill in kills:
        during = [o for o in outcomes if kill in overlapping_kills(o, [kill])]
        rows.append({**asdict(kill), "victim": kill.name, "empties_pool": kill.empties_pool,
                     "num_requests_overlapping": len(during),
                     "num_sent_during_outage": sum(kill.at_s <= o.start_s <= kill.back_at_s
                                                   for o in during),
                     "failed_overlapping": dict(Counter(
                         c for o in during if (c := cause_of(o, kills)) is not None))})
    return rows


def summarise(outcomes: list[Outcome], kills: list[Kill], leaks: dict[str, Any],
              offered_rate: float, capacity: dict[str, Any] | None,
              args: argparse.Namespace) -> dict[str, Any]:
    causes = {o.index: cause_of(o, kills) for o in outcomes}
    failed = [o for o in outcomes if causes[o.index] is not None]
    lost = [o for o in failed if causes[o.index] == LOST_WITH_KILLED_ROUTER]
    not_ok = [o for o in failed if not o.ok and o not in lost]
    wrong = [o for o in failed if o.ok]
    worker_kills = [k for k in kills if any(v.startswith(("prefill", "decode"))
                                            for v in k.victims)]
    checked = Counter(o.kind for o in outcomes if o.ok)
    capacity_rate = None if capacity is None else capacity["capacity_req_s"]
    return {
        "duration_s": args.duration_s, "rate": offered_rate,
        "load": send_stats(outcomes, offered_rate, args.duration_s),
        "capacity": capacity, "capacity_req_s": capacity_rate,
        "capacity_fraction": None if not capacity_rate else offered_rate / capacity_rate,
        "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
        "requests": len(outcomes), "by_kind": dict(Counter(o.kind for o in outcomes)),
        "completed": len(outcomes) - len(not_ok) - len(lost),
        "completed_right": len(outcomes) - len(failed),
        "failed": len(not_ok), LOST_WITH_KILLED_ROUTER: len(lost),
        "failed_by_cause": dict(Counter(causes[o.index] for o in not_ok)),
        "failed_by_kind": dict(Counter(o.kind for o in not_ok)),
        "failed_during_worker_kills": dict(Counter(
            causes[o.index] for o in not_ok + wrong if overlapping_kills(o, worker_kills))),
        "checked_by_kind": {kind: checked[kind] for kind in KINDS},
        "wrong_by_kind": dict(Counter(o.kind for o in wrong)),
        "errors": [{"at_s": round(o.start_s, 1), "kind": o.kind, "router": o.router,
                    "cause": causes[o.index], "error": o.error or o.wrong}
                   for o in failed][:50],
        "kills": kill_rows(outcomes, kills),
        "goodput_window_s": WINDOW_S,
        "goodput_per_window": goodput_windows(outcomes, args.duration_s, args.ttft_slo_ms,
                                              args.tpot_slo_ms),
        "after_the_run": leaks,
        "outcomes": [asdict(o) for o in outcomes],
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4))
    windows = result["goodput_per_window"]
    times = [(i + 0.5) * result["goodput_window_s"] for i in range(len(windows))]
    ax.plot(times, windows, color="tab:blue", label="goodput (right, within SLOs, req/s)")
    ax.axhline(result["rate"], color="tab:gray", linestyle="--", label="offered rate")
    ax.axhline(result["load"]["sent_rate"], color="tab:green", linestyle=":",
               label="sent rate")
    for kill in result["kills"]:
        ax.axvline(kill["at_s"], color="tab:red", linestyle=":")
        ready = kill["ready_after_s"]
        label = f"{kill['victim']} ({ready:.1f} s)" if ready is not None else kill["victim"]
        ax.text(kill["at_s"], 0.98, label, rotation=90, fontsize=7, va="top",
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests / s")
    ax.set_title(f"chaos soak: {result['failed']} failed, {sum(result['wrong_by_kind'].values())}"
                 f" wrong of {result['requests']}")
    ax.legend(loc="lower left")
    return save_figure(fig, plt, path)


def print_table(result: dict[str, Any]) -> None:
    load = result["load"]
    capacity = result["capacity"]
    if capacity is not None:
        print("capacity sweep (offered / planned / sent / served req/s, completed, keeps up):")
        for step in capacity["steps"]:
            print(f"  {step['offered_rate']:6.2f} {step['planned_rate']:6.2f} "
                  f"{step['sent_rate']:6.2f} "
                  f"{step['served_rate']:6.2f}  {step['num_completed']}/{step['num_sent']}  "
                  f"{step['keeps_up']}")
        bound = "at least " if capacity.get("is_lower_bound") else ""
        print(f"capacity {bound}{capacity['capacity_req_s']} req/s ({capacity['definition']})")
    print(f"offered {result['rate']:.2f} req/s, planned {load['planned_rate']:.2f}, sent "
          f"{load['sent_rate']:.2f} req/s "
          f"(send lag p50 {load.get('send_lag_p50_s', 0):.3f} s, p99 "
          f"{load.get('send_lag_p99_s', 0):.3f} s), {result['requests']} requests "
          f"{result['by_kind']}")
    print(f"completed {result['completed']}  right {result['completed_right']}  failed "
          f"{result['failed']} {result['failed_by_cause']}  lost with the killed router "
          f"{result[LOST_WITH_KILLED_ROUTER]}")
    print(f"checked by kind {result['checked_by_kind']}  wrong by kind "
          f"{result['wrong_by_kind']}  failed during worker kills "
          f"{result['failed_during_worker_kills']}")
    if "n2_references" in result:
        print(f"n2 undisturbed runs the same as the offline engine's (seeded alike): "
              f"{result['n2_references']['same_as_offline_engine']}/"
              f"{result['n2_references']['num']}")
    for kill in result["kills"]:
        print(f"  {kill['at_s']:6.0f} s  {kill['victim']:<20} ready {kill['ready_after_s']} s "
              f"after its restart; {kill['num_requests_overlapping']} requests overlapped its "
              f"outage ({kill['num_sent_during_outage']} sent during it), failed "
              f"{kill['failed_overlapping']}" + ("  [pool emptied]" if kill["empties_pool"]
                                                 else ""))
    for error in result["errors"][:5]:
        print(f"  failed at {error['at_s']} s ({error['kind']}, router-{error['router']}, "
              f"{error['cause']}): {error['error']}")
    print("after the run:", json.dumps(result["after_the_run"]))
