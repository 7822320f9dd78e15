"""fused_mlp's host cost per call against one torch.add launch (issue 22: <= 1.5x at B <= 2048),
before and after the eager fast path and kgen.runtime.triton_launch, and its GPU time at B in
{128, 2048}. One process, the modes interleaved:

- before:  the op and Triton's own `kernel[grid]` launch (op.FAST_PATH off, triton_launch off),
- general: the op, launched through triton_launch (what autograd / `using` / odd inputs get),
- after:   the eager fast path (the default).

Host cost: a loop of N calls timed without a synchronisation inside the timer (N well under the
launch queue's depth, so the host never waits on the GPU), the minimum over interleaved rounds;
beside it the same loop timed to the end of the GPU work (GPU-bound where the kernel is longer).
GPU time: a CUDA graph of 20 calls, replayed (triton.testing.do_bench, median), per call.

`python3 tools/fused_mlp_host.py [--quick] [--batch B] [--dtype bfloat16|float16|float32]`
(PYTHONPATH = the repo root; defaults B = 128, bfloat16; float32 with TF32 on); prints JSON lines
and tables. The reference launch is always torch.add of two 128 x 512 bfloat16 tensors.
"""

import argparse
import json
import time

import torch
import triton

from kgen.bench import environment, print_table
from kgen.families import fused_mlp as fm
from kgen.nn import FusedMLP
from kgen.runtime import triton_launch

MLPS = {"top": ((367, 512, 256, 1), "relu", "sigmoid"), "bottom": ((13, 512, 256, 64, 16), "relu", "relu")}


def mode(name):
    fm.op.FAST_PATH = name == "after"
    triton_launch.set_enabled(name != "before")


def host_times(impls, n, rounds):
    """{name: (enqueue us/call, to-GPU-end us/call)}: minima over interleaved rounds."""
    best = {name: [float("inf"), float("inf")] for name, *_ in impls}
    for name, m, fn in impls:
        mode(m)
        for _ in range(30):
            fn()
    for _ in range(rounds):
        for name, m, fn in impls:
            mode(m)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            b = best[name]
            b[0], b[1] = min(b[0], (t1 - t0) / n * 1e6), min(b[1], (t2 - t0) / n * 1e6)
    mode("after")
    return best


def _cells(f):
    return dict(zip(f.__code__.co_freevars, f.__closure__))


def breakdown(mlp, x, ws, bs, act, last):
    """The fast path's parts, timed alone: its memo lookup (op._call and CallMemo.get), the
    launcher closure (checks, the output, the bound launch), the launch itself with a fixed
    argument list (a Triton variant: triton_launch's bound launch and Triton's own launcher,
    CompiledKernel.run; a CUDA cluster variant: kgen's trampoline into its C launcher),
    torch.empty_like of the output prototype."""
    f = fm.op._FAST.get(fm.op._call(x, ws, bs, act, last))[0]
    cells = _cells(f)
    parts = [(f"{mlp} part: memo lookup", "after", lambda: fm.op._FAST.get(fm.op._call(x, ws, bs, act, last))),
             (f"{mlp} part: launcher closure", "after", lambda: f(x, ws, bs))]
    if "proto" not in cells:  # the eager composition, called without the op around it
        return parts
    proto = cells["proto"].cell_contents
    parts.append((f"{mlp} part: torch.empty_like(proto)", "after", lambda: torch.empty_like(proto)))
    if "raw" in cells:  # a CUDA cluster variant (fused_mlp/cuda.py, CudaMLP.direct)
        raw, got = cells["raw"].cell_contents, []
        cells["raw"].cell_contents = lambda *a: got.append(a) or 0
        keep = f(x, ws, bs)  # its pointer stays in the argument list: a live buffer
        cells["raw"].cell_contents = raw
        a = got[0]
        if cells["size"].cell_contents:  # the ring launcher's scratch (a weight copied row-padded each call)
            scratch = torch.empty(cells["size"].cell_contents, dtype=x.dtype, device=x.device)
            a, keep = (*a[:-1], scratch.data_ptr()), (keep, scratch)  # (a live buffer in its place)
        return parts + [(f"{mlp} part: trampoline launch alone", "after", lambda: raw(*a) or keep)]
    # a Triton variant (launch.direct): triton_launch's Replay of the recorded launches
    go, got = cells["go"].cell_contents, []  # (Replay.go, bound)
    cells["go"].cell_contents = lambda *vals: got.append(vals) or True
    keep = f(x, ws, bs)  # its pointer stays in the argument list: a live buffer
    cells["go"].cell_contents = go
    if cells["s_numel"].cell_contents:  # a scratch buffer, freed after the call: not replayed alone
        return parts
    return parts + [(f"{mlp} part: Replay of the launches alone", "after", lambda: go(*got[0]) or keep)]


