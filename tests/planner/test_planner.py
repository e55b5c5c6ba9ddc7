"""The offline planner (`pdserve profile`, `pdserve plan`): the shared simulation against
hand-computed times, the placement search against a planted optimum, the latency profile's
round trip (file, controller export, controller start), the CLI on a tiny profile, and the
profiler's sweep on a tiny model."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest

from pdserve.app import cli
from pdserve.app import profile as profiler
from pdserve.planner.goodput_model import (
    LinearLatency,
    RequestShape,
    SimulationConfig,
    attainment,
    estimate_goodput,
    simulate,
)
from pdserve.planner.latency_profile import LatencyProfile, ProfileError
from pdserve.planner.search import Placement, kv_bandwidth_bytes_per_s, placements, search
from pdserve.protocol.worker import StepSample
from pdserve.router.config import ControllerConfig
from pdserve.router.controller import GoodputController, export_profile


def make_profile(
    prefill: dict[int, tuple[float, float, float]] | None = None,
    decode: dict[int, tuple[float, float, float]] | None = None,
    **fields,
) -> LatencyProfile:
    """A profile from (a, b, c) per TP degree; defaults: one TP-1 entry of each phase."""
    prefill = prefill or {1: (0.01, 1e-4, 1e-8)}
    decode = decode or {1: (0.003, 1e-6, 1e-4)}
    return LatencyProfile(
        model="tiny",
        hardware="test",
        kv_bytes_per_token=fields.pop("kv_bytes_per_token", 1024),
        prefill={tp: LinearLatency(a, (b, c), 0, 0.0) for tp, (a, b, c) in prefill.items()},
        decode={tp: LinearLatency(a, (b, c), 0, 0.0) for tp, (a, b, c) in decode.items()},
        **fields,
    )


# ---- the simulation, by hand -----------------------------------------------------------------
def test_one_request_alone_takes_exactly_the_profile_times():
    """A prompt of 400 tokens, 10 output tokens, requests far apart: TTFT is one prefill step
    a + b·400 + c·400²; the decode side waits for the fixed hand-off plus 400 tokens of KV at
    the profile's transfer rate, then runs 9 steps over contexts 401..409."""
    profile = make_profile(kv_transfer_bytes_per_s=1024 * 1e5, handoff_s=0.001)
    config = profile.simulation_config(SimulationConfig(ttft_slo_s=1, tpot_slo_s=1, num_requests=8))
    assert config.kv_transfer_s_per_token == pytest.approx(1e-5)
    results = simulate([RequestShape(400, 0, 10)], 1e-4, 1, 1, profile.models(1, 1), config)
    ttft = 0.01 + 1e-4 * 400 + 1e-8 * 400 * 400  # 0.0516 s
    transfer = 0.001 + 400 * 1e-5  # 0.005 s
    decode_s = sum(0.003 + 1e-6 * (401 + k) + 1e-4 for k in range(9))  # 0.031545 s
    for got_ttft, got_tpot in results:
        assert got_ttft == pytest.approx(0.0516, abs=1e-9)
        assert got_ttft == pytest.approx(ttft, abs=1e-9)
        assert got_tpot == pytest.approx((transfer + decode_s) / 9, abs=1e-9)
        assert got_tpot == pytest.approx(0.036545 / 9, abs=1e-9)


def test_saturated_prefill_queue_serves_first_come_first_served():
    """Six 1000-token prompts arriving at once (rate 1e9/s: within nanoseconds) on one prefill
    instance whose budget holds two prompts. The first runs alone (nothing else has arrived
    when it starts), then pairs, then the last alone: TTFTs T1, T1+T2, T1+T2, T1+2·T2,
    T1+2·T2, 2·T1+2·T2 with T1 = a + b·1000 + c·1000² and T2 = a + b·2000 + c·2·1000²."""
    profile = make_profile(max_num_batched_tokens=2000)
    config = profile.simulation_config(
        SimulationConfig(ttft_slo_s=0.25, tpot_slo_s=1, num_requests=6, max_num_requests=6)
    )
    results = simulate([RequestShape(1000, 0, 1)], 1e9, 1, 1, profile.models(1, 1), config)
    t1 = 0.01 + 0.1 + 0.01  # 0.12 s
    t2 = 0.01 + 0.2 + 0.02  # 0.23 s
    want = [t1, t1 + t2, t1 + t2, t1 + 2 * t2, t1 + 2 * t2, 2 * t1 + 2 * t2]
    assert [ttft for ttft, _ in results] == pytest.approx(want, abs=1e-6)
    # only the first meets a 250 ms TTFT SLO
    assert attainment(results, config) == pytest.approx(1 / 6)
    # two instances take turns: each runs its first prompt alone, then its other two together
    two = simulate([RequestShape(1000, 0, 1)], 1e9, 2, 1, profile.models(1, 1), config)
    assert sorted(t for t, _ in two) == pytest.approx([t1, t1] + [t1 + t2] * 4, abs=1e-6)
    assert attainment(two, config) == pytest.approx(2 / 6)


