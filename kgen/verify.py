"""`kgen verify`: golden numerics of every variant this machine can run.

On a machine without a GPU, Triton variants run under the Triton interpreter
(TRITON_INTERPRET=1, set before any generated module is imported) on CPU tensors; CUDA
variants need a GPU of a matching arch and are reported as skipped.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table


def runnable(variant, capability) -> str | None:
    """None when the variant can run here, else why not."""
    from kgen.runtime.dispatch import arch_runs_on

    if variant.backend == "cuda":
        if capability is None:
            return "no GPU"
        if not arch_runs_on(variant.arch, capability):
            return f"{variant.arch} does not run on sm_{capability[0]}{capability[1]}"
    return None


def verify(spec, variants) -> int:
    import torch

    from kgen.families import module_of
    from kgen.errors import KgenError
    from kgen.runtime.dispatch import load, prebuild

    gpu = torch.cuda.is_available()
    if not gpu:
        from kgen.runtime import interpret

        interpret.enable()
    capability = torch.cuda.get_device_capability() if gpu else None
    device = torch.device("cuda" if gpu else "cpu")
    family = module_of(spec.family)
    if getattr(family, "golden", None) is None:  # (optional: docs/families.md)
        print(f"kgen verify: family {spec.family} defines no golden(kernel, device, dtype, tol), so there is "
              "nothing to verify its variants with (docs/families.md)", file=sys.stderr)
        return 1
    table = Table(title=f"kgen verify {spec.path} on {torch.cuda.get_device_name() if gpu else 'CPU (Triton interpreter)'}")
    for col in ("variant", "cases", "worst err/tol", "status"):
        table.add_column(col)
    failures = ran = 0
    failed = prebuild([v for v in variants if not runnable(v, capability)])  # (nvcc in parallel)
    for v in variants:
        why = runnable(v, capability)
        if why:
            table.add_row(v.name, "-", "-", f"skipped: {why}")
            continue
        tol = spec.numerics.get(v.dtype)
        if tol is None:
            table.add_row(v.name, "-", "-", "FAILED: the spec has no numerics for this dtype")
            failures += 1
            continue
        try:
            if v.name in failed:
                raise failed[v.name]
            kernel = load(v)
            results = family.golden(kernel, device, v.dtype, tol)
        except (KgenError, RuntimeError) as e:
            table.add_row(v.name, "-", "-", f"FAILED: {str(e).splitlines()[0]}")
            failures += 1
            continue
        ran += 1
        worst_label, worst = max(results, key=lambda r: r[1])
        ok = worst <= 1.0
        failures += not ok
        table.add_row(v.name, str(len(results)), f"{worst:.3g}",
                      "ok" if ok else f"FAILED ({worst_label})")
    Console().print(table)
    print(f"{ran} variants verified, {failures} failed")
    if not ran and not failures:
        print("nothing could run here (every variant skipped: the table says why), so nothing is verified")
    return 1 if failures or not ran else 0
