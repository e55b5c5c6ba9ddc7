"""`pdserve profile`: measure a model's step times on this machine and write a latency profile
(pdserve/planner/latency_profile.py, docs/planner.md) for `pdserve plan` and the controller.

    pdserve profile [--model DIR] [--tp 1 2] [--output profile.json]

For each TP degree it starts the engine (no server) on an instance's share of the machine and
runs two sweeps, every prompt fresh (random tokens, prefix caching off):

    prefill  k prompts of L tokens in one step (k·L within the token budget), max_tokens 1
    decode   B prompts of C tokens, then `--decode-steps` steps of B sequences each
    (each point `--repeats` times; the decode sweep in whole passes, so a slow spell on a
    shared host hits one pass of a point rather than all of it)

then fits each phase's step model by non-negative least squares (the controller's fit) to
the median step of each sweep point, and writes the profile, a plot of measured against
fitted step times, and the samples (JSON). A step's time is, by default, the CPU time the
engine's process spent on it (`--clock cpu`, TP 1): on a host shared with other work, the
time an instance would take with its cores to itself; `--clock wall` times as the engine does.

On a CPU host a "GPU" is `--cores-per-gpu` cores (default 1): TP t runs on the first
t·cores-per-gpu cores this process may use, each rank with cores-per-gpu threads, as
`pdserve up` pins its workers. A TP degree needing more cores than there are is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.app import profile_served
from pdserve.app.profile_served import ServedWorkload
from pdserve.planner.goodput_model import LinearLatency, fit_nonnegative
from pdserve.planner.latency_profile import LatencyProfile, ProfileError

PREFILL_LENGTHS = (32, 64, 128, 256, 512, 1024, 2048)
PREFILL_BATCHES = (1, 2, 4)
DECODE_BATCHES = (1, 4, 16, 48)
DECODE_CONTEXTS = (128, 512, 1536)
MAX_DECODE_PROMPT_TOKENS = 16384
"""Skip decode points whose prompts add up to more (their prefill is the sweep's cost)."""


@dataclass(frozen=True)
class SweepConfig:
    prefill_lengths: tuple[int, ...] = PREFILL_LENGTHS
    prefill_batches: tuple[int, ...] = PREFILL_BATCHES
    decode_batches: tuple[int, ...] = DECODE_BATCHES
    decode_contexts: tuple[int, ...] = DECODE_CONTEXTS
    repeats: int = 3
    """Each point is measured this many times (fresh prompts each time; the decode sweep
    in whole passes), and the fit takes each point's median."""
    decode_steps: int = 8
    """Pure decode steps measured per decode point."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cores_per_gpu: int = 1
    clock: str = "cpu"
    """cpu: a step's time is the CPU time this process spent on it (TP 1 only; a core shared
    with other processes does not inflate it); wall: elapsed time, as the engine reports."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.decode_steps < 1 or self.cores_per_gpu < 1:
            raise ValueError("--repeats, --decode-steps and --cores-per-gpu must be >= 1")
        if self.clock not in ("cpu", "wall"):
            raise ValueError(f"--clock must be cpu or wall, got {self.clock!r}")
        if max(self.decode_batches) > self.max_num_seqs:
            raise ValueError("a decode batch exceeds --max-num-seqs")


