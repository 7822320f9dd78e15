"""fused_mlp benchmark (issue 22's table): DLRM's top (367-512-256-1, ReLU, ReLU, sigmoid)
and bottom (13-512-256-64-16, ReLU after each) MLPs at B in {128, 2048, 16384, 65536}, bf16
and float32 (TF32 on), GPU time per call in us of: the floor, eager nn.Sequential, eager in
a CUDA graph, torch.compile, kgen (dispatch's choice, called eagerly and in a CUDA graph;
and the same with FusedMLP(pad_weights=True), the inference layout), and each kgen variant that takes the widths (as the op runs it when called again: its bound
fast path, op.runner); the same for a training step (forward + backward for the input,
weights and biases), also as its kernels' own GPU time ("... kernels": where the host issues
a step slower than the GPU runs it, the wall time hides what the kernels do). The floor is
max(FLOPs / the measured GEMM rate, bytes / the measured copy bandwidth) (bytes: x, out and
the weights once; training: 3x the forward's FLOPs).

`python -m kgen.benchmarks.fused_mlp [--quick] [--no-compile]`, or `kgen bench
kgen/specs/fused_mlp.yaml`."""

from __future__ import annotations

import os
import sys

import torch
import triton
from torch import nn

from kgen.families import fused_mlp as fm
from kgen.nn import FusedMLP
from kgen.runtime import dispatch

MLPS = {"top": ((367, 512, 256, 1), "relu", "sigmoid"), "bottom": ((13, 512, 256, 64, 16), "relu", "relu")}
BATCHES = (128, 2048, 16384, 65536)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_ACT = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def _bench(fn, quick) -> float:
    """Median us per call (triton.testing.do_bench: L2 flushed between calls)."""
    return 1e3 * triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=30 if quick else 100,
                                         return_mode="median")


def _kernel_us(fn, calls: int = 10) -> float:
    """GPU time per call in us: the durations of the GPU work its calls launch (torch.profiler),
    summed, without the idle time between them."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.device_time_total for e in prof.events() if e.device_type == cuda) / calls


def _graphed(fn):
    """fn captured in a CUDA graph (after warm-up calls on a side stream): the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _rates(dtype) -> tuple[float, float]:
    """(FLOP/s of a large GEMM in dtype, copy bytes/s) measured here."""
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    ms = triton.testing.do_bench(lambda: a @ a, warmup=5, rep=50, return_mode="median")
    src = torch.empty(1 << 28, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    return 2 * 8192 ** 3 / (ms * 1e-3), 2 * src.numel() / (ms_copy * 1e-3)


def _sequential(widths, act, last, dtype):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        layers.append(_ACT[last if i == len(widths) - 2 else act]())
    return nn.Sequential(*layers).to(device="cuda", dtype=dtype)


def _train_step(model, x, g):
    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        model(x).backward(g)
    return step


def run(spec=None, quick: bool = False, compile_: bool = True) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    fwd, train = [], []
    for dname, dtype in DTYPES.items():
        flops_rate, copy_rate = _rates(dtype)
        for mlp, (widths, act, last) in MLPS.items():
            seq = _sequential(widths, act, last, dtype)
            fused = FusedMLP.from_sequential(seq)
            padded = FusedMLP.from_sequential(seq, pad_weights=True)  # (the inference layout: no pad launch)
            wname = "-".join(map(str, widths))
            variants = [v for v in dispatch.runnable("fused_mlp", dname, torch.device("cuda"))
                        if fm.variant_fits(v, {"widths": widths})]
            comp = torch.compile(seq, dynamic=False) if compile_ else None
            for B in BATCHES:
                x = torch.randn(B, widths[0], device="cuda", dtype=dtype)
                flops = 2 * B * sum(widths[i] * widths[i + 1] for i in range(len(widths) - 1))
                nbytes = (B * (widths[0] + widths[-1]) + sum(w.numel() for w in seq.parameters())) * x.element_size()
                floor = max(flops / flops_rate, nbytes / copy_rate) * 1e6
                case = f"{mlp} {wname} {dname} B={B}"
                row = {"case": case, "floor": floor}
                with torch.no_grad():
                    ref = fm.reference(x, list(fused.weights), list(fused.biases), act, last)
                    impls = {"eager": lambda: seq(x), "eager graph": _graphed(lambda: seq(x))}
                    if comp is not None:
                        impls["torch.compile"] = lambda: comp(x)
                    impls["kgen"] = lambda: fused(x)
                    impls["kgen graph"] = _graphed(lambda: fused(x))
                    impls["kgen pad_weights"] = lambda: padded(x)
                    impls["kgen pad_weights graph"] = _graphed(lambda: padded(x))
                    for v in variants:  # each as the op runs it for a repeated call (its bound fast path)
                        mod = fm.implementation(dispatch.load(v), widths)  # CUDA: with its Triton companion
                        impls[v.name.removeprefix("triton_")] = fm.op.runner(mod, x, list(fused.weights),
                                                                             list(fused.biases), act, last)
                    got = fused(x).double()
                    row["kgen err"] = float((got - ref).abs().max())
                    for name, fn in impls.items():
                        row[name] = _bench(fn, quick)
                fwd.append(row)
                # training step: forward + backward for x, the weights and the biases
                xg = x.clone().requires_grad_()
                g = torch.randn(B, widths[-1], device="cuda", dtype=dtype)
                trow = {"case": case, "3x floor": 3 * floor}
                timpls = {"eager": _train_step(seq, xg, g)}
                if comp is not None and (dname == "bfloat16" or B == 65536):
                    timpls["torch.compile"] = _train_step(comp, xg, g)
                timpls["kgen"] = _train_step(fused, xg, g)
                for name, fn in timpls.items():
                    trow[name] = _bench(fn, quick)
                for name in ("eager", "kgen"):
                    trow[f"{name} kernels"] = _kernel_us(timpls[name])
                train.append(trow)
                print(f"{case}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "case"), flush=True)
                print("  train: " + ", ".join(f"{k} {v:.1f}" for k, v in trow.items() if k != "case"), flush=True)
    return {"forward, us (GPU time per call; kgen err: max |kgen - float64|)": fwd,
            "training step (forward + backward), us": train}


if __name__ == "__main__":
    from kgen.bench import print_table

    res = run(quick="--quick" in sys.argv, compile_="--no-compile" not in sys.argv and not os.environ.get("NO_COMPILE"))
    for title, rows in res.items():
        print_table(title, rows)
