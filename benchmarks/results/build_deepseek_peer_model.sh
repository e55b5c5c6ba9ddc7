#!/usr/bin/env bash
# The random DeepSeek-V3 (MLA + MoE, bf16) that pdserve and vLLM's CPU build both serve:
# vLLM's MLA needs kv_lora_rank + rope = 576, and its CPU MoE kernels bf16/fp16 weights.
#   benchmarks/results/build_deepseek_peer_model.sh [OUT_DIR]     (default /tmp/ds-peer)
#   PEER_DTYPE=bfloat16 benchmarks/results/pdserve_vs_vllm.sh /tmp/ds-peer OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/python - "${1:-/tmp/ds-peer}" <<'PY'
import sys

from pdserve.serve.default_model import build_random_model

out = build_random_model(
    sys.argv[1], "deepseek_v3", seed=0, dtype="bfloat16", hidden_size=256,
    intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=512, q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    moe_intermediate_size=128, first_k_dense_replace=1, n_group=4, topk_group=2)
print(out)
PY
