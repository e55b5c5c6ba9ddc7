"""The communication table: bytes per step of every collective, for a model and a layout.

    python -m benchmarks.comm_table [--output-dir DIR]

Arithmetic, not a measurement (pdserve/serve/executor/comm_model.py derives each row;
tests/serve/test_comm_model.py
checks the formulas by hand and against bytes counted in a real TP/EP run). Printed for the
embedded default model (a tiny GQA Llama), a Llama-3-8B-shaped GQA model, and a
DeepSeek-V3-shaped MLA + MoE model whose dimensions are those of the released config.json
(DEEPSEEK_V3_CONFIG below), each under a few layouts. Prints a table per model, writes the JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.serve.default_model import DEFAULT_MODEL_CONFIG
from pdserve.serve.executor.comm_model import Layout, ModelShape, comm_table, table_as_dicts

# deepseek-ai/DeepSeek-V3's config.json (the fields communication depends on), as released
# with the V3 technical report (arXiv 2412.19437, section 4.2): 61 layers (3 dense, then MoE),
# hidden 7168, 128 heads, MLA with kv_lora_rank 512 + rope 64, 256 routed experts, top-8,
# 1 shared expert; weights released in FP8, served here as bf16 (2 bytes).
DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "vocab_size": 129280, "torch_dtype": "bfloat16",
}
# Llama-3-8B-shaped GQA: the hand-off's MHA/GQA reference point.
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
DEFAULT_CONFIG: dict[str, Any] = dict(DEFAULT_MODEL_CONFIG, model_type="llama",
                                      vocab_size=1024, torch_dtype="float32")

CASES: list[tuple[str, dict[str, Any], list[Layout]]] = [
    ("pdserve-default (tiny Llama, fp32)", DEFAULT_CONFIG, [
        Layout(tp=2, num_tokens=512, prompt_len=512),
        Layout(tp=2, pp=2, num_micro_batches=4, num_tokens=512, prompt_len=512),
        Layout(cp=2, num_tokens=2048, prompt_len=2048),
    ]),
    ("llama-3-8b-shaped (GQA, bf16)", LLAMA3_8B_CONFIG, [
        Layout(tp=8, num_tokens=4096, prompt_len=4096),
        Layout(tp=8, num_tokens=64, prompt_len=4096),  # a decode step of 64 sequences
        Layout(tp=4, pp=2, num_micro_batches=4, num_tokens=4096, prompt_len=4096),
        Layout(cp=4, tp=2, num_tokens=32768, prompt_len=32768),
    ]),
    ("deepseek-v3-shaped (MLA + 256 experts top-8, bf16)", DEEPSEEK_V3_CONFIG, [
        Layout(tp=8, num_tokens=4096, prompt_len=4096),
        Layout(tp=8, ep=8, num_tokens=4096, prompt_len=4096),
        Layout(tp=8, ep=8, num_tokens=128, prompt_len=4096),  # a decode step of 128 seqs
        Layout(tp=8, ep=8, pp=2, num_micro_batches=4, num_tokens=4096, prompt_len=4096),
        Layout(cp=4, num_tokens=131072, prompt_len=131072),
    ]),
]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def build() -> dict[str, Any]:
    models = []
    for title, config, layouts in CASES:
        shape = ModelShape.from_hf_config(config, name=title)
        entries = []
        for layout in layouts:
            rows = comm_table(shape, layout)
            entries.append({"layout": layout.__dict__, "collectives": table_as_dicts(rows),
                            "total_bytes_per_rank": sum(r.bytes_per_rank for r in rows
                                                        if r.name != "kv_handoff_per_request")})
        models.append({"model": title, "shape": shape.__dict__, "layouts": entries})
    return {"note": "arithmetic from pdserve/serve/executor/comm_model.py (no measurement, so the "
                    "busy shared box does not affect it); bytes per rank per step, the busiest "
                    "stage",
            "models": models}


def print_tables(result: dict[str, Any]) -> None:
    for model in result["models"]:
        print(f"\n== {model['model']}")
        for entry in model["layouts"]:
            lay = entry["layout"]
            print(f"  layout TP {lay['tp']} PP {lay['pp']} (m={lay['num_micro_batches']}) "
                  f"CP {lay['cp']} EP {lay['ep']}, {lay['num_tokens']} tokens/step, hand-off "
                  f"of a {lay['prompt_len']}-token prompt")
            print(f"    {'collective':<24} {'calls':>6} {'payload MiB':>12} "
                  f"{'MiB/rank/step':>14}  formula")
            for row in entry["collectives"]:
                print(f"    {row['name']:<24} {row['calls_per_step']:>6} "
                      f"{_mib(row['payload_bytes']):>12} {_mib(row['bytes_per_rank']):>14}  "
                      f"{row['formula']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None,
                        help="the JSON file (default: comm_table.json in --output-dir)")
    add_output_dir(parser, "comm_table")
    args = parser.parse_args(argv)
    result = build()
    print_tables(result)
    out = output_path(args, "comm_table", "comm_table.json", args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
