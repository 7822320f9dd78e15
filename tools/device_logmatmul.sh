#!/usr/bin/env bash
# issue 17 on one GPU: build logmatmul's variants, its GPU tests, then its benchmark
# (forward at N = K = 4096 vs the PyTorch expression eager and compiled and the copy
# floor; forward + backward; host cost; block-sparse). Under 8 minutes on an H100.
# Usage on the device machine (repo root): bash tools/device_logmatmul.sh   ($OUT: outputs)
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
python3 -m kgen.cli build kgen/specs/logmatmul.yaml > "$OUT/build.txt" 2>&1; tail -22 "$OUT/build.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_logmatmul.py > "$OUT/pytest.txt" 2>&1
tail -15 "$OUT/pytest.txt"
timeout 200 python3 -m kgen.cli bench kgen/specs/logmatmul.yaml --quick --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
grep -v "^{" "$OUT/bench.txt" | tail -60
