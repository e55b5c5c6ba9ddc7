"""The offline placement search (DistServe §4.2, Dynamo's planner): how to split N GPUs into
P prefill and D decode instances, each at a TP degree of the latency profile, for the most
goodput under the SLOs.

Every candidate is simulated by the controller's own simulation (goodput_model.simulate) with
the profile's models at the candidate's TP degrees, over one fixed workload and one fixed
sequence of Poisson arrivals (common random numbers), so candidates differ only by placement.

    candidates: P·tp_p + D·tp_d <= N GPUs, P >= 1, D >= 1, and fewer GPUs left idle than the
                profile's smallest TP degree (no instance could still be added)
    goodput:    estimate_goodput (the highest rate meeting the attainment target)
    ranked by:  goodput, then per-GPU goodput, then fewer GPUs
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

from pdserve.planner.goodput_model import (
    RequestShape,
    SimulationConfig,
    attainment,
    estimate_goodput,
    simulate,
)
from pdserve.planner.latency_profile import LatencyProfile


@dataclass(frozen=True)
class Placement:
    num_prefill: int
    num_decode: int
    prefill_tp: int
    decode_tp: int

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    def describe(self) -> str:
        return f"{self.num_prefill}P(TP{self.prefill_tp}) + {self.num_decode}D(TP{self.decode_tp})"


@dataclass(frozen=True)
class Candidate:
    placement: Placement
    goodput_rps: float

    @property
    def per_gpu_goodput_rps(self) -> float:
        return self.goodput_rps / self.placement.num_gpus

    def to_dict(self) -> dict[str, float | int]:
        return {
            **asdict(self.placement),
            "num_gpus": self.placement.num_gpus,
            "goodput_rps": round(self.goodput_rps, 4),
            "per_gpu_goodput_rps": round(self.per_gpu_goodput_rps, 4),
        }


def placements(profile: LatencyProfile, num_gpus: int) -> Iterator[Placement]:
    """Every split of at most num_gpus GPUs that leaves too few idle for another instance."""
    smallest = min(min(profile.prefill), min(profile.decode))
    for prefill_tp in sorted(profile.prefill):
        for decode_tp in sorted(profile.decode):
            for num_prefill in range(1, num_gpus // prefill_tp + 1):
                left = num_gpus - num_prefill * prefill_tp
                num_decode = left // decode_tp
                if num_decode < 1:
                    continue
                placement = Placement(num_prefill, num_decode, prefill_tp, decode_tp)
                if num_gpus - placement.num_gpus < smallest:
                    yield placement


def search(
    profile: LatencyProfile,
    num_gpus: int,
    workload: Sequence[RequestShape],
    config: SimulationConfig,
) -> list[Candidate]:
    """Every placement with its simulated goodput, best first. `config` holds the SLOs and
    the simulation's settings; the profile's batch limits and transfer rate go on top."""
    if num_gpus < 2:
        raise ValueError("a disaggregated placement needs at least 2 GPUs")
    if not workload:
        raise ValueError("the workload is empty")
    config = profile.simulation_config(config)
    candidates = [
        Candidate(
            p,
            estimate_goodput(
                workload,
                p.num_prefill,
                p.num_decode,
                profile.models(p.prefill_tp, p.decode_tp),
                config,
            ),
        )
        for p in placements(profile, num_gpus)
    ]
    if not candidates:
        raise ValueError(
            f"no placement fits {num_gpus} GPUs with prefill TP "
            f"{sorted(profile.prefill)} and decode TP {sorted(profile.decode)}"
        )
    return sorted(
        candidates, key=lambda c: (-c.goodput_rps, -c.per_gpu_goodput_rps, c.placement.num_gpus)
    )


def attainment_curve(
    profile: LatencyProfile,
    placement: Placement,
    workload: Sequence[RequestShape],
    config: SimulationConfig,
    rates: Sequence[float],
) -> list[tuple[float, float]]:
    """(rate, simulated SLO attainment) of one placement at each rate."""
    config = profile.simulation_config(config)
    models = profile.models(placement.prefill_tp, placement.decode_tp)
    return [
        (
            rate,
            attainment(
                simulate(
                    workload, rate, placement.num_prefill, placement.num_decode, models, config
                ),
                config,
            ),
        )
        for rate in rates
    ]


def kv_bandwidth_bytes_per_s(
    profile: LatencyProfile, rate: float, workload: Sequence[RequestShape]
) -> float:
    """The KV bytes per second that move from the prefill to the decode pool at `rate`:
    every prompt's KV (rate x mean prompt tokens x KV bytes per token)."""
    mean_prompt = sum(s.prompt_tokens for s in workload) / len(workload)
    return rate * mean_prompt * profile.kv_bytes_per_token
