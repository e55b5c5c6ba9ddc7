"""Table and plot of the follow A/B: ttft_breakdown runs with PDSERVE_HANDOFF_FOLLOW=1 (the
decode worker copies each layer as the prefill stages it, serve/follow.py) and =0 (the copy
waits for the hand-off), alternated on the same box.

    for f in 1 0 1 0; do PDSERVE_HANDOFF_FOLLOW=$f python -m pdserve.benchmarks.ttft_breakdown \
        --sequential 30 --num-requests 80 --rate 8 --max-tokens 16 \
        --setups disagg disagg-no-lending --skip-offline --out-dir OUT/ab-follow-$f-$RANDOM; done
    python benchmarks/results/follow_ab_table.py benchmarks/results/follow-ab-5dec
(each run's ttft_breakdown.json copied to OUT as ab-follow-<flag>-<n>.json)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from pdserve.benchmarks import plots

PHASES = (("handover_ms", "kv_load"), ("phases_ms", "prefill"), ("client_ttft_ms", "p50"))


def main(out_dir: Path) -> None:
    runs: dict[tuple[str, str], dict[str, list[float]]] = {}
    for path in sorted(out_dir.glob("ab-follow-*.json")):
        follow = "on" if path.name.startswith("ab-follow-1") else "off"
        for name, run in json.loads(path.read_text())["runs"].items():
            values = runs.setdefault((name, follow), {})
            for group, key in PHASES:
                values.setdefault(key, []).append(run[group][key])
    names = sorted({name for name, _ in runs})
    table = {f"{name} / follow {follow}": {k: statistics.mean(v) for k, v in values.items()}
             for (name, follow), values in sorted(runs.items())}
    print("| run | follow | kv_load (ms, mean per run) | prefill (ms) | client TTFT p50 (ms) |")
    print("|---|---|---|---|---|")
    for (name, follow), values in sorted(runs.items()):
        print(f"| {name} | {follow} | " + " | ".join(
            ", ".join(f"{x:.2f}" for x in values[key]) for _, key in PHASES) + " |")
    (out_dir / "follow_ab.json").write_text(json.dumps(table, indent=2) + "\n")
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for i, follow in enumerate(("off", "on")):
        means = [statistics.mean(runs[name, follow]["kv_load"]) for name in names]
        ax.bar([x + (i - 0.5) * width for x in range(len(names))], means, width,
               label=f"follow {follow}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("kv_load, mean ms")
    ax.set_title("kv_load (decode: hand-off in -> in the batch), follow off vs on\n"
                 "llama-mid fp32, 256-token prompts, 2 cores")
    ax.legend()
    plots.save_figure(fig, plt, out_dir / "follow_ab.png")
    print(f"wrote {out_dir / 'follow_ab.json'} and follow_ab.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
