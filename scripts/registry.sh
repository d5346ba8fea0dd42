#!/usr/bin/env bash
# The OCI registry the registry tests, the artifact bench and the demo
# start on loopback: Debian's docker-registry (the CNCF distribution
# registry), with htpasswd (apache2-utils) for its basic auth and openssl
# for its certificates. Installs what is missing; prints the registry's path.
set -euo pipefail
source "$(dirname "$0")/apt.sh"
apt_install docker-registry apache2-utils openssl >&2
command -v docker-registry
