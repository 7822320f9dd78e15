"""int8_gemm benchmark (issue 16's table): per Llama shape (N, K) and M, kgen's int8_mm,
int8_linear and w8a16_linear (as dispatch picks them) against torch._int_mm, bf16 cuBLAS
with bf16 weights, and the PyTorch W8A16 expression eager and compiled; TOP/s and % of the
floor beside each time. Floor = max(bytes moved once / measured copy bandwidth, ops / the
measured library peak (torch._int_mm at 8192^3 for int8, bf16 cuBLAS for W8A16)).
`variants=True` also times every int8 and bf16 variant alone (what a tuning table would pick).
At M <= 64 (bandwidth-bound) also in steady state (kgen.benchmarks.steady: CUDA-graph
replays rotating over enough weight sets that none is found in L2, a clean flush), against
a floor timed the same way, and torch._int_mm timed alike: do_bench's dirty-L2 flush adds
several us to a 5-90 us call, the same to every kernel, which hides ratios between them.

    python -m kgen.benchmarks.int8_gemm [--quick] [--variants] [--shapes N,K ...] [--ms 1,16]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import triton

from kgen import ops
from kgen.benchmarks.steady import copy_floor_us, steady_us
from kgen.families import int8_gemm as ig
from kgen.runtime import dispatch

SHAPES = ((4096, 11008), (12288, 4096), (22016, 4096), (4096, 4096), (65536, 4096))
MS = (1, 16, 64, 256, 1024, 4096)
COMPILED_MS = (1, 16, 64)  # torch.compile of the W8A16 expression: one compile per shape
STEADY_MS = 64  # M at most this: also timed in steady state
STEADY_BYTES = 128 << 20  # weight sets rotated in steady state: at least this many bytes (> 2 x L2)


def _ms(fn, quick) -> float:
    """Median time (ms) with L2 flushed between calls (triton.testing.do_bench)."""
    return triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median")


def copy_bandwidth(quick) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _ms(lambda: dst.copy_(src), quick)
    return 2 * src.numel() / (ms * 1e-3)


def peaks(quick) -> tuple[float, float]:
    """Measured ops/s of torch._int_mm and bf16 cuBLAS at 8192^3."""
    n = 8192
    a = torch.randint(-128, 128, (n, n), dtype=torch.int8, device="cuda")
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    i8 = 2 * n**3 / (_ms(lambda: torch._int_mm(a, a.t()), quick) * 1e-3)
    bf = 2 * n**3 / (_ms(lambda: x @ x.t(), quick) * 1e-3)
    return i8, bf


def _w8a16_expr(x, b, s):
    return (x @ b.t().to(x.dtype)) * s


def cases(shapes, ms, quick, bw, i8_peak, bf_peak, variants=False) -> tuple[list[dict], list[dict]]:
    rows, vrows = [], []
    compiled = torch.compile(_w8a16_expr, dynamic=False)
    for N, K in shapes:
        b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda")
        wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        sb = torch.rand(N, device="cuda") / 127
        sbb = sb.to(torch.bfloat16)
        for M in ms:
            a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device="cuda")
            sa = torch.rand(M, device="cuda") / 127
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ops_ = 2.0 * M * N * K
            i8_floor = max((N * K + M * K + 4 * M * N) / bw, ops_ / i8_peak)
            w_floor = max((N * K + 2 * M * K + 2 * M * N) / bw, ops_ / bf_peak)
            want = (a.long().cpu() @ b.long().cpu().t()) if M * N * K <= 1 << 34 else None
            got = ops.int8_mm(a, b)
            exact = "exact" if want is None or torch.equal(got.cpu().long(), want) else "WRONG"
            t_mm = _ms(lambda: ops.int8_mm(a, b), quick)
            t_lin = _ms(lambda: ops.int8_linear(a, b, sa, sb), quick)
            t_w = _ms(lambda: ops.w8a16_linear(x, b, sb), quick)
            t_int = _ms(lambda: torch._int_mm(a, b.t()), quick) if ig.reference.int_mm_allowed(a, b) else math.nan
            t_bf = _ms(lambda: x @ wb.t(), quick)
            t_eager = _ms(lambda: _w8a16_expr(x, b, sbb), quick)
            t_comp = _ms(lambda: compiled(x, b, sbb), quick) if M in COMPILED_MS else math.nan
            us = lambda t: t * 1e3  # noqa: E731
            rows.append({
                "case": f"M={M} N={N} K={K}", "int8_mm us": us(t_mm), "TOP/s": ops_ / (t_mm * 1e-3) / 1e12,
                "% floor": 100 * i8_floor / (t_mm * 1e-3), "_int_mm us": us(t_int),
                "x _int_mm": t_int / t_mm, "int8_linear us": us(t_lin), "epi %": 100 * (t_lin / t_mm - 1),
                "w8a16 us": us(t_w), "w8a16 % floor": 100 * w_floor / (t_w * 1e-3), "bf16 cuBLAS us": us(t_bf),
                "x cuBLAS": t_bf / t_w, "W8A16 eager us": us(t_eager), "compiled us": us(t_comp), "check": exact})
            if M <= STEADY_MS:
                rows[-1].update(_steady(M, N, K, a, b, x, sb, sbb))
            if variants:
                vrows.extend(_variants(M, N, K, a, b, x, sb, quick, i8_floor, w_floor))
            del a, x, got
        del b, wb
        torch.cuda.empty_cache()
    return rows, vrows


def _steady(M, N, K, a, b, x, sb, sbb) -> dict:
    """Steady-state us of int8_mm, torch._int_mm (where it takes M), w8a16_linear and bf16
    cuBLAS at a small M, each over enough weight copies that no call finds its weights in L2,
    and the weight-read floor (N x K int8 bytes at the copy bandwidth measured alike)."""
    sets = max(2, -(-STEADY_BYTES // (N * K)))
    bs = [b] + [torch.randint_like(b, -128, 128) for _ in range(sets - 1)]
    bsets = max(2, -(-STEADY_BYTES // (2 * N * K)))
    wbs = [torch.randn(N, K, device=b.device, dtype=torch.bfloat16) for _ in range(bsets)]
    _, floor = copy_floor_us(max(N * K, STEADY_BYTES // 2))
    floor *= N * K / max(N * K, STEADY_BYTES // 2)  # the rate of a large copy, for N x K bytes
    mm = steady_us([lambda b=b: ops.int8_mm(a, b) for b in bs])
    im = steady_us([lambda b=b: torch._int_mm(a, b.t()) for b in bs]) if ig.reference.int_mm_allowed(a, b) else math.nan
    w = steady_us([lambda b=b: ops.w8a16_linear(x, b, sb) for b in bs])
    bf = steady_us([lambda wb=wb: x @ wb.t() for wb in wbs])
    del bs, wbs
    return {"steady: floor us": floor, "steady: int8_mm us": mm, "steady: int8_mm x floor": mm / floor,
            "steady: _int_mm us": im, "steady: x _int_mm": im / mm,
            "steady: w8a16 us": w, "steady: w8a16 x floor": w / floor, "steady: bf16 cuBLAS us": bf,
            "steady: x cuBLAS": bf / w}


def _variants(M, N, K, a, b, x, sb, quick, i8_floor, w_floor) -> list[dict]:
    rows = []
    dev = a.device
    for dtype, floor in (("int8", i8_floor), ("bfloat16", w_floor)):
        inputs = {"a": a, "b": b, "out": torch.empty(M, N, dtype=torch.int32, device=dev)} if dtype == "int8" else \
            {"x": x, "b": b, "scale_b": sb, "group_size": None, "out": torch.empty(M, N, dtype=x.dtype, device=dev)}
        times, variants = {}, dispatch.runnable("int8_gemm", dtype, dev)
        dispatch.prebuild(variants)  # (nvcc in parallel on the first shape; cache hits after)
        for v in variants:
            times[v.name] = _ms(ig.tune_runner(dispatch.load(v), inputs), quick)
        best = min(times, key=times.get)
        rows.append({"case": f"{dtype} M={M} N={N} K={K}", "best": best, "best us": times[best] * 1e3,
                     "% floor": 100 * floor / (times[best] * 1e-3),
                     **{n.removeprefix("triton_"): t * 1e3 for n, t in times.items()}})
    return rows


def run(spec, quick) -> dict:
    bw = copy_bandwidth(quick)
    i8, bf = peaks(quick)
    rows, _ = cases(SHAPES, MS, quick, bw, i8, bf)
    head = [{"what": "copy GB/s", "value": bw / 1e9}, {"what": "_int_mm TOP/s at 8192^3", "value": i8 / 1e12},
            {"what": "bf16 cuBLAS TFLOP/s at 8192^3", "value": bf / 1e12}]
    return {"floors": head, "int8_gemm (us; % floor = floor / time)": rows}


def main(argv=None) -> int:
    from kgen.bench import environment, print_table

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--variants", action="store_true")
    p.add_argument("--shapes", nargs="*", default=None, help="N,K pairs")
    p.add_argument("--ms", default=None, help="comma-separated M values")
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    ms = [int(m) for m in args.ms.split(",")] if args.ms else MS
    print(environment())
    bw = copy_bandwidth(args.quick)
    i8, bf = peaks(args.quick)
    print(f"copy {bw / 1e9:.0f} GB/s, _int_mm {i8 / 1e12:.0f} TOP/s, bf16 cuBLAS {bf / 1e12:.0f} TFLOP/s at 8192^3")
    rows, vrows = cases(shapes, ms, args.quick, bw, i8, bf, args.variants)
    print_table("int8_gemm via dispatch (us; TOP/s and % of floor of int8_mm; x = peer time / kgen time)", rows)
    print_table("each variant alone (us)", vrows)
    for name, col in (("int8_mm vs _int_mm", "x _int_mm"), ("w8a16 vs bf16 cuBLAS", "x cuBLAS"),
                      ("steady-state int8_mm vs _int_mm", "steady: x _int_mm")):
        for lo, hi in ((1, 16), (64, 64), (1024, 4096)):
            vals = [r[col] for r in rows
                    if lo <= int(r["case"].split()[0][2:]) <= hi and not math.isnan(r.get(col, math.nan))]
            if vals:
                print(f"geomean {name} at M in [{lo}, {hi}]: {math.exp(sum(map(math.log, vals)) / len(vals)):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
