#!/usr/bin/env bash
# Build the CNCF Distribution registry (the reference OCI registry) from Go modules, so
# `make test-images` can push the images to a real registry on loopback and pull them back, as
# the README tells users to with theirs: `go install .../distribution/v3/cmd/registry@<pinned>`.
#
# Usage: hack/build-registry.sh CACHE_DIR
# The binary lands in CACHE_DIR/registry-<version>/bin/registry and is reused when present (a
# .complete stamp is written only after it built and answered --version). Cold: ~2 min on 2 cores.
set -euo pipefail

REGISTRY_VERSION="v3.0.0"

CACHE_DIR="${1:?usage: $0 CACHE_DIR}"
mkdir -p "$CACHE_DIR"
CACHE_DIR="$(cd "$CACHE_DIR" && pwd)"
OUT="$CACHE_DIR/registry-$REGISTRY_VERSION"
BIN="$OUT/bin"
if [[ -f "$OUT/.complete" && -x "$BIN/registry" ]]; then echo "registry cached in $BIN"; exit 0; fi

command -v go >/dev/null || { echo "error: go is not installed (need go >= 1.23)" >&2; exit 1; }
mkdir -p "$BIN"
export CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" GOTOOLCHAIN=local
START=$(date +%s)
GOBIN="$OUT/gobin" go install -ldflags "-s -w" \
  "github.com/distribution/distribution/v3/cmd/registry@$REGISTRY_VERSION"
mv "$OUT/gobin/registry" "$BIN/registry"
"$BIN/registry" --version >/dev/null || { echo "error: registry --version failed" >&2; exit 1; }
echo "built in $(( $(date +%s) - START ))s" > "$OUT/.complete"
echo "[build-registry] done in $(( $(date +%s) - START ))s: $BIN/registry"
