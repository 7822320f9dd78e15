#!/usr/bin/env bash
# One device call: start-up times, then `kgen tune` of both shipped specs into $OUT/<gpu>.json.
# Usage on the device machine (repo root): bash tools/device_tune.sh [TABLE-NAME] [tune args]
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KGEN_CACHE_DIR=/tmp/kgen-cache
name="${1:-gpu}"; shift || true
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  nvcc --version | tail -1; } 2>&1 | tee "$OUT/env.txt"
[ -z "${SKIP_STARTUP:-}" ] && python3 tools/startup.py --runs 2 --json "$OUT/startup.json" 2>&1 | tee "$OUT/startup.txt"
python3 -m kgen.cli build kgen/specs/linear_logp.yaml --out /tmp/gen > "$OUT/build.txt" 2>&1 &
python3 -m kgen.cli build kgen/specs/fused_bias_act.yaml --out /tmp/gen >> "$OUT/build.txt" 2>&1; wait
for s in fused_bias_act linear_logp; do
  python3 -m kgen.cli tune kgen/specs/$s.yaml --out "$OUT/$name.json" --json "$OUT/tune-$s.json" "$@" 2>&1 | tee "$OUT/tune-$s.txt"
done
