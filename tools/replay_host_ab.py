"""Host cost of the eager fast calls whose Triton launches are replayed (triton_launch.Replay),
with launcher.c's replay_go (new) and with the Python replay loop (old: replay_go and replay_run
stubbed to "not launched", two extra no-op calls, ~0.1 us, and the Python checks), in one process: each case alternates old, new
and a 1-element torch.add, 15 rounds of 200 calls, the minimum per side (µs a call: the loop's
time up to the last call's return, before the synchronise, i.e. the host's cost while the launch
queue has room; a call whose GPU work is longer fills the queue and then shows its GPU time). KGEN_BACKEND=triton sends every family to its
Triton variants. On a GPU machine from the repo root: PYTHONPATH=$PWD python3 tools/replay_host_ab.py
(BENCHMARKS.md, sixty-seventh session)."""
import os
import sys
import time

import torch

import kgen.ops as ops
from kgen.runtime import triton_launch as tl

torch.manual_seed(0)
dev = "cuda"
bf = torch.bfloat16


def timed(f, n=200):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def mlp(widths, dtype, B):
    ws = [torch.randn(widths[i + 1], widths[i], device=dev, dtype=dtype) / widths[i] ** 0.5 for i in range(len(widths) - 1)]
    bs = [torch.randn(widths[i + 1], device=dev, dtype=dtype) * 0.1 for i in range(len(widths) - 1)]
    x = torch.randn(B, widths[0], device=dev, dtype=dtype)
    return lambda: ops.fused_mlp(x, ws, bs, activation="relu", last_activation="sigmoid")


def cases():
    yield "fused_mlp bottom bf16 B=2048", mlp([13, 512, 256, 64, 16], bf, 2048)
    yield "fused_mlp top bf16 B=2048", mlp([367, 512, 256, 1], bf, 2048)
    yield "fused_mlp bottom f32 B=128", mlp([13, 512, 256, 64, 16], torch.float32, 128)
    yield "fused_mlp top f32 B=2048", mlp([367, 512, 256, 1], torch.float32, 2048)
    lx8 = torch.randn(40, 777, device=dev).log_softmax(-1)
    lw8 = torch.rand(1200, 777, device=dev)
    yield "logmatmul f32 40x777 -> 1200", lambda: ops.logmatmul(lx8, lw8)
    ia = torch.randint(-127, 128, (64, 1000), device=dev, dtype=torch.int8)
    ib = torch.randint(-127, 128, (3000, 1000), device=dev, dtype=torch.int8)
    yield "int8_mm 64x1000x3000", lambda: ops.int8_mm(ia, ib)
    x, y, b = (torch.randn(128, 512, device=dev, dtype=bf), torch.randn(128, 512, device=dev, dtype=bf),
               torch.randn(512, device=dev, dtype=bf))
    yield "fused_bias_act bf16 128x512 y gelu", lambda: ops.fused_bias_act(x, b, y, alpha=0.5, act="gelu")


a1 = torch.ones(1, device=dev)
add = lambda: torch.add(a1, a1)  # noqa: E731
print(f"{sys.argv[1] if len(sys.argv) > 1 else ''} KGEN_BACKEND={os.environ.get('KGEN_BACKEND', '')}")
print("| case | torch.add | Python loop (old) | replay_go (new) | new - old | Triton launches a call |")
print("|---|---:|---:|---:|---:|---:|")
for name, f in cases():
    for _ in range(30):
        f()
    s0 = tl.STATS["direct"]
    f()
    launches = tl.STATS["direct"] - s0
    real, real_go = tl._state.get("rrun"), tl._state.get("rgo")
    old, new, base = [], [], []
    for _ in range(15):
        base.append(timed(add))
        tl._state["rrun"] = tl._state["rgo"] = lambda *a: -1
        old.append(timed(f))
        tl._state["rrun"], tl._state["rgo"] = real, real_go
        new.append(timed(f))
    o, n_, b_ = min(old), min(new), min(base)
    print(f"| {name} | {b_:.2f} | {o:.2f} ({o / b_:.2f}x) | {n_:.2f} ({n_ / b_:.2f}x) | {n_ - o:+.2f} | {launches} |")
