#!/bin/sh
# weightlift's worker in a team's own vLLM or Triton image (spec.template.worker Injected;
# operator/inject.py). The init container copied this bundle next to this file; here, as the
# worker container's command, it finds the image's Python, checks it and its vLLM (for Triton
# also tritonserver and its Python backend), then runs the worker from the bundle with that
# Python. A refusal is a permanent WorkerReport in the termination log:
# the replica's status names why, and the pod (restartPolicy Never) is not replaced in a loop.
#   WEIGHTLIFT_ENGINE_PYTHON  the Python to use (default: python3, python on PATH, then the
#                             usual venv and system paths)
#   WEIGHTLIFT_PYTHON_CANDIDATES  where else to look when PATH has none (default below)
#   WEIGHTLIFT_TERMINATION_LOG  where the refusal goes (default /dev/termination-log)
#   WEIGHTLIFT_INJECTED_ENGINE  vLLM (default) or Triton (the operator sets it)
#   WEIGHTLIFT_TRITON_HOME      Triton: the directory whose bin/ holds tritonserver (default:
#                               PATH's, then /opt/tritonserver)
set -u
BUNDLE=$(cd "${0%/*}" && pwd)
LOG=${WEIGHTLIFT_TERMINATION_LOG:-/dev/termination-log}
# The Pythons the bundle ships compiled dependencies for (hack/build-bundle.sh) and weightlift's
# requires-python.
PYTHON_MIN=11
PYTHON_MAX=13

# refuse REASON DETAIL: the report the operator reads into the replica's status, then exit 3.
refuse() {
  detail=$(printf '%s' "$2" | tr '\n\t"\\' '  '"'"'/')
  printf '{"phase":"Failed","permanentFailure":true,"message":"%s: %s"}' "$1" "$detail" \
    >"$LOG" 2>/dev/null || true
  echo "weightlift launcher: $1: $2" >&2
  exit 3
}

[ -f "$BUNDLE/.complete" ] || refuse BundleIncomplete \
  "the init container did not finish copying weightlift into $BUNDLE"

# vLLM, torch and Inductor write their caches under HOME (the pod's /tmp emptyDir): a read-only
# root filesystem with no writable volume there cannot start vLLM.
home=${HOME:-/tmp}
if ! mkdir -p "$home/.cache" 2>/dev/null || ! : >"$home/.cache/.weightlift-write" 2>/dev/null; then
  refuse NoWritableVolume "HOME $home is not writable (read-only root filesystem and no writable \
volume there): vLLM and torch keep their caches under HOME"
fi
rm -f "$home/.cache/.weightlift-write"

python=${WEIGHTLIFT_ENGINE_PYTHON:-}
if [ -z "$python" ]; then
  for name in python3 python; do
    python=$(command -v "$name" 2>/dev/null) && break
    python=""
  done
fi
if [ -z "$python" ]; then
  candidates=${WEIGHTLIFT_PYTHON_CANDIDATES:-/opt/venv/bin/python3 /usr/local/bin/python3 \
/usr/bin/python3 /opt/conda/bin/python3}
  for path in $candidates; do
    [ -x "$path" ] && { python=$path; break; }
  done
fi
[ -n "$python" ] || refuse NoPython "the image has no python3 on PATH ($PATH) nor at \
$candidates (set WEIGHTLIFT_ENGINE_PYTHON in spec.template.env)"

# %-formatting: any Python answers, so an old one is named rather than failing to parse.
version=$(PYTHONPATH= "$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>&1) \
  || refuse NoPython "$python does not run: $version"
major=${version%%.*}
minor=${version#*.}
if [ "$major" != 3 ] || [ "$minor" -lt "$PYTHON_MIN" ] || [ "$minor" -gt "$PYTHON_MAX" ]; then
  refuse WrongPython "$python is Python $version; weightlift's worker needs 3.$PYTHON_MIN to \
3.$PYTHON_MAX"
fi

# vLLM's version and plugin API, tritonserver and its Python backend (Triton), the dependencies
# the image must have and those the bundle adds (probe.py: no import of vLLM, a few ms).
engine=${WEIGHTLIFT_INJECTED_ENGINE:-vLLM}
probe=$(PYTHONPATH= "$python" "$BUNDLE/probe.py" "$BUNDLE" "$engine" 2>&1) \
  || refuse ProbeFailed "$python $BUNDLE/probe.py: $probe"
path=$BUNDLE/lib
nixl=""
while IFS='	' read -r key value rest; do
  case $key in
    refuse) refuse "$value" "$rest" ;;
    add) path=$path:$value ;;
    vllm) vllm_version=$value ;;
    triton) triton=$value ;;
    nixl) nixl=$value ;;
  esac
done <<PROBE
$probe
PROBE

export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
export WEIGHTLIFT_VLLM_PYTHON="$python"
# The worker starts this tritonserver with this Python backend (worker/engines/triton/install.py).
[ -z "${triton:-}" ] || export WEIGHTLIFT_TRITON_HOME="$triton"
# NIXL missing is not fatal: P2P is off, storage and preload still work (the worker's pull
# then logs NIXL's import error and loads from storage).
if [ -n "$nixl" ]; then
  export WEIGHTLIFT_P2P_UNAVAILABLE="$nixl"
  echo "weightlift launcher: $nixl" >&2
fi
# The working directory of weightlift's own images (`python -m` puts it first on sys.path).
cd "$home" || refuse NoWritableVolume "cannot enter HOME $home"
echo "weightlift launcher: Python $version ($python), vLLM ${vllm_version:-?}${triton:+, \
tritonserver in $triton}; worker from $BUNDLE" >&2
exec "$python" -m weightlift worker "$@"