@dataclass(frozen=True)
class Sample:
    phase: str  # "prefill" | "decode"
    point: tuple[int, int]  # the sweep point: prefill (prompts, length); decode (batch, context)
    features: tuple[int, int]  # prefill (tokens, Σ q·k); decode (context tokens, sequences)
    seconds: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SweepConfig()
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint directory (default: the "
        "embedded tiny random Llama that `pdserve up` serves)",
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[1], help="TP degrees to profile")
    parser.add_argument(
        "--output",
        default="profile.json",
        help="the profile JSON; the plot and the samples go beside it (.png, -samples.json)",
    )
    parser.add_argument(
        "--hardware",
        default=None,
        help="what the profile says it ran on (default: this CPU's name)",
    )
    parser.add_argument(
        "--cores-per-gpu",
        type=int,
        default=d.cores_per_gpu,
        help="CPU host: cores one TP rank gets (a 'GPU')",
    )
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=list(d.prefill_lengths))
    parser.add_argument(
        "--prefill-batches",
        type=int,
        nargs="+",
        default=list(d.prefill_batches),
        help="prompts per prefill step (kept when prompts x length fit the token budget)",
    )
    parser.add_argument("--decode-batches", type=int, nargs="+", default=list(d.decode_batches))
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=list(d.decode_contexts))
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--decode-steps", type=int, default=d.decode_steps)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument(
        "--kv-transfer-gb-per-s",
        type=float,
        default=None,
        help="record this transfer rate between the pools in the profile",
    )
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default=d.clock,
        help="time steps by this process's CPU time (TP 1; immune to other "
        "processes on the core) or by the wall clock",
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--disable-tqdm", action="store_true")
    served = parser.add_argument_group(
        "served calibration (pdserve/app/profile_served.py)",
        "after the engine sweep, serve the model at 1P1D with `pdserve up` (2 x TP x "
        "cores-per-gpu cores), drive it with `pdserve bench`, and scale the engine models "
        "by what serving adds; the hand-off and first-token overhead come from the router's "
        "controller. The engine-only profile is kept beside the output (-engine.json).")
    w = ServedWorkload()
    served.add_argument("--served", action="store_true", help="calibrate against the served "
                        "system")
    served.add_argument("--engine-profile", default=None,
                        help="with --served: calibrate this engine profile instead of sweeping")
    served.add_argument("--served-input-len", type=int, default=w.input_len)
    served.add_argument("--served-output-len", type=int, default=w.output_len)
    served.add_argument("--served-rates", type=float, nargs="+", default=list(w.rates),
                        help="Poisson request rates of the calibration load")
    served.add_argument("--served-num-prompts", type=int, default=w.num_prompts,
                        help="requests per rate, fresh prompts each")
    served.add_argument("--served-port", type=int, default=w.port,
                        help="the calibration router's port; the ten after it are taken too")


def prefill_points(config: SweepConfig, max_prompt_tokens: int) -> list[tuple[int, int]]:
    """(prompts per step, prompt length) of the prefill sweep, each within the token budget."""
    return [
        (k, length)
        for length in config.prefill_lengths
        if length <= max_prompt_tokens
        for k in config.prefill_batches
        if k * length <= config.max_num_batched_tokens
    ]


def decode_points(config: SweepConfig, max_prompt_tokens: int) -> list[tuple[int, int]]:
    """(sequences, context tokens) of the decode sweep."""
    return [
        (batch, context)
        for context in config.decode_contexts
        if context + config.decode_steps + 1 <= max_prompt_tokens
        for batch in config.decode_batches
        if batch * context <= MAX_DECODE_PROMPT_TOKENS
    ]


def instance_cores(tp: int, cores_per_gpu: int, cores: list[int]) -> list[int] | None:
    """The cores an instance of TP `tp` takes (the first tp·cores_per_gpu), or None when
    there are too few."""
    needed = tp * cores_per_gpu
    return cores[:needed] if needed <= len(cores) else None


