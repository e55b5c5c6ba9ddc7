"""`pdserve tune [--model DIR]`: prepare this machine for serving, in the foreground.

Builds pdserve's CPU kernels (once per machine: a minute or more), then times every CPU path a
worker could serve the model with (pdserve/serve/executor/cpu_tuning.py: the weights' packed
layout, the fused decode loop, AMX) and caches the choice where every worker on this machine
reads it back. Without it a worker serves at once anyway, on plain torch, while a child of it
does the same in the background (pdserve/serve/executor/cpu_preparation.py); with it, the
worker serves its cached choice from the first step. A choice is keyed by the cores and threads
it was timed on, so it measures each shape a worker will have: this process's own (all the cores
it may use: `LLM(...)`, a worker started by hand without pinning), and every one-rank worker's
placement that `pdserve up` makes here by default (each timed in a child pinned as `up` pins
that worker). It prints the table of each and the shapes it prepared. Run it when an image is
built or a machine is set up; `pdserve up` and the workers then start on the chosen path.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local Hugging Face checkpoint directory (default: the embedded "
                             "tiny random-weight Llama that `pdserve up` serves)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads to time with: a worker's (default: every core "
                             "this process may use)")
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="the largest decode batch timed (as the workers' flag)")
    parser.add_argument("--dtype", default="auto",
                        help="the model's compute dtype, as the workers' --dtype")
    parser.add_argument("--only-here", action="store_true",
                        help="time only this process's own cores and threads, not the "
                             "placements of `pdserve up`'s workers")


def run(args: argparse.Namespace) -> int:
    from pdserve.kernels import cpu_ops

    print("building pdserve's CPU kernels (once per machine)...", flush=True)
    start = time.monotonic()
    if cpu_ops.load() is None:
        print("pdserve tune: the CPU kernels could not be built here (see the log above): "
              "workers serve with the plain-torch paths, and there is nothing to choose",
              file=sys.stderr)
        return 1
    print(f"CPU kernels ready ({time.monotonic() - start:.1f} s): {cpu_ops.library_name()}",
          flush=True)
    model_dir = args.model
    if model_dir is None:
        from pdserve.serve.default_model import default_model_dir

        model_dir = str(default_model_dir())
    elif not os.path.isfile(os.path.join(model_dir, "config.json")):
        print(f"pdserve tune: {model_dir} is not a checkpoint directory (no config.json)",
              file=sys.stderr)
        return 2
    here = (len(os.sched_getaffinity(0)), args.cpu_threads or len(os.sched_getaffinity(0)))
    code = tune_here(model_dir, args, here[1])
    if code or args.only_here:
        return code
    prepared = [f"{here[0]} cores x {here[1]} threads (this process: LLM(...), an unpinned "
                "worker)"]
    # a choice is keyed by the number of cores and threads (tuning.machine_facts), not by which
    shapes: dict[tuple[int, int], tuple[tuple[int, ...], list[str]]] = {}
    for (cores, threads), names in up_shapes(model_dir).items():
        shapes.setdefault((len(cores), threads), (cores, []))[1].extend(names)
    for (_, threads), (cores, names) in shapes.items():
        if (len(cores), threads) != here:
            print(f"\n`pdserve up`'s {', '.join(names)}: cores {','.join(map(str, cores))}, "
                  f"{threads} threads", flush=True)
            child = subprocess.run(
                [sys.executable, "-m", "pdserve.app.cli", "tune", "--only-here", "--model",
                 model_dir, "--cpu-threads", str(threads), "--max-num-seqs",
                 str(args.max_num_seqs), "--dtype", args.dtype],
                preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores), check=False)
            if child.returncode:
                return child.returncode
        prepared.append(f"{len(cores)} core{'s' * (len(cores) > 1)} x {threads} thread"
                        f"{'s' * (threads > 1)} (pdserve up: {', '.join(names)})")
    print("\nprepared: " + "; ".join(prepared))
    return 0


def tune_here(model_dir: str, args: argparse.Namespace, threads: int) -> int:
    """Time every path on this process's cores with `threads` threads, print the table."""
    import torch
    from tqdm import tqdm

    from pdserve.serve import LLM

    torch.set_num_threads(threads)
    os.environ["PDSERVE_CPU_TUNING"] = "0"  # measured below, in the foreground
    with LLM(model_dir, device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs) as llm:
        torch.set_num_threads(threads)
        bar = tqdm(total=None, desc="timing CPU paths", unit="point", file=sys.stdout)

        def progress(done: int, total: int, what: str) -> None:
            bar.total = total
            bar.set_postfix_str(what, refresh=False)
            bar.update(done - bar.n)

        try:
            tuning = llm.engine.runner.tune_cpu_path(use_cache=False, progress=progress)
        except RuntimeError as exc:
            print(f"pdserve tune: {exc}", file=sys.stderr)
            return 2
        finally:
            bar.close()
    print_table(tuning)
    return 0


def up_shapes(model_dir: str, up_argv: list[str] | None = None
              ) -> dict[tuple[tuple[int, ...], int], list[str]]:
    """The cores and threads each one-rank worker of `pdserve up [up_argv]` times its paths
    on here ((its own cores, threads) -> its names): a borrower of idle cores starts on its
    own and the lent ones but narrows itself to its own first. Workers of several ranks do
    not tune (one rank per process)."""
    from pdserve.app.cli import make_parser
    from pdserve.app.launcher.commands import worker_slots
    from pdserve.app.launcher.placement import place_workers

    _, parser = make_parser("up")
    args = parser.parse_args(["--model", model_dir, "--device", "cpu", *(up_argv or [])])
    slots = worker_slots(args)
    with tempfile.TemporaryDirectory() as run_dir:
        placement = place_workers(args, slots, [], Path(run_dir))
    shapes: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for slot, place in zip(slots, placement.workers, strict=True):
        if slot.num_ranks != 1:
            continue
        cores = set(place.cpus or os.sched_getaffinity(0))
        for flag, value in zip(place.argv, place.argv[1:], strict=False):
            if flag == "--borrow-idle-cores":
                cores -= {int(c) for c in value.split("@", 1)[0].split(",")}
        key = (tuple(sorted(cores)), place.cpu_threads or len(cores))
        shapes.setdefault(key, []).append(slot.name)
    return shapes


def print_table(tuning) -> None:
    if not tuning.seconds:
        print(f"one CPU path runs here: {tuning.chosen.label}")
        return
    points = list(next(iter(tuning.seconds.values())))
    width = max(len(label) for label in tuning.seconds) + 2
    print(f"\n{'path (step ms)':<{width}}" + "".join(f"{p:>16}" for p in points))
    for label, times in tuning.seconds.items():
        mark = "  <- chosen" if label == tuning.chosen.label else ""
        print(f"{label:<{width}}" + "".join(f"{times[p] * 1e3:16.3f}" for p in points) + mark)
    print(f"\n{tuning.summary()}")
