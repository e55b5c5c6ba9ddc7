"""controller_check: the controller's /status snapshot and a bench sweep in, predicted vs
measured attainment out."""

from __future__ import annotations

import pytest

from benchmarks.controller_check import compare, main


def _snapshot() -> dict:
    return {
        "current": {"prefill": 1, "decode": 1}, "recommended": {"prefill": 1, "decode": 1},
        "goodput_by_num_prefill": {"1": 10.0},
        "models": {
            "prefill": {"intercept_s": 0.005, "per_tokens_s": 1e-4, "per_attention_s": 0.0,
                        "num_samples": 100, "rel_error": 0.1},
            "decode": {"intercept_s": 0.002, "per_context_s": 0.0, "per_batch_s": 5e-4,
                       "num_samples": 100, "rel_error": 0.1}},
        "simulation": {"ttft_slo_s": 1.0, "tpot_slo_s": 1.0, "attainment": 0.9,
                       "max_batched_tokens": 2048, "max_num_seqs": 64, "handoff_s": 0.005,
                       "num_requests": 128, "seed": 0},
    }


def _sweep(rates) -> dict:
    run = {"input_lens": [256] * 8, "output_lens": [64] * 8}
    return {"goodput_slo_ms": {"ttft": 200.0, "tpot": 20.0}, "target_attainment": 0.9,
            "servers": [{"goodput_rate": 8.0, "runs": [
                {**run, "request_rate": r, "slo_attainment": 1.0} for r in rates]}]}


def test_prediction_follows_the_sweeps_slos_and_rates():
    result = compare(_snapshot(), _sweep([1000.0, 1.0]))
    rows = result["rows"]
    assert [r["request_rate"] for r in rows] == [1.0, 1000.0]
    # One request alone: prefill 5 + 25.6 ms, decode steps 2.5 ms + 5 ms hand-off: meets the
    # sweep's SLOs (200 / 20 ms), which replace the controller's own (1 s / 1 s).
    assert rows[0]["predicted_attainment"] == 1.0
    assert rows[1]["predicted_attainment"] < 0.5  # 1000 req/s swamps one prefill worker
    assert 1.0 < result["predicted_goodput"] < 1000.0
    assert result["measured_goodput"] == 8.0


def test_clear_errors_without_an_estimate_or_lengths(tmp_path, capsys):
    with pytest.raises(ValueError, match="no estimate"):
        compare({"state": "warming up"}, _sweep([1.0]))
    sweep = _sweep([1.0])
    for run in sweep["servers"][0]["runs"]:
        del run["input_lens"]
    with pytest.raises(ValueError, match="--save-detailed"):
        compare(_snapshot(), sweep)
    assert main(["--base-url", "http://127.0.0.1:9", "--bench-result",
                 str(tmp_path / "missing.json")]) == 2
    assert "controller_check" in capsys.readouterr().err


def test_cached_prompt_tokens_are_not_prefilled():
    """A sweep that repeats its prompts is served from the prefix cache: the prediction must
    count only the uncached tokens, as the server did."""
    snapshot = _snapshot()
    snapshot["models"]["prefill"]["per_tokens_s"] = 1e-3  # 256 tokens: 261 ms > TTFT 200 ms
    cold = _sweep([1.0])
    warm = _sweep([1.0])
    warm["servers"][0]["runs"][0]["cached_lens"] = [240] * 8  # 16 new tokens: 21 ms
    assert compare(snapshot, cold)["predicted_goodput"] == 0.0
    assert compare(snapshot, warm)["predicted_goodput"] > 1.0
