"""The CPU path a worker serves with, chosen by measuring every candidate on the machine at hand.

Which product kernel is fastest depends on the machine, not on a rule: pdserve's panels stream
the weights past the cache, which pays where the weights do not fit in it and costs several
times over where a huge L3 holds them; the fused decode loop saves Python per layer, which
matters more on a fast core than a slow one. So on its first start a CPU worker times each
candidate path (pdserve/serve/layers/ops.py CpuPath: the weights' packed layout x the fused loop x
AMX) on its own model, threads and pinning, over a few steps it will serve:

    decode 1, 8 and 32 sequences of 256 tokens (capped by max_num_seqs and max_model_len)
    one prompt of 256 tokens

and takes the path whose worst point is closest to that point's best (the smallest largest
ratio): no point is much slower than it could be. Besides the paths as measured, it weighs each
packed layout split by rows (CpuPath.plain_rows): decode steps of at most T sequences on the
plain weights, the rest on the packed copy, whose times at each point are the two measured
paths' (a step runs exactly one of them); the plain weights are kept anyway, so a split costs no
memory (the choice itself: pdserve/serve/executor/cpu_path_choice.py). The choice and its times
are cached in a JSON file beside the kernel library, keyed by what decides them (CPU model and
flags, cores, cache sizes, torch version, the kernel library, the model's products and dtype); a
later start with the same key reads it back. An entry that does not parse, or whose key differs, is
measured again, never trusted.

A measurement taken while something else runs on the cores is wrong for good once cached (a
decode step 44x slower than its best was seen so). So the workers of one host measure one at a
time (a file lock beside the cache; the next reads what the first wrote), and a result is kept
only when a quick re-check agrees with it: the chosen path is timed again at every point, and so
is the fastest other path at each point; a time off by more than RECHECK_TOLERANCE either way
measures everything again, once; a second disagreement serves the choice but does not cache
it.

A worker does not wait for any of this: it serves at once on what is ready and has a child
process build the kernels and measure (pdserve/serve/executor/cpu_preparation.py); `pdserve
tune` does it all ahead.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import SchedulerConfig
from pdserve.serve.executor.cpu_path_choice import (
    Point,
    Tuning,
    candidate_paths,
    decide,
)
from pdserve.serve.layers import ops

if TYPE_CHECKING:
    from pdserve.serve.executor.rank import Rank

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
DECODE_BATCHES = (1, 8, 32)
CONTEXT_LEN = 256
PREFILL_LEN = 256
NUM_WARMUP = 2
NUM_TIMED = 5
RECHECK_TOLERANCE = 1.5
"""A re-timed point this many times slower or faster than measured: the measurement is void..."""
RECHECK_FLOOR_S = 1e-3
"""...unless the two differ by less than this (a tiny model's sub-millisecond steps jitter
more than that, and no choice between them matters)."""
LOCK_TIMEOUT_S = 900.0
"""Longest wait for another process's measurement on this host; past it, measure anyway."""


# ---- the cache -------------------------------------------------------------------------------


def machine_facts() -> dict[str, Any]:
    """What decides the fastest path besides the model: the CPU (model name and flags), the
    cores this process may use and its threads, the caches, torch and the kernel library."""
    cpuinfo = _cpuinfo()
    from pdserve.kernels import cpu_ops

    return {
        "cpu_model": cpuinfo.get("model name", "unknown"),
        "cpu_flags": " ".join(sorted(cpuinfo.get("flags", "").split())),
        "cores": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "caches": cache_sizes(),
        "torch": torch.__version__,
        "kernel_library": cpu_ops.library_name(),
    }


def _cpuinfo() -> dict[str, str]:
    facts: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return facts
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if not name.strip():
            break  # the first processor's block is enough
        facts.setdefault(name.strip(), value.strip())
    return facts


def cache_sizes() -> dict[str, str]:
    """{"L1d": "48K", "L2": "2048K", "L3": "491520K", ...} as the kernel reports cpu0's."""
    sizes = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        sizes[f"L{level}{suffix}"] = size
    return sizes


