"""PNG plots of a benchmark: SLO attainment vs request rate, and TTFT / TPOT CDFs; the JSON
results file a plot goes beside.

matplotlib is imported inside each function with the Agg backend, so the harness runs headless
and `pdserve bench --help` does not pay for it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attainment(attainment_by_label: Mapping[str, Sequence[tuple[float, float]]],
                    path: str | Path, target: float = 0.9,
                    goodput_by_label: Mapping[str, float | None] | None = None,
                    spread_by_label: Mapping[str, tuple[float, float]] | None = None) -> Path:
    """One line per server: SLO attainment (%) against offered request rate (req/s).

    Several runs at one rate (a search's repeats) are drawn as points and joined by their
    mean; the goodput rate is a dotted line, its spread over repeats a shaded band.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, points in attainment_by_label.items():
        by_rate: dict[float, list[float]] = {}
        for rate, attainment in points:
            by_rate.setdefault(rate, []).append(100.0 * attainment)
        rates = sorted(by_rate)
        (line,) = ax.plot(rates, [float(np.mean(by_rate[r])) for r in rates], marker="o",
                          label=label)
        colour = line.get_color()
        if any(len(v) > 1 for v in by_rate.values()):
            ax.scatter([r for r in rates for _ in by_rate[r]],
                       [a for r in rates for a in by_rate[r]], s=12, color=colour, alpha=0.5)
        rate = (goodput_by_label or {}).get(label)
        if rate is not None and math.isfinite(rate):
            ax.axvline(rate, linestyle=":", color=colour, alpha=0.8)
        spread = (spread_by_label or {}).get(label)
        if spread is not None and spread[1] > spread[0]:
            ax.axvspan(spread[0], spread[1], color=colour, alpha=0.12)
    ax.axhline(100.0 * target, color="grey", linestyle="--", linewidth=1,
               label=f"{100 * target:.0f}% target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("SLO attainment vs request rate")
    return save_figure(fig, plt, path)


def plot_cdf(values_ms_by_label: Mapping[str, Sequence[float]], path: str | Path,
             metric_name: str, slo_ms: float | None = None) -> Path:
    """Empirical CDF of one latency metric (ms), one line per run, the SLO as a vertical line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    # Runs are "<server> @ <rate>": one line style per server, one colour per run within it
    # (matplotlib's 10-colour cycle would repeat colours across a two-server sweep).
    servers = list(dict.fromkeys(label.split(" @ ")[0] for label in values_ms_by_label))
    styles = ["-", "--", ":", "-."]
    colours = plt.get_cmap("tab10").colors
    seen: dict[str, int] = {}
    for label, values_ms in values_ms_by_label.items():
        if len(values_ms) == 0:
            continue
        server = label.split(" @ ")[0]
        index = seen[server] = seen.get(server, -1) + 1
        xs = np.sort(np.asarray(values_ms, dtype=np.float64))
        ys = np.arange(1, xs.size + 1) / xs.size
        ax.step(xs, 100.0 * ys, where="post", label=label,
                linestyle=styles[servers.index(server) % len(styles)],
                color=colours[index % len(colours)])
    if slo_ms is not None:
        ax.axvline(slo_ms, color="grey", linestyle="--", linewidth=1,
                   label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel(f"{metric_name} (ms)")
    ax.set_ylabel("requests (%)")
    ax.set_ylim(0, 101)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(f"{metric_name} CDF")
    return save_figure(fig, plt, path)


def save_figure(fig, plt, path: str | Path, dpi: int = 100) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def save_json(report: Mapping, path: str | Path) -> Path:
    """Write a benchmark's JSON results (its plot goes beside: path.with_suffix(".png"))."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