def test_goodput_of_a_prefill_bound_split_is_its_service_rate():
    """Prompts whose prefill takes 0.12 s, one per step: one prefill instance cannot keep up
    past 1/0.12 = 8.33 req/s. Past it the queue grows without bound: the 900th of 1000
    requests waits 900·(0.12 - 1/rate), under 0.5 s only below 8.37 req/s; below it Poisson
    queueing still costs some rate, but not half."""
    profile = make_profile(max_num_batched_tokens=1000)
    config = profile.simulation_config(
        SimulationConfig(ttft_slo_s=0.5, tpot_slo_s=1.0, num_requests=1000, attainment=0.9)
    )
    goodput = estimate_goodput([RequestShape(1000, 0, 2)], 1, 1, profile.models(1, 1), config)
    assert 0.5 / 0.12 < goodput < 1 / (0.12 - 0.5 / 900)


# ---- the search ------------------------------------------------------------------------------
def test_placements_use_the_gpus_without_leaving_room_for_another_instance():
    profile = make_profile(
        prefill={1: (0.01, 1e-4, 0), 2: (0.01, 5e-5, 0)},
        decode={1: (0.003, 1e-6, 1e-4), 2: (0.003, 1e-6, 1e-4)},
    )
    got = {(p.num_prefill, p.prefill_tp, p.num_decode, p.decode_tp) for p in placements(profile, 4)}
    assert got == {
        (1, 1, 3, 1),
        (2, 1, 2, 1),
        (3, 1, 1, 1),
        (1, 2, 2, 1),
        (2, 1, 1, 2),
        (1, 2, 1, 2),
    }
    only_tp2 = make_profile(prefill={2: (0.01, 5e-5, 0)}, decode={2: (0.003, 1e-6, 1e-4)})
    # 5 GPUs at TP 2: 4 used, the fifth cannot hold another instance
    assert [p.num_gpus for p in placements(only_tp2, 5)] == [4]


def test_search_finds_a_planted_optimum():
    """Prefill at TP 2 is four times as fast as at TP 1 (a planted superlinear speed-up) and
    decode gains nothing from TP 2 (one TP-2 instance serves what one TP-1 instance does, on
    two GPUs), and a tight TPOT SLO keeps each decode instance's batch small. So one TP-2
    prefill instance beats two TP-1 ones, and the other two GPUs are two TP-1 decode
    instances: about 9.75 req/s of prefill against ~6 req/s per decode instance."""
    profile = make_profile(
        prefill={1: (0.01, 4e-4, 0.0), 2: (0.0025, 1e-4, 0.0)},
        decode={1: (0.004, 1e-6, 2e-3), 2: (0.004, 1e-6, 2e-3)},
    )
    config = SimulationConfig(ttft_slo_s=0.5, tpot_slo_s=0.01, num_requests=200)
    ranked = search(profile, 4, [RequestShape(1000, 0, 32)], config)
    assert ranked[0].placement == Placement(1, 2, 2, 1)
    assert ranked[0].goodput_rps > 2 * ranked[1].goodput_rps
    assert [c.goodput_rps for c in ranked] == sorted((c.goodput_rps for c in ranked), reverse=True)
    assert ranked[0].per_gpu_goodput_rps == pytest.approx(ranked[0].goodput_rps / 4)
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        search(profile, 1, [RequestShape(1000, 0, 32)], config)


