"""Host cost of small linear_logp calls (issue 19): wall time per call in a loop of calls
synchronised once at the end, forward and forward + backward, for kgen's op (dispatch's
choice, each implementation forced) and the eager PyTorch expression, bf16.
Usage on a GPU machine (repo root): PYTHONPATH=$PWD python3 tools/llp_small_calls.py
`--breakdown`: the pieces of one small call (N=8, D=512, V=1024) timed interleaved, min over
rounds, and a cProfile of the backward called directly (the autograd engine runs a CUDA
backward on its own thread, where a profiler of the main thread does not see it).
Before/after the backward's plan cache (backward_launch.backward_plan) in one device call: each run
prints a "kgen op (dispatch), plan cache off" row (backward_launch.PLAN_CACHE off for that row, as
KGEN_LINEAR_LOGP_PLAN_CACHE=0 sets it for a whole process) next to the default
"kgen op (dispatch)" row, both against the eager expression measured in the same run.
Before/after the eager fast path (op._fast, kgen/families/linear_logp/fast.py): the "kgen op
(dispatch)" row takes it (the calls after the first of a signature; the row prints how many
calls it served), the "kgen op (dispatch), general path" row has it off (op.FAST = False for
that row, as KGEN_LINEAR_LOGP_FAST=0 sets it for a whole process). The rows that force an
implementation (`using`) take the general path."""

import time

import torch
import torch.nn.functional as F

from kgen import ops
from kgen.families import linear_logp as llp
from kgen.families.linear_logp import op as llp_op


def eager(h, w, t):
    return torch.log_softmax(F.linear(h, w).float(), -1).gather(1, t[:, None]).squeeze(1)


def inputs(N, D, V):
    """bf16 hidden and weight, targets, an upstream gradient, and leaf copies that need grad."""
    h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, D, device="cuda") * D ** -0.5).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    g = torch.randn(N, device="cuda")
    return h, w, t, g, h.clone().requires_grad_(), w.clone().requires_grad_()


def no_plan_cache(fn):
    """fn with backward_launch.backward making its plan anew every call (the cache's "before")."""
    from kgen.families.linear_logp import backward_launch

    def run():
        saved, backward_launch.PLAN_CACHE = backward_launch.PLAN_CACHE, False
        try:
            fn()
        finally:
            backward_launch.PLAN_CACHE = saved
    return run


def general_path(fn):
    """fn with the op's eager fast path off (the fast path's "before")."""
    def run():
        saved, llp_op.FAST = llp_op.FAST, False
        try:
            fn()
        finally:
            llp_op.FAST = saved
    return run


