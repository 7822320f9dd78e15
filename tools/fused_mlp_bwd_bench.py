"""fused_mlp's fused backward against backward_lean, and the training step it serves.

For DLRM's top (367-512-256-1: ReLU, ReLU, sigmoid) and bottom (13-512-256-64-16: ReLU after
each) MLPs, B in {128, 2048, 16384, 65536}, bfloat16 (--dtype float32 for float32, TF32 as
torch.backends.cuda.matmul.allow_tf32 says; --tf32 turns it on), every gradient (x, weights,
biases):

- backward GPU time (triton.testing.do_bench, median µs, L2 flushed between calls) of
  reference.backward_lean (the training fast path's backward before) and of the fused
  backward (fused_backward.Plan: two launches, three where the dW split over B is on), both
  on the same saved zs; beside it the floor (FLOPs 2x the forward's / 700 TFLOP/s + bytes of
  the zs and dz written and read / 3 TB/s) and the largest difference between the two, as a
  fraction of each gradient's largest element;
- training step (forward + backward, all gradients) host time: a loop of N steps synchronised
  once at the end, µs per step — what a training loop sees — through kgen.nn.FusedMLP with the
  fused backward on (KGEN_FUSED_MLP_FUSED_BWD=1; toggled here through fused_backward.ENABLED,
  which the variable sets) and off (=0: backward_lean), eager nn.Sequential and
  torch.compile(nn.Sequential) (a failing compile prints its error and the row goes on);
  and the same steps' GPU time (do_bench).

`python3 tools/fused_mlp_bwd_bench.py [--quick] [--dtype float32] [--tf32] [--no-compile]
[--json out.json]` (PYTHONPATH = the repo root; needs a CUDA GPU). Prints one JSON line per
case as it goes, then a markdown table.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch
import triton
from torch import nn

from kgen.families.fused_mlp import fused_backward as fb
from kgen.families.fused_mlp import op as fm_op
from kgen.nn import FusedMLP

ref = sys.modules["kgen.families.fused_mlp.reference"]

MLPS = {"top": ((367, 512, 256, 1), "relu", "sigmoid"), "bottom": ((13, 512, 256, 64, 16), "relu", "relu")}
BATCHES = (128, 2048, 16384, 65536)
PEAK_FLOPS, PEAK_BYTES = 700e12, 3.0e12  # the floor: H100-class bf16 dense, HBM copy
ACT = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def gpu_us(fn, quick) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=30 if quick else 100,
                                         return_mode="median")


def host_us(step, n) -> float:
    """Best of 3 loops of n steps, each synchronised once at its end: µs per step."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def sequential(widths, act, last, dtype):
    layers = []
    for i in range(len(widths) - 1):
        layers += [nn.Linear(widths[i], widths[i + 1]), ACT[last if i == len(widths) - 2 else act]()]
    return nn.Sequential(*layers).to(device="cuda", dtype=dtype)


def train_step(model, x, g):
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        model(x).backward(g)

    return step


def floor_us(widths, B, item) -> float:
    flops = 2 * 2 * B * sum(widths[i] * widths[i + 1] for i in range(len(widths) - 1))
    zs = B * sum(widths[1:]) * item  # the zs read, and as many bytes of dz written and read
    return (flops / PEAK_FLOPS + 2 * zs / PEAK_BYTES) * 1e6


def attempt(row, key, fn):
    """row[key] = fn(), or the error's first line (the traceback to stderr)."""
    try:
        row[key] = fn()
    except Exception as e:  # noqa: BLE001 -- a benchmark row goes on
        traceback.print_exc()
        row[key] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]


def backward_row(row, widths, act, last, dtype, B, quick):
    """GPU time of backward_lean and the fused backward on one set of saved zs."""
    torch.manual_seed(0)
    x = torch.randn(B, widths[0], device="cuda", dtype=dtype)
    ws = [torch.randn(widths[i + 1], widths[i], device="cuda", dtype=dtype) * widths[i] ** -0.5
          for i in range(len(widths) - 1)]
    bs = [torch.randn(w.shape[0], device="cuda", dtype=dtype) * 0.1 for w in ws]
    L = len(ws)
    _, zs = ref.eager(x, ws, bs, act, last, save=True)
    zs = [z if i < L - 1 or last != "none" else None for i, z in enumerate(zs)]
    g = torch.randn(B, widths[-1], device="cuda", dtype=dtype)
    hb, needs = (True,) * L, (True,) * (1 + 2 * L)
    plan = fb.plan(widths, dtype, x.device, B, hb, (act, last), needs)
    row["split S"] = plan.S

    def lean():
        return ref.backward_lean(g, x, ws, hb, zs, act, last, needs)

    def fused():
        return plan(g, x, ws, zs)

    a, b = fused(), lean()
    torch.cuda.synchronize()
    diffs = [float((p.float() - q.float()).abs().max() / (q.float().abs().max() + 1e-30))
             for p, q in zip([a[0], *a[1], *a[2]], [b[0], *b[1], *b[2]])]
    row["fused vs lean"] = max(diffs)
    row["bwd floor"] = floor_us(widths, B, x.element_size())
    attempt(row, "bwd lean gpu", lambda: gpu_us(lean, quick))
    attempt(row, "bwd fused gpu", lambda: gpu_us(fused, quick))


