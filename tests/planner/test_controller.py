"""The goodput controller's decisions: when it recommends a split, when it flips, and that it
waits (patience, min gain, cooldown). The pools here are plain objects holding step samples;
tests/cluster/test_server_controller.py runs the real flip through `pdserve up`."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgpack
import pytest

from pdserve.planner.goodput_model import LinearLatency, PhaseModels, SimulationConfig
from pdserve.protocol.codec import WireError
from pdserve.protocol.worker import WORKER_PROTOCOL, StepSample, WorkerStatus
from pdserve.router.config import ControllerConfig
from pdserve.router.controller import Estimate, GoodputController, wanted_prefill

PREFILL = LinearLatency(0.01, (1e-4, 1e-8), 0, 0.0)
DECODE = LinearLatency(0.003, (1e-6, 1e-4), 0, 0.0)


@dataclass
class Pool:
    """A worker as the controller sees it: readiness, status totals, reported samples."""

    samples: list[StepSample] = field(default_factory=list)
    is_ready: bool = True
    status: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(
        kv_transfer={"load_seconds": 0.5, "load_count": 100.0}, max_num_seqs=48,
        max_num_batched_tokens=1024, tensor_parallel_size=1))

    def take_step_samples(self) -> list[StepSample]:
        samples, self.samples = self.samples, []
        return samples


class Pools:
    def __init__(self, num_prefill: int, num_decode: int) -> None:
        self.prefill = [Pool() for _ in range(num_prefill)]
        self.decode = [Pool() for _ in range(num_decode)]
        self.config = SimpleNamespace(is_disaggregated=True)
        self.flips: list[str] = []

    async def flip_one(self, to_role: str, drain_timeout_s: float):
        self.flips.append(to_role)
        source, target = (self.decode, self.prefill) if to_role == "prefill" else \
            (self.prefill, self.decode)
        target.append(source.pop())
        return SimpleNamespace(worker_id=f"w{len(self.flips)}")

    def report(self, rng: random.Random, num: int = 40) -> None:
        """Each pool reports `num` steps timed by the models above (2% noise)."""
        for i in range(num):
            n = rng.randint(100, 2000)
            self.prefill[0].samples.append(StepSample(
                i + 1, n, n * n, 0, 0, PREFILL(n, n * n) * rng.uniform(0.98, 1.02)))
            b = rng.randint(1, 32)
            c = b * rng.randint(50, 2000)
            self.decode[0].samples.append(StepSample(
                i + 1, 0, 0, b, c, DECODE(c, b) * rng.uniform(0.98, 1.02)))


def _controller(pools: Pools, **overrides) -> GoodputController:
    config = ControllerConfig(**{"mode": "flip", "ttft_slo_s": 0.5, "tpot_slo_s": 0.05,
                                 "patience": 2, "cooldown_s": 3600.0, **overrides})
    controller = GoodputController(config, pools)
    for _ in range(40):  # long prompts, two output tokens: prefill is the bottleneck
        controller.record_request(1500, 0, 2, ttft_s=PREFILL(1500, 1500 * 1500) + 0.02)
    return controller


def test_wanted_split_needs_a_clear_gain():
    models = PhaseModels(PREFILL, DECODE)

    def estimate(goodput: dict[int, float], current: int) -> Estimate:
        return Estimate(models, goodput, current, 4, SimulationConfig(1, 1))

    assert wanted_prefill(estimate({1: 10.0, 2: 11.0, 3: 5.0}, 1), 1.2) is None
    assert wanted_prefill(estimate({1: 10.0, 2: 15.0, 3: 5.0}, 1), 1.2) == 2
    assert wanted_prefill(estimate({1: 0.0, 2: 0.5, 3: 0.0}, 1), 1.2) == 2
    assert wanted_prefill(estimate({1: 0.0, 2: 0.0, 3: 0.0}, 2), 1.2) is None
    # A tie with the current split keeps it.
    assert estimate({1: 7.0, 2: 7.0, 3: 7.0}, 3).best_prefill == 3


async def test_flips_towards_the_bottleneck_after_patience_then_cools_down():
    pools = Pools(1, 3)
    controller = _controller(pools)
    rng = random.Random(0)
    pools.report(rng)
    await controller.tick()
    assert controller.estimate is not None and controller.estimate.best_prefill >= 2
    assert pools.flips == []  # one tick is not patience 2
    pools.report(rng)
    await controller.tick()
    assert pools.flips == ["prefill"] and controller.num_flips == 1
    assert (len(pools.prefill), len(pools.decode)) == (2, 2)
    for _ in range(3):  # still wants more prefill, but the cooldown holds
        pools.report(rng)
        await controller.tick()
    assert pools.flips == ["prefill"]
    snapshot = controller.snapshot()
    assert snapshot["num_flips"] == 1 and snapshot["current"] == {"prefill": 2, "decode": 2}
    assert snapshot["recommended"]["prefill"] >= 2
    assert snapshot["models"]["prefill"]["per_tokens_s"] == pytest.approx(1e-4, rel=0.2)
    # The simulation runs with what the workers report: batch limits, KV load time.
    sim = snapshot["simulation"]
    assert (sim["max_num_seqs"], sim["max_batched_tokens"]) == (48, 1024)
    assert sim["handoff_s"] == pytest.approx(0.005)
    assert sim["ttft_overhead_s"] == pytest.approx(0.02, abs=0.005)  # measured - modelled


async def test_workers_of_different_tp_are_not_flipped():
    pools = Pools(1, 3)
    pools.decode[1].status = SimpleNamespace(**{**vars(pools.decode[1].status),
                                                "tensor_parallel_size": 2})
    controller = _controller(pools)
    rng = random.Random(3)
    for _ in range(3):
        pools.report(rng)
        await controller.tick()
    assert pools.flips == [] and "TP degrees differ" in controller.state


async def test_recommend_mode_never_flips():
    pools = Pools(1, 3)
    controller = _controller(pools, mode="recommend")
    rng = random.Random(1)
    for _ in range(4):
        pools.report(rng)
        await controller.tick()
    assert pools.flips == [] and controller.estimate.best_prefill >= 2
    assert controller.state.startswith("wants")


async def test_no_estimate_without_enough_data():
    pools = Pools(1, 1)
    controller = GoodputController(ControllerConfig(mode="flip"), pools)
    pools.report(random.Random(2), num=4)  # too few samples, no requests
    await controller.tick()
    assert controller.estimate is None and controller.state == "warming up"
    assert "recommended" not in controller.snapshot()


def test_mixed_and_idle_steps_fit_neither_phase():
    pools = Pools(1, 1)
    controller = GoodputController(ControllerConfig(), pools)
    pools.prefill[0].samples = [StepSample(1, 10, 100, 2, 50, 0.01),  # colocated-style mix
                                StepSample(2, 10, 100, 0, 0, 0.01)]
    pools.decode[0].samples = [StepSample(1, 0, 0, 3, 90, 0.01)]
    controller.collect()
    assert [s.seq for s in controller.prefill_samples] == [2]
    assert [s.seq for s in controller.decode_samples] == [1]


@pytest.mark.parametrize("bad", [{"mode": "auto"}, {"ttft_slo_s": 0}, {"min_gain": 0.5},
                                 {"patience": 0}, {"attainment": 1.5}])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        ControllerConfig(**bad)


@pytest.mark.parametrize("bad", [{"seconds": float("nan")}, {"seconds": -1.0},
                                 {"num_decode_seqs": -2}])
def test_a_bad_step_sample_is_a_malformed_status(bad):
    """Samples feed least squares: a NaN or negative one would poison every fit after it."""
    status = WorkerStatus("w", "prefill", "m", 64, True, 0, 0, 8, 8, 16,
                          step_samples=[StepSample(1, 4, 16, 0, 0, 0.01)])
    plain = msgpack.unpackb(WORKER_PROTOCOL.encode(status))
    assert WORKER_PROTOCOL.decode(msgpack.packb(plain)) == status
    plain["step_samples"][0].update(bad)
    with pytest.raises(WireError):
        WORKER_PROTOCOL.decode(msgpack.packb(plain))
