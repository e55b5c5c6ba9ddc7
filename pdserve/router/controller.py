"""The goodput-aware prefill:decode controller (docs/planner.md).

Every `interval_s` the controller

    1. takes the step samples the workers reported since the last tick (StepSample:
       tokens, attention work, batch, context, seconds) and the shapes of the requests the
       router finished, keeping a window of each;
    2. fits the prefill and decode step-latency models (goodput_model.fit_nonnegative);
    3. estimates the goodput of every split of the flippable workers (prefill + decode) by
       simulating the recent workload under the SLOs (goodput_model.goodput_by_split);
    4. publishes the best split (/status, /metrics; the fitted models also as a latency
       profile, docs/planner.md, that `pdserve plan` reads), and in `flip` mode moves one worker
       towards it when it is clearly better (`min_gain`) for `patience` ticks in a row:
       the worker is drained (no new requests; the ones it holds finish), told its new
       role, and moved to the other pool once it reports that role.

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
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.planner.goodput_model import (
    LinearLatency,
    PhaseModels,
    RequestShape,
    SimulationConfig,
    fit_nonnegative,
    goodput_by_split,
    ttft_overhead_s,
)
from pdserve.planner.latency_profile import LatencyProfile, ProfileError
from pdserve.protocol.worker import StepSample
from pdserve.router.config import ControllerConfig

if TYPE_CHECKING:
    from pdserve.router.dispatch import Dispatcher

logger = logging.getLogger(__name__)

MIN_REQUESTS = 16


@dataclass(frozen=True)
class Estimate:
    """One tick's view: the fitted models and the goodput of each split."""

    models: PhaseModels
    goodput: dict[int, float]  # number of prefill workers -> req/s
    current_prefill: int
    num_workers: int
    simulation: SimulationConfig

    @property
    def best_prefill(self) -> int:
        """The split with the most goodput; ties go to the one nearest the current split."""
        return max(self.goodput,
                   key=lambda p: (self.goodput[p], -abs(p - self.current_prefill)))


def wanted_prefill(estimate: Estimate, min_gain: float) -> int | None:
    """The number of prefill workers to move towards, or None to stay."""
    best = estimate.best_prefill
    if best == estimate.current_prefill:
        return None
    current = estimate.goodput.get(estimate.current_prefill, 0.0)
    if estimate.goodput[best] < min_gain * current or estimate.goodput[best] <= 0:
        return None
    return best


class GoodputController:
    def __init__(self, config: ControllerConfig, dispatcher: Dispatcher,
                 sim: SimulationConfig | None = None) -> None:
        self.config = config
        self.dispatcher = dispatcher
        self.sim = sim or SimulationConfig(config.ttft_slo_s, config.tpot_slo_s,
                                           config.attainment)
        # Finished requests: their lengths, and their TTFT at the router (None: not seen).
        self.requests: deque[tuple[RequestShape, float | None]] = deque(
            maxlen=config.window_requests)
        self.prefill_samples: deque[StepSample] = deque(maxlen=config.window_samples)
        self.decode_samples: deque[StepSample] = deque(maxlen=config.window_samples)
        self.estimate: Estimate | None = None
        self.profile = LatencyProfile.load(config.profile) if config.profile else None
        """The models to start from (raises ProfileError, a ValueError, on a bad file)."""
        self.state = "warming up"
        self.num_flips = 0
        self._streak: tuple[int | None, int] = (None, 0)  # (wanted split, ticks in a row)
        self._last_flip_s = -float("inf")
        self._task: asyncio.Task | None = None

    # ---- inputs -------------------------------------------------------------------------
    def record_request(self, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                       ttft_s: float | None = None) -> None:
        """A request finished at the router with these lengths (and this TTFT)."""
        if prompt_tokens > 0 and output_tokens > 0:
            self.requests.append((RequestShape(prompt_tokens, cached_tokens, output_tokens),
                                  ttft_s))

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
    async def evaluate(self) -> Estimate | None:
        """Fit and simulate. The inputs are copied here, on the event loop (request handlers
        append to the windows meanwhile); the CPU-bound part runs in a thread."""
        models = self.fit()
        pools = self.dispatcher.prefill, self.dispatcher.decode
        num_prefill, num_decode = (sum(1 for w in pool if w.is_ready) for pool in pools)
        if models is None or len(self.requests) < MIN_REQUESTS or num_prefill < 1 \
                or num_decode < 1:
            return None
        workload = [shape for shape, _ in self.requests]
        sim, num_workers = self._simulation_config(models), num_prefill + num_decode
        goodput = await asyncio.to_thread(goodput_by_split, workload, num_workers, models, sim)
        return Estimate(models, goodput, num_prefill, num_workers, sim)

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
                                       (shape, ttft) for shape, ttft in self.requests
                                       if ttft is not None]))

    async def tick(self) -> None:
        self.collect()
        estimate = await self.evaluate()
        self.estimate = estimate
        if estimate is None:
            self.state = "warming up"
            return
        wanted = wanted_prefill(estimate, self.config.min_gain)
        previous, streak = self._streak
        self._streak = (wanted, streak + 1 if wanted == previous else 1)
        self.state = "balanced" if wanted is None else f"wants {wanted} prefill"
        if (self.config.mode != "flip" or wanted is None
                or self._streak[1] < self.config.patience
                or time.monotonic() - self._last_flip_s < self.config.cooldown_s):
            return
        if not self._workers_alike():
            self.state = f"wants {wanted} prefill; not flipping: the workers' TP degrees differ"
            return
        to_role = "prefill" if wanted > estimate.current_prefill else "decode"
        self.state = f"flipping a worker to {to_role}"
        flipped = await self.dispatcher.flip_one(to_role, self.config.drain_timeout_s)
        self._last_flip_s = time.monotonic()
        self._streak = (None, 0)
        if flipped is not None:
            self.num_flips += 1
            self.state = f"flipped {flipped.worker_id} to {to_role}"

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
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.tick()
            except Exception:  # a bad tick must not end the controller
                logger.exception("goodput controller tick failed")

    # ---- outputs ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What /status shows."""
        out: dict[str, Any] = {
            "mode": self.config.mode, "state": self.state, "num_flips": self.num_flips,
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
