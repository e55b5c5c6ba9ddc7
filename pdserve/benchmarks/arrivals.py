"""When each request is sent: open-loop Poisson / gamma arrivals, or a trace's own timestamps.

Open-loop means the send times are fixed before the run and do not wait for responses, so a
slow server builds a queue instead of silently lowering the offered load (closed-loop clients
hide overload; DistServe and vLLM's `bench serve` both measure open-loop).

The offsets are the ones `vllm bench serve` (0.32) computes, draw for draw: gaps from the
legacy numpy RNG seeded with --seed (`np.random.seed`; after a dataset that draws from it,
e.g. prefix_repetition, they continue from its state), gamma with shape `burstiness` and
scale 1 / (rate * burstiness), one gap before every request including the first; their
running sum is then rescaled so the last request goes out at exactly num_requests / rate.
Burstiness 1 is a Poisson process, < 1 burstier, > 1 smoother, inf evenly spaced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArrivalConfig:
    """Open-loop arrival process of one run."""

    # Mean requests per second; math.inf sends every request at time 0.
    request_rate: float = math.inf
    # Gamma shape of the inter-arrival gaps: 1.0 = Poisson, < 1 bursty, > 1 smooth, inf even.
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0 (or inf), got {self.burstiness}")


def arrival_offsets_s(num_requests: int, config: ArrivalConfig,
                      rng: np.random.RandomState | None = None) -> np.ndarray:
    """Send times in seconds after the start, non-decreasing, as vLLM 0.32 draws them.

    `rng` continues a legacy RNG a dataset already drew from (default: fresh, seeded with
    config.seed) and is advanced. Returns [num_requests] float64.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if num_requests == 0:
        return np.zeros(0)
    if math.isinf(config.request_rate):
        return np.zeros(num_requests)
    if math.isinf(config.burstiness):
        gaps_s = np.full(num_requests, 1.0 / config.request_rate)
    else:
        rng = rng if rng is not None else np.random.RandomState(config.seed)
        scale_s = 1.0 / (config.request_rate * config.burstiness)
        gaps_s = rng.gamma(config.burstiness, scale_s, size=num_requests)
    # cumsum adds left to right, as vLLM's loop does, so the sums agree to the last bit.
    offsets_s = np.cumsum(gaps_s)
    if offsets_s[-1] != 0:
        offsets_s = offsets_s * ((num_requests / config.request_rate) / offsets_s[-1])
    return offsets_s


def trace_offsets_s(timestamps_ms: Sequence[float], time_scale: float = 1.0) -> np.ndarray:
    """A trace's arrival times, shifted to start at 0 and multiplied by `time_scale`.

    `time_scale` 0.1 replays ten times faster. Returns [len(timestamps_ms)] float64 seconds.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    stamps_ms = np.asarray(timestamps_ms, dtype=np.float64)
    if stamps_ms.size == 0:
        return stamps_ms
    if np.any(np.diff(stamps_ms) < 0):
        raise ValueError("trace timestamps must be non-decreasing")
    return (stamps_ms - stamps_ms[0]) * (time_scale / 1000.0)
