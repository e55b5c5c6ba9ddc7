"""The choice among measured CPU paths (pdserve/serve/executor/cpu_tuning.py measures them): the
points a path is timed at, the path whose worst point is nearest that point's best, and the
splits of a packed layout by rows composed of two measured paths' times. Pure: no timing, no
files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.serve.layers import ops


@dataclass(frozen=True)
class Point:
    """One step shape timed for every path: `num_seqs` sequences of `context_len` tokens
    decoding one token each, or (num_seqs 0) one prompt of `context_len` tokens."""

    num_seqs: int
    context_len: int

    @property
    def label(self) -> str:
        if self.num_seqs == 0:
            return f"prefill {self.context_len}"
        return f"decode {self.num_seqs}x{self.context_len}"


@dataclass
class Tuning:
    """What a worker chose, from what (seconds per point per path label), and how."""

    chosen: ops.CpuPath
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per path label, seconds per point: the measured paths, then the splits composed of
    them."""
    source: str = "default"
    """"measured", "cached" (read back from cache_file) or "default" (nothing to choose)."""
    cache_file: str = ""
    paths: dict[str, ops.CpuPath] = field(default_factory=dict)
    """The path of each label in `seconds`."""
    num_measured: int = 0
    """The first this many labels of `seconds` were measured; the rest are splits of them."""
    facts: dict[str, object] = field(default_factory=dict)
    """What the choice is keyed by (pdserve/serve/executor/cpu_tuning.py key_facts); empty
    for a default."""

    def summary(self) -> str:
        """One line: the choice, why (its times against the runner-up's), and the source."""
        if not self.seconds:
            return f"cpu path {self.chosen.label} ({self.source})"
        mine = self.seconds[self.chosen.label]
        parts = [f"{point} {mine[point] * 1e3:.2f} ms" for point in mine]
        others = sorted((label for label in self.seconds if label != self.chosen.label),
                        key=lambda label: worst_ratio(self.seconds, label))
        runner_up = ""
        if others:
            ratio = worst_ratio(self.seconds, others[0])
            runner_up = f"; next best {others[0]} is up to {ratio:.2f}x its points' best"
        where = f" {self.cache_file}" if self.source == "cached" else ""
        return (f"cpu path {self.chosen.label}: {', '.join(parts)}{runner_up} "
                f"({self.source}{where})")

    def as_status(self) -> dict[str, str]:
        """What /status shows: the choice, its source and every path's times in ms."""
        status = {"path": self.chosen.label, "source": self.source}
        for label, times in self.seconds.items():
            status[label] = ", ".join(f"{p} {s * 1e3:.3f}" for p, s in times.items())
        return status


def worst_ratio(seconds: dict[str, dict[str, float]], label: str) -> float:
    """The path's largest ratio, over the points, of its time to the point's best time."""
    times = seconds[label]
    return max(t / min(other[point] for other in seconds.values()) for point, t in times.items())


def choose(seconds: dict[str, dict[str, float]]) -> str:
    """The label of the path whose worst point is nearest its best (ties: the first)."""
    if not seconds:
        raise ValueError("nothing was measured")
    points = set(next(iter(seconds.values())))
    if any(set(times) != points for times in seconds.values()):
        raise ValueError("every path must be timed at the same points")
    return min(seconds, key=lambda label: worst_ratio(seconds, label))


def split_paths(measured: dict[str, dict[str, float]], candidates: Sequence[ops.CpuPath],
                step_points: Sequence[Point]) -> dict[str, tuple[ops.CpuPath, dict[str, float]]]:
    """Every packed path split by rows at each decode point's batch: its times composed from
    the packed path's and the plain one's (same fused loop), as a step of either runs."""
    by_label = {p.label: p for p in candidates}
    splits = {}
    for packed in candidates:
        plain = ops.CpuPath("none", packed.fused_decode, False)
        if packed.prepack == "none" or plain.label not in measured:
            continue
        for rows in sorted({p.num_seqs for p in step_points if p.num_seqs})[:-1]:
            split = ops.CpuPath(packed.prepack, packed.fused_decode, packed.amx, rows)
            times = {point.label: measured[(plain if 0 < point.num_seqs <= rows
                                            else packed).label][point.label]
                     for point in step_points}
            splits[split.label] = (split, times)
    assert not set(splits) & set(by_label)
    return splits


def options(measured: dict[str, dict[str, float]], candidates: Sequence[ops.CpuPath],
            step_points: Sequence[Point]) -> dict[str, tuple[ops.CpuPath, dict[str, float]]]:
    """What the choice is among: every measured path, then every split of them (ties go to
    the measured, in candidate order)."""
    return {**{p.label: (p, measured[p.label]) for p in candidates},
            **split_paths(measured, candidates, step_points)}


def decide(measured: dict[str, dict[str, float]], candidates: Sequence[ops.CpuPath],
           step_points: Sequence[Point], source: str, cache_file: Path) -> Tuning:
    """The choice among the measured paths and their splits."""
    choices = options(measured, candidates, step_points)
    seconds = {label: times for label, (_, times) in choices.items()}
    return Tuning(choices[choose(seconds)][0], seconds, source, str(cache_file),
                  {label: path for label, (path, _) in choices.items()}, len(measured))


def candidate_paths(has_panels: bool, has_amx: bool, has_fused: bool) -> list[ops.CpuPath]:
    """Every path this machine and model can run that the environment's switches allow."""
    prepacks = (["panels"] if has_panels else []) + ["onednn", "none"]
    paths = [ops.CpuPath(prepack, fused, amx)
             for prepack in prepacks
             for fused in ((True, False) if has_fused else (False,))
             for amx in ((True, False) if has_amx and prepack == "panels" else (False,))]
    return [p for p in paths if p.allowed_by_environment()]
