"""Every public op at random awkward shapes through dispatch and the shipped tables, against
float64 within the spec's stated tolerance, and a second call bitwise equal to the first.

    python3 tools/sweep_numerics.py [--cases 12] [--only fba,llp,lm,i8,fm] [--seed 2211] [--one-wide 0.2]
    DEV=cpu SCALE=0.01 python3 tools/sweep_numerics.py --cases 3   # the script itself, on a CPU

Families: fused_bias_act (2-D and 3-D x, every activation, with and without y), linear_logp
(bias, temperature, ignored rows, entropy; logp, entropy and every gradient), logmatmul (-inf
entries, float32 or 16-bit w; out and both gradients), int8_mm (exact) / int8_linear /
w8a16_linear (per channel and grouped), fused_mlp (1-6 layers of widths 1-1100, every
activation, biases on and off, TF32 on and off; its error taken over twice eager's own where
that exceeds the tolerance: 16-bit ReLU masks flip as eager's do; and its training step, every
gradient, the fast path's second step bitwise equal to its first; in 16-bit dtypes, the fused
backward with each dz-chain tile forced, against backward_lean). Prints each failure and
rejection, a line as each family's cases end, then a summary: cases, failed, rejected, worst
error / tolerance per op. Stopped by SIGTERM (`timeout`), it prints the summary so far and
exits 124."""

import argparse
import math
import os
import random
import signal
import sys
import time
import traceback

import torch

if os.environ.get("DEV", "cuda") == "cpu":  # the interpreter, before any kernel is decorated at import
    from kgen.runtime import interpret  # (fused_mlp's backward kernels are: fused_backward_kernels.py)

    interpret.enable()  # (TRITON_INTERPRET=1, with its bf16 dots and elementwise ops fixed)

import kgen.families.fused_bias_act as fba
import kgen.families.fused_mlp as fm
import kgen.families.linear_logp as llp
import kgen.families.logmatmul as lm
from kgen import ops, spec
from kgen.families.int8_gemm.golden import w8a16_error_ratio
from kgen.runtime.op import error_ratio

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--cases", type=int, default=12)
ap.add_argument("--only", default=None, help="comma-separated: fba, llp, lm, i8, fm")
ap.add_argument("--seed", type=int, default=2211)
ap.add_argument("--one-wide", type=float, default=0.0,
                help="fused_mlp: the chance that a width is 1 (a one-wide layer: float32's TF32 rules, "
                     "batch sums that cancel); 0 keeps earlier seeds' cases")
args = ap.parse_args()
dev = torch.device(os.environ.get("DEV", "cuda"))
SCALE = float(os.environ.get("SCALE", "1"))  # shrinks every size (DEV=cpu runs)
N_CASES, ONLY, rng = args.cases, args.only.split(",") if args.only else None, random.Random(args.seed)
NUM = {
    f: spec.load(f"kgen/specs/{f}.yaml").numerics
    for f in ("fused_bias_act", "linear_logp", "logmatmul", "int8_gemm", "fused_mlp")
}
stats = {}


def dim(lo, hi):  # log-uniform, awkward
    hi = max(lo, int(hi * SCALE))
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def report(op, desc, res, ok_thr=1.0):
    s = stats.setdefault(op, [0, 0, 0, 0.0])
    s[0] += 1
    worst = max(r for _, r in res) if res else 0.0
    s[3] = max(s[3], worst if math.isfinite(worst) else 1e9)
    if not worst <= ok_thr:
        s[1] += 1
        print(f"FAIL {op} {desc}: " + ", ".join(f"{n}={r:.3g}" for n, r in res if not r <= ok_thr), flush=True)


# A CUDA fault (an illegal address, ...) is a failure, not a refusal, and leaves the process's
# CUDA context unusable: the sweep reports it as failed, prints its summary so far and stops
# (exit status 1); rerun the case on its own (under compute-sanitizer) to find the kernel.
CUDA_FAULTS = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
               "device-side assert")


def is_fault(e) -> bool:
    return any(f in str(e) for f in CUDA_FAULTS)


