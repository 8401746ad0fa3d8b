#!/usr/bin/env bash
# `weightlift bench gpu` on a bare GPU host, as ONE command (the `device` tool: no network, no
# pip install of the project, Python 3.12 with torch there). Prepare here first:
#
#   hack/gpu-wheels.sh                      # the cp312 wheels the host lacks -> hack/gpu-wheels/
#
# then run, from the checkout the device tool sends (tracked files + carried wheels < 64 MiB):
#
#   run(command="bash hack/gpu-bench.sh", carry=["hack/gpu-wheels"], timeout_s=600)
#
# Rehearse here (CPU, no GPU): WL_GPU_PYTHON=3.11 hack/gpu-wheels.sh, then this script with a
# `python3` on PATH that has torch; then hack/gpu-wheels.sh again for the GPU host's 3.12.
#
# It installs the wheels with --no-deps into /tmp/wl-site, puts it and the checkout on
# PYTHONPATH, and runs the bench with sizes that fit ~8 minutes (a 2 GB model, 3 runs per figure,
# 5 pulls); extra arguments go to the bench. $OUT/gpu.json and $OUT/gpu.log come back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
SITE=/tmp/wl-site
WORK=${WL_GPU_WORKDIR:-$PWD/.gpu-work}  # on the host's disk: O_DIRECT and cold reads need one
{
  date -u
  nvidia-smi -L || true
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" hack/gpu-wheels/*.whl || exit 1
  export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
  [ -f hack/gpu-wheels/libinit.so ] && export WEIGHTLIFT_BENCH_HOOK_LIBRARY=$PWD/hack/gpu-wheels/libinit.so
  mkdir -p "$WORK" && df -hT "$WORK" | tail -1
  python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())'
  timeout 560 python3 -m weightlift.bench.gpu --json "$OUT/gpu.json" --workdir "$WORK" "$@"
  rc=$?
  echo "exit $rc"
  exit $rc
} 2>&1 | tee "$OUT/gpu.log"
