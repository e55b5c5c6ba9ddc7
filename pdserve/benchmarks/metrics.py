"""Per-request latency metrics, their aggregation, SLO attainment, goodput, and the rate sweep.

Definitions (vLLM's `bench serve`, so the two agree):
- TPOT of a request = (E2EL - TTFT) / (output_tokens - 1): decode time per token, the first
  token excluded. Requests with one output token have no TPOT: they are left out of the TPOT
  statistics and count as meeting a TPOT SLO.
- A request attains its SLO when it succeeded and meets every given bound (TTFT, TPOT, E2EL).
- request_goodput = requests attaining the SLO / run duration (req/s).
- SLO attainment = attaining requests / all requests sent (failures are misses).
- Goodput rate (DistServe) = the highest offered request rate whose attainment is >= 90%.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.benchmarks.client import RequestOutcome

SLO_NAMES = ("ttft", "tpot", "e2el")
DEFAULT_TARGET_ATTAINMENT = 0.9


@dataclass(frozen=True)
class SLOConfig:
    """Latency objectives in milliseconds; None = no bound on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in SLO_NAMES:
            value = getattr(self, f"{name}_ms")
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be a positive number of ms, got {value}")

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f"{name}_ms") is None for name in SLO_NAMES)

    def as_dict(self) -> dict[str, float]:
        """{"ttft": ms, ...} for the bounds that are set (vLLM's goodput dict form)."""
        return {name: getattr(self, f"{name}_ms") for name in SLO_NAMES
                if getattr(self, f"{name}_ms") is not None}


def parse_goodput(pairs: Sequence[str]) -> SLOConfig:
    """`["ttft:500", "tpot:50"]` -> SLOConfig; raises ValueError with a readable message."""
    bounds: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes KEY:MS pairs with KEY in {'/'.join(SLO_NAMES)}, "
                             f"got {pair!r}")
        try:
            bounds[f"{name}_ms"] = float(value)
        except ValueError as e:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of ms") from e
    return SLOConfig(**bounds)


def request_tpot_s(outcome: RequestOutcome, output_tokens: int) -> float | None:
    """Seconds per output token after the first, or None with fewer than two tokens."""
    if not outcome.success or output_tokens < 2:
        return None
    return (outcome.latency_s - outcome.ttft_s) / (output_tokens - 1)


def meets_slo(outcome: RequestOutcome, output_tokens: int, slo: SLOConfig) -> bool:
    """Whether the request succeeded and met every bound of `slo`."""
    if not outcome.success:
        return False
    if slo.ttft_ms is not None and outcome.ttft_s * 1000.0 > slo.ttft_ms:
        return False
    tpot_s = request_tpot_s(outcome, output_tokens)
    if slo.tpot_ms is not None and tpot_s is not None and tpot_s * 1000.0 > slo.tpot_ms:
        return False
    return not (slo.e2el_ms is not None and outcome.latency_s * 1000.0 > slo.e2el_ms)


def output_token_counts(outcomes: Sequence[RequestOutcome],
                        count_text: Callable[[str], int | None]) -> list[int]:
    """Output tokens per request: server usage, else the tokenizer, else token chunks."""
    counts = []
    for outcome in outcomes:
        if not outcome.success:
            counts.append(0)
        elif outcome.output_tokens is not None:
            counts.append(outcome.output_tokens)
        else:
            counted = count_text(outcome.generated_text)
            counts.append(counted if counted is not None else outcome.num_token_chunks)
    return counts


def _stats_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]
              ) -> dict[str, float]:
    # vLLM reports 0 for a metric with no samples (np.mean(0)); keep that so fields exist.
    values_ms = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    stats = {f"mean_{name}_ms": float(values_ms.mean()),
             f"median_{name}_ms": float(np.median(values_ms)),
             f"std_{name}_ms": float(values_ms.std())}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        stats[f"p{word}_{name}_ms"] = float(np.percentile(values_ms, p))
    return stats


def error_counts(outcomes: Sequence[RequestOutcome]) -> dict[str, int]:
    """Failed requests per cause ("HTTP 429 rate_limit_error": 3, ...), most frequent first."""
    counts = Counter(o.error_cause or "unknown" for o in outcomes if not o.success)
    return dict(counts.most_common())


def summarize(outcomes: Sequence[RequestOutcome], output_tokens: Sequence[int],
              duration_s: float, slo: SLOConfig, percentiles: Sequence[float] = (99.0,)
              ) -> dict[str, Any]:
    """Aggregate one run into vLLM's result fields plus `slo_attainment`, `error_counts`."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [(o, n) for o, n in zip(outcomes, output_tokens, strict=True) if o.success]
    tpots_s = [t for o, n in done if (t := request_tpot_s(o, n)) is not None]
    num_good = sum(meets_slo(o, n, slo) for o, n in done)
    total_input = sum(o.prompt_len for o, _ in done)
    total_output = sum(n for _, n in done)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": num_good / duration_s if not slo.is_empty else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "slo_attainment": num_good / len(outcomes) if outcomes else 0.0,
    }
    result["error_counts"] = error_counts(outcomes)
    result.update(_stats_ms("ttft", [o.ttft_s for o, _ in done], percentiles))
    result.update(_stats_ms("tpot", tpots_s, percentiles))
    result.update(_stats_ms("itl", [g for o, _ in done for g in o.itl_s], percentiles))
    result.update(_stats_ms("e2el", [o.latency_s for o, _ in done], percentiles))
    return result


def goodput_rate(attainment_by_rate: Sequence[tuple[float, float]],
                 target: float = DEFAULT_TARGET_ATTAINMENT) -> float | None:
    """Highest rate meeting `target` attainment, below the first rate that misses it.

    Sorted by rate, the scan stops at the first miss: a lucky pass at a higher rate (noise on
    a busy box) is not goodput, since a server is expected to hold every load below it.
    None when even the lowest rate misses.
    """
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target attainment must be in (0, 1], got {target}")
    best = None
    for rate, attainment in sorted(attainment_by_rate):
        if attainment < target:
            break
        best = rate
    return best


def next_sweep_rate(attainment_by_rate: Sequence[tuple[float, float]],
                    target: float = DEFAULT_TARGET_ATTAINMENT) -> float | None:
    """The rate to try next to narrow the goodput rate down, or None when nothing brackets it.

    Bisects between the goodput rate and the lowest rate above it (which missed); above an
    infinite rate that missed, it doubles. None when even the lowest rate missed or no rate
    above the goodput rate was tried.
    """
    best = goodput_rate(attainment_by_rate, target)
    above = [rate for rate, _ in attainment_by_rate if best is not None and rate > best]
    if best is None or not above:
        return None
    high = min(above)
    return (best + high) / 2 if math.isfinite(high) else best * 2
