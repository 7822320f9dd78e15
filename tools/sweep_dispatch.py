"""Dispatch at random shapes (GPU): for each case the public op as a user calls it, every
candidate of the family that can take the shape (`tune_runner`, as the tuner times them) and
the reference, all timed by the tuner's own timer (`timing.cuda_timer`) in interleaved rounds.
One line a case: the op's time and GPU part (and the candidate whose GPU time it matches),
the fastest candidate, op / fastest (`<<<` past 1.15), and the op's GPU part / the least
GPU part of any candidate (`GPU<<<` past 1.15: a dispatch choice to look at, where `<<<`
alone is usually host cost). Shapes are log-uniform and awkward: mostly untuned buckets,
where dispatch falls to "tuned nearby" or spec order.

    python3 tools/sweep_dispatch.py FAMILY [--cases 8] [--seed 7] [--min-us 500]
    python3 tools/sweep_dispatch.py FAMILY --shape DTYPE:SHAPE ...   (given cases only; SHAPE as
        `kgen tune --shapes` takes it: 208x4671x3776 or B=2048,widths=13-512-256)
    --all: also dispatch's choice and why (dispatch.choose), and every candidate's time
        and GPU part, fastest first
    --shapes-file F: the cases of F (whitespace-separated DTYPE:SHAPE, `--shape` words ignored)
    --json F: every case's times (op, each candidate: [time, GPU part]) and dispatch's choice
    The last line sums up: geomean op / fastest and dispatch's choice (its candidate's time) /
    fastest, and how many cases are past 1.15x, to compare rules over the same shapes.

It found the untuned-shape defects of the twenty-second session (BENCHMARKS.md): int8 above
M = 16 on Triton tiles, logmatmul at tiny K through the op's general path, a winner carried
16x across columns; and the thirty-sixth's: Triton tiles loading one element at a time at
K % 16 != 0, host-bound W8A16 and fused_bias_act calls, tiles that starved the SMs. The op pays its own host cost (checks, output allocation) on top of a
bare launch: host-bound cases read ~2x here without any defect; compare GPU parts there."""

from __future__ import annotations

import argparse
import json
import math
import random

import torch

from kgen import ops
from kgen.errors import KgenError
from kgen.families import module_of
from kgen.runtime import dispatch, timing, tune, tuning_table
from kgen.tune_cli import parse_shape


def random_case(family: str, rng: random.Random) -> tuple[str, dict]:
    """(dtype, shape) for the family's tune_inputs, sizes log-uniform over a wide range."""

    def dim(lo, hi):
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    if family == "fused_bias_act":
        return rng.choice(["bfloat16", "float16", "float32"]), {
            "rows": dim(1, 30000),
            "cols": dim(1, 30000),
            "has_y": rng.random() < 0.5,
        }
    if family == "linear_logp":
        return rng.choice(["bfloat16", "float16", "float32"]), {
            "N": dim(1, 4096),
            "D": 8 * dim(16, 512),
            "V": dim(1000, 160000),
        }
    if family == "logmatmul":
        return rng.choice(["float32", "bfloat16", "float16"]), {
            "B": dim(1, 512),
            "N": dim(16, 8192),
            "K": dim(16, 8192),
        }
    if family == "int8_gemm":
        return rng.choice(["int8", "int8", "bfloat16", "float16"]), {
            "M": dim(1, 8192),
            "N": dim(256, 16384),
            "K": 16 * dim(16, 1024),
        }
    if family == "fused_mlp":
        widths = "-".join(str(dim(1, 1024)) for _ in range(rng.randint(2, 6)))
        return rng.choice(["bfloat16", "float16", "float32"]), {
            "B": dim(1, 65536),
            "widths": widths,
            "activation": "relu",
            "last_activation": rng.choice(["none", "sigmoid"]),
        }
    raise SystemExit(f"no random shapes for {family}")


