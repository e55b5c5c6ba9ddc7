#!/usr/bin/env bash
# pdserve disaggregated (1 prefill + 1 decode over the KV store) vs colocated (1 worker), same
# model, workload, seed and machine, measured by `pdserve bench` in compare mode (the same
# rate sweep against both servers in one run; each server idles while the other is measured).
#   benchmarks/results/disagg_vs_colocated.sh [MODEL_DIR] [OUT_DIR]    (RATES="1 2 4 ..." to
#   change the sweep)
# Default model: the embedded tiny random Llama (pdserve up's default).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-$(.venv/bin/python -c 'from pdserve.serve.default_model import default_model_dir as d; print(d())')}
out=${2:-benchmarks/results/disagg-vs-colocated}
mkdir -p "$out"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT
.venv/bin/pdserve up --model "$model" --mode disagg --port 18400 --worker-base-port 18410 \
  --store-port 18420 > "$out/up-disagg.log" 2>&1 & pids+=($!)
.venv/bin/pdserve up --model "$model" --mode colocated --port 18500 --worker-base-port 18510 \
  > "$out/up-colocated.log" 2>&1 & pids+=($!)
for log in "$out/up-disagg.log" "$out/up-colocated.log"; do
  for _ in $(seq 600); do grep -q "pdserve is ready" "$log" && break; sleep 0.5; done
  grep -q "pdserve is ready" "$log" || { echo "not ready: $log"; exit 1; }
done
.venv/bin/pdserve bench --base-url http://127.0.0.1:18400 --label disagg \
  --compare-base-url http://127.0.0.1:18500 --compare-label colocated \
  --tokenizer "$model" --dataset-name random --random-input-len 256 --random-output-len 64 \
  --num-prompts 48 --ignore-eos --seed 0 --sweep-rates ${RATES:-1 2 4 8 16 32} \
  --goodput ttft:500 tpot:50 --metric-percentiles 50,99 --save-result --result-dir "$out" \
  --result-filename disagg-vs-colocated.json
