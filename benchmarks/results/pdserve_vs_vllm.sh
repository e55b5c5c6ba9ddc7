#!/usr/bin/env bash
# pdserve (colocated and disaggregated) against vLLM's CPU build on the same model, workload
# and machine: one `pdserve bench` compare run per pdserve mode, vLLM as the second server.
#   benchmarks/results/pdserve_vs_vllm.sh [MODEL_DIR] [OUT_DIR]
# Needs the peer installed once: /work/shared/tools/vllm-peer install (venv /tmp/vllm-peer).
# Default model: the embedded tiny random Llama (head_dim 64, which vLLM's CPU attention takes).
# PEER_DTYPE=bfloat16: serve vLLM in that dtype (the peer tool serves float32; vLLM's CPU MoE
# kernels need bf16/fp16 weights, so a DeepSeek checkpoint needs this, and a bf16 checkpoint
# keeps pdserve in bf16 too).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-$(.venv/bin/python -c 'from pdserve.serve.default_model import default_model_dir as d; print(d())')}
out=${2:-benchmarks/results/pdserve-vs-vllm}
peer=${VLLM_PEER:-/work/shared/tools/vllm-peer}
mkdir -p "$out"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT
if [ -n "${PEER_DTYPE:-}" ]; then
  VLLM_CPU_KVCACHE_SPACE=2 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 setsid \
    "${PEER_VENV:-/tmp/vllm-peer}/bin/vllm" serve "$model" --host 127.0.0.1 --port 18700 \
    --served-model-name tiny --dtype "$PEER_DTYPE" --max-model-len 2048 > "$out/vllm.log" 2>&1 &
else
  setsid "$peer" serve "$model" 18700 tiny > "$out/vllm.log" 2>&1 &
fi
pids+=($!)
for mode in colocated disagg; do
  .venv/bin/pdserve up --model "$model" --mode "$mode" --port 18800 --worker-base-port 18810 \
    --store-port 18820 > "$out/up-$mode.log" 2>&1 & up=$!
  for _ in $(seq 600); do grep -q "pdserve is ready" "$out/up-$mode.log" && break; sleep 0.5; done
  for _ in $(seq 600); do curl -sf http://127.0.0.1:18700/health > /dev/null && break; sleep 0.5; done
  .venv/bin/pdserve bench --base-url http://127.0.0.1:18800 --label "pdserve-$mode" \
    --compare-base-url http://127.0.0.1:18700 --compare-model tiny --compare-label vllm-cpu \
    --tokenizer "$model" --dataset-name random --random-input-len 128 --random-output-len 32 \
    --num-prompts 64 --ignore-eos --seed 0 --sweep-rates 4 16 64 --goodput ttft:200 tpot:50 \
    --metric-percentiles 50,99 --disable-tqdm --save-result --result-dir "$out" \
    --result-filename "pdserve-$mode-vs-vllm.json"
  kill -TERM "$up"; wait "$up" || true
done
