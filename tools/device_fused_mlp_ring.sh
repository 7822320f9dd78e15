#!/usr/bin/env bash
# fused_mlp's TMA ring variants on one GPU (issue 22): their GPU tests (golden against float64,
# user widths) and the timing table beside the module and the other CUDA variants
# (tools/fused_mlp_ring_bench.py). Run from the repo root: bash tools/device_fused_mlp_ring.sh
# (ROWS=... the benchmark's B list; DTYPES="bfloat16 float16"; SKIP_TESTS=1, SKIP_BENCH=1; TUNE="shape ..."
# then runs `kgen tune --shapes` of those shapes, TUNE_DTYPE (bfloat16; TUNE_DTYPE_H100 on an H100),
# into a copy of the shipped table of this GPU, $OUT/h100.json or $OUT/h200.json). Writes to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KGEN_CACHE_DIR="${KGEN_CACHE_DIR:-/tmp/kgen-cache}" PYTHONPATH="$PWD:$PWD/tools:${PYTHONPATH:-}"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)" | tee "$OUT/versions.txt"
nvcc --version 2>/dev/null | tail -2 >> "$OUT/versions.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  start=$SECONDS
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu -x \
    -k "${TEST_K:-(golden_every_variant or user_widths or gpu_cuda_variant) and (st11 or st10 or st8 or st6 or st4)}" \
    tests/test_fused_mlp.py > "$OUT/pytest.txt" 2>&1
  rc=$?; echo "tests: rc $rc in $((SECONDS - start)) s"; tail -30 "$OUT/pytest.txt"
  [ $rc -eq 0 ] || exit $rc  # (a wrong or hung kernel: nothing to time)
fi
for dt in ${DTYPES:-bfloat16}; do
  [ -n "${SKIP_BENCH:-}" ] && break
  timeout ${BENCH_TIMEOUT:-240} python3 tools/fused_mlp_ring_bench.py --dtype "$dt" ${ROWS:+--rows $ROWS} 2>&1 \
    | grep -v Warning | tee -a "$OUT/bench.txt"
done
if [ -n "${TUNE:-}" ]; then
  gpu=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')")
  cp "kgen/tuning/$gpu.json" "$OUT/$gpu.json"
  dtype="${TUNE_DTYPE:-bfloat16}"
  [ "$gpu" = h100 ] && [ -n "${TUNE_DTYPE_H100:-}" ] && dtype="$TUNE_DTYPE_H100"
  timeout ${TUNE_TIMEOUT:-300} python3 -m kgen.cli tune kgen/specs/fused_mlp.yaml --dtype "$dtype" --shapes $TUNE \
    --out "$OUT/$gpu.json" --json "$OUT/tune.json" 2>&1 | grep -v Warning | tee "$OUT/tune.txt"
fi
