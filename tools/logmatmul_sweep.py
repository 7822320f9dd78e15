"""Device diagnostics for issue 17 (tools/device_logmatmul.sh, LMM_SWEEP=1), N = K = 4096
float32 against the copy floor: what other reads of w take (cuBLAS GEMV, torch reductions);
the CUDA variants, and variants built here with other knobs (`--more`), at the plan's K
split and forced ones; then the host cost of kgen.ops.logmatmul at B = 1, N = K = 512
against torch.add (interleaved minima, as the benchmark measures it) and the op's general
path (no fast path)."""

import dataclasses
import sys

import torch
import triton

from kgen import ops
from kgen import spec as kspec
from kgen.benchmarks.fused_bias_act import interleaved_min
from kgen.families import logmatmul as lmm
from kgen.families.logmatmul import launch
from kgen.runtime import dispatch

S = kspec.load("kgen/specs/logmatmul.yaml")
t = lambda f: 1e3 * triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median")
dev = torch.device("cuda")
w = torch.rand(4096, 4096, device=dev)
src, dst = torch.empty_like(w), torch.empty_like(w)
copy = t(lambda: dst.copy_(src))
floor = copy / 2
print(f"copy {copy:.1f} us -> floor {floor:.2f} us ({2 * w.numel() * 4 / copy / 1e3:.0f} GB/s)")
v1 = torch.rand(4096, device=dev)
for name, f in (("cuBLAS mv (B=1)", lambda: torch.mv(w, v1)), ("w.sum()", lambda: w.sum()),
                ("w.amax()", lambda: w.amax()), ("w.sum(1)", lambda: w.sum(1))):
    us = t(f)
    print(f"{name}: {us:.1f} us ({us / floor:.2f}x floor)")


def variant(base: str, **knobs):
    v = S.variant(base)
    return dataclasses.replace(v, knobs=tuple((k, knobs.get(k, val)) for k, val in v.knobs))


def sweep(v, batches, splits=()):
    mod = lmm.implementation(dispatch.load(v))
    for B in batches:
        if B > mod.max_b:
            continue
        x = torch.randn(B, 4096, device=dev) * 2
        ref = lmm.reference(x.double(), w.double(), torch.float64)
        key = (B, 4096, 4096, x.dtype, w.dtype, 0)
        plan = mod._plan(key)
        cells = []
        for s in (None, *splits):
            got = plan if s is None else mod._plan(key, s)
            if s is not None and got == plan:
                continue
            out = launch.forward(mod, x, w, splits=s)
            err = float((out.double() - ref).abs().max())
            us = t(lambda: launch.forward(mod, x, w, splits=s))
            cells.append(f"{'plan' if s is None else s}:{got[0]}x{got[1]} {us:.1f}us ({us / floor:.2f}x)"
                         + (f" ERR {err:.2e}" if err > 1e-3 else ""))
        print(f"{v.name} B={B}: " + " | ".join(cells), flush=True)


tries = [(S.variant("sm90_w4_n8_v4_b4_f32"), (1, 4, 8), (2,)), (S.variant("sm90_w4_n4_v4_u2_b8_f32"), (1, 4), ())]
if "--more" in sys.argv:  # a node per CTA, 4 steps in flight: 16 KiB contiguous per CTA per row pass
    tries += [(variant("sm90_w4_n4_v4_u2_b8_f32", nodes=1, unroll=4), (1, 2, 4), (2,)),
              (variant("sm90_w4_n4_v4_u2_b8_f32", nodes=2, unroll=4, warps=2), (1, 4), ())]
for v, batches, splits in tries:
    try:
        sweep(v, batches, splits)
    except Exception as e:  # noqa: BLE001 - a knob set that fails to build or launch: say so, go on
        print(f"{v.name}: {type(e).__name__}: {str(e)[:300]}", flush=True)

x, w5 = torch.randn(1, 512, device=dev), torch.rand(512, 512, device=dev)
a, b = torch.randn(1, 512, device=dev), torch.randn(1, 512, device=dev)
ops.logmatmul(x, w5)
print("dispatch at B=1, N=K=512:", getattr(lmm.op._module(dev, torch.float32, 1, 512, 512), "name", None),
      "fast path entries:", len(lmm.op._FAST))
for rep in range(2):
    best = interleaved_min([("torch.add", lambda: torch.add(a, b)), ("kgen.ops.logmatmul", lambda: ops.logmatmul(x, w5)),
                            ("op, general path", lambda: lmm.op._op(x, w5))], 1000, 7)
    print({k: round(v, 2) for k, v in best.items()}, f"ratio {best['kgen.ops.logmatmul'] / best['torch.add']:.2f}")
