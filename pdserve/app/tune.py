"""`pdserve tune [--model DIR]`: prepare this machine for serving, in the foreground.

Builds pdserve's CPU kernels (once per machine; a worker's first start otherwise spends a minute
or more on it), then times every CPU path a worker could serve the model with (pdserve/serve/cpu/
tuning.py: the weights' packed layout, the fused decode loop, AMX) on the threads a worker
would use, prints the table and caches the choice where every worker on this machine reads it
back. Run it when an image is built or a machine is set up; `pdserve up` and the workers then
start without measuring.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


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


def run(args: argparse.Namespace) -> int:
    import torch

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
    threads = args.cpu_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    os.environ["PDSERVE_CPU_TUNING"] = "0"  # measured below, in the foreground
    from tqdm import tqdm

    from pdserve.serve import LLM

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
