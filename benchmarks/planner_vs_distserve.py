"""The planner against DistServe's simulator: pdserve's goodput estimate for each placement
of 2..6 GPUs beside the goodput DistServe's own simulator (github.com/LLMServe/DistServe,
simdistserve/) finds for it, on DistServe's OPT-13B / A100 profile.

    # the reference: a DistServe checkout and a Python with simpy, numpy and pandas
    python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install simpy numpy pandas
    git clone https://github.com/LLMServe/DistServe /tmp/distserve
    python -m benchmarks.planner_vs_distserve --distserve-dir /tmp/distserve \
        --distserve-python /tmp/dsvenv/bin/python [--output-dir /tmp/bench] [--tp1-only]
    # again, from the reference that run saved (no DistServe needed)
    python -m benchmarks.planner_vs_distserve --reference-json /tmp/bench/distserve-reference.json

What it measures, and how:

- The workload: every request 512 prompt tokens and 64 output tokens (--input-len,
  --output-len), Poisson arrivals, SLOs TTFT 250 ms and TPOT 100 ms (--ttft-ms, --tpot-ms).
- The reference: DistServe's DisaggCluster (P prefill and D decode instances at their TP
  degrees, PP 1) run by its simpy simulation exactly as its simulate_dist.py sets it up (its
  worker config, its prefill token cap from max_num_tokens.csv), with the requests arriving at
  the same times as in pdserve's simulation (goodput_model.poisson_arrivals: the same seeded
  unit gaps, scaled by the rate), so the two differ by their models and not by a draw of
  arrivals (one draw moves a goodput by about 5% either way at 1000 requests). DistServe
  passes a rate when the 90th percentile of its TTFTs is under the TTFT SLO and that of its
  TPOTs under the TPOT SLO, each on its own (its search_binary.py); the reference also records
  the rate by pdserve's rule (90% of requests meeting both). Its goodput is the highest
  passing rate: doubling from 0.25 req/s, then ten bisections on a log scale (to 0.07%).
- pdserve: goodput_model.estimate_goodput, as `pdserve plan --num-requests 1000` runs it, on
  "bundled", the bundled profile as shipped (distserve-opt-13b-a100); "steps", that profile
  with DistServe's step times as its simulator charges them (the reference reads them off
  DistServe's own estimator functions and per-step overhead, probing each at a few batches
  and checking that the result is linear); and "matched", which also takes DistServe's batch
  limits (its prefill token cap; its decode cap of 50,000 context tokens as sequences at the
  workload's mean context) and its instant hand-off (no KV transfer time), so that it differs
  from DistServe only in what the two simulations do.
- It prints one row per placement (goodput by each, the relative error of pdserve's against
  DistServe's criterion) and, for each pdserve column, the median absolute error, the signed
  mean error and the worst; and the time of one estimate_goodput and of one simulate() call.
  It writes everything as JSON to --output-dir (outside the checkout).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DISTSERVE_DECODE_TOKEN_CAP = 50_000
"""simdistserve/base/worker.py _enter_decodes: a decode step admits sequences while their
contexts (each + 1) sum to at most this (a constant there, not a setting)."""


# ---- the reference: runs under DistServe's Python, imports nothing of pdserve -------------
def _reference_worker() -> None:
    """Reads a job (JSON) on stdin, writes DistServe's goodput of each placement on stdout."""
    job = json.load(sys.stdin)
    import numpy as np
    import simpy
    from simdistserve.base.scheduler import put_requests_with_interarrivals
    from simdistserve.base.worker import Worker, WorkerConfig
    from simdistserve.base.workload import convert_pd_pair_to_request
    from simdistserve.clusters.disagg import DisaggCluster
    from simdistserve.constants import ModelTypes
    from simdistserve.estimators.memory_estimator import get_max_num_tokens
    from simdistserve.estimators.time_estimator import get_decode_time, get_prefill_time

    model = ModelTypes.opt_13b
    input_len, output_len = job["input_len"], job["output_len"]
    ttft_ms, tpot_ms, target = job["ttft_ms"], job["tpot_ms"], job["attainment"]
    unit_gaps = job["unit_gaps"]

    def overhead_ms(num_context_tokens: int) -> float:
        return Worker.add_ray_overhead(None, num_context_tokens)  # reads nothing of self

    def prefill_ms(lengths: list[int], tp: int) -> float:
        # Worker.do_prefill: the estimate plus the per-step overhead on the prompts' tokens
        return get_prefill_time(sum(lengths), model_type=model, TP=tp,
                                prefill_len_list=lengths) + overhead_ms(sum(lengths))

    def decode_ms(contexts: list[int], tp: int) -> float:
        # Worker.do_decode: each sequence is charged its context + 1; the overhead its context
        return get_decode_time(len(contexts), model_type=model, TP=tp,
                               token_generated_list=[c + 1 for c in contexts]
                               ) + overhead_ms(sum(contexts))

    def linear(points: list[tuple[tuple[float, float], float]]) -> list[float]:
        """Exact a + b·x + c·y through the first three points, checked on the rest."""
        x = np.array([[1.0, f1, f2] for (f1, f2), _ in points])
        y = np.array([t for _, t in points])
        coefs = np.linalg.solve(x[:3], y[:3])
        worst = float(np.max(np.abs(x @ coefs - y) / y))
        if worst > 1e-6:
            raise SystemExit(f"DistServe's step time is not linear in pdserve's terms ({worst})")
        return [float(c) / 1000 for c in coefs]  # ms -> s

    def step_models(tp: int) -> dict[str, list[float]]:
        # pdserve's prefill terms: N = Σ L, A = Σ L²; decode: C = Σ (context + 1), B.
        prefill_batches = [[100], [1000], [100] * 5, [300, 700], [512] * 7]
        decode_batches = [[99], [999], [99] * 10, [300, 700, 41], [512] * 60]
        return {
            "prefill": linear([((sum(b), sum(x * x for x in b)), prefill_ms(b, tp))
                               for b in prefill_batches]),
            "decode": linear([((sum(c + 1 for c in b), len(b)), decode_ms(b, tp))
                              for b in decode_batches]),
            "prefill_max_tokens": int(get_max_num_tokens(model, tp, 1)),
        }

    def run(p: int, d: int, tp_p: int, tp_d: int, rate: float) -> dict[str, bool]:
        requests = convert_pd_pair_to_request([(input_len, output_len)] * len(unit_gaps))
        env = simpy.Environment()
        config = WorkerConfig(  # as simulate_dist.py main() sets DistServe up
            model_type=model, TP=tp_p, TP_Prefill=tp_p, TP_Decode=tp_d,
            prefill_max_batch_size=10**7, decode_max_batch_size=10**7,
            prefill_max_tokens=get_max_num_tokens(model, tp_p, 1),
            decode_max_tokens=get_max_num_tokens(model, tp_d, 1),
            enable_chunked_prefill=False, engine_type="distserve")
        cluster = DisaggCluster(env=env, N_prefill_instance=p, N_decode_instance=d,
                                PP_prefill=1, PP_decode=1, worker_configs=config)
        cluster.run()
        put_requests_with_interarrivals(env, cluster.scheduler,
                                        [g / rate * 1000 for g in unit_gaps], requests)
        env.run()
        ttft, tpot = [], []
        for r in requests:  # organize_data.calculate_per_request_latency, without pandas
            start = min(t for t, e, _ in r.log if e == "init")
            first = min(t for t, e, _ in r.log if e == "wait_decode")
            end = max(t for t, e, _ in r.log if e == "exit_system")
            ttft.append(first - start)
            tpot.append((end - first) / r.output_lens)
        ttft_a, tpot_a = np.array(ttft), np.array(tpot)
        return {
            "distserve": bool(np.quantile(ttft_a, target) < ttft_ms
                              and np.quantile(tpot_a, target) < tpot_ms),
            "joint": bool(np.mean((ttft_a <= ttft_ms) & (tpot_a <= tpot_ms)) >= target),
        }

    def goodput(p: int, d: int, tp_p: int, tp_d: int) -> dict[str, float]:
        cache: dict[float, dict[str, bool]] = {}

        def meets(rate: float, criterion: str) -> bool:
            if rate not in cache:
                cache[rate] = run(p, d, tp_p, tp_d, rate)
            return cache[rate][criterion]

        out: dict[str, float] = {}
        for criterion in ("distserve", "joint"):
            low = 0.25
            while low > 1e-3 and not meets(low, criterion):
                low /= 4
            if not meets(low, criterion):
                out[criterion] = 0.0
                continue
            high = low * 2
            while meets(high, criterion):
                low, high = high, high * 2
            for _ in range(10):
                mid = math.sqrt(low * high)
                low, high = (mid, high) if meets(mid, criterion) else (low, mid)
            out[criterion] = low
        out["num_runs"] = len(cache)
        return out

    tps = sorted({tp for pl in job["placements"] for tp in pl[2:]})
    result: dict[str, Any] = {"step_models": {str(tp): step_models(tp) for tp in tps},
                              "goodput": {}}
    for p, d, tp_p, tp_d in job["placements"]:
        started = time.perf_counter()
        found = goodput(p, d, tp_p, tp_d)
        found["seconds"] = round(time.perf_counter() - started, 1)
        result["goodput"][f"{p},{d},{tp_p},{tp_d}"] = found
        print(f"reference {p}P(TP{tp_p}) + {d}D(TP{tp_d}): {found}", file=sys.stderr,
              flush=True)
    json.dump(result, sys.stdout)


