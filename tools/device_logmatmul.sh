#!/usr/bin/env bash
# issue 17 on one GPU: build logmatmul's variants, its benchmark (forward at N = K = 4096 vs
# the PyTorch expression eager and compiled and the copy floor; forward + backward; host
# cost; block-sparse), a breakdown of the backward's launches, then its GPU tests.
# Usage on the device machine (repo root): bash tools/device_logmatmul.sh   ($OUT: outputs)
#   KGEN_BENCH_NO_COMPILE=1 (or =backward): no torch.compile peers (in that table)
#   LMM_DIAG=0: no backward breakdown / profile
#   LMM_TUNE=1: then re-tune the family into $OUT/h100.json (a copy of kgen/tuning/h100.json),
#   on an H100 only
#   LMM_SWEEP=1: first the CUDA variants over K splits and the host cost (tools/logmatmul_sweep.py;
#   LMM_SWEEP_ARGS=--more adds variants built with other knobs)
#   LMM_TEST_FIRST='pytest -k expr': GPU tests of that selection right after the build
#   LMM_BENCH=0: no benchmark
#   KGEN_LOGMATMUL_CUDA_BACKWARD=0: the op's backward on the Triton companion instead of a
#   CUDA variant's own backward (launch.CUDA_BACKWARD, on by default; tools/logmatmul_fb.py
#   times the two)
set -uo pipefail
OUT="${OUT:-/tmp/kgen-out}"; mkdir -p "$OUT"
export KGEN_CACHE_DIR=/tmp/kgen-cache PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
nvcc --version | tail -2
timeout "${LMM_BUILD_S:-90}" python3 -m kgen.cli build kgen/specs/logmatmul.yaml > "$OUT/build.txt" 2>&1
grep -E "cuda|triton|fail|rror" "$OUT/build.txt" | head -40
if [ -n "${LMM_TEST_FIRST:-}" ]; then
  timeout "${LMM_TEST_FIRST_S:-120}" python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_logmatmul_gpu.py \
    -k "$LMM_TEST_FIRST" > "$OUT/pytest_first.txt" 2>&1
  tail -8 "$OUT/pytest_first.txt"
fi
[ "${LMM_SWEEP:-0}" = 1 ] && timeout "${LMM_SWEEP_S:-90}" python3 tools/logmatmul_sweep.py ${LMM_SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.txt"
[ "${LMM_BENCH:-1}" = 1 ] && timeout "${LMM_BENCH_S:-150}" python3 -m kgen.cli bench kgen/specs/logmatmul.yaml --quick --json "$OUT/bench.json" \
  > "$OUT/bench.txt" 2>&1
[ "${LMM_BENCH:-1}" = 1 ] && grep -v "^{" "$OUT/bench.txt" | tail -70
[ "${LMM_DIAG:-1}" = 1 ] && timeout "${LMM_DIAG_S:-60}" python3 - <<'PY' 2>&1 | tee "$OUT/diag.txt"
# the backward alone (one-pass kernel and GEMM form), then where one op fwd+bwd step goes
import time, torch, triton
from kgen import ops
from kgen.families import logmatmul as lmm
from kgen.families.logmatmul import backward_launch, launch, plans
from kgen.runtime import dispatch
from kgen import spec as kspec
S = kspec.load("kgen/specs/logmatmul.yaml")
t = lambda f: 1e3 * triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median")
mod = lmm.implementation(dispatch.load(S.variant("triton_b4_n16_k128_w4_f32")))
w = torch.rand(4096, 4096, device="cuda")
for B in (1, 2, 4, 8):
    x = torch.randn(B, 4096, device="cuda") * 2
    out = launch.forward(mod, x, w)
    g = torch.randn(B, 4096, device="cuda")
    one = t(lambda: backward_launch.backward(mod, x, w, out, g, gemm=False))
    two = t(lambda: backward_launch.backward(mod, x, w, out, g, gemm=True))
    print(f"B={B}: backward one-pass kernel {one:.1f} us, GEMM form {two:.1f} us")
for B in (1, 8):
    x = (torch.randn(B, 4096, device="cuda") * 2).requires_grad_()
    wl = w.clone().requires_grad_()
    g = torch.randn(B, 4096, device="cuda")
    def step():
        x.grad = wl.grad = None
        ops.logmatmul(x, wl).backward(g)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        step()
    host = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 50 * 1e6
    print(f"B={B}: op fwd+bwd host {host:.0f} us/step, wall {wall:.0f} us/step, do_bench {t(step):.0f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
from kgen.families.logmatmul import op
for B in (1, 8, 16, 64, 256):
    m = op._module(torch.device("cuda", 0), torch.float32, B, 4096, 4096)
    print(f"dispatch B={B}: {getattr(m, 'name', None) or getattr(m, '__name__', m)}")
PY
[ "${LMM_TEST_S:-120}" != 0 ] && timeout "${LMM_TEST_S:-120}" python3 -m pytest -q -x -p no:cacheprovider -m gpu \
  tests/test_logmatmul_gpu.py > "$OUT/pytest.txt" 2>&1 && true
[ "${LMM_TEST_S:-120}" != 0 ] && tail -15 "$OUT/pytest.txt"
if [ "${LMM_TUNE:-0}" = 1 ] && nvidia-smi -L | grep -q H100; then
  cp kgen/tuning/h100.json "$OUT/h100.json"
  timeout "${LMM_TUNE_S:-200}" python3 -m kgen.cli tune kgen/specs/logmatmul.yaml --out "$OUT/h100.json" \
    --min-us "${LMM_TUNE_US:-300}" > "$OUT/tune.txt" 2>&1
  tail -30 "$OUT/tune.txt"
fi
