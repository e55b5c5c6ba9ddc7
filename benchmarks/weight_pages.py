"""A decode step with its weights on 4 KiB against 2 MiB pages, in one engine.

    python -m benchmarks.weight_pages [--model DIR] [--batch-sizes 1 8] \\
        [--contexts 256]

The loader moves the weights onto huge pages (pdserve/serve/cpu/huge_pages.py). This benchmark
copies the fused decode loop's large weights once more onto ordinary pages, then swaps the loop
between the two copies, round after round (interleaved, so a noisy minute on a shared host weighs on
both alike). Each round times `--steps` engine steps with one copy, then with the other; a
point keeps the median of its rounds' medians. Prompts are fresh random tokens. Without
--model it uses step_roofline's llama-mid-like random Llama. Prints a table, writes the JSON
and a plot next to --output, and prints the JSON object last.
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

COPIES = ("4 KiB pages", "2 MiB pages")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local HF checkpoint (default: the llama-mid-like random Llama)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per copy and round")
    parser.add_argument("--output", default=None,
                        help="the JSON file (default: weight_pages.json in --output-dir)")
    add_output_dir(parser, "weight_pages")


def measure(model_dir: Path, batch: int, context: int, args: argparse.Namespace
            ) -> dict[str, Any]:
    from pdserve.serve import LLM, SamplingParams
    from pdserve.serve.layers.fused_decode import FusedDecode

    loops: list[FusedDecode] = []
    call = FusedDecode.__call__

    def record(self: FusedDecode, *call_args: Any) -> Any:
        loops.append(self)
        return call(self, *call_args)

    steps_needed = 2 + args.rounds * 2 * (args.steps + 2)
    gen = torch.Generator().manual_seed(batch * 100003 + context)
    FusedDecode.__call__ = record  # type: ignore[method-assign]
    try:
        with LLM(str(model_dir), block_size=16, enable_prefix_caching=False,
                 num_kv_blocks=batch * ((context + steps_needed) // 16 + 2) + 16,
                 max_num_seqs=batch, max_model_len=context + steps_needed + 16) as llm:
            torch.set_num_threads(args.threads)
            engine, vocab = llm.engine, model_facts(model_dir)["vocab"]
            params = SamplingParams(temperature=0, max_tokens=steps_needed, ignore_eos=True)
            for _ in range(batch):
                engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(),
                                   params)
            prefill_added(engine)
            engine.step()
            if not loops:
                raise SystemExit("this model's decode steps do not take the fused loop "
                                 "(pdserve/serve/layers/fused_decode.py), whose weights this swaps")
            fused = loops[-1]
            huge = list(fused.weights)
            small = [w.clone() if w.numel() * w.element_size() >= 1 << 20 else w for w in huge]
            rounds: dict[str, list[float]] = {name: [] for name in COPIES}
            for i in range(args.rounds):
                for name, weights in zip(COPIES, (small, huge), strict=True):
                    fused.weights = weights
                    engine.step()  # the first step after a swap pays for the swap
                    engine.step()
                    times = []
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        engine.step()
                        times.append(time.perf_counter() - start)
                    rounds[name].append(statistics.median(times))
                print(f"  {batch} x {context}: round {i + 1}/{args.rounds}", flush=True)
            fused.weights = huge
    finally:
        FusedDecode.__call__ = call  # type: ignore[method-assign]
    small_s, huge_s = (statistics.median(rounds[name]) for name in COPIES)
    return {"batch": batch, "context": context, "small_pages_step_s": small_s,
            "huge_pages_step_s": huge_s, "change": huge_s / small_s - 1, "rounds_s": rounds}


def plot(result: dict[str, Any], path: Path) -> Path:
    from pdserve.benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    points = result["points"]
    xs = range(len(points))
    ax.bar([x - 0.2 for x in xs], [p["small_pages_step_s"] * 1e3 for p in points], 0.4,
           label="weights on 4 KiB pages", color="lightgrey")
    ax.bar([x + 0.2 for x in xs], [p["huge_pages_step_s"] * 1e3 for p in points], 0.4,
           label="weights on 2 MiB pages")
    ax.set_xticks(list(xs), [f"b{p['batch']} c{p['context']}" for p in points])
    ax.set_ylabel("decode step (ms, median of rounds)")
    ax.set_title("decode step by the weights' page size")
    ax.legend()
    return save_figure(fig, plt, path, dpi=120)


def run(args: argparse.Namespace) -> int:
    model_dir = Path(args.model) if args.model else mid_model_dir()
    points = [measure(model_dir, batch, context, args)
              for batch in args.batch_sizes for context in args.contexts]
    print(f"\n{'batch':>5} {'ctx':>5} | {'4 KiB ms':>8} {'2 MiB ms':>8} {'change':>7}")
    for p in points:
        print(f"{p['batch']:>5} {p['context']:>5} | {p['small_pages_step_s'] * 1e3:8.2f} "
              f"{p['huge_pages_step_s'] * 1e3:8.2f} {100 * p['change']:6.1f}%")
    result = {"model": str(model_dir), "threads": args.threads, "rounds": args.rounds,
              "points": points}
    output = output_path(args, "weight_pages", "weight_pages.json", args.output)
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
