"""fused_bias_act: every CUDA variant (orders down / across / flat) and the Triton ones against
torch.compile and a copy of the same bytes, gelu(x + 0.5 y + b), at large, odd and tiny shapes;
each variant's output checked against the float32 reference first. Interleaved rounds, min of
the per-round medians (kgen.runtime.timing.cuda_timer).
Usage on a GPU machine (repo root): PYTHONPATH=$PWD python3 tools/fba_flat.py [--rounds N] [--dump-inductor]"""
import argparse
import os

import torch
import torch.nn.functional as F

from kgen import spec
from kgen.families import fused_bias_act as fba
from kgen.runtime import dispatch
from kgen.runtime.timing import cuda_timer

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--min-us", type=float, default=1500)
ap.add_argument("--dtypes", default="bfloat16,float32,float16")
ap.add_argument("--shapes", default="8192x11008,16384x4096,6000x5000,4096x4096,1000x12345,30000x768,8x1048576,333x4104,1x100000,1x4096,7x1000")
args = ap.parse_args()
S = spec.load("kgen/specs/fused_bias_act.yaml")
print(torch.cuda.get_device_name(), torch.__version__, flush=True)


def expr_y(x, b, y):
    return F.gelu(x + 0.5 * y + b, approximate="tanh")


def expr(x, b):
    return F.gelu(x + b, approximate="tanh")


cy, cn = torch.compile(expr_y), torch.compile(expr)
short = lambda n: n.replace("sm90_", "").replace("_bf16", "").replace("_f16", "").replace("_f32", "")  # noqa: E731
for dt in args.dtypes.split(","):
    vs = [v for v in S.variants if v.dtype == dt and v.arch in ("sm_90", "sm_90a", None) and v.backend in ("cuda", "triton")]
    kernels = [dispatch.load(v) for v in vs]
    for shp in args.shapes.split(","):
        rows, cols = map(int, shp.split("x"))
        for has_y in (True, False):
            t = getattr(torch, dt)
            x = torch.randn(rows, cols, device="cuda", dtype=t)
            y = torch.randn_like(x) if has_y else None
            b = torch.randn(cols, device="cuda", dtype=t)
            out = torch.empty_like(x)
            want = fba.reference(x, b, y, 0.5, "gelu")
            for k in kernels:
                out.fill_(float("nan"))
                fba.launch(k, x, b, y, 0.5, "gelu", out)
                err = (out.float() - want.float()).abs().max().item()
                assert err < (0.05 if dt != "float32" else 1e-4), (k.name, err)
            fns = {short(k.name): (lambda k=k: fba.launch(k, x, b, y, 0.5, "gelu", out)) for k in kernels}
            fns["compile"] = (lambda: cy(x, b, y)) if has_y else (lambda: cn(x, b))
            nbytes = x.numel() * (3 if has_y else 2)
            big = torch.empty(nbytes, device="cuda", dtype=t)
            half = nbytes // 2
            fns["copy"] = lambda: big[:half].copy_(big[half: 2 * half])
            for f in fns.values():
                f()
            res = {}
            for _ in range(args.rounds):
                for n, f in fns.items():
                    res[n] = min(res.get(n, float("inf")), cuda_timer(f, args.min_us))
            best = min((v, n) for n, v in res.items() if n not in ("compile", "copy"))
            line = "  ".join(f"{n} {v:.1f}" for n, v in sorted(res.items(), key=lambda kv: kv[1]))
            print(f"{dt} {rows}x{cols} y={int(has_y)} best {best[1]} {best[0]:.1f} compile/best {res['compile'] / best[0]:.3f}: {line}", flush=True)
            del x, y, b, out, big, want
            torch.cuda.empty_cache()
