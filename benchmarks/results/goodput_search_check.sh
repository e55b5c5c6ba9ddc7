#!/usr/bin/env bash
# Does `pdserve bench --goodput-search` find the rate a fine manual sweep finds? On the embedded
# default model served by `pdserve up --mode colocated` (start it first; one core is enough):
#   taskset -c 0 pdserve up --mode colocated --port 18801 --no-cpu-pinning &
#   benchmarks/results/goodput_search_check.sh [OUT_DIR]
# then: python benchmarks/results/goodput_search_table.py OUT_DIR  (table + plot)
# Env: URL (http://127.0.0.1:18801), SEEDS ("0 1 2"), RATES (the sweep grid), SLO,
#   CLIENT_CPUS (0: the cores the clients run on; give them a core the server does not use),
#   NUM_PROMPTS (64 per run; enough that a run at the limit lasts several seconds),
#   SEARCH_MIN_RATE (2: where the search starts doubling).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/results/goodput-search}
url=${URL:-http://127.0.0.1:18801}
tok=$(.venv/bin/python -c 'from pdserve.serve.default_model import default_model_dir as d; print(d())')
rates=${RATES:-2 2.5 3 3.5 4 4.5 5 6}
cpus=${CLIENT_CPUS:-0}
mkdir -p "$out"
common=(--base-url "$url" --tokenizer "$tok" --dataset-name random --random-input-len 128
        --random-output-len 32 --num-prompts "${NUM_PROMPTS:-64}" --goodput ${SLO:-ttft:1000 tpot:75}
        --disable-tqdm --save-result --result-dir "$out")
# Seeds: no run of a search shares its prompts with a sweep run (fresh prompts everywhere).
# Interleaved (search repeat, sweep seed, search repeat, ...): the box's background load drifts
# over minutes, and both methods should see the same drift.
for i in ${SEEDS:-0 1 2}; do
  date -u +"search $i %H:%M:%S"
  taskset -c "$cpus" .venv/bin/pdserve bench "${common[@]}" --seed $((i * 1000 + 1)) --goodput-search \
    --search-min-rate "${SEARCH_MIN_RATE:-2}" --search-repeats 1 --search-max-runs 7 --search-tolerance 0.05 \
    --result-filename "search-rep$i.json" 2>&1 | tee "$out/search-rep$i.txt" \
    | grep --line-buffered -E "goodput rate|search [0-9]"
  date -u +"sweep $i %H:%M:%S"
  taskset -c "$cpus" .venv/bin/pdserve bench "${common[@]}" --seed $((i * 100 + 50)) \
    --sweep-rates $rates --sweep-fresh-prompts --result-filename "sweep-seed$i.json" \
    2>&1 | tee "$out/sweep-seed$i.txt" | grep --line-buffered -E "goodput rate"
done
date -u +"done %H:%M:%S"
