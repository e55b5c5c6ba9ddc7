"""`pdserve plan`: size a disaggregated fleet from a latency profile, before it is bought.

    pdserve plan --profile profile.json --num-gpus 8 --slo-ttft-ms 400 --slo-tpot-ms 40 \\
        --input-len 1024 --output-len 128            # or --dataset-path TRACE.jsonl

Simulates every split of the GPUs into prefill and decode instances over the profile's TP
degrees (pdserve/planner/search.py) with Poisson arrivals, and prints a ranked table, the KV
bandwidth the best placement needs between the pools, and one JSON object last:

    {"best": {...}, "candidates": [{"num_prefill", "num_decode", "prefill_tp", "decode_tp",
                                    "num_gpus", "goodput_rps", "per_gpu_goodput_rps"}, ...]}

docs/planner.md documents the profile format and the simulation's assumptions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pdserve.planner.goodput_model import RequestShape, SimulationConfig
from pdserve.planner.latency_profile import LatencyProfile, ProfileError
from pdserve.planner.search import (
    Candidate,
    attainment_curve,
    kv_bandwidth_bytes_per_s,
    search,
)

NUM_PLOTTED = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimulationConfig(ttft_slo_s=1.0, tpot_slo_s=1.0)
    parser.add_argument(
        "--profile",
        required=True,
        help="latency profile JSON (pdserve profile's output, or a transcribed one)",
    )
    parser.add_argument(
        "--num-gpus",
        type=int,
        required=True,
        help="GPUs (on a CPU host: worker instances of one core) to split",
    )
    parser.add_argument("--slo-ttft-ms", type=float, required=True)
    parser.add_argument("--slo-tpot-ms", type=float, required=True)
    parser.add_argument(
        "--attainment",
        type=float,
        default=d.attainment,
        help="fraction of requests that must meet both SLOs",
    )
    workload = parser.add_mutually_exclusive_group(required=True)
    workload.add_argument("--input-len", type=int, help="prompt tokens of every request")
    workload.add_argument(
        "--dataset-path",
        help="Mooncake-format JSONL trace: its requests' input and output lengths are the workload",
    )
    parser.add_argument("--output-len", type=int, help="output tokens (with --input-len)")
    parser.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiplies the trace's lengths (to fit a small machine)",
    )
    parser.add_argument(
        "--num-requests", type=int, default=1000,
        help="simulated requests per rate, at least (more, up to 2048, where their arrivals "
             "would not span three requests' decode)"
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--plot", default=None, help=f"PNG of attainment against rate for the top {NUM_PLOTTED}"
    )
    parser.add_argument("--output", default=None, help="also write the JSON here")


def workload_from_args(args: argparse.Namespace) -> list[RequestShape]:
    if args.input_len is not None:
        if args.output_len is None:
            raise ValueError("--input-len needs --output-len")
        if args.input_len < 1 or args.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        return [RequestShape(args.input_len, 0, args.output_len)]
    from pdserve.benchmarks.datasets import load_mooncake_trace

    # Prefix reuse across requests is not modelled: every prompt is computed in full.
    return [
        RequestShape(
            max(1, round(int(e["input_length"]) * args.length_scale)),
            0,
            max(1, round(int(e["output_length"]) * args.length_scale)),
        )
        for e in load_mooncake_trace(args.dataset_path)
    ]


def print_table(candidates: list[Candidate]) -> None:
    print(f"{'rank':>4}  {'placement':<22} {'GPUs':>4} {'goodput req/s':>14} {'per GPU':>9}")
    for rank, c in enumerate(candidates, 1):
        print(
            f"{rank:>4}  {c.placement.describe():<22} {c.placement.num_gpus:>4} "
            f"{c.goodput_rps:>14.3f} {c.per_gpu_goodput_rps:>9.3f}"
        )


def bandwidth_line(
    profile: LatencyProfile, best: Candidate, workload: list[RequestShape]
) -> tuple[str, dict[str, Any]]:
    need = kv_bandwidth_bytes_per_s(profile, best.goodput_rps, workload)
    info: dict[str, Any] = {
        "needed_bytes_per_s": need,
        "profile_bytes_per_s": profile.kv_transfer_bytes_per_s,
    }
    line = (
        f"KV transfer between the pools at {best.goodput_rps:.3g} req/s: "
        f"{need / 1e9:.3g} GB/s needed"
    )
    if profile.kv_transfer_bytes_per_s:
        share = need / profile.kv_transfer_bytes_per_s
        info["fraction_of_profile"] = share
        line += (
            f", the profile's transfer rate is {profile.kv_transfer_bytes_per_s / 1e9:.3g}"
            f" GB/s ({100 * share:.1f}% of it"
            f"{'; the link is the bottleneck' if share > 1 else ''})"
        )
    else:
        line += " (the profile gives no transfer rate; hand-off time counted as 0)"
    return line, info


def run(args: argparse.Namespace) -> int:
    try:
        if not 0 < args.attainment <= 1 or args.num_requests < 1:
            raise ValueError("--attainment must be in (0, 1] and --num-requests >= 1")
        if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
            raise ValueError("the SLOs must be positive")
        profile = LatencyProfile.load(args.profile)
        workload = workload_from_args(args)
        config = SimulationConfig(
            ttft_slo_s=args.slo_ttft_ms / 1000,
            tpot_slo_s=args.slo_tpot_ms / 1000,
            attainment=args.attainment,
            num_requests=args.num_requests,
            seed=args.seed,
        )
        candidates = search(profile, args.num_gpus, workload, config)
    except (ProfileError, ValueError) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    print(
        f"pdserve plan: {profile.model} on {profile.hardware}, {args.num_gpus} GPUs, SLO "
        f"TTFT {args.slo_ttft_ms:g} ms / TPOT {args.slo_tpot_ms:g} ms at "
        f"{100 * args.attainment:g}%, {len(workload)} request shapes, "
        f"{args.num_requests} simulated requests per rate"
    )
    print_table(candidates)
    best = candidates[0]
    line, bandwidth = bandwidth_line(profile, best, workload)
    print(line)
    result: dict[str, Any] = {
        "best": best.to_dict(),
        "candidates": [c.to_dict() for c in candidates],
        "kv_bandwidth": bandwidth,
    }
    if args.plot:
        result["plot"] = str(plot(profile, candidates[:NUM_PLOTTED], workload, config, args.plot))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


def plot(
    profile: LatencyProfile,
    candidates: list[Candidate],
    workload: list[RequestShape],
    config: SimulationConfig,
    path: str | Path,
) -> Path:
    from pdserve.benchmarks import plots

    top = max(c.goodput_rps for c in candidates) or 1.0
    rates = [top * k / 10 for k in range(1, 21)]  # 0.1x .. 2x the best goodput
    curves = {
        c.placement.describe(): attainment_curve(profile, c.placement, workload, config, rates)
        for c in candidates
    }
    return plots.plot_attainment(
        curves, path, config.attainment, {c.placement.describe(): c.goodput_rps for c in candidates}
    )
