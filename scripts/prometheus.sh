#!/usr/bin/env bash
# Debian's Prometheus (with promtool), which the demo starts on loopback at
# its end to check the chart's dashboard and alerts against its processes
# (scripts/keda.sh installs the same package for the autoscaling test).
# Installs it if missing; prints its path.
set -euo pipefail
source "$(dirname "$0")/apt.sh"
[ -x /usr/bin/prometheus ] || apt_install prometheus >&2
command -v prometheus
