#!/usr/bin/env bash
# Build MinIO (the S3-compatible server the storage tests and `weightlift demo --storage s3` run
# on loopback) from Go modules: `go install github.com/minio/minio@<pinned pseudo-version>`.
#
# Usage: hack/build-minio.sh CACHE_DIR
# The binary lands in CACHE_DIR/minio-<version>/bin/minio and is reused when present (a
# .complete stamp is written only after it built and answered --version).
# Set WL_MINIO_PRINT_DIR=1 to only print the bin dir and exit.
set -euo pipefail

# ---- pinned version (keep in sync with local/s3server.py) ----
# MinIO's tags (RELEASE.*) are not semver, so the module proxy knows it by pseudo-version; this
# is the newest commit on its default branch when pinned.
MINIO_VERSION="v0.0.0-20260212201848-7aac2a2c5b7c"

CACHE_DIR="${1:?usage: $0 CACHE_DIR}"
mkdir -p "$CACHE_DIR"
CACHE_DIR="$(cd "$CACHE_DIR" && pwd)"
OUT="$CACHE_DIR/minio-$MINIO_VERSION"
BIN="$OUT/bin"
if [[ "${WL_MINIO_PRINT_DIR:-}" == 1 ]]; then echo "$BIN"; exit 0; fi
if [[ -f "$OUT/.complete" && -x "$BIN/minio" ]]; then echo "minio cached in $BIN"; exit 0; fi

command -v go >/dev/null || { echo "error: go is not installed (need go >= 1.24)" >&2; exit 1; }
mkdir -p "$BIN"
export CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" GOTOOLCHAIN=local
START=$(date +%s)
echo "[build-minio] go install github.com/minio/minio@$MINIO_VERSION (about 10 min on 2 cores cold)"
GOBIN="$OUT/gobin" go install -ldflags "-s -w" "github.com/minio/minio@$MINIO_VERSION"
mv "$OUT/gobin/minio" "$BIN/minio"
"$BIN/minio" --version | head -1 >/dev/null || { echo "error: minio --version failed" >&2; exit 1; }
echo "built in $(( $(date +%s) - START ))s" > "$OUT/.complete"
echo "[build-minio] done in $(( $(date +%s) - START ))s: $BIN/minio"
