#!/usr/bin/env bash
# Does the controller's recommended split win? A prompt-heavy workload (1024 in / 8 out) on
# 1 prefill + 2 decode workers, then on 2 prefill + 1 decode: each measured by a bench sweep
# and predicted by the controller (controller_check.sh), so the table compares the predicted
# and the measured goodput of both splits.
#   benchmarks/results/controller_split.sh [MODEL_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
export INPUT_LEN=1024 OUTPUT_LEN=8 SLO="ttft:1000 tpot:100" RATES="${RATES:-1 2 3 4 6 8 12}"
export WARMUP_RATE=2
for split in "1 2" "2 1"; do
  read -r p d <<< "$split"
  NUM_PREFILL=$p NUM_DECODE=$d bash benchmarks/results/controller_check.sh "${1:-}" \
    "benchmarks/results/controller-split/${p}p${d}d"
done
