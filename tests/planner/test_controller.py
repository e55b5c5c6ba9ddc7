"""The goodput controller's decisions on recorded arrivals and step samples: a steady load
causes no move, a phase change moves the predicted number of workers at once, and it waits
(headroom, gain, cooldown). The pools here are plain objects holding step samples;
tests/cluster/test_server_controller.py runs the real flip through `pdserve up`."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgpack
import pytest

from pdserve.planner.goodput_model import (
    LinearLatency,
    PhaseModels,
    SimulationConfig,
    fleet_size,
)
from pdserve.protocol.codec import WireError
from pdserve.protocol.worker import WORKER_PROTOCOL, StepSample, WorkerStatus
from pdserve.router.config import ControllerConfig
from pdserve.router.controller import (
    MIX_CHANGE_MIN_REQUESTS,
    Estimate,
    GoodputController,
    choose_split,
    mix_change,
)
from pdserve.router.moves import Move

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

    async def flip_one(self, to_role: str, drain_timeout_s: float, hand_over: bool = True):
        self.flips.append(to_role)
        source, target = (self.decode, self.prefill) if to_role == "prefill" else \
            (self.prefill, self.decode)
        target.append(source.pop())
        return Move(f"w{len(self.flips)}", to_role, 0.5, 3 if to_role == "prefill" else 0)

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


T0 = 1000.0
"""Where the recorded arrivals' clock starts (time.monotonic() seconds)."""


def arrive(controller: GoodputController, start_s: float, rate: float, seconds: float,
           prompt: int, output: int) -> float:
    """Requests of `prompt` tokens and max_tokens `output` arriving at `rate` per second
    from start_s (after T0) for `seconds`, each finished at once
    with all its tokens; the time they end at."""
    t0 = T0 + start_s
    for i in range(int(rate * seconds)):
        controller.record_arrival(prompt, output, at_s=t0 + i / rate)
        controller.record_request(prompt, 0, output, ttft_s=PREFILL(prompt, prompt * prompt)
                                  + 0.02, max_tokens=output)
    return start_s + seconds


async def tick_at(controller: GoodputController, seconds: float) -> None:
    await controller.tick(now_s=T0 + seconds)


LONG_PROMPTS = (1500, 2)  # prefill-bound: 0.18 s of prefill, one more token
LONG_OUTPUTS = (50, 1000)  # decode-bound: a quick prompt, 1000 decode steps


def _controller(pools: Pools, rate: float = 6.0, **overrides) -> GoodputController:
    """A flipping controller (TTFT 0.5 s, TPOT 50 ms) that saw 10 s of long prompts."""
    config = ControllerConfig(**{"mode": "flip", "ttft_slo_s": 0.5, "tpot_slo_s": 0.05,
                                 "cooldown_s": 0.0, **overrides})
    controller = GoodputController(config, pools)
    arrive(controller, 0.0, rate, 10.0, *LONG_PROMPTS)
    return controller


