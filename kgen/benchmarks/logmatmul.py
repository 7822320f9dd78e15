"""logmatmul benchmark (issue 17): N = K = 4096 float32 weights against the PyTorch
expression (eager and torch.compile) and the floor = bytes of w / copy bandwidth measured
in the same run, each timed two ways: do_bench per call (its L2 flush leaves dirty lines
that the timed call writes back) and in steady state (kgen.benchmarks.steady: CUDA-graph
replays over two weight sets, a clean flush; the floor's copy timed alike); forward + backward; host cost per call at B = 1, N = K = 512 against one
torch.add launch; block-sparse at 25 % density, block_size 128, against the dense time."""

from __future__ import annotations

import os

import torch
import triton

from kgen import ops
from kgen.benchmarks.fused_bias_act import interleaved_min
from kgen.benchmarks.steady import copy_floor_us, steady_us
from kgen.families import logmatmul as lmm
from kgen.runtime import dispatch

N = K = 4096
BATCHES = (1, 2, 4, 8, 16, 64, 256)


def _bench(fn, quick) -> float:
    """Median microseconds."""
    return 1e3 * triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 150,
                                         return_mode="median")


def expression(x, w):
    """What a user writes: shift each row by its maximum, one matmul, log."""
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.log(torch.exp(x - m) @ w.T) + m


def _copy_floor(w, quick) -> tuple[float, float]:
    """(GB/s of a device copy of w's size, microseconds to read w once at that rate)."""
    src = torch.empty_like(w)
    dst = torch.empty_like(w)
    us = _bench(lambda: dst.copy_(src), quick)
    bw = 2 * w.numel() * w.element_size() / us / 1e3
    return bw, w.numel() * w.element_size() / bw / 1e3


def _compile(fn, table: str):
    """torch.compile(fn), or None with KGEN_BENCH_NO_COMPILE=1 or =<table> (a short device
    session: each batch size compiles anew)."""
    if os.environ.get("KGEN_BENCH_NO_COMPILE") in ("1", table):
        return None
    return torch.compile(fn, dynamic=False)


def _variants(spec):
    """The float32 variants; of the CUDA ones only the device's own arch (sm_90 code on an
    H100: dispatch prefers it to the sm_80 build of the same kernel)."""
    cap = torch.cuda.get_device_capability()
    archs = {v.arch for v in spec.variants if v.backend == "cuda" and dispatch.arch_runs_on(v.arch, cap)}
    best = max(archs, key=lambda a: int(a[3:5]), default=None)
    variants = [v for v in spec.variants if v.dtype == "float32" and (v.backend != "cuda" or v.arch == best)]
    dispatch.prebuild(variants)  # (nvcc in parallel)
    return [(v.name, lmm.implementation(dispatch.load(v))) for v in variants]


def forward_table(spec, quick) -> list[dict]:
    dev = torch.device("cuda")
    w = torch.rand(N, K, device=dev)
    bw, floor = _copy_floor(w, quick)
    w2 = torch.rand(N, K, device=dev)  # a second weight set: steady-state calls never reuse L2
    s_bw, s_floor = copy_floor_us(w.numel() * w.element_size())
    compiled = _compile(expression, "forward")
    impls = _variants(spec)
    rows = []
    for B in BATCHES:
        x = torch.randn(B, K, device=dev) * 2
        ref = lmm.reference(x.double(), w.double(), torch.float64)
        row = {"B": B, "copy GB/s": bw, "floor us": floor,
               "eager us": _bench(lambda: expression(x, w), quick),
               "compile us": _bench(lambda: compiled(x, w), quick) if compiled else float("nan"),
               "kgen.ops us": _bench(lambda: ops.logmatmul(x, w), quick),
               "steady: floor us": s_floor,
               "steady: kgen.ops us": steady_us([lambda: ops.logmatmul(x, w), lambda: ops.logmatmul(x, w2)]),
               "steady: eager us": steady_us([lambda: expression(x, w), lambda: expression(x, w2)])}
        if compiled:
            try:
                row["steady: compile us"] = steady_us([lambda: compiled(x, w), lambda: compiled(x, w2)])
            except Exception as e:  # noqa: BLE001 - a peer that cannot be captured: say so in the row
                row["steady: compile us"] = float("nan")
                row["steady: compile error"] = f"{type(e).__name__}: {str(e)[:120]}"
        best, best_name = float("inf"), "-"
        for name, mod in impls:
            if isinstance(mod, lmm.CudaForward) and not mod.takes(x, w):
                continue
            err = float((lmm.forward(mod, x, w).double() - ref).abs().max())
            us = _bench(lmm.runner(mod, x, w), quick)  # as the op runs it (its fast path)
            row[name] = us
            if err > 1e-3:
                row[name + " ERR"] = err
            if us < best:
                best, best_name = us, name
        row.update({"best us": best, "best": best_name, "best/floor": best / floor,
                    "kgen.ops/floor": row["kgen.ops us"] / floor,
                    "steady: kgen.ops/floor": row["steady: kgen.ops us"] / s_floor,
                    "compile/best": row["compile us"] / best, "eager/best": row["eager us"] / best})
        rows.append(row)
        print(row, flush=True)
    return rows


