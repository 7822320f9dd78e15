#!/usr/bin/env bash
# int8_gemm on one H100: its tests on the GPU (every variant against the exact / float64 reference,
# dispatch, CUDA graph replay, torch.compile), then issue 16's benchmark table (and each
# variant alone, for the tuning picture). Under 8 minutes.
# Usage on the device machine (repo root): bash tools/device_int8_gemm.sh   ($OUT: output folder)
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_int8_gemm.py > "$OUT/pytest.txt" 2>&1
tail -5 "$OUT/pytest.txt"
timeout 290 python3 -m kgen.benchmarks.int8_gemm --quick ${BENCH_ARGS:---variants} > "$OUT/bench.txt" 2>&1
tail -90 "$OUT/bench.txt"
