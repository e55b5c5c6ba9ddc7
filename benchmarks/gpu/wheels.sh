#!/usr/bin/env bash
# The wheels benchmarks/gpu/run.sh needs on the GPU image and that the image lacks, downloaded
# here into ./.whl (git-ignored) for Python 3.12 on x86-64 Linux, one pinned version each:
#
#   bash benchmarks/gpu/wheels.sh            # then carry .whl to the GPU machine
#
# PY_VERSION=3.11 WHEELS_DIR=... fetches the same versions for another Python (run.sh --rehearse
# on a machine whose torch wheel is for 3.11).
#
# The image has torch 2.11+cu130, Triton 3.6, transformers, numpy, httpx, msgpack, pytest,
# uvloop, anyio, click, h11, protobuf, requests, attrs (the "Python packages already there" list
# of the device's KINDS.md) but none of these. Versions are the ones pdserve's tests pass with
# here (pip check clean); --no-deps, so every dependency the image lacks is named below.
# Nothing the image has is carried: KINDS_MD=path/to/KINDS.md makes the script refuse one.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${WHEELS_DIR:-$REPO/.whl}"
PY="${PYTHON:-python3}"
PY_VERSION="${PY_VERSION:-3.12}"  # the GPU image's
LIMIT_BYTES=$((64 << 20))  # the device's carry limit: the whole working tree, wheels included

WHEELS=(
    pyzmq==27.3.0                       # pdserve.security, every process's messaging
    fastapi==0.165.0 starlette==1.10.0  # the HTTP servers
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    uvicorn==0.55.0 httptools==0.9.0    # uvloop is in the image
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2  # structured outputs
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
    opentelemetry-exporter-http-transport==0.66b2 googleapis-common-protos==1.76.0
    pytest-asyncio==1.5.0               # asyncio_mode = "auto" in pyproject.toml
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
    rpds-py==2026.9.1                   # structured-output tests validate against schemas
)

if [ -n "${KINDS_MD:-}" ]; then  # refuse a package the image already has
    image="$(grep -A2 '^## Python packages already there' "$KINDS_MD" | tail -1)"
    for spec in "${WHEELS[@]}"; do
        name="${spec%%==*}"
        if grep -qiE "(: |, )$name(,|\.$)" <<< "$image"; then
            echo "refusing $name: the image has it" >&2
            exit 1
        fi
    done
fi

mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "$PY_VERSION" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"

# one version of each (a stale second one stops the --no-index install there)
names="$(ls "$DEST" | sed -E 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort)"
if [ -n "$(uniq -d <<< "$names")" ]; then
    echo "two versions of: $(uniq -d <<< "$names" | tr '\n' ' ')in $DEST: remove the old" >&2
    exit 1
fi
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $((total / 1024)) KiB in $DEST" \
    "(carry limit $((LIMIT_BYTES >> 20)) MiB with the working tree)"
if [ "$total" -ge "$LIMIT_BYTES" ]; then
    echo "over the carry limit" >&2
    exit 1
fi