def test_a_split_that_meets_the_target_with_headroom_stays():
    models = PhaseModels(PREFILL, DECODE)

    def estimate(goodput: dict[int, float], attained: dict[int, float], rate: float,
                 current: int) -> Estimate:
        return Estimate(models, goodput, current, 4, SimulationConfig(1, 1), rate, attained)

    meets = {1: 0.95, 2: 0.97, 3: 0.6}
    # meets the target, 1.5x the rate: stays though 2 has more capacity
    assert choose_split(estimate({1: 6.0, 2: 9.0, 3: 2.0}, meets, 4.0, 1), 1.2, 0.05) is None
    # meets it, but with no headroom: to the split with the most capacity
    assert choose_split(estimate({1: 4.2, 2: 9.0, 3: 2.0}, meets, 4.0, 1), 1.2, 0.05) == 2
    # misses it: to the one that meets it, however many workers away
    assert choose_split(estimate({1: 3.0, 2: 3.1, 3: 9.0}, {1: 0.5, 2: 0.6, 3: 0.95}, 4.0, 1),
                        1.2, 0.05) == 3
    # none meets it and the best is barely better: no move (no oscillation)
    assert choose_split(estimate({1: 3.0, 2: 3.1, 3: 3.0}, {1: 0.5, 2: 0.52, 3: 0.4}, 4.0, 1),
                        1.2, 0.05) is None
    # an overload (a backlog): none comes near the target; the most capacity works it off
    # soonest, whatever the small attainments say
    overload = {1: 0.0, 2: 0.0, 3: 0.06}
    assert estimate({1: 3.0, 2: 4.5, 3: 4.0}, overload, 6.0, 2).best_prefill == 2
    assert choose_split(estimate({1: 3.0, 2: 4.5, 3: 4.0}, overload, 6.0, 2), 1.2, 0.05) is None
    assert choose_split(estimate({1: 3.0, 2: 4.5, 3: 4.0}, overload, 6.0, 3), 1.2, 0.05) is None
    assert choose_split(estimate({1: 3.0, 2: 4.5, 3: 4.0}, overload, 6.0, 1), 1.2, 0.05) == 2
    # capacity to spare over the rate (3.0 against 2.0), the target missed (a backlog):
    # not to a split with more attainment and less capacity, which falls behind the rate
    # as soon as it reads a little higher; to one with more capacity, yes
    backlog = {1: 0.7, 2: 0.92, 3: 0.0}
    assert choose_split(estimate({1: 3.0, 2: 2.6, 3: 1.0}, backlog, 2.0, 1), 1.2, 0.05) is None
    assert choose_split(estimate({1: 3.0, 2: 3.7, 3: 1.0}, backlog, 2.0, 1), 1.2, 0.05) == 2
    # the same split short of the rate (2.8): the attainment decides
    assert choose_split(estimate({1: 2.5, 2: 2.6, 3: 1.0}, backlog, 2.8, 1), 1.2, 0.05) == 2
    # nothing arrives: no move
    assert choose_split(estimate({1: 3.0, 2: 9.0, 3: 9.0}, {}, 0.0, 1), 1.2, 0.05) is None
    # ties keep the current split
    assert estimate({1: 7.0, 2: 7.0, 3: 7.0}, {1: 1.0, 2: 1.0, 3: 1.0}, 1.0, 3
                    ).best_prefill == 3


async def test_a_steady_load_causes_no_move():
    pools = Pools(2, 2)
    controller = _controller(pools, rate=3.0)
    rng = random.Random(0)
    end = 10.0
    for _ in range(4):
        pools.report(rng)
        await tick_at(controller, end)
        end = arrive(controller, end, 3.0, 5.0, *LONG_PROMPTS)
    estimate = controller.estimate
    assert estimate.rate == pytest.approx(3.0, rel=0.1)
    assert estimate.attainment[2] >= 0.9, estimate
    assert pools.flips == [] and controller.state == "balanced"


