#!/usr/bin/env bash
# Provides the official OpenAI Python SDK (from PyPI) for the test that
# drives the router with a real OpenAI client: a virtualenv cached under
# ~/.cache/model-residency/openai-sdk/<version>/; prints its python last.
#
# Environment: MODEL_RESIDENCY_CACHE.
set -euo pipefail

VERSION=3.51.0
CACHE_ROOT=${MODEL_RESIDENCY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/model-residency}
DIR=$CACHE_ROOT/openai-sdk/$VERSION
log() { printf '[openai-sdk] %s\n' "$*" >&2; }

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/openai-sdk.lock"
flock 9
if "$DIR/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$VERSION')" 2>/dev/null; then
  echo "$DIR/bin/python"; exit 0
fi
rm -rf "$DIR"
log "installing openai==$VERSION from PyPI into $DIR"
python3 -m venv "$DIR" >&2
"$DIR/bin/pip" install --quiet --disable-pip-version-check "openai==$VERSION" >&2
echo "$DIR/bin/python"
