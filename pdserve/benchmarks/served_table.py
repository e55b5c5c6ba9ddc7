"""The table, plot and summary of `vllm bench serve` results for vLLM and pdserve (colocated,
disaggregated) side by side, with pdserve's ratios to vLLM at each request rate (the runs that
benchmarks/served_vs_vllm.py makes, which calls this at its end).

    python -m pdserve.benchmarks.served_table FOLDER

Reads SERVER-rateR.json (vLLM's saved results), prints the table, writes summary.json and
served.png (goodput, TTFT and TPOT against the offered rate) into the same folder.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

FIELDS = ("request_throughput", "request_goodput", "mean_ttft_ms", "p99_ttft_ms",
          "mean_tpot_ms", "p99_tpot_ms")
PEER = "vllm"
_NAME = re.compile(r"(?P<server>[a-z0-9_-]+?)-rate(?P<rate>[0-9.]+)\.json")


def load_results(folder: Path) -> dict[str, dict[float, dict[str, Any]]]:
    """server -> rate -> the FIELDS of its run."""
    runs: dict[str, dict[float, dict[str, Any]]] = {}
    for path in sorted(folder.glob("*-rate*.json")):
        match = _NAME.fullmatch(path.name)
        if match is None:
            continue
        data = json.loads(path.read_text())
        runs.setdefault(match["server"], {})[float(match["rate"])] = {
            f: data.get(f) for f in FIELDS}
    return runs


def summarise(runs: dict[str, dict[float, dict[str, Any]]]) -> dict[str, Any]:
    """Rows per (server, rate) with pdserve's ratios to vLLM at the same rate, and each
    server's best goodput over the sweep (with its ratio to vLLM's best)."""
    rows = []
    peer = runs.get(PEER, {})
    for server, by_rate in runs.items():
        for rate, fields in sorted(by_rate.items()):
            row: dict[str, Any] = {"server": server, "rate": rate, **fields}
            if server != PEER and rate in peer:
                for f in ("mean_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "request_goodput"):
                    theirs = peer[rate].get(f)
                    if fields.get(f) is not None and theirs:
                        row[f"{f}_x_vllm"] = fields[f] / theirs
            rows.append(row)
    best = {server: max((f.get("request_goodput") or 0.0) for f in by_rate.values())
            for server, by_rate in runs.items()}
    best_ratio = {server: value / best[PEER] for server, value in best.items()
                  if server != PEER and best.get(PEER)}
    return {"rows": rows, "best_goodput": best, "best_goodput_x_vllm": best_ratio}


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'server':>10} {'rate':>5} | {'goodput':>8} {'thru':>6} | {'TTFT ms':>8} "
          f"{'p99':>7} | {'TPOT ms':>8} {'p99':>7} | {'TTFT/v':>6} {'TPOT/v':>6} {'good/v':>6}")
    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:6.2f}" if key in r else f"{'':>6}"

    for r in summary["rows"]:
        print(f"{r['server']:>10} {r['rate']:5.1f} | {r['request_goodput'] or 0:8.2f} "
              f"{r['request_throughput'] or 0:6.2f} | {r['mean_ttft_ms'] or 0:8.1f} "
              f"{r['p99_ttft_ms'] or 0:7.1f} | {r['mean_tpot_ms'] or 0:8.1f} "
              f"{r['p99_tpot_ms'] or 0:7.1f} | {ratio(r, 'mean_ttft_ms_x_vllm')} "
              f"{ratio(r, 'mean_tpot_ms_x_vllm')} {ratio(r, 'request_goodput_x_vllm')}")
    print("best goodput (req/s):", {k: round(v, 2) for k, v in summary["best_goodput"].items()},
          " x vLLM:", {k: round(v, 2) for k, v in summary["best_goodput_x_vllm"].items()})


def plot(summary: dict[str, Any], path: Path) -> Path:
    from pdserve.benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("request_goodput", "goodput (req/s)"), ("mean_ttft_ms", "mean TTFT (ms)"),
              ("mean_tpot_ms", "mean TPOT (ms)"))
    servers = sorted({r["server"] for r in summary["rows"]})
    for ax, (key, label) in zip(axes, panels, strict=True):
        for server in servers:
            points = [(r["rate"], r[key]) for r in summary["rows"]
                      if r["server"] == server and r[key] is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=server)
        ax.set_xlabel("offered rate (req/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("vllm bench serve against vLLM CPU and pdserve, same model and box")
    return save_figure(fig, plt, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    runs = load_results(args.folder)
    if not runs:
        print(f"no SERVER-rateR.json results in {args.folder}", file=sys.stderr)
        return 2
    summary = summarise(runs)
    print_table(summary)
    summary["plot"] = str(plot(summary, args.folder / "served.png"))
    (args.folder / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
