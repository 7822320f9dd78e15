"""Issue 22's training-step table: forward + backward for x, every weight and bias of DLRM's
top (367-512-256-1, ReLU, ReLU, sigmoid) and bottom (13-512-256-64-16, ReLU after each) MLPs,
B in {128, 2048, 16384, 65536}, bfloat16 and float32 (TF32 on), per step:

- host: a loop of N steps timed to the end of the GPU work (one synchronisation after the
  loop), µs per step — what a training loop sees;
- gpu: triton.testing.do_bench's median (L2 flushed between steps), µs.

Implementations: eager nn.Sequential, torch.compile(dynamic=False) of it (after every other
row, while the time budget lasts: its compiles are the slow part), kgen before (the op's
general path: fused_mlp.op.FAST_TRAIN off, as KGEN_FUSED_MLP_FAST_TRAIN=0) and kgen after
(the training fast path). Before the timing, kgen after's gradients are checked against
kgen before's (max |difference| / max |gradient|).

`python3 tools/fused_mlp_train.py [--quick] [--budget S]` (PYTHONPATH = the repo root).
"""

import json
import sys
import time

import torch
import triton

from kgen.benchmarks.fused_mlp import MLPS, _sequential, _train_step
from kgen.families import fused_mlp as fm
from kgen.nn import FusedMLP

BATCHES = (128, 2048, 16384, 65536)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def host_us(step, n):
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


def gpu_us(step, quick):
    return 1e3 * triton.testing.do_bench(step, warmup=5 if quick else 20, rep=30 if quick else 80,
                                         return_mode="median")


def kgen_mode(fast):
    fm.op.FAST_TRAIN = fast


def grads(model, x, g):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    model(x).backward(g)
    return [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]


def main(quick, budget):
    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    rows, pending = [], []
    for dname, dtype in DTYPES.items():
        for mlp, (widths, act, last) in MLPS.items():
            seq = _sequential(widths, act, last, dtype)
            fused = FusedMLP.from_sequential(seq)
            for B in BATCHES:
                x = torch.randn(B, widths[0], device="cuda", dtype=dtype).requires_grad_()
                g = torch.randn(B, widths[-1], device="cuda", dtype=dtype)
                n = 30 if quick else (100 if B <= 16384 else 30)
                row = {"case": f"{mlp} {dname} B={B}"}
                kgen_mode(False)
                before = grads(fused, x, g)
                kgen_mode(True)
                grads(fused, x, g)  # the general path once: remembers the signature
                after = grads(fused, x, g)
                row["after vs before"] = max(float((a - b).abs().max() / (b.abs().max() + 1e-30))
                                             for a, b in zip(after, before))
                row["fast entries"] = len(fm.op._TRAIN)
                impls = {"eager": (None, _train_step(seq, x, g)), "kgen before": (False, _train_step(fused, x, g)),
                         "kgen after": (True, _train_step(fused, x, g))}
                for name, (mode, step) in impls.items():
                    if mode is not None:
                        kgen_mode(mode)
                    row[f"{name} host"] = host_us(step, n)
                    row[f"{name} gpu"] = gpu_us(step, quick)
                kgen_mode(True)
                rows.append(row)
                if dname == "bfloat16" or B == 65536:
                    pending.append((row, seq, x, g, quick))
                print(json.dumps(row), flush=True)
    # torch.compile last, while the budget lasts (each (MLP, B, dtype) is its own compile)
    compiled = {}
    for row, seq, x, g, quick in pending:
        if time.perf_counter() - t_start > budget:
            row["torch.compile host"] = row["torch.compile gpu"] = "skipped (time)"
            continue
        comp = compiled.setdefault(id(seq), torch.compile(seq, dynamic=False))
        step = _train_step(comp, x, g)
        row["torch.compile host"] = host_us(step, 20 if quick else 50)
        row["torch.compile gpu"] = gpu_us(step, quick)
        print(json.dumps({"case": row["case"], "torch.compile host": row["torch.compile host"],
                          "torch.compile gpu": row["torch.compile gpu"]}), flush=True)
    cols = ["eager", "torch.compile", "kgen before", "kgen after"]
    print("\n| case | " + " | ".join(f"{c} host / gpu µs" for c in cols) + " | after ÷ compile (host) | after vs before |")
    print("|---|" + "---:|" * (len(cols) + 2))
    for r in rows:
        cells = []
        for c in cols:
            h, gp = r.get(f"{c} host", "-"), r.get(f"{c} gpu", "-")
            cells.append(f"{h:.0f} / {gp:.0f}" if isinstance(h, float) else str(h))
        ch = r.get("torch.compile host")
        ratio = f"{r['kgen after host'] / ch:.2f}" if isinstance(ch, float) else "-"
        print(f"| {r['case']} | " + " | ".join(cells) + f" | {ratio} | {r['after vs before']:.1e} |")


if __name__ == "__main__":
    b = sys.argv[sys.argv.index("--budget") + 1] if "--budget" in sys.argv else "150"
    main("--quick" in sys.argv, float(b))