def sweep(
    model_dir: str, tp: int, config: SweepConfig, progress: Any = None
) -> tuple[list[Sample], dict[str, Any]]:
    """Run both sweeps on an engine of TP `tp` (already pinned by the caller); returns the
    samples and what the model is (kv_bytes_per_token, name)."""
    import numpy as np

    from pdserve.kvstore.connector import block_nbytes
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from pdserve.serve.engine.engine import Engine

    engine = Engine(
        ModelConfig(model=model_dir, seed=config.seed),
        CacheConfig(enable_prefix_caching=False),
        ParallelConfig(tensor_parallel_size=tp, device="cpu", cpu_threads=config.cores_per_gpu),
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens
        ),
    )
    rng = np.random.default_rng(config.seed)
    spec = engine.spec
    samples: list[Sample] = []

    # The CPU clock counts only the time this process computed: another process sharing the
    # core does not stretch it. It sees one process, so TP > 1 (ranks in processes of their
    # own) keeps the wall clock.
    clock = "cpu" if config.clock == "cpu" and tp == 1 else "wall"

    def run(num_prompts: int, length: int, max_tokens: int) -> list[Any]:
        """Fresh prompts to completion; the step samples of this run."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        last = engine.step_samples[-1].seq if engine.step_samples else 0
        for _ in range(num_prompts):
            engine.add_request(rng.integers(0, spec.vocab_size, length).tolist(), params)
        steps = []
        while engine.has_unfinished_requests():
            cpu_start_s = time.process_time()
            engine.step()
            if engine.step_samples and engine.step_samples[-1].seq > last:
                step = last_step = engine.step_samples[-1]
                last = step.seq
                if clock == "cpu":
                    step = dataclasses.replace(last_step, seconds=time.process_time() - cpu_start_s)
                steps.append(step)
        return steps

    try:
        max_prompt = spec.max_model_len - config.decode_steps - 2
        if progress is not None:  # the model's length limit may drop points
            progress.total = config.repeats * (
                len(prefill_points(config, max_prompt)) + len(decode_points(config, max_prompt))
            )
            progress.refresh()
        run(2, min(64, max_prompt), 4)  # warm-up: first-call costs stay out of the fit
        for k, length in prefill_points(config, max_prompt):
            for _ in range(config.repeats):
                samples += [
                    Sample(
                        "prefill",
                        (k, length),
                        (s.num_prefill_tokens, s.num_prefill_query_keys),
                        s.seconds,
                    )
                    for s in run(k, length, 1)
                    if s.num_decode_seqs == 0 and s.num_prefill_tokens > 0
                ]
                if progress is not None:
                    progress.update(1)
        for _ in range(config.repeats):  # a whole pass each time: a slow spell hits one
            for batch, context in decode_points(config, max_prompt):
                # max_tokens counts the first token (sampled by the prompt's last step)
                samples += [
                    Sample(
                        "decode",
                        (batch, context),
                        (s.num_decode_context_tokens, s.num_decode_seqs),
                        s.seconds,
                    )
                    for s in run(batch, context, config.decode_steps + 1)
                    if s.num_prefill_tokens == 0 and s.num_decode_seqs == batch
                ]
                if progress is not None:
                    progress.update(1)
        layout = spec.kv_layout(engine.runner.block_size)
        about = {
            "model": Path(model_dir).name,
            "max_model_len": spec.max_model_len,
            "clock": clock,
            "kv_bytes_per_token": block_nbytes(layout) // layout.block_size,
        }
    finally:
        engine.shutdown()
    return samples, about


def fit(samples: list[Sample], phase: str) -> LinearLatency:
    """The phase's step model, fitted to one (median features, median time) per sweep point:
    on a shared host a step slowed by another process is an outlier, and least squares
    would follow it (num_samples counts points, not steps)."""
    import numpy as np

    by_point: dict[tuple[int, int], list[Sample]] = {}
    for sample in samples:
        if sample.phase == phase:
            by_point.setdefault(sample.point, []).append(sample)
    features = [
        tuple(float(np.median([s.features[i] for s in group])) for i in range(2))
        for group in by_point.values()
    ]
    seconds = [float(np.median([s.seconds for s in group])) for group in by_point.values()]
    model = fit_nonnegative(features, seconds)
    if model is None:
        raise RuntimeError(
            f"too few {phase} sweep points ({len(by_point)}) to fit a step "
            "model: add prompt lengths, batches or contexts"
        )
    return model


def hardware_name(cores_per_gpu: int) -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {cores_per_gpu} core{'s' if cores_per_gpu > 1 else ''} per GPU"


def plot(samples_by_tp: dict[int, list[Sample]], profile: LatencyProfile, path: Path) -> Path:
    """Measured against fitted step time, one panel per phase, one colour per TP degree."""
    from pdserve.benchmarks import plots

    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, phase, models in (
        (axes[0], "prefill", profile.prefill),
        (axes[1], "decode", profile.decode),
    ):
        top = 0.0
        for tp, samples in samples_by_tp.items():
            mine = [s for s in samples if s.phase == phase]
            fitted = [1000 * models[tp](*s.features) for s in mine]  # every step
            measured = [1000 * s.seconds for s in mine]
            ax.scatter(
                fitted,
                measured,
                s=10,
                alpha=0.6,
                label=f"TP{tp} (mean error {100 * models[tp].rel_error:.0f}%)",
            )
            top = max([top, *fitted, *measured])
        ax.plot([0, top], [0, top], color="grey", linestyle="--", linewidth=1, label="y = x")
        ax.set_xlabel("fitted step time (ms)")
        ax.set_ylabel("measured step time (ms)")
        ax.set_title(f"{phase} steps: {profile.model}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return plots.save_figure(fig, plt, path)


def run(args: argparse.Namespace) -> int:
    from pdserve.serve.default_model import default_model_dir

    model_dir = args.model or str(default_model_dir())
    if not (Path(model_dir) / "config.json").is_file():
        print(
            f"pdserve profile: {model_dir} is not a checkpoint directory (no config.json)",
            file=sys.stderr,
        )
        return 2
    try:
        workload = ServedWorkload(
            input_len=args.served_input_len,
            output_len=args.served_output_len,
            rates=tuple(args.served_rates),
            num_prompts=args.served_num_prompts,
            port=args.served_port,
        )
    except ValueError as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    report: dict[str, Any] = {}
    if args.engine_profile:
        if not args.served:
            print("pdserve profile: --engine-profile needs --served", file=sys.stderr)
            return 2
        try:
            engine = LatencyProfile.load(args.engine_profile)
        except ProfileError as exc:
            print(f"pdserve profile: {exc}", file=sys.stderr)
            return 2
        engine_path = Path(args.engine_profile)
    else:
        swept = _sweep(args, model_dir, report)
        if isinstance(swept, int):
            return swept
        engine = swept
        engine_path = Path(args.output)
        if args.served:
            engine_path = engine_path.with_name(engine_path.stem + "-engine.json")
        engine.save(engine_path)
        report["engine_profile"] = str(engine_path)
    if args.served:
        code = _calibrate(args, model_dir, engine, engine_path, workload, report)
        if code:
            return code
    report["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    return 0


def _calibrate(args: argparse.Namespace, model_dir: str, engine: LatencyProfile,
               engine_path: Path, workload: ServedWorkload, report: dict[str, Any]) -> int:
    cores = len(os.sched_getaffinity(0))
    calibrations = []
    for tp in sorted(engine.prefill):
        if 2 * tp * args.cores_per_gpu > cores:
            print(f"pdserve profile: no served calibration for TP {tp}: 1P1D needs "
                  f"{2 * tp * args.cores_per_gpu} cores, this process may use {cores}",
                  file=sys.stderr)
            continue
        try:
            served = profile_served.measure(model_dir, tp, engine_path, workload,
                                            log_dir=Path(args.output).parent / "served-logs",
                                            progress=lambda m: print(m, file=sys.stderr))
            calibration = profile_served.calibrate(engine, served, tp, workload)
        except (RuntimeError, ProfileError, OSError) as exc:
            print(f"pdserve profile: served calibration failed: {exc}", file=sys.stderr)
            return 1
        calibrations.append(calibration)
        print(
            f"TP{tp} served: prefill x{calibration.prefill_factor:.2f}, decode "
            f"x{calibration.decode_factor:.2f}, hand-off {1e3 * calibration.handoff_s:.1f} ms, "
            f"first-token overhead {1e3 * calibration.ttft_overhead_s:.1f} ms"
        )
    if not calibrations:
        print("pdserve profile: no TP degree could be calibrated served", file=sys.stderr)
        return 2
    profile = profile_served.apply(engine, calibrations)
    report["profile"] = str(profile.save(args.output))
    report["served_calibration"] = [c.describe() for c in calibrations]
    return 0


def _sweep(args: argparse.Namespace, model_dir: str, report: dict[str, Any]
           ) -> LatencyProfile | int:
    """The engine sweeps at each TP degree and their fits; the samples and the plot are
    written beside args.output."""
    try:
        config = SweepConfig(
            prefill_lengths=tuple(args.prefill_lengths),
            prefill_batches=tuple(args.prefill_batches),
            decode_batches=tuple(args.decode_batches),
            decode_contexts=tuple(args.decode_contexts),
            repeats=args.repeats,
            decode_steps=args.decode_steps,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            cores_per_gpu=args.cores_per_gpu,
            clock=args.clock,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 2
    import torch
    from tqdm import tqdm

    cores = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    samples_by_tp: dict[int, list[Sample]] = {}
    about: dict[str, Any] = {}
    clocks: dict[str, str] = {}
    for tp in sorted(set(args.tp)):
        mine = instance_cores(tp, config.cores_per_gpu, cores)
        if mine is None:
            print(
                f"pdserve profile: skipping TP {tp}: it needs {tp * config.cores_per_gpu} "
                f"cores, this process may use {len(cores)} ({cores})",
                file=sys.stderr,
            )
            continue
        num_points = config.repeats * (
            len(prefill_points(config, 1 << 30)) + len(decode_points(config, 1 << 30))
        )
        progress = tqdm(
            total=num_points,
            desc=f"TP{tp} on cores {mine}",
            unit="point",
            disable=args.disable_tqdm,
        )
        # Pinned before the engine starts any thread; TP rank processes inherit the mask.
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(config.cores_per_gpu)
        try:
            samples_by_tp[tp], about = sweep(model_dir, tp, config, progress)
            clocks[str(tp)] = about["clock"]
        finally:
            progress.close()
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
    if not samples_by_tp:
        print("pdserve profile: no TP degree fits this machine", file=sys.stderr)
        return 2
    try:
        profile = LatencyProfile(
            model=about["model"],
            hardware=args.hardware or hardware_name(config.cores_per_gpu),
            kv_bytes_per_token=about["kv_bytes_per_token"],
            prefill={tp: fit(s, "prefill") for tp, s in samples_by_tp.items()},
            decode={tp: fit(s, "decode") for tp, s in samples_by_tp.items()},
            kv_transfer_bytes_per_s=(
                args.kv_transfer_gb_per_s * 1e9 if args.kv_transfer_gb_per_s else None
            ),
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            source=f"pdserve profile, {time.strftime('%Y-%m-%d')}",
            extra={
                "cores_per_gpu": config.cores_per_gpu,
                "clock_by_tp": clocks,
                "model_dir": str(Path(model_dir).resolve()),
            },
        )
    except RuntimeError as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 1
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    samples_path = output.with_name(output.stem + "-samples.json")
    samples_path.write_text(
        json.dumps(
            {
                str(tp): [[s.phase, *s.point, *s.features, s.seconds] for s in samples]
                for tp, samples in samples_by_tp.items()
            }
        )
    )
    figure = plot(samples_by_tp, profile, output.with_suffix(".png"))
    for tp in samples_by_tp:
        p, d = profile.prefill[tp], profile.decode[tp]
        print(
            f"TP{tp}: prefill {1e3 * p.intercept:.3f} ms + {1e6 * p.coefs[0]:.2f} us/token "
            f"+ {1e9 * p.coefs[1]:.3f} ns per q·k ({p.num_samples} points, "
            f"{100 * p.rel_error:.1f}% mean error); decode {1e3 * d.intercept:.3f} ms + "
            f"{1e9 * d.coefs[0]:.2f} ns/context token + {1e6 * d.coefs[1]:.1f} us/sequence "
            f"({d.num_samples} points, {100 * d.rel_error:.1f}% mean error)"
        )
    report.update(profile=str(output), plot=str(figure), samples=str(samples_path))
    return profile
