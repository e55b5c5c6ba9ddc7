#!/usr/bin/env bash
# pdserve attention kernels on a CUDA machine, in one go: GPU tests, then benchmarks.
#
#   benchmarks/kernels/run_gpu_checks.sh            (from anywhere; OUT defaults to ./gpu_results)
#   OUT=/some/dir PYTHON=python3 benchmarks/kernels/run_gpu_checks.sh
#
# Writes under $OUT:
#   env.txt                nvidia-smi, torch/triton versions, device name
#   tests.txt              pytest on the kernel tests (compiled kernels vs the torch references,
#                          including the @gpu ones at Llama / DeepSeek shapes)
#   engine.txt             greedy tokens of the engine with triton == with torch, on CUDA
#   bench_attention.json   prefill TFLOP/s vs SDPA flash and the measured bf16 peak; decode and
#                          MLA-decode GB/s vs the measured copy bandwidth; MLA prefill
#                          absorbed (Triton) vs expanded (torch); tile sweep
#   bench.txt              the benchmark's log
#   status.txt             one line per stage with its exit code
# Budget (never measured: written without a GPU): ~1.5-3 min compiling + testing, ~2-3 min of
# benchmarks, ~1 min engine; each stage is capped by *_TIMEOUT_S (240/240/120 s by default).
# pdserve need not be installed: without it, a throwaway pdserve.* package of symlinks is used.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$PWD/gpu_results}"
PY="${PYTHON:-python3}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-240}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-240}"
ENGINE_TIMEOUT_S="${ENGINE_TIMEOUT_S:-120}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/status.txt"

# Run from a neutral directory: the repository root's pdserve/ folder would shadow an installed
# pdserve.* (its sub-packages live in sibling folders, mapped by pyproject's package-dir).
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
if ! "$PY" -c "import pdserve.kernels" 2>/dev/null; then
    mkdir -p "$WORK/shim/pdserve"
    ln -s "$REPO"/pdserve/*.py "$WORK/shim/pdserve/"
    for pkg in serve kernels kvstore router benchmarks; do
        [ -d "$REPO/$pkg" ] && ln -s "$REPO/$pkg" "$WORK/shim/pdserve/$pkg"
    done
    export PYTHONPATH="$WORK/shim${PYTHONPATH:+:$PYTHONPATH}"
fi
unset TRITON_INTERPRET PDSERVE_ATTENTION_BACKEND
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"

{
    nvidia-smi || true
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

stage() {  # stage NAME LOGFILE TIMEOUT_S COMMAND...
    local name="$1" log="$2" limit="$3"
    shift 3
    echo "== $name" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc="${PIPESTATUS[0]}"
    echo "$name rc=$rc" | tee -a "$OUT/status.txt"
}

# --noconftest: the kernel tests need none of tests/conftest.py's model fixtures (which import
# transformers, possibly absent here).
if "$PY" -c "import pytest" 2>/dev/null; then
    stage tests "$OUT/tests.txt" "$TEST_TIMEOUT_S" "$PY" -m pytest -q -rs -p no:cacheprovider \
        --noconftest "$REPO/tests/test_kernels_triton.py" "$REPO/tests/test_kernels_reference.py" \
        "$REPO/tests/test_kernels_compile.py"
else
    echo "tests skipped: pytest is not installed (the benchmark still checks every" \
         "configuration against the references)" | tee -a "$OUT/status.txt"
fi

stage bench "$OUT/bench.txt" "$BENCH_TIMEOUT_S" "$PY" -m pdserve.benchmarks.kernels.bench_attention \
    --sweep-tiles --output "$OUT/bench_attention.json"

# The engine comparison needs tests/conftest.py's tiny models (transformers, tokenizers).
if "$PY" -c "import pytest, transformers, tokenizers, safetensors" 2>/dev/null; then
    stage engine "$OUT/engine.txt" "$ENGINE_TIMEOUT_S" "$PY" -m pytest -q -rs -p no:cacheprovider \
        "$REPO/tests/test_kernels_engine.py"
else
    echo "engine test skipped: needs pytest, transformers, tokenizers, safetensors" \
        | tee -a "$OUT/status.txt"
fi

cat "$OUT/status.txt"
! grep -q "rc=[1-9]" "$OUT/status.txt"
