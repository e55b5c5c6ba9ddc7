#!/usr/bin/env bash
# pdserve bench vs `vllm bench serve` on the same vLLM server, workload and seed, back to back.
#   benchmarks/results/compare_vllm.sh BASE_URL MODEL_NAME TOKENIZER_DIR [OUT_DIR] [REPS]
# The server: /work/shared/tools/vllm-peer serve MODEL_DIR PORT MODEL_NAME
# The two tools draw different Poisson sequences from the same seed, so at a finite rate they
# queue differently; two load levels need no draw: one request at a time (--max-concurrency 1)
# and all at once (inf). 2 req/s is run too. The order alternates per repetition so a drift
# in the shared box's load does not favour either tool.
set -euo pipefail
base_url=$1; model=$2; tokenizer=$3; out=${4:-benchmarks/results}; reps=${5:-3}
peer=${VLLM_PEER:-/work/shared/tools/vllm-peer}
common=(--base-url "$base_url" --model "$model" --tokenizer "$tokenizer" --dataset-name random
        --random-input-len 128 --random-output-len 32 --seed 0 --ignore-eos
        --goodput ttft:200 tpot:50 --metric-percentiles 50,99 --disable-tqdm --save-result
        --result-dir "$out")
mkdir -p "$out"
# ARGS: rate num_prompts max_concurrency(- = none) rep
level() { local c=(); [[ $3 != - ]] && c=(--max-concurrency "$3"); echo "${c[@]}"; }
name() { [[ $3 != - ]] && echo "rate$1-conc$3-rep$4" || echo "rate$1-rep$4"; }
ours() {
  .venv/bin/pdserve bench "${common[@]}" --num-prompts "$2" --request-rate "$1" $(level "$@") \
    --no-plots --result-filename "pdserve-bench-$(name "$@").json"
}
# setsid: vLLM's CLI signals its whole process group on exit, which would end this script.
theirs() {
  setsid "$peer" bench "${common[@]}" --num-prompts "$2" --request-rate "$1" $(level "$@") \
    --percentile-metrics ttft,tpot,itl,e2el --result-filename "vllm-bench-serve-$(name "$@").json"
}
for rep in $(seq 1 "$reps"); do
  for spec in "inf 32 1" "2 32 -" "inf 64 -"; do
    set -- $spec
    if (( rep % 2 )); then ours "$@" "$rep"; theirs "$@" "$rep"
    else theirs "$@" "$rep"; ours "$@" "$rep"; fi
  done
done
# The goodput sweep with plots (attainment vs rate, TTFT/TPOT CDFs).
.venv/bin/pdserve bench "${common[@]}" --num-prompts 64 --sweep-rates 4 16 64 \
  --label vllm-cpu --result-filename pdserve-bench-vllm-sweep.json
# Per rate: each tool's TTFT / TPOT means averaged over the repetitions, and ours / theirs.
.venv/bin/python - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
table = {}
for rate in ("inf-conc1", "2", "inf"):
    row = {}
    for tool, pattern in (("pdserve", "pdserve-bench-rate{}-rep*.json"),
                          ("vllm", "vllm-bench-serve-rate{}-rep*.json")):
        # "inf-conc1": one request at a time (files rateinf-conc1-repN)
        paths = sorted(glob.glob(os.path.join(out, pattern.format(rate))))
        runs = [json.load(open(p)) for p in paths]
        row[tool] = {k: sum(r[k] for r in runs) / len(runs) for k in
                     ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                      "mean_e2el_ms", "output_throughput")}
        row[tool]["per_rep_mean_ttft_ms"] = [round(r["mean_ttft_ms"], 2) for r in runs]
        row[tool]["per_rep_mean_tpot_ms"] = [round(r["mean_tpot_ms"], 2) for r in runs]
    row["ratio_pdserve_over_vllm"] = {k: row["pdserve"][k] / row["vllm"][k] for k in
                                      ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
                                       "median_tpot_ms", "mean_e2el_ms")}
    table[f"rate_{rate}"] = row
    print(f"rate {rate}: " + "  ".join(f"{k} {v:.3f}" for k, v in
                                       row["ratio_pdserve_over_vllm"].items()))
json.dump(table, open(os.path.join(out, "comparison.json"), "w"), indent=2)
PY
