"""What a grammar mask costs a decode step: offline engine TPOT with and without a JSON schema.

    python -m benchmarks.structured_cost [--model DIR] [--batch-sizes 1 8]

Each point runs `batch` fresh prompts (random tokens from a new seed, prefix caching off) to
their first token untimed, then times `--steps` decode steps and keeps the median; plain and
structured points alternate for `--rounds` rounds, so a box whose load drifts biases neither.
The structured requests carry a JSON schema whose one string must be exactly
`STRING_LENGTH` characters long, so no request can finish inside the timed steps; sampling is
seeded at temperature 1 for both. The mask is filled on a thread while the forward runs
(pdserve/serve/engine/structured.py), so what the step pays is the part of the fill the forward does
not hide, the bitmask's application to the logits, and accepting the sampled token. On a busy box
the TPOT difference drowns in noise, so the two parts are also timed directly, per structured
step: the fill on the thread (off the critical path) and the join plus the bitmask's
application (on it). Also measured: one fill of one row in isolation (inside the string, the
case with the most allowed tokens). Without --model it uses the embedded default model
(random weights, a 1,024-token vocabulary: a 128k-token vocabulary makes every fill dearer).
Prints a table, writes the JSON and a plot next to --output, and prints the JSON object last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.output import add_output_dir, output_path

STRING_LENGTH = 4000
SCHEMA = {"type": "object",
          "properties": {"note": {"type": "string", "minLength": STRING_LENGTH,
                                  "maxLength": STRING_LENGTH}},
          "required": ["note"], "additionalProperties": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local HF checkpoint (default: the embedded random Llama)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per point")
    parser.add_argument("--rounds", type=int, default=3,
                        help="plain/structured alternations per batch size")
    parser.add_argument("--output", default=None,
                        help="the JSON file (default: structured_outputs.json in --output-dir)")
    add_output_dir(parser, "structured_cost")


def measure(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.protocol.sampling import SamplingParams, StructuredOutputs
    from pdserve.serve import LLM

    generator = torch.Generator().manual_seed(1234)
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    max_batch = max(args.batch_sizes)
    context = args.prompt_len + args.steps + 64
    num_blocks = max_batch * (-(-context // 16)) + 64
    samples: dict[tuple[int, str], list[float]] = {}
    parts: dict[tuple[int, str], list[float]] = {}
    with LLM(str(model_dir), num_kv_blocks=num_blocks, max_num_seqs=max_batch,
             enable_prefix_caching=False) as llm:
        torch.set_num_threads(args.threads)
        engine = llm.engine
        vocab = engine.spec.vocab_size

        def fresh() -> list[int]:
            return torch.randint(10, vocab, (args.prompt_len,), generator=generator).tolist()

        def params(structured: bool, seed: int) -> SamplingParams:
            return SamplingParams(temperature=1.0, seed=seed, max_tokens=args.steps + 32,
                                  ignore_eos=True,
                                  structured_outputs=spec if structured else None)

        # warm-up: compile the grammar, start the mask thread, touch every code path
        llm.generate([fresh(), fresh()], [params(False, 0), params(True, 0)])
        for batch in args.batch_sizes:
            for round_index in range(args.rounds):
                for mode in ("plain", "json_schema"):
                    with _timed_mask_parts() as timed:
                        step_s = _decode_steps(engine, [fresh() for _ in range(batch)],
                                               [params(mode == "json_schema",
                                                       round_index * 100 + i)
                                                for i in range(batch)], args.steps)
                    samples.setdefault((batch, mode), []).extend(step_s)
                    for part, seconds in timed.items():
                        parts.setdefault((batch, part), []).extend(seconds)
                    print(f"batch {batch} {mode:>11} round {round_index}: "
                          f"{statistics.median(step_s) * 1e3:.2f} ms", flush=True)
        fill_us = _fill_us_per_row(engine, spec)
    rows = []
    for batch in args.batch_sizes:
        plain = statistics.median(samples[(batch, "plain")])
        shaped = statistics.median(samples[(batch, "json_schema")])
        rows.append({"batch": batch, "plain_tpot_ms": plain * 1e3,
                     "json_schema_tpot_ms": shaped * 1e3,
                     "overhead_ms": (shaped - plain) * 1e3,
                     "overhead_pct": 100 * (shaped - plain) / plain,
                     "fill_ms_per_step": _median_ms(parts.get((batch, "fill"))),
                     "join_apply_ms_per_step": _median_ms(parts.get((batch, "join_apply"))),
                     "num_steps": len(samples[(batch, "plain")])})
    return {"vocab_size": vocab, "fill_us_per_row": fill_us, "rows": rows}


def _median_ms(seconds: list[float] | None) -> float | None:
    return statistics.median(seconds) * 1e3 if seconds else None


@contextlib.contextmanager
def _timed_mask_parts() -> Iterator[dict[str, list[float]]]:
    """Time pdserve/serve/engine/structured.py's fill (on its thread) and StepMasks.apply (the join
    and the bitmask's application, on the step's path) while the block runs."""
    from pdserve.serve.engine import structured

    timed: dict[str, list[float]] = {"fill": [], "join_apply": []}
    fill, apply = structured._fill_rows, structured.StepMasks.apply

    def timed_fill(*args: Any) -> None:
        start = time.perf_counter()
        fill(*args)
        timed["fill"].append(time.perf_counter() - start)

    def timed_apply(self: Any, logits: torch.Tensor) -> None:
        start = time.perf_counter()
        apply(self, logits)
        timed["join_apply"].append(time.perf_counter() - start)

    structured._fill_rows, structured.StepMasks.apply = timed_fill, timed_apply
    try:
        yield timed
    finally:
        structured._fill_rows, structured.StepMasks.apply = fill, apply


def _decode_steps(engine: Any, prompts: list[list[int]], params: list[Any], steps: int
                  ) -> list[float]:
    """Seconds of each of `steps` decode steps of these requests (prefill untimed)."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if any(r.is_finished for r in requests):
        raise RuntimeError("a request finished inside the timed steps: raise max_tokens")
    for r in requests:
        engine.abort_request(r.request_id)
    return times


