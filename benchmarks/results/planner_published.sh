#!/usr/bin/env bash
# What `pdserve plan` chooses on a published profile: DistServe's OPT-13B step fits on
# A100-80GB (planner/distserve-opt-13b-a100-80g.json, transcribed; its "source" says from where)
# for one 8-GPU node: a fixed 512-in / 128-out workload at SLO TTFT 250 ms / TPOT 100 ms, and
# the Mooncake conversation trace's lengths scaled by 1/16 (mean 752 prompt tokens, p90 1710:
# OPT's context is 2048; the ~3% longer ones are kept, chunked) at TTFT 400 ms / TPOT 100 ms.
#   benchmarks/results/planner_published.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/results/planner}
profile=benchmarks/results/planner/distserve-opt-13b-a100-80g.json
trace=${TRACE:-../shared/traces/mooncake_conversation_trace.jsonl}
mkdir -p "$out"
plan=(taskset -c 0 .venv/bin/pdserve plan --profile "$profile" --num-gpus 8 --slo-tpot-ms 100)
"${plan[@]}" --slo-ttft-ms 250 --input-len 512 --output-len 128 \
  --output "$out/distserve-plan-fixed.json" --plot "$out/distserve-plan-fixed.png" \
  > "$out/distserve-plan-fixed.txt"
"${plan[@]}" --slo-ttft-ms 400 --dataset-path "$trace" --length-scale 0.0625 \
  --output "$out/distserve-plan-trace.json" --plot "$out/distserve-plan-trace.png" \
  > "$out/distserve-plan-trace.txt"
grep -v '^{' "$out/distserve-plan-fixed.txt" | head -8
grep -v '^{' "$out/distserve-plan-trace.txt" | head -8
