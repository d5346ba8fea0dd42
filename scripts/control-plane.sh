#!/usr/bin/env bash
# Provision the local Kubernetes control plane used by the tests and the demo.
#
# There is no kind/k3d/Docker here and no binary downloads outside the package
# registries, so kube-apiserver, kube-controller-manager and kube-scheduler
# are built from the k8s.io/kubernetes Go module (through the Go module
# proxy) and etcd from go.etcd.io/etcd/server/v3, each pinned by a small Go
# module of ours under scripts/control-plane/ (go.mod and go.sum only; see
# pin.sh). The result is an "assets" directory (like envtest's
# KUBEBUILDER_ASSETS) holding `etcd`, `kube-apiserver`,
# `kube-controller-manager`, `kube-scheduler` and a `kubectl` of the same
# version (so the tests' kubectl is within its version skew).
#
# Usage: scripts/control-plane.sh [install|path|check|version]
#   install  build (or reuse) the binaries; prints the assets dir last (default)
#   path     print the assets dir if it is complete, exit 1 otherwise
#   check    verify the assets report the version asked for
#   version  print the Kubernetes version that would be used
#
# Environment:
#   MODEL_RESIDENCY_K8S_VERSION  the Kubernetes release: 1.37.2 (default),
#                                1.34.4, or 1.34.x for the newest 1.34 pinned
#   MODEL_RESIDENCY_ASSETS       use binaries already installed in this
#                                directory instead of building (checked, never
#                                modified)
#   MODEL_RESIDENCY_CACHE        cache root (default ~/.cache/model-residency)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PINS=$HERE/control-plane
DEFAULT_VERSION=v1.37.2
ETCD_VERSION=v3.6.16
# Bump when the build recipe changes, so stale caches are rebuilt.
BUILD_REV=go1
CACHE_ROOT=${MODEL_RESIDENCY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/model-residency}
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)

log() { printf '[control-plane] %s\n' "$*" >&2; }
die() { printf '[control-plane] error: %s\n' "$*" >&2; exit 1; }