def summary():
    print("summary (cases, failed, rejected, worst ratio):")
    for k, v in stats.items():
        print(f"  {k:16s} {v[0]:4d} {v[1]:3d} {v[2]:3d} {v[3]:.3g}", flush=True)


def rejected(op, desc, e):
    msg = str(e).splitlines()[0][:160] if str(e) else ""
    if is_fault(e):
        stats.setdefault(op, [0, 0, 0, 0.0])[1] += 1
        print(f"FAILED {op} {desc}: a CUDA fault: {type(e).__name__}: {msg}", flush=True)
        summary()
        raise SystemExit(1)
    stats.setdefault(op, [0, 0, 0, 0.0])[2] += 1
    print(f"rejected {op} {desc}: {type(e).__name__}: {msg}", flush=True)


def twice(op, desc, f):
    """(f(), f()): the op called twice on the same inputs; None (counted as rejected) where it
    refuses them."""
    try:
        return f(), f()
    except (ValueError, TypeError, RuntimeError) as e:
        rejected(op, desc, e)
        return None


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def case_fba():
    dt = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    rows, cols = dim(1, 20000), dim(1, 20000)
    if rows * cols > 3e8:
        rows = max(1, int(3e8 // cols))
    act = rng.choice(list(fba.ACTIVATIONS))
    has_y = rng.random() < 0.5
    alpha = rng.choice([1.0, 0.5, -1.25])
    shape = (rows, cols) if rng.random() < 0.8 else (2, (rows + 1) // 2, cols)
    x = (torch.randn(*shape, device=dev) * 2).to(dt)
    b = torch.randn(cols, device=dev).to(dt)
    y = (torch.randn(*shape, device=dev) * 2).to(dt) if has_y else None
    desc = f"{tuple(shape)} {dt} act={act} y={has_y} alpha={alpha}"
    outs = twice("fused_bias_act", desc, lambda: ops.fused_bias_act(x, b, y, alpha=alpha, act=act))
    if outs is None:
        return
    o1, o2 = outs
    want = fba.reference(x, b, y, alpha=alpha, act=act, compute=torch.float64)
    report(
        "fused_bias_act",
        desc,
        [
            ("out", error_ratio(o1, want, NUM["fused_bias_act"][str(dt)[6:]])),
            ("repeat", 0.0 if same([o1], [o2]) else math.inf),
        ],
    )


def case_llp():
    dt = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    N, V, D = dim(1, 700), dim(2, 70000), dim(8, 1500)
    if N * V > 2e8:
        V = max(2, int(2e8 // N))
    has_b = rng.random() < 0.4
    temp = rng.choice([1.0, 0.7, 1.3])
    ent = rng.random() < 0.5
    h = torch.randn(N, D, device=dev).to(dt)
    w = (torch.randn(V, D, device=dev) * (2.0 / math.sqrt(D))).to(dt)
    b = (torch.randn(V, device=dev) * 0.5).to(dt) if has_b else None
    t = torch.randint(0, V, (N,), device=dev)
    t[::5] = -100
    gl, ge = torch.randn(N, device=dev), torch.randn(N, device=dev)
    desc = f"N={N} V={V} D={D} {dt} bias={has_b} T={temp} entropy={ent}"
    res, outs = [], []
    try:
        for _ in range(2):
            leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if has_b else ())]
            r = ops.linear_logp(
                leaves[0], leaves[1], t, leaves[2] if has_b else None, temperature=temp, return_entropy=ent
            )
            lp, en = r if ent else (r, None)
            loss = (lp * gl).sum() + ((en * ge).sum() if ent else 0)
            loss.backward()
            outs.append([lp.detach(), *([en.detach()] if ent else []), *[x.grad for x in leaves]])
    except (ValueError, TypeError, RuntimeError) as e:
        return rejected("linear_logp", desc, e)
    leaves = [x.double().requires_grad_() for x in (h, w) + ((b,) if has_b else ())]
    lp, en = llp.reference(
        leaves[0], leaves[1], t, leaves[2] if has_b else None, temperature=temp, compute=torch.float64
    )
    ((lp * gl.double()).sum() + ((en * ge.double()).sum() if ent else 0)).backward()
    want = [lp.detach(), *([en.detach()] if ent else []), *[x.grad for x in leaves]]
    names = ["logp", *(["entropy"] if ent else []), "dh", "dw", *(["db"] if has_b else [])]
    tol = NUM["linear_logp"][str(dt)[6:]]
    for n, g, wv in zip(names, outs[0], want):
        if n.startswith("d"):
            res.append(
                (
                    n,
                    float(
                        ((g.double() - wv).abs() / (llp.GRAD_TOL[str(dt)[6:]] * max(1.0, float(wv.abs().max())))).max()
                    ),
                )
            )
        else:
            res.append((n, error_ratio(g, wv, tol)))
    res.append(("repeat", 0.0 if same(outs[0], outs[1]) else math.inf))
    report("linear_logp", desc, res)


def case_lm():
    dt = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    wdt = rng.choice([torch.float32, dt])
    B, N, K = rng.choice([1, 2, 3, 5, 8, 13, 16, 31, 64, 129, 300]), dim(1, 5000), dim(1, 5000)
    x, w = lm.make_inputs(B, N, K, dt, dev, wdt, seed=rng.randrange(1000))
    g = torch.randn(B, N, device=dev, dtype=torch.float64)
    desc = f"B={B} N={N} K={K} x={dt} w={wdt}"
    outs = []
    try:
        for _ in range(2):
            xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
            o = ops.logmatmul(xl, wl)
            o.backward(g.float())
            outs.append([o.detach(), xl.grad, wl.grad])
    except (ValueError, TypeError, RuntimeError) as e:
        return rejected("logmatmul", desc, e)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = lm.reference(xr, wr, compute=torch.float64)
    ref.backward(g)
    tol = NUM["logmatmul"][str(dt)[6:]]
    o = outs[0][0].double()
    r = ref.detach()
    both_inf = torch.isinf(r) & (o == r)
    err = ((o - r).abs() / (tol.atol + tol.rtol * r.abs())).masked_fill(both_inf, 0.0)
    res = [("out", float(err.max()) if not torch.isnan(err).any() else math.inf)]
    for n, gg, wv, gdt in (("dx", outs[0][1], xr.grad, str(dt)[6:]), ("dw", outs[0][2], wr.grad, str(wdt)[6:])):
        e = (gg.double() - wv).abs() / (lm.GRAD_TOL[gdt] * max(1.0, float(wv.abs().max())))
        res.append((n, float(e.max()) if not torch.isnan(e).any() else math.inf))
    res.append(("repeat", 0.0 if same(outs[0], outs[1]) else math.inf))
    report("logmatmul", desc, res)


def case_i8():
    M, N, K = dim(1, 4000), dim(1, 12000), 16 * dim(1, 500)
    if rng.random() < 0.3:
        K = dim(1, 8000)
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=dev)
    b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=dev)
    which = rng.choice(["mm", "linear", "w8a16"])
    desc = f"{which} M={M} N={N} K={K}"
    try:
        if which == "mm":
            o1, o2 = ops.int8_mm(a, b), ops.int8_mm(a, b)
            want = a.double() @ b.double().T
            return report(
                "int8_mm",
                desc,
                [
                    ("exact", 0.0 if torch.equal(o1.double(), want) else math.inf),
                    ("repeat", 0.0 if torch.equal(o1, o2) else math.inf),
                ],
            )
        if which == "linear":
            odt = rng.choice([torch.bfloat16, torch.float16])
            sa = torch.rand(M, device=dev) * 0.02 + 1e-3
            sb = torch.rand(N, device=dev) * 0.02 + 1e-3
            bias = torch.randn(N, device=dev) if rng.random() < 0.5 else None
            desc += f" out={odt} bias={bias is not None}"
            o1 = ops.int8_linear(a, b, sa, sb, bias, out_dtype=odt)
            o2 = ops.int8_linear(a, b, sa, sb, bias, out_dtype=odt)
            want = (a.double() @ b.double().T) * sa.double()[:, None] * sb.double()[None, :] + (
                bias.double() if bias is not None else 0
            )
            return report(
                "int8_linear",
                desc,
                [
                    ("out", error_ratio(o1, want, NUM["int8_gemm"]["int8"])),
                    ("repeat", 0.0 if torch.equal(o1, o2) else math.inf),
                ],
            )
        xdt = rng.choice([torch.bfloat16, torch.float16])
        x = torch.randn(M, K, device=dev).to(xdt)
        gs = rng.choice([None, None, 32, 64, 128])
        if gs and K % gs:
            gs = None
        sb = (
            (torch.rand(N, device=dev) * 0.02 + 1e-3)
            if gs is None
            else (torch.rand(N, K // gs, device=dev) * 0.02 + 1e-3)
        )
        bias = torch.randn(N, device=dev).to(xdt) if rng.random() < 0.5 else None
        desc += f" x={xdt} group={gs} bias={bias is not None}"
        o1 = ops.w8a16_linear(x, b, sb, bias, group_size=gs)
        o2 = ops.w8a16_linear(x, b, sb, bias, group_size=gs)
        err = w8a16_error_ratio(o1, x, b, sb, bias, gs, NUM["int8_gemm"][str(xdt)[6:]])
        return report("w8a16_linear", desc, [("out", err), ("repeat", 0.0 if torch.equal(o1, o2) else math.inf)])
    except (ValueError, TypeError, RuntimeError) as e:
        return rejected("int8_" + which, desc, e)


def case_fm():
    dt = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    L = rng.randint(1, 6)
    widths = [dim(1, 1100) for _ in range(L + 1)]
    if args.one_wide:  # (only when asked: at 0 the draws, and so earlier seeds' cases, are as they were)
        widths = [1 if rng.random() < args.one_wide else w for w in widths]
    if rng.random() < 0.3:
        widths = [int(v) for v in rng.choice([fm.DLRM_TOP, fm.DLRM_BOTTOM]).split("-")]
    B = dim(1, 70000)
    a = rng.choice(list(fm.ACTIVATIONS))
    last = rng.choice(list(fm.ACTIVATIONS))
    bias = rng.random() < 0.8
    tf32 = rng.random() < 0.5 if dt == torch.float32 else False
    torch.backends.cuda.matmul.allow_tf32 = tf32
    x, ws, bs = fm.make_inputs(dev, dt, B, tuple(widths), seed=rng.randrange(1000), bias=bias)
    desc = f"B={B} widths={'-'.join(map(str, widths))} {dt} tf32={tf32} act={a}/{last} bias={bias}"
    outs = twice("fused_mlp", desc, lambda: ops.fused_mlp(x, ws, bs, activation=a, last_activation=last))
    if outs is None:
        return
    o1, o2 = outs
    want = fm.reference(x, ws, bs, a, last)
    tol = NUM["fused_mlp"][str(dt)[6:]]
    # eager's own error in dt, as the tests compare (16-bit relu masks flip like eager's)
    eag = fm.eager(x, ws, bs, a, last)[0]
    res = [
        ("out", error_ratio(o1, want, tol)),
        ("eager", error_ratio(eag, want, tol)),
        ("repeat", 0.0 if torch.equal(o1, o2) else math.inf),
    ]
    res[0] = (
        "out",
        res[0][1] / max(1.0, 2 * res[1][1]),
    )  # over eager's own error (x2) where that exceeds the tolerance
    report("fused_mlp", desc, res)
    if B * sum(widths) <= 2e8 * SCALE:
        fm_grads(x, ws, bs, a, last, dt, desc)
        if dt == torch.float16 or (dt == torch.bfloat16 and dev.type == "cuda"):  # (the interpreter
            fm_tiles(x, ws, bs, a, last, dt, desc)  # truncates to bf16 where PyTorch rounds: not comparable)
    torch.backends.cuda.matmul.allow_tf32 = False


def fm_tiles(x, ws, bs, a, last, dt, desc):
    """fused_mlp's fused backward with each dz-chain tile a table or the tuner can pick
    (fused_backward.CHAIN's rows and CHAIN_OPTIONS) forced, pad off and on, every gradient against
    backward_lean's, as a ratio of the tuner's bound (tuning.AGREE of the gradient's largest
    element): how Triton's miscompiles of some tiles at some widths were found."""
    fb, ref_mod = fm.fused_backward, sys.modules["kgen.families.fused_mlp.reference"]
    L, widths = len(ws), (x.shape[1], *(w.shape[0] for w in ws))
    _, zs = ref_mod.eager(x, ws, bs, a, last, save=True)
    zs = [z if i < L - 1 or last != "none" else None for i, z in enumerate(zs)]
    g = torch.randn(x.shape[0], widths[-1], device=dev).to(dt)
    hb, needs = tuple(b is not None for b in bs), (True,) * (1 + 2 * L)
    want = ref_mod.backward_lean(g, x, ws, hb, zs, a, last, needs)
    tiles = sorted({row[1:] for row in fb.CHAIN[dt.itemsize]} | set(fb.CHAIN_OPTIONS.values()))
    res = []
    for tile in tiles:
        for pad in (False, True):
            got = fb.plan(widths, dt, x.device, x.shape[0], hb, (a, last), needs, chain=tile, pad=pad)(g, x, ws, zs)
            res.append(("x".join(map(str, tile)) + ("p" if pad else ""), fm.tuning.disagreement(got, want, dt)[0]))
    report("fused_mlp tiles", desc, res)


def fm_grads(x, ws, bs, a, last, dt, desc):
    """fused_mlp's training step: every gradient against float64 autograd (over twice eager's own
    error where that exceeds the tolerance), and the fast path's steps (the second and third: the
    first runs the general path and remembers the signature) bitwise equal."""
    g = torch.randn(x.shape[0], ws[-1].shape[0], device=dev).to(dt)
    L = len(ws)

    def run(fn, conv, grad):
        """fn's backward on fresh leaves conv(t) of x, the weights and the present biases."""
        leaves = [conv(t.detach()).requires_grad_() for t in (x, *ws, *(b for b in bs if b is not None))]
        it = iter(leaves[1 + L:])
        fn(leaves[0], leaves[1:1 + L], [None if b is None else next(it) for b in bs]).backward(grad)
        return leaves

    fused = lambda x_, w_, b_: ops.fused_mlp(x_, w_, b_, activation=a, last_activation=last)  # noqa: E731
    try:
        steps = [[t.grad for t in run(fused, torch.clone, g)] for _ in range(3)]
    except (ValueError, TypeError, RuntimeError) as e:
        return rejected("fused_mlp grad", desc, e)
    ref = run(lambda *t: fm.reference(*t, a, last), torch.Tensor.double, g.double())
    eag = run(lambda *t: fm.eager(*t, a, last)[0], torch.clone, g)
    tol = NUM["fused_mlp"][str(dt)[6:]]
    res = [("repeat", 0.0 if same(steps[1], steps[2]) else math.inf)]
    for i, (got, want, e) in enumerate(zip(steps[2], ref, eag)):
        scale = float(want.grad.abs().max()) or 1.0
        own = error_ratio(e.grad / scale, want.grad / scale, tol)
        res.append((f"grad{i}", error_ratio(got / scale, want.grad / scale, tol) / max(1.0, 2 * own)))
    report("fused_mlp grad", desc, res)


def stopped(signum, frame):
    print(f"stopped by signal {signum} after {time.perf_counter() - t0:.0f} s", flush=True)
    summary()
    os._exit(124)


signal.signal(signal.SIGTERM, stopped)
t0 = time.perf_counter()
CASES = {"fba": case_fba, "llp": case_llp, "lm": case_lm, "i8": case_i8, "fm": case_fm}
for name, fn in CASES.items():
    if ONLY and name not in ONLY:
        continue
    for i in range(N_CASES):
        try:
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()  # (a fault of an asynchronous launch surfaces here)
        except Exception as e:
            print(f"ERROR {name} case {i}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
            stats.setdefault(name + "!", [0, 0, 0, 0.0])[1] += 1
            if is_fault(e):
                summary()
                raise SystemExit(1)
    print(f"{name}: {N_CASES} cases done at {time.perf_counter() - t0:.0f} s", flush=True)
summary()
