#!/usr/bin/env bash
# Provision the local Kubernetes control plane used by the tests and the demo.
#
# There is no kind/k3d/Docker here and no binary downloads outside the package
# registries, so we build kube-apiserver and kube-controller-manager v1.20.2
# from Debian bookworm's `kubernetes` source package and take etcd from
# Debian's etcd-server. The result is an "assets" directory (like envtest's
# KUBEBUILDER_ASSETS) holding `etcd`, `kube-apiserver` and
# `kube-controller-manager`.
#
# Usage: scripts/control-plane.sh [install|path|check]
#   install  build (or reuse) the binaries; prints the assets dir last (default)
#   path     print the assets dir if it is complete, exit 1 otherwise
#   check    verify the assets report v1.20.2
#
# Environment:
#   MODEL_RESIDENCY_ASSETS  use binaries already installed in this directory
#                           instead of building (checked, never modified)
#   MODEL_RESIDENCY_CACHE   cache root (default ~/.cache/model-residency)
set -euo pipefail

K8S_VERSION=v1.20.2
# Bump when the build recipe changes, so stale caches are rebuilt.
BUILD_REV=r2
DEB_VERSION='1.20.5+really1.20.2-1.1+deb12u1'
CACHE_ROOT=${MODEL_RESIDENCY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/model-residency}
ASSETS=${MODEL_RESIDENCY_ASSETS:-$CACHE_ROOT/control-plane/$K8S_VERSION-$BUILD_REV}
BINARIES=(etcd kube-apiserver kube-controller-manager)

log() { printf '[control-plane] %s\n' "$*" >&2; }
die() { printf '[control-plane] error: %s\n' "$*" >&2; exit 1; }

assets_ok() {
  local dir=$1
  for b in "${BINARIES[@]}"; do
    [ -x "$dir/$b" ] && [ -s "$dir/$b" ] || return 1
  done
  "$dir/kube-apiserver" --version 2>/dev/null | grep -q "Kubernetes $K8S_VERSION" || return 1
  "$dir/kube-controller-manager" --version 2>/dev/null | grep -q "Kubernetes $K8S_VERSION" || return 1
  "$dir/etcd" --version >/dev/null 2>&1 || return 1
}

need_root() {
  [ "$(id -u)" = 0 ] || die "installing packages needs root (or set MODEL_RESIDENCY_ASSETS to prebuilt binaries)"
}

apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  need_root
  log "apt-get install ${missing[*]}"
  if [ ! -f "$CACHE_ROOT/.apt-updated" ] || [ -n "$(find "$CACHE_ROOT/.apt-updated" -mmin +600 2>/dev/null)" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    touch "$CACHE_ROOT/.apt-updated"
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

ensure_deb_src() {
  local f=/etc/apt/sources.list.d/model-residency-src.sources
  [ -f "$f" ] && return 0
  need_root
  log "adding a deb-src entry for bookworm (needed by apt-get source)"
  cat >"$f" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  touch "$CACHE_ROOT/.apt-updated"
}

build() {
  local out=$1
  work=$(mktemp -d "$CACHE_ROOT/build.XXXXXX")
  # A failed or interrupted build leaves nothing half-made behind.
  trap 'rm -rf "${work:-}"' EXIT
  local t0=$SECONDS

  apt_install etcd-server golang-go rsync golang-github-modern-go-reflect2-dev dpkg-dev ca-certificates
  ensure_deb_src

  log "fetching Debian source package kubernetes=$DEB_VERSION"
  (cd "$work" && apt-get source -qq --download-only "kubernetes=$DEB_VERSION" >/dev/null) \
    || die "apt-get source kubernetes=$DEB_VERSION failed (is Debian's registry reachable?)"
  local tarball
  tarball=$(ls "$work"/kubernetes_*.orig.tar.* | head -n1)
  [ -n "$tarball" ] || die "no orig tarball in $work"
  log "unpacking $(basename "$tarball")"
  mkdir -p "$work/src"
  tar -xf "$tarball" -C "$work/src" --strip-components=1

  local tree=$work/src
  [ -d "$tree/vendor" ] || die "source tree has no vendor/ directory"
  # Go 1.19 segfaults in reflect2 v1.0.1 on the first custom-resource create:
  # swap in Debian's 1.0.2 sources.
  log "replacing vendored modern-go/reflect2 with Debian's 1.0.2"
  rm -rf "$tree/vendor/github.com/modern-go/reflect2"
  mkdir -p "$tree/vendor/github.com/modern-go/reflect2"
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2/. "$tree/vendor/github.com/modern-go/reflect2/"
  rm -f "$tree/vendor/github.com/modern-go/reflect2/go.mod" "$tree/vendor/github.com/modern-go/reflect2/go.sum"

  export GO111MODULE=off GOFLAGS= GOCACHE="$work/gocache"
  log "make generated_files (a few minutes)"
  (cd "$tree" && make generated_files >"$work/generated.log" 2>&1) || {
    tail -n 30 "$work/generated.log" >&2; die "make generated_files failed"; }
  rm -rf "$tree/_output/bin"

  mkdir -p "$work/gopath/src/k8s.io"
  ln -s "$tree" "$work/gopath/src/k8s.io/kubernetes"
  export GOPATH="$work/gopath:$tree/_output/local/go"
  # Stamp the version wherever it is read: --version uses component-base,
  # the /version endpoint client-go's copy. Unknown packages are ignored.
  local ldflags="-s -w" pkg
  for pkg in k8s.io/kubernetes/vendor/k8s.io/component-base/version \
             k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version \
             k8s.io/kubernetes/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=20 -X $pkg.gitTreeState=clean"
  done
  mkdir -p "$work/bin"
  for b in kube-apiserver kube-controller-manager; do
    log "go build $b (5-7 minutes on 2 cores)"
    (cd "$work/gopath/src/k8s.io/kubernetes" && go build -ldflags "$ldflags" -o "$work/bin/$b" "./cmd/$b") \
      || die "go build $b failed"
  done
  ln -s "$(command -v etcd || echo /usr/bin/etcd)" "$work/bin/etcd"
  assets_ok "$work/bin" || die "built binaries do not report $K8S_VERSION"
  mkdir -p "$(dirname "$out")"
  rm -rf "$out"
  mv "$work/bin" "$out"
  rm -rf "$work"
  # Older recipes' entries are dead weight (150 MB each).
  for old in "$(dirname "$out")"/*; do
    [ "$old" = "$out" ] || rm -rf "$old"
  done
  log "built in $((SECONDS - t0)) s -> $out"
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
  rm -rf "$CACHE_ROOT"/build.*
  # etcd comes from the Debian package; make sure it is still installed.
  if [ -L "$ASSETS/etcd" ] && [ ! -e "$ASSETS/etcd" ]; then apt_install etcd-server; fi
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
  *) die "usage: $0 [install|path|check]" ;;
esac
