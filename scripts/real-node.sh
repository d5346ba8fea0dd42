#!/usr/bin/env bash
# Provision the real node the tests and the demo can run pods on: the
# kubelet and kube-proxy of the control plane's Kubernetes release,
# containerd with its runc shim and ctr, and our fake-GPU DRA kubelet plugin;
# runc, the CNI plugins and nft (kube-proxy's nftables mode) come from Debian.
#
# Like the control plane, everything is built from Go modules through the
# module proxy, pinned by small modules of ours (go.mod and go.sum only):
#   kubelet      the control plane's pin, scripts/control-plane/kubernetes-*
#   kube-proxy   the same pin (Services on the node: nftables mode)
#   containerd   scripts/real-node/containerd (v2.4.2: containerd,
#                containerd-shim-runc-v2, ctr)
#   gpu-plugin   scripts/real-node/gpu-plugin, our own ~200 lines on
#                k8s.io/dynamic-resource-allocation: it publishes the same
#                gpu.nvidia.com devices as the kubelet stand-in and writes a
#                CDI spec per claim (test infrastructure, not the product)
# The binaries land in one cache directory that `path` prints.
#
# Usage: scripts/real-node.sh [install|path|check]
#
# Environment: MODEL_RESIDENCY_CACHE (default ~/.cache/model-residency).
# Costs on 2 cores: about 2.5 minutes on the Go build cache the control
# plane's build leaves, about 17 minutes with an empty one.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
K8S_VERSION=v1.37.2
CONTAINERD_VERSION=v2.4.2
# Bump when the build recipe changes, so stale caches are rebuilt.
BUILD_REV=go2
CACHE_ROOT=${MODEL_RESIDENCY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/model-residency}
OUT=$CACHE_ROOT/real-node/$K8S_VERSION-containerd-$CONTAINERD_VERSION-$BUILD_REV
BINARIES=(kubelet kube-proxy containerd containerd-shim-runc-v2 ctr gpu-plugin)
PACKAGES=(runc containernetworking-plugins iproute2 nftables)

log() { printf '[real-node] %s\n' "$*" >&2; }
die() { printf '[real-node] error: %s\n' "$*" >&2; exit 1; }

prints_line() {
  local line=$1 out
  shift
  out=$("$@" 2>/dev/null) || return 1
  grep -qF -- "$line" <<<"$out"
}

binary_ok() {
  local b=$1
  [ -x "$OUT/$b" ] && [ -s "$OUT/$b" ] || return 1
  case $b in
    kubelet | kube-proxy) prints_line "Kubernetes $K8S_VERSION" "$OUT/$b" --version ;;
    containerd) prints_line "$CONTAINERD_VERSION" "$OUT/containerd" --version ;;
    ctr) prints_line "$CONTAINERD_VERSION" "$OUT/ctr" --version ;;
    containerd-shim-runc-v2) prints_line "$CONTAINERD_VERSION" "$OUT/containerd-shim-runc-v2" -v ;;
    # --help exits 2 (Go's flag package) and writes to stderr.
    # The per-device variables came later: an older build is rebuilt.
    gpu-plugin) local help; help=$("$OUT/gpu-plugin" --help 2>&1 || true); grep -qF "per-device variables FAKE_GPU_DEVICE_" <<<"$help" ;;
  esac
}

packages_ok() {
  [ -x /usr/sbin/runc ] && [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] \
    && [ -x /usr/lib/cni/loopback ] && command -v ip >/dev/null && [ -x /usr/sbin/nft ]
}

all_ok() {
  local b
  for b in "${BINARIES[@]}"; do binary_ok "$b" || return 1; done
  packages_ok
}

go_env() { export CGO_ENABLED=0 GOFLAGS=-mod=readonly GOTOOLCHAIN=local; }

# go build into a scratch directory, then move the named binaries in: a
# failed or interrupted build leaves nothing half-made in the cache.
build_into_cache() {
  local dir=$1 what=$2
  shift 2
  local work t0=$SECONDS
  work=$(mktemp -d "$CACHE_ROOT/build-real-node.XXXXXX")
  log "go build $what"
  (cd "$dir" && go build -trimpath -o "$work/" "$@") || { rm -rf "$work"; die "go build $what failed (is the Go module proxy reachable?)"; }
  mkdir -p "$OUT"
  local f
  for f in "$work"/*; do mv -f "$f" "$OUT/"; done
  rm -rf "$work"
  log "$what built in $((SECONDS - t0)) s"
}

# The kubelet and kube-proxy, from the control plane's pinned module.
build_node_commands() {
  local minor=${K8S_VERSION#v1.} ldflags="-s -w" pkg
  minor=${minor%%.*}
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  build_into_cache "$HERE/control-plane/kubernetes-$K8S_VERSION" "kubelet and kube-proxy $K8S_VERSION (about 1.5 minutes after the control plane's build, 15 cold)" \
    -ldflags "$ldflags" k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
}

build_containerd() {
  local p=github.com/containerd/containerd/v2
  local ld="-s -w -X $p/version.Version=$CONTAINERD_VERSION -X $p/version.Revision=$CONTAINERD_VERSION-gomod -X $p/version.Package=$p"
  # btrfs and devmapper snapshotters need cgo; only overlayfs is used.
  build_into_cache "$HERE/real-node/containerd" "containerd $CONTAINERD_VERSION and ctr (about 1.5 minutes warm, 3 cold)" \
    -tags "urfave_cli_no_docs no_btrfs no_devmapper no_zfs" -ldflags "$ld" "$p/cmd/containerd" "$p/cmd/ctr"
  build_into_cache "$HERE/real-node/containerd" "containerd-shim-runc-v2 $CONTAINERD_VERSION" \
    -tags "urfave_cli_no_docs no_grpc" -ldflags "$ld" "$p/cmd/containerd-shim-runc-v2"
}

build_gpu_plugin() {
  build_into_cache "$HERE/real-node/gpu-plugin" "gpu-plugin (seconds warm)" -ldflags "-s -w" .
}

install() {
  mkdir -p "$CACHE_ROOT"
  exec 9>"$CACHE_ROOT/real-node.lock"
  flock 9
  # shellcheck source=apt.sh
  . "$HERE/apt.sh"
  packages_ok || apt_install "${PACKAGES[@]}" || die "could not install ${PACKAGES[*]}"
  command -v go >/dev/null || die "Go is needed to build the real node (Go 1.26 is installed on this machine kind)"
  go_env
  { binary_ok kubelet && binary_ok kube-proxy; } || build_node_commands
  { binary_ok containerd && binary_ok ctr && binary_ok containerd-shim-runc-v2; } || build_containerd
  binary_ok gpu-plugin || build_gpu_plugin
  all_ok || die "the built binaries do not report $K8S_VERSION / $CONTAINERD_VERSION"
  log "real node at $OUT ($(du -sh "$OUT/" | cut -f1))"
  echo "$OUT"
}

case "${1:-install}" in
  install) install ;;
  path) all_ok && echo "$OUT" ;;
  check) all_ok && log "ok: $OUT" ;;
  *) die "usage: $0 [install|path|check]" ;;
esac
