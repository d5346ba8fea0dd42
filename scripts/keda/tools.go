//go:build tools

// Package tools names the KEDA commands scripts/keda.sh builds (its
// operator and its external-metrics API server), so that go mod tidy keeps
// everything they need.
package tools

import (
	_ "github.com/kedacore/keda/v2/cmd/adapter"
	_ "github.com/kedacore/keda/v2/cmd/operator"
)
