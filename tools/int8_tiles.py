"""int8_gemm's untuned tile choice against measurement (GPU): at each case every tile variant
(Triton, mma.sync, WGMMA; no gemv) as the op's plan runs it, the op itself, and each variant's
predicted time (plans.tile_grid_us for the Triton and mma.sync tiles; plans.wgmma_tile_cost,
relative, for the WGMMA ones). One line a case: the op, the fastest, op / fastest; then every
candidate's GPU µs (prediction). Ends with the geomean and worst op / fastest. It checked the
fifty-first session's split-or-not model (BENCHMARKS.md) on shapes it was not fitted on.

    python3 tools/int8_tiles.py --shape float16:208x4671x3776 --shape int8:3001x2999x3008
    python3 tools/int8_tiles.py --random 30 --seed 5121 --dtype bfloat16 float16 --m 129-1024

With --gemv, the CUDA gemv variants instead (M <= 16): each with the plan's K splits, one
split and the fill plan's (plans.gemv_fill_splits), timed as the tuner times them (the larger
of host and GPU time, and the GPU part alone): data for the gemv choice (plans._gemv_rank)
and split rule (plans.gemv_splits), and at the end the rule's choice over the fastest.

    python3 tools/int8_tiles.py --gemv --random 60 --seed 5902 --m 1-16 --json gemv.json
    python3 tools/int8_tiles.py --gemv-summary gemv.json   (the rule as the tree has it, no GPU)
"""

from __future__ import annotations

import argparse
import json
import math
import random

import torch

from kgen import ops
from kgen.families import module_of
from kgen.families.int8_gemm import plans
from kgen.runtime import dispatch, timing, tune, tuning_table
from kgen.tune_cli import parse_shape


def cases(args) -> list[tuple[str, int, int, int]]:
    out = []
    for text in args.shape:
        dt, _, dims = text.partition(":")
        shape = parse_shape(dims, ("M", "N", "K"))
        out.append((dt, shape["M"], shape["N"], shape["K"]))
    rng = random.Random(args.seed)
    lo, hi = map(int, args.m.split("-"))

    def dim(a, b):
        return int(round(math.exp(rng.uniform(math.log(a), math.log(b)))))

    for n in range(args.random):
        out.append((args.dtype[n % len(args.dtype)], dim(lo, hi), dim(256, 16384), 16 * dim(16, 1024)))
    return out


def predicted(v, M: int, N: int, K: int, sms: int) -> float:
    if plans.is_wgmma(v):
        return plans.wgmma_tile_cost(v.params, M, N, sms) * K * plans.WGMMA_US_PER_COST_K + plans.FIXED_US
    return plans.tile_grid_us(v.params, M, N, K, sms, v.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=[], metavar="DTYPE:MxNxK")
    ap.add_argument("--random", type=int, default=0, help="this many random shapes too")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float16", "int8"])
    ap.add_argument("--m", default="17-1024", help="the random shapes' rows, LO-HI")
    ap.add_argument("--min-us", type=float, default=200.0)
    ap.add_argument("--json", metavar="PATH", help="also write every case's times, predictions and tile parameters")
    ap.add_argument("--gemv", action="store_true", help="the gemv variants at each split count (M <= 16)")
    ap.add_argument("--gemv-summary", metavar="JSON", help="the gemv rule against a --gemv run's JSON (no GPU)")
    args = ap.parse_args()
    if args.gemv_summary:
        with open(args.gemv_summary) as f:
            return gemv_summary(json.load(f))
    if args.gemv:
        return gemv_main(args)
    dev, fam = torch.device("cuda"), module_of("int8_gemm")
    sms = plans.sm_count(dev)
    ratios, rows = [], []
    for dt, M, N, K in cases(args):
        inputs = fam.tune_inputs(dev, dt, M=M, N=N, K=K)
        vs = [v for v in dispatch.runnable("int8_gemm", dt, dev) if not plans.is_gemv(v)]
        fns, _ = tune.candidate_runners(fam, vs, inputs)
        fns.pop(tuning_table.REFERENCE, None)
        if dt == "int8":
            fns["OP"] = lambda i=inputs: ops.int8_mm(i["a"], i["b"])
        else:
            fns["OP"] = lambda i=inputs: ops.w8a16_linear(i["x"], i["b"], i["scale_b"], None)
        gpu = {}
        with torch.no_grad():
            for _ in range(2):
                for k, f in fns.items():
                    gpu[k] = min(gpu.get(k, math.inf), timing.cuda_timer(f, args.min_us).gpu)
        best = min((k for k in gpu if k != "OP"), key=gpu.get)
        ratios.append(gpu["OP"] / gpu[best])
        pred = {v.name: predicted(v, M, N, K, sms) for v in vs}
        print(f"{dt:8s} {M}x{N}x{K}: op {gpu['OP']:.1f} fastest {best.removeprefix('int8_gemm_')} {gpu[best]:.1f} "
              f"op/fastest {ratios[-1]:.2f}", flush=True)
        for k in sorted(pred, key=lambda k: gpu.get(k, math.inf)):
            if k in gpu:
                print(f"    {k.removeprefix('int8_gemm_'):44s} {gpu[k]:8.1f} (predicted {pred[k]:8.1f})", flush=True)
        rows.append({"dtype": dt, "M": M, "N": N, "K": K, "sms": sms, "op_us": gpu["OP"],
                     "variants": {v.name: {"us": gpu.get(v.name), "predicted_us": pred[v.name], "params": v.params}
                                  for v in vs if v.name in gpu}})
        del inputs, fns
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    if ratios:
        print(f"op / fastest over {len(ratios)} cases: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, "
              f"worst {max(ratios):.2f}")


