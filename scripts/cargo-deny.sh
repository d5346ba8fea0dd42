#!/usr/bin/env bash
# Provides cargo-deny for the test command's supply-chain check (deny.toml:
# licences, bans, sources). Built once from crates.io with `cargo install
# --locked` (2 min 11 s on this 2-core machine) and cached under
# ~/.cache/model-residency/cargo-deny/; prints the binary's path last.
# RustSec advisories are not checked: their database is a GitHub repository,
# which these machines cannot reach (docs/limits.md).
#
# Environment: CARGO_DENY (use this binary instead), MODEL_RESIDENCY_CACHE.
set -euo pipefail

if [ -n "${CARGO_DENY:-}" ]; then "$CARGO_DENY" --version >/dev/null && echo "$CARGO_DENY" && exit 0; fi

VERSION=0.20.2
CACHE_ROOT=${MODEL_RESIDENCY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/model-residency}
ROOT=$CACHE_ROOT/cargo-deny/$VERSION
log() { printf '[cargo-deny] %s\n' "$*" >&2; }

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/cargo-deny.lock"
flock 9
if [ -x "$ROOT/bin/cargo-deny" ] && "$ROOT/bin/cargo-deny" --version 2>/dev/null | grep -q "$VERSION"; then
  echo "$ROOT/bin/cargo-deny"; exit 0
fi
log "building cargo-deny $VERSION from crates.io (once)"
# Its own target dir, removed after: the binary is all that is kept.
build=$(mktemp -d "$CACHE_ROOT/cargo-deny-build.XXXXXX")
trap 'rm -rf "$build"' EXIT
CARGO_TARGET_DIR=$build CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2} CARGO_INCREMENTAL=0 \
  cargo install --quiet --locked --root "$ROOT" --version "$VERSION" cargo-deny >&2
"$ROOT/bin/cargo-deny" --version | grep -q "$VERSION" || { log "unexpected cargo-deny version"; exit 1; }
log "cargo-deny $VERSION cached at $ROOT/bin/cargo-deny"
echo "$ROOT/bin/cargo-deny"
