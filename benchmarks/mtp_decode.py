"""Decode tokens/s with and without MTP speculative decoding (pdserve/serve/engine/spec_decode.py).

    python -m benchmarks.mtp_decode

A small DeepSeek-V3-shaped model (MLA latent cache, MoE with a shared expert, V3's routing)
is built with a high-acceptance MTP layer (spec_decode.add_mtp_layer(mirror=True): the MTP
module predicts what the main model will, so nearly every draft is kept; the main model's
attention output is zeroed for that, its cost is not). For each batch size and each setting
(no speculation, then k = 1, 2 drafts), after one warm-up run: the same greedy prompts,
output_len tokens each (ignore_eos), timed from the first sampled token to the last:

    decode tokens/s = batch * (output_len - 1) / (time from first to last token)

The best of --repeats is kept (the box is shared: the least disturbed run). Prints a table,
writes the JSON (and a bar plot beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.benchmarks.plots import save_json

MODEL_CONFIG: dict[str, object] = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32,
    qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=2,
    n_shared_experts=1, moe_intermediate_size=256, first_k_dense_replace=1, n_group=4,
    topk_group=2, max_position_embeddings=1024,
)


def measure(model_dir: Path, batch: int, k: int, prompt_len: int, output_len: int,
            repeats: int) -> dict[str, Any]:
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.serve import LLM

    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    best_s = float("inf")
    with LLM(model_dir, num_kv_blocks=256, block_size=16, speculative_config=spec) as llm:
        engine = llm.engine
        for run in range(repeats + 1):  # run 0 warms up
            for i in range(batch):
                prompt = [(7 * i + 3 * t + run) % 1000 + 3 for t in range(prompt_len)]
                engine.add_request(prompt, params, f"r{run}-{i}")
            engine.step()  # the prefill: every prompt's first token
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            if run > 0:
                best_s = min(best_s, time.perf_counter() - start)
        stats = engine.speculator.stats if engine.speculator is not None else None
    result: dict[str, Any] = {
        "batch": batch, "num_speculative_tokens": k, "decode_s": best_s,
        "decode_tokens_per_s": batch * (output_len - 1) / best_s,
    }
    if stats is not None:
        result.update(acceptance_rate=stats.acceptance_rate,
                      tokens_per_verify_step=1 + stats.num_accepted_tokens / stats.num_drafts,
                      accepted_per_pos=stats.accepted_per_pos)
    return result


def plot(results: list[dict[str, Any]], path: Path) -> None:
    from pdserve.benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    batches = sorted({r["batch"] for r in results})
    settings = sorted({r["num_speculative_tokens"] for r in results})
    width = 0.8 / len(settings)
    for n, k in enumerate(settings):
        values = [next(r["decode_tokens_per_s"] for r in results
                       if r["batch"] == b and r["num_speculative_tokens"] == k) for b in batches]
        ax.bar([i + n * width for i in range(len(batches))], values, width,
               label="no speculation" if k == 0 else f"MTP k={k}")
    ax.set_xticks([i + width * (len(settings) - 1) / 2 for i in range(len(batches))],
                  [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("MTP speculation, tiny DeepSeek-V3, ~100% acceptance (CPU)", fontsize=10)
    ax.legend()
    save_figure(fig, plt, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", type=str, default=None,
                        help="the JSON file (default: mtp_decode.json in --output-dir)")
    add_output_dir(parser, "mtp_decode")
    args = parser.parse_args(argv)

    import torch

    from pdserve.serve.default_model import build_random_model
    from pdserve.serve.engine.spec_decode import add_mtp_layer

    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model(Path(tmp) / "v3-mtp", "deepseek_v3", seed=0,
                                       **MODEL_CONFIG)
        add_mtp_layer(model_dir, mirror=True)
        for batch in args.batch_sizes:
            for k in [0, *args.num_speculative_tokens]:
                results.append(measure(model_dir, batch, k, args.prompt_len,
                                       args.output_len, args.repeats))
                print(f"batch {batch} k {k}: {results[-1]['decode_tokens_per_s']:.1f} tok/s",
                      flush=True)
    print(f"{'batch':>5} {'k':>3} {'decode tok/s':>13} {'speedup':>8} {'accept':>7} "
          f"{'tok/step':>8}")
    for r in results:
        base = next(b for b in results if b["batch"] == r["batch"]
                    and b["num_speculative_tokens"] == 0)
        r["speedup"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        print(f"{r['batch']:>5} {r['num_speculative_tokens']:>3} "
              f"{r['decode_tokens_per_s']:>13.1f} {r['speedup']:>8.2f} "
              f"{r.get('acceptance_rate', float('nan')):>7.3f} "
              f"{r.get('tokens_per_verify_step', 1.0):>8.2f}")
    report = {
        "benchmark": "mtp_decode",
        "model": {"architecture": "DeepseekV3ForCausalLM", **MODEL_CONFIG,
                  "mtp": "mirror (high acceptance): spec_decode.add_mtp_layer"},
        "prompt_len": args.prompt_len, "output_len": args.output_len,
        "repeats": args.repeats, "device": "cpu", "cpu_count": os.cpu_count(),
        "load_average_1m_at_end": os.getloadavg()[0],
        "note": "ran on a busy shared 2-core box (other jobs running): absolute numbers are "
                "noisy; the ratio within one run is the result",
        "results": results,
    }
    print(json.dumps(report))
    out = save_json(report, output_path(args, "mtp_decode", "mtp_decode.json", args.output))
    plot(results, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
