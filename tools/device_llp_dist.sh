#!/usr/bin/env bash
# Issue 23 on a 2-GPU machine (nvidia-h200-x2), from the repo root: the vocab-parallel
# linear_logp's GPU tests (NCCL, bf16, CUDA graph replay, torch.compile) -> $OUT/pytest.txt,
# then its benchmark (1 GPU vs 2 GPUs, communication alone, a Megatron-style eager peer,
# verl's linear_cross_entropy when .peers/verl is there, peak memory) -> $OUT/bench.txt.
# The kernels build on first use into KGEN_CACHE_DIR. .peers/ is git-ignored: run with the
# device tool's carry [".peers"] for the verl row (without it the benchmark says so, and
# goes on).
# Usage: bash tools/device_llp_dist.sh [bench args, e.g. --iters 5]
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print(torch.cuda.device_count(), torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
timeout 270 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_linear_logp_dist.py > "$OUT/pytest.txt" 2>&1
tail -15 "$OUT/pytest.txt"
timeout 270 torchrun --standalone --nproc-per-node 2 tools/bench_llp_dist.py "$@" > "$OUT/bench.txt" 2>&1
rc=$?
cat "$OUT/bench.txt" | grep -v "^W\|^\[W" | tail -40
exit $rc
