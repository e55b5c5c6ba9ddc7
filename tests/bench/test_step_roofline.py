"""The decode floor of benchmarks/step_roofline.py: bytes at the bandwidth measured
for that many bytes in the same round, or FLOPs at the matmul peak, whichever is slower."""

from __future__ import annotations

import pytest

from benchmarks import step_roofline

FACTS = {"layers": 2, "heads": 4, "head_dim": 8, "matmul_params": 1000, "weight_bytes": 4000,
         "kv_bytes_per_token": 4 * 2 * 2 * 2 * 8}


def _run(batch: int, context: int, rounds_s: list[float], reads_gb_s: list[float]) -> dict:
    row = {"batch": batch, "context": context, "step_s": sorted(rounds_s)[len(rounds_s) // 2],
           "rounds_s": rounds_s, "rounds_read_gb_s": reads_gb_s}
    return {"pdserve": {"decode": [row], "prefill": []}}


def test_memory_bound_row_is_held_to_the_bandwidth_of_its_own_size() -> None:
    nbytes = step_roofline.decode_bytes(FACTS, 2, 10)
    assert nbytes == 4000 + 2 * 10 * 256
    # 9120 bytes at 1e6 B/s: 9.12 ms; 2 rows x 2000 + attention 2*2*2*4*8*10*2 = 9120 FLOPs at
    # 1e9: 9.1 us
    row = step_roofline.analyse(FACTS, 1e9, _run(2, 10, [0.018], [1e-3]))["decode"][0]
    assert step_roofline.decode_flops(FACTS, 2, 10) == 2 * 1000 * 2 + 2 * 2 * 2 * 4 * 8 * 10 * 2
    assert row["memory_floor_s"] == pytest.approx(9120 / 1e6)
    assert row["floor_s"] == row["memory_floor_s"]
    assert row["x_floor"] == pytest.approx(0.018 / (9120 / 1e6))
    assert row["read_gb_s"] == pytest.approx(1e-3)


def test_compute_bound_row_is_held_to_the_matmul_peak() -> None:
    row = step_roofline.analyse(FACTS, 1e6, _run(2, 10, [0.05], [1e3]))["decode"][0]
    assert row["floor_s"] == row["compute_floor_s"] == pytest.approx(9120 / 1e6)
    assert row["compute_floor_s"] > row["memory_floor_s"]


def test_each_round_is_held_to_the_floor_read_in_that_round() -> None:
    # 9120 bytes: a round read at 1 MB/s has a 9.12 ms floor, one at 2 MB/s 4.56 ms
    rounds_s, reads = [0.0184, 0.0092, 0.010], [1e-3, 2e-3, 1e-3]
    row = step_roofline.analyse(FACTS, 1e9, _run(2, 10, rounds_s, reads))["decode"][0]
    ratios = sorted([0.0184 / 9.12e-3, 0.0092 / 4.56e-3, 0.010 / 9.12e-3])
    assert row["x_floor"] == pytest.approx(ratios[1])  # the median of the rounds' ratios
    assert row["floor_s"] == pytest.approx(9.12e-3)  # the median of the rounds' floors
    assert row["read_gb_s"] == pytest.approx(1e-3)
    assert row["step_s"] == 0.010


def test_step_parts_split_the_step_and_hold_products_to_their_own_floor() -> None:
    facts = {**FACTS, "matmul_params": 800, "weight_bytes": 3200}
    run = _run(2, 10, [0.018, 0.020, 0.019], [1e-3, 1e-3, 1e-3])
    run["pdserve"]["decode"][0]["rounds_parts_s"] = [
        [0.004, 0.002, 0.001], [0.005, 0.003, 0.001], [0.006, 0.002, 0.002]]
    row = step_roofline.analyse(facts, 1e9, run)["decode"][0]
    parts = row["parts"]
    assert (parts["products_s"], parts["attention_s"], parts["other_s"]) == (0.005, 0.002, 0.001)
    assert parts["host_s"] == pytest.approx(0.019 - 0.008)  # the step's median minus the loop
    # 3200 bytes of weights at 1 MB/s (3.2 ms) > 2 x 800 x 2 FLOPs at 1 GFLOP/s
    assert parts["products_floor_s"] == pytest.approx(3.2e-3)
    assert parts["attention_gb_s"] == pytest.approx(2 * 10 * 256 / 0.002 / 1e9)


def test_rows_without_clocks_have_no_parts() -> None:
    row = step_roofline.analyse(FACTS, 1e9, _run(2, 10, [0.018], [1e-3]))["decode"][0]
    assert "parts" not in row
