"""Table and plot of goodput_search_check.sh: --goodput-search beside a fine manual sweep.

python benchmarks/results/goodput_search_table.py benchmarks/results/goodput-search
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from pdserve.benchmarks import plots


def main(out_dir: Path) -> None:
    documents = [json.loads(p.read_text()) for p in sorted(out_dir.glob("search-rep*.json"))]
    target = documents[0]["target_attainment"]
    repeats = [d["servers"][0] for d in documents]
    search_runs = [run for r in repeats for run in r["runs"]]
    rates = sorted(r["goodput_search"]["repeat_rates"][0] or 0.0 for r in repeats)
    result = {
        "repeat_rates": [r["goodput_search"]["repeat_rates"][0] for r in repeats],
        "repeat_brackets": [r["goodput_search"]["repeat_brackets"][0] for r in repeats],
        "goodput_rate": statistics.median(rates),
        "goodput_rate_min": rates[0],
        "goodput_rate_max": rates[-1],
    }
    sweeps = [
        json.loads(p.read_text())["servers"][0] for p in sorted(out_dir.glob("sweep-seed*.json"))
    ]
    by_rate: dict[float, list[float]] = {}
    for sweep in sweeps:
        for run in sweep["runs"]:
            by_rate.setdefault(run["request_rate"], []).append(run["slo_attainment"])
    print("| rate (req/s) | attainment per sweep seed (%) | mean (%) |")
    print("|---|---|---|")
    for rate in sorted(by_rate):
        values = by_rate[rate]
        print(
            f"| {rate:g} | {' / '.join(f'{100 * v:.0f}' for v in values)} | "
            f"{100 * statistics.mean(values):.1f} |"
        )
    sweep_rates = [s["goodput_rate"] for s in sweeps]
    print(f"\nmanual sweep goodput rate per seed: {sweep_rates}")
    print(
        f"--goodput-search per repeat: {result['repeat_rates']} (brackets "
        f"{result['repeat_brackets']}); median {result['goodput_rate']:.3g}, spread "
        f"{result['goodput_rate_min']:.3g}-{result['goodput_rate_max']:.3g} req/s, "
        f"{len(search_runs)} runs"
    )
    # Mean-attainment goodput of the sweep: the last rate before the mean first misses.
    mean_rate = None
    for rate in sorted(by_rate):
        if statistics.mean(by_rate[rate]) < target:
            break
        mean_rate = rate
    print(f"manual sweep goodput rate on the seeds' mean attainment: {mean_rate}")
    points = {
        f"manual sweep ({len(sweeps)} seeds)": [(r, a) for r, v in by_rate.items() for a in v],
        f"--goodput-search ({len(repeats)} repeats)": [
            (r["request_rate"], r["slo_attainment"]) for r in search_runs
        ],
    }
    path = plots.plot_attainment(
        points,
        out_dir / "search-vs-sweep.png",
        target,
        {next(iter(points)): mean_rate, list(points)[1]: result["goodput_rate"]},
        {list(points)[1]: (result["goodput_rate_min"], result["goodput_rate_max"])},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/goodput-search"))
