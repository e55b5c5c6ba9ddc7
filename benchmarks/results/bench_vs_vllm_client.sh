#!/usr/bin/env bash
# pdserve bench against vllm bench serve: the same flags on the same server, run back to back,
# alternating which client goes first, so both see the same server state and box load.
#   benchmarks/results/bench_vs_vllm_client.sh URL SERVED_NAME OUT_DIR
# Serve the embedded default model first with either server (one core each):
#   taskset -c 0 pdserve up --mode colocated --port 18801 --no-cpu-pinning
#   taskset -c 0 ../shared/tools/vllm-peer serve "$(python -c 'from pdserve.serve.default_model
#       import default_model_dir as d; print(d())')" 18801 pdserve-tiny-random-llama
# Env: SEEDS ("1 2 3"), RATE (2), NUM_PROMPTS (64), CLIENT_CPUS (0: the clients' cores; give
# them a core the server does not use, e.g. 1, on a quiet box). Then:
#   python benchmarks/results/bench_vs_vllm_client_table.py OUT_DIR...
set -euo pipefail
cd "$(dirname "$0")/../.."
url=$1; name=$2; out=$3
cpus=${CLIENT_CPUS:-0}
peer=${VLLM_PEER:-/work/shared/tools/vllm-peer}
tok=$(.venv/bin/python -c 'from pdserve.serve.default_model import default_model_dir as d; print(d())')
mkdir -p "$out"
flags=(--backend openai --base-url "$url" --model "$name" --tokenizer "$tok"
       --dataset-name random --random-input-len 128 --random-output-len 32
       --num-prompts "${NUM_PROMPTS:-64}" --request-rate "${RATE:-2}" --ignore-eos
       --percentile-metrics ttft,tpot,itl,e2el --disable-tqdm --save-result --result-dir "$out")
run() {  # TOOL SEED
  if [ "$1" = vllm ]; then
    HF_HUB_OFFLINE=1 taskset -c "$cpus" "$peer" bench "${flags[@]}" --seed "$2" \
      --result-filename "vllm-seed$2.json" > "$out/vllm-seed$2.txt" 2>&1
  else
    taskset -c "$cpus" .venv/bin/pdserve bench "${flags[@]}" --seed "$2" --no-plots \
      --result-filename "pdserve-seed$2.json" > "$out/pdserve-seed$2.txt" 2>&1
  fi
  echo "$(date -u +%H:%M:%S) $1 seed $2: $(grep -E '^Mean TPOT' "$out/$1-seed$2.txt")"
}
# Warm the server (first-request compilation, allocator) outside the measured runs.
taskset -c "$cpus" .venv/bin/pdserve bench "${flags[@]}" --num-prompts 8 --seed 999 --no-plots \
  --result-filename warmup.json > /dev/null 2>&1
i=0
for seed in ${SEEDS:-1 2 3}; do
  if [ $((i % 2)) = 0 ]; then run pdserve "$seed"; run vllm "$seed"
  else run vllm "$seed"; run pdserve "$seed"; fi
  i=$((i + 1))
done
rm -f "$out/warmup.json"