def per_call_us(fn, calls=2000, rounds=5):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(best)[len(best) // 2]


def main():
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for N, D, V in ((8, 512, 1024), (64, 1024, 4096), (1, 4096, 32000)):
        h, w, t, g, hr, wr = inputs(N, D, V)
        choice = llp_op._module(h.device, h.dtype, (N, D, V))
        name = "reference" if choice is None else getattr(choice, "name", None) or getattr(choice, "__name__", "triton")
        print(f"\nN={N} D={D} V={V}: dispatch's forward choice: {name}", flush=True)

        def fb(fn):
            def run():
                hr.grad = wr.grad = None
                fn(hr, wr, t).backward(g)
            return run
        rows = [("eager expression", lambda: eager(h, w, t), fb(eager)),
                ("kgen op (dispatch)", lambda: ops.linear_logp(h, w, t), fb(ops.linear_logp)),
                ("kgen op (dispatch), general path", general_path(lambda: ops.linear_logp(h, w, t)),
                 general_path(fb(ops.linear_logp))),
                ("kgen op (dispatch), plan cache off", lambda: ops.linear_logp(h, w, t), no_plan_cache(fb(ops.linear_logp)))]
        for label, forced in (("kgen op, reference forced", None),
                              ("kgen op, Triton forced", llp_op.implementation(
                                  __import__("kgen.runtime.dispatch", fromlist=["x"]).select(
                                      "linear_logp", h.device, "bfloat16", backend="triton")))):
            def fwd(forced=forced):
                with llp.using(forced):
                    return ops.linear_logp(h, w, t)

            def fwdbwd(forced=forced):
                with llp.using(forced):
                    hr.grad = wr.grad = None
                    ops.linear_logp(hr, wr, t).backward(g)
            rows.append((label, fwd, fwdbwd))
        for label, f, b in rows:
            served = llp_op.STATS["fast"]
            fwd_us, fb_us = per_call_us(f), per_call_us(b, calls=500)
            served = llp_op.STATS["fast"] - served
            print(f"  {label:34s} fwd {fwd_us:7.1f} us/call   fwd+bwd {fb_us:7.1f} us/call"
                  + (f"   (fast path: {served} calls)" if served else ""), flush=True)


def instrumented(step, calls=300):
    """Wall time per call of `step` and of the op's pieces inside it (wrapped with timers):
    what is left is the autograd engine and torch.autograd.Function's own work."""
    from kgen.families.linear_logp import backward_launch, fast as llp_fast, launch

    spent: dict = {}

    def timed(owner, name):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return fn, wrapper

    # _op: the forward op with its autograd.Function; _bwd_op: the backward op, called from
    # inside the engine; launch.forward / backward_launch.backward: the kernels' host code in them;
    # _fast: the eager fast path (its Function and launches), ForwardLaunch.run its forward
    patches = [(llp_op, "_op"), (llp_op, "_bwd_op"), (launch, "forward"), (backward_launch, "backward"),
               (llp_op, "_fast"),
               (llp_fast.ForwardLaunch, "run")]
    saved = []
    for owner, name in patches:
        fn, wrapper = timed(owner, name)
        saved.append((owner, name, fn))
        setattr(owner, name, wrapper)
    # op.py holds its own references to launch's functions and to its impls (via define)
    saved.append((llp_op, "forward", llp_op.forward))
    saved.append((llp_op, "backward", llp_op.backward))
    llp_op.forward, llp_op.backward = launch.forward, backward_launch.backward
    try:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    lines = [f"{total / calls * 1e6:8.1f}  whole step"]
    lines += [f"{v / calls * 1e6:8.1f}  {k}" for k, v in spent.items()]
    return lines


def breakdown(N=8, D=512, V=1024):
    import cProfile
    import pstats

    from kgen.benchmarks.fused_bias_act import interleaved_min
    from kgen.families.linear_logp import backward_launch, launch, plans
    from kgen.families.linear_logp.checks import check_inputs
    from kgen.runtime import dispatch

    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    h, w, t, g, hr, wr = inputs(N, D, V)
    mod = llp_op._module(h.device, h.dtype, (N, D, V))
    tri = llp_op.implementation(dispatch.select("linear_logp", h.device, "bfloat16", backend="triton"))
    bmod = llp_op._module(h.device, h.dtype)
    print("forward choice", getattr(mod, "name", mod), "backward module", bmod, flush=True)
    logp, ent, lse2, ez2 = launch.forward(tri, h, w, t, None, 1.0, -100, False)
    splits = plans.triton_splits(tri, N, V, h.device)
    part = torch.empty((4, splits, N), device="cuda")
    prec = plans._precision(h.dtype)
    hs, ws, tma = plans._tile_sources(tri, h, w)

    def fwd_kernel():
        tri.linear_logp_fwd_kernel[plans.fwd_grid(tri, N, splits)](
            hs, ws, w, t, part, N, V, D, splits, 1.0, HAS_BIAS=False, WITH_ENTROPY=False, TARGET_IN_TILE=False,
            PRECISION=prec, TMA=tma, **plans._tiles(tri))

    def combine_kernel():
        tri.linear_logp_combine_kernel[plans.combine_grid(N, plans.COMBINE_DOT_BLOCK)](
            part, t, h, w, w, logp, logp, lse2, lse2, N, V, D, splits, -100, 1.0,
            WITH_ENTROPY=False, TARGET_DOT=True, HAS_BIAS=False, BLOCK=plans.COMBINE_DOT_BLOCK,
            BLOCK_D=plans.TARGET_BLOCK_D)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, gx):
            return gx

    def autograd_only():
        hr.grad = None
        Identity.apply(hr).sum().backward()

    pieces = {
        "torch.add(g, g)": lambda: torch.add(g, g),
        "torch.empty((N,))": lambda: torch.empty((N,), device="cuda"),
        "eager fwd": lambda: eager(h, w, t),
        "ops.linear_logp (dispatch)": lambda: ops.linear_logp(h, w, t),
        "check_inputs": lambda: check_inputs(h, w, t, None, 1.0, -100),
        "_module lookup": lambda: llp_op._module(h.device, h.dtype, (N, D, V)),
        "launch.forward (dispatch's mod)": lambda: launch.forward(mod, h, w, t, None, 1.0, -100, False),
        "launch.forward (Triton)": lambda: launch.forward(tri, h, w, t, None, 1.0, -100, False),
        "Triton fwd kernel launch": fwd_kernel,
        "Triton combine launch": combine_kernel,
        "_tile_sources (TMA descriptors)": lambda: plans._tile_sources(tri, h, w),
        "triton_splits": lambda: plans.triton_splits(tri, N, V, h.device),
        "backward_launch.backward (Triton)":
            lambda: backward_launch.backward(tri, h, w, t, None, lse2, ez2, g, None, 1.0, -100),
        "torch.mm (N x V) @ (V x D)": lambda: torch.mm(torch.empty(N, V, device="cuda", dtype=torch.bfloat16), w),
        "autograd: identity fwd+bwd": autograd_only,
        "_forward_impl direct": lambda: llp_op._forward_impl(h, w, t, None, 1.0, -100, False, False),
        "_op (define's call)": lambda: llp_op._op(h, w, t, None, 1.0, -100, False, False),
        "_backward_impl direct": lambda: llp_op._backward_impl(h, w, t, None, lse2, ez2, g, None, 1.0, -100),
        "kgen fwd, requires_grad inputs": lambda: ops.linear_logp(hr, wr, t),
        "kgen fwd, general path": general_path(lambda: ops.linear_logp(h, w, t)),
        "kgen fwd, requires_grad inputs, general path": general_path(lambda: ops.linear_logp(hr, wr, t)),
        "fast path signature": lambda: llp_op._signature(h, w, t, None, False),
        "eager fwd+bwd": lambda: (setattr(hr, "grad", None), eager(hr, wr, t).backward(g)),
        "kgen fwd+bwd": lambda: (setattr(hr, "grad", None), setattr(wr, "grad", None),
                                 ops.linear_logp(hr, wr, t).backward(g)),
        "kgen fwd+bwd, general path": general_path(lambda: (setattr(hr, "grad", None), setattr(wr, "grad", None),
                                                            ops.linear_logp(hr, wr, t).backward(g))),
    }
    for name, us in interleaved_min(list(pieces.items()), 300, 7).items():
        print(f"{us:8.1f} us  {name}", flush=True)
    for name in ("kgen fwd+bwd", "kgen fwd+bwd, general path"):
        print(f"\ninstrumented {name} (us per call, perf_counter inside the call):", flush=True)
        for line in instrumented(pieces[name]):
            print("  " + line, flush=True)
    torch.autograd.set_multithreading_enabled(False)  # the backward on this thread: profiled
    for name, us in interleaved_min([(k, pieces[k]) for k in ("eager fwd+bwd", "kgen fwd+bwd")], 300, 5).items():
        print(f"{us:8.1f} us  {name}, autograd multithreading off", flush=True)
    for label, fn in (("kgen fwd+bwd", pieces["kgen fwd+bwd"]), ("eager fwd+bwd", pieces["eager fwd+bwd"]),
                      ("ops.linear_logp (dispatch)", pieces["ops.linear_logp (dispatch)"]),
                      ("launch.forward (dispatch's mod)", pieces["launch.forward (dispatch's mod)"])):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        print(f"\ncProfile, 300 calls of {label}:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("cumtime").print_stats(25)


if __name__ == "__main__":
    import sys

    breakdown() if "--breakdown" in sys.argv else main()
