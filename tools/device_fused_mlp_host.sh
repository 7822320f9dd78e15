#!/usr/bin/env bash
# Issue 22's host-cost bar on one GPU, in one call of at most ~290 s: build fused_mlp's
# variants, the GPU tests of the eager fast path / kgen.runtime.triton_launch (bit-identical to
# Triton's own launch, CUDA-graph capture, torch.compile) with the CPU tests of triton_launch,
# then tools/fused_mlp_host.py (host cost per call before / after against torch.add, GPU time
# at B 128 and 2048), then the rest of `pytest -m gpu tests/test_fused_mlp.py` in the time left.
# Run from the repo root: bash tools/device_fused_mlp_host.sh. SKIP_BUILD=1, SKIP_REST=1 leave
# those out; BUILD_TIMEOUT, FAST_TIMEOUT, HOST_TIMEOUT (s) bound the steps, TOTAL (s) the call.
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)" | tee "$OUT/versions.txt"
if [ -z "${SKIP_BUILD:-}" ]; then
  start=$SECONDS
  timeout ${BUILD_TIMEOUT:-80} python3 -m kgen.cli build kgen/specs/fused_mlp.yaml > "$OUT/build.txt" 2>&1
  echo "build: rc $? in $((SECONDS - start)) s"; grep -v Warning "$OUT/build.txt" | tail -5
fi
start=$SECONDS
timeout ${FAST_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_launch.py \
  tests/test_fused_mlp.py -k "fast_path or triton_launch" > "$OUT/pytest_fast.txt" 2>&1
echo "fast-path tests: rc $? in $((SECONDS - start)) s"; tail -15 "$OUT/pytest_fast.txt"
start=$SECONDS
timeout ${HOST_TIMEOUT:-70} python3 tools/fused_mlp_host.py ${QUICK:+--quick} > "$OUT/host.txt" 2>&1
echo "host tool: rc $? in $((SECONDS - start)) s"; grep -v "^{\|^\[\|Warning" "$OUT/host.txt"
if [ -z "${SKIP_REST:-}" ]; then
  left=$(( ${TOTAL:-285} - SECONDS ))
  if [ $left -gt 20 ]; then
    timeout $left python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_mlp.py -k "not fast_path" \
      > "$OUT/pytest_rest.txt" 2>&1
    echo "rest of the GPU tests ($left s allowed): rc $?"; tail -8 "$OUT/pytest_rest.txt"
  fi
fi
