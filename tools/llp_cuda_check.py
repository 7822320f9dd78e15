"""One device call for the CUDA linear_logp kernels: numerics of each variant that runs on
this GPU against float64 (poisoned buffers, awkward sizes, bias / temperature / ignored
rows / entropy, split invariance), then forward timing against cuBLAS at the benchmark
shapes. Prints tables; writes $OUT/llp-cuda.json.

Usage (device machine, repo root): python3 tools/llp_cuda_check.py [--spec S] [--variants A,B]
    [--no-check] [--no-time] [--ablate] [--order] [--clocks] [--flags "label:nvcc flags,..."]
    [--launch-hidden]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.getcwd())
from kgen import spec as spec_mod  # noqa: E402
from kgen.families import linear_logp as llp  # noqa: E402
from kgen.families.linear_logp import launch  # noqa: E402
from kgen.runtime import dispatch  # noqa: E402

SHAPES = [(4096, 2048, 151936), (8192, 4096, 128256)]


def poisoned_empty(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)


def check(impl, dtype, rows):
    launch._empty = poisoned_empty
    cases = [(1, 50, 16, False, False, 1.0), (7, 257, 40, True, True, 0.7), (33, 1000, 72, True, False, 1.3),
             (300, 5003, 264, False, True, 1.0), (4099, 50257, 2048, True, True, 0.7),
             (7, 128256, 4096, False, True, 1.0), (1, 151936, 2048, True, False, 1.0),
             # "spiky": a few columns far above the rest (bias + 40), so that tiles late in a
             # V slice raise the kernels' lazily kept reference maximum (its refold path)
             (33, 20000, 72, "spiky", True, 1.0), (4099, 50257, 2048, "spiky", True, 0.7)]
    for N, V, D, with_bias, ent, T in cases:
        torch.manual_seed(N * 7 + V)
        h = torch.randn(N, D, device="cuda").to(dtype)
        w = (torch.randn(V, D, device="cuda") * (2.0 / math.sqrt(D))).to(dtype)
        b = (torch.randn(V, device="cuda") * 0.5) if with_bias else None
        if with_bias == "spiky":
            b[V // 3::1237] += 40.0
        b = b.to(dtype) if b is not None else None
        t = torch.randint(0, V, (N,), device="cuda")
        t[::3] = -100 if N > 1 else t[::3]
        want_logp, want_ent = llp.reference(h, w, t, b, temperature=T, compute=torch.float64)
        results = {}
        for splits in (None, 1, 3):
            got = llp.forward(impl, h, w, t, b, T, -100, ent, splits=splits)
            torch.cuda.synchronize()
            err = (got[0].double() - want_logp).abs() / (2e-5 + 2e-5 * want_logp.abs())
            e_ent = ((got[1].double() - want_ent).abs() / (2e-5 + 2e-5 * want_ent.abs())).max().item() if ent else 0.0
            results[splits] = (err.max().item(), e_ent, got[0])
        inv = (results[None][2] - results[1][2]).abs().max().item()
        worst = max(max(r[0], r[1]) for r in results.values())
        rows.append({"case": f"N={N} V={V} D={D} bias={with_bias} ent={ent} T={T}",
                     "logp err/tol": round(max(r[0] for r in results.values()), 3),
                     "ent err/tol": round(max(r[1] for r in results.values()), 3),
                     "split invariance": f"{inv:.2e}", "ok": worst <= 1.0 and not math.isnan(worst)})
        print(rows[-1], flush=True)
    launch._empty = lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device)


def median(xs):
    return sorted(xs)[len(xs) // 2]


def interleaved(fns: dict, baseline: str, rounds: int = 25, reps: int = 4,
                launch_hidden: bool = False) -> tuple[dict, dict]:
    """Per-call ms of each function and its ratio to `baseline`, from interleaved rounds:
    in each round every other function, in a fresh random order, is timed (reps
    back-to-back calls between CUDA events, after one warm call) right after the baseline,
    and the ratio of the two is one sample. Returns (median ms, median ratio) per function.
    Pairing each sample with a baseline timed moments before takes out the clock drift of a
    power-capped GPU (the medians of unpaired times of one kernel moved 3-5 % within a run).
    Inputs are hundreds of MB: L2 holds none between calls. The GPU is idle when the first
    event is recorded, so the host's path to the first launch of the reps (Python, argument
    checks, launcher) is on the clock, once per `reps` calls; with `launch_hidden` a ~0.5 ms
    GPU sleep queued first keeps it off, measuring the device time alone."""
    import random

    def timed(fn):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if launch_hidden:
            torch.cuda._sleep(1_000_000)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / reps

    times = {k: [] for k in fns}
    ratios = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    order = [(k, fn) for k, fn in fns.items() if k != baseline]
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for k, fn in order:
            base = timed(fns[baseline])
            t = timed(fn)
            times[baseline].append(base)
            times[k].append(t)
            ratios[k].append(t / base)
    return {k: median(v) for k, v in times.items()}, {k: median(v) for k, v in ratios.items() if v} | {baseline: 1.0}


def clocks(fns: dict, seconds: float = 2.0) -> dict:
    """Median SM clock (MHz) and board power (W) while each function runs back to back for
    `seconds`, sampled by nvidia-smi every 50 ms (the first 0.5 s left out): whether a
    variant is slower because it runs more cycles or because the power cap lowers the clock."""
    import subprocess

    out = {}
    for k, fn in fns.items():
        proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                 "-lms", "50", "-i", str(torch.cuda.current_device())],
                                stdout=subprocess.PIPE, text=True)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(4):
                fn()
            torch.cuda.synchronize()
        proc.terminate()
        samples = [tuple(float(x) for x in line.split(",")) for line in proc.communicate()[0].splitlines()
                   if line.count(",") == 1]
        samples = samples[10:] or samples
        out[k] = (median([c for c, _ in samples]), median([p for _, p in samples])) if samples else (0.0, 0.0)
    return out


class _Entry:
    """Stands in for a cache entry: a library built outside the cache (ablation builds)."""

    def __init__(self, path):
        self.path, self.manifest = path, {}

    def file(self, name):
        return self.path


def ablation_build(variant, flags):
    """The variant's rendered source compiled with extra nvcc flags, loaded (diagnostics)."""
    import subprocess
    import tempfile

    from kgen.render import render
    from kgen.runtime import build, loader, toolchain

    d = tempfile.mkdtemp(prefix="kgen-ablate-")
    src, out = os.path.join(d, "kernel.cu"), os.path.join(d, "lib.so")
    with open(src, "w") as f:
        f.write(render(variant).text)
    cmd = build.cuda_command(toolchain.nvcc(), variant.arch, src, out)
    subprocess.run(cmd[:1] + flags.split() + cmd[1:], check=True)
    return loader.load_cuda(variant, _Entry(out))


