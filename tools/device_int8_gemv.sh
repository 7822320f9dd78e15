#!/usr/bin/env bash
# int8_gemm's small-M CUDA kernels (kernel: gemv) on one GPU, in under 5 minutes: build every
# CUDA variant that runs here (ninja, in parallel), the gemv GPU tests, the M <= 16 benchmark
# (tools/bench_int8_gemv.py: floor, old variants, dispatch, bf16 cuBLAS), then the family's
# other GPU tests. Usage on the device machine (repo root): bash tools/device_int8_gemv.sh
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
nvcc --version | tail -2
timeout 60 python3 - <<'PY' > "$OUT/build.txt" 2>&1
import torch
from kgen import spec
from kgen.runtime import build, dispatch
S = spec.load("kgen/specs/int8_gemm.yaml")
cap = torch.cuda.get_device_capability()
vs = [v for v in S.variants if v.backend == "cuda" and dispatch.arch_runs_on(v.arch, cap)]
for r in build.build_cuda(vs):
    print(r.variant.name, r.status, r.error or "")
PY
tail -12 "$OUT/build.txt"
timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_gemm.py -k gemv > "$OUT/pytest_gemv.txt" 2>&1
tail -15 "$OUT/pytest_gemv.txt"
timeout 110 python3 tools/bench_int8_gemv.py --out "$OUT" > "$OUT/bench.txt" 2>&1
tail -25 "$OUT/bench.txt"
timeout 50 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_gemm.py -k "not gemv" > "$OUT/pytest_rest.txt" 2>&1
tail -6 "$OUT/pytest_rest.txt"
