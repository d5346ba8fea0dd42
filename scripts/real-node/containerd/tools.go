//go:build tools

// Package tools names the containerd commands scripts/real-node.sh builds,
// so that go mod tidy keeps everything they need.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