def _fill_us_per_row(engine: Any, spec: Any, repeats: int = 2000) -> float:
    """One row's fill, alone, inside the JSON string (after '{"note": "ab')."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(engine.structured.compile(spec))
    matcher.accept_string('{"note": "ab')
    bitmask = xgr.allocate_token_bitmask(1, engine.spec.vocab_size)
    start = time.perf_counter()
    for _ in range(repeats):
        matcher.fill_next_token_bitmask(bitmask, 0)
    return (time.perf_counter() - start) / repeats * 1e6


def print_table(result: dict[str, Any]) -> None:
    print(f"\nvocab {result['vocab_size']}, one row's fill {result['fill_us_per_row']:.1f} us"
          f" (on a thread, overlapped with the forward)")
    print(f"{'batch':>5} | {'plain ms':>9} {'schema ms':>9} | {'overhead ms':>11} {'%':>6} | "
          f"{'fill ms':>8} {'join+apply ms':>13}")
    for r in result["rows"]:
        print(f"{r['batch']:>5} | {r['plain_tpot_ms']:9.2f} {r['json_schema_tpot_ms']:9.2f} | "
              f"{r['overhead_ms']:11.2f} {r['overhead_pct']:6.1f} | "
              f"{r['fill_ms_per_step'] or 0:8.3f} {r['join_apply_ms_per_step'] or 0:13.3f}")


def plot(result: dict[str, Any], path: Path) -> Path:
    from pdserve.benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["rows"]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["plain_tpot_ms"] for r in rows], 0.4, label="free text")
    ax.bar([x + 0.2 for x in xs], [r["json_schema_tpot_ms"] for r in rows], 0.4,
           label="json_schema (masked)")
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("decode TPOT, median step (ms)")
    ax.set_title(f"grammar mask cost (vocab {result['vocab_size']})")
    ax.legend()
    return save_figure(fig, plt, path, dpi=120)


def run(args: argparse.Namespace) -> int:
    from pdserve.serve.default_model import default_model_dir

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_dir()
    result = {"model": str(model_dir), "threads": args.threads,
              "prompt_len": args.prompt_len, "steps": args.steps, "rounds": args.rounds,
              "schema": SCHEMA, **measure(model_dir, args)}
    print_table(result)
    output = output_path(args, "structured_cost", "structured_outputs.json", args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(plot(result, output.with_suffix(".png")))
    output.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
