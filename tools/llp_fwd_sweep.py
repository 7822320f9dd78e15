"""Forward-only sweep of linear_logp Triton configurations against cut-cross-entropy and
cuBLAS, at the issue's two bf16 shapes; for choosing the spec's first (dispatch) variant."""
import sys

import torch
import triton

from kgen import spec
from kgen.families import linear_logp as llp
from kgen.runtime import dispatch

CONFIGS = [  # block_n, block_v, block_d, num_warps, num_stages, split_v
    (128, 256, 64, 8, 3, 4), (128, 256, 64, 8, 4, 4), (128, 256, 64, 8, 2, 4), (256, 128, 64, 8, 3, 4),
    (128, 256, 32, 8, 5, 4), (128, 128, 64, 4, 4, 4), (64, 256, 64, 4, 4, 4), (256, 256, 64, 16, 2, 4),
]
for N, D, V in [(4096, 2048, 151936), (8192, 4096, 128256)]:
    h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, D, device="cuda") * (2 / D**0.5)).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    rows = [("cuBLAS h @ w.T", triton.testing.do_bench(lambda: h @ w.T, warmup=10, rep=50, return_mode="median"))]
    try:
        from cut_cross_entropy import linear_cross_entropy
        rows.append(("cut-cross-entropy", triton.testing.do_bench(
            lambda: linear_cross_entropy(h, w, t, reduction="none"), warmup=10, rep=50, return_mode="median")))
    except Exception as e:  # noqa: BLE001
        print("cce failed:", e)
    for bn, bv, bd, nw, ns, sv in CONFIGS:
        text = (f"family: linear_logp\ndtypes: [bfloat16]\nvariants:\n  - {{backend: triton, block_n: {bn}, "
                f"block_v: {bv}, block_d: {bd}, num_warps: {nw}, num_stages: {ns}, split_v: {sv}}}\n")
        try:
            v = spec.parse(text, "sweep.yaml").variants[0]
            mod = dispatch.load(v).module
            with llp.using(mod):
                ms = triton.testing.do_bench(lambda: llp.linear_logp(h, w, t), warmup=10, rep=50, return_mode="median")
            rows.append((v.name, ms))
        except Exception as e:  # noqa: BLE001
            print(f"{bn, bv, bd, nw, ns, sv} failed: {str(e).splitlines()[0][:200]}")
    gemm = rows[0][1]
    print(f"--- N={N} D={D} V={V}")
    for name, ms in rows:
        print(f"{ms:8.3f} ms  {ms / gemm:5.3f} x GEMM  {name}")
    sys.stdout.flush()
    del h, w, t
    torch.cuda.empty_cache()
