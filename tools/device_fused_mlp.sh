#!/usr/bin/env bash
# fused_mlp on one GPU (issue 22): build the family's variants, its GPU tests, then the
# benchmark table (floor, eager, eager in a CUDA graph, torch.compile, kgen; forward and
# training step; bf16 and float32 with TF32). Run from the repo root: bash tools/device_fused_mlp.sh
# (NO_COMPILE=1 leaves torch.compile out of the benchmark, QUICK=1 shortens its timing.)
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
python3 -m kgen.cli build kgen/specs/fused_mlp.yaml > "$OUT/pytest.txt" 2>&1; tail -3 "$OUT/pytest.txt"
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_mlp.py >> "$OUT/pytest.txt" 2>&1
tail -15 "$OUT/pytest.txt"
python3 -m kgen.benchmarks.fused_mlp ${QUICK:+--quick} ${NO_COMPILE:+--no-compile} > "$OUT/bench.txt" 2>&1
tail -80 "$OUT/bench.txt"
