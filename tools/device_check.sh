#!/usr/bin/env bash
# One device call: versions, build, GPU tests, verify, bench. Writes logs and JSON to $OUT.
# Usage on the device machine (from the repo root): bash tools/device_check.sh [pytest args]
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KGEN_CACHE_DIR=/tmp/kgen-cache
export TRITON_DEFAULT_FP_FUSION=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/env.txt"
python3 -m kgen.cli build kgen/specs/fused_bias_act.yaml --out /tmp/gen 2>&1 | tee "$OUT/build.txt"
python3 -m pytest -q -p no:cacheprovider "${@:-tests}" 2>&1 | tee "$OUT/pytest.txt" | tail -30
python3 -m kgen.cli verify kgen/specs/fused_bias_act.yaml 2>&1 | tee "$OUT/verify.txt" | tail -32
python3 -m kgen.cli bench kgen/specs/fused_bias_act.yaml --json "$OUT/fba-bench.json" 2>&1 | tee "$OUT/bench.txt"
