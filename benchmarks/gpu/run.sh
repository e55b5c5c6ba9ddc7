#!/usr/bin/env bash
# Everything pdserve does on a GPU, in one command, on a bare CUDA machine (within ~8 minutes
# on one H100):
#
#   bash benchmarks/gpu/run.sh                 # results in $OUT, else ./gpu-results
#
# Stages (each capped by its *_TIMEOUT_S; one line per stage in summary.json's "stages"):
#   install   pdserve without its dependencies (the machine's torch and Triton stay), plus
#             wheels from ./.whl where someone carried them (a machine with no registry)
#   tests     the Triton kernels compiled against their torch references, the fused MoE, the
#             device sampler, the decode step's host reads and the decode CUDA graphs; then
#             every @gpu test (tests.txt)
#   kernels   prefill / decode / MLA attention against SDPA and the copy bandwidth
#             (bench_attention.json)
#   engine    greedy tokens of the Triton backend equal the torch backend's, on CUDA
#   decode-step  the decode step at batch 1 / 8 / 32: pdserve with CUDA graphs, eager
#             (--enforce-eager), without async scheduling, and vLLM where installed
#             (decode_step.json)
#   served    `pdserve up` colocated and 1P+1D on one GPU (--allow-gpu-sharing), and vLLM's
#             CUDA build where it is installed: TTFT / TPOT / goodput, 512 in / 128 out, a
#             random ~1B Llama in bf16 (served.json)
# Writes at most 7 files into $OUT: summary.json, tests.txt, bench_attention.json,
# decode_step.json, served.json, engine.txt, log.txt.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$PWD/gpu-results}"
PY="${PYTHON:-python3}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-180}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-120}"
ENGINE_TIMEOUT_S="${ENGINE_TIMEOUT_S:-90}"
SERVED_TIMEOUT_S="${SERVED_TIMEOUT_S:-240}"
STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-300}"  # vLLM's first start on a bare machine compiles
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/log.txt"
STATUS="$(mktemp)"
: > "$LOG"
unset TRITON_INTERPRET PDSERVE_ATTENTION_BACKEND

stage() {  # stage NAME TIMEOUT_S COMMAND... (output appended to the log)
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - start))" | tee -a "$STATUS"
}

# -- install: the checkout, editable, without touching the machine's torch / Triton
if [ -d "$REPO/.whl" ]; then
    stage wheels 120 "$PY" -m pip install -q --no-index --no-deps "$REPO"/.whl/*.whl
fi
stage install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO"
"$PY" - >> "$LOG" 2>&1 <<'EOF'
import importlib.util
missing = [m for m in ("zmq", "fastapi", "uvicorn", "xgrammar", "msgpack", "prometheus_client",
                       "opentelemetry", "transformers", "safetensors", "httpx")
           if importlib.util.find_spec(m) is None]
print("missing for the served stage:", missing or "none")
EOF

{ nvidia-smi; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton',
triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } >> "$LOG" 2>&1

cd "$REPO"
stage tests "$TEST_TIMEOUT_S" "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/kernels tests/serve/test_sampler_device.py tests/serve/test_decode_host_reads.py \
    tests/serve/test_cuda_graphs.py tests/serve/test_async_scheduling.py
stage gpu-tests "$TEST_TIMEOUT_S" "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$LOG" > "$OUT/tests.txt"

stage kernels "$BENCH_TIMEOUT_S" "$PY" -m benchmarks.kernels.bench_attention \
    --output "$OUT/bench_attention.json"

stage engine "$ENGINE_TIMEOUT_S" "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/kernels/test_kernels_engine.py
grep -E "[0-9]+ (passed|failed)" "$LOG" | tail -1 > "$OUT/engine.txt"

stage decode-step "$STEP_TIMEOUT_S" "$PY" -m benchmarks.gpu.decode_step \
    --output "$OUT/decode_step.json" --timeout-s $((STEP_TIMEOUT_S / 3))

stage served "$SERVED_TIMEOUT_S" "$PY" -m benchmarks.gpu.served \
    --output "$OUT/served.json" --timeout-s $((SERVED_TIMEOUT_S / 3))

"$PY" - "$STATUS" "$OUT/summary.json" <<'EOF'
import json, subprocess, sys
stages = {}
for line in open(sys.argv[1]):
    name, rc, seconds = line.split()
    stages[name] = {"exit_code": int(rc), "seconds": int(seconds)}
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
json.dump({"gpu": gpu, "stages": stages}, open(sys.argv[2], "w"), indent=1)
print(json.dumps({"gpu": gpu, "stages": stages}))
EOF
rm -f "$STATUS"
! grep -q '"exit_code": [1-9]' "$OUT/summary.json"
