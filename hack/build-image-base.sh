#!/usr/bin/env bash
# A local stand-in for python:3.11-slim, made from Debian packages, for machines that reach no
# image registry (the Dockerfile's BASE build argument takes it; see `make images`).
#
# debootstrap lays down a minimal Debian bookworm (minbase) with python3.11, pip and
# ca-certificates; `buildah from scratch` + that root filesystem + `buildah commit` makes it an
# image. Like python:3.11-slim it lets `pip install` write into the system Python (Debian's
# EXTERNALLY-MANAGED marker goes; pip puts packages under /usr/local) and answers to `python`.
# bookworm's pip (23.0) is replaced by a current one (PIP_VERSION): its resolver spends many
# minutes on the worker's dependency set (torch, nvidia-*, boto3), as python:3.11-slim's does not.
# No daemon and no registry: buildah keeps the image in its local storage.
#
# Also installs buildah and debootstrap (Debian packages) when they are missing and we are root.
# Usage: hack/build-image-base.sh [IMAGE]  (default localhost/weightlift-base:bookworm-py3.11-pip26.3)
# Cache: $WL_CACHE/imagebase-<tag>/rootfs (+ .complete). Rerun: a no-op once the image exists in
# buildah's storage; the rootfs is reused if only the image is gone (~5 s). PIP_CA: as in
# hack/build-images.sh, the CA bundle pip trusts while it upgrades itself (not kept).
set -euo pipefail
SUITE=${SUITE:-bookworm}
PIP_VERSION=${PIP_VERSION:-26.3}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WL_CACHE=${WL_CACHE:-$HOME/.cache/weightlift}
TAG=$SUITE-py3.11-pip$PIP_VERSION
IMAGE=${1:-localhost/weightlift-base:$TAG}
DEST=$WL_CACHE/imagebase-$TAG
PIP_CA=${PIP_CA:-/etc/ssl/certs/ca-certificates.crt}

need_tools() {
  local missing=()
  command -v buildah >/dev/null || missing+=(buildah)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "build-image-base: missing ${missing[*]}; install them (Debian: apt-get install" \
      "buildah debootstrap) or run as root on Debian" >&2
    exit 1
  fi
  echo "build-image-base: apt-get install ${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
    >/dev/null || { apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; }
}

make_rootfs() {
  [[ -f $DEST/.complete ]] && return 0
  if [[ $(id -u) -ne 0 ]]; then
    echo "build-image-base: debootstrap needs root (device nodes, chroot)" >&2
    exit 1
  fi
  rm -rf "$DEST"
  mkdir -p "$DEST"
  local root=$DEST/rootfs
  debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
    "$SUITE" "$root" "$MIRROR" >"$DEST/debootstrap.log" 2>&1 || {
    tail -20 "$DEST/debootstrap.log" >&2
    exit 1
  }
  rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
  ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
  upgrade_pip "$root"
  # What the slim image leaves out too: package caches and lists, docs, man pages, locales.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
  chroot "$root" python3 --version >/dev/null
  touch "$DEST/.complete"
}

upgrade_pip() {
  local root=$1 cert=()
  if [[ -f $PIP_CA ]]; then
    cp "$PIP_CA" "$root/tmp/pip-ca.crt"
    cert=(--cert /tmp/pip-ca.crt)
  fi
  # A clean environment: the host's PIP_* variables name host paths.
  local run=(chroot "$root" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root)
  "${run[@]}" python3 -m pip install -q --no-cache-dir --root-user-action=ignore \
    "${cert[@]}" "pip==$PIP_VERSION"
  rm -rf "$root/tmp/pip-ca.crt" "$root/tmp/x"
  "${run[@]}" pip --version | grep -q "^pip $PIP_VERSION " || {
    echo "build-image-base: pip $PIP_VERSION is not the image's pip" >&2
    exit 1
  }
}

commit_image() {
  local ctr mnt
  ctr=$(buildah from scratch)
  mnt=$(buildah mount "$ctr")
  cp -a "$DEST/rootfs/." "$mnt/"
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 \
    --label org.opencontainers.image.description="Debian $SUITE + python3.11 (debootstrap)" \
    "$ctr"
  buildah commit -q --rm "$ctr" "$IMAGE" >/dev/null
}

need_tools
if ! buildah inspect --type image "$IMAGE" >/dev/null 2>&1; then
  make_rootfs
  commit_image
fi
echo "$IMAGE"
