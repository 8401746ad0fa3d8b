#!/usr/bin/env bash
# Build Prometheus (the local stack's scraper: local/prometheus.py, `weightlift demo --prometheus`,
# tests/e2e/test_prometheus.py) from Go modules: `go install .../cmd/prometheus@<pinned>`.
#
# Usage: hack/build-prometheus.sh CACHE_DIR
# The binary lands in CACHE_DIR/prometheus-<version>/bin/prometheus and is reused when present (a
# .complete stamp is written only after it built and answered --version with the pinned version).
# Set WL_PROMETHEUS_PRINT_DIR=1 to only print the bin dir and exit.
#
# Only Kubernetes service discovery is compiled in (upstream's remove_all_sd/enable_*_sd tags):
# the cloud SDKs are most of the build time and size. No web UI assets (builtinassets off): the
# HTTP API is what the tests and the demo use.
set -euo pipefail

# ---- pinned version (keep in sync with local/prometheus.py) ----
# Prometheus 3.x is published as module versions v0.3MM.P (v3.16.0 -> v0.316.0): its go.mod
# keeps the module path without /v3.
PROMETHEUS_VERSION="v3.16.0"
PROMETHEUS_MODULE_VERSION="v0.316.0"

CACHE_DIR="${1:?usage: $0 CACHE_DIR}"
mkdir -p "$CACHE_DIR"
CACHE_DIR="$(cd "$CACHE_DIR" && pwd)"
OUT="$CACHE_DIR/prometheus-$PROMETHEUS_VERSION"
BIN="$OUT/bin"
if [[ "${WL_PROMETHEUS_PRINT_DIR:-}" == 1 ]]; then echo "$BIN"; exit 0; fi
if [[ -f "$OUT/.complete" && -x "$BIN/prometheus" ]]; then echo "prometheus cached in $BIN"; exit 0; fi

command -v go >/dev/null || { echo "error: go is not installed (need go >= 1.26.7)" >&2; exit 1; }
mkdir -p "$BIN"
export CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" GOTOOLCHAIN=local
START=$(date +%s)
# --version reads these (github.com/prometheus/common/version), as upstream's promu sets them.
LD="-s -w -X github.com/prometheus/common/version.Version=${PROMETHEUS_VERSION#v}"
LD+=" -X github.com/prometheus/common/version.Branch=weightlift"
echo "[build-prometheus] go install github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_MODULE_VERSION"
GOBIN="$OUT/gobin" go install -tags remove_all_sd,enable_kubernetes_sd -ldflags "$LD" \
  "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_MODULE_VERSION"
mv "$OUT/gobin/prometheus" "$BIN/prometheus"
rmdir "$OUT/gobin"
got="$("$BIN/prometheus" --version 2>&1 | head -1)"
[[ "$got" == "prometheus, version ${PROMETHEUS_VERSION#v} "* ]] || {
  echo "error: prometheus --version says '$got'" >&2; exit 1; }
echo "built in $(( $(date +%s) - START ))s" > "$OUT/.complete"
echo "[build-prometheus] done in $(( $(date +%s) - START ))s: $BIN/prometheus"
