#!/usr/bin/env bash
# GPU tests file by file on the device machine, each under its own time limit, one summary line a
# file (passed / failed / skipped, or "stopped at the limit"), logs under $OUT. Optionally under a
# Triton packed by tools/pack_triton.sh (the newest release, not the device image's).
#   bash tools/device_tests.sh tests/test_fused_bias_act.py tests/test_int8_gemm.py ...
# Environment: PER_FILE_S (default 240), PYTEST_ARGS (e.g. '-k "not compile"'), TRITON_PACK
# (build/triton-VERSION.tar.xz, carried with the call).
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KGEN_CACHE_DIR="${KGEN_CACHE_DIR:-/tmp/kgen-cache}"
if [ -n "${TRITON_PACK:-}" ]; then
  # shellcheck source=tools/pack_triton.sh
  source tools/pack_triton.sh --use "$TRITON_PACK" || { echo "cannot use $TRITON_PACK"; exit 1; }
fi
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" \
  || exit 1
for f in "$@"; do
  log="$OUT/$(basename "$f" .py).log"
  SECONDS=0
  eval timeout "${PER_FILE_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu "$f" "${PYTEST_ARGS:-}" > "$log" 2>&1
  rc=$?
  if [ $rc -eq 124 ]; then
    # pytest -q's progress characters so far (a line of them has no percentage until it is full)
    prog=$(grep -E '^[.sFExX]+( +\[ *[0-9]+%\])?$' "$log" | sed 's/ *\[.*//' | tr -d '\n')
    echo "$f: stopped at the ${PER_FILE_S:-240} s limit after $(tr -cd . <<< "$prog" | wc -c) passed," \
      "$(tr -cd s <<< "$prog" | wc -c) skipped, $(tr -cd FE <<< "$prog" | wc -c) failed or errors"
  else
    echo "$f: $(tail -1 "$log") (${SECONDS} s)"
  fi
  grep "^FAILED" "$log" | head -5
done