def model_facts(model: nn.Module) -> dict[str, Any]:
    """The model's products (their [out, in] shapes and dtypes, counted) and its layer count:
    what the paths are timed on."""
    from pdserve.serve.layers.parallel import ParallelLMHead, PrepackedLinear

    products: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, PrepackedLinear | ParallelLMHead):
            weight = module.weight
            key = f"{tuple(weight.shape)} {str(weight.dtype).removeprefix('torch.')}"
            products[key] = products.get(key, 0) + 1
    return {"products": dict(sorted(products.items())),
            "parameters": sum(p.numel() for p in model.parameters())}


def cache_key(facts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def cache_directory() -> Path:
    """Beside the kernel library: torch's extension cache (TORCH_EXTENSIONS_DIR)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("pdserve_cpu_tuning", verbose=False))


def key_facts(model: nn.Module, step_points: Sequence[Point],
              candidates: Sequence[ops.CpuPath],
              machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a choice is keyed by (`machine`: machine_facts() as taken earlier)."""
    return {**(machine or machine_facts()), **model_facts(model),
            "points": [p.label for p in step_points],
            "candidates": [p.label for p in candidates]}


def read_cached(path: Path, facts: dict[str, Any], candidates: Sequence[ops.CpuPath],
                step_points: Sequence[Point]) -> Tuning | None:
    """The tuning saved at `path` for exactly these facts, or None (missing, unreadable,
    another version or key, or a choice that is no longer a candidate)."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return from_entry(entry, facts, candidates, step_points, "cached", path)


def from_entry(entry: Any, facts: dict[str, Any], candidates: Sequence[ops.CpuPath],
               step_points: Sequence[Point], source: str, path: Path) -> Tuning | None:
    """The tuning a cache entry (write_cached's JSON) holds for exactly these facts, or None."""
    try:
        if entry["version"] != CACHE_VERSION or entry["facts"] != facts:
            return None
        labels = [p.label for p in candidates]
        saved = entry["seconds"]
        if set(saved) != set(labels):
            return None
        # in candidate order, as measured: ties go to the same path
        measured = {label: {str(point): float(s) for point, s in saved[label].items()}
                    for label in labels}
        tuning = decide(measured, candidates, step_points, source, path)
        return tuning if tuning.chosen.label == entry["chosen"] else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def cache_entry(facts: dict[str, Any], tuning: Tuning) -> dict[str, Any]:
    """What the cache keeps of a measured tuning (from_entry reads it back)."""
    measured = dict(list(tuning.seconds.items())[:tuning.num_measured])
    return {"version": CACHE_VERSION, "facts": facts, "chosen": tuning.chosen.label,
            "seconds": measured}


def write_cached(path: Path, facts: dict[str, Any], tuning: Tuning) -> None:
    """Write atomically (a reader never sees half a file); a failure only costs a re-measure."""
    entry = cache_entry(facts, tuning)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(entry, indent=1, sort_keys=True))
        scratch.replace(path)
    except OSError as exc:
        logger.warning("could not cache the cpu path choice at %s: %s", path, exc)


# ---- measuring -------------------------------------------------------------------------------


def points(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> list[Point]:
    context = min(CONTEXT_LEN, max_model_len)
    decode = [Point(n, context) for n in DECODE_BATCHES if n <= max(1, max_num_seqs)]
    return decode + [Point(0, min(PREFILL_LEN, max_model_len, max_num_batched_tokens))]


def point_step(point: Point, block_size: int, vocab_size: int) -> StepInput:
    """The step of a point, its blocks numbered from 0 in a scratch pool."""
    blocks_per_seq = -(-point.context_len // block_size)
    if point.num_seqs == 0:
        token_ids = [t % vocab_size for t in range(point.context_len)]
        return StepInput([SeqChunk("tune-prefill", token_ids, 0,
                                   list(range(blocks_per_seq)), True)])
    return StepInput([
        SeqChunk(f"tune-{i}", [(7 * i + 3) % vocab_size], point.context_len - 1,
                 list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True)
        for i in range(point.num_seqs)])


def time_step(run: Callable[[], object]) -> float:
    """The median of NUM_TIMED calls after NUM_WARMUP (seconds)."""
    for _ in range(NUM_WARMUP):
        run()
    samples = []
    for _ in range(NUM_TIMED):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def apply(model: nn.Module, chosen: ops.CpuPath) -> None:
    """Run `chosen` from now on: the ops chosen again, every weight packed again, the fused
    decode loop built again."""
    from pdserve.serve.layers.parallel import ParallelLMHead, PrepackedLinear

    ops.use_path(chosen)
    for module in model.modules():
        if isinstance(module, PrepackedLinear | ParallelLMHead):
            module.repack()
    rebuild = getattr(model, "rebuild_fused_decode", None)
    if rebuild is not None:
        rebuild()


Progress = Callable[[int, int, str], None]
"""(points timed so far, points in all, what was just timed)"""


def measure(model: nn.Module, paths: Sequence[ops.CpuPath], run_point: Callable[[Point], float],
            step_points: Sequence[Point], progress: Progress | None = None
            ) -> dict[str, dict[str, float]]:
    """Seconds per point for each path (the model left on the last path measured)."""
    seconds: dict[str, dict[str, float]] = {}
    total = len(paths) * len(step_points)
    for candidate in paths:
        apply(model, candidate)
        seconds[candidate.label] = {}
        for point in step_points:
            seconds[candidate.label][point.label] = run_point(point)
            if progress is not None:
                progress(sum(map(len, seconds.values())), total,
                         f"{candidate.label} {point.label}")
    return seconds


def tune(model: nn.Module, run_point: Callable[[Point], float], step_points: Sequence[Point],
         has_panels: bool, has_amx: bool, has_fused: bool, use_cache: bool = True,
         progress: Progress | None = None, cache_dir: Path | None = None) -> Tuning:
    """Choose the CPU path for `model` (cached, or measured and cached in `cache_dir`,
    default cache_directory()) and apply it."""
    cache_dir = cache_dir or cache_directory()
    tuning = known_choice(model, step_points, has_panels, has_amx, has_fused, use_cache,
                          cache_dir=cache_dir)
    if tuning is None:
        candidates = candidate_paths(has_panels, has_amx, has_fused)
        facts = key_facts(model, step_points, candidates)
        path = cache_dir / f"{cache_key(facts)}.json"
        with measuring_alone(cache_dir / "measure.lock"):
            # another worker of this host may have measured the same key while this one waited
            tuning = read_cached(path, facts, candidates, step_points) if use_cache else None
            if tuning is None:
                for attempt in (1, 2):
                    measured = measure(model, candidates, run_point, step_points, progress)
                    tuning = decide(measured, candidates, step_points, "measured", path)
                    off = recheck(model, tuning, run_point, step_points, candidates)
                    if not off:
                        write_cached(path, facts, tuning)
                        break
                    logger.warning("cpu path timings disagree with a re-check (%s): %s", off,
                                   "measuring again" if attempt == 1 else
                                   "serving the choice without caching it")
        tuning.facts = facts
    apply(model, tuning.chosen)
    return tuning


def known_choice(model: nn.Module, step_points: Sequence[Point], has_panels: bool,
                 has_amx: bool, has_fused: bool, use_cache: bool = True,
                 machine: dict[str, Any] | None = None, cache_dir: Path | None = None
                 ) -> Tuning | None:
    """The choice where it needs no timing (nothing to choose from, or cached), else None;
    not applied. `machine`: machine_facts() as taken earlier."""
    candidates = candidate_paths(has_panels, has_amx, has_fused)
    if len(candidates) <= 1:
        return Tuning(candidates[0] if candidates else ops.CpuPath("none", False, False),
                      source="default")
    facts = key_facts(model, step_points, candidates, machine)
    path = (cache_dir or cache_directory()) / f"{cache_key(facts)}.json"
    tuning = read_cached(path, facts, candidates, step_points) if use_cache else None
    if tuning is not None:
        tuning.facts = facts
    return tuning


@contextlib.contextmanager
def measuring_alone(lock_path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[bool]:
    """Hold the host's measuring lock (an flock, released when the process dies); yields
    False when it could not be had within timeout_s (then measure anyway: a stuck holder
    must not keep a worker from starting)."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a+")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield False
        return
    deadline = time.monotonic() + timeout_s
    held, said = False, False
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("another process has measured cpu paths for %.0f s: "
                                   "measuring beside it", timeout_s)
                    break
                if not said:
                    logger.info("another process on this host measures its cpu paths: "
                                "waiting for it")
                    said = True
                time.sleep(0.2)
        yield held
    finally:
        if held:
            fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def recheck(model: nn.Module, tuning: Tuning, run_point: Callable[[Point], float],
            step_points: Sequence[Point], candidates: Sequence[ops.CpuPath]) -> str:
    """Time again what the choice rests on: the chosen path at every point, and at each point
    the fastest other measured path there (a neighbour that slowed it made the chosen one
    look better than it is). "" when every time agrees with its measurement within
    RECHECK_TOLERANCE, else the ones that do not."""
    measured = tuning.seconds
    if tuning.chosen.label not in measured:
        return ""
    to_time: dict[str, list[Point]] = {tuning.chosen.label: list(step_points)}
    by_label = {p.label: p for p in candidates}
    for point in step_points:
        others = [label for label in by_label
                  if label != tuning.chosen.label and label in measured]
        if others:
            fastest = min(others, key=lambda label: measured[label][point.label])
            to_time.setdefault(fastest, []).append(point)
    off = []
    for label, at in to_time.items():
        apply(model, by_label.get(label, tuning.chosen))
        for point in at:
            again, before = run_point(point), measured[label][point.label]
            if max(again, before) > RECHECK_TOLERANCE * min(again, before) \
                    and abs(again - before) > RECHECK_FLOOR_S:
                off.append(f"{label} at {point.label}: {before * 1e3:.2f} then "
                           f"{again * 1e3:.2f} ms")
    return "; ".join(off)


def tune_rank(rank: Rank, scheduler_config: SchedulerConfig, use_cache: bool = True,
              progress: Progress | None = None, cache_dir: Path | None = None) -> Tuning:
    """Choose and apply the CPU path of a one-rank CPU worker, timing its own model's steps
    on a scratch pool (the served pool is untouched)."""
    step_points, run_point = rank_timer(rank, scheduler_config)
    return tune(rank.model, run_point, step_points, *abilities(rank.model), use_cache,
                progress, cache_dir)


def rank_timer(rank: Rank, scheduler_config: SchedulerConfig
               ) -> tuple[list[Point], Callable[[Point], float]]:
    """A one-rank CPU worker's points and what times its model at one of them."""
    step_points = points(scheduler_config.max_num_seqs, rank.spec.max_model_len,
                         scheduler_config.max_num_batched_tokens)
    steps = {p: point_step(p, rank.block_size, rank.spec.vocab_size) for p in step_points}

    @functools.cache
    def scratch_caches() -> list[torch.Tensor]:
        """The scratch pool (zeroed, as every pool is), made at the first point timed: a
        cached choice times nothing."""
        num_blocks = max(sum(len(c.block_table) for c in s.chunks) for s in steps.values())
        return rank.new_pool(num_blocks).kv_caches

    @torch.inference_mode()
    def run_point(point: Point) -> float:
        return time_step(lambda: rank.forward(steps[point], scratch_caches()))

    return step_points, run_point


def abilities(model: nn.Module) -> tuple[bool, bool, bool]:
    """(has_panels, has_amx, has_fused): what this machine's kernels and the model can take
    (the model is left on a path that has them all)."""
    from pdserve.kernels import cpu_linear

    kernels = ops.cpu_kernels() is not None
    has_panels = kernels and cpu_linear.panel_width() > 0
    # the fused loop (built on a path that has it) and AMX (only bf16 panels go to AMX: a
    # half-precision checkpoint's weights)
    apply(model, ops.CpuPath("panels" if has_panels else "onednn", True, False))
    has_fused = kernels and getattr(model, "fused_decode", lambda: None)() is not None
    first = next((m for m in model.modules() if hasattr(m, "repack")), None)
    has_amx = (has_panels and first is not None and cpu_linear.amx_min_rows() != float("inf")
               and cpu_linear.panel_dtype(first.weight) == torch.bfloat16)
    return has_panels, has_amx, has_fused