# The pinned release a MODEL_RESIDENCY_K8S_VERSION names: exact (1.34.4,
# v1.34.4) or the newest pinned patch of a minor (1.34.x, 1.34).
resolve_version() {
  local want=${MODEL_RESIDENCY_K8S_VERSION:-$DEFAULT_VERSION}
  want=v${want#v}
  local pinned
  pinned=$(cd "$PINS" && ls -d kubernetes-v1.* 2>/dev/null | sed 's/^kubernetes-//' | sort -V)
  if [[ $want =~ ^v1\.[0-9]+\.[0-9]+$ ]]; then
    grep -qx "$want" <<<"$pinned" && { echo "$want"; return; }
  elif [[ $want =~ ^(v1\.[0-9]+)(\.x)?$ ]]; then
    local newest
    newest=$(grep "^${BASH_REMATCH[1]}\." <<<"$pinned" | tail -n1)
    [ -n "$newest" ] && { echo "$newest"; return; }
  fi
  die "MODEL_RESIDENCY_K8S_VERSION=${MODEL_RESIDENCY_K8S_VERSION:-} is not pinned; pinned: $(echo $pinned). Add one with scripts/control-plane/pin.sh"
}

K8S_VERSION=$(resolve_version)
ASSETS=${MODEL_RESIDENCY_ASSETS:-$CACHE_ROOT/control-plane/$K8S_VERSION-$BUILD_REV}
ETCD_DIR=$CACHE_ROOT/control-plane/etcd-$ETCD_VERSION-$BUILD_REV

# Whether a command's output has the line. The output is read whole first:
# `cmd | grep -q` under pipefail fails now and then, when grep exits at the
# first line and the command's next write (kubectl's Kustomize line) gets
# SIGPIPE; that made good caches look broken and rebuilt them.
prints_line() {
  local line=$1 out
  shift
  out=$("$@" 2>/dev/null) || return 1
  grep -qxF -- "$line" <<<"$out"
}

assets_ok() {
  local dir=$1 b
  for b in "${BINARIES[@]}"; do
    [ -x "$dir/$b" ] && [ -s "$dir/$b" ] || return 1
  done
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    prints_line "Kubernetes $K8S_VERSION" "$dir/$b" --version || return 1
  done
  prints_line "Client Version: $K8S_VERSION" "$dir/kubectl" version --client || return 1
  "$dir/etcd" --version >/dev/null 2>&1 || return 1
}

need_go() {
  command -v go >/dev/null || die "Go is needed to build the control plane (Go 1.26 is installed on this machine kind); or set MODEL_RESIDENCY_ASSETS to prebuilt binaries"
  local v
  v=$(go env GOVERSION)
  [[ $v =~ ^go1\.(2[6-9]|[3-9][0-9]) ]] || die "Go $v is too old; the pinned modules say go 1.26"
}

# Only the pinned module graph, only this Go, nothing written into the repo.
go_env() {
  export CGO_ENABLED=0 GOFLAGS=-mod=readonly GOTOOLCHAIN=local
}

build_etcd() {
  [ -x "$ETCD_DIR/etcd" ] && prints_line "etcd Version: ${ETCD_VERSION#v}" "$ETCD_DIR/etcd" --version && return 0
  local t0=$SECONDS work
  work=$(mktemp -d "$CACHE_ROOT/build-control-plane.XXXXXX")
  log "go build etcd $ETCD_VERSION (about 2 minutes on 2 cores)"
  (cd "$PINS/etcd" && go build -trimpath -ldflags "-s -w" -o "$work/etcd" go.etcd.io/etcd/server/v3) \
    || { rm -rf "$work"; die "go build etcd failed (is the Go module proxy reachable?)"; }
  chmod 755 "$work"
  mkdir -p "$(dirname "$ETCD_DIR")"
  rm -rf "$ETCD_DIR"
  mv "$work" "$ETCD_DIR"
  log "etcd built in $((SECONDS - t0)) s -> $ETCD_DIR"
}

build() {
  local out=$1 t0=$SECONDS
  local mod=$PINS/kubernetes-$K8S_VERSION
  [ -f "$mod/go.mod" ] || die "no pinned module for $K8S_VERSION at $mod"
  need_go
  go_env
  build_etcd
  work=$(mktemp -d "$CACHE_ROOT/build-control-plane.XXXXXX")
  # A failed or interrupted build leaves nothing half-made behind.
  trap 'rm -rf "${work:-}"' EXIT
  local minor=${K8S_VERSION#v1.}
  minor=${minor%%.*}
  # Stamp the version wherever it is read: --version uses component-base,
  # the /version endpoint client-go's copy.
  local ldflags="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  mkdir -p "$work/bin"
  log "go build kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $K8S_VERSION (about 12 minutes on 2 cores when nothing is cached)"
  (cd "$mod" && go build -trimpath -ldflags "$ldflags" -o "$work/bin/" \
      k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler \
      k8s.io/kubernetes/cmd/kubectl) \
    || die "go build of Kubernetes $K8S_VERSION failed (is the Go module proxy reachable?)"
  ln -s "$ETCD_DIR/etcd" "$work/bin/etcd"
  assets_ok "$work/bin" || die "built binaries do not report $K8S_VERSION"
  mkdir -p "$(dirname "$out")"
  rm -rf "$out"
  mv "$work/bin" "$out"
  rm -rf "$work"
  # Other recipes' entries of this version, and the Debian-built v1.20
  # ones, are dead weight (about 300 MB each); other versions stay.
  local old
  for old in "$(dirname "$out")"/"$K8S_VERSION"-* "$(dirname "$out")"/v1.20.*; do
    [ -e "$old" ] && [ "$old" != "$out" ] && rm -rf "$old"
  done
  log "built in $((SECONDS - t0)) s ($(du -sh "$out/" | cut -f1) of binaries) -> $out"
}

install() {
  if [ -n "${MODEL_RESIDENCY_ASSETS:-}" ]; then
    assets_ok "$ASSETS" || die "MODEL_RESIDENCY_ASSETS=$ASSETS lacks working ${BINARIES[*]} ($K8S_VERSION)"
    echo "$ASSETS"; return 0
  fi
  mkdir -p "$CACHE_ROOT"
  # Serialise concurrent installs; the loser finds the winner's cache.
  exec 9>"$CACHE_ROOT/control-plane.lock"
  flock 9
  # Builds killed before their trap ran (kill -9, power loss) leave these.
  rm -rf "$CACHE_ROOT"/build-control-plane.*
  if assets_ok "$ASSETS"; then
    log "cached control plane $K8S_VERSION at $ASSETS"
  else
    build "$ASSETS"
  fi
  echo "$ASSETS"
}

case "${1:-install}" in
  install) install ;;
  path) assets_ok "$ASSETS" && echo "$ASSETS" ;;
  check) assets_ok "$ASSETS" && log "ok: $ASSETS" ;;
  version) echo "$K8S_VERSION" ;;
  *) die "usage: $0 [install|path|check|version]" ;;
esac
