"""Goodput by search: the highest request rate at which the SLO attainment target is met.

DistServe's goodput is the largest rate a server sustains with at least `target` (90%) of its
requests meeting every SLO. A fixed sweep either wastes runs far from that rate or misses it
between two grid points; `RateSearch` brackets it instead: start at `min_rate`, double while
the target is met (or halve while it is missed, down to min_rate / 8), then bisect between the
highest passing and the lowest failing rate until the bracket is narrower than
`rel_tolerance` of its lower end, or a run / time budget ends.

One search is one sample of a noisy quantity (arrivals and prompts are random, the box is
shared), so `pdserve bench --goodput-search` repeats it with different seeds and reports the
median with the repeats' spread (min, max) as its confidence.

    search = RateSearch(SearchConfig(min_rate=0.5))
    while (rate := search.next_rate()) is not None:
        search.record(rate, attainment_of_a_run_at(rate))
    search.goodput_rate, search.failing_rate
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.benchmarks.metrics import DEFAULT_TARGET_ATTAINMENT, goodput_rate


@dataclass(frozen=True)
class SearchConfig:
    """Bounds of one goodput search (runs per repeat; the time bound covers all repeats)."""

    target_attainment: float = DEFAULT_TARGET_ATTAINMENT
    # First rate tried (req/s); when it misses, the search halves down to min_rate / 8.
    min_rate: float = 0.5
    # Doubling stops here: a server that meets the target at max_rate has goodput >= it.
    max_rate: float = 64.0
    # Stop bisecting once (failing - passing) <= rel_tolerance * passing.
    rel_tolerance: float = 0.1
    # Load runs one search may use (one run = --num-prompts requests at one rate).
    max_runs: int = 8
    # Independent searches, each with its own seeds; their spread is the confidence.
    num_repeats: int = 3
    # Wall-clock bound on all repeats on one server: no new run starts after it.
    max_time_s: float = 1800.0

    def __post_init__(self) -> None:
        if not 0.0 < self.target_attainment <= 1.0:
            raise ValueError(f"target attainment must be in (0, 1], got {self.target_attainment}")
        if not (0 < self.min_rate <= self.max_rate and math.isfinite(self.max_rate)):
            raise ValueError("need 0 < --search-min-rate <= --search-max-rate < inf")
        if not self.rel_tolerance > 0:
            raise ValueError("--search-tolerance must be > 0")
        if self.max_runs < 1 or self.num_repeats < 1 or not self.max_time_s > 0:
            raise ValueError(
                "--search-max-runs, --search-repeats and --search-max-time must be > 0"
            )


@dataclass
class RateSearch:
    """One bracketing search over rates; feed it each run's attainment with `record`."""

    config: SearchConfig
    points: list[tuple[float, float]] = field(default_factory=list)

    @property
    def goodput_rate(self) -> float | None:
        """Highest passing rate below the lowest failure so far; None if none passed."""
        return goodput_rate(self.points, self.config.target_attainment)

    @property
    def failing_rate(self) -> float | None:
        """Lowest rate tried above the goodput rate (it missed the target), if any."""
        best = self.goodput_rate
        above = [rate for rate, _ in self.points if best is None or rate > best]
        return min(above) if above else None

    @property
    def floor_rate(self) -> float:
        """The lowest rate a search tries after misses (below it: no goodput)."""
        return self.config.min_rate / 8.0

    @property
    def is_converged(self) -> bool:
        """The bracket is narrow enough, the floor rate missed, or max_rate passed."""
        best, failing = self.goodput_rate, self.failing_rate
        if not self.points:
            return False
        if best is None:
            return min(rate for rate, _ in self.points) / 2.0 < self.floor_rate
        if failing is None:
            return best >= self.config.max_rate
        return failing - best <= self.config.rel_tolerance * best

    def next_rate(self) -> float | None:
        """The rate to run next, or None when converged or out of runs."""
        if not self.points:
            return self.config.min_rate
        if self.is_converged or len(self.points) >= self.config.max_runs:
            return None
        best, failing = self.goodput_rate, self.failing_rate
        if best is None:  # every rate so far missed: go down
            return min(rate for rate, _ in self.points) / 2.0
        if failing is None:
            return min(2.0 * best, self.config.max_rate)
        return (best + failing) / 2.0

    def record(self, rate: float, attainment: float) -> None:
        if not 0.0 <= attainment <= 1.0:
            raise ValueError(f"attainment must be in [0, 1], got {attainment}")
        self.points.append((rate, attainment))


@dataclass(frozen=True)
class SearchSummary:
    """Goodput rate over repeated searches: the median and the spread of the repeats."""

    rates: tuple[float | None, ...]
    # (passing, failing) bracket each repeat ended with; failing None = never missed.
    brackets: tuple[tuple[float | None, float | None], ...]
    converged: tuple[bool, ...]

    @property
    def median_rate(self) -> float | None:
        """Median over repeats; a repeat where even the floor rate missed counts as 0."""
        if not self.rates or all(r is None for r in self.rates):
            return None
        return float(statistics.median(r or 0.0 for r in self.rates))

    @property
    def spread(self) -> tuple[float, float] | None:
        """(min, max) of the repeats' rates (a missed floor rate counts as 0)."""
        if self.median_rate is None:
            return None
        values = [r or 0.0 for r in self.rates]
        return min(values), max(values)

    def as_dict(self) -> dict[str, object]:
        spread = self.spread
        return {
            "goodput_rate": self.median_rate,
            "goodput_rate_min": None if spread is None else spread[0],
            "goodput_rate_max": None if spread is None else spread[1],
            "goodput_rate_stdev": statistics.stdev(r or 0.0 for r in self.rates)
            if len(self.rates) > 1 and self.median_rate is not None
            else None,
            "repeat_rates": list(self.rates),
            "repeat_brackets": [list(b) for b in self.brackets],
            "repeat_converged": list(self.converged),
        }


def summarize_searches(searches: Sequence[RateSearch]) -> SearchSummary:
    return SearchSummary(
        tuple(s.goodput_rate for s in searches),
        tuple((s.goodput_rate, s.failing_rate) for s in searches),
        tuple(s.is_converged for s in searches),
    )
