#!/usr/bin/env bash
# The README's "run it" command: the operator end to end on a local control
# plane (built once and cached), explaining itself. Cleans up after itself.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
MODEL_RESIDENCY_ASSETS=$(bash scripts/control-plane.sh install)
export MODEL_RESIDENCY_ASSETS
HELM=$(bash scripts/helm.sh)
export HELM
# kubectl comes with the control plane (same version); else the PATH's.
[ -x "$MODEL_RESIDENCY_ASSETS/kubectl" ] || command -v kubectl >/dev/null \
  || echo "note: kubectl not found; the demo prints its own views only" >&2
# The local OCI registry the disk step pulls llama's weights from.
bash scripts/registry.sh >/dev/null \
  || echo "note: no docker-registry; the disk step fetches from an http store instead" >&2
# The real node (kubelet, containerd, the fake-GPU DRA plugin; about 2.5
# minutes after the control plane's build, cached): the demo runs its pods
# there, or on the kubelet stand-in when it cannot (it says why).
MODEL_RESIDENCY_REAL_NODE=$(bash scripts/real-node.sh install) && export MODEL_RESIDENCY_REAL_NODE \
  || echo "note: no real node; the demo runs on the kubelet stand-in" >&2
MODEL_RESIDENCY_PROMETHEUS=$(bash scripts/prometheus.sh) && export MODEL_RESIDENCY_PROMETHEUS \
  || echo "note: no Prometheus; the demo skips its dashboard and alerts check" >&2
bash scripts/build-tools.sh
echo "[demo] building model-residency (release)..." >&2
cargo build --release --locked --quiet
exec "${CARGO_TARGET_DIR:-target}/release/model-residency" demo "$@"
