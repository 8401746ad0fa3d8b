#!/usr/bin/env bash
# Triton Inference Server for runtime.engine Triton: the tritonserver 2.51 binary, its Python
# backend and the backend stubs (Python 3.8-3.13) that `nvidia-pytriton` bundles. PyPI's
# `tritonserver` holds only bindings that need the NGC container's libtritonserver.so.
#
# Why a tree of files and no Python environment: the Triton model weightlift generates is a
# Python-backend model that runs vLLM, so its stub must import vLLM and weightlift. The stub is
# a native program that embeds the libpython of its Python version; the worker starts
# tritonserver with the vLLM environment's libpython on LD_LIBRARY_PATH and the generated
# model.py adds that environment's site-packages (its .pth files too: the editable weightlift).
# Installing pytriton into the vLLM environment would change versions others rely on (its
# numpy/pyzmq/grpc pins); a copy of that 6 GB environment buys nothing. Only the wheel's
# server tree and its auditwheel libraries are unpacked here (~140 MB); the binaries find those
# libraries through their $ORIGIN rpath, so the tree keeps the wheel's layout.
#
# Layout: DEST/pytriton/tritonserver/{bin/tritonserver,backends-py<X.Y>/python}, DEST/stub-site/py<X.Y>.
# Usage: hack/install-triton.sh [DEST] (default $WL_CACHE/triton-<version>); prints DEST.
# Rerun: a no-op once DEST/.engine-installed exists.
set -euo pipefail
PYTRITON_VERSION=${PYTRITON_VERSION:-0.7.0}   # bundles tritonserver 2.51
TRITON_VERSION=${TRITON_VERSION:-2.51}
PYTHON=${PYTHON:-python3}
WL_CACHE=${WL_CACHE:-$HOME/.cache/weightlift}
DEST=${1:-$WL_CACHE/triton-$TRITON_VERSION}

if [[ ! -f $DEST/.engine-installed ]]; then
  rm -rf "$DEST"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PYTHON" -m pip download -q --no-deps "nvidia-pytriton==$PYTRITON_VERSION" -d "$work"
  mkdir -p "$work/tree"
  "$PYTHON" - "$work"/nvidia_pytriton-*.whl "$work/tree" <<'PYEOF'
import os, stat, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        name = info.filename
        if not name.startswith(("pytriton/tritonserver/", "nvidia_pytriton.libs/")):
            continue
        path = zf.extract(info, dest)
        if not info.is_dir():  # zipfile drops the mode bits: binaries and libraries run
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PYEOF
  server="$work/tree/pytriton/tritonserver/bin/tritonserver"
  if ldd "$server" | grep -q "not found"; then
    echo "install-triton: $server lacks libraries:" >&2
    ldd "$server" | grep "not found" >&2
    exit 1
  fi
  # One backend directory per Python version (backends-py3.11/python/...): the Python backend
  # looks for its stub only beside libtriton_python.so, so the worker picks the stub of the
  # engine's Python by picking the directory (--backend-directory). Hard links at the same depth
  # as backends/python keep the libraries' $ORIGIN rpath pointing at nvidia_pytriton.libs.
  root="$work/tree/pytriton/tritonserver"
  for stub in "$root"/python_backend_stubs/*/triton_python_backend_stub; do
    version=$(basename "$(dirname "$stub")")
    dir="$root/backends-py$version/python"
    mkdir -p "$dir"
    cp -l "$root"/backends/python/* "$dir/"
    cp -l "$stub" "$dir/"
  done
  echo "nvidia-pytriton $PYTRITON_VERSION (tritonserver $TRITON_VERSION)" > "$work/tree/VERSION"
  mkdir -p "$(dirname "$DEST")"
  mv "$work/tree" "$DEST"
  touch "$DEST/.engine-installed"
fi
# numpy 1.x for the stub, per engine Python: the stub's pybind11 reads numpy 1.x's dtype layout;
# under numpy 2 (the vLLM environment's) every BYTES tensor (text_input, text_output) arrives as
# its first byte repeated and the stub aborts. The generated model.py puts this directory ahead
# of the engine environment's site-packages; vLLM, torch and transformers run on numpy 1.26.
# A --target install: the engine environment itself is not touched.
ENGINE_PYTHON=${ENGINE_PYTHON:-$WL_CACHE/vllm-0.32.0/bin/python}
STUB_NUMPY=${STUB_NUMPY:-1.26.4}
if [[ -x $ENGINE_PYTHON ]]; then
  version=$("$ENGINE_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  site="$DEST/stub-site/py$version"
  if [[ ! -f $site/.installed-$STUB_NUMPY ]]; then
    rm -rf "$site"
    "$ENGINE_PYTHON" -m pip install -q --disable-pip-version-check --no-deps --only-binary :all: \
      --target "$site" "numpy==$STUB_NUMPY"
    touch "$site/.installed-$STUB_NUMPY"
  fi
else
  echo "install-triton: no engine python at $ENGINE_PYTHON (set ENGINE_PYTHON); the stub's numpy is not installed" >&2
fi
echo "$DEST"
