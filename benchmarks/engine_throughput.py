"""Offline engine throughput: pdserve's LLM beside Hugging Face generate, same prompts.

    python -m benchmarks.engine_throughput --output engine_throughput.json

A seeded random Llama (~0.1B parameters by default) is built in a temporary directory. For
each batch size both systems get the same random prompts (fixed length, fixed seed), one
warm-up run, then `--repeats` timed runs of output_len greedy tokens each:

    prefill tokens/s = batch * prompt_len / (time to the first sampled token)
    decode tokens/s  = batch * (output_len - 1) / (time from first to last token)

pdserve is timed around its engine steps, HF by a logits processor used as a clock. Both
make exactly output_len tokens (pdserve: ignore_eos; HF: min_new_tokens). The best of the
repeats is kept per metric (the machine is shared: the minimum is the least disturbed).
Prints a table, then one JSON object as the last line, and writes it to --output.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.output import add_output_dir, output_path

# --architecture deepseek_v3: MLA and MoE at the same hidden size, with DeepSeek-V3's
# proportions scaled down (V3: hidden 7168, kv_lora_rank 512, q_lora_rank 1536, rope 64,
# nope 128, v 128, 256 experts of 2048, 8 per token, 1 shared).
DEEPSEEK_CONFIG: dict[str, object] = dict(
    kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64,
    v_head_dim=64, n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1,
    moe_intermediate_size=704, first_k_dense_replace=1, n_group=4, topk_group=2,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--architecture", choices=["llama", "mixtral", "deepseek_v3"],
                        default="llama",
                        help="llama (GQA), mixtral (GQA + 8 experts, 2 per token, each "
                             "intermediate_size / 4) or deepseek_v3 (MLA latent cache + MoE)")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                        help="pdserve's TP degree (HF runs in one process either way)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE: whole experts per TP rank, rows moved by all-to-all")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--intermediate-size", type=int, default=2816)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="measure pdserve only")
    parser.add_argument("--output", type=str, default=None,
                        help="the JSON file (default: engine_throughput.json in --output-dir)")
    add_output_dir(parser, "engine_throughput")


def _rates(batch: int, prompt_len: int, output_len: int,
           runs: list[tuple[float, float]]) -> dict[str, float]:
    """runs: (prefill_s, decode_s) per repeat; the best of each is kept."""
    prefill_s = min(r[0] for r in runs)
    decode_s = min(r[1] for r in runs)
    return {
        "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "decode_tokens_per_s": batch * (output_len - 1) / decode_s,
        "t_prefill_s": prefill_s,
        "t_decode_s": decode_s,
    }


def measure_pdserve(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace
                    ) -> dict[str, float]:
    """Step the engine: the first step prefills every prompt (the budget fits them all) and
    samples token 1; the remaining output_len - 1 steps are decodes."""
    from pdserve.serve import LLM, SamplingParams

    batch, total = len(prompts), args.prompt_len + args.output_len
    num_blocks = batch * (-(-total // args.block_size)) + 8
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(model_dir, block_size=args.block_size, num_kv_blocks=num_blocks,
             max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, batch * total),
             enable_prefix_caching=False, seed=args.seed,
             tensor_parallel_size=args.tensor_parallel_size,
             enable_expert_parallel=args.enable_expert_parallel) as llm:
        llm.wait_for_cpu_path()  # time the CPU path a worker ends on, not its first one
        engine = llm.engine
        # Time inside the model runner: the rest is scheduling, sampling, detokenization.
        runner, execute = engine.runner, engine.runner.execute
        runner_s = [0.0]

        def timed_execute(step: Any, *rest: Any) -> Any:
            start = time.perf_counter()
            try:
                return execute(step, *rest)
            finally:
                runner_s[0] += time.perf_counter() - start

        runner.execute = timed_execute

        def one_run() -> tuple[float, float]:
            for prompt in prompts:
                engine.add_request(prompt, params)
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            return t1 - t0, time.perf_counter() - t1

        one_run()  # warm-up
        runner_s[0] = 0.0
        start = time.perf_counter()
        runs = [one_run() for _ in range(args.repeats)]
        overhead_s = (time.perf_counter() - start - runner_s[0]) / args.repeats
        runner.execute = execute
    rates = _rates(batch, args.prompt_len, args.output_len, runs)
    rates["engine_overhead_s_per_run"] = overhead_s
    return rates


def measure_hf(model: Any, prompts: list[list[int]], args: argparse.Namespace
               ) -> dict[str, float]:
    """HF generate with a logits processor as a clock: its first call follows the prefill
    forward, its last the output_len-th forward."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def one_run() -> tuple[float, float]:
        clock = Clock()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                           logits_processor=LogitsProcessorList([clock]))
        return clock.stamps[0] - t0, clock.stamps[-1] - clock.stamps[0]

    one_run()  # warm-up
    runs = [one_run() for _ in range(args.repeats)]
    return _rates(len(prompts), args.prompt_len, args.output_len, runs)


