#!/usr/bin/env bash
# Planned against measured: `pdserve profile` on one core (a "GPU" of this host), `pdserve plan`
# for 2 GPUs (and 3, for the other split's prediction), then a `pdserve bench` goodput sweep on
# the real `pdserve up` at each split, and the table (python -m pdserve.benchmarks.plan_check).
# The router's controller starts from the profile (--controller-profile) and what it fitted
# from the served steps is saved as a profile too (measured-*/controller.json).
#   benchmarks/results/planner_check.sh [MODEL_DIR] [OUT_DIR]
# Environment (defaults): INPUT_LEN=256 OUTPUT_LEN=32 SLO="ttft:1500 tpot:150"
#   RATES="1.5 2.5 3.5 5 7" SPLITS="1:1 2:1" NUM_PROMPTS=48 PROFILE=<OUT_DIR>/llama-mid-profile.json
#   (an existing PROFILE is reused: the profile takes ~2 minutes on one core).
# Default model: the llama-mid-like random Llama (benchmarks/step_roofline.py, mid_model_dir).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-$(.venv/bin/python -c 'from pdserve.benchmarks.step_roofline import mid_model_dir as d; print(d())')}
out=${2:-benchmarks/results/planner}
slo=${SLO:-ttft:1500 tpot:150}
read -r ttft_ms tpot_ms < <(echo "$slo" | sed -E 's/ttft:([0-9.]+) tpot:([0-9.]+)/\1 \2/')
input_len=${INPUT_LEN:-256} output_len=${OUTPUT_LEN:-32}
profile=${PROFILE:-$out/llama-mid-profile.json}
mkdir -p "$out"
if [ ! -f "$profile" ]; then
  taskset -c 0 .venv/bin/pdserve profile --model "$model" --tp 1 --output "$profile" --disable-tqdm
fi
# The same profile calibrated against the served system (pdserve profile --served: 1P1D on
# both cores, its engine models scaled by what serving adds, the measured hand-off).
served_profile=${SERVED_PROFILE:-$out/llama-mid-profile-served.json}
if [ ! -f "$served_profile" ]; then
  .venv/bin/pdserve profile --model "$model" --served --engine-profile "$profile" \
    --served-input-len "$input_len" --served-output-len "$output_len" \
    --output "$served_profile" > "$out/profile-served.txt"
  cat "$out/profile-served.txt"
fi
plan() {  # plan <profile> <num GPUs> <name suffix>
  taskset -c 0 .venv/bin/pdserve plan --profile "$1" --num-gpus "$2" \
    --slo-ttft-ms "$ttft_ms" --slo-tpot-ms "$tpot_ms" --input-len "$input_len" \
    --output-len "$output_len" --output "$out/plan-$2gpus$3.json" --plot "$out/plan-$2gpus$3.png" \
    > "$out/plan-$2gpus$3.txt"
  grep -v '^{' "$out/plan-$2gpus$3.txt"
}
plan "$profile" 2 ""
plan "$profile" 3 ""
plan "$served_profile" 2 "-calibrated"
plan "$served_profile" 3 "-calibrated"
# Three instances on this host's two cores get 2/3 of a core each: the same profile, 1.5x slower.
.venv/bin/python - "$profile" "$out/profile-shared.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
for phase in ("prefill", "decode"):
    for entry in data[phase].values():
        for key in list(entry):
            if key.endswith("_s"):
                entry[key] *= 1.5
data["hardware"] += ", time-shared: 3 instances on 2 cores (times x 1.5)"
json.dump(data, open(sys.argv[2], "w"), indent=2)
PY
plan "$out/profile-shared.json" 3 "-shared"
pid=
cleanup() { [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait || true; }
trap cleanup EXIT
for split in ${SPLITS:-1:1 2:1}; do
  p=${split%:*} d=${split#*:}
  dir="$out/measured-${p}p${d}d"
  mkdir -p "$dir"
  # Both cores: pdserve up pins each worker rank to a core of its own where they fit (1P1D),
  # and lets every process float where they do not (3 workers on 2 cores).
  .venv/bin/pdserve up --model "$model" --port 18700 --worker-base-port 18710 \
    --store-port 18720 --num-prefill "$p" --num-decode "$d" --controller recommend \
    --controller-profile "$profile" --controller-interval-s 20 --slo-ttft-ms "$ttft_ms" \
    --slo-tpot-ms "$tpot_ms" > "$dir/up.log" 2>&1 & pid=$!
  for _ in $(seq 600); do grep -q "pdserve is ready" "$dir/up.log" && break; sleep 0.5; done
  grep -q "pdserve is ready" "$dir/up.log" || { echo "not ready: $dir/up.log"; exit 1; }
  bench=(.venv/bin/pdserve bench --base-url http://127.0.0.1:18700 --tokenizer "$model"
    --dataset-name random --random-input-len "$input_len" --random-output-len "$output_len"
    --ignore-eos --goodput $slo --metric-percentiles 50,99 --disable-tqdm)
  "${bench[@]}" --num-prompts 8 --request-rate 1 --seed 1000 > "$dir/warmup.log"
  "${bench[@]}" --seed 0 --num-prompts "${NUM_PROMPTS:-48}" --sweep-rates ${RATES:-1.5 2.5 3.5 5 7} \
    --sweep-refine-steps 2 --sweep-fresh-prompts --save-result \
    --save-detailed --no-plots --result-dir "$dir" --result-filename sweep.json > "$dir/bench.log"
  sleep 21  # one more controller tick over the sweep's samples, then what it fitted, as a profile
  .venv/bin/python -c 'import json, sys, httpx
status = httpx.get("http://127.0.0.1:18700/status", timeout=10).json()["controller"]
json.dump({"state": status["state"], "recommended": status.get("recommended"),
           "goodput_by_num_prefill": status.get("goodput_by_num_prefill"),
           "profile": status.get("profile")}, sys.stdout, indent=2)' > "$dir/controller.json"
  kill -TERM "$pid"; wait "$pid" || true; pid=
  rm -f "$dir/warmup.log"
  # The same plan from the controller's served fit (its step models, hand-off and overhead).
  .venv/bin/python -c 'import json, sys
json.dump(json.load(open(sys.argv[1]))["profile"], open(sys.argv[2], "w"), indent=2)' \
    "$dir/controller.json" "$dir/served-profile.json"
  taskset -c 0 .venv/bin/pdserve plan --profile "$dir/served-profile.json" --num-gpus $((p + d)) \
    --slo-ttft-ms "$ttft_ms" --slo-tpot-ms "$tpot_ms" --input-len "$input_len" \
    --output-len "$output_len" --output "$dir/plan-$((p + d))gpus-served.json" > /dev/null
done
.venv/bin/python -m pdserve.benchmarks.plan_check "$out" "$profile" | tee "$out/plan-check.txt"
