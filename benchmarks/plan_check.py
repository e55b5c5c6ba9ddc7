"""Planned against measured: the goodput `pdserve plan` predicted for a split against the goodput
a `pdserve bench` sweep measured on `pdserve up` at that split.

    python -m benchmarks.plan_check OUT_DIR PROFILE

OUT_DIR holds plan-<N>gpus.json (`pdserve plan --num-gpus N --profile PROFILE ... --output`,
the plans made from PROFILE) and measured-<P>p<D>d/sweep.json (one `pdserve bench
--sweep-rates ... --save-detailed --result-filename sweep.json` per split, against `pdserve up`
at that split with `--controller recommend --controller-profile PROFILE`). Where a split has more
instances than the host has cores, plan-<N>gpus-shared.json may hold the plan for a profile
slowed by instances/cores (each instance's share of a core), and
measured-<P>p<D>d/plan-<N>gpus-served.json the plan made from what the router's controller
fitted while serving that split; both are shown beside. For each measured
split it prints the predicted and measured goodput and, per rate of the sweep, the measured
SLO attainment beside the simulated one (the plan's simulation on the sweep's own request
lengths), and writes plan-check.json.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from pdserve.planner.goodput_model import RequestShape, SimulationConfig
from pdserve.planner.latency_profile import LatencyProfile
from pdserve.planner.search import Placement, attainment_curve

SPLIT_DIR = re.compile(r"measured-(\d+)p(\d+)d$")


def predicted_goodput(
    out: Path, num_prefill: int, num_decode: int, suffix: str = ""
) -> float | None:
    """The plan's goodput for the TP-1 split, from plan-<P+D>gpus<suffix>.json."""
    path = out / f"plan-{num_prefill + num_decode}gpus{suffix}.json"
    if not path.is_file():
        return None
    for c in json.loads(path.read_text())["candidates"]:
        if (c["num_prefill"], c["num_decode"], c["prefill_tp"], c["decode_tp"]) == (
            num_prefill,
            num_decode,
            1,
            1,
        ):
            return c["goodput_rps"]
    return None


def check_split(out: Path, profile: LatencyProfile, split_dir: Path) -> dict[str, Any]:
    num_prefill, num_decode = map(int, SPLIT_DIR.search(split_dir.name).groups())
    sweep = json.loads((split_dir / "sweep.json").read_text())
    server = sweep["servers"][0]
    runs = sorted(server["runs"], key=lambda r: r["request_rate"])
    slo = sweep["goodput_slo_ms"]
    config = SimulationConfig(
        ttft_slo_s=slo["ttft"] / 1000,
        tpot_slo_s=slo["tpot"] / 1000,
        attainment=sweep["target_attainment"],
        num_requests=1000,
    )
    workload = [
        RequestShape(i, 0, o)
        for run in runs
        for i, o in zip(run["input_lens"], run["output_lens"], strict=True)
        if o > 0
    ]
    simulated = attainment_curve(
        profile,
        Placement(num_prefill, num_decode, 1, 1),
        workload,
        config,
        [r["request_rate"] for r in runs],
    )
    predicted = predicted_goodput(out, num_prefill, num_decode)
    calibrated = predicted_goodput(out, num_prefill, num_decode, "-calibrated")
    measured = server["goodput_rate"]
    return {
        "split": f"{num_prefill}P{num_decode}D",
        "num_prefill": num_prefill,
        "num_decode": num_decode,
        "slo_ms": slo,
        "predicted_goodput_rps": predicted,
        "measured_goodput_rps": measured,
        "predicted_calibrated_rps": calibrated,
        "calibrated_error": (calibrated - measured) / measured
        if calibrated and measured else None,
        "predicted_time_shared_rps": predicted_goodput(out, num_prefill, num_decode, "-shared"),
        "predicted_from_served_fit_rps": predicted_goodput(
            split_dir, num_prefill, num_decode, "-served"
        ),
        "measured_is_lower_bound": server.get("goodput_rate_is_lower_bound", False),
        "error": (predicted - measured) / measured if predicted and measured else None,
        "rows": [
            {
                "request_rate": r["request_rate"],
                "measured_attainment": r["slo_attainment"],
                "simulated_attainment": a,
                "mean_ttft_ms": r.get("mean_ttft_ms"),
                "mean_tpot_ms": r.get("mean_tpot_ms"),
            }
            for r, (_, a) in zip(runs, simulated, strict=True)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    plan = json.loads(next(iter(sorted(out.glob("plan-*gpus.json")))).read_text())
    profile = LatencyProfile.load(argv[1])
    results = [
        check_split(out, profile, d)
        for d in sorted(out.iterdir())
        if d.is_dir() and SPLIT_DIR.search(d.name) and (d / "sweep.json").is_file()
    ]
    print(f"plan for {plan['best']['num_gpus']} GPUs: best {plan['best']}")
    print(
        f"{'split':>6} {'predicted req/s':>16} {'measured req/s':>15} {'error':>7} "
        f"{'predicted, time-shared':>23} {'predicted, served fit':>22} "
        f"{'calibrated (--served)':>22} {'error':>7}"
    )
    for r in results:
        bound = ">=" if r["measured_is_lower_bound"] else ""
        error = "-" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        shared, served = r["predicted_time_shared_rps"], r["predicted_from_served_fit_rps"]
        calibrated = r["predicted_calibrated_rps"]
        calibrated_error = ("-" if r["calibrated_error"] is None
                            else f"{100 * r['calibrated_error']:+.0f}%")
        print(
            f"{r['split']:>6} {r['predicted_goodput_rps'] or float('nan'):>16.2f} "
            f"{bound + format(r['measured_goodput_rps'] or float('nan'), '.2f'):>15} "
            f"{error:>7} {'-' if shared is None else format(shared, '.2f'):>23} "
            f"{'-' if served is None else format(served, '.2f'):>22} "
            f"{'-' if calibrated is None else format(calibrated, '.2f'):>22} "
            f"{calibrated_error:>7}"
        )
    for r in results:
        print(
            f"{r['split']}: rate -> measured / simulated attainment: "
            + ", ".join(
                f"{row['request_rate']:g}: {100 * row['measured_attainment']:.0f}% / "
                f"{100 * row['simulated_attainment']:.0f}%"
                for row in r["rows"]
            )
        )
    (out / "plan-check.json").write_text(json.dumps(results, indent=2) + "\n")
    print(
        json.dumps(
            {
                "splits": [
                    {
                        k: r[k]
                        for k in (
                            "split",
                            "predicted_goodput_rps",
                            "measured_goodput_rps",
                            "error",
                            "predicted_time_shared_rps",
                            "predicted_from_served_fit_rps",
                            "predicted_calibrated_rps",
                            "calibrated_error",
                        )
                    }
                    for r in results
                ]
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
