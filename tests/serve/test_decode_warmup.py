"""benchmarks/decode_warmup.py's summary of the decode steps after a prefill."""

from __future__ import annotations

import pytest

from benchmarks import decode_warmup


def test_summary_takes_the_median_round_per_step_and_finds_where_it_settles() -> None:
    curves = [[9.0, 6.0, 5.4, 5.0, 5.0, 5.0], [7.0, 6.2, 5.6, 5.0, 5.2, 4.8],
              [8.0, 5.8, 5.5, 5.1, 4.9, 5.0]]
    summary = decode_warmup.summarise(curves)
    assert summary["step_s"] == [8.0, 6.0, 5.5, 5.0, 5.0, 5.0]
    assert summary["steady_step_s"] == 5.0  # the median of the last third
    assert summary["first_step_s"] == 8.0
    assert summary["settled_at_step"] == 2  # 5.5 <= 1.1 x 5.0; 6.0 is not
    assert summary["excess_s"] == pytest.approx(3.0 + 1.0 + 0.5)


def test_a_curve_still_falling_settles_only_at_its_end() -> None:
    summary = decode_warmup.summarise([[9.0, 8.0, 7.0, 6.0, 5.0, 4.0]])
    assert summary["steady_step_s"] == 4.5
    assert summary["settled_at_step"] == 5  # 5.0 > 1.1 x 4.5
    flat = decode_warmup.summarise([[3.0, 3.0, 3.0]])
    assert flat["settled_at_step"] == 0 and flat["excess_s"] == 0.0
