#!/usr/bin/env bash
# Served latency and goodput against vLLM, measured by vLLM's own client (`vllm bench serve`)
# for every server: vLLM's CPU build, pdserve colocated and pdserve disaggregated, on the same
# model and box, one server at a time (they never share the cores), fresh random prompts
# (seed per rate, fractional rates included, so no rate is served from the prefix cache of the
# one before).
#   benchmarks/results/served_vs_vllm.sh [MODEL_DIR] [OUT_DIR]
# Env: RATES ("1 2 4"), NUM_PROMPTS (40), INPUT_LEN (256), OUTPUT_LEN (64), GOODPUT
# ("ttft:1000 tpot:100"), SERVERS ("vllm colocated disagg"), UP_ARGS (extra `pdserve up` flags),
# PEER_DTYPE (serve vLLM in that dtype, e.g. bfloat16 for a bf16 checkpoint, as vLLM's own
# default would; the peer tool serves float32).
# Needs the peer installed once: /work/shared/tools/vllm-peer install (venv /tmp/vllm-peer).
# Then: python -m pdserve.benchmarks.served_table OUT_DIR  (table, plot, summary JSON).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-$(.venv/bin/python -c 'from pdserve.benchmarks.step_roofline import mid_model_dir as d; print(d())')}
out=${2:-benchmarks/results/served-vs-vllm}
peer=${VLLM_PEER:-/work/shared/tools/vllm-peer}
rates=${RATES:-1 2 4}
name=$(basename "$model")  # pdserve's router serves a checkpoint under its directory's name
mkdir -p "$out"
pid=""
cleanup() { [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_health() {  # URL LOG: up to 10 minutes (vLLM's CPU start takes 2-3)
  for _ in $(seq 1200); do curl -sf "$1/health" > /dev/null && return 0; sleep 0.5; done
  echo "server never became healthy; see $2" >&2; return 1
}

for server in ${SERVERS:-vllm colocated disagg}; do
  if [ "$server" = vllm ] && [ -n "${PEER_DTYPE:-}" ]; then
    VLLM_CPU_KVCACHE_SPACE=2 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 setsid \
      "${PEER_VENV:-/tmp/vllm-peer}/bin/vllm" serve "$model" --host 127.0.0.1 --port 18700 \
      --served-model-name "$name" --dtype "$PEER_DTYPE" --max-model-len 2048 \
      > "$out/serve-$server.log" 2>&1 & pid=$!
  elif [ "$server" = vllm ]; then
    setsid "$peer" serve "$model" 18700 "$name" > "$out/serve-$server.log" 2>&1 & pid=$!
  else
    setsid .venv/bin/pdserve up --model "$model" --mode "$server" --port 18700 \
      --worker-base-port 18710 --store-port 18730 ${UP_ARGS:-} \
      > "$out/serve-$server.log" 2>&1 & pid=$!
  fi
  wait_health http://127.0.0.1:18700 "$out/serve-$server.log"
  # The same warm-up for every server (first-request allocations and kernel loads), unmeasured
  "$peer" bench --backend openai --base-url http://127.0.0.1:18700 --model "$name" \
    --tokenizer "$model" --dataset-name random --random-input-len "${INPUT_LEN:-256}" \
    --random-output-len 8 --num-prompts 8 --request-rate 4 --seed 99991 --ignore-eos \
    --disable-tqdm > /dev/null 2>&1 || true
  for rate in $rates; do
    echo "== $server at $rate req/s"
    "$peer" bench --backend openai --base-url http://127.0.0.1:18700 --model "$name" \
      --tokenizer "$model" --dataset-name random --random-input-len "${INPUT_LEN:-256}" \
      --random-output-len "${OUTPUT_LEN:-64}" --num-prompts "${NUM_PROMPTS:-40}" \
      --request-rate "$rate" --seed "$(awk -v r="$rate" 'BEGIN { printf "%d", r * 791900 + 1 }')" --ignore-eos \
      --goodput ${GOODPUT:-ttft:1000 tpot:100} --percentile-metrics ttft,tpot,e2el \
      --metric-percentiles 50,99 --disable-tqdm --save-result --result-dir "$out" \
      --result-filename "$server-rate$rate.json" 2>&1 | grep -E "^(Request|Mean|Median|P99|Successful)" || true
  done
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  sleep 3
done