def step_row(row, widths, act, last, dtype, B, quick, compile_):
    """Host and GPU time of a training step: kgen with the fused backward on and off,
    eager nn.Sequential, torch.compile."""
    seq = sequential(widths, act, last, dtype)
    model = FusedMLP.from_sequential(seq)
    x = torch.randn(B, widths[0], device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(B, widths[-1], device="cuda", dtype=dtype)
    n = 30 if quick else (100 if B <= 16384 else 30)
    kgen = train_step(model, x, g)
    kgen()  # the general path once: remembers the signature for the training fast path
    for on, name in ((True, "kgen fused bwd"), (False, "kgen lean bwd")):
        fb.ENABLED = on
        try:
            attempt(row, f"{name} host", lambda: host_us(kgen, n))
            attempt(row, f"{name} gpu", lambda: gpu_us(kgen, quick))
        finally:
            fb.ENABLED = True
    entry = fm_op._TRAIN.get(fm_op._call(x, list(model.weights), list(model.biases), act, last))
    row["fast path + fused"] = bool(entry and any(isinstance(p, fb.Plan) and p.state == "ok"
                                                  for p in entry.plans.values()))
    eager = train_step(seq, x, g)
    attempt(row, "eager host", lambda: host_us(eager, n))
    attempt(row, "eager gpu", lambda: gpu_us(eager, quick))
    if compile_:
        def compiled():
            step = train_step(torch.compile(seq, dynamic=False), x, g)
            step()  # compiles here: an error is this row's, not the script's
            return step

        holder = {}
        attempt(holder, "step", compiled)
        if callable(holder["step"]):
            attempt(row, "torch.compile host", lambda: host_us(holder["step"], n))
            attempt(row, "torch.compile gpu", lambda: gpu_us(holder["step"], quick))
        else:
            row["torch.compile host"] = row["torch.compile gpu"] = holder["step"]


def fmt(v):
    if isinstance(v, float):
        return f"{v:.1e}" if v < 1 else f"{v:.0f}" if v >= 10 else f"{v:.1f}"
    return str(v)


def main(argv):
    quick = "--quick" in argv
    dname = argv[argv.index("--dtype") + 1] if "--dtype" in argv else "bfloat16"
    dtype = getattr(torch, dname)
    if "--tf32" in argv:
        torch.backends.cuda.matmul.allow_tf32 = True
    out = argv[argv.index("--json") + 1] if "--json" in argv else None
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {dname}"
          f"{' (TF32 on)' if dname == 'float32' and torch.backends.cuda.matmul.allow_tf32 else ''}", flush=True)
    rows = []
    for mlp, (widths, act, last) in MLPS.items():
        for B in BATCHES:
            row = {"case": f"{mlp} {'-'.join(map(str, widths))} B={B}"}
            attempt(row, "_bwd", lambda: backward_row(row, widths, act, last, dtype, B, quick))
            attempt(row, "_step", lambda: step_row(row, widths, act, last, dtype, B, quick, "--no-compile" not in argv))
            for k in ("_bwd", "_step"):
                if row.get(k) is None:
                    row.pop(k)
            rows.append(row)
            print(json.dumps(row), flush=True)
    cols = [("bwd floor", "floor"), ("bwd lean gpu", "lean"), ("bwd fused gpu", "fused"), ("split S", "S"),
            ("fused vs lean", "Δ")]
    steps = ["kgen fused bwd", "kgen lean bwd", "eager", "torch.compile"]
    print("\n| case | bwd GPU µs: " + " / ".join(c[1] for c in cols) + " | "
          + " | ".join(f"step {s} host / gpu µs" for s in steps) + " | compile ÷ fused (host) |")
    print("|---|---|" + "---:|" * (len(steps) + 1))
    for r in rows:
        cells = [" / ".join(fmt(r.get(c, "-")) for c, _ in cols)]
        cells += [f"{fmt(r.get(s + ' host', '-'))} / {fmt(r.get(s + ' gpu', '-'))}" for s in steps]
        a, c = r.get("kgen fused bwd host"), r.get("torch.compile host")
        cells.append(f"{c / a:.1f}x" if isinstance(a, float) and isinstance(c, float) else "-")
        print(f"| {r['case']} | " + " | ".join(cells) + " |")
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
