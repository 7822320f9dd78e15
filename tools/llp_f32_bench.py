"""linear_logp's float32 forward against torch.compile of the PyTorch expression and the
F.linear GEMM, with TF32 off and on (issue 19), and its largest error against float64.
Usage on a GPU machine (repo root): PYTHONPATH=$PWD python3 tools/llp_f32_bench.py [--dh-cublas]
(--dh-cublas: float32's dH by cuBLAS instead of the Triton kernel, backward_launch.DH_TRITON off)"""

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kgen import ops


def expr(h, w, t):
    return torch.log_softmax(F.linear(h, w).float(), -1).gather(1, t[:, None]).squeeze(1)


def main():
    if "--dh-cublas" in sys.argv[1:]:
        from kgen.families.linear_logp import backward_launch

        backward_launch.DH_TRITON = False
    torch.manual_seed(0)
    compiled = torch.compile(expr)
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__)
    for N, D, V in ((4096, 2048, 32000), (1024, 4096, 128256)):
        h = torch.randn(N, D, device="cuda") * 0.5
        w = torch.randn(V, D, device="cuda") / D ** 0.5
        t = torch.randint(0, V, (N,), device="cuda")
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            err = (ops.linear_logp(h, w, t).double() - expr(h.double(), w.double(), t)).abs().max().item()
            tk = do_bench(lambda: ops.linear_logp(h, w, t), warmup=50, rep=300)
            tc = do_bench(lambda: compiled(h, w, t), warmup=50, rep=300)
            tg = do_bench(lambda: F.linear(h, w), warmup=50, rep=300)
            print(f"f32 N={N} D={D} V={V} tf32={tf32}: kgen {tk:.3f} ms, compile {tc:.3f} ms, GEMM {tg:.3f} ms, "
                  f"kgen/compile {tk / tc:.2f}, max|err| {err:.2e}", flush=True)
            hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
            g = torch.randn(N, device="cuda")

            def step(fn):
                hk.grad = wk.grad = None
                fn(hk, wk, t).backward(g)
            bk = do_bench(lambda: step(ops.linear_logp), warmup=10, rep=200)
            bc = do_bench(lambda: step(compiled), warmup=10, rep=200)
            print(f"   fwd+bwd: kgen {bk:.3f} ms, compile {bc:.3f} ms, kgen/compile {bk / bc:.2f}", flush=True)


if __name__ == "__main__":
    main()
