#!/usr/bin/env bash
# How well the goodput controller predicts: `pdserve up` (NUM_PREFILL prefill + NUM_DECODE
# decode workers over the KV store, --controller recommend), a warm-up run so the controller
# has step samples, a `pdserve bench` rate sweep (fresh prompts at each rate), then the
# controller's prediction for the same requests and rates
# (python -m pdserve.benchmarks.controller_check).
#   benchmarks/results/controller_check.sh [MODEL_DIR] [OUT_DIR]
# Environment (defaults): NUM_PREFILL=1 NUM_DECODE=1 INPUT_LEN=256 OUTPUT_LEN=64
#   SLO="ttft:200 tpot:20" RATES="2 4 8 12 16 24 32" WARMUP_RATE=8
# Default model: the embedded tiny random Llama (pdserve up's default).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-$(.venv/bin/python -c 'from pdserve.serve.default_model import default_model_dir as d; print(d())')}
out=${2:-benchmarks/results/controller-check}
slo=${SLO:-ttft:200 tpot:20}
read -r ttft_ms tpot_ms < <(echo "$slo" | sed -E 's/ttft:([0-9.]+) tpot:([0-9.]+)/\1 \2/')
mkdir -p "$out"
pid=
cleanup() { [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait || true; }
trap cleanup EXIT
.venv/bin/pdserve up --model "$model" --port 18600 --worker-base-port 18610 --store-port 18620 \
  --num-prefill "${NUM_PREFILL:-1}" --num-decode "${NUM_DECODE:-1}" \
  --controller recommend --controller-interval-s 2 --slo-ttft-ms "$ttft_ms" \
  --slo-tpot-ms "$tpot_ms" > "$out/up.log" 2>&1 & pid=$!
for _ in $(seq 600); do grep -q "pdserve is ready" "$out/up.log" && break; sleep 0.5; done
grep -q "pdserve is ready" "$out/up.log" || { echo "not ready: $out/up.log"; exit 1; }
bench=(.venv/bin/pdserve bench --base-url http://127.0.0.1:18600 --tokenizer "$model"
  --dataset-name random --random-input-len "${INPUT_LEN:-256}"
  --random-output-len "${OUTPUT_LEN:-64}" --ignore-eos --seed 0 --goodput $slo
  --metric-percentiles 50,99)
"${bench[@]}" --num-prompts 64 --request-rate "${WARMUP_RATE:-8}" --seed 1000 --disable-tqdm \
  > "$out/warmup.log"
# Fresh prompts at every rate: nothing is served from the prefix cache or the KV store.
"${bench[@]}" --num-prompts 64 --sweep-rates ${RATES:-2 4 8 12 16 24 32} --sweep-refine-steps 3 \
  --sweep-fresh-prompts --save-result --save-detailed --result-dir "$out" \
  --result-filename sweep.json
sleep 3  # one more controller tick over the sweep's samples
.venv/bin/python -m pdserve.benchmarks.controller_check --base-url http://127.0.0.1:18600 \
  --bench-result "$out/sweep.json" | tee "$out/controller-check.txt"
rm -f "$out/up.log" "$out/warmup.log"
