#!/usr/bin/env bash
# deploy/render.sh OUTDIR [OVERLAY]: pdserve's Kubernetes deployment as plain YAML, one file per
# object in OUTDIR, in apply order (`kubectl apply -f OUTDIR`). OVERLAY: gpu (the default), cpu,
# or autoscale (gpu + KEDA). Needs no kubectl: deploy/render.py does the kustomize part.
#
# The cluster key (the Secret pdserve-cluster-key) is read from $CLUSTER_KEY_FILE, default
# deploy/base/cluster.key; when that file is missing it is made first (`pdserve keygen`). Keep
# it: pods started under one key cannot talk to pods under another.
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: deploy/render.sh OUTDIR [gpu|cpu|autoscale]" >&2
    exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
out="$1"
overlay="${2:-gpu}"
python="${PYTHON:-python3}"
if [ ! -d "$here/overlays/$overlay" ]; then
    echo "render.sh: no overlay '$overlay' (have: $(ls "$here/overlays" | tr '\n' ' '))" >&2
    exit 2
fi
key="${CLUSTER_KEY_FILE:-$here/base/cluster.key}"
if [ ! -f "$key" ]; then
    "$python" -m pdserve.app.cli keygen "$key" >&2
fi
exec "$python" "$here/render.py" "$here/overlays/$overlay" "$out" --file "cluster.key=$key"
