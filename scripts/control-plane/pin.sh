#!/usr/bin/env bash
# Write (or refresh) the Go module that pins one Kubernetes release, for
# scripts/control-plane.sh to build from. Run by a developer when adding a
# version; its go.mod and go.sum are committed, never Kubernetes' code.
#
# Usage: scripts/control-plane/pin.sh v1.37.2
#
# k8s.io/kubernetes requires its staging modules (k8s.io/api, apiserver,
# client-go, ...) at v0.0.0 and replaces them with ./staging paths that only
# exist in its own repository; a module that imports it must replace each one
# with the release tagged for it (v1.37.2 -> v0.37.2). The list is read from
# that release's own go.mod, so it is always the whole list.
set -euo pipefail
version=${1:?usage: $0 vMAJOR.MINOR.PATCH}
[[ $version =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] || { echo "not a release: $version" >&2; exit 1; }
staging=v0.${BASH_REMATCH[1]}.${BASH_REMATCH[2]}
dir=$(dirname "$0")/kubernetes-$version
mkdir -p "$dir"
cd "$dir"
export GOFLAGS=-mod=mod
upstream=$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')
[ -s "$upstream" ] || { echo "k8s.io/kubernetes@$version did not resolve" >&2; exit 1; }
{
  echo "module model-residency.local/control-plane/kubernetes"
  echo
  echo "go 1.26.0"
  echo
  echo "require k8s.io/kubernetes $version"
  echo
  sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/src/.*#\1#p' "$upstream" |
    while read -r m; do echo "replace $m => $m $staging"; done
} >go.mod
n=$(grep -c '^replace' go.mod)
[ "$n" -ge 25 ] || { echo "only $n staging modules in $upstream" >&2; exit 1; }
# tidy needs an importer of the commands to keep their dependencies.
cat >tools.go <<'GO'
//go:build tools

// Package tools names the commands scripts/control-plane.sh builds, so that
// go mod tidy keeps everything they need (the kubelet and kube-proxy are
// scripts/real-node.sh's).
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
go mod tidy
echo "pinned k8s.io/kubernetes $version with $n staging modules at $staging in $dir" >&2
