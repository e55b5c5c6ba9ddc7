"""Pipeline parallelism at equal cores: PP 1 against PP 2, and the bubble against its bound.

    python -m benchmarks.pp_bubble

A seeded random Llama is built in a temporary directory. Every configuration gets the same
cores in all (`--cores`): PP 1 runs one rank with all of them, PP 2 two ranks with half each
(pdserve/serve/layers/pipeline.py). Each runs, through the ModelRunner (the engine's step
interface):

    prefill: one step of --num-seqs prompts of --prompt-len tokens (rerun over its blocks)
    decode:  --decode-steps steps of one token for each of the --num-seqs sequences

prefill tokens/s = num_seqs * prompt_len / step time; decode tokens/s = num_seqs / step
time, from the fastest of --repeats (the box is shared: the fastest is the least
disturbed). PP 1 also runs on one rank's share of the cores, which is what each stage gets.

For PP 2 with M micro-batches the measured bubble is rank 0's idle share of its steps (1 -
its stage's forward time / the step's wall time, PipelineTimes), beside GPipe's bound for
equal stages, (PP - 1) / (M + PP - 1). It includes the transfers (activations and logits,
gloo over loopback on CPU) and the stages' imbalance: stage 0 runs the embedding, the last
stage the norm and LM head, so a slower stage 0 idles less than the bound, a faster one more.

Prints a table, then the JSON as the last line, and writes it (and a plot beside it) to
--output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.benchmarks.plots import save_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--num-seqs", type=int, default=16,
                        help="sequences per step (micro-batches split them)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4],
                        help="M values for PP 2")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="torch threads in all, shared equally by the ranks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. the box's load)")
    parser.add_argument("--plot", type=str, default=None,
                        help="write the plot here (default: --output with .png)")
    parser.add_argument("--output", type=str, default=None,
                        help="the JSON file (default: pp_bubble.json in --output-dir)")
    add_output_dir(parser, "pp_bubble")


def _steps(num_seqs: int, prompt_len: int, decode_steps: int, block_size: int, vocab: int,
           seed: int) -> tuple[Any, list[Any], int]:
    """(the prefill step, the decode steps after it, blocks used)."""
    from pdserve.protocol.tp import SeqChunk, StepInput

    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-(prompt_len + decode_steps) // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
               for _ in range(num_seqs)]
    prefill = StepInput([SeqChunk(f"s{i}", prompts[i], 0, tables[i], True)
                         for i in range(num_seqs)])
    decodes = [StepInput([SeqChunk(f"s{i}", [prompts[i][k % prompt_len]], prompt_len + k,
                                   tables[i], True) for i in range(num_seqs)])
               for k in range(decode_steps)]
    return prefill, decodes, num_seqs * per_seq


def measure(model_dir: Path, pp: int, micro_batches: int | None, args: argparse.Namespace,
            threads: int | None = None) -> dict[str, Any]:
    from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
    from pdserve.serve.executor.model_runner import ModelRunner
    from pdserve.serve.layers.pipeline import PipelineTimes, bubble_fraction

    threads = threads or max(1, args.cores // pp)
    parallel = ParallelConfig(pipeline_parallel_size=pp, pipeline_micro_batches=micro_batches,
                              cpu_threads=threads, device="cpu")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prefill, decodes, num_blocks = _steps(args.num_seqs, args.prompt_len, args.decode_steps,
                                          args.block_size, vocab, args.seed)
    with ModelRunner(ModelConfig(str(model_dir)),
                     CacheConfig(block_size=args.block_size, num_blocks=num_blocks),
                     parallel) as runner:
        runner.execute(prefill)  # warm-up (and the context the decode steps read)
        for step in decodes[:2]:
            runner.execute(step)
        result: dict[str, Any] = {"pp": pp, "micro_batches": micro_batches or pp,
                                  "threads_per_rank": threads}
        for phase, steps, tokens in (("prefill", [prefill], args.num_seqs * args.prompt_len),
                                     ("decode", decodes, args.num_seqs)):
            before = dataclasses.replace(runner.pipeline_times)
            seconds = []
            for _ in range(args.repeats):
                for step in steps:
                    start = time.perf_counter()
                    runner.execute(step)
                    seconds.append(time.perf_counter() - start)
            step_s = min(seconds)
            result[f"{phase}_step_ms"] = step_s * 1e3
            result[f"{phase}_tokens_per_s"] = tokens / step_s
            if pp > 1:
                after = runner.pipeline_times
                times = PipelineTimes(after.num_steps - before.num_steps,
                                      after.busy_s - before.busy_s,
                                      after.step_s - before.step_s,
                                      after.num_micro_batches - before.num_micro_batches)
                result[f"{phase}_bubble_measured"] = times.bubble_fraction
                result[f"{phase}_micro_batches_per_step"] = (times.num_micro_batches
                                                             / max(1, times.num_steps))
                result["bubble_bound"] = bubble_fraction(pp, min(micro_batches or pp,
                                                                 args.num_seqs))
    return result


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """tokens/s of PP 2 against M beside PP 1's (all cores, and one rank's share), per phase;
    then the measured bubble beside its bound."""
    from pdserve.benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    pp1 = [r for r in results if r["pp"] == 1]
    pp2 = [r for r in results if r["pp"] > 1]
    ms = [r["micro_batches"] for r in pp2]
    for ax, phase in zip(axes[:2], ("prefill", "decode"), strict=True):
        ax.plot(ms, [r[f"{phase}_tokens_per_s"] for r in pp2], marker="o",
                label=f"PP 2, {pp2[0]['threads_per_rank']} thread(s) per rank")
        for r, style in zip(pp1, ("k--", "k:"), strict=False):
            ax.axhline(r[f"{phase}_tokens_per_s"], linestyle=style[1:], color="k",
                       label=f"PP 1, {r['threads_per_rank']} thread(s)")
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel(f"{phase} tokens/s")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.legend()
    right = axes[2]
    for phase, marker in (("prefill", "o"), ("decode", "s")):
        right.plot(ms, [r[f"{phase}_bubble_measured"] for r in pp2], marker=marker,
                   label=f"{phase}: measured (rank 0 idle)")
    right.plot(ms, [r["bubble_bound"] for r in pp2], "k--", label="(PP-1)/(M+PP-1)")
    right.set_xlabel("micro-batches M")
    right.set_ylabel("bubble fraction of a step")
    right.set_xscale("log", base=2)
    right.set_ylim(0, 1)
    right.legend()
    fig.suptitle("PP 2 vs PP 1 at equal cores (busy shared box: noisy)")
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
            num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads)
        results = [measure(model_dir, 1, None, args)]
        if args.cores > 1:  # PP 1 on one rank's share: what a core does without PP
            results.append(measure(model_dir, 1, None, args, threads=max(1, args.cores // 2)))
        results += [measure(model_dir, 2, m, args) for m in args.micro_batches]
    print(f"{'PP':>3} {'M':>3} {'thr/rank':>8} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'bubble pf':>9} {'bubble dec':>10} {'bound':>6}")
    for r in results:
        print(f"{r['pp']:>3} {r['micro_batches']:>3} {r['threads_per_rank']:>8} "
              f"{r['prefill_tokens_per_s']:>14.0f} {r['decode_tokens_per_s']:>13.0f} "
              f"{r.get('prefill_bubble_measured', 0):>9.2f} "
              f"{r.get('decode_bubble_measured', 0):>10.2f} {r.get('bubble_bound', 0):>6.2f}")
    report = {
        "benchmark": "pp_bubble",
        "model": {"architecture": "llama", "hidden_size": args.hidden_size,
                  "num_layers": args.num_layers, "intermediate_size": args.intermediate_size,
                  "num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads},
        "num_seqs": args.num_seqs, "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps, "repeats": args.repeats, "cores": args.cores,
        "note": args.note, "load_average_1_5_15": list(os.getloadavg()), "results": results,
    }
    print(json.dumps(report))
    out = save_json(report, output_path(args, "pp_bubble", "pp_bubble.json", args.output))
    plot(results, Path(args.plot) if args.plot else out.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
