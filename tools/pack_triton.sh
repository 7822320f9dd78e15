#!/usr/bin/env bash
# Run kgen's GPU paths under a Triton release other than the device image's (its 3.6), e.g. the
# newest one CI installs. The device tool carries at most 64 MiB a call and Triton's wheel is
# ~190-290 MB, so this packs what a CUDA run imports: the wheel without the AMD backend's
# libraries, CUPTI, the proton profiler and the bundled ptxas binaries (the device's CUDA ptxas
# stands in), libtriton.so stripped of its debug information: Triton 3.9.0 -> a 48 MB .tar.xz.
#
# Here (needs pip's index; ~2 min on 2 cores):
#   bash tools/pack_triton.sh 3.9.0            # -> build/triton-3.9.0.tar.xz (git-ignored)
# On the device (carry: ["build/triton-3.9.0.tar.xz", ...]), before the command:
#   source tools/pack_triton.sh --use build/triton-3.9.0.tar.xz
# which unpacks it to /tmp/triton-VERSION and puts it first on PYTHONPATH, with the device's ptxas
# for both of Triton's ptxas knobs (3.9 compiles sm_90 with its "ptxas-blackwell") and its own
# KGEN_CACHE_DIR (a cache keyed by one Triton must not serve another's binaries to a test).
# Python 3.12 wheels (the device's Python); `python3 -c "import triton"` there checks the result.
if [ "${1:-}" = "--use" ]; then
  _tar="${2:?--use PATH.tar.xz}"
  _ver="$(basename "$_tar" .tar.xz)"
  mkdir -p "/tmp/$_ver" && { [ -d "/tmp/$_ver/triton" ] || tar xJf "$_tar" -C "/tmp/$_ver"; } || return 1 2>/dev/null || exit 1
  _ptxas="$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)"
  export PYTHONPATH="/tmp/$_ver:$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_PTXAS_PATH="$_ptxas"
  export TRITON_PTXAS_BLACKWELL_PATH="$_ptxas" KGEN_CACHE_DIR="/tmp/kgen-cache-$_ver"
  return 0 2>/dev/null || exit 0
fi
set -euo pipefail
VER="${1:?usage: bash tools/pack_triton.sh VERSION}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$WORK/whl" "triton==$VER"
mkdir "$WORK/t" && (cd "$WORK/t" && unzip -q "$WORK"/whl/triton-*.whl)
cd "$WORK/t"
# The AMD backend stays importable (its entry point is registered: the package must exist),
# without its 100 MB of libraries.
rm -rf triton/backends/amd/lib triton/backends/nvidia/lib/cupti* triton/_C/libproton.so \
  triton/backends/nvidia/bin/ptxas triton/backends/nvidia/bin/ptxas-blackwell
strip --strip-unneeded triton/_C/libtriton.so
cd - > /dev/null
mkdir -p build
tar cf - -C "$WORK/t" . | xz -T0 -6 > "build/triton-$VER.tar.xz"
ls -la "build/triton-$VER.tar.xz"
