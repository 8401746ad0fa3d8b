#!/usr/bin/env bash
# Build and install what a real node of the local stack runs (weightlift/local/kubeletnode/):
#   kubelet, kube-proxy          <- k8s.io/kubernetes (the control plane's wrapper module, lib/)
#   weightlift-gpu-plugin        <- hack/deviceplugin/main.go (k8s.io/kubelet device-plugin API)
#   crictl                       <- go install sigs.k8s.io/cri-tools/cmd/crictl (tear-down, debug)
#   pause image                  <- hack/pause/pause.c, gcc -static, buildah from scratch
#   containerd, runc, CNI plugins, iptables, buildah  <- Debian packages (apt-get, when missing)
#
# Usage: hack/build-node.sh CACHE_DIR
# Binaries land in CACHE_DIR/node-k8s<K>-crictl<C>/bin and are reused when present: a .complete
# stamp records the sha256 of the plugin's and pause's sources, so editing either rebuilds it.
# The pause image is kept in buildah's local storage as $PAUSE_IMAGE (the stack pushes it to
# its registry). WL_NODE_PRINT_DIR=1: print the bin dir and exit.
set -euo pipefail

# ---- pinned versions (keep in sync with local/kubeletnode/paths.py) ----
K8S_VERSION="v1.36.3"
CRICTL_VERSION="v1.36.0"
PAUSE_IMAGE="localhost/weightlift/pause:3.10"
APT_PACKAGES=(containerd runc containernetworking-plugins iptables buildah)

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_DIR="${1:?usage: $0 CACHE_DIR}"
mkdir -p "$CACHE_DIR"
CACHE_DIR="$(cd "$CACHE_DIR" && pwd)"
OUT="$CACHE_DIR/node-k8s${K8S_VERSION}-crictl${CRICTL_VERSION}"
BIN="$OUT/bin"
if [[ "${WL_NODE_PRINT_DIR:-}" == 1 ]]; then echo "$BIN"; exit 0; fi
BINARIES=(kubelet kube-proxy weightlift-gpu-plugin crictl pause)
START=$(date +%s)
log() { echo "[build-node +$(( $(date +%s) - START ))s] $*"; }
src_sum() { cat "$HERE/deviceplugin/main.go" "$HERE/pause/pause.c" | sha256sum | cut -c1-16; }
SUM="$(src_sum)"

# ---- Debian packages: the container runtime, runc, the CNI plugins, iptables, buildah ----
install_packages() {
  local missing=()
  command -v containerd >/dev/null || missing+=(containerd)
  command -v runc >/dev/null || missing+=(runc)
  [[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local ]] || missing+=(containernetworking-plugins)
  command -v iptables >/dev/null || missing+=(iptables)
  command -v buildah >/dev/null || missing+=(buildah)
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "build-node: missing ${missing[*]}; install them (Debian: apt-get install ${APT_PACKAGES[*]})" >&2
    exit 1
  fi
  log "apt-get install ${missing[*]}"
  # No service starts at install: the stack runs its own containerd (own config, socket, dirs).
  local policy=/usr/sbin/policy-rc.d created=0
  if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' > $policy; chmod +x $policy; created=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
    >/dev/null || { apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; }
  [[ $created == 1 ]] && rm -f $policy
  return 0
}

# ---- kubelet, kube-proxy, the device plugin: one wrapper module ----
build_kube() {
  command -v go >/dev/null || { echo "error: go is not installed (need go >= 1.26)" >&2; exit 1; }
  export CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" GOTOOLCHAIN=local
  # shellcheck source=hack/lib/k8s-module.sh
  source "$HERE/lib/k8s-module.sh"
  local src="$OUT/src/kube"
  mkdir -p "$src/cmd/weightlift-gpu-plugin"
  cp "$HERE/deviceplugin/main.go" "$src/cmd/weightlift-gpu-plugin/main.go"
  log "resolving the k8s.io/kubernetes@$K8S_VERSION module graph"
  k8s_wrapper_module "$src" "$K8S_VERSION" weightlift.local/node \
    k8s.io/kubernetes/cmd/kubelet/app k8s.io/kubernetes/cmd/kube-proxy/app \
    k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 google.golang.org/grpc
  local ld
  ld="$(k8s_ldflags "$src" "$K8S_VERSION")"
  for cmd in kubelet kube-proxy; do
    [[ -x "$BIN/$cmd" ]] && continue
    log "building $cmd"
    (cd "$src" && go build -mod=mod -ldflags "$ld" -o "$BIN/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd")
    mv "$BIN/$cmd.tmp" "$BIN/$cmd"
  done
  log "building weightlift-gpu-plugin"
  (cd "$src" && go build -mod=mod -ldflags "-s -w" -o "$BIN/weightlift-gpu-plugin.tmp" ./cmd/weightlift-gpu-plugin)
  mv "$BIN/weightlift-gpu-plugin.tmp" "$BIN/weightlift-gpu-plugin"
}

build_crictl() {
  log "building crictl $CRICTL_VERSION"
  CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" GOTOOLCHAIN=local GOBIN="$OUT/gobin" \
    go install -ldflags "-s -w" "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
  mv "$OUT/gobin/crictl" "$BIN/crictl"
}

# ---- the pause image: a static binary alone in an image made from scratch ----
build_pause() {
  log "building the pause image $PAUSE_IMAGE"
  gcc -static -Os -Wall -o "$BIN/pause.tmp" "$HERE/pause/pause.c"
  strip "$BIN/pause.tmp"
  mv "$BIN/pause.tmp" "$BIN/pause"
  local ctr
  ctr=$(buildah from scratch)
  buildah copy -q "$ctr" "$BIN/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --cmd '' --user 65535:65535 \
    --label org.opencontainers.image.description="weightlift's pod sandbox (hack/pause/pause.c)" "$ctr"
  buildah commit -q --rm "$ctr" "$PAUSE_IMAGE" >/dev/null
}

install_packages
mkdir -p "$BIN"
fresh=1
if [[ -f "$OUT/.complete" && "$(sed -n 's/^sources //p' "$OUT/.complete")" == "$SUM" ]]; then
  fresh=0
  for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || fresh=1; done
fi
if [[ $fresh == 1 ]]; then
  rm -f "$OUT/.complete" "$BIN/weightlift-gpu-plugin" "$BIN/pause"
  [[ -x "$BIN/kubelet" && -x "$BIN/kube-proxy" && -x "$BIN/weightlift-gpu-plugin" ]] || build_kube
  [[ -x "$BIN/crictl" ]] || build_crictl
fi
if [[ $fresh == 1 ]] || ! buildah inspect --type image "$PAUSE_IMAGE" >/dev/null 2>&1; then
  build_pause
fi
for cmd in kubelet kube-proxy; do
  got="$("$BIN/$cmd" --version 2>&1 | head -1)"
  [[ "$got" == "Kubernetes $K8S_VERSION" ]] || { echo "error: $cmd --version says '$got'" >&2; exit 1; }
done
if [[ $fresh == 1 ]]; then
  printf 'built in %ss\nsources %s\n' "$(( $(date +%s) - START ))" "$SUM" > "$OUT/.complete"
fi
log "done: $BIN ($(containerd --version | awk '{print $3}'), runc $(runc --version | awk 'NR==1{print $3}'))"
