#!/usr/bin/env bash
# One device call for fused_bias_act (issue 15): build, tune into a fresh table, put its entries
# into the shipped table of this checkout (replacing those buckets), time dispatch's choice
# against every candidate, torch.compile and a copy (`kgen bench --dispatch`), then the GPU tests.
# Usage on the device machine (repo root): bash tools/device_fba_tune.sh TABLE-NAME (h100 | h200)
# (TUNE_S / BENCH_S / TEST_S: seconds for each step; TEST_S=0 leaves the tests out)
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 KGEN_CACHE_DIR=/tmp/kgen-cache
name="${1:-gpu}"
python3 -m kgen.cli build kgen/specs/fused_bias_act.yaml --arch sm_90 --out /tmp/gen > "$OUT/build.txt" 2>&1
timeout "${TUNE_S:-330}" python3 -m kgen.cli tune kgen/specs/fused_bias_act.yaml --out "$OUT/$name-fba.json" > "$OUT/tune.txt" 2>&1
echo "tune rc $?"; tail -2 "$OUT/tune.txt"
python3 - "$OUT/$name-fba.json" "kgen/tuning/$name.json" <<'PY'
import json, sys
new = json.load(open(sys.argv[1]))["entries"]
table = json.load(open(sys.argv[2]))
table["entries"] = dict(sorted({**table["entries"], **new}.items()))  # buckets not re-tuned stay
open(sys.argv[2], "w").write(json.dumps(table, indent=1) + "\n")
print(f"merged {len(new)} fused_bias_act entries into {sys.argv[2]}")
PY
timeout "${BENCH_S:-200}" python3 -m kgen.cli bench kgen/specs/fused_bias_act.yaml --dispatch --json "$OUT/dispatch-fba.json" > "$OUT/dispatch-fba.txt" 2>&1
echo "bench rc $?"
if [ "${TEST_S:-120}" != 0 ]; then  # TEST_S=0: no tests
  timeout "${TEST_S:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_bias_act.py tests/test_tune.py > "$OUT/pytest.txt" 2>&1
  tail -3 "$OUT/pytest.txt"
fi