def test_kv_bandwidth_is_rate_times_prompt_times_bytes():
    profile = make_profile(kv_bytes_per_token=131072)
    workload = [RequestShape(1000, 0, 8), RequestShape(3000, 0, 8)]
    assert kv_bandwidth_bytes_per_s(profile, 2.5, workload) == 2.5 * 2000 * 131072


# ---- the profile -----------------------------------------------------------------------------
def test_profile_round_trip(tmp_path):
    profile = make_profile(
        prefill={1: (0.01, 1e-4, 1e-8), 4: (0.004, 3e-5, 3e-9)},
        kv_transfer_bytes_per_s=25e9,
        max_num_batched_tokens=4096,
        max_num_seqs=128,
        source="hand-made",
        extra={"note": "kept"},
    )
    path = profile.save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["prefill"]["4"] == {
        "intercept_s": 0.004,
        "per_token_s": 3e-5,
        "per_attention_s": 3e-9,
    }
    assert data["decode"]["1"] == {
        "intercept_s": 0.003,
        "per_context_token_s": 1e-6,
        "per_sequence_s": 1e-4,
    }
    assert data["note"] == "kept" and data["kv_transfer_bytes_per_s"] == 25e9
    assert LatencyProfile.load(path) == profile
    assert LatencyProfile.from_dict(profile.to_dict()).to_dict() == data


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["decode"]["1"].update(per_sequence_s=-1e-4), "finite and >= 0"),
        (lambda d: d.pop("prefill"), "not a latency profile"),
        (lambda d: d["prefill"].update({"0": d["prefill"]["1"]}), "TP degree 0"),
        (
            lambda d: (
                d.update(kv_transfer_bytes_per_s=0.0) or d.update(kv_transfer_bytes_per_s=-1.0)
            ),
            "kv_transfer_bytes_per_s",
        ),
    ],
)
def test_bad_profiles_are_named_errors(tmp_path, edit, message):
    data = make_profile().to_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        LatencyProfile.load(path)
    with pytest.raises(ProfileError, match="asked for prefill TP 2"):
        make_profile().models(2, 1)


class _Worker:
    def __init__(self, samples: list[StepSample], tp: int = 1) -> None:
        self.samples, self.is_ready = samples, True
        self.status = SimpleNamespace(
            kv_transfer={},
            max_num_seqs=32,
            max_num_batched_tokens=1024,
            tensor_parallel_size=tp,
            model="tiny-served",
            kv_layout={
                "dtype": "bfloat16",
                "block_size": 16,
                "num_layers": 8,
                "num_kv_heads": 4,
                "head_dim": 64,
                "kind": "mha",
            },
        )

    def take_step_samples(self) -> list[StepSample]:
        samples, self.samples = self.samples, []
        return samples


async def test_controller_starts_from_a_profile_and_exports_one(tmp_path):
    """No decode samples yet: the profile's TP-2 decode model stands in (the decode pool is
    TP 2); prefill is fitted from samples. The export is a profile of both, at the pools' TP
    degrees, with the KV bytes from the reported layout (8 layers x K,V x 4 heads x 64 x 2 B)."""
    prefill = LinearLatency(0.01, (1e-4, 1e-8), 0, 0.0)
    samples = [
        StepSample(i + 1, n, n * n, 0, 0, prefill(n, n * n))
        for i, n in enumerate(range(100, 2100, 100))
    ]
    decode_tp2 = (0.002, 5e-7, 5e-5)
    path = make_profile(decode={1: (0.003, 1e-6, 1e-4), 2: decode_tp2}).save(
        tmp_path / "start.json"
    )
    pools = SimpleNamespace(
        prefill=[_Worker(samples)],
        decode=[_Worker([], tp=2)],
        config=SimpleNamespace(is_disaggregated=True),
    )
    controller = GoodputController(
        ControllerConfig(mode="recommend", ttft_slo_s=0.5, tpot_slo_s=0.05, profile=str(path)),
        pools,
    )
    for _ in range(20):
        controller.record_arrival(500, 16)
        controller.record_request(500, 0, 16, max_tokens=16)
    controller.collect()
    models = controller.fit()
    assert models is not None
    assert models.decode == LinearLatency(0.002, (5e-7, 5e-5), 0, 0.0)
    assert models.prefill.coefs[0] == pytest.approx(1e-4, rel=1e-3)
    estimate = await controller.evaluate()
    assert estimate is not None and estimate.goodput[1] > 0
    exported = export_profile(estimate, pools)
    assert sorted(exported.prefill) == [1] and sorted(exported.decode) == [2]
    assert exported.kv_bytes_per_token == 8 * 2 * 4 * 64 * 2
    assert exported.model == "tiny-served" and exported.max_num_seqs == 32
    again = LatencyProfile.from_dict(json.loads(json.dumps(exported.to_dict())))
    assert again.decode[2].coefs == (5e-7, 5e-5)
    controller.estimate = estimate
    assert controller.snapshot()["profile"]["decode"]["2"]["per_sequence_s"] == 5e-5
    # without the profile the controller waits for decode samples
    bare = GoodputController(ControllerConfig(mode="recommend"), pools)
    assert bare.fit() is None


