#!/usr/bin/env bash
# Provision the Gateway API Inference Extension's released InferencePool
# CRDs, which the operator's pools are tested against: each version's
# config/crd/bases/inference.networking.k8s.io_inferencepools.yaml from the
# sigs.k8s.io/gateway-api-inference-extension Go module (through the Go
# module proxy; nothing is built). Prints the directory holding one
# <version>.yaml per version; beside them, gateway-api-<version>.yaml, the
# Gateway API's standard Gateway, GatewayClass and HTTPRoute CRDs from the
# sigs.k8s.io/gateway-api module, which the operator's routes are tested
# against.
#
# Environment: MODEL_RESIDENCY_CACHE (default ~/.cache/model-residency).
# Costs: two module downloads (a few MB) the first time; none after.
set -euo pipefail

MODULE=sigs.k8s.io/gateway-api-inference-extension
# v1.5.0 requires endpointPickerRef; v1.6.0 made it optional.
VERSIONS=(v1.5.0 v1.6.0)
CRD=config/crd/bases/inference.networking.k8s.io_inferencepools.yaml
GATEWAY_MODULE=sigs.k8s.io/gateway-api
# The newest that builds with this machine's Go 1.26 (v1.7.0 needs 1.27).
GATEWAY_VERSION=v1.6.3
GATEWAY_CRDS=(gatewayclasses gateways httproutes)
CACHE_ROOT=${MODEL_RESIDENCY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/model-residency}
OUT=$CACHE_ROOT/inference-extension

log() { printf '[inference-extension] %s\n' "$*" >&2; }
die() { printf '[inference-extension] error: %s\n' "$*" >&2; exit 1; }

all_ok() {
  local v
  for v in "${VERSIONS[@]}"; do
    grep -q "kind: InferencePool$" "$OUT/$v.yaml" 2>/dev/null || return 1
  done
  grep -q "kind: HTTPRoute$" "$OUT/gateway-api-$GATEWAY_VERSION.yaml" 2>/dev/null
}

# The module's directory in the Go module cache (downloaded if need be).
module_dir() {
  (cd "$work" && GOFLAGS=-mod=mod GOTOOLCHAIN=local go mod download -json "$1" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
}

if ! all_ok; then
  command -v go >/dev/null || die "Go is needed to fetch the extension's module"
  mkdir -p "$OUT"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && go mod init fetch >/dev/null 2>&1)
  for v in "${VERSIONS[@]}"; do
    dir=$(module_dir "$MODULE@$v")
    [ -n "$dir" ] && [ -s "$dir/$CRD" ] || die "no $CRD in $MODULE@$v (is the Go module proxy reachable?)"
    cp "$dir/$CRD" "$OUT/$v.yaml.tmp" && mv "$OUT/$v.yaml.tmp" "$OUT/$v.yaml"
    log "$MODULE@$v: InferencePool CRD -> $OUT/$v.yaml"
  done
  dir=$(module_dir "$GATEWAY_MODULE@$GATEWAY_VERSION")
  out=$OUT/gateway-api-$GATEWAY_VERSION.yaml
  : > "$out.tmp"
  for crd in "${GATEWAY_CRDS[@]}"; do
    file=$dir/config/crd/standard/gateway.networking.k8s.io_$crd.yaml
    [ -s "$file" ] || die "no $file in $GATEWAY_MODULE@$GATEWAY_VERSION (is the Go module proxy reachable?)"
    { echo "---"; cat "$file"; } >> "$out.tmp"
  done
  mv "$out.tmp" "$out"
  log "$GATEWAY_MODULE@$GATEWAY_VERSION: ${GATEWAY_CRDS[*]} CRDs -> $out"
  all_ok || die "the CRDs at $OUT are not InferencePool and HTTPRoute CRDs"
fi
echo "$OUT"
