#!/usr/bin/env bash
# What building the binary needs besides cargo, from Debian's packages: a C
# compiler (ring and jemalloc are C) and make (jemalloc, the binary's
# allocator, is built from source with it).
set -euo pipefail
missing=()
command -v make >/dev/null || missing+=(make)
command -v cc >/dev/null || missing+=(gcc)
[ ${#missing[@]} -eq 0 ] && exit 0
[ "$(id -u)" = 0 ] || { echo "build-tools: installing ${missing[*]} needs root" >&2; exit 1; }
echo "[build-tools] apt-get install ${missing[*]}" >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