def graphed_us(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return 1e3 * triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median") / reps


def main(quick, batch, dtype):
    print(json.dumps({**environment(), "triton_launch": triton_launch.disabled() or "on",
                      "batch": batch, "dtype": str(dtype)}), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    a = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    impls = [("torch.add(128x512 bf16)", "after", lambda: torch.add(a, b))]
    checks = []
    torch.set_grad_enabled(False)
    for mlp, (widths, act, last) in MLPS.items():
        x, ws, bs = fm.make_inputs("cuda", dtype, batch, widths)
        module = FusedMLP(widths, act, last, dtype=dtype, device="cuda")

        def op(x=x, ws=ws, bs=bs, act=act, last=last):
            return fm.fused_mlp(x, ws, bs, activation=act, last_activation=last)

        outs = {}
        for m in ("before", "general", "after"):
            mode(m)
            outs[m] = [op() for _ in range(3)]
        checks.append({"mlp": mlp, "bit-identical before/general/after": all(
            torch.equal(o, outs["before"][0]) for m in outs for o in outs[m])})
        for m in ("before", "general", "after"):
            impls.append((f"{mlp} ops.fused_mlp, {m}", m, op))
        for m in ("before", "after"):
            impls.append((f"{mlp} FusedMLP module, {m}", m, lambda module=module, x=x: module(x)))
        mode("after")
        g = torch.cuda.CUDAGraph()
        op()
        with torch.cuda.graph(g):
            op()
        impls.append((f"{mlp} CUDA graph replay of one call", "after", g.replay))
        impls += breakdown(mlp, x, ws, bs, act, last)
    print(json.dumps(checks), flush=True)
    before = dict(triton_launch.STATS)
    res = host_times(impls, 150, 5 if quick else 15)
    stats = {k: triton_launch.STATS[k] - before[k] for k in before}
    print(json.dumps({"triton_launch.STATS during the timing": stats}), flush=True)
    base = res[impls[0][0]][0]
    rows = [{"impl": name, "host us/call": h, "x torch.add": h / base, "us/call to GPU end": e}
            for name, (h, e) in res.items()]
    print_table(f"host cost per call (B = {batch}, {dtype}, no grad; min over rounds of 150 calls)", rows)
    print(json.dumps(rows), flush=True)

    gpu = []
    for mlp, (widths, act, last) in MLPS.items():
        for B in (128, 2048):
            x, ws, bs = fm.make_inputs("cuda", dtype, B, widths)
            row = {"mlp": mlp, "B": B}
            for m in ("before", "after"):
                mode(m)
                row[f"graph us/call, {m}"] = graphed_us(lambda: fm.fused_mlp(x, ws, bs, activation=act,
                                                                           last_activation=last))
            mode("after")
            mod = fm.module_for(x.device, dtype, widths, B)
            row["variant"] = "eager" if mod is None else getattr(mod, "name", None) or mod.__name__
            gpu.append(row)
    print_table(f"GPU time per forward, {dtype} (CUDA graph of 20 calls, median replay / 20)", gpu)
    print(json.dumps(gpu), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 rounds, not 15")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = ap.parse_args()
    main(args.quick, args.batch, getattr(torch, args.dtype))
