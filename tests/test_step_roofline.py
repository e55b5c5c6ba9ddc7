"""The decode floor of benchmarks/step_roofline.py: bytes at the bandwidth measured for that
many bytes, or FLOPs at the matmul peak, whichever is slower."""

from __future__ import annotations

import pytest

from pdserve.benchmarks import step_roofline

FACTS = {"layers": 2, "heads": 4, "head_dim": 8, "matmul_params": 1000, "weight_bytes": 4000,
         "kv_bytes_per_token": 4 * 2 * 2 * 2 * 8}


def _run(batch: int, context: int, step_s: float) -> dict:
    return {"pdserve": {"decode": [{"batch": batch, "context": context, "step_s": step_s}],
                        "prefill": []}}


def test_memory_bound_row_is_held_to_the_bandwidth_of_its_own_size() -> None:
    nbytes = step_roofline.decode_bytes(FACTS, 2, 10)
    assert nbytes == 4000 + 2 * 10 * 256
    # 9120 bytes at 1e6 B/s: 9.12 ms; 2 rows x 2000 + attention 2*2*2*4*8*10*2 = 9120 FLOPs at
    # 1e9: 9.1 us
    row = step_roofline.analyse(FACTS, {nbytes: 1e6}, 1e9, _run(2, 10, 0.018))["decode"][0]
    assert step_roofline.decode_flops(FACTS, 2, 10) == 2 * 1000 * 2 + 2 * 2 * 2 * 4 * 8 * 10 * 2
    assert row["memory_floor_s"] == pytest.approx(9120 / 1e6)
    assert row["floor_s"] == row["memory_floor_s"]
    assert row["x_floor"] == pytest.approx(0.018 / (9120 / 1e6))
    assert row["read_gb_s"] == pytest.approx(1e-3)


def test_compute_bound_row_is_held_to_the_matmul_peak() -> None:
    nbytes = step_roofline.decode_bytes(FACTS, 2, 10)
    row = step_roofline.analyse(FACTS, {nbytes: 1e12}, 1e6, _run(2, 10, 0.05))["decode"][0]
    assert row["floor_s"] == row["compute_floor_s"] == pytest.approx(9120 / 1e6)
    assert row["compute_floor_s"] > row["memory_floor_s"]
