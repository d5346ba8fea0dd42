#!/usr/bin/env bash
# Provision the autoscaling stack the KEDA test runs against: KEDA's
# operator and its external-metrics API server (the "adapter"), built from
# the github.com/kedacore/keda/v2 Go module through the module proxy and
# pinned by scripts/keda (go.mod and go.sum only, as the control plane's
# pins), KEDA's CRDs from that module, and Prometheus from Debian.
#
# The binaries and CRDs land in one cache directory that `path` prints:
#   keda          the operator (ScaledObjects, HPAs, the 0 <-> 1 activation,
#                 the gRPC metrics service the adapter asks)
#   keda-adapter  the external.metrics.k8s.io API server behind the
#                 aggregation layer
#   crds/         keda.sh and eventing.keda.sh CRDs of the same version
# Prometheus is /usr/bin/prometheus (no service is started at install).
#
# Usage: scripts/keda.sh [install|path|check]
#
# Environment: MODEL_RESIDENCY_CACHE (default ~/.cache/model-residency).
# Costs on 2 cores: about 8 minutes of go build (KEDA links every scaler's
# cloud SDK), about 150 MB of binaries; seconds when cached.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
KEDA_VERSION=v2.21.0
# Bump when the build recipe changes, so stale caches are rebuilt.
BUILD_REV=go1
CACHE_ROOT=${MODEL_RESIDENCY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/model-residency}
OUT=$CACHE_ROOT/keda/$KEDA_VERSION-$BUILD_REV
MODULE=github.com/kedacore/keda/v2
PACKAGES=(prometheus)

log() { printf '[keda] %s\n' "$*" >&2; }
die() { printf '[keda] error: %s\n' "$*" >&2; exit 1; }

# Neither binary has --version; --help names a flag only it has (and exits
# non-zero, as pflag does on --help).
binary_ok() {
  local b=$1 flag=$2 help
  [ -x "$OUT/$b" ] && [ -s "$OUT/$b" ] || return 1
  help=$("$OUT/$b" --help 2>&1 || true)
  grep -qF -- "$flag" <<<"$help"
}

keda_ok() {
  binary_ok keda --metrics-service-bind-address \
    && binary_ok keda-adapter --metrics-service-address \
    && [ -s "$OUT/crds/keda.sh_scaledobjects.yaml" ]
}

all_ok() { keda_ok && [ -x /usr/bin/prometheus ]; }

build() {
  command -v go >/dev/null || die "Go is needed to build KEDA (Go 1.26 is installed on this machine kind)"
  export CGO_ENABLED=0 GOFLAGS=-mod=readonly GOTOOLCHAIN=local
  local work t0=$SECONDS
  work=$(mktemp -d "$CACHE_ROOT/build-keda.XXXXXX")
  trap 'rm -rf "${work:-}"' EXIT
  log "go build KEDA $KEDA_VERSION operator and adapter (about 8 minutes on 2 cores)"
  local ld="-s -w -X $MODULE/version.Version=${KEDA_VERSION#v} -X $MODULE/version.GitCommit=$KEDA_VERSION-gomod"
  (cd "$HERE/keda" && go build -trimpath -ldflags "$ld" -o "$work/keda" "$MODULE/cmd/operator" \
      && go build -trimpath -ldflags "$ld" -o "$work/keda-adapter" "$MODULE/cmd/adapter") \
    || die "go build of KEDA $KEDA_VERSION failed (is the Go module proxy reachable?)"
  # The CRDs of the same version, from the module the build used.
  local src
  src=$(cd "$HERE/keda" && go list -m -f '{{.Dir}}' "$MODULE")
  mkdir -p "$work/crds"
  cp "$src"/config/crd/bases/*.yaml "$work/crds/"
  chmod -R u+w "$work" && chmod 755 "$work"
  mkdir -p "$(dirname "$OUT")"
  rm -rf "$OUT"
  mv "$work" "$OUT"
  log "built in $((SECONDS - t0)) s ($(du -sh "$OUT/" | cut -f1)) -> $OUT"
}

install() {
  mkdir -p "$CACHE_ROOT"
  exec 9>"$CACHE_ROOT/keda.lock"
  flock 9
  rm -rf "$CACHE_ROOT"/build-keda.*
  # shellcheck source=apt.sh
  . "$HERE/apt.sh"
  [ -x /usr/bin/prometheus ] || apt_install "${PACKAGES[@]}" || die "could not install ${PACKAGES[*]}"
  keda_ok || build
  all_ok || die "KEDA at $OUT or /usr/bin/prometheus does not work"
  echo "$OUT"
}

case "${1:-install}" in
  install) install ;;
  path) all_ok && echo "$OUT" ;;
  check) all_ok && log "ok: $OUT" ;;
  *) die "usage: $0 [install|path|check]" ;;
esac