def time_shapes(impls, companion, rows, ablate: bool, order: bool, flags: dict, sample_clocks: bool = False,
                launch_hidden: bool = False):
    """Forward times at the benchmark shapes (bf16, no bias, no entropy) in one interleaved
    set per shape; with `ablate`, also each CUDA variant with parts left out, and each
    CUDA variant built with each of `flags` (label -> nvcc flags); with `order`, each CUDA
    variant's partials in split-major order and with splits = split_v."""
    from concurrent.futures import ThreadPoolExecutor

    extra = {}
    todo = [(name, impl, label, f) for name, impl in impls if isinstance(impl, llp.CudaForward)
            for label, f in (({"no softmax fold": "-DKGEN_ABLATE_FOLD"} if ablate else {}) | flags).items()]
    with ThreadPoolExecutor(8) as pool:
        built = list(pool.map(lambda x: ablation_build(x[1].kernel.variant, x[3]), todo))
    for (name, impl, label, _), k in zip(todo, built):
        extra.setdefault(name, {})[label] = llp.CudaForward(k, companion)
    for N, D, V in SHAPES:
        torch.manual_seed(0)
        h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(V, D, device="cuda") * (2.0 / math.sqrt(D))).to(torch.bfloat16)
        t = torch.randint(0, V, (N,), device="cuda")
        flop = 2.0 * N * V * D
        fns = {"cuBLAS h @ w.T": lambda: h @ w.T}
        notes = {}
        for name, impl in impls:
            fns[name] = lambda impl=impl: llp.forward(impl, h, w, t, None, 1.0, -100, False)
            if not isinstance(impl, llp.CudaForward):
                continue
            splits, group = impl.splits(N, V, h.device), impl.group(N, D)
            notes[name] = f"splits {splits}, group {group} of {-(-N // impl.rows)} row groups"
            fns[f"{name}: partials only"] = lambda impl=impl, s=splits: impl.partials(h, w, t, None, 1.0, False, s)
            for label, x in extra.get(name, {}).items():
                fns[f"{name}: partials, {label}"] = lambda x=x, s=splits: x.partials(h, w, t, None, 1.0, False, s)
            if order:
                sm = llp.CudaForward(impl.kernel, companion)
                sm.group = lambda N, D, impl=impl: -(-N // impl.rows)
                fns[f"{name}: partials, split-major order"] = lambda sm=sm, s=splits: sm.partials(h, w, t, None, 1.0, False, s)
                fns[f"{name}: partials, splits = split_v {impl.split_v}"] = (
                    lambda impl=impl: impl.partials(h, w, t, None, 1.0, False, impl.split_v))
        ms, ratio = interleaved(fns, "cuBLAS h @ w.T", launch_hidden=launch_hidden)
        clk = clocks(fns) if sample_clocks else {}
        for k, v in ms.items():
            rows.append({"shape": f"{N}x{D}x{V}", "impl": k, "ms": round(v, 3), "TFLOP/s": round(flop / v / 1e9, 1),
                         "x GEMM (paired)": round(ratio[k], 3), "note": notes.get(k, "")}
                        | ({"MHz": clk[k][0], "W": clk[k][1]} if k in clk else {}))
            print(rows[-1], flush=True)
        del h, w, t, fns
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="kgen/specs/linear_logp.yaml")
    ap.add_argument("--variants", default="")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--ablate", action="store_true", help="also time each CUDA variant without its softmax fold")
    ap.add_argument("--order", action="store_true", help="also time split-major order and splits = split_v")
    ap.add_argument("--clocks", action="store_true", help="also sample SM clock and power while each runs")
    ap.add_argument("--flags", default="", help="label:nvcc flags[,label:flags...] builds to time too")
    ap.add_argument("--launch-hidden", action="store_true",
                    help="queue a GPU sleep before each timed region: device time without the host's launch path")
    args = ap.parse_args()
    out = os.environ.get("OUT", "/tmp/kgen-out")
    os.makedirs(out, exist_ok=True)
    cap = torch.cuda.get_device_capability()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    spec = spec_mod.load(args.spec)
    wanted = set(filter(None, args.variants.split(",")))
    companion = {d: dispatch.select("linear_logp", torch.device("cuda"), d, backend="triton")
                 for d in ("bfloat16", "float16")}
    report = {"check": [], "time": [], "errors": []}
    impls = []
    for v in spec.variants:
        if v.backend != "cuda" or not dispatch.arch_runs_on(v.arch, cap) or (wanted and v.name not in wanted):
            continue
        t0 = time.perf_counter()
        try:
            k = dispatch.load(v)
        except Exception as e:  # noqa: BLE001
            report["errors"].append(f"{v.name}: {e}")
            print("BUILD FAILED", v.name, e, flush=True)
            continue
        print(f"loaded {v.name} in {time.perf_counter() - t0:.1f}s", flush=True)
        impl = llp.CudaForward(k, companion[v.dtype].module)
        if not args.no_check:
            try:
                check(impl, getattr(torch, v.dtype), report["check"])
            except Exception as e:  # noqa: BLE001
                report["errors"].append(f"{v.name} check: {type(e).__name__}: {e}")
                print("CHECK FAILED", v.name, e, flush=True)
                continue
        if v.dtype == "bfloat16":
            impls.append((v.name, impl))
    impls.append((f"triton {companion['bfloat16'].name}", companion["bfloat16"].module))
    if not args.no_time:
        flags = dict(x.split(":", 1) for x in args.flags.split(",") if x)
        time_shapes(impls, companion["bfloat16"].module, report["time"], args.ablate, args.order, flags,
                    args.clocks, args.launch_hidden)
    with open(os.path.join(out, "llp-cuda.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
