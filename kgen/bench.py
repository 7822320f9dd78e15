"""`kgen bench SPEC`: time a family's variants against peers in one run; print a table and
write JSON with the device and versions. The family's cases live in kgen/benchmarks/."""

from __future__ import annotations

import importlib
import json
import os
import platform
import shlex
import subprocess
import sys

from rich.console import Console
from rich.table import Table


def environment() -> dict:
    import torch
    import triton

    from kgen.runtime import toolchain

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "command": "kgen " + shlex.join(sys.argv[1:])}
    try:
        env["nvcc"] = toolchain.tool_version(toolchain.nvcc())
    except Exception as e:  # noqa: BLE001 - a bench without nvcc still times Triton and peers
        env["nvcc"] = f"unavailable: {e}"
    from kgen.runtime import loader

    env["launcher"] = "trampoline" if loader.trampoline() is not None else "ctypes"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except OSError:
            pass
    return env


def print_table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    table = Table(title=title)
    cols = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, dict)))
    for c in cols:
        table.add_column(c, justify="left" if c in ("case", "impl", "what") else "right")
    for r in rows:
        table.add_row(*[f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols])
    Console(width=None if "COLUMNS" in os.environ else 200).print(table)  # COLUMNS: a wider table


def dispatch_effect(family: str, cases, peers=None, quick: bool = False) -> list[dict]:
    """What the tuning table does, per (dtype, shape) case: the variant spec order picks
    ("before"), the table's pick ("after", and why), and the fastest candidate measured here,
    each timed by the tuner's own method (`timing.cuda_timer`: the larger of the GPU time
    and the host's launch time, so host cost counts where it bounds) in interleaved rounds, minimum per candidate. `peers(dtype,
    inputs) -> {name: fn}` adds non-candidates (torch.compile, a GEMM) to the same rounds."""
    import torch

    from kgen.families import module_of
    from kgen.runtime import dispatch, timing, tune, tuning_table

    fam = module_of(family)
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for dtype, shape in cases:
        shape = tune.with_extras(fam, dtype, shape)
        inputs = fam.tune_inputs(dev, dtype, **shape)
        # the shape too: a variant built for some shapes only (fused_mlp's exact widths) is
        # not spec order's choice for others
        before = dispatch.select(family, dev, dtype, shape=shape)
        after, why = dispatch.choose(family, dev, dtype, fam.tune_bucket(**shape), shape)
        fns, _ = tune.candidate_runners(fam, dispatch.runnable(family, dtype, dev), inputs)
        extra = peers(dtype, inputs) if peers else {}
        best = {n: float("inf") for n in (*fns, *extra)}
        gpu = {n: float("inf") for n in fns}  # the GPU part of each candidate's time alone
        for _ in range(2 if quick else 3):
            for n, fn in (*fns.items(), *extra.items()):
                t = timing.cuda_timer(fn, 500 if quick else 3000)
                best[n] = min(best[n], t)
                if n in gpu:
                    gpu[n] = min(gpu[n], t.gpu)
        name = lambda k: k.name if k is not None else tuning_table.REFERENCE  # noqa: E731
        fastest = min(fns, key=best.get)
        a = name(after)
        # The fastest of ~16 noisy times is biased low (the winner's curse, tune.confirm):
        # where it is not dispatch's choice, the two are re-timed against each other,
        # alternating, and the ratio is taken from that paired measurement.
        paired = {}
        if fastest != a:
            _, paired, _ = tune.confirm({a: best[a], fastest: best[fastest]}, fastest, fns, timing.cuda_timer,
                                        500 if quick else 3000)
        t_after, t_fastest = (paired[a], paired[fastest]) if paired else (best[a], best[fastest])
        row = {"case": f"{dtype} " + "x".join(str(shape[d]) for d in fam.TUNE_DIMS)
               + "".join(f" {k}={int(v) if isinstance(v, bool) else v}" for k, v in shape.items()
                         if k not in fam.TUNE_DIMS),
               "before": name(before), "before us": best.get(name(before), float("nan")),
               "after": a, "why": why, "after us": t_after,
               "fastest": fastest, "fastest us": t_fastest,
               "after / fastest": min(1.0, t_fastest / t_after),
               "after / fastest (screening)": best[fastest] / best[a],
               # the kernels alone: where host time bounds every candidate, this says whether
               # dispatch chose a fast kernel, which the totals (noise of the host) cannot
               "gpu: after / least": min(gpu.values()) / gpu[a],
               "candidates us": {n: round(best[n], 2) for n in fns}}
        for n in extra:
            row[f"{n} us"] = best[n]
            row[f"after vs {n}"] = best[n] / best[a]
        rows.append(row)
        print(row, flush=True)
        del inputs, fns, extra
        torch.cuda.empty_cache()
    return rows


def benchmark_module(family: str):
    """kgen's own families: kgen.benchmarks.<family>; any family: the module its family
    module names in BENCHMARK (with `run(spec, quick) -> {title: rows}`)."""
    from kgen.families import builtin_names, module_of

    if family in builtin_names():
        return importlib.import_module(f"kgen.benchmarks.{family}")
    name = getattr(module_of(family), "BENCHMARK", None)
    return importlib.import_module(name) if name else None


def bench(spec, json_path: str, quick: bool, only_dispatch: bool = False) -> int:
    import torch

    if not torch.cuda.is_available():
        print("kgen bench: needs a CUDA GPU (timings on a CPU say nothing about the kernels)", file=sys.stderr)
        return 2
    mod = benchmark_module(spec.family)
    if mod is None:
        print(f"kgen bench: family {spec.family} has no benchmark (a BENCHMARK module name in its "
              "family module; docs/families.md)", file=sys.stderr)
        return 2
    env = environment()
    print(json.dumps(env))
    if only_dispatch and not hasattr(mod, "dispatch_section"):
        from kgen.families import module_of

        fam = module_of(spec.family)
        cases = [(d, s) for d in spec.dtypes for s in getattr(fam, "TUNE_SHAPES", ())]
        sections = {"dispatch: spec order (before) vs tuning table (after)": dispatch_effect(spec.family, cases)}
    else:
        sections = mod.dispatch_section(spec, quick) if only_dispatch else mod.run(spec, quick)
    for title, rows in sections.items():
        print_table(title, rows)
    with open(json_path, "w") as f:
        json.dump({"env": env, "spec": spec.path, "results": sections}, f, indent=1)
    print(f"wrote {json_path}")
    return 0
