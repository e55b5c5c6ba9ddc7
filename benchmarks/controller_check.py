"""How well the goodput controller predicts: its fitted step models and simulation against a
measured `pdserve bench` sweep of the same server and workload.

    pdserve bench --base-url URL ... --sweep-rates 2 4 8 16 --goodput ttft:MS tpot:MS \\
        --save-result --save-detailed --result-filename sweep.json
    python -m benchmarks.controller_check --base-url URL \\
        --bench-result sweep.json

It reads the controller's models, split and simulation settings from the router's /status,
simulates the sweep's own requests (their input and output lengths) at every rate of the
sweep, and prints predicted against measured SLO attainment and goodput; the JSON goes to
--output-dir, with a plot of both attainment curves. The server is `pdserve up --controller
recommend`, given some load first (64 requests at 8 req/s) so the controller has step samples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.planner.goodput_model import (
    LinearLatency,
    PhaseModels,
    RequestShape,
    SimulationConfig,
    attainment,
    estimate_goodput,
    simulate,
)


def models_from_status(controller: dict[str, Any]) -> PhaseModels:
    def model(entry: dict[str, Any], names: tuple[str, str]) -> LinearLatency:
        return LinearLatency(entry["intercept_s"], tuple(entry[f"per_{n}_s"] for n in names),
                             entry["num_samples"], entry["rel_error"])

    models = controller["models"]
    return PhaseModels(model(models["prefill"], ("tokens", "attention")),
                       model(models["decode"], ("context", "batch")))


def compare(controller: dict[str, Any], sweep: dict[str, Any]) -> dict[str, Any]:
    """Predicted vs measured attainment per rate, and goodput, for the current split."""
    if "models" not in controller:
        raise ValueError(f"the controller has no estimate yet ({controller.get('state')}): "
                         "run load through the server first")
    server = sweep["servers"][0]
    runs = sorted(server["runs"], key=lambda r: r["request_rate"])
    if not runs or "input_lens" not in runs[0]:
        raise ValueError("the sweep needs per-request lengths: run pdserve bench with "
                         "--sweep-rates and --save-detailed")
    slo = sweep["goodput_slo_ms"] or {}
    sim = SimulationConfig(**{**controller["simulation"],
                              "ttft_slo_s": slo.get("ttft", float("inf")) / 1000,
                              "tpot_slo_s": slo.get("tpot", float("inf")) / 1000,
                              "attainment": sweep["target_attainment"]})
    workload = []
    for run in runs:  # the server's reported cached tokens count (a rate may repeat prompts)
        cached = run.get("cached_lens") or [None] * len(run["input_lens"])
        workload += [RequestShape(i, c or 0, o) for i, c, o in
                     zip(run["input_lens"], cached, run["output_lens"], strict=True) if o > 0]
    models = models_from_status(controller)
    split = controller["current"]
    rows = []
    for run in runs:
        rate = float(run["request_rate"])
        predicted = attainment(simulate(workload, rate, split["prefill"], split["decode"],
                                        models, sim), sim)
        rows.append({"request_rate": rate, "measured_attainment": run["slo_attainment"],
                     "predicted_attainment": predicted})
    return {
        "split": split, "slo_ms": slo, "models": controller["models"],
        "simulation": controller["simulation"], "rows": rows,
        "measured_goodput": server["goodput_rate"],
        "measured_goodput_is_lower_bound": server.get("goodput_rate_is_lower_bound", False),
        "predicted_goodput": estimate_goodput(workload, split["prefill"], split["decode"],
                                              models, sim),
        "controller_goodput_by_num_prefill": controller["goodput_by_num_prefill"],
        "recommended": controller["recommended"],
    }


def print_table(result: dict[str, Any]) -> None:
    split = result["split"]
    print(f"controller check: {split['prefill']} prefill + {split['decode']} decode, "
          f"SLO {result['slo_ms']}")
    print(f"{'rate':>8} {'measured':>10} {'predicted':>10}")
    for row in result["rows"]:
        print(f"{row['request_rate']:>8g} {100 * row['measured_attainment']:>9.1f}% "
              f"{100 * row['predicted_attainment']:>9.1f}%")
    measured = result["measured_goodput"]
    bound = " (lower bound)" if result["measured_goodput_is_lower_bound"] else ""
    print(f"goodput: measured {measured if measured is None else f'{measured:.2f}'}{bound}, "
          f"predicted {result['predicted_goodput']:.2f} req/s")
    print(f"controller: goodput by number of prefill workers "
          f"{result['controller_goodput_by_num_prefill']}, recommends {result['recommended']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.controller_check",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the pdserve router")
    parser.add_argument("--bench-result", required=True, type=Path,
                        help="JSON of a `pdserve bench --sweep-rates ... --save-detailed` run")
    parser.add_argument("--output", type=Path, default=None,
                        help="result JSON (default: <bench-result stem>-controller.json in "
                             "--output-dir)")
    add_output_dir(parser, "controller_check")
    args = parser.parse_args(argv)
    try:
        sweep = json.loads(args.bench_result.read_text())
        status = httpx.get(f"{args.base_url.rstrip('/')}/status", timeout=10).json()
        result = compare(status["controller"], sweep)
    except (OSError, ValueError, KeyError, httpx.HTTPError) as exc:
        print(f"controller_check: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print_table(result)
    output = output_path(args, "controller_check",
                         f"{args.bench_result.stem}-controller.json", args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    from pdserve.benchmarks import plots

    points = {name: [(r["request_rate"], r[f"{name}_attainment"]) for r in result["rows"]]
              for name in ("measured", "predicted")}
    plot = plots.plot_attainment(points, output.with_suffix(".png"),
                                 sweep["target_attainment"],
                                 {"measured": result["measured_goodput"],
                                  "predicted": result["predicted_goodput"]})
    print(json.dumps({"output": str(output), "plot": str(plot)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
