"""pdserve/benchmarks/served_table.py: vLLM's saved results -> rows with pdserve's ratios to
vLLM."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.benchmarks import served_table


def _result(path: Path, goodput: float, ttft: float, tpot: float) -> None:
    path.write_text(json.dumps({
        "request_throughput": 1.9, "request_goodput": goodput, "mean_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot,
        "date": "x", "num_prompts": 40}))


def test_rows_ratios_and_best_goodput(tmp_path: Path) -> None:
    _result(tmp_path / "vllm-rate1.json", 1.0, 200.0, 20.0)
    _result(tmp_path / "vllm-rate2.json", 1.5, 400.0, 30.0)
    _result(tmp_path / "disagg-rate2.json", 1.8, 100.0, 15.0)
    (tmp_path / "summary.json").write_text("{}")  # not a result: skipped
    runs = served_table.load_results(tmp_path)
    assert sorted(runs) == ["disagg", "vllm"] and sorted(runs["vllm"]) == [1.0, 2.0]
    summary = served_table.summarise(runs)
    [row] = [r for r in summary["rows"] if r["server"] == "disagg"]
    assert row["rate"] == 2.0
    assert row["mean_ttft_ms_x_vllm"] == 0.25 and row["mean_tpot_ms_x_vllm"] == 0.5
    assert abs(row["request_goodput_x_vllm"] - 1.2) < 1e-9
    assert summary["best_goodput"] == {"vllm": 1.5, "disagg": 1.8}
    assert abs(summary["best_goodput_x_vllm"]["disagg"] - 1.2) < 1e-9
    assert all("x_vllm" not in k for r in summary["rows"] if r["server"] == "vllm" for k in r)