async def test_a_phase_change_moves_the_predicted_number_at_once():
    """Long prompts on 1 prefill + 3 decode workers: prefill-bound, so the first tick moves
    decode workers to prefill; then long outputs at 4 req/s, which only 3 decode workers
    serve: the next tick moves two back at once, and the one after moves nothing."""
    pools = Pools(1, 3)
    controller = _controller(pools, rate=6.0)
    rng = random.Random(0)
    pools.report(rng)
    await tick_at(controller, 10.0)
    first = controller.estimate
    assert first.attainment[1] < 0.9 <= first.attainment[first.best_prefill], first
    assert pools.flips == ["prefill"] * (first.best_prefill - 1)
    assert len(pools.prefill) == first.best_prefill == 3
    arrive(controller, 10.0, 4.0, 10.0, *LONG_OUTPUTS)
    pools.report(rng)
    await tick_at(controller, 20.0)
    second = controller.estimate
    assert second.best_prefill == 1 and second.attainment[3] < 0.9 <= second.attainment[1]
    assert pools.flips[2:] == ["decode", "decode"] and len(pools.decode) == 3
    assert controller.num_moves == 2 and controller.num_flips == 4
    arrive(controller, 20.0, 4.0, 5.0, *LONG_OUTPUTS)
    pools.report(rng)
    await tick_at(controller, 25.0)
    assert len(pools.flips) == 4 and controller.state == "balanced"
    snapshot = controller.snapshot()
    assert snapshot["num_moves"] == 2 and snapshot["arrival_rate"] == pytest.approx(4.0)
    assert snapshot["attainment_by_num_prefill"]["1"] >= 0.9
    assert [m["to_role"] for m in snapshot["last_moves"]] == ["decode", "decode"]
    # the fleet this load needs, whatever this one's size: long outputs at 4 req/s
    estimate = controller.estimate
    load = controller.load(now_s=T0 + 25.0)
    assert estimate.needed == fleet_size(load.shapes, load.rate, estimate.models,
                                         estimate.simulation, 64)
    assert snapshot["needed"] == {"prefill": estimate.needed[0], "decode": estimate.needed[1]}
    assert estimate.needed[1] >= 3 and estimate.needed[0] == 1


async def test_moves_wait_for_patience_and_the_cooldown():
    pools = Pools(1, 3)
    controller = _controller(pools, patience=2, cooldown_s=3600.0)
    rng = random.Random(0)
    pools.report(rng)
    await tick_at(controller, 10.0)
    assert controller.estimate is not None and controller.estimate.best_prefill >= 2
    assert pools.flips == []  # one tick is not patience 2
    pools.report(rng)
    await tick_at(controller, 10.0)
    assert pools.flips and controller.num_moves == 1
    moved = len(pools.flips)
    assert (len(pools.prefill), len(pools.decode)) == (1 + moved, 3 - moved)
    snapshot = controller.snapshot()
    arrive(controller, 10.0, 30.0, 10.0, *LONG_PROMPTS)  # more than any split serves
    for _ in range(3):  # the cooldown holds
        pools.report(rng)
        await tick_at(controller, 20.0)
    assert len(pools.flips) == moved
    assert snapshot["models"]["prefill"]["per_tokens_s"] == pytest.approx(1e-4, rel=0.2)
    # The simulation runs with what the workers report: batch limits, KV load time.
    sim = snapshot["simulation"]
    assert (sim["max_num_seqs"], sim["max_batched_tokens"]) == (48, 1024)
    assert sim["handoff_s"] == pytest.approx(0.005)
    assert sim["ttft_overhead_s"] == pytest.approx(0.02, abs=0.005)  # measured - modelled


async def test_a_backlog_at_the_workers_is_planned_on_top_of_the_arrivals():
    """Long prompts at 3 req/s meet the target on 2P2D (the steady test above); the same
    with 120 requests queued at the prefill workers (a steady load's queue, what arrives
    within the 0.5 s TTFT SLO, is not backlog: 118 are) is simulated with them waiting at
    the start, which 2 prefill workers do not work off within the SLO: the controller moves
    decode workers to prefill. The rate it plans for stays the arrivals' (a burst, not a
    rate), and a split's capacity does not depend on the queue."""
    pools = Pools(2, 2)
    for worker in pools.prefill:
        worker.status.num_waiting = 60
    controller = _controller(pools, rate=3.0)
    pools.report(random.Random(0))
    await tick_at(controller, 10.0)
    estimate = controller.estimate
    assert estimate.rate == pytest.approx(3.0, rel=0.1)
    assert estimate.num_queued == 120 and estimate.backlog == 118
    assert estimate.attainment[2] < 0.9
    assert pools.flips and set(pools.flips) == {"prefill"}
    assert controller.snapshot()["backlog"] == 118


