#!/usr/bin/env bash
# Everything pdserve does on a GPU, in one command of at most 10 minutes (the device tool's
# limit), on a bare CUDA machine with no package registry:
#
#   bash benchmarks/gpu/wheels.sh               # here, once: the missing wheels into ./.whl
#   bash benchmarks/gpu/run.sh [STAGE...]       # there, with .whl carried: results in $OUT
#   bash benchmarks/gpu/run.sh --rehearse       # here, on a CPU: the same stages, no CUDA
#
# Stages, in order, each within its limit (STAGE_LIMITS; their sum leaves a minute of the
# command's 600 s spare); naming some runs only those (and wheels, which the others need):
#   wheels       the carried wheels (.whl) into a folder on PYTHONPATH (the machine's torch and
#                Triton stay); the checkout itself is imported from PYTHONPATH
#   tests        the Triton kernels against their torch references, the fused MoE, the device
#                sampler, the decode step's host reads, the decode CUDA graphs, async scheduling
#   gpu-tests    the other modules' @gpu tests (GPU_TEST_FILES)
#   kernels      prefill / decode / MLA attention against SDPA, copy bandwidth
#                (bench_attention.json)
#   engine       greedy tokens of the Triton backend equal the torch backend's, on CUDA
#   decode-step  the decode step at batch 1 / 8 / 32: pdserve with CUDA graphs, eager, without
#                async scheduling, and vLLM where installed (decode_step.json)
#   served       `pdserve up` colocated and 1P+1D on one GPU, vLLM's CUDA build where installed:
#                TTFT / TPOT / goodput, 512 in / 128 out, a random ~1B Llama in bf16
#                (served.json, which names the client that measured each number)
#
# $OUT gets at most 5 files (the device returns 8): summary.json (rewritten after every stage,
# so a command cut short still returns what finished: each stage's exit code, seconds, limit
# and test counts, the machine, missing modules), log.txt, bench_attention.json,
# decode_step.json, served.json. Each stage runs in a process group of its own that the script
# kills when the stage's limit passes and when the script exits (trap); servers die with the
# benchmark that started them (pdserve/benchmarks/server_process.py: parent-death signal).
#
# --rehearse runs on a CPU machine, in a cached venv (REHEARSE_DIR, default
# $PDSERVE_CACHE_DIR/gpu-rehearse) holding only the image's packages that pdserve imports plus
# the same pinned wheels for this Python (wheels.sh): it collects every test the GPU stages
# select (no error allowed), runs a Triton kernel subset in the interpreter, the decode step and
# the served stage on a tiny CPU model, and checks the file count and the time budget.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
COMMAND_LIMIT_S=600  # one device command (/work/.library/device/README.md)
SPARE_S=60           # the stages' limits leave this much of it
STAGE_LIMITS=(       # stage=seconds, in running order (tests/bench/test_gpu_script.py sums them)
    wheels=20
    tests=110
    gpu-tests=60
    kernels=40
    engine=40
    decode-step=120
    served=150
)
MAX_OUT_FILES=5  # the device returns at most 8
GPU_TEST_FILES=(  # modules with @gpu tests that no other stage runs
    tests/kvstore/test_kvstore_connector.py tests/kvstore/test_kvstore_tiers.py
    tests/serve/test_memory_plan.py tests/serve/test_model_fidelity.py
)
KERNEL_TESTS=(
    tests/kernels tests/serve/test_sampler_device.py tests/serve/test_decode_host_reads.py
    tests/serve/test_cuda_graphs.py tests/serve/test_async_scheduling.py
)
ENGINE_TEST=tests/kernels/test_kernels_engine.py

