"""Where the host time of one fused_mlp training step goes, on any machine (no GPU needed):
forward + backward for x, every weight and bias of DLRM's two MLPs, through kgen.ops.fused_mlp
on CPU tensors, the Triton launches stubbed (counted, nothing run), in two modes:

- before: the general path (the op under autograd; its backward launches the forward again
  with `save`, then reference.backward), KGEN_FUSED_MLP_FAST_TRAIN=0's path;
- after:  the training fast path (train.Step, reference.backward_lean), its entry made as the
  op's backward makes it on a GPU, with a stub for the bound launcher.

Per step: kernel launches, aten ops reaching the dispatcher (TorchDispatchMode, after
autograd: what runs), autograd nodes, Python function calls (cProfile) and host µs per step
on this CPU (B = 4, float32: the CPU GEMMs small; µs here are not an H100 host's).

`python3 tools/fused_mlp_train_ops.py` (PYTHONPATH = the repo root).
"""

import cProfile
import collections
import json
import os
import pstats
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kgen.families import fused_mlp as fm  # noqa: E402
from kgen.families.fused_mlp import train  # noqa: E402
from kgen.runtime import dispatch, triton_launch  # noqa: E402

MLPS = {"top": ((367, 512, 256, 1), "relu", "sigmoid", "triton_367x512x256x1_m64_k64_w8_f32"),
        "bottom": ((13, 512, 256, 64, 16), "relu", "relu", "triton_13x512x256x64x16_m64_k64_w8_f32")}
LAUNCHES = collections.Counter()


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _stub_launch(fn, grid, args, kw):
    LAUNCHES["triton_launch.launch"] += 1


def _stub_go(mod, x, ws, bs, act, last):
    """What launch.direct(save=True)'s launcher allocates, without a launch."""
    _, zs, *_ = launch_plan(mod, x, ws, bs, act, last)
    out_p = torch.empty((x.shape[0], ws[-1].shape[0]), dtype=x.dtype)
    z_p = [None if z is None else torch.empty(z.shape, dtype=z.dtype) for z in zs]

    def go(x, weights, biases):
        LAUNCHES["bound launcher"] += 1
        return torch.empty_like(out_p), [None if p is None else torch.empty_like(p) for p in z_p]

    return go


def launch_plan(mod, x, ws, bs, act, last):
    return fm.launch._plan(mod, x, ws, bs, act, last, True, None)


def step_fn(mode, mod, x, ws, bs, act, last, g):
    leaves = [x.clone().requires_grad_(), *(t.clone().requires_grad_() for t in (*ws, *bs))]
    L = len(ws)
    xl, wl, bl = leaves[0], leaves[1:1 + L], leaves[1 + L:]
    if mode == "after":
        fm.op.FAST_TRAIN = True
        fm.op._TRAIN.clear()
        fm.op._TRAIN.put(fm.op._call(xl, wl, bl, act, last), train.make(
            mod, xl, wl, bl, act, last, go=_stub_go(mod, x, ws, bs, act, last)))

        def step():
            for t in leaves:
                t.grad = None
            fm.fused_mlp(xl, wl, bl, activation=act, last_activation=last).backward(g)
    else:
        fm.op.FAST_TRAIN = False

        def step():
            for t in leaves:
                t.grad = None
            with fm.using(mod):
                fm.fused_mlp(xl, wl, bl, activation=act, last_activation=last).backward(g)
    return step


def autograd_nodes(mode, mod, x, ws, bs, act, last, g):
    leaves = [x.clone().requires_grad_(), *(t.clone().requires_grad_() for t in (*ws, *bs))]
    L = len(ws)
    fm.op.FAST_TRAIN = mode == "after"
    if mode == "after":
        fm.op._TRAIN.clear()
        fm.op._TRAIN.put(fm.op._call(leaves[0], leaves[1:1 + L], leaves[1 + L:], act, last), train.make(
            mod, leaves[0], leaves[1:1 + L], leaves[1 + L:], act, last, go=_stub_go(mod, x, ws, bs, act, last)))
        out = fm.fused_mlp(leaves[0], leaves[1:1 + L], leaves[1 + L:], activation=act, last_activation=last)
    else:
        with fm.using(mod):
            out = fm.fused_mlp(leaves[0], leaves[1:1 + L], leaves[1 + L:], activation=act, last_activation=last)
    seen, stack = [], [out.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.append(n)
        stack += [f for f, _ in n.next_functions]
    return [type(n).__name__ for n in seen]


def main():
    # the stubbed kernels leave their outputs uninitialised: no denormal slow paths in the GEMMs
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    triton_launch.launch = _stub_launch
    fm.launch.triton_launch.launch = _stub_launch
    spec = dispatch.shipped_spec("fused_mlp")
    rows = []
    for name, (widths, act, last, variant) in MLPS.items():
        mod = dispatch.load(spec.variant(variant)).module
        x, ws, bs = fm.make_inputs("cpu", torch.float32, 4, widths)
        g = torch.randn(4, widths[-1])
        for mode in ("before", "after"):
            step = step_fn(mode, mod, x, ws, bs, act, last, g)
            for _ in range(20):
                step()
            LAUNCHES.clear()
            ops = Ops()
            with ops:
                step()
            launches = dict(LAUNCHES)
            prof = cProfile.Profile()
            prof.enable()
            step()
            prof.disable()
            st = pstats.Stats(prof)
            ncalls = sum(v[1] for v in st.stats.values())
            top = sorted(((v[3], f"{k[0].split('/')[-1]}:{k[2]}") for k, v in st.stats.items()), reverse=True)[:8]
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(200):
                    step()
                best = min(best, (time.perf_counter() - t0) / 200 * 1e6)
            row = {"mlp": name, "mode": mode, "kernel launches": launches, "aten ops": sum(ops.seen.values()),
                   "aten ops by name": dict(ops.seen.most_common()), "python calls": ncalls,
                   "autograd nodes": autograd_nodes(mode, mod, x, ws, bs, act, last, g),
                   "host us/step (this CPU, B=4 f32)": round(best, 1),
                   "cumulative s, top functions (cProfile, one step)": [(round(t * 1e6), f) for t, f in top]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    fm.op.FAST_TRAIN = True
    print()
    print("| MLP | mode | launches | aten ops | Python calls | autograd nodes | host µs/step (CPU) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mlp']} | {r['mode']} | {sum(r['kernel launches'].values())} | {r['aten ops']} | "
              f"{r['python calls']} | {len(r['autograd nodes'])} | {r['host us/step (this CPU, B=4 f32)']} |")


if __name__ == "__main__":
    main()