def backward_table(spec, quick) -> list[dict]:
    """Forward + backward (dx and dw) through autograd, B <= 8; floor = 3 passes over w.
    Per call (do_bench: host-bound at these sizes) and in steady state (the whole step,
    autograd's backward included, captured in a CUDA graph: its GPU time)."""
    dev = torch.device("cuda")
    w0 = torch.rand(N, K, device=dev)
    _, floor = _copy_floor(w0, quick)
    _, s_floor = copy_floor_us(w0.numel() * w0.element_size())
    compiled = _compile(expression, "backward")
    rows = []
    for B in (1, 2, 4, 8):
        sets = []
        for i in range(2):  # two input sets: steady-state steps never find w in L2
            x = (torch.randn(B, K, device=dev) * 2).requires_grad_()
            w = (w0 if i == 0 else torch.rand_like(w0)).clone().requires_grad_()
            sets.append((x, w, torch.randn(B, N, device=dev)))

        def step(f, i=0):
            x, w, g = sets[i]
            x.grad = w.grad = None
            f(x, w).backward(g)

        row = {"B": B, "floor us": floor, "floor x3 us": 3 * floor}
        for name, f in (("eager", expression), ("compile", compiled), ("kgen.ops", ops.logmatmul)):
            row[f"{name} us"] = _bench(lambda f=f: step(f), quick) if f is not None else float("nan")
        # the bar: <= 3.6x the floor (three passes over w at 1.2x each)
        row["kgen/floor"] = row["kgen.ops us"] / floor
        row["kgen/floor x3"] = row["kgen.ops us"] / (3 * floor)
        row["compile/kgen"] = row["compile us"] / row["kgen.ops us"]
        row["steady: floor us"] = s_floor
        for name, f in (("eager", expression), ("kgen.ops", ops.logmatmul)):
            try:
                row[f"steady: {name} us"] = steady_us([lambda f=f, i=i: step(f, i) for i in range(2)])
            except Exception as e:  # noqa: BLE001 - a step that cannot be captured: say so in the row
                row[f"steady: {name} us"] = float("nan")
                row[f"steady: {name} error"] = f"{type(e).__name__}: {str(e)[:120]}"
        row["steady: kgen/floor"] = row["steady: kgen.ops us"] / s_floor
        rows.append(row)
        print(row, flush=True)
    return rows


def host_cost(spec, quick) -> list[dict]:
    dev = torch.device("cuda")
    x, w = torch.randn(1, 512, device=dev), torch.rand(512, 512, device=dev)
    a, b = torch.randn(1, 512, device=dev), torch.randn(1, 512, device=dev)
    ops.logmatmul(x, w)
    impls = [("torch.add(a, b)", lambda: torch.add(a, b)),
             ("kgen.ops.logmatmul", lambda: ops.logmatmul(x, w)),
             ("eager PyTorch expression", lambda: expression(x, w))]
    best = interleaved_min(impls, 1000 if quick else 3000, 5 if quick else 11)
    base = best[impls[0][0]]
    return [{"impl": n, "us/call": us, "x torch.add": us / base} for n, us in best.items()]


def block_sparse(spec, quick) -> list[dict]:
    dev = torch.device("cuda")
    bs = 128
    R = C = N // bs
    g = torch.Generator().manual_seed(0)
    keep = torch.rand(R, C, generator=g).argsort(1) < C // 4  # 25 %: 8 blocks in each block row
    rows_, cols = keep.nonzero(as_tuple=True)
    row_ptr = torch.zeros(R + 1, dtype=torch.int32)
    row_ptr[1:] = torch.cumsum(keep.sum(1), 0)
    row_ptr, col_idx = row_ptr.to(dev), cols.to(torch.int32).to(dev)
    blocks = torch.rand(rows_.shape[0], bs, bs, device=dev)
    dense_w = lmm.dense_from_blocks(blocks, row_ptr, col_idx, bs, K)
    # steady state: enough weight sets that no call finds its weights in L2 (16 MiB each sparse)
    block_sets = [blocks] + [torch.rand_like(blocks) for _ in range(4)]
    dense_sets = [dense_w, torch.rand_like(dense_w)]
    rows = []
    for B in (1, 4, 8, 16):
        x = torch.randn(B, K, device=dev) * 2
        sparse_out = ops.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, bs)
        err = float((sparse_out - ops.logmatmul(x, dense_w)).nan_to_num().abs().max())
        s = _bench(lambda: ops.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, bs), quick)
        d = _bench(lambda: ops.logmatmul(x, dense_w), quick)
        ss = steady_us([lambda b=b: ops.block_sparse_logmatmul(x, b, row_ptr, col_idx, bs) for b in block_sets])
        sd = steady_us([lambda d=d: ops.logmatmul(x, d) for d in dense_sets])
        rows.append({"B": B, "sparse us": s, "dense us": d, "sparse/dense": s / d,
                     "steady: sparse us": ss, "steady: dense us": sd, "steady: sparse/dense": ss / sd,
                     "max |diff|": err})
        print(rows[-1], flush=True)
    return rows


def run(spec, quick) -> dict:
    return {f"forward, N = K = {N}, float32 w": forward_table(spec, quick),
            "forward + backward (dx, dw)": backward_table(spec, quick),
            "host cost per call, B = 1, N = K = 512": host_cost(spec, quick),
            "block-sparse, 25 % density, block_size 128": block_sparse(spec, quick)}
