"""int8_gemm at M <= 16 (issue 16's small-M bars): the CUDA gemv variants against the
weight-read floor, the family's other variants (and dispatch's current choice, from the
tuning table), bf16 cuBLAS with bf16 weights and the PyTorch W8A16 expression, one run.
Each kernel's output is checked first (int8_mm exact; w8a16 within the spec's tolerance
of float64). Times: triton.testing.do_bench medians, L2 flushed between calls. Also
writes every candidate's time per tuning bucket (JSON) for a re-tune of the M <= 16 buckets.

    python tools/bench_int8_gemv.py [--out DIR] [--ms 1,16] [--shapes N,K ...] [--no-sweep]

Also times a device-to-device copy moving the same bytes as the weight read (N x K / 2 read,
as many written) at each shape: what one bandwidth-bound launch of that size costs with its
ramp and tail ("copy us"), the practical floor beside the bandwidth floor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton

from kgen import ops, spec
from kgen.families import int8_gemm as ig
from kgen.runtime import dispatch
from kgen.runtime.op import error_ratio

SHAPES = ((4096, 11008), (12288, 4096), (22016, 4096), (4096, 4096), (65536, 4096))
SPEC = spec.load(os.path.join(os.path.dirname(__file__), "..", "kgen", "specs", "int8_gemm.yaml"))


def _us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = _us(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 30) / (t * 1e-6)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--ms", default="1,16")
    p.add_argument("--shapes", nargs="*", default=None)
    p.add_argument("--no-sweep", action="store_true")
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    ms = [int(m) for m in args.ms.split(",")]
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    kernels = {}
    for dtype in ("int8", "bfloat16"):
        for v in dispatch.runnable("int8_gemm", dtype, dev):
            kernels[(dtype, v.name)] = ig.implementation(dispatch.load(v))
    tol = SPEC.numerics["bfloat16"]
    src = torch.empty(max(N * K for N, K in shapes) // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    rows, buckets = [], {}
    for N, K in shapes:
        b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=dev)
        wb = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        sb = (torch.rand(N, device=dev) + 0.5) / (127 * K ** 0.5)
        sbb = sb.to(torch.bfloat16)
        half = N * K // 2
        copy_us = _us(lambda: dst[:half].copy_(src[:half]))
        for M in ms:
            a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=dev)
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            i8_floor = (N * K + M * K + 4 * M * N) / bw * 1e6
            w_floor = (N * K + 2 * M * K + 2 * M * N) / bw * 1e6
            want = ig.reference.int8_mm(a, b).long()  # float64 on CUDA at M <= 16: exact
            ref = ig.reference.w8a16_linear(x, b, sb, compute=torch.float64)
            for dtype in ("int8", "bfloat16"):
                times, checks = {}, {}
                for (d, name), impl in kernels.items():
                    if d != dtype:
                        continue
                    if dtype == "int8":
                        out = torch.empty(M, N, dtype=torch.int32, device=dev)
                        fn = lambda impl=impl, out=out: ig.gemm(impl, ig.MODE_MM, a, b, out)  # noqa: E731
                        fn()
                        checks[name] = "exact" if torch.equal(out.long(), want) else "WRONG"
                    else:
                        out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
                        fn = lambda impl=impl, out=out: ig.gemm(impl, ig.MODE_W8A16, x, b, out, scale_b=sb)  # noqa: E731
                        fn()
                        r = error_ratio(out, ref, tol)
                        checks[name] = f"ok {r:.2f}" if r <= 1.0 else f"WRONG {r:.2f}"
                    times[name] = _us(fn)
                floor = i8_floor if dtype == "int8" else w_floor
                if dtype == "int8":
                    times["dispatch (table)"] = _us(lambda: ops.int8_mm(a, b))
                else:
                    times["dispatch (table)"] = _us(lambda: ops.w8a16_linear(x, b, sb))
                    times["bf16 cuBLAS"] = _us(lambda: x @ wb.t())
                    times["W8A16 eager"] = _us(lambda: (x @ b.t().to(x.dtype)) * sbb)
                gemv = {n: t for n, t in times.items() if "gemv" in n}
                old = {n: t for n, t in times.items() if n in checks and "gemv" not in n}
                best_g = min(gemv, key=gemv.get)
                best_o = min(old, key=old.get)
                row = {"op": "int8_mm" if dtype == "int8" else "w8a16", "M": M, "N": N, "K": K,
                       "floor us": floor, "gemv best": best_g, "gemv us": gemv[best_g],
                       "x floor": gemv[best_g] / floor, "old best": best_o, "old us": old[best_o],
                       "dispatch us": times["dispatch (table)"], "check": checks[best_g],
                       "copy us": copy_us, "x copy": gemv[best_g] / copy_us}
                if dtype != "int8":
                    row["cuBLAS bf16 us"] = times["bf16 cuBLAS"]
                    row["x vs cuBLAS"] = times["bf16 cuBLAS"] / gemv[best_g]
                    row["eager us"] = times["W8A16 eager"]
                rows.append(row)
                bucket = ig.tune_bucket(M, N, K)
                buckets[f"{dtype}|{bucket}"] = {"times_us": times, "checks": checks, "floor_us": floor}
                print(json.dumps(row), flush=True)
                ranked = sorted(gemv.items(), key=lambda i: i[1])
                print("  gemv:", {n.replace("sm90_gemv_m16_", ""): round(t, 2) for n, t in ranked}, flush=True)
                bad = [n for n, c in checks.items() if c.startswith("WRONG")]
                if bad:
                    print("WRONG:", bad, flush=True)
            # the K split policy against forced splits, for the first gemv variant of each dtype
            if (N, K) in ((4096, 4096), (4096, 11008)) and not args.no_sweep:
                for (d, name), impl in kernels.items():
                    if "gemv" not in name or ("n64" not in name and "n16" not in name):
                        continue
                    sweep = {}
                    for s in (1, 2, 4, 8, 16) if "n64" in name else (1, 2, 3, 4):
                        if d == "int8":
                            out = torch.empty(M, N, dtype=torch.int32, device=dev)
                            sweep[s] = _us(lambda: ig.gemm(impl, ig.MODE_MM, a, b, out, n_splits=s))
                        else:
                            out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
                            sweep[s] = _us(lambda: ig.gemm(impl, ig.MODE_W8A16, x, b, out, scale_b=sb, n_splits=s))
                    print(json.dumps({"sweep": name, "M": M, "N": N, "K": K,
                                      "policy": ig.plans.gemv_splits_of(impl.cuda.params, M, N, K, ig.plans.sm_count(dev)),
                                      "us by splits": {k: round(v, 2) for k, v in sweep.items()}}), flush=True)
            del a, x
        del b, wb
        torch.cuda.empty_cache()
    print()
    head = ["op", "M", "N", "K", "floor us", "copy us", "gemv us", "x floor", "x copy", "old us", "dispatch us", "cuBLAS bf16 us",
            "x vs cuBLAS", "eager us", "gemv best", "old best", "check"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = []
        for h in head:
            v = r.get(h, "")
            cells.append(f"{v:.2f}" if isinstance(v, float) and not math.isnan(v) else str(v))
        print("| " + " | ".join(cells) + " |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "int8_gemv_bench.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "rows": rows,
                   "buckets": buckets}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
