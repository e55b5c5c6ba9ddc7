"""What the offline studies share (benchmarks/: the decode step against its floor, weight
pages, warm-up, KV offload, served against vLLM): the llama-mid-like random model they run,
its byte and FLOP counts, and stepping an engine to its first tokens. The model is built with
the default model's builder (pdserve/serve/default_model.py), imported only when one is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MID_CONFIG: dict[str, Any] = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=4096)

def mid_model_dir() -> Path:
    """The llama-mid-like random Llama, built once into the cache directory."""
    from pdserve import envs
    from pdserve.serve.default_model import build_random_model

    target = Path(envs.cache_dir()) / "llama-mid-random"
    if not (target / "config.json").exists():
        build_random_model(target, "llama", seed=0, **MID_CONFIG)
    return target


def model_facts(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden \
        + 3 * hidden * inter + 2 * hidden
    matmul_params = layers * per_layer + vocab * hidden + hidden  # + LM head, final norm
    # The floor reads weights and KV in the checkpoint's own precision (2 bytes for a bf16 or
    # fp16 one), whatever precision an engine computes in.
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    size = 2 if dtype in ("bfloat16", "float16") else 4
    return {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "vocab": vocab, "dtype": dtype,
            "matmul_params": matmul_params, "weight_bytes": size * matmul_params,
            "kv_bytes_per_token": size * layers * 2 * kv_heads * head_dim}


def prefill_added(engine: Any) -> None:
    """Step an engine until every request added to it has its first token: their prefill,
    chunked by the token budget (the other benchmarks of one engine step share it)."""
    while engine.scheduler.waiting or any(r.num_output_tokens == 0
                                          for r in engine.scheduler.running):
        engine.step()