# ---- the comparison ----------------------------------------------------------------------
def _job(args: argparse.Namespace, placements: list[tuple[int, int, int, int]]
         ) -> dict[str, Any]:
    from pdserve.planner.goodput_model import poisson_arrivals

    arrivals = poisson_arrivals(args.num_requests, 1.0, args.seed)
    return {
        "input_len": args.input_len, "output_len": args.output_len,
        "ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms, "attainment": args.attainment,
        "seed": args.seed, "num_requests": args.num_requests,
        "unit_gaps": [b - a for a, b in zip([0.0, *arrivals[:-1]], arrivals, strict=True)],
        "placements": [list(p) for p in placements],
    }


def _reference(args: argparse.Namespace, job: dict[str, Any]) -> dict[str, Any]:
    if args.reference_json:
        reference = json.loads(Path(args.reference_json).read_text())
        for key in ("input_len", "output_len", "ttft_ms", "tpot_ms", "attainment", "seed",
                    "num_requests"):
            if reference["job"][key] != job[key]:
                raise SystemExit(f"--reference-json was made with {key}="
                                 f"{reference['job'][key]}, not {job[key]}")
        gaps = reference["job"]["unit_gaps"]
        if max(abs(a - b) for a, b in zip(gaps, job["unit_gaps"], strict=True)) > 1e-9:
            raise SystemExit("--reference-json saw other arrivals than pdserve's simulation now "
                             "draws: make it again")
        missing = [p for p in job["placements"] if ",".join(map(str, p))
                   not in reference["result"]["goodput"]]
        if missing:
            raise SystemExit(f"--reference-json lacks placements {missing}")
        return reference
    if not args.distserve_dir:
        raise SystemExit("give --distserve-dir (and --distserve-python) or --reference-json")
    env = {**os.environ, "PYTHONPATH": str(Path(args.distserve_dir).resolve())}
    started = time.perf_counter()
    done = subprocess.run([args.distserve_python, str(Path(__file__).resolve()),
                           "--reference-worker"], input=json.dumps(job), env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"DistServe's simulator failed:\n{done.stderr[-4000:]}")
    return {"job": job, "result": json.loads(done.stdout),
            "distserve_dir": str(args.distserve_dir),
            "seconds": round(time.perf_counter() - started, 1)}


