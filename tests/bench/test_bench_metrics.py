"""Metric math of the goodput harness on hand-made outcomes: exact values, no network."""

from __future__ import annotations

import math

import pytest

from pdserve.benchmarks.client import RequestOutcome
from pdserve.benchmarks.metrics import (
    SLOConfig,
    goodput_rate,
    meets_slo,
    next_sweep_rate,
    output_token_counts,
    parse_goodput,
    request_tpot_s,
    summarize,
)


def make_outcome(ttft_s: float, itl_s: list[float], prompt_len: int = 10,
                 success: bool = True, output_tokens: int | None = None) -> RequestOutcome:
    """An outcome whose latency is ttft + sum(itl), as the client records it."""
    return RequestOutcome(
        prompt_len=prompt_len, success=success, ttft_s=ttft_s, itl_s=list(itl_s),
        latency_s=ttft_s + sum(itl_s), output_tokens=output_tokens,
        num_token_chunks=len(itl_s) + 1 if success else 0,
        error="" if success else "HTTP 500: boom")


def test_tpot_excludes_first_token_and_needs_two_tokens() -> None:
    outcome = make_outcome(0.5, [0.1, 0.2, 0.3])
    assert request_tpot_s(outcome, 4) == pytest.approx(0.2, abs=1e-12)
    # Usage may report more tokens than chunks (several tokens in one chunk): TPOT uses tokens.
    assert request_tpot_s(outcome, 7) == pytest.approx(0.1, abs=1e-12)
    assert request_tpot_s(make_outcome(0.5, []), 1) is None
    assert request_tpot_s(make_outcome(0.5, [0.1], success=False), 2) is None


def test_summary_fields_are_exact() -> None:
    outcomes = [
        make_outcome(0.100, [0.010, 0.010, 0.010], prompt_len=10),   # tpot 10 ms
        make_outcome(0.300, [0.020, 0.040], prompt_len=20),          # tpot 30 ms
        make_outcome(0.0, [], success=False, prompt_len=30),
    ]
    tokens = output_token_counts(outcomes, lambda text: None)
    assert tokens == [4, 3, 0]  # no usage, no tokenizer: token chunks
    slo = SLOConfig(ttft_ms=200, tpot_ms=50)
    s = summarize(outcomes, tokens, duration_s=2.0, slo=slo, percentiles=(50.0, 99.0))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(18.5)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["std_ttft_ms"] == pytest.approx(100.0)
    assert s["mean_tpot_ms"] == pytest.approx(20.0)
    assert s["p50_tpot_ms"] == pytest.approx(20.0)
    assert s["p99_tpot_ms"] == pytest.approx(10.0 + 0.99 * 20.0)
    # ITL pools every gap of every request: 10, 10, 10, 20, 40 ms.
    assert s["mean_itl_ms"] == pytest.approx(18.0)
    assert s["median_itl_ms"] == pytest.approx(10.0)
    assert s["mean_e2el_ms"] == pytest.approx((130.0 + 360.0) / 2)
    # Only the first meets TTFT <= 200 ms; the failure is a miss too.
    assert s["request_goodput"] == pytest.approx(0.5)
    assert s["slo_attainment"] == pytest.approx(1 / 3)


def test_usage_wins_over_tokenizer_and_chunks() -> None:
    with_usage = make_outcome(0.1, [0.1], output_tokens=5)
    without = make_outcome(0.1, [0.1])
    without.generated_text = "a b c"
    assert output_token_counts([with_usage, without], lambda t: len(t.split())) == [5, 3]


def test_slo_bounds_are_inclusive_and_each_one_can_fail() -> None:
    # Binary-exact times (ttft 250 ms, tpot 62.5 ms, e2el 375 ms) so "==" bounds are exact.
    outcome = make_outcome(0.25, [0.0625, 0.0625])
    assert meets_slo(outcome, 3, SLOConfig(ttft_ms=250, tpot_ms=62.5, e2el_ms=375))
    assert not meets_slo(outcome, 3, SLOConfig(ttft_ms=249))
    assert not meets_slo(outcome, 3, SLOConfig(tpot_ms=62))
    assert not meets_slo(outcome, 3, SLOConfig(e2el_ms=374))
    # One output token: no TPOT, so a TPOT bound cannot fail it (vLLM counts TPOT as 0).
    assert meets_slo(make_outcome(0.1, []), 1, SLOConfig(tpot_ms=1))
    assert not meets_slo(make_outcome(0.0, [], success=False), 0, SLOConfig())


def test_no_slo_means_no_goodput() -> None:
    s = summarize([make_outcome(0.1, [0.1])], [2], 1.0, SLOConfig())
    assert s["request_goodput"] is None


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "TPOT:50.5"]) == SLOConfig(ttft_ms=500, tpot_ms=50.5)
    assert parse_goodput(["e2el:1000"]).as_dict() == {"e2el": 1000.0}
    for bad in (["ttft"], ["foo:1"], ["ttft:abc"], ["ttft:-1"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_goodput_rate_is_highest_rate_before_first_miss() -> None:
    assert goodput_rate([(1, 1.0), (2, 0.95), (4, 0.9), (8, 0.5)]) == 4
    # A lucky pass above a miss does not count.
    assert goodput_rate([(8, 0.95), (1, 1.0), (2, 0.7)]) == 1
    assert goodput_rate([(1, 0.89)]) is None
    assert goodput_rate([(1, 1.0), (math.inf, 1.0)]) == math.inf
    assert goodput_rate([(1, 0.8), (2, 0.7)], target=0.75) == 1
    with pytest.raises(ValueError):
        goodput_rate([(1, 1.0)], target=0.0)


def test_next_sweep_rate_bisects_the_bracket() -> None:
    assert next_sweep_rate([(1, 1.0), (2, 0.95), (4, 0.5)]) == 3
    assert next_sweep_rate([(1, 1.0), (2, 0.95), (4, 0.5), (3, 0.92)]) == 3.5
    assert next_sweep_rate([(1, 1.0), (math.inf, 0.2)]) == 2
    assert next_sweep_rate([(1, 1.0), (2, 1.0)]) is None  # nothing above failed: no bracket
    assert next_sweep_rate([(1, 0.5), (2, 0.4)]) is None  # even the lowest rate misses
