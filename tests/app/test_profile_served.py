"""`pdserve profile --served`: the calibration's arithmetic by hand, its CLI errors, and one
real calibration of the embedded model through `pdserve up` and `pdserve bench`."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pdserve.app import profile as profiler
from pdserve.app import profile_served
from pdserve.planner.goodput_model import LinearLatency
from pdserve.planner.latency_profile import LatencyProfile, ProfileError


def _profile(prefill: tuple[float, float, float], decode: tuple[float, float, float],
             **fields) -> LatencyProfile:
    a, b, c = prefill
    d, e, f = decode
    return LatencyProfile(model="tiny", hardware="test", kv_bytes_per_token=1024,
                          prefill={1: LinearLatency(a, (b, c), 5, 0.01)},
                          decode={1: LinearLatency(d, (e, f), 5, 0.02)}, **fields)


def test_calibration_scales_each_phase_by_served_over_engine_time():
    engine = _profile((0.0, 1e-3, 0.0), (5e-3, 0.0, 1e-3), source="pdserve profile")
    # served: prefill 1.5 ms/token; decode 8 ms + 2 ms/sequence
    served = _profile((0.0, 1.5e-3, 0.0), (8e-3, 0.0, 2e-3), handoff_s=0.1,
                      ttft_overhead_s=0.02)
    workload = profile_served.ServedWorkload(input_len=200, output_len=20)
    c = profile_served.calibrate(engine, served, 1, workload)
    assert c.prefill_factor == pytest.approx(1.5)
    # decode at B = 1, 2, 4, 8, 16: (8 + 2B) / (5 + B), averaged
    expected = sum((8 + 2 * b) / (5 + b) for b in (1, 2, 4, 8, 16)) / 5
    assert c.decode_factor == pytest.approx(expected)
    assert (c.handoff_s, c.ttft_overhead_s) == (0.1, 0.02)

    calibrated = profile_served.apply(engine, [c])
    # the engine's shape, scaled: a 200-token prefill takes 0.3 s, a decode step of 4 x
    # factor x (5 + 4) ms
    assert calibrated.prefill[1](200, 200 * 200) == pytest.approx(0.3)
    assert calibrated.decode[1](0, 4) == pytest.approx(expected * 9e-3)
    assert (calibrated.handoff_s, calibrated.ttft_overhead_s) == (0.1, 0.02)
    assert calibrated.extra["served_calibration"][0]["prefill_factor"] == pytest.approx(1.5)
    # and it round-trips as a profile the planner reads
    again = LatencyProfile.from_dict(json.loads(json.dumps(calibrated.to_dict())))
    assert again.decode[1](0, 4) == pytest.approx(expected * 9e-3)
    assert "served calibration" in again.source


def test_calibration_needs_the_tp_degree_in_both_profiles():
    engine = _profile((0.0, 1e-3, 0.0), (5e-3, 0.0, 1e-3))
    served = LatencyProfile(model="tiny", hardware="test", kv_bytes_per_token=1024,
                            prefill={2: LinearLatency(0.0, (1e-3, 0.0), 5, 0.0)},
                            decode={2: LinearLatency(5e-3, (0.0, 1e-3), 5, 0.0)})
    with pytest.raises(ProfileError, match="TP 1"):
        profile_served.calibrate(engine, served, 1, profile_served.ServedWorkload())


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    profiler.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_refuses_bad_calibration_settings(tmp_path, capsys, llama_dir):
    assert profiler.run(_parse(["--model", str(llama_dir), "--engine-profile", "x.json"])) == 2
    assert "--engine-profile needs --served" in capsys.readouterr().err
    assert profiler.run(_parse(["--model", str(llama_dir), "--served", "--served-rates",
                                "0"])) == 2
    assert "--served-rates must be positive" in capsys.readouterr().err
    missing = tmp_path / "missing.json"
    assert profiler.run(_parse(["--model", str(llama_dir), "--served", "--engine-profile",
                                str(missing)])) == 2
    assert "missing.json" in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="1P1D needs two cores")
def test_served_calibration_of_the_embedded_model(tmp_path, capsys):
    """A real calibration: `pdserve up` 1P1D on the embedded model, a short `pdserve bench`
    load, the controller's fit read back; the calibrated profile keeps the engine models'
    shape, scaled by positive factors, and carries the measured hand-off."""
    from pdserve.serve.default_model import default_model_dir

    engine = _profile((0.0, 2e-5, 0.0), (2e-3, 0.0, 2e-4), max_num_seqs=64,
                      max_num_batched_tokens=2048)
    engine_path = engine.save(tmp_path / "engine.json")
    output = tmp_path / "served.json"
    args = _parse(["--model", str(default_model_dir()), "--served", "--engine-profile",
                   str(engine_path), "--output", str(output), "--served-input-len", "64",
                   "--served-output-len", "8", "--served-rates", "8",
                   "--served-num-prompts", "16", "--served-port", "18980"])
    assert profiler.run(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["profile"] == str(output)
    calibrated = LatencyProfile.load(output)
    (calibration,) = calibrated.extra["served_calibration"]
    assert calibration["prefill_factor"] > 0 and calibration["decode_factor"] > 0
    assert calibrated.handoff_s is not None and calibrated.handoff_s > 0
    # the engine model's shape, times the factor
    assert calibrated.prefill[1](64, 64 * 64) == pytest.approx(
        calibration["prefill_factor"] * engine.prefill[1](64, 64 * 64), rel=1e-3)
    assert (tmp_path / "served-logs" / "up-tp1.log").is_file()
