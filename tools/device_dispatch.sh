#!/usr/bin/env bash
# One device call: dispatch before/after the tuning table (both shipped specs), host cost of
# fused_bias_act against the committed HEAD in .base/ (if carried), and the GPU tests given.
# Usage on the device machine (repo root): bash tools/device_dispatch.sh [pytest args]
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KGEN_CACHE_DIR=/tmp/kgen-cache
for s in fused_bias_act linear_logp; do
  PYTHONPATH="$PWD" python3 -m kgen.cli bench kgen/specs/$s.yaml --dispatch --json "$OUT/dispatch-$s.json" > "$OUT/dispatch-$s.txt" 2>&1
done
if [ -d .base ]; then
  for i in 1 2; do
    (cd .base && PYTHONPATH="$PWD" python3 tools/host_cost.py 1 2>&1 | sed 's/^/HEAD /')
    PYTHONPATH="$PWD" python3 tools/host_cost.py 1 2>&1 | sed 's/^/NEW  /'
  done > "$OUT/host-cost.txt"
fi
[ $# -gt 0 ] && PYTHONPATH="$PWD" python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/pytest.txt" 2>&1
tail -3 "$OUT/pytest.txt" 2>/dev/null; grep -E "kgen.ops|torch.add" "$OUT/host-cost.txt"
