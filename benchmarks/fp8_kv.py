"""The FP8 KV cache against the model-dtype (bf16) cache: memory, bytes moved, decode time.

    python -m benchmarks.fp8_kv

Seeded random bf16 models are built in a temporary directory: a Llama (MHA with GQA) and a
DeepSeek-V3 (MLA latent cache). For each, with kv_cache_dtype auto (bf16) and fp8
(float8_e4m3fn, pdserve/serve/layers/fp8.py), in one process on the same cores:

    KV bytes per token   the pool's bytes per block / block size, summed over layers
    hand-off bytes       what a prefill worker's KV transfer saves per request (its
                         saved_bytes metric: a prompt of --prompt-len tokens, every block)
    decode step          median time of a batch-8 decode step over --prompt-len-token
                         contexts, through the ModelRunner (the engine's step interface)

On CPU the C++ decode kernel reads FP8 rows and upcasts them as it reads bf16 ones; the
cache writes take the plain-torch path. On a GPU the Triton kernels read FP8 directly.

FP8 weights on CPU (pdserve/serve/layers/fp8.py), one [--linear-size]^2 linear layer: dequantizing
per call
(what pdserve does: the weight stays FP8 in memory) against dequantizing once at load (a
dense fp32 weight, 4x the bytes), at 8 rows (a decode step) and 256 (a prefill chunk).

Prints tables, then the JSON as the last line, and writes it (and a bar plot beside it) to
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

MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "deepseek_v3": dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
                        kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32,
                        v_head_dim=32, intermediate_size=512, moe_intermediate_size=128),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="decode batch")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--handoff-requests", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--linear-size", type=int, default=2048)
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. the box's load)")
    parser.add_argument("--output", type=str, default=None,
                        help="the JSON file (default: fp8_kv.json in --output-dir)")
    add_output_dir(parser, "fp8_kv")


def measure(model_dir: Path, kv_cache_dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.handoff.connector import make_in_process_connector
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.protocol.tp import SeqChunk, StepInput
    from pdserve.serve.config import CacheConfig, ModelConfig
    from pdserve.serve.engine.engine import Engine
    from pdserve.serve.engine.roles import make_role
    from pdserve.serve.worker.kv_transfer import KVTransfer

    block_size = args.block_size
    per_seq = -(-(args.prompt_len + args.decode_steps + 1) // block_size)
    num_blocks = max(args.batch, args.handoff_requests) * per_seq + 8
    engine = Engine(ModelConfig(str(model_dir), dtype="bfloat16"),
                    CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False))
    try:
        runner, spec = engine.runner, engine.spec
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, spec.vocab_size, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(max(args.batch, args.handoff_requests))]

        # hand-off bytes: a prefill role saving through the KV transfer
        transfer = KVTransfer(runner, engine.block_manager,
                              make_in_process_connector(spec.kv_layout(block_size), num_blocks))
        engine.set_role(make_role("prefill", transfer))
        params = SamplingParams(temperature=0, max_tokens=2)
        for i in range(args.handoff_requests):
            engine.add_request(prompts[i], params, f"h{i}")
        while engine.has_unfinished_requests():
            engine.step()
        deadline = time.monotonic() + 30
        while transfer.num_in_flight and time.monotonic() < deadline:
            transfer.poll()
            time.sleep(0.01)
        handoff_bytes = transfer.totals()["saved_bytes"] / args.handoff_requests
        transfer.close()

        # decode step at batch `batch`, through the runner (fresh blocks from 0)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.batch)]
        runner.execute(StepInput([SeqChunk(f"s{i}", prompts[i], 0, tables[i], True)
                                  for i in range(args.batch)]))
        times = []
        for k in range(args.decode_steps):
            step = StepInput([SeqChunk(f"s{i}", [prompts[i][k]], args.prompt_len + k,
                                       tables[i], True) for i in range(args.batch)])
            start = time.perf_counter()
            runner.execute(step)
            times.append(time.perf_counter() - start)
        warm = times[2:] if len(times) > 4 else times
        return {
            "kv_cache_dtype": kv_cache_dtype,
            "pool_dtype": str(runner.kv_caches[0].dtype).removeprefix("torch."),
            "kv_bytes_per_token": runner.plan.bytes_per_block / block_size,
            "handoff_bytes_per_request": handoff_bytes,
            "decode_step_ms_p50": statistics.median(warm) * 1e3,
            "decode_step_ms_min": min(warm) * 1e3,
        }
    finally:
        engine.shutdown()


def measure_fp8_linear(size: int, rows: int, repeats: int = 10) -> dict[str, Any]:
    """One FP8 linear layer on CPU: per-call dequantization against a dense fp32 copy."""
    from pdserve.serve.layers.fp8 import block_quantize, fp8_linear

    gen = torch.Generator().manual_seed(rows)
    weight, grid = block_quantize(torch.randn(size, size, generator=gen) * 0.02)
    scale = grid.repeat_interleave(128, dim=0)[:size].contiguous()  # the loaders' per-row form
    dense = (weight.float() * scale.repeat_interleave(128, dim=1)[:, :size]).contiguous()
    x = torch.randn(rows, size, generator=gen)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    per_call_ms = timed(lambda: fp8_linear(x, weight, scale, None, 128))
    dense_ms = timed(lambda: torch.nn.functional.linear(x, dense))
    return {"rows": rows, "size": size,
            "fp8_weight_bytes": weight.nbytes + scale.nbytes, "dense_fp32_bytes": dense.nbytes,
            "dequantize_per_call_ms": per_call_ms, "dense_fp32_ms": dense_ms}


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    from pdserve.benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    metrics = [("kv_bytes_per_token", "KV bytes / token"),
               ("handoff_bytes_per_request", "hand-off bytes / request"),
               ("decode_step_ms_p50", "decode step (ms, batch 8)")]
    models = list(results)
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for j, dtype in enumerate(("auto", "fp8")):
            values = [next(r[key] for r in results[m] if r["kv_cache_dtype"] == dtype)
                      for m in models]
            ax.bar([i + 0.4 * j for i in range(len(models))], values, width=0.4,
                   label="bf16 cache" if dtype == "auto" else "fp8 cache")
        ax.set_xticks([i + 0.2 for i in range(len(models))], models)
        ax.set_title(title)
    axes[0].legend()
    save_figure(fig, plt, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from pdserve.serve.default_model import build_random_model

    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = build_random_model(Path(tmp) / name, name, seed=args.seed,
                                           dtype="bfloat16", **MODELS[name])
            results[name] = [measure(model_dir, dtype, args) for dtype in ("auto", "fp8")]
    print(f"{'model':>12} {'kv cache':>14} {'KV B/token':>11} {'hand-off B/req':>15} "
          f"{'decode ms p50':>14}")
    for name, rows in results.items():
        for r in rows:
            print(f"{name:>12} {r['pool_dtype']:>14} {r['kv_bytes_per_token']:>11.0f} "
                  f"{r['handoff_bytes_per_request']:>15.0f} {r['decode_step_ms_p50']:>14.2f}")
    linear = [measure_fp8_linear(args.linear_size, rows) for rows in (8, 256)]
    print(f"\n{'rows':>5} {'FP8 weight MiB':>15} {'fp32 MiB':>9} {'dequant/call ms':>16} "
          f"{'dense fp32 ms':>14}")
    for r in linear:
        print(f"{r['rows']:>5} {r['fp8_weight_bytes'] / 2**20:>15.2f} "
              f"{r['dense_fp32_bytes'] / 2**20:>9.2f} {r['dequantize_per_call_ms']:>16.2f} "
              f"{r['dense_fp32_ms']:>14.2f}")
    ratios = {name: {key: rows[1][key] / rows[0][key]
                     for key in ("kv_bytes_per_token", "handoff_bytes_per_request",
                                 "decode_step_ms_p50")}
              for name, rows in results.items()}
    report = {
        "benchmark": "fp8_kv", "models": {m: MODELS[m] for m in args.models},
        "model_dtype": "bfloat16", "prompt_len": args.prompt_len, "batch": args.batch,
        "decode_steps": args.decode_steps, "block_size": args.block_size,
        "attention_backend": os.environ.get("PDSERVE_ATTENTION_BACKEND", "default"),
        "torch_threads": torch.get_num_threads(),
        "note": args.note, "load_average_1_5_15": list(os.getloadavg()),
        "results": results, "fp8_over_bf16": ratios, "fp8_weights_cpu_linear": linear,
    }
    print(json.dumps(report))
    out = save_json(report, output_path(args, "fp8_kv", "fp8_kv.json", args.output))
    plot(results, out.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
