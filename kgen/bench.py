"""`kgen bench SPEC`: time a family's variants against peers in one run; print a table and
write JSON with the device and versions. The family's cases live in kgen/benchmarks/."""

from __future__ import annotations

import importlib
import json
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
    cols = list(dict.fromkeys(k for r in rows for k in r))
    for c in cols:
        table.add_column(c, justify="left" if c in ("case", "impl", "what") else "right")
    for r in rows:
        table.add_row(*[f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols])
    Console(width=200).print(table)


def bench(spec, json_path: str, quick: bool) -> int:
    import torch

    if not torch.cuda.is_available():
        print("kgen bench: needs a CUDA GPU (timings on a CPU say nothing about the kernels)", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"kgen.benchmarks.{spec.family}")
    env = environment()
    print(json.dumps(env))
    sections = mod.run(spec, quick)
    for title, rows in sections.items():
        print_table(title, rows)
    with open(json_path, "w") as f:
        json.dump({"env": env, "spec": spec.path, "results": sections}, f, indent=1)
    print(f"wrote {json_path}")
    return 0
