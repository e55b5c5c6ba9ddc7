"""When each request is sent: open-loop Poisson / gamma arrivals, or a trace's own timestamps.

Open-loop means the send times are fixed before the run and do not wait for responses, so a
slow server builds a queue instead of silently lowering the offered load (closed-loop clients
hide overload; DistServe and vLLM's `bench serve` both measure open-loop).

Inter-arrival gaps follow a gamma distribution with shape `burstiness` and mean
`1 / request_rate`: shape 1 is a Poisson process (exponential gaps), shape < 1 is burstier,
shape > 1 more regular. This is the parameterisation vLLM's `--burstiness` uses.
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
    # Gamma shape of the inter-arrival gaps: 1.0 = Poisson, < 1 bursty, > 1 smooth.
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive finite number, got {self.burstiness}")


def arrival_offsets_s(num_requests: int, config: ArrivalConfig) -> np.ndarray:
    """Send times in seconds after the start, non-decreasing, first one at 0.

    Returns [num_requests] float64. Deterministic for a given config (seeded generator).
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if num_requests == 0:
        return np.zeros(0)
    if math.isinf(config.request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(config.seed)
    mean_gap_s = 1.0 / config.request_rate
    # Gamma(shape k, scale theta) has mean k * theta: theta = mean / k keeps the rate.
    gaps_s = rng.gamma(config.burstiness, mean_gap_s / config.burstiness, size=num_requests)
    # The first request goes out at once; the remaining n-1 gaps space out the rest.
    gaps_s[0] = 0.0
    return np.cumsum(gaps_s)


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