def _distserve_profiles(step_models: dict[str, Any], args: argparse.Namespace
                        ) -> tuple[Any, Any]:
    """The bundled profile with DistServe's step times ("steps"), and with its batch limits
    and instant hand-off as well ("matched")."""
    from pdserve.planner.goodput_model import LinearLatency
    from pdserve.planner.latency_profile import load_profile

    bundled = load_profile(args.profile)

    def model(coefs: list[float]) -> LinearLatency:
        return LinearLatency(coefs[0], (coefs[1], coefs[2]), 0, 0.0)

    steps = dataclasses.replace(
        bundled,
        prefill={int(tp): model(m["prefill"]) for tp, m in step_models.items()},
        decode={int(tp): model(m["decode"]) for tp, m in step_models.items()},
        source="DistServe's simulator's step times (benchmarks/planner_vs_distserve.py)")
    mean_context = args.input_len + args.output_len / 2 + 1
    matched = dataclasses.replace(
        steps, kv_transfer_bytes_per_s=None,
        max_num_batched_tokens=min(m["prefill_max_tokens"] for m in step_models.values()),
        max_num_seqs=int(DISTSERVE_DECODE_TOKEN_CAP // mean_context))
    return steps, matched


def _errors(rows: list[dict[str, Any]], column: str) -> dict[str, float]:
    errors = [r[column] / r["distserve"] - 1 for r in rows if r["distserve"] > 0]
    return {
        "median_abs_error": statistics.median(abs(e) for e in errors),
        "signed_mean_error": statistics.fmean(errors),
        "worst_error": max(errors, key=abs),
        "min_error": min(errors),
        "max_error": max(errors),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--distserve-dir", help="a DistServe checkout (holds simdistserve/)")
    parser.add_argument("--distserve-python", default="python3",
                        help="a Python with simpy, numpy and pandas (default python3)")
    parser.add_argument("--reference-json", help="DistServe's numbers from an earlier run")
    parser.add_argument("--output-dir", default="/tmp/bench")
    parser.add_argument("--profile", default="distserve-opt-13b-a100")
    parser.add_argument("--min-gpus", type=int, default=2)
    parser.add_argument("--max-gpus", type=int, default=6)
    parser.add_argument("--tp1-only", action="store_true", help="only TP-1 placements")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ttft-ms", type=float, default=250.0)
    parser.add_argument("--tpot-ms", type=float, default=100.0)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.reference_worker:
        _reference_worker()
        return 0

    from pdserve.planner.goodput_model import (
        RequestShape,
        SimulationConfig,
        estimate_goodput,
        simulate,
    )
    from pdserve.planner.latency_profile import load_profile
    from pdserve.planner.search import placements

    bundled = load_profile(args.profile)
    found: set[tuple[int, int, int, int]] = set()
    for num_gpus in range(args.min_gpus, args.max_gpus + 1):
        for p in placements(bundled, num_gpus):
            if not args.tp1_only or (p.prefill_tp, p.decode_tp) == (1, 1):
                found.add((p.num_prefill, p.num_decode, p.prefill_tp, p.decode_tp))
    chosen = sorted(found, key=lambda p: (p[0] * p[2] + p[1] * p[3], p))
    job = _job(args, chosen)
    reference = _reference(args, job)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.reference_json:
        (out_dir / "distserve-reference.json").write_text(json.dumps(reference) + "\n")
    steps, matched = _distserve_profiles(reference["result"]["step_models"], args)
    workload = [RequestShape(args.input_len, 0, args.output_len)]
    base = SimulationConfig(args.ttft_ms / 1000, args.tpot_ms / 1000, args.attainment,
                            num_requests=args.num_requests, seed=args.seed)
    profiles = {"bundled": bundled, "steps": steps, "matched": matched}
    rows: list[dict[str, Any]] = []
    timings: dict[str, list[float]] = {"estimate_goodput_s": [], "simulate_s": []}
    for p, d, tp_p, tp_d in chosen:
        ref = reference["result"]["goodput"][f"{p},{d},{tp_p},{tp_d}"]
        row: dict[str, Any] = {"placement": f"{p}P(TP{tp_p}) + {d}D(TP{tp_d})",
                               "num_gpus": p * tp_p + d * tp_d,
                               "distserve": ref["distserve"], "distserve_joint": ref["joint"]}
        for name, profile in profiles.items():
            config = profile.simulation_config(base)
            models = profile.models(tp_p, tp_d)
            started = time.perf_counter()
            row[name] = estimate_goodput(workload, p, d, models, config)
            if name == "bundled":
                timings["estimate_goodput_s"].append(time.perf_counter() - started)
                started = time.perf_counter()
                simulate(workload, row[name], p, d, models, config)
                timings["simulate_s"].append(time.perf_counter() - started)
        rows.append(row)

    print(f"pdserve's planner against DistServe's simulator: {args.input_len} in / "
          f"{args.output_len} out, TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms at "
          f"{100 * args.attainment:g}%, {args.num_requests} requests (seed {args.seed}, the "
          f"same arrivals in both); goodput in req/s")
    print(f"{'placement':<22} {'GPUs':>4} {'DistServe':>10} {'(joint)':>9}"
          + "".join(f" {name:>9} {'err':>7}" for name in profiles))
    for r in rows:
        print(f"{r['placement']:<22} {r['num_gpus']:>4} {r['distserve']:>10.3f} "
              f"{r['distserve_joint']:>9.3f}"
              + "".join(f" {r[name]:>9.3f} {100 * (r[name] / r['distserve'] - 1):>+6.1f}%"
                        for name in profiles))
    summary = {name: _errors(rows, name) for name in profiles}
    summary["distserve_joint"] = _errors(rows, "distserve_joint")
    for name, s in summary.items():
        print(f"{name:>16}: median |error| {100 * s['median_abs_error']:.1f}%, signed mean "
              f"{100 * s['signed_mean_error']:+.1f}%, worst {100 * s['worst_error']:+.1f}% "
              f"(range {100 * s['min_error']:+.1f}% to {100 * s['max_error']:+.1f}%)")
    timing = {k: {"median": statistics.median(v), "max": max(v)} for k, v in timings.items()}
    print(f"pdserve time: estimate_goodput median {timing['estimate_goodput_s']['median']:.2f} s"
          f" (max {timing['estimate_goodput_s']['max']:.2f} s), one simulate() at the goodput "
          f"median {1000 * timing['simulate_s']['median']:.0f} ms")
    result = {"job": {k: v for k, v in job.items() if k != "unit_gaps"}, "rows": rows,
              "summary": summary, "timing": timing,
              "steps_profile": steps.to_dict(), "matched_profile": matched.to_dict(),
              "reference_seconds": reference.get("seconds")}
    (out_dir / "planner_vs_distserve.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_dir / 'planner_vs_distserve.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
