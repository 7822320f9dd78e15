#!/usr/bin/env bash
# int8_gemm's small-M CUDA kernels (kernel: gemv) on one GPU, in about 5 minutes: build every
# CUDA variant that runs here (ninja, in parallel), the M <= 16 benchmark (tools/bench_int8_gemv.py:
# floor, same-size copy, old variants, dispatch, bf16 cuBLAS; every output checked), the gemv
# GPU tests, then the family's other GPU tests. Usage on the device machine (repo root):
#   bash tools/device_int8_gemv.sh
# Options (environment): SKIP_GEMV_TESTS=1, SKIP_REST=1 (the family's other GPU tests),
# SKIP_BENCH=1, BENCH_ARGS="--no-sweep --ms 1,16 ...", BUILD_TIMEOUT / GEMV_TIMEOUT /
# BENCH_TIMEOUT / REST_TIMEOUT / TUNE_TIMEOUT (seconds, TUNE_TIMEOUT per dtype);
# TUNE="int8 bfloat16 float16": re-tune the M <= 16 buckets of the issue's shapes for these
# dtypes (one `kgen tune` a dtype, each recorded as it ends) into $OUT/h100_int8_gemv.json, a
# copy of kgen/tuning/h100.json (the shipped table is not touched); NCU="VARIANT,M,N,K ...":
# Nsight Compute sections of those calls (tools/ncu_int8_gemv.py) into $OUT/ncu.txt.
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
nvcc --version | tail -2
SECONDS=0
timeout "${BUILD_TIMEOUT:-90}" python3 - <<'PY' > "$OUT/build.txt" 2>&1
import torch
from kgen import spec
from kgen.runtime import build, dispatch, toolchain
S = spec.load("kgen/specs/int8_gemm.yaml")
cap = torch.cuda.get_device_capability()
vs = [v for v in S.variants if v.backend == "cuda" and dispatch.arch_runs_on(v.arch, cap)]
for r in build.build_cuda(vs):
    print(r.variant.name, r.status, r.error or "")
    if r.status in ("built", "cached") and "gemv" in r.variant.name:
        for k, u in toolchain.resource_usage(r.entry.file(build.CUDA_LIB)).items():
            print("   ", k[-48:], u)
PY
grep -v "^    " "$OUT/build.txt" | tail -14; echo "build done at ${SECONDS}s"
if [ -z "${SKIP_BENCH:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-110}" python3 tools/bench_int8_gemv.py --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
  tail -25 "$OUT/bench.txt"; echo "bench done at ${SECONDS}s"
fi
if [ -z "${SKIP_GEMV_TESTS:-}" ]; then
  timeout "${GEMV_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_gemm.py -k gemv \
    > "$OUT/pytest_gemv.txt" 2>&1
  tail -15 "$OUT/pytest_gemv.txt"; echo "gemv tests done at ${SECONDS}s"
fi
if [ -z "${SKIP_REST:-}" ]; then
  timeout "${REST_TIMEOUT:-50}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_gemm.py -k "not gemv" \
    > "$OUT/pytest_rest.txt" 2>&1
  tail -6 "$OUT/pytest_rest.txt"; echo "rest done at ${SECONDS}s"
fi
if [ -n "${TUNE:-}" ]; then
  cp kgen/tuning/h100.json "$OUT/h100_int8_gemv.json"
  for dt in $TUNE; do
    timeout "${TUNE_TIMEOUT:-120}" python3 -m kgen.cli tune kgen/specs/int8_gemm.yaml --dtype "$dt" \
      --min-us "${TUNE_MIN_US:-300}" --out "$OUT/h100_int8_gemv.json" --json "$OUT/tune_$dt.json" \
      --shapes 1x4096x11008 16x4096x11008 1x12288x4096 16x12288x4096 1x22016x4096 16x22016x4096 \
      1x4096x4096 16x4096x4096 1x65536x4096 16x65536x4096 > "$OUT/tune_$dt.txt" 2>&1
    tail -3 "$OUT/tune_$dt.txt"; echo "tune $dt done at ${SECONDS}s"
  done
fi
if [ -n "${NCU:-}" ] && command -v ncu > /dev/null; then
  for job in $NCU; do
    IFS=, read -r v m n k <<< "$job"
    timeout "${NCU_TIMEOUT:-40}" ncu --kernel-name regex:gemv_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      python3 tools/ncu_int8_gemv.py "$v" "$m" "$n" "$k" >> "$OUT/ncu.txt" 2>&1
  done
  grep -E "ERR|Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Registers" "$OUT/ncu.txt" | head -40
  echo "ncu done at ${SECONDS}s"
fi
