"""The soak itself: the capacity sweep, the undisturbed n2 runs, the load under kills, and the
checks after the run (the package's docstring says what each measures)."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chaos_soak.checks import Kill, judge, offline_reference
from benchmarks.chaos_soak.client import run_clients
from benchmarks.chaos_soak.fleet import NAMES, Fleet
from benchmarks.chaos_soak.report import plot, print_table, send_stats, summarise
from benchmarks.chaos_soak.workload import Outcome, n2_pool, plan
from pdserve.benchmarks.output import add_output_dir, output_path

VICTIMS = ("prefill-0", "decode-0", "master", "data-1", "router-0", "decode-0+decode-1",
           "prefill-0+prefill-1")
"""Killed in turn, round and round; `a+b` kills both at once (a pool emptied: the router
waits up to its --pool-wait-s for a worker of it to come back)."""
KEEP_UP = 0.95
COMPLETE = 0.99
CAPACITY_DEFINITION = (
    f"the highest offered rate of the rising sweep, below its first failing step, at which the "
    f"clients sent >= {KEEP_UP:.0%} of the planned arrivals within the step, >= {COMPLETE:.0%} "
    f"of the requests completed, and >= {KEEP_UP:.0%} completed by the step's end plus the "
    f"drain time")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="checkpoint dir (default: the embedded tiny random model)")
    add("--duration-s", type=float, default=600.0)
    add("--rate", type=float, default=None,
        help="Poisson arrivals per second (default: --capacity-fraction of the capacity the "
             "sweep finds)")
    add("--capacity-fraction", type=float, default=0.7)
    add("--sweep-start-rate", type=float, default=2.0, help="the sweep's first offered rate")
    add("--sweep-factor", type=float, default=1.25, help="each step's rate over the last's")
    add("--sweep-step-s", type=float, default=30.0, help="seconds of arrivals per step")
    add("--sweep-drain-s", type=float, default=5.0,
        help="a step's requests count as served when done this long after its last arrival")
    add("--sweep-max-steps", type=int, default=16)
    add("--num-clients", type=int, default=4, help="load client processes")
    add("--n2-references", type=int, default=50,
        help="n2 requests run undisturbed before the kills; the soak's n2 requests repeat them")
    add("--victims", nargs="+", default=list(VICTIMS),
        help="killed in turn; a+b kills both at once")
    add("--standbys", action=argparse.BooleanOptionalAction, default=True,
        help="restart from a standby that did its imports ahead, as `pdserve up` does (a "
             "standby imports at nice 19: on a host saturated by other work it may not be "
             "ready when needed, and --no-standbys restarts fresh processes)")
    add("--kill-every-s", type=float, default=45.0)
    add("--first-kill-s", type=float, default=30.0)
    add("--restart-after-s", type=float, default=1.0)
    add("--max-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    add("--request-timeout-s", type=float, default=300.0)
    add("--ttft-slo-ms", type=float, default=3000.0)
    add("--tpot-slo-ms", type=float, default=250.0)
    add("--base-port", type=int, default=19400)
    add("--seed", type=int, default=0)
    add("--output", default=None, help="the JSON file (default: chaos_soak.json in --output-dir)")
    add_output_dir(parser, "chaos_soak")


# ---- capacity: an open-loop sweep ----------------------------------------------------------
@dataclass
class SweepStep:
    offered_rate: float
    planned_rate: float
    """The step's arrivals over its duration (a Poisson draw of offered_rate)."""
    sent_rate: float
    num_sent: int
    num_completed: int
    num_served: int
    """Completed within the step's duration plus the drain time."""
    served_rate: float
    keeps_up: bool


def sweep_step(offered_rate: float, step_s: float, drain_s: float, outcomes: list[Outcome]
               ) -> SweepStep:
    stats = send_stats(outcomes, offered_rate, step_s)
    planned_rate, sent_rate = stats["planned_rate"], stats["sent_rate"]
    completed = [o for o in outcomes if o.ok]
    served = [o for o in completed if o.end_s <= step_s + drain_s]
    keeps_up = (sent_rate >= KEEP_UP * planned_rate
                and len(completed) >= COMPLETE * len(outcomes)
                and len(served) >= KEEP_UP * len(outcomes))
    return SweepStep(offered_rate, planned_rate, sent_rate, len(outcomes), len(completed),
                     len(served), len(served) / step_s, keeps_up)


def capacity_of(steps: list[SweepStep]) -> float | None:
    """The last rate that kept up before the first that did not (None: the first failed)."""
    capacity = None
    for step in steps:
        if not step.keeps_up:
            break
        capacity = step.offered_rate
    return capacity


