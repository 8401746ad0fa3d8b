#!/usr/bin/env bash
# The wheels a bare GPU host lacks for `weightlift bench gpu` (hack/gpu-bench.sh installs them
# there), downloaded here for CPython 3.12 on x86-64 Linux, into hack/gpu-wheels/ (.gitignore'd).
#
# The GPU host of the `device` tool has torch, safetensors, numpy, httpx, aiohttp, click, rich,
# xxhash and typer/humanize, but no pydantic, NIXL or the loader peers, and no network. Everything
# that travels (the project's tracked files, ~3 MB, and these) must fit 64 MiB, and nixl-cu13's
# wheel alone is 59 MB: hack/slim_nixl_wheel.py repacks it with the UCX backend only (~13 MB).
# Also built: the demo model's init hook (gcc, x86-64), used there if that host has no gcc.
#
#   hack/gpu-wheels.sh            # then: du -sh hack/gpu-wheels (must stay well under 60 MiB)
#   WL_GPU_PYTHON=3.11 hack/gpu-wheels.sh   # wheels for this machine: rehearse gpu-bench.sh here
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=hack/gpu-wheels
PYVER=${WL_GPU_PYTHON:-3.12}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# What hack/gpu-bench.sh installs with --no-deps: every requirement named, one version each.
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  nixl-cu13==1.5.1
  runai-model-streamer fastsafetensors
)
# pip matches each platform tag exactly: name every glibc the host (Ubuntu 24.04: 2.39) can run.
PLATFORMS=(--platform manylinux2014_x86_64)
for n in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done

rm -rf "$DEST" && mkdir -p "$DEST/raw"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST/raw" "${WHEELS[@]}"
for w in "$DEST"/raw/*.whl; do
  case "$(basename "$w")" in
    nixl_cu1*) "$PY" hack/slim_nixl_wheel.py "$w" "$DEST" ;;
    *) mv "$w" "$DEST/" ;;
  esac
done
rm -rf "$DEST/raw"
PYTHONPATH="$PWD" "$PY" -c 'import sys, pathlib; from weightlift.local.models import build_hook_library as b; b(pathlib.Path(sys.argv[1]))' \
  "$DEST/libinit.so"
du -sh "$DEST"
ls -l "$DEST"