def run(args: argparse.Namespace) -> int:
    from pdserve.serve.default_model import build_random_model

    torch.manual_seed(args.seed)
    results: dict[str, Any] = {
        "benchmark": "engine_throughput",
        "config": {k: v for k, v in vars(args).items() if k != "output"},
        "torch_threads": torch.get_num_threads(),
        "device": "cpu",
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        config: dict[str, object] = dict(
            hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
            num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
            num_key_value_heads=args.num_kv_heads, initializer_range=0.02)
        if args.architecture == "deepseek_v3":  # HF's MLA wants as many K/V heads as Q heads
            config.update(DEEPSEEK_CONFIG, num_key_value_heads=args.num_heads)
        elif args.architecture == "mixtral":
            config.update(num_local_experts=8, num_experts_per_tok=2,
                          intermediate_size=args.intermediate_size // 4)
        model_dir = build_random_model(tmp, args.architecture, seed=args.seed, **config)
        hf_model = None
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                            dtype=torch.float32).eval()
            results["num_params"] = sum(p.numel() for p in hf_model.parameters())
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(args.seed)
        for batch in args.batch_sizes:
            prompts = torch.randint(0, vocab_size, (batch, args.prompt_len),
                                    generator=gen).tolist()
            row: dict[str, Any] = {"batch": batch, "pdserve": measure_pdserve(model_dir,
                                                                             prompts, args)}
            if hf_model is not None:
                row["hf"] = measure_hf(hf_model, prompts, args)
            results["results"].append(row)
            print(_format_row(row), flush=True)
    print(_table(results))
    text = json.dumps(results)
    output = output_path(args, "engine_throughput", "engine_throughput.json", args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text + "\n")
    print(text)
    return 0


def _format_row(row: dict[str, Any]) -> str:
    parts = [f"batch {row['batch']}:"]
    for system in ("pdserve", "hf"):
        if system in row:
            r = row[system]
            parts.append(f"{system} prefill {r['prefill_tokens_per_s']:.0f} tok/s, "
                         f"decode {r['decode_tokens_per_s']:.1f} tok/s;")
            if "engine_overhead_s_per_run" in r:
                parts.append(f"(outside the model runner: "
                             f"{r['engine_overhead_s_per_run'] * 1e3:.1f} ms per run)")
    return " ".join(parts)


def _table(results: dict[str, Any]) -> str:
    lines = ["", f"{'batch':>5} | {'pdserve prefill':>15} {'hf prefill':>11} | "
             f"{'pdserve decode':>14} {'hf decode':>10}   (tokens/s)"]
    for row in results["results"]:
        p, h = row["pdserve"], row.get("hf")
        hf_prefill = f"{h['prefill_tokens_per_s']:11.0f}" if h else f"{'-':>11}"
        hf_decode = f"{h['decode_tokens_per_s']:10.1f}" if h else f"{'-':>10}"
        lines.append(f"{row['batch']:>5} | {p['prefill_tokens_per_s']:15.0f} {hf_prefill} | "
                     f"{p['decode_tokens_per_s']:14.1f} {hf_decode}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
