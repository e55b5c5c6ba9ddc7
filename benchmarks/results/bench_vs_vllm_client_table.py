"""Table of bench_vs_vllm_client.sh: mean TTFT / TPOT / E2EL per client, per server.

python benchmarks/results/bench_vs_vllm_client_table.py DIR [DIR...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

METRICS = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")


def main(dirs: list[Path]) -> None:
    print("| server | seed | client | completed | " + " | ".join(METRICS) + " |")
    print("|---|---|---|---|---|---|---|")
    for out in dirs:
        totals: dict[str, dict[str, list[float]]] = {"pdserve": {}, "vllm": {}}
        for path in sorted(out.glob("*-seed*.json")):
            tool, seed = path.stem.split("-seed")
            result = json.loads(path.read_text())
            print(
                f"| {out.name} | {seed} | {tool} | {result['completed']} | "
                + " | ".join(f"{result[m]:.2f}" for m in METRICS)
                + " |"
            )
            for m in METRICS:
                totals[tool].setdefault(m, []).append(result[m])
        means = {
            tool: {m: statistics.mean(v) for m, v in by.items()} for tool, by in totals.items()
        }
        for tool in ("pdserve", "vllm"):
            print(
                f"| {out.name} | mean | {tool} | | "
                + " | ".join(f"{means[tool][m]:.2f}" for m in METRICS)
                + " |"
            )
        print(
            f"| {out.name} | | pdserve / vllm | | "
            + " | ".join(f"{means['pdserve'][m] / means['vllm'][m]:.3f}" for m in METRICS)
            + " |"
        )


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
