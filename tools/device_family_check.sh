#!/usr/bin/env bash
# One device call for issue 21's GPU half: scaffold a family, install, build, verify and run
# its tests on the GPU; the GPU tests of user specs, both shipped families and tuning; and,
# when a copy of an older commit is carried in .base/ (git archive REV | tar -x -C .base),
# fused_bias_act's host cost per call there and here, interleaved.
# Usage on the device machine (repo root): bash tools/device_family_check.sh
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
d=/tmp/kgen-scaffold; rm -rf "$d"
{ python3 -m kgen.cli new-family axpb --dir "$d/axpb" &&
  python3 -m pip install -q --no-deps --no-build-isolation -e "$d/axpb" &&   # the image has the deps
  (cd "$d/axpb" && python3 -m kgen.cli build kgen_axpb/specs/axpb.yaml && python3 -m kgen.cli verify kgen_axpb/specs/axpb.yaml &&
   python3 -m pytest -q -p no:cacheprovider tests); } > "$OUT/scaffold.txt" 2>&1
tail -3 "$OUT/scaffold.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_plugins.py tests/test_fused_bias_act.py tests/test_tune.py \
  tests/test_linear_logp_gpu.py tests/test_linear_logp_cuda.py > "$OUT/pytest.txt" 2>&1
tail -3 "$OUT/pytest.txt"
if [ -d .base ]; then
  for i in 1 2; do
    (cd .base && PYTHONPATH="$PWD" python3 tools/host_cost.py 1 2>&1 | sed 's/^/BASE /')
    python3 tools/host_cost.py 1 2>&1 | sed 's/^/HERE /'
  done > "$OUT/host-cost.txt"
  grep -E "kgen.ops|torch.add" "$OUT/host-cost.txt"
fi