def op_call(family: str, i: dict):
    """() -> the public op on the tune_inputs `i` (as the family's tune_runner would run the
    same work)."""
    if family == "fused_bias_act":
        return lambda: ops.fused_bias_act(i["x"], i["bias"], i["y"], alpha=0.5, act="gelu")
    if family == "linear_logp":
        return lambda: ops.linear_logp(i["hidden"], i["weight"], i["target"])
    if family == "logmatmul":
        return lambda: ops.logmatmul(i["x"], i["w"])
    if family == "int8_gemm":
        if "a" in i:
            return lambda: ops.int8_mm(i["a"], i["b"])
        return lambda: ops.w8a16_linear(i["x"], i["b"], i["scale_b"], None, group_size=i["group_size"])
    return lambda: ops.fused_mlp(
        i["x"], i["weights"], i["biases"], activation=i["activation"], last_activation=i["last_activation"]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--min-us", type=float, default=500.0)
    ap.add_argument("--all", action="store_true", help="print dispatch's choice and every candidate's times")
    ap.add_argument("--shape", action="append", default=[], metavar="DTYPE:SHAPE",
                    help="time this case instead of random ones (repeatable)")
    ap.add_argument("--shapes-file", help="time the DTYPE:SHAPE cases this file lists")
    ap.add_argument("--json", help="write every case's times and dispatch's choice here")
    args = ap.parse_args()
    fam, rng, dev = module_of(args.family), random.Random(args.seed), torch.device("cuda")
    cases = list(args.shape)
    if args.shapes_file:
        with open(args.shapes_file) as f:
            cases += [w for w in f.read().split() if w != "--shape"]
    given = [(c.partition(":")[0], parse_shape(c.partition(":")[2], fam.TUNE_DIMS)) for c in cases]
    records = []
    for n in range(len(given) or args.cases):
        dt, shape = given[n] if given else random_case(args.family, rng)
        shape = tune.with_extras(fam, dt, shape)
        label = f"{dt:8s} {'x'.join(str(shape[d]) for d in fam.TUNE_DIMS):30s}"
        try:
            inputs = fam.tune_inputs(dev, dt, **shape)
            fns = {"OP": op_call(args.family, inputs),
                   **tune.candidate_runners(fam, dispatch.runnable(args.family, dt, dev), inputs)[0]}
            best, gpu = {}, {}
            with torch.no_grad():
                for _ in range(2):
                    for k, f in fns.items():
                        t = timing.cuda_timer(f, args.min_us)
                        best[k], gpu[k] = min(best.get(k, math.inf), float(t)), min(gpu.get(k, math.inf), t.gpu)
        except (KgenError, RuntimeError, ValueError) as e:
            print(f"{label} ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        cands = {k: v for k, v in best.items() if k != "OP"}
        fastest = min(cands, key=cands.get)
        like = min(cands, key=lambda k: abs(gpu[k] - gpu["OP"]))
        ratio = best["OP"] / best[fastest]
        gpu_ratio = gpu["OP"] / min(v for k, v in gpu.items() if k != "OP")
        print(
            f"{label} op {best['OP']:8.1f} (gpu {gpu['OP']:7.1f}, like {like[-26:]:26s}) | fastest "
            f"{fastest[-26:]:26s} {best[fastest]:8.1f} (gpu {gpu[fastest]:7.1f}) | op/fastest {ratio:.2f} "
            f"gpu {gpu_ratio:.2f} | ref {best.get(tuning_table.REFERENCE, math.nan):8.1f}"
            f"{' <<<' if ratio > 1.15 else ''}{' GPU<<<' if gpu_ratio > 1.15 else ''}",
            flush=True,
        )
        kernel, why = dispatch.choose(args.family, dev, dt, fam.tune_bucket(**shape), shape)
        chosen = kernel.name if kernel is not None else tuning_table.REFERENCE
        if args.all:
            print(f"    dispatch: {chosen} ({why})")
            for k in sorted(cands, key=cands.get):
                print(f"    {k:48s} {best[k]:8.1f} (gpu {gpu[k]:7.1f})")
        records.append({"dtype": dt, "shape": {d: shape[d] for d in fam.TUNE_DIMS}, "chosen": chosen, "why": why,
                        "op": [best["OP"], gpu["OP"]], "times": {k: [best[k], gpu[k]] for k in cands}})
        del inputs, fns
        torch.cuda.empty_cache()
    print(summary(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


def summary(records: list) -> str:
    """One line over the cases: geomean op / fastest and dispatch's choice / fastest (its
    candidate's time; cases where the choice is not a timed candidate are left out), and how
    many are past 1.15x."""

    def geomean(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan

    op, chosen = [], []
    for r in records:
        fastest = min(t[0] for t in r["times"].values())
        op.append(r["op"][0] / fastest)
        if r["chosen"] in r["times"]:
            chosen.append(r["times"][r["chosen"]][0] / fastest)
    return (f"{len(records)} cases: op / fastest geomean {geomean(op):.3f} ({sum(x > 1.15 for x in op)} past 1.15x); "
            f"dispatch's choice / fastest geomean {geomean(chosen):.3f} ({sum(x > 1.15 for x in chosen)} past 1.15x, "
            f"{len(chosen)} cases)")


if __name__ == "__main__":
    main()