def gemv_main(args) -> None:
    from kgen.families.int8_gemm import launch

    dev, fam = torch.device("cuda"), module_of("int8_gemm")
    sms = plans.sm_count(dev)
    rows = []
    dispatch.prebuild([v for dt in args.dtype for v in dispatch.runnable("int8_gemm", dt, dev) if plans.is_gemv(v)])
    for dt, M, N, K in cases(args):
        inputs = fam.tune_inputs(dev, dt, M=M, N=N, K=K)
        vs = [v for v in dispatch.runnable("int8_gemm", dt, dev) if plans.is_gemv(v)]
        fns = {}
        for v in vs:
            impl = fam.implementation(dispatch.load(v))
            p = v.params
            counts = {"plan": plans.gemv_splits_of(p, M, N, K, sms), "one": 1,
                      "fill": plans.gemv_fill_splits(p["block_n"], M, N, K, sms, p["warps_n"], p["warps_m"])}
            for tag, n in counts.items():
                n = impl.splits(M, N, K, dev, n)
                if (v.name, n) in fns:
                    continue
                if dt == "int8":
                    f = lambda impl=impl, n=n, i=inputs: launch.gemm(impl, fam.MODE_MM, i["a"], i["b"], i["out"], n_splits=n)
                else:
                    f = lambda impl=impl, n=n, i=inputs: launch.gemm(impl, fam.MODE_W8A16, i["x"], i["b"], i["out"],
                                                                     scale_b=i["scale_b"], n_splits=n)
                fns[(v.name, n)] = (f, tag)
        if dt == "int8":
            op = lambda i=inputs: ops.int8_mm(i["a"], i["b"])
        else:
            op = lambda i=inputs: ops.w8a16_linear(i["x"], i["b"], i["scale_b"], None)
        t = {}
        with torch.no_grad():
            for _ in range(2):
                for k, (f, _tag) in [*fns.items(), ("OP", (op, ""))]:
                    r = timing.cuda_timer(f, args.min_us)
                    old = t.get(k)
                    t[k] = (min(old[0], float(r)), min(old[1], r.gpu)) if old else (float(r), r.gpu)
        best = min((k for k in t if k != "OP"), key=lambda k: t[k][0])
        print(f"{dt:8s} {M}x{N}x{K}: op {t['OP'][0]:.1f} (gpu {t['OP'][1]:.1f}) fastest {best[0].removeprefix('int8_gemm_')} "
              f"x{best[1]} {t[best][0]:.1f} op/fastest {t['OP'][0] / t[best][0]:.2f}", flush=True)
        for k in sorted((k for k in t if k != "OP"), key=lambda k: t[k][0]):
            print(f"    {k[0].removeprefix('int8_gemm_'):40s} x{k[1]:<3d} {fns[k][1]:5s} {t[k][0]:8.1f} gpu {t[k][1]:8.1f}",
                  flush=True)
        rows.append({"dtype": dt, "M": M, "N": N, "K": K, "sms": sms, "op": t["OP"],
                     "runs": [{"variant": k[0], "splits": k[1], "tag": fns[k][1], "us": t[k][0], "gpu_us": t[k][1],
                               "params": next(v.params for v in vs if v.name == k[0])} for k in fns]})
        if args.json:  # after every case: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1, default=str)
        del inputs, fns
        torch.cuda.empty_cache()
    gemv_summary(rows)


def gemv_summary(rows: list) -> None:
    """The shape preference's gemv choice (plans.preference, each variant at its plan's
    splits) over the fastest variant at its plan: geomean and worst, of the time and of the
    GPU part. Also `python3 tools/int8_tiles.py --gemv-summary JSON` (no GPU)."""
    class V:  # what plans.preference reads of a variant
        backend, dtype = "cuda", None

        def __init__(self, params):
            self.params = params

    time, gpu = [], []
    for r in rows:
        plan = [x for x in r["runs"] if x["tag"] == "plan"]
        chosen = min(plan, key=lambda x: plans.preference(V(x["params"]), r["M"], r["N"], r["sms"], r["K"]))
        time.append(chosen["us"] / min(x["us"] for x in plan))
        gpu.append(chosen["gpu_us"] / min(x["gpu_us"] for x in plan))
    if rows:
        g = lambda a: math.exp(sum(map(math.log, a)) / len(a))  # noqa: E731
        print(f"the rule's choice / the fastest over {len(rows)} cases: time {g(time):.3f} (worst {max(time):.2f}), "
              f"GPU {g(gpu):.3f} (worst {max(gpu):.2f})")


if __name__ == "__main__":
    main()
