#!/usr/bin/env bash
# The RustSec advisory database for `cargo deny check advisories`, from
# the shared snapshot (the database's GitHub repository is out of reach
# here): the bundle cloned once under ~/.cache/model-residency/advisory-db,
# in the directory cargo-deny derives from the default database URL
# (deny.toml's db-path points there). Prints the newest advisory's date:
# nothing published after it is known. The
# bundle: $MODEL_RESIDENCY_ADVISORY_BUNDLE, else shared/data/rustsec/ beside
# the checkout, else /work/shared/data/rustsec/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
db="$HOME/.cache/model-residency/advisory-db/advisory-db-3157b0e258782691"
if [ ! -d "$db/.git" ]; then
  bundle=""
  for b in "${MODEL_RESIDENCY_ADVISORY_BUNDLE:-}" \
           "$root/../shared/data/rustsec/advisory-db.bundle" \
           /work/shared/data/rustsec/advisory-db.bundle; do
    if [ -n "$b" ] && [ -f "$b" ]; then bundle="$b"; break; fi
  done
  if [ -z "$bundle" ]; then
    echo "advisories: no RustSec snapshot (set MODEL_RESIDENCY_ADVISORY_BUNDLE to advisory-db.bundle)" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$db")"
  rm -rf "$db.tmp"
  git clone -q "$bundle" "$db.tmp"
  mv "$db.tmp" "$db"
fi
newest=$(grep -rh '^date = ' "$db/crates" | sort | tail -1 | tr -d '"' | sed 's/date = //')
echo "RustSec advisories as of $newest"
