#!/bin/sh
# Builds the bundle the worker-bundle image's init container copies into a pod whose image is the
# team's own vLLM image (operator/inject.py), at image build time (never at pod start):
#   OUT/launch.sh, copy.sh, probe.py, vllm-versions   (bundle/)
#   OUT/lib/             weightlift (no local/, bench/, operator/), pure Python
#   OUT/deps/<module>/   pure-Python dependencies a vLLM image may lack (added only when it does)
#   OUT/abi/cpXY/<module>/  compiled ones per Python ABI: xxhash; NIXL for NIXL_PYTHONS only
# Usage: hack/build-bundle.sh deps OUT         the dependencies (a layer of their own)
#        hack/build-bundle.sh code SRC OUT     weightlift from the checkout SRC, and the scripts
set -eu
PYTHONS=${PYTHONS:-"3.11 3.12 3.13"}
NIXL_PYTHONS=${NIXL_PYTHONS:-"3.11 3.12"}
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
pip_target() {  # DIR REQUIREMENT [pip args...]
  dir=$1; req=$2; shift 2
  python3 -m pip install -q --no-cache-dir --disable-pip-version-check --target "$dir" "$@" "$req"
}
if [ "$1" = code ]; then
SRC=$2
OUT=$3
mkdir -p "$OUT"
cp "$SRC"/bundle/launch.sh "$SRC"/bundle/copy.sh "$SRC"/bundle/probe.py "$SRC"/bundle/vllm-versions "$OUT/"
build=$(mktemp -d)
cp -R "$SRC/pyproject.toml" "$SRC/README.md" "$SRC/weightlift" "$build/"
rm -rf "$build/weightlift/local" "$build/weightlift/bench" "$build/weightlift/operator"
# The dist-info comes along: vLLM finds the load format through its vllm.general_plugins entry point.
pip_target "$OUT/lib" "$build" --no-deps
rm -rf "$build" "$OUT/lib/bin"
# Only what this step wrote: a chmod of deps/ would copy that layer into this one.
chmod -R a+rX "$OUT/lib" "$OUT"/*.sh "$OUT/probe.py" "$OUT/vllm-versions"
exit 0
fi
OUT=$2
pip_target "$OUT/deps/click" "click>=8.1" --no-deps
pip_target "$OUT/deps/sniffio" "sniffio>=1.3" --no-deps
pip_target "$OUT/deps/boto3" "boto3>=1.34"   # s3:// models; with botocore, s3transfer, ...
for version in $PYTHONS; do
  abi=cp$(echo "$version" | tr -d .)
  # shellcheck disable=SC2086
  pip_target "$OUT/abi/$abi/xxhash" "xxhash>=3.4" --no-deps --only-binary=:all: $PLATFORMS \
    --python-version "$version" --implementation cp --abi "$abi"
  case " $NIXL_PYTHONS " in *" $version "*)
    # shellcheck disable=SC2086
    pip_target "$OUT/abi/$abi/nixl_cu12" "nixl-cu12>=1.0" --no-deps --only-binary=:all: \
      $PLATFORMS --python-version "$version" --implementation cp --abi "$abi"
    # Expert-parallel kernels (100 MB) weightlift never imports.
    rm -rf "$OUT/abi/$abi/nixl_cu12/nixl_ep_cu12" ;;
  esac
done
chmod -R a+rX "$OUT"
