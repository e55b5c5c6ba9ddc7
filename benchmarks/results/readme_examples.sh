#!/usr/bin/env bash
# Runs the README's `pdserve bench` examples (the block tests/test_bench_readme.py checks) at
# full size against a running server, for the "expect:" lines; the goodput-search example is
# left out by default (minutes; goodput_search_check.sh measures it).
#   taskset -c 0 pdserve up --mode colocated --port 18801 --no-cpu-pinning &
#   benchmarks/results/readme_examples.sh [URL] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
url=${1:-http://127.0.0.1:18801}
out=${2:-benchmarks/results/readme-examples}
M=$(.venv/bin/python -c 'from pdserve.serve.default_model import default_model_dir as d; print(d())')
mkdir -p "$out"
# The README block, one example per line, base URL and result dir replaced.
.venv/bin/python - "$url" "$out" "$M" > "$out/commands.txt" <<'PY'
import re, shlex, sys
url, out, tokenizer = sys.argv[1:]
text = open("README.md").read()
start = text.index("<!-- bench-examples")
body_start = text.index("```bash", start) + 7
block = text[body_start:text.index("```", body_start)]
for line in re.sub(r"\\\n\s*", " ", block).splitlines():
    if line.startswith("pdserve bench ") and "--goodput-search" not in line:
        argv = shlex.split(line.replace('"$M"', tokenizer))[2:]
        argv[argv.index("--base-url") + 1] = url
        argv[argv.index("--result-dir") + 1] = out
        print(shlex.join(argv))
PY
n=0
while read -r line; do
  n=$((n + 1))
  eval "taskset -c 0 .venv/bin/pdserve bench $line --disable-tqdm --result-filename example$n.json" \
    > "$out/example$n.txt" 2>&1 || true
  echo "== example $n: $line"
  grep -E "^(Successful|Failed|  |SLO attain|Mean TTFT|Mean TPOT|Mean E2EL|P99 TTFT|P99 TPOT)" "$out/example$n.txt" || true
done < "$out/commands.txt"
