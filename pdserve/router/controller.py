"""The goodput-aware prefill:decode controller (docs/planner.md).

Every `interval_s` the controller

    1. takes the step samples the workers reported since the last tick (StepSample:
       tokens, attention work, batch, context, seconds), keeping a window of them, and the
       requests that arrived in the last `window_s` (prompt length, max_tokens);
    2. fits the prefill and decode step-latency models (goodput_model.fit_nonnegative);
    3. predicts, for every split of the flippable workers (prefill + decode), the SLO
       attainment of the arriving load (its rate and mix: prompt lengths, the outputs that
       max_tokens leaves once scaled by what finished requests produced, the cached share)
       after the backlog the workers hold (queued beyond what arrives within a TTFT SLO),
       and the split's capacity, the highest rate it serves at the attainment target
       (goodput_model.simulate, goodput_by_split);
    4. publishes the best split and the smallest fleet that meets the target on the load
       (goodput_model.fleet_size; an autoscaler reads it) in /status and /metrics, the
       fitted models also as a latency profile (docs/planner.md) that `pdserve plan` reads;
    5. in `flip` mode, moves as many workers as the prediction says, all at once
       (choose_split): not while the current split meets the target with `min_gain`
       headroom in capacity (a steady load causes no move), and only to a split that
       predicts `min_attainment_gain` more attainment or `min_gain` times the capacity
       (hysteresis: a balanced mix does not oscillate). Each moved worker gets no new
       requests; a decode worker hands the ones it holds to the
       other decode workers (`hand_over`), a prefill worker finishes them; it is told its
       new role and joins the other pool once it reports it (pdserve/router/moves.py).

Started with a latency profile (ControllerConfig.profile), the controller uses its model for
a phase, at that pool's TP degree, until it has enough samples of the phase to fit its own.

The estimate assumes the flippable workers are alike (same hardware and TP degree): a
worker moved to the other pool is expected to run at that pool's fitted speed, so workers of
different TP degrees are never flipped (the split is still recommended).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.planner.goodput_model import (
    LinearLatency,
    PhaseModels,
    RequestShape,
    SimulationConfig,
    attainment,
    fit_nonnegative,
    fleet_size,
    goodput_by_split,
    simulate,
    ttft_overhead_s,
)
from pdserve.planner.latency_profile import LatencyProfile, ProfileError
from pdserve.protocol.worker import StepSample
from pdserve.router.config import ControllerConfig

if TYPE_CHECKING:
    from pdserve.router.dispatch import Dispatcher
    from pdserve.router.moves import Move

logger = logging.getLogger(__name__)

MIN_REQUESTS = 16
MIX_CHANGE_MIN_REQUESTS = 6
"""Arrivals on each side of a change in the mix before the controller believes it."""
MIX_CHANGE_RATIO = 2.0
"""A change in the mix: the geometric mean prompt length or max_tokens moved this much,"""
MIX_CHANGE_SCORE = 8.0
"""by this many standard errors (Welch's t on the logarithm),"""
MIX_CHANGE_OVERLAP = 0.05
"""and at most this share of the arrivals on either side came near (within a factor of
sqrt 2) the other side's mean: a run of short requests within an interleaved mix of short
and long ones differs from the rest by the first two tests, but not by this one."""
MIX_CHANGE_PENDING = 2
"""Arrivals of what looks like a new mix after which the controller waits for the rest
(up to MIX_CHANGE_MIN_REQUESTS) before it moves: planned on both mixes, the first move went
part of the way, and the next tick moved again."""


def mix_change(arrivals: list[tuple[float, int, int]],
               min_after: int = MIX_CHANGE_MIN_REQUESTS) -> int | None:
    """Where the arriving mix changed within `arrivals` ((seconds, prompt tokens,
    max_tokens), in order): the index of the first arrival of the new mix, or None where the
    mix is one. Of the splits into a before of at least MIX_CHANGE_MIN_REQUESTS and an after
    of at least `min_after` arrivals whose log prompt lengths or log max_tokens differ by
    MIX_CHANGE_RATIO and MIX_CHANGE_SCORE, the one that differs the most in standard errors
    among the few best where neither side holds (almost) anything like the other's mean."""
    n, k_min = len(arrivals), MIX_CHANGE_MIN_REQUESTS
    if n < k_min + min_after:
        return None
    candidates: list[tuple[float, int, list[float], float, float]] = []
    for feature in (1, 2):
        xs = [math.log(a[feature]) for a in arrivals]
        total, total_sq = sum(xs), sum(x * x for x in xs)
        head = head_sq = 0.0
        for k, x in enumerate(xs[:n - min_after]):
            head, head_sq = head + x, head_sq + x * x
            before = k + 1
            if before < k_min:
                continue
            after = n - before
            mean_b, mean_a = head / before, (total - head) / after
            if abs(mean_a - mean_b) < math.log(MIX_CHANGE_RATIO):
                continue
            var_b = max(head_sq / before - mean_b * mean_b, 0.0)
            var_a = max((total_sq - head_sq) / after - mean_a * mean_a, 0.0)
            # a floor on the spread: lengths fixed within each part are no infinite score
            score = abs(mean_a - mean_b) / math.sqrt((var_b + 0.01) / before
                                                     + (var_a + 0.01) / after)
            if score >= MIX_CHANGE_SCORE:
                candidates.append((score, before, xs, mean_b, mean_a))
    near = math.log(2) / 2
    for _, before, xs, mean_b, mean_a in sorted(candidates, key=lambda c: -c[0])[:4]:
        old_like_new = sum(1 for x in xs[:before] if abs(x - mean_a) <= near)
        new_like_old = sum(1 for x in xs[before:] if abs(x - mean_b) <= near)
        if (old_like_new <= MIX_CHANGE_OVERLAP * before
                and new_like_old <= MIX_CHANGE_OVERLAP * (n - before)):
            return before
    return None


@dataclass(frozen=True)
class Load:
    """The load the controller plans for: requests arriving per second and their shapes."""

    rate: float
    shapes: list[RequestShape]
    mix_changed: bool = False
    """The window held another mix before these arrivals; the load is what came since."""
    mix_pending: bool = False
    """The last few arrivals look like a new mix, too few yet to plan on (MIX_CHANGE_PENDING):
    a move now would be planned on a window of both mixes."""


@dataclass(frozen=True)
class Estimate:
    """One tick's view: the fitted models, and for each split its capacity (the highest rate
    it serves at the attainment target) and its predicted attainment of the current load."""

    models: PhaseModels
    goodput: dict[int, float]  # number of prefill workers -> req/s
    current_prefill: int
    num_workers: int
    simulation: SimulationConfig
    rate: float = 0.0
    """Requests arriving per second now (0: none arrived in the window)."""
    attainment: dict[int, float] = dataclasses.field(default_factory=dict)
    """Number of prefill workers -> predicted share of the current load meeting both SLOs."""
    num_queued: int = 0
    """Requests waiting in the workers' queues at this tick."""
    backlog: int = 0
    """Of those, the ones beyond what arrives within a TTFT SLO: the attainment predicted
    for each split is of them (waiting at the start) and the arrivals."""
    needed: tuple[int, int] | None = None
    """The smallest fleet (prefill, decode workers) predicted to meet the target on the
    current load, whatever this fleet's size (goodput_model.fleet_size): what an autoscaler
    reads. None: nothing arrives, or no fleet of at most max_pool_workers a pool meets it."""
    mix_changed: bool = False
    """The mix changed within the load window: the load is what arrived since (mix_change)."""
    mix_pending: bool = False
    """The last arrivals look like a new mix, too few yet: no move this tick."""

    @property
    def best_prefill(self) -> int:
        """The split that meets the target on the current load with the most capacity; where
        none meets it (an overload, or a backlog no split clears within the SLOs), the one
        with the most capacity too: it works the queue off soonest, while the attainments
        the splits predict are all small and differ by noise (picking the highest of them
        moved 7P1D to 6P2D and back within one prefill-heavy phase). Ties go to the one
        nearest the current split."""
        target = self.simulation.attainment
        meets = [p for p in self.goodput if self.attainment.get(p, target) >= target]

        def key(p: int) -> tuple[float, int]:
            return self.goodput[p], -abs(p - self.current_prefill)

        return max(meets or self.goodput, key=key)


def choose_split(estimate: Estimate, min_gain: float, min_attainment_gain: float) -> int | None:
    """The number of prefill workers to move to now, or None to stay: stay while the current
    split meets the target with `min_gain` headroom in capacity over the arriving rate (or
    nothing arrives); move only to a split with `min_gain` times the capacity, or, where the
    current split's capacity is below the rate, to one that predicts `min_attainment_gain`
    more attainment."""
    current, target = estimate.current_prefill, estimate.simulation.attainment
    if estimate.rate <= 0:
        return None
    capacity = estimate.goodput.get(current, 0.0)
    attained = estimate.attainment.get(current, 0.0)
    if attained >= target and capacity >= min_gain * estimate.rate:
        return None
    best = estimate.best_prefill
    if best == current or estimate.goodput[best] <= 0:
        return None
    if estimate.goodput[best] >= min_gain * capacity:
        return best
    # More attainment for less capacity only where this split falls short of the rate:
    # with capacity to spare, what it misses is a backlog it works off (or noise), and a
    # split with less capacity moved back a tick later when the rate read a little higher
    # (1P7D to 3P5D and back, within one decode-heavy phase).
    if capacity < estimate.rate and (estimate.attainment.get(best, 0.0)
                                     >= attained + min_attainment_gain):
        return best
    return None


class GoodputController:
    def __init__(self, config: ControllerConfig, dispatcher: Dispatcher,
                 sim: SimulationConfig | None = None) -> None:
        self.config = config
        self.dispatcher = dispatcher
        self.sim = sim or SimulationConfig(config.ttft_slo_s, config.tpot_slo_s,
                                           config.attainment)
        # Finished requests: their lengths, their TTFT at the router (None: not seen) and
        # their max_tokens (0: unknown).
        self.requests: deque[tuple[RequestShape, float | None, int]] = deque(
            maxlen=config.window_requests)
        # Arrived requests: (time.monotonic() seconds, prompt tokens, max_tokens).
        self.arrivals: deque[tuple[float, int, int]] = deque(maxlen=config.window_requests)
        self.prefill_samples: deque[StepSample] = deque(maxlen=config.window_samples)
        self.decode_samples: deque[StepSample] = deque(maxlen=config.window_samples)
        self.estimate: Estimate | None = None
        self.profile = LatencyProfile.load(config.profile) if config.profile else None
        """The models to start from (raises ProfileError, a ValueError, on a bad file)."""
        self.state = "warming up"
        self.num_flips = 0
        self.num_moves = 0
        """Ticks that moved workers (each may move several)."""
        self.last_moves: list[Move] = []
        """The workers the last such tick moved (/status: what each move cost)."""
        self._streak: tuple[int | None, int] = (None, 0)  # (wanted split, ticks in a row)
        self._mix_since_s = -float("inf")  # where the mix last changed (monotonic seconds)
        self._last_flip_s = -float("inf")
        self._task: asyncio.Task | None = None

    # ---- inputs -------------------------------------------------------------------------
    def record_arrival(self, prompt_tokens: int, max_tokens: int,
                       at_s: float | None = None) -> None:
        """A request arrived with this prompt and max_tokens (at `at_s`, monotonic), admitted
        or refused: refused requests are demand too."""
        if prompt_tokens > 0 and max_tokens > 0:
            self.arrivals.append((time.monotonic() if at_s is None else at_s, prompt_tokens,
                                  max_tokens))

    def record_request(self, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                       ttft_s: float | None = None, max_tokens: int = 0) -> None:
        """A request finished at the router with these lengths (and this TTFT, less the time
        it waited in a worker's queue: the simulation models queueing itself, and only the
        fixed part of the rest, ttft_overhead_s, is added to its prefill)."""
        if prompt_tokens > 0 and output_tokens > 0:
            self.requests.append((RequestShape(prompt_tokens, cached_tokens, output_tokens),
                                  ttft_s, max_tokens))

    def load(self, now_s: float | None = None) -> Load | None:
        """The arriving load: the rate over the last window_s (or since the first arrival
        in it, or since the mix changed in it: mix_change), and the shapes of the requests
        that arrived in that time (the last MIN_REQUESTS ones where fewer did and the mix is
        one), each output being its max_tokens scaled by what finished requests produced of
        theirs, each cached share the finished requests'. None before MIN_REQUESTS have
        arrived."""
        if len(self.arrivals) < MIN_REQUESTS:
            return None
        now_s = time.monotonic() if now_s is None else now_s
        # where the mix changed within the window (a phase change), only what came since:
        # a window holding both mixes planned a split between them, and the move took
        # a tick more per step of the way; a change once found holds until the window
        # has passed it (later, too few of the old mix are left in it to find it again)
        start_s = max(now_s - self.config.window_s, self._mix_since_s)
        recent = [a for a in self.arrivals if a[0] >= start_s]
        change = mix_change(recent)
        if change is not None:
            recent = recent[change:]
            self._mix_since_s = recent[0][0]
        changed = start_s == self._mix_since_s or change is not None
        pending = change is None and mix_change(recent, MIX_CHANGE_PENDING) is not None
        # over the window, or since the first arrival in it where the load began later (a
        # load that started 3 s ago is not a third of what it is); at least a second
        span = max(now_s - recent[0][0], 1.0) if recent else self.config.window_s
        rate = len(recent) / span
        if len(recent) < MIN_REQUESTS and not changed:
            recent = list(self.arrivals)[-MIN_REQUESTS:]
        finished = [(shape, m) for shape, _, m in self.requests if m > 0]
        produced = sum(shape.output_tokens for shape, _ in finished)
        allowed = sum(m for _, m in finished)
        output_share = produced / allowed if allowed else 1.0
        prompts = sum(shape.prompt_tokens for shape, _, _ in self.requests)
        cached_share = (sum(shape.cached_tokens for shape, _, _ in self.requests) / prompts
                        if prompts else 0.0)
        shapes = [RequestShape(p, min(int(p * cached_share), p - 1),
                               max(1, round(m * output_share))) for _, p, m in recent]
        return Load(rate, shapes, changed, pending)

    def collect(self) -> None:
        """Move the samples the workers reported since the last call into the windows:
        pure prefill steps fit the prefill model, pure decode steps the decode model."""
        for worker in self.dispatcher.prefill + self.dispatcher.decode:
            for sample in worker.take_step_samples():
                if sample.num_decode_seqs == 0 and sample.num_prefill_tokens > 0:
                    self.prefill_samples.append(sample)
                elif sample.num_prefill_tokens == 0 and sample.num_decode_seqs > 0:
                    self.decode_samples.append(sample)

    def fit(self) -> PhaseModels | None:
        prefill = fit_nonnegative([(s.num_prefill_tokens, s.num_prefill_query_keys)
                                   for s in self.prefill_samples],
                                  [s.seconds for s in self.prefill_samples])
        decode = fit_nonnegative([(s.num_decode_context_tokens, s.num_decode_seqs)
                                  for s in self.decode_samples],
                                 [s.seconds for s in self.decode_samples])
        if self.profile is not None:  # at the pools' TP degrees, where the profile has them
            prefill = prefill or self.profile.prefill.get(_pool_tp(self.dispatcher.prefill))
            decode = decode or self.profile.decode.get(_pool_tp(self.dispatcher.decode))
        if prefill is None or decode is None:
            return None
        return PhaseModels(prefill, decode)

    # ---- one tick -----------------------------------------------------------------------
    async def evaluate(self, now_s: float | None = None) -> Estimate | None:
        """Fit and simulate. The inputs are copied here, on the event loop (request handlers
        append to the windows meanwhile); the CPU-bound part runs in a thread."""
        models = self.fit()
        pools = self.dispatcher.prefill, self.dispatcher.decode
        num_prefill, num_decode = (sum(1 for w in pool if w.is_ready) for pool in pools)
        load = self.load(now_s)
        if models is None or load is None or num_prefill < 1 or num_decode < 1:
            return None
        sim, num_workers = self._simulation_config(models), num_prefill + num_decode
        # A backlog (a phase change leaves the pool that became too small with a queue) is
        # work on top of what arrives: simulated as requests waiting at the start, a burst
        # (planned as a rate, it looked sustained; the fleet then lagged the model, the
        # queue grew, and the planned rate with it). Not the queue a steady load keeps
        # (what arrives within a TTFT SLO): the arrivals already hold that.
        num_queued = sum(getattr(w.status, "num_waiting", 0) for pool in pools for w in pool
                         if w.status is not None)
        backlog = max(0, round(num_queued - load.rate * self.config.ttft_slo_s))
        rate = load.rate

        def predict() -> tuple[dict[int, float], dict[int, float], tuple[int, int] | None]:
            capacity = goodput_by_split(load.shapes, num_workers, models, sim)
            attained = ({p: attainment(simulate(load.shapes, rate, p, num_workers - p,
                                                models, sim, backlog), sim)
                         for p in capacity} if rate > 0 else {})
            needed = fleet_size(load.shapes, rate, models, sim, self.config.max_pool_workers)
            return capacity, attained, needed

        capacity, attained, needed = await asyncio.to_thread(predict)
        return Estimate(models, capacity, num_prefill, num_workers, sim, rate, attained,
                        num_queued, backlog, needed, load.mix_changed, load.mix_pending)

    def _simulation_config(self, models: PhaseModels) -> SimulationConfig:
        """The SLOs, with what the workers report (their batch limits, the mean KV load time
        the decode workers measured) and the TTFT overhead the router measured."""
        sim = self.sim
        seconds = count = 0.0
        for worker in self.dispatcher.decode:
            status = worker.status
            if status is None:
                continue
            seconds += status.kv_transfer.get("load_seconds", 0.0)
            count += status.kv_transfer.get("load_count", 0.0)
            if status.max_num_seqs:
                sim = dataclasses.replace(sim, max_num_seqs=status.max_num_seqs)
        for worker in self.dispatcher.prefill:
            if worker.status is not None and worker.status.max_num_batched_tokens:
                sim = dataclasses.replace(
                    sim, max_batched_tokens=worker.status.max_num_batched_tokens)
        return dataclasses.replace(sim, handoff_s=seconds / count if count else 0.0,
                                   ttft_overhead_s=ttft_overhead_s(models.prefill, [
                                       (shape, ttft) for shape, ttft, _ in self.requests
                                       if ttft is not None]))

    async def tick(self, now_s: float | None = None) -> None:
        self.collect()
        estimate = await self.evaluate(now_s)
        self.estimate = estimate
        if estimate is None:
            self.state = "warming up"
            return
        wanted = choose_split(estimate, self.config.min_gain, self.config.min_attainment_gain)
        if wanted is not None and estimate.mix_pending:
            wanted = None  # the next tick plans on the new mix alone
        previous, streak = self._streak
        self._streak = (wanted, streak + 1 if wanted == previous else 1)
        state = ("waiting for the new mix" if estimate.mix_pending and wanted is None
                 else "balanced" if wanted is None else f"wants {wanted} prefill")
        if state != self.state:  # what it decided and on what, once per change
            logger.info("goodput controller: %s at %dP%dD; arriving %.2f req/s%s, %d queued "
                        "beyond that; attainment by prefill workers %s; capacity %s", state,
                        estimate.current_prefill,
                        estimate.num_workers - estimate.current_prefill, estimate.rate,
                        " (a new mix)" if estimate.mix_changed else "",
                        estimate.backlog,
                        {p: round(a, 2) for p, a in estimate.attainment.items()},
                        {p: round(g, 2) for p, g in estimate.goodput.items()})
        self.state = state
        if (self.config.mode != "flip" or wanted is None
                or self._streak[1] < self.config.patience
                or time.monotonic() - self._last_flip_s < self.config.cooldown_s):
            return
        if not self._workers_alike():
            self.state = f"wants {wanted} prefill; not flipping: the workers' TP degrees differ"
            return
        to_role = "prefill" if wanted > estimate.current_prefill else "decode"
        count = abs(wanted - estimate.current_prefill)
        self.state = f"moving {count} worker(s) to {to_role}"
        # All at once: each flip_one marks its worker draining before its first wait, so the
        # next picks another; each keeps at least one worker in the pool it leaves.
        moved = [m for m in await asyncio.gather(*(
            self.dispatcher.flip_one(to_role, self.config.drain_timeout_s,
                                     self.config.hand_over)
            for _ in range(count))) if m is not None]
        self._last_flip_s = time.monotonic()
        self._streak = (None, 0)
        if moved:
            self.num_flips += len(moved)
            self.num_moves += 1
            self.last_moves = moved
            self.state = f"moved {', '.join(m.worker_id for m in moved)} to {to_role}"

    def _workers_alike(self) -> bool:
        """A flipped worker runs at the other pool's fitted speed only if it has the same
        TP degree as the workers that pool's samples came from."""
        sizes = {w.status.tensor_parallel_size for w in self.dispatcher.prefill
                 + self.dispatcher.decode if w.status is not None}
        return len(sizes) <= 1

    def start(self) -> None:
        if not self.dispatcher.is_disaggregated and self.dispatcher.config.discovery is None:
            self.state = "inactive: colocated workers"
        elif self.config.mode == "off":
            self.state = "off"
        else:
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        # every interval_s from the last tick's start, not its end: a tick's simulation
        # takes a second or more of CPU on a large fleet, which otherwise adds to the time
        # a phase change waits for its first move
        next_s = time.monotonic()
        while True:
            next_s = max(next_s + self.config.interval_s,
                         time.monotonic() + self.config.interval_s / 4)
            await asyncio.sleep(next_s - time.monotonic())
            try:
                await self.tick()
            except Exception:  # a bad tick must not end the controller
                logger.exception("goodput controller tick failed")

    # ---- outputs ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What /status shows."""
        out: dict[str, Any] = {
            "mode": self.config.mode, "state": self.state, "num_flips": self.num_flips,
            "num_moves": self.num_moves,
            "last_moves": [dataclasses.asdict(m) for m in self.last_moves],
            "slo": {"ttft_s": self.config.ttft_slo_s, "tpot_s": self.config.tpot_slo_s,
                    "attainment": self.config.attainment},
            "num_requests": len(self.requests),
            "num_samples": {"prefill": len(self.prefill_samples),
                            "decode": len(self.decode_samples)},
        }
        estimate = self.estimate
        if estimate is not None:
            best = estimate.best_prefill
            out.update(
                current={"prefill": estimate.current_prefill,
                         "decode": estimate.num_workers - estimate.current_prefill},
                recommended={"prefill": best, "decode": estimate.num_workers - best},
                goodput_by_num_prefill={str(p): round(g, 3)
                                        for p, g in estimate.goodput.items()},
                arrival_rate=round(estimate.rate, 3), mix_changed=estimate.mix_changed,
                mix_pending=estimate.mix_pending,
                num_queued=estimate.num_queued, backlog=estimate.backlog,
                needed=(None if estimate.needed is None else
                        {"prefill": estimate.needed[0], "decode": estimate.needed[1]}),
                attainment_by_num_prefill={str(p): round(a, 3)
                                           for p, a in estimate.attainment.items()},
                models={"prefill": _describe(estimate.models.prefill, ("tokens", "attention")),
                        "decode": _describe(estimate.models.decode, ("context", "batch"))},
                simulation=dataclasses.asdict(estimate.simulation),
            )
            try:
                out["profile"] = export_profile(estimate, self.dispatcher).to_dict()
            except ProfileError as exc:  # /status must answer whatever the fit came to
                out["profile"] = {"error": str(exc)}
        return out


def _pool_tp(pool: list) -> int:
    """A pool's TP degree, as its first reporting worker says (1 before any reports)."""
    return next((w.status.tensor_parallel_size for w in pool if w.status is not None), 1)


def _kv_bytes_per_token(pool: list) -> int:
    """Bytes of one token's KV, from the layout a worker reports (0 before any reports)."""
    for worker in pool:
        layout = getattr(worker.status, "kv_layout", None)
        if layout:
            planes = 2 if layout.get("kind", "mha") == "mha" else 1
            return (int(layout["num_layers"]) * planes * int(layout["num_kv_heads"])
                    * int(layout["head_dim"]) * _DTYPE_BYTES.get(str(layout["dtype"]), 4))
    return 0


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def export_profile(estimate: Estimate, dispatcher: Dispatcher,
                   hardware: str = "measured by the goodput controller") -> LatencyProfile:
    """What the controller fitted, as a latency profile at its pools' TP degrees: the
    planner's input, and a later controller's starting point."""
    sim = estimate.simulation
    pools = dispatcher.prefill + dispatcher.decode
    model = next((w.status.model for w in pools if getattr(w.status, "model", None)),
                 "unknown")
    return LatencyProfile(
        model=model, hardware=hardware, kv_bytes_per_token=_kv_bytes_per_token(pools),
        prefill={_pool_tp(dispatcher.prefill): estimate.models.prefill},
        decode={_pool_tp(dispatcher.decode): estimate.models.decode},
        max_num_batched_tokens=sim.max_batched_tokens, max_num_seqs=sim.max_num_seqs,
        handoff_s=sim.handoff_s, ttft_overhead_s=sim.ttft_overhead_s,
        source="pdserve goodput controller (router /status)")


def _describe(model: LinearLatency, names: tuple[str, ...]) -> dict[str, float]:
    out = {"intercept_s": model.intercept, "num_samples": model.num_samples,
           "rel_error": round(model.rel_error, 4)}
    out.update({f"per_{name}_s": coef for name, coef in zip(names, model.coefs, strict=True)})
    return out