def sweep(fleet: Fleet, args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    steps: list[SweepStep] = []
    rate = args.sweep_start_rate
    for k in range(args.sweep_max_steps):
        planned = plan(rate, args.sweep_step_s, args.seed + 1000 + k, tuple(args.max_tokens))
        _, outcomes = run_clients(fleet.router_urls, planned, args.num_clients, work_dir,
                                  args.request_timeout_s)
        steps.append(sweep_step(rate, args.sweep_step_s, args.sweep_drain_s, outcomes))
        print(f"sweep: offered {rate:.2f} req/s, planned {steps[-1].planned_rate:.2f}, sent "
              f"{steps[-1].sent_rate:.2f}, served "
              f"{steps[-1].served_rate:.2f}, {steps[-1].num_completed}/{steps[-1].num_sent} "
              f"completed: {'keeps up' if steps[-1].keeps_up else 'falls behind'}", flush=True)
        if not steps[-1].keeps_up:
            break
        rate *= args.sweep_factor
    return {"capacity_req_s": capacity_of(steps), "definition": CAPACITY_DEFINITION,
            # no step fell behind within --sweep-max-steps: the fleet may take more
            "is_lower_bound": all(step.keeps_up for step in steps),
            "step_s": args.sweep_step_s, "drain_s": args.sweep_drain_s,
            "steps": [asdict(step) for step in steps]}


# ---- the kills -----------------------------------------------------------------------------
def chaos(fleet: Fleet, args: argparse.Namespace, kills: list[Kill], t0: float) -> None:
    """Kill, restart, wait until ready, then the next victims, until the run's last stretch."""
    time.sleep(max(0.0, t0 + args.first_kill_s - time.monotonic()))
    turn = 0
    while time.monotonic() - t0 < args.duration_s - args.kill_every_s / 2:
        victims = args.victims[turn % len(args.victims)].split("+")
        turn += 1
        kill = Kill(victims, time.monotonic() - t0)
        for victim in victims:
            fleet.kill(victim)
        kill.dead_at_s = time.monotonic() - t0
        kills.append(kill)
        print(f"[{kill.at_s:6.0f} s] SIGKILL {kill.name}", flush=True)
        time.sleep(args.restart_after_s)
        for victim in victims:
            fleet.start(victim)
        kill.restarted_at_s = time.monotonic() - t0
        try:
            kill.ready_after_s_each = fleet.wait_ready(victims, 120.0)
            kill.ready_after_s = max(kill.ready_after_s_each.values())
        except TimeoutError as exc:
            print(f"  {exc}", flush=True)
        print(f"  {kill.name} ready {kill.ready_after_s} s after its restart", flush=True)
        for victim in victims:
            fleet.prepare_standby(victim)  # for its next kill, as the launcher would
        time.sleep(max(0.0, t0 + kill.at_s + args.kill_every_s - time.monotonic()))


# ---- after the run -------------------------------------------------------------------------
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


def run(args: argparse.Namespace) -> int:
    from pdserve.serve.default_model import default_model_dir

    model = args.model or str(default_model_dir())
    max_tokens = tuple(args.max_tokens)
    output = output_path(args, "chaos_soak", "chaos_soak.json", args.output)
    log_dir = output.parent / f"{output.stem}-logs"  # every process's log, kept for the causes
    shutil.rmtree(log_dir, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        fleet = Fleet(model, Path(tmp), args.base_port, use_standbys=args.standbys,
                      log_dir=log_dir)
        try:
            fleet.start_all()
            capacity, rate = None, args.rate
            if rate is None:
                capacity = sweep(fleet, args, Path(tmp) / "sweep")
                if capacity["capacity_req_s"] is None:
                    raise SystemExit("the sweep's first rate already falls behind: lower "
                                     "--sweep-start-rate")
                rate = args.capacity_fraction * capacity["capacity_req_s"]
                bound = " at least" if capacity["is_lower_bound"] else ""
                print(f"capacity{bound} {capacity['capacity_req_s']:.2f} req/s: load at "
                      f"{rate:.2f} req/s", flush=True)
            pool = n2_pool(args.n2_references, args.seed + 99, max_tokens, 1 / rate)
            _, undisturbed = run_clients(fleet.router_urls, pool, args.num_clients,
                                         Path(tmp) / "n2", args.request_timeout_s)
            failed = [o for o in undisturbed if not o.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} undisturbed n2 runs failed: {failed[0]}")
            planned = plan(rate, args.duration_s, args.seed, max_tokens, pool)
            kills: list[Kill] = []
            _, outcomes = run_clients(fleet.router_urls, planned, args.num_clients,
                                      Path(tmp) / "soak", args.request_timeout_s,
                                      during=lambda t0: chaos(fleet, args, kills, t0))
            fleet.wait_ready(list(NAMES), 120)  # the last victims back
            leaks = leak_check(fleet)
        finally:
            fleet.stop()
    by_index = {p.index: p for p in planned}
    greedy, n2_offline = offline_reference(model, outcomes, by_index, pool)
    judge(outcomes, by_index, greedy, {o.index: o for o in undisturbed})
    result = summarise(outcomes, kills, leaks, rate, capacity, args)
    result["n2_references"] = {"num": len(pool), "same_as_offline_engine": sum(
        o.texts == n2_offline.get(o.index) for o in undisturbed)}
    print_table(result)
    print(f"logs: {log_dir}")
    print(f"plot: {plot(result, output.with_suffix('.png'))}")
    output.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "outcomes"}))
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks.chaos_soak import __doc__ as doc

    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos_soak",
                                     description=(doc or "").splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    # a SIGTERM unwinds like an error, so that the fleet is stopped and the run dir removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