# ---- the CLI ---------------------------------------------------------------------------------
def test_plan_cli_on_a_tiny_profile(tmp_path, capsys):
    profile = make_profile(
        prefill={1: (0.01, 4e-4, 0.0), 2: (0.0025, 1e-4, 0.0)},
        decode={1: (0.004, 1e-6, 2e-3), 2: (0.004, 1e-6, 2e-3)},
        kv_bytes_per_token=2048,
        kv_transfer_bytes_per_s=1e9,
    )
    path = profile.save(tmp_path / "tiny.json")
    args = [
        "plan",
        "--profile",
        str(path),
        "--num-gpus",
        "4",
        "--slo-ttft-ms",
        "500",
        "--slo-tpot-ms",
        "10",
        "--num-requests",
        "150",
    ]
    assert (
        cli.main(
            [
                *args,
                "--input-len",
                "1000",
                "--output-len",
                "32",
                "--plot",
                str(tmp_path / "plan.png"),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    best = result["best"]
    assert (
        best["num_prefill"],
        best["prefill_tp"],
        best["num_decode"],
        best["decode_tp"],
        best["num_gpus"],
    ) == (1, 2, 2, 1, 4)
    assert result["candidates"][0] == best and len(result["candidates"]) == 6
    assert {"goodput_rps", "per_gpu_goodput_rps"} <= set(best)
    assert any(line.split()[:2] == ["1", "1P(TP2)"] for line in lines)  # rank 1 row
    kv_line = next(line for line in lines if line.startswith("KV transfer"))
    need = best["goodput_rps"] * 1000 * 2048
    assert result["kv_bandwidth"]["needed_bytes_per_s"] == pytest.approx(need, rel=1e-3)
    assert "GB/s" in kv_line and "of it" in kv_line
    assert (tmp_path / "plan.png").stat().st_size > 0

    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": i,
                    "input_length": 1000 + 10 * i,
                    "output_length": 32,
                    "hash_ids": [i],
                }
            )
            + "\n"
            for i in range(5)
        )
    )
    assert cli.main([*args, "--dataset-path", str(trace)]) == 0
    traced = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert traced["best"]["prefill_tp"] == 2 and traced["best"]["num_decode"] == 2

    assert cli.main([*args, "--input-len", "1000"]) == 2  # no --output-len
    assert "--output-len" in capsys.readouterr().err


# ---- the profiler ----------------------------------------------------------------------------
def test_sweep_points_fit_the_budget_and_the_model():
    config = profiler.SweepConfig(
        prefill_lengths=(64, 1024, 4096),
        prefill_batches=(1, 2, 4),
        decode_batches=(1, 16),
        decode_contexts=(128, 1536),
        max_num_batched_tokens=2048,
    )
    assert profiler.prefill_points(config, 2000) == [
        (1, 64),
        (2, 64),
        (4, 64),
        (1, 1024),
        (2, 1024),
    ]
    assert profiler.decode_points(config, 1000) == [(1, 128), (16, 128)]
    assert profiler.instance_cores(2, 1, [0, 1, 2]) == [0, 1]
    assert profiler.instance_cores(2, 2, [0, 1, 2]) is None


