#!/usr/bin/env bash
# linear_logp benchmark on the device machine, from the repo root: kgen (dispatch and each
# bf16 Triton variant) against cuBLAS, eager PyTorch, torch.compile, cut-cross-entropy and
# Liger-Kernel (their wheels, pure Python, come from .whl/; the machine has no network).
# Usage: bash tools/bench_linear_logp.sh [--quick]   -> $OUT/llp-bench.txt, $OUT/llp-bench.json
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site" KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONUNBUFFERED=1
python3 -m kgen.cli bench kgen/specs/linear_logp.yaml --json "$OUT/llp-bench.json" "$@" 2>&1 | tee "$OUT/llp-bench.txt"
exit "${PIPESTATUS[0]}"
