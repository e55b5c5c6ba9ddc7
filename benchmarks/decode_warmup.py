"""Decode steps right after a prefill, one by one: how long a step takes to settle.

    python -m benchmarks.decode_warmup [--model DIR] [--batch 8] [--context 256]

A decode step reads every weight; on a host whose weights fit its last-level cache it reads
them from there, at the cache's speed. A prefill's activations (and its KV writes) push the
weights out, and the decode steps after it run slow until they are back. This benchmark
shows that transient: each round adds `--batch` fresh prompts of `--context` random tokens,
steps through their prefill untimed, then times `--steps` decode steps one by one. Per step
index it keeps the median over `--rounds` rounds; the steady step is the median of the last
third; "settled at" is the first step within 10% of it; "excess" is what the steps above
it cost in all, the price of one prefill on the decode steps after it. Without --model it
uses step_roofline's llama-mid-like random Llama. Prints a table, writes the JSON and a plot
next to --output, and prints the JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.offline import mid_model_dir, model_facts, prefill_added
from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.benchmarks.plots import save_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local HF checkpoint (default: the llama-mid-like random Llama)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=None,
                        help="the JSON file (default: decode_warmup.json in --output-dir)")
    add_output_dir(parser, "decode_warmup")


def measure(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Per round: the prefill's wall time and each decode step's after it."""
    from pdserve.serve import LLM, SamplingParams

    vocab = model_facts(model_dir)["vocab"]
    generator = torch.Generator().manual_seed(args.batch * 100003 + args.context)
    blocks_per_seq = -(-(args.context + args.steps + 8) // 16)
    prefills, curves = [], []
    with LLM(str(model_dir), block_size=16, enable_prefix_caching=False,
             num_kv_blocks=args.batch * blocks_per_seq + 16, max_num_seqs=args.batch,
             max_model_len=args.context + args.steps + 8,
             max_num_batched_tokens=max(2048, args.context)) as llm:
        llm.wait_for_cpu_path()  # time the CPU path a worker ends on, not its first one
        torch.set_num_threads(args.threads)
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
        for i in range(args.rounds):
            for _ in range(args.batch):
                engine.add_request(torch.randint(10, vocab, (args.context,),
                                                 generator=generator).tolist(), params)
            start = time.perf_counter()
            prefill_added(engine)
            prefills.append(time.perf_counter() - start)
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
            curves.append(times)
            print(f"  round {i + 1}/{args.rounds}: prefill {prefills[-1] * 1e3:.0f} ms, first "
                  f"step {times[0] * 1e3:.2f} ms, last {times[-1] * 1e3:.2f} ms", flush=True)
    return {"prefill_s": prefills, "rounds_step_s": curves}


def summarise(curves: list[list[float]]) -> dict[str, Any]:
    """Per step index the median over rounds; the steady step (median of the last third of
    those), the first index within 10% of it, and the time spent above it in all."""
    median = [statistics.median(curve[i] for curve in curves) for i in range(len(curves[0]))]
    steady = statistics.median(median[len(median) - max(1, len(median) // 3):])
    settled = next((i for i, t in enumerate(median) if t <= 1.1 * steady), len(median))
    return {"step_s": median, "steady_step_s": steady, "first_step_s": median[0],
            "settled_at_step": settled,
            "excess_s": sum(max(0.0, t - steady) for t in median)}


def plot(result: dict[str, Any], path: Path) -> Path:
    from pdserve.benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    steps = range(1, len(result["step_s"]) + 1)
    curves = result["rounds_step_s"]
    ax.fill_between(steps, [min(c[i] for c in curves) * 1e3 for i in range(len(steps))],
                    [max(c[i] for c in curves) * 1e3 for i in range(len(steps))],
                    color="lightgrey", label="range over rounds")
    ax.plot(steps, [t * 1e3 for t in result["step_s"]], marker=".", label="median")
    ax.axhline(result["steady_step_s"] * 1e3, color="grey", linestyle="--", label="steady")
    ax.set_xlabel("decode step after the prefill")
    ax.set_ylabel("step (ms)")
    ax.set_title(f"decode steps after a prefill (batch {result['batch']}, "
                 f"context {result['context']})")
    ax.legend()
    return save_figure(fig, plt, path, dpi=120)


def run(args: argparse.Namespace) -> int:
    if args.steps < 3 or args.rounds < 1 or args.batch < 1 or args.context < 1:
        raise SystemExit("decode_warmup: --steps >= 3, --rounds, --batch, --context >= 1")
    model_dir = Path(args.model) if args.model else mid_model_dir()
    measured = measure(model_dir, args)
    result = {"model": str(model_dir), "threads": args.threads, "batch": args.batch,
              "context": args.context, **summarise(measured["rounds_step_s"]), **measured}
    print(f"\nbatch {args.batch} x context {args.context}: prefill "
          f"{statistics.median(result['prefill_s']) * 1e3:.0f} ms; first decode step "
          f"{result['first_step_s'] * 1e3:.2f} ms, steady {result['steady_step_s'] * 1e3:.2f} "
          f"ms, within 10% from step {result['settled_at_step'] + 1}; "
          f"{result['excess_s'] * 1e3:.1f} ms above steady in all")
    output = output_path(args, "decode_warmup", "decode_warmup.json", args.output)
    result["plot"] = str(plot(result, output.with_suffix(".png")))
    save_json(result, output)
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