def test_the_load_is_the_window_s_arrivals_with_outputs_scaled_by_what_finished():
    controller = GoodputController(ControllerConfig(window_s=10.0), Pools(1, 1))
    assert controller.load() is None  # nothing arrived
    t0 = T0
    for i in range(40):  # 20 s at 2 req/s: only the last 10 s count for the rate
        controller.record_arrival(100 + i, 64, at_s=t0 + i / 2)
    for _ in range(10):  # finished requests made half their max_tokens, a quarter cached
        controller.record_request(200, 50, 32, ttft_s=0.1, max_tokens=64)
    load = controller.load(now_s=t0 + 20.0)
    assert load.rate == pytest.approx(2.0, rel=0.1)
    assert [s.prompt_tokens for s in load.shapes] == list(range(120, 140))
    assert {s.output_tokens for s in load.shapes} == {32}
    assert all(s.cached_tokens == s.prompt_tokens // 4 for s in load.shapes)
    # a quiet minute later: no rate, the last shapes still describe the mix
    quiet = controller.load(now_s=t0 + 80.0)
    assert quiet.rate == 0.0 and len(quiet.shapes) == 16


async def test_workers_of_different_tp_are_not_flipped():
    pools = Pools(1, 3)
    pools.decode[1].status = SimpleNamespace(**{**vars(pools.decode[1].status),
                                                "tensor_parallel_size": 2})
    controller = _controller(pools)
    rng = random.Random(3)
    for _ in range(3):
        pools.report(rng)
        await tick_at(controller, 10.0)
    assert pools.flips == [] and "TP degrees differ" in controller.state


async def test_recommend_mode_never_flips():
    pools = Pools(1, 3)
    controller = _controller(pools, mode="recommend")
    rng = random.Random(1)
    for _ in range(4):
        pools.report(rng)
        await tick_at(controller, 10.0)
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
                                 {"patience": 0}, {"attainment": 1.5}, {"window_s": 0},
                                 {"min_attainment_gain": 2}])
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


def test_a_request_s_ttft_reaches_the_controller_without_its_worker_queue_wait():
    """The TTFT overhead the simulation adds is taken from the requests' TTFTs less their wait
    in a worker's queue (the simulation models queueing): under overload every request
    queues, and with the wait the overhead grew until every split looked as if it missed."""
    from pdserve.protocol.worker import Output
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.responses import Accumulated
    from pdserve.router.streaming import RequestObserver, RequestTiming

    controller = GoodputController(ControllerConfig(), Pools(1, 1))
    timing = RequestTiming(100.0, None, max_tokens=8)
    timing.phases.first.on_sent(100.01)
    timing.phases.first.on_output(
        Output("r", [1], "a", phase_seconds={"queue": 0.7, "prefill": 0.2}), 100.95)
    timing.first_s = 101.0
    RequestObserver(RouterMetrics("m"), controller).observe(
        timing, Accumulated(token_ids=[1, 2, 3], num_prompt_tokens=50, finish_reason="length"))
    [(shape, ttft_s, max_tokens)] = list(controller.requests)
    assert ttft_s == pytest.approx(1.0 - 0.7) and max_tokens == 8
    assert (shape.prompt_tokens, shape.output_tokens) == (50, 3)


def _arrivals(shapes: list[tuple[int, int]], rate: float = 4.0) -> list[tuple[float, int, int]]:
    return [(T0 + i / rate, p, m) for i, (p, m) in enumerate(shapes)]


