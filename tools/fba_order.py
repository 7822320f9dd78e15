"""fused_bias_act: grid order down vs across (CUDA variants) against torch.compile and a copy,
gelu(x + 0.5 y + b), large and awkward shapes, interleaved rounds, min of medians (cuda_timer).
Usage on a GPU machine (repo root): PYTHONPATH=$PWD python3 tools/fba_order.py"""
import torch, torch.nn.functional as F
from kgen import spec
from kgen.families import fused_bias_act as fba
from kgen.runtime import dispatch
from kgen.runtime.timing import cuda_timer

S = spec.load("kgen/specs/fused_bias_act.yaml")
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
def expr_y(x, b, y): return F.gelu(x + 0.5 * y + b, approximate="tanh")
def expr(x, b): return F.gelu(x + b, approximate="tanh")
cy, cn = torch.compile(expr_y), torch.compile(expr)
for dt in ("bfloat16", "float32"):
    kernels = [dispatch.load(v) for v in S.variants if v.backend == "cuda" and v.dtype == dt and v.arch == "sm_90"]
    for rows, cols in ((8192, 11008), (16384, 4096), (6000, 5000), (4096, 4096), (1000, 12345), (30000, 768)):
        for has_y in (True, False):
            t = getattr(torch, dt)
            x = torch.randn(rows, cols, device="cuda", dtype=t); y = torch.randn_like(x) if has_y else None
            b = torch.randn(cols, device="cuda", dtype=t); out = torch.empty_like(x)
            want = fba.reference(x, b, y, 0.5, "gelu")
            res = {}
            for k in kernels:
                out.fill_(float("nan")); fba.launch(k, x, b, y, 0.5, "gelu", out)
                err = (out.float() - want.float()).abs().max().item()
                assert err < (0.05 if dt != "float32" else 1e-4), (k.name, err)
            fns = {k.name.replace("sm90_", ""): (lambda k=k: fba.launch(k, x, b, y, 0.5, "gelu", out)) for k in kernels}
            fns["compile"] = (lambda: cy(x, b, y)) if has_y else (lambda: cn(x, b))
            src = torch.cat([x.view(-1), y.view(-1)]) if has_y else x.view(-1).clone()
            big = torch.empty(src.numel() + x.numel(), device="cuda", dtype=t)
            fns["copy(same bytes)"] = lambda: big[: (src.numel() + x.numel()) // 2].copy_(big[(src.numel() + x.numel()) // 2:][: (src.numel() + x.numel()) // 2])
            for f in fns.values(): f()
            for _ in range(3):
                for n, f in fns.items(): res.setdefault(n, []).append(cuda_timer(f))
            best = {n: min(v) for n, v in res.items()}
            line = "  ".join(f"{n} {v:.1f}" for n, v in best.items())
            print(f"{dt} {rows}x{cols} y={int(has_y)}: {line}", flush=True)
            del x, y, b, out, src, big, want
            torch.cuda.empty_cache()