def test_profile_command_on_a_tiny_model(llama_dir, tmp_path, capsys):
    """A small sweep of the real engine: a profile comes out that plans, with a positive
    cost per prompt token and per decode sequence, and the fit follows its own samples."""
    output = tmp_path / "tiny-profile.json"
    parser = argparse.ArgumentParser()
    profiler.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(llama_dir),
            "--output",
            str(output),
            "--prefill-lengths",
            "16",
            "32",
            "64",
            "128",
            "--prefill-batches",
            "1",
            "2",
            "--repeats",
            "2",
            "--decode-batches",
            "1",
            "2",
            "4",
            "8",
            "--decode-contexts",
            "16",
            "48",
            "--decode-steps",
            "3",
            "--disable-tqdm",
        ]
    )
    assert profiler.run(args) == 0
    profile = LatencyProfile.load(output)
    assert sorted(profile.prefill) == [1] and profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert profile.extra["clock_by_tp"] == {"1": "cpu"}  # TP 1 is timed by its CPU time
    prefill, decode = profile.prefill[1], profile.decode[1]
    # one fitted point per sweep point: 4 lengths x 2 batches, 4 batches x 2 contexts
    assert prefill.num_samples == 8 and decode.num_samples == 8
    # a tiny model's 16- and 128-token prefills differ by microseconds: on a busy host the fit
    # may find no slope, but never a negative one (a longer prompt is never predicted faster)
    assert len(prefill.coefs) == 2 and min(prefill.coefs) >= 0 and prefill.intercept >= 0
    assert prefill(128, 128 * 128) >= prefill(16, 16 * 16) > 0
    samples = json.loads(output.with_name("tiny-profile-samples.json").read_text())["1"]
    prefill_steps = [s for s in samples if s[0] == "prefill"]
    assert len(prefill_steps) == 8 * 2  # every step kept: each point ran twice, one step each
    assert all(s[3] == s[1] * s[2] and s[-1] > 0 for s in prefill_steps)  # tokens = k x L
    decode_steps = [s for s in samples if s[0] == "decode"]
    assert decode_steps and all(s[4] == s[1] for s in decode_steps)  # B sequences a step
    assert output.with_suffix(".png").stat().st_size > 0
    assert math.isfinite(decode(64, 4))


def test_plan_check_compares_the_plan_with_a_measured_sweep(tmp_path, capsys):
    """planner_check.sh's table: the plan's goodput for the measured split against the sweep's,
    and the simulated attainment at each of the sweep's rates on its own request lengths."""
    from benchmarks import plan_check

    profile = make_profile()
    profile_path = profile.save(tmp_path / "profile.json")
    assert (
        cli.main(
            [
                "plan",
                "--profile",
                str(profile_path),
                "--num-gpus",
                "2",
                "--slo-ttft-ms",
                "500",
                "--slo-tpot-ms",
                "50",
                "--input-len",
                "500",
                "--output-len",
                "8",
                "--num-requests",
                "200",
                "--output",
                str(tmp_path / "plan-2gpus.json"),
            ]
        )
        == 0
    )
    predicted = json.loads((tmp_path / "plan-2gpus.json").read_text())["best"]["goodput_rps"]
    runs = [
        {
            "request_rate": rate,
            "slo_attainment": attained,
            "input_lens": [500] * 4,
            "output_lens": [8] * 4,
        }
        for rate, attained in ((0.5, 1.0), (1000.0, 0.0))
    ]
    (tmp_path / "measured-1p1d").mkdir()
    (tmp_path / "measured-1p1d" / "sweep.json").write_text(
        json.dumps(
            {
                "goodput_slo_ms": {"ttft": 500, "tpot": 50},
                "target_attainment": 0.9,
                "servers": [{"runs": runs, "goodput_rate": predicted / 1.25}],
            }
        )
    )
    capsys.readouterr()
    assert plan_check.main([str(tmp_path), str(profile_path)]) == 0
    (result,) = json.loads((tmp_path / "plan-check.json").read_text())
    assert result["split"] == "1P1D" and result["error"] == pytest.approx(0.25)
    assert result["predicted_time_shared_rps"] is None
    # requests far apart all meet the SLOs; a thousand a second overwhelm one prefill instance
    assert [row["simulated_attainment"] for row in result["rows"]] == [
        1.0,
        pytest.approx(0.0, abs=0.02),
    ]
    assert "+25%" in capsys.readouterr().out