def test_a_change_in_the_mix_is_found_where_it_happened_and_only_then():
    rng = random.Random(7)
    # long prompts, then long outputs: the change is found once enough of the new mix came,
    # at its first arrival; so for max_tokens alone, and with lengths that vary in a phase
    for before, after in ((LONG_PROMPTS, LONG_OUTPUTS), ((512, 16), (512, 256))):
        shapes = [before] * 30 + [after] * MIX_CHANGE_MIN_REQUESTS
        assert mix_change(_arrivals(shapes)) == 30
        assert mix_change(_arrivals(shapes[:-2])) is None  # two new arrivals short
        varied = [(int(p * rng.uniform(0.7, 1.3)), int(m * rng.uniform(0.7, 1.3)))
                  for p, m in shapes + [after] * 4]
        assert mix_change(_arrivals(varied)) == 30
    # one mix, however mixed: short and long prompts interleaved at random, in any
    # proportion, or lengths spread over two orders of magnitude, is never a change
    for seed in range(200):
        rng = random.Random(seed)
        share = rng.choice((0.1, 0.3, 0.5))
        interleaved = [(1024, 8) if rng.random() < share else (64, 128) for _ in range(60)]
        assert mix_change(_arrivals(interleaved)) is None, (seed, share)
        spread = [(int(math.exp(rng.uniform(3, 8))), rng.randint(1, 512)) for _ in range(60)]
        assert mix_change(_arrivals(spread)) is None, seed
        heavy = [(max(1, int(rng.lognormvariate(6, 1.2))), max(1, int(rng.lognormvariate(
            4, 1.5)))) for _ in range(60)]
        assert mix_change(_arrivals(heavy)) is None, seed
    assert mix_change(_arrivals([LONG_PROMPTS] * 5 + [LONG_OUTPUTS] * 5)) is None  # too few


async def test_the_first_tick_after_a_phase_change_plans_the_new_mix_alone():
    """Long prompts, then long outputs for only 3 s of the 10 s window: the load is the long
    outputs (their rate, their shapes), and the tick moves the whole way at once."""
    pools = Pools(3, 1)
    controller = _controller(pools, rate=6.0)
    rng = random.Random(0)
    arrive(controller, 10.0, 4.0, 3.0, *LONG_OUTPUTS)
    load = controller.load(now_s=T0 + 13.0)
    assert load.mix_changed and load.rate == pytest.approx(4.0, rel=0.1)
    assert {s.prompt_tokens for s in load.shapes} == {LONG_OUTPUTS[0]}
    pools.report(rng)
    await tick_at(controller, 13.0)
    estimate = controller.estimate
    assert estimate.mix_changed and estimate.best_prefill == 1
    assert pools.flips == ["decode", "decode"] and len(pools.decode) == 3
    assert controller.snapshot()["mix_changed"] is True


async def test_a_new_mix_too_young_to_plan_on_holds_the_move_and_a_found_one_holds_on():
    """Three long-output arrivals after long prompts: the controller waits for the new mix
    (a move planned on both went part of the way); four more, and it moves the whole way.
    Later, when the window holds fewer of the old mix than it takes to find the change
    again, the load is still the new mix alone."""
    pools = Pools(3, 1)
    controller = _controller(pools, rate=6.0)
    rng = random.Random(0)
    arrive(controller, 10.0, 4.0, 0.75, *LONG_OUTPUTS)  # 3 arrivals
    pools.report(rng)
    await tick_at(controller, 10.75)
    assert controller.estimate.mix_pending and not controller.estimate.mix_changed
    assert pools.flips == [] and controller.state == "waiting for the new mix"
    assert controller.snapshot()["mix_pending"] is True
    arrive(controller, 10.75, 4.0, 1.0, *LONG_OUTPUTS)  # 4 more
    pools.report(rng)
    await tick_at(controller, 11.75)
    assert controller.estimate.mix_changed and not controller.estimate.mix_pending
    assert pools.flips == ["decode", "decode"]
    # at 19.6 s the 10 s window holds 2 long prompts: too few to find the change again
    arrive(controller, 11.75, 4.0, 7.85, *LONG_OUTPUTS)
    assert mix_change([a for a in controller.arrivals if a[0] >= T0 + 9.6]) is None
    load = controller.load(now_s=T0 + 19.6)
    assert load.mix_changed and {s.prompt_tokens for s in load.shapes} == {LONG_OUTPUTS[0]}
    # once the window has passed the change, the window is the load again
    arrive(controller, 19.6, 4.0, 5.0, *LONG_OUTPUTS)
    assert not controller.load(now_s=T0 + 24.6).mix_changed