total=0  # the device stages' limits (the rehearsal's own stages come on top)
for entry in "${STAGE_LIMITS[@]}"; do total=$((total + ${entry#*=})); done

REHEARSE=0
if [ "${1:-}" = "--rehearse" ]; then
    REHEARSE=1
    shift
    STAGE_LIMITS=(venv=900 collect=120 "${STAGE_LIMITS[@]}")  # venv: once, then cached
fi
SELECTED=("$@")

OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d)"  # stage bookkeeping and scratch, outside $OUT
LOG="$OUT/log.txt"
SUMMARY="$OUT/summary.json"
STATUS="$WORK/status"
: > "$LOG"
: > "$STATUS"
PY="${PYTHON:-python3}"
STAGE_PID=""
unset TRITON_INTERPRET PDSERVE_ATTENTION_BACKEND
export PYTHONUNBUFFERED=1
export PDSERVE_CPU_KERNELS=0  # the C++ CPU kernels: none runs on CUDA, so none is built

stop_stage() {  # the running stage's whole process group: TERM, then KILL after 10 s
    [ -n "$STAGE_PID" ] || return 0
    kill -TERM -- "-$STAGE_PID" 2>/dev/null
    for _ in $(seq 20); do
        kill -0 -- "-$STAGE_PID" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL -- "-$STAGE_PID" 2>/dev/null
    STAGE_PID=""
}
trap 'stop_stage; rm -rf "$WORK"' EXIT
CURRENT_STAGE=""
CURRENT_START=0
stopped() {  # a signal: the running stage goes into the summary as stopped, then the EXIT trap
    echo "stopped by a signal" | tee -a "$LOG"
    if [ -n "$CURRENT_STAGE" ]; then
        stop_stage
        echo "$CURRENT_STAGE 143 $((SECONDS - CURRENT_START))" >> "$STATUS"
        summarize
    fi
    exit 143
}
trap stopped TERM INT HUP

limit_of() {  # limit_of STAGE -> its seconds
    local entry
    for entry in "${STAGE_LIMITS[@]}"; do
        [ "${entry%%=*}" = "$1" ] && echo "${entry#*=}" && return
    done
    echo 0
}

wanted() {  # wanted STAGE: no stage named on the command line, or this one named
    [ ${#SELECTED[@]} -eq 0 ] && return 0
    local name
    for name in "${SELECTED[@]}"; do [ "$name" = "$1" ] && return 0; done
    return 1
}

summarize() {  # summary.json from what finished so far
    "$PY" - "$STATUS" "$LOG" "$SUMMARY" "$WORK" "$REHEARSE" "$COMMAND_LIMIT_S" "$MAX_OUT_FILES" \
        "$total" "${STAGE_LIMITS[@]}" <<'EOF'
import json, os, re, sys
from pathlib import Path

status, log, summary_path, work, rehearse, command_s, max_files, total = sys.argv[1:9]
summary_path = Path(summary_path)
out = summary_path.parent
limits = dict(entry.split("=") for entry in sys.argv[9:])
stages = {}
for line in open(status):
    name, rc, seconds = line.split()
    stages[name] = {"exit_code": int(rc), "seconds": int(seconds), "limit_s": int(limits[name])}
    if int(rc) in (124, 137):
        stages[name]["timed_out"] = True
# pytest's last counts line in each stage's part of the log
part, counts = None, {}
for line in open(log, errors="replace"):
    if line.startswith("== "):
        part = line[3:].split(":")[0]
    elif part and re.search(r"\d+ (passed|failed|skipped|error|deselected|tests? collected)",
                            line):
        counts[part] = line.strip().strip("=").strip()
for name, text in counts.items():
    if name in stages:
        stages[name]["tests"] = text
facts = {}
for name in ("machine.json", "missing.json"):
    path = Path(work) / name
    if path.exists():
        facts.update(json.loads(path.read_text()))
files = sorted(p.name for p in out.iterdir() if p.is_file() and p.name != "summary.json")
summary = {**facts, "rehearsal": rehearse == "1", "stages": stages,
           "total_s": sum(s["seconds"] for s in stages.values()),
           "budget": {"command_limit_s": int(command_s), "device_stages_limits_s": int(total)},
           "files": [*files, "summary.json"]}
summary["files_ok"] = len(summary["files"]) <= int(max_files)
tmp = summary_path.with_suffix(".tmp")
tmp.write_text(json.dumps(summary, indent=1))
os.replace(tmp, summary_path)
EOF
}

stage() {  # stage NAME COMMAND...: within NAME's limit, in a process group of its own
    local name="$1" limit
    shift
    limit="$(limit_of "$name")"
    echo "== $name: $*" >> "$LOG"
    echo "== $name (limit ${limit} s)"
    local start=$SECONDS
    CURRENT_STAGE="$name"
    CURRENT_START=$start
    # timeout leads a process group of its own: TERM to all of it at the limit, KILL 10 s later
    timeout -k 10 "$limit" "$@" >> "$LOG" 2>&1 < /dev/null &
    STAGE_PID=$!
    wait "$STAGE_PID"
    local rc=$?
    stop_stage  # whatever the stage left behind
    CURRENT_STAGE=""
    echo "$name $rc $((SECONDS - start))" >> "$STATUS"
    echo "   $name: exit $rc, $((SECONDS - start)) s"
    summarize
}

# -- where the stages' Python comes from
SITE="$WORK/site"
WHEELS_DIR="$REPO/.whl"
if [ "$REHEARSE" = 1 ]; then
    CACHE="${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}"
    REHEARSE_DIR="${REHEARSE_DIR:-$CACHE/gpu-rehearse}"
    BASE_PY="${REHEARSE_PYTHON:-python3.11}"  # torch 2.13's CPU wheel on this disk is cp311
    # the image's packages that pdserve's stages import (KINDS.md's list; torch and Triton at
    # the nearest this index offers), then the carried wheels for this Python, cached
    # (numpy below 2.4: Triton 3.6's interpreter calls int() on 1-element arrays, which numpy
    # 2.4 refuses; the image's numpy 2.5 never meets the interpreter on CUDA)
    IMAGE_PACKAGES=(torch==2.13.0 triton==3.6.0 "numpy<2.4" transformers==5.17.0 tokenizers
                    safetensors==0.8.0 huggingface-hub jinja2 msgpack prometheus-client httpx
                    pytest pytest-timeout tqdm matplotlib psutil requests protobuf attrs anyio
                    click h11 uvloop typing-extensions annotated-doc)
    stamp="$(echo "${IMAGE_PACKAGES[*]}" | cat - "$REPO/benchmarks/gpu/wheels.sh" | sha256sum)"
    make_venv() (  # a subshell: set -e stays in it
        set -e
        if [ "$(cat "$REHEARSE_DIR/stamp" 2>/dev/null)" = "$stamp" ]; then
            echo "cached: $REHEARSE_DIR"
            return
        fi
        rm -rf "$REHEARSE_DIR"
        "$BASE_PY" -m venv "$REHEARSE_DIR/venv"
        "$REHEARSE_DIR/venv/bin/python" -m pip install -q "${IMAGE_PACKAGES[@]}"
        version="$("$REHEARSE_DIR/venv/bin/python" -c \
            'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
        WHEELS_DIR="$REHEARSE_DIR/whl" PY_VERSION="$version" PYTHON="$BASE_PY" \
            bash "$REPO/benchmarks/gpu/wheels.sh"
        # what the image's packages pulled in of the carried ones (pydantic, ...): the image
        # lacks them, so the rehearsal gets them from the wheels stage alone
        carried=()
        for wheel in "$REHEARSE_DIR"/whl/*.whl; do
            carried+=("$(basename "$wheel" | cut -d- -f1)")
        done
        "$REHEARSE_DIR/venv/bin/python" -m pip uninstall -y -q "${carried[@]}" 2>&1 \
            | grep -v "not installed" || true
        echo "$stamp" > "$REHEARSE_DIR/stamp"
    )
    echo "== venv: $REHEARSE_DIR" | tee -a "$LOG"
    start=$SECONDS
    make_venv >> "$LOG" 2>&1
    echo "venv $? $((SECONDS - start))" >> "$STATUS"
    echo "   venv: $((SECONDS - start)) s"
    PY="$REHEARSE_DIR/venv/bin/python"
    WHEELS_DIR="$REHEARSE_DIR/whl"
fi
export PYTHONPATH="$SITE:$REPO"  # the carried wheels, then the checkout
# one process: the device image has no pytest-xdist (pyproject's addopts ask for it), and the
# GPU stages share one device
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider -o addopts=)

echo "stage limits: $total s of the command's $COMMAND_LIMIT_S s" | tee -a "$LOG"
if [ "$total" -gt $((COMMAND_LIMIT_S - SPARE_S)) ]; then
    echo "over budget: the stages' limits must leave $SPARE_S s" | tee -a "$LOG"
    exit 1
fi

# -- the machine, once (summary.json carries it)
{ nvidia-smi || echo "no nvidia-smi"; } >> "$LOG" 2>&1
"$PY" - "$WORK/machine.json" >> "$LOG" 2>&1 <<'EOF'
import json, platform, subprocess, sys
import torch, triton
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip() \
    if torch.cuda.is_available() else "none"
facts = {"gpu": gpu, "python": platform.python_version(), "torch": torch.__version__,
         "triton": triton.__version__, "cuda": torch.version.cuda}
print(facts)
open(sys.argv[1], "w").write(json.dumps(facts))
EOF

# -- the wheels, always: every other stage imports what they hold
if ls "$WHEELS_DIR"/*.whl > /dev/null 2>&1; then
    stage wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$WHEELS_DIR"/*.whl
else
    echo "no wheels in $WHEELS_DIR: run benchmarks/gpu/wheels.sh and carry .whl" | tee -a "$LOG"
fi
"$PY" - "$WORK/missing.json" >> "$LOG" 2>&1 <<'EOF'
import importlib.util, json, sys
needed = ("zmq", "fastapi", "starlette", "pydantic", "uvicorn", "xgrammar", "opentelemetry.sdk",
          "pytest_asyncio", "jsonschema", "msgpack", "prometheus_client", "transformers",
          "safetensors", "httpx", "jinja2", "matplotlib")
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
missing = [name for name in needed if not found(name)]
print("missing modules:", missing or "none")
open(sys.argv[1], "w").write(json.dumps({"missing_modules": missing}))
EOF
summarize

cd "$REPO"
if [ "$REHEARSE" = 1 ]; then
    # every test the GPU stages select must at least import here: 0 collection errors
    wanted collect && stage collect "${PYTEST[@]}" --collect-only "${KERNEL_TESTS[@]}" \
        "${GPU_TEST_FILES[@]}"
    # the Triton kernels in the interpreter (fp32/fp16 only: bf16 is wrong there), a subset
    wanted tests && stage tests env TRITON_INTERPRET=1 "${PYTEST[@]}" \
        tests/kernels/test_kernels_triton.py tests/serve/test_sampler_device.py \
        tests/serve/test_decode_host_reads.py \
        -k "decode_matches_reference and 4-16-8-2 or negative_slot or sampler or host"
    wanted gpu-tests && stage gpu-tests "${PYTEST[@]}" -m gpu "${GPU_TEST_FILES[@]}"
    wanted kernels && stage kernels "$PY" -m benchmarks.kernels.bench_attention --help
    wanted engine && stage engine "${PYTEST[@]}" "$ENGINE_TEST"
    TINY="$WORK/tiny-llama"
    "$PY" - "$TINY" >> "$LOG" 2>&1 <<'EOF'
import sys
from pdserve.serve.default_model import build_random_model, build_tokenizer
build_tokenizer(sys.argv[1] + "-tokenizer")
build_random_model(sys.argv[1], "llama", tokenizer_dir=sys.argv[1] + "-tokenizer",
                   hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=256, max_position_embeddings=1024)
EOF
    wanted decode-step && stage decode-step "$PY" -m benchmarks.gpu.decode_step \
        --output "$OUT/decode_step.json" --model "$TINY" --device cpu --batch-sizes 1 4 \
        --num-steps 4 --prompt-tokens 32 --engines pdserve pdserve-eager --timeout-s 40
    wanted served && stage served "$PY" -m benchmarks.gpu.served --output "$OUT/served.json" \
        --model "$TINY" --rates 8 --num-prompts 8 --input-len 32 --output-len 8 \
        --timeout-s 60 --work-dir "$WORK/served"
else
    wanted tests && stage tests "${PYTEST[@]}" "${KERNEL_TESTS[@]}" --ignore "$ENGINE_TEST"
    wanted gpu-tests && stage gpu-tests "${PYTEST[@]}" -m gpu "${GPU_TEST_FILES[@]}"
    wanted kernels && stage kernels "$PY" -m benchmarks.kernels.bench_attention \
        --output "$OUT/bench_attention.json"
    wanted engine && stage engine "${PYTEST[@]}" "$ENGINE_TEST"
    wanted decode-step && stage decode-step "$PY" -m benchmarks.gpu.decode_step \
        --output "$OUT/decode_step.json" \
        --timeout-s $(($(limit_of decode-step) / 4 + 3))  # the model's build, 3 engines
    wanted served && stage served "$PY" -m benchmarks.gpu.served --output "$OUT/served.json" \
        --timeout-s $(($(limit_of served) / 3)) --work-dir "$WORK/served"
fi

summarize
num_files=$(find "$OUT" -type f | wc -l)
echo "files in $OUT: $num_files (at most $MAX_OUT_FILES)" | tee -a "$LOG"
echo "stage        exit  seconds  limit"
while read -r name rc seconds; do
    printf "%-12s %4s %8s %6s\n" "$name" "$rc" "$seconds" "$(limit_of "$name")"
done < "$STATUS"
[ "$num_files" -le "$MAX_OUT_FILES" ] && ! awk '$2 != 0 { bad = 1 } END { exit !bad }' "$STATUS"
