"""Context-parallel prefill at equal cores: CP 1 against CP 2, prefill time against prompt length.

    python -m benchmarks.cp_prefill

A seeded random Llama is built in a temporary directory. Both configurations get the same
cores in all (`--cores`): CP 1 runs one rank with all of them, CP 2 two ranks with half each,
the prompt split zig-zag over them and attention run as ring attention
(pdserve/serve/executor/context_parallel.py). Each prompt length is one prefill step of one sequence
through the ModelRunner (the engine's step interface), fresh blocks, timed as the median over
--repeats after a warm-up; the configurations' runs alternate, so load on a shared box
drifts over both alike. The pool of each rank is sized to what CP 1 needs, so CP 2 also
shows the other half of the point: each of its ranks holds only half of the prompt's KV
(`max_blocks_per_rank`).

On CPU the CP 1 prefill runs the engine's torch path (SDPA's flash kernel), CP 2 runs the
plain-torch block attention of pdserve/kernels/ring_attention.py (scores materialised per block
pair) and passes K/V over gloo on loopback: what CP buys here is the split of the projections and
MLP and of the KV memory, not a faster attention kernel.

Prints a table, then the JSON as the last line, and writes it (and a plot beside it) to
--output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.benchmarks.plots import save_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=688)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="torch threads in all, shared equally by the ranks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. the box's load)")
    parser.add_argument("--plot", type=str, default=None,
                        help="write the plot here (default: --output with .png)")
    parser.add_argument("--output", type=str, default=None,
                        help="the JSON file (default: cp_prefill.json in --output-dir)")
    add_output_dir(parser, "cp_prefill")


def measure(model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every CP size's runner open at once, their runs interleaved (CP 1, CP 2, CP 1, ...)
    so that the box's load drifts over all of them alike."""
    import contextlib

    from pdserve.protocol.tp import SeqChunk, StepInput
    from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
    from pdserve.serve.executor.model_runner import ModelRunner

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    num_blocks = -(-max(args.prompt_lens) // args.block_size)  # CP 1's need, per rank
    gen = torch.Generator().manual_seed(args.seed)
    threads = {cp: max(1, args.cores // cp) for cp in args.cp_sizes}
    results = []
    with contextlib.ExitStack() as stack:
        runners = {cp: stack.enter_context(ModelRunner(
            ModelConfig(str(model_dir)),
            CacheConfig(block_size=args.block_size, num_blocks=num_blocks),
            ParallelConfig(context_parallel_size=cp, cpu_threads=threads[cp], device="cpu")))
            for cp in args.cp_sizes}
        for prompt_len in args.prompt_lens:
            prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
            table = list(range(-(-prompt_len // args.block_size)))
            step = StepInput([SeqChunk("p", prompt, 0, table, True)])
            seconds: dict[int, list[float]] = {cp: [] for cp in args.cp_sizes}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for cp, runner in runners.items():
                    torch.set_num_threads(threads[cp])  # rank 0 of each lives here
                    start = time.perf_counter()
                    runner.execute(step)
                    if repeat:
                        seconds[cp].append(time.perf_counter() - start)
            for cp in args.cp_sizes:
                step_s = statistics.median(seconds[cp])
                results.append({
                    "cp": cp, "threads_per_rank": threads[cp], "prompt_len": prompt_len,
                    "prefill_ms": step_s * 1e3, "prefill_tokens_per_s": prompt_len / step_s,
                    "prefill_ms_all": [x * 1e3 for x in seconds[cp]],
                    "max_blocks_per_rank": -(-len(table) // cp),
                })
                print(f"cp {cp} len {prompt_len}: {step_s * 1e3:.1f} ms", flush=True)
    return sorted(results, key=lambda r: (r["cp"], r["prompt_len"]))


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    from pdserve.benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for cp in sorted({r["cp"] for r in results}):
        rows = [r for r in results if r["cp"] == cp]
        lens = [r["prompt_len"] for r in rows]
        left.plot(lens, [r["prefill_ms"] for r in rows], marker="o", label=f"CP {cp}")
        right.plot(lens, [r["max_blocks_per_rank"] for r in rows], marker="o",
                   label=f"CP {cp}")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("prompt length (tokens)")
        axis.legend()
    left.set_yscale("log")
    left.set_ylabel("prefill time (ms, median)")
    right.set_ylabel("KV blocks held per rank")
    fig.suptitle("CP prefill at equal cores (busy shared 2-core CPU box: noisy)")
    return save_figure(fig, plt, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from pdserve.serve.default_model import build_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model(
            Path(tmp) / "model", "llama", seed=args.seed, hidden_size=args.hidden_size,
            num_hidden_layers=args.num_layers, intermediate_size=args.intermediate_size,
            num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
            max_position_embeddings=max(4096, max(args.prompt_lens)))
        results = measure(model_dir, args)
    print(f"{'CP':>3} {'thr/rank':>8} {'prompt':>7} {'prefill ms':>11} {'tok/s':>8} "
          f"{'blocks/rank':>11}")
    for r in results:
        print(f"{r['cp']:>3} {r['threads_per_rank']:>8} {r['prompt_len']:>7} "
              f"{r['prefill_ms']:>11.1f} {r['prefill_tokens_per_s']:>8.0f} "
              f"{r['max_blocks_per_rank']:>11}")
    report = {
        "benchmark": "cp_prefill",
        "model": {"architecture": "llama", "hidden_size": args.hidden_size,
                  "num_layers": args.num_layers, "intermediate_size": args.intermediate_size,
                  "num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads},
        "repeats": args.repeats, "cores": args.cores, "block_size": args.block_size,
        "attention": "CP 1: engine torch prefill (SDPA); CP > 1: ring of plain-torch block "
                     "attention over gloo (loopback)",
        "note": args.note, "load_average_1_5_15": list(os.getloadavg()), "results": results,
    }
    print(json.dumps(report))
    out = save_json(report, output_path(args, "cp_prefill", "cp_prefill.json", args.output))
    plot(results, Path(args.plot) if args.plot else out.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
