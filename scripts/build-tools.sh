#!/usr/bin/env bash
# What building the binary needs besides cargo, from Debian's packages: a C
# compiler (ring and jemalloc are C) and make (jemalloc, the binary's
# allocator, is built from source with it).
set -euo pipefail
source "$(dirname "$0")/apt.sh"
apt_install make gcc
