#!/usr/bin/env bash
# fused_mlp on one GPU (issue 22): build the family's variants, its GPU tests, then the
# benchmark table (floor, eager, eager in a CUDA graph, torch.compile, kgen; forward and
# training step; bf16 and float32 with TF32). Run from the repo root: bash tools/device_fused_mlp.sh
# (NO_COMPILE=1 leaves torch.compile out of the benchmark, QUICK=1 shortens its timing,
# SKIP_BUILD=1 / SKIP_TESTS=1 / SKIP_BENCH=1 leave those out, BUILD_TIMEOUT / TEST_TIMEOUT bound those (s), COMPARE=script
# runs a comparison script between the tests and the benchmark.) Every step writes to $OUT as it goes.
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)" | tee "$OUT/versions.txt"
nvcc --version 2>/dev/null | tail -2 >> "$OUT/versions.txt"
start=$SECONDS
if [ -z "${SKIP_BUILD:-}" ]; then
  timeout ${BUILD_TIMEOUT:-300} python3 -m kgen.cli build kgen/specs/fused_mlp.yaml > "$OUT/build.txt" 2>&1
  grep -v Warning "$OUT/build.txt" | tail -24; echo "build: $((SECONDS - start)) s"
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  start=$SECONDS
  timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=15 tests/test_fused_mlp.py > "$OUT/pytest.txt" 2>&1
  echo "tests: rc $? in $((SECONDS - start)) s"; tail -40 "$OUT/pytest.txt"
fi
if [ -n "${COMPARE:-}" ]; then
  start=$SECONDS
  timeout ${COMPARE_TIMEOUT:-200} python3 "$COMPARE" > "$OUT/compare.txt" 2>&1
  echo "compare: rc $? in $((SECONDS - start)) s"; cat "$OUT/compare.txt" | grep -v Warning
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-1800} python3 -m kgen.benchmarks.fused_mlp ${QUICK:+--quick} ${NO_COMPILE:+--no-compile} \
    > "$OUT/bench.txt" 2>&1
  tail -80 "$OUT/bench.txt"
fi
