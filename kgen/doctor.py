"""`kgen doctor`: what this machine can do with kgen, on one screen.

It reports versions, the CUDA compiler, the GPU, how eager calls launch (the C trampoline or
ctypes), which variants of each shipped spec can run here and the state of the cache, and exits non-zero when the cache is not writable or
something named with `--require` cannot work.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import kgen
from kgen import config
from kgen.runtime import toolchain

# What `--require` can ask for, and what "missing" means for each.
REQUIREMENTS = {
    "gpu": "a CUDA GPU visible to torch",
    "nvcc": "nvcc 12.4 or newer, to build CUDA variants",
    "cuda": "a CUDA variant of a shipped spec that builds and runs here (nvcc and a GPU of its arch)",
    "triton": "Triton and a GPU to run its compiled kernels on (the CPU interpreter does not count)",
}
MIN_NVCC = toolchain.MIN_NVCC


def _version(module: str) -> str | None:
    """The module's version, or None when it does not import."""
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - a broken install is "not usable", whatever it raises
        return None


def _nvcc() -> tuple[str, bool]:
    """(what to print, whether kgen can build with it)."""
    from kgen.errors import ToolchainError
    from kgen.runtime import toolchain

    try:
        path = toolchain.nvcc()
    except ToolchainError:
        named = config.nvcc_path()
        where = f" at {named}" if named else " (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, $KGEN_NVCC)"
        return f"not found{where}: CUDA variants cannot be built", False
    try:  # not toolchain.tool_version: that one memoises into the cache dir, which may be broken
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{path}: `--version` failed ({e})", False
    release = toolchain.nvcc_release(out)
    if release < MIN_NVCC:
        return f"{path}, release {release[0]}.{release[1]}: too old, kgen needs 12.4+", False
    return f"{path}, release {release[0]}.{release[1]}", True


def _gpu() -> tuple[tuple[int, int] | None, str]:
    """(compute capability of the current GPU or None, what to print)."""
    import torch

    try:
        if not torch.cuda.is_available():
            why = "torch is a CPU build" if torch.version.cuda is None else "torch.cuda.is_available() is False"
            return None, f"none ({why})"
        index = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(index)
    except Exception as e:  # noqa: BLE001 - a driver or init failure is "no GPU", with its reason
        return None, f"none ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
    count = torch.cuda.device_count()
    more = f" (device {index} of {count})" if count > 1 else ""
    return (p.major, p.minor), f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs{more}"


def _launcher() -> str:
    """How eager calls reach the GPU: launcher.c's trampoline where this Python can build it
    (nothing is built here: that happens on first use, into the cache), else ctypes."""
    from kgen.runtime import loader

    cc, why = loader.trampoline_toolchain()
    if cc is None:
        return (f"ctypes: {why} (~3 us more host time a CUDA launch; replayed Triton launches go "
                "through Triton's own launcher)")
    return f"C trampoline (built on first use with {cc})"


def _cache() -> tuple[str, bool]:
    """(what to print, whether the cache dir is writable). Creates it 0700 if absent, as a
    build would (kgen.runtime.cache.root)."""
    from kgen.runtime import cache

    d = config.cache_dir()
    try:
        cache.root()
        with tempfile.NamedTemporaryFile(dir=d, prefix=".doctor-"):
            pass
    except OSError as e:
        return f"{d}: NOT WRITABLE ({e.strerror or e}); set KGEN_CACHE_DIR to a writable directory", False
    except cache.CacheDirError as e:  # (not a directory, or not creatable)
        return f"{d}: NOT WRITABLE ({e.why}); set KGEN_CACHE_DIR to a writable directory", False
    i = cache.info()
    return f"{d}: {i['entries']} entries, {i['bytes'] / 2**20:.1f} MiB, writable", True


def _spec_rows(specs, capability: tuple[int, int] | None, nvcc_ok: bool, triton_ok: bool) -> tuple[list, int]:
    """One row per spec and backend: (family, backend, runnable of total, why), and the
    number of CUDA variants that run here."""
    from kgen import spec as spec_mod
    from kgen.runtime.dispatch import arch_runs_on

    rows, cuda_runs = [], 0
    for path in specs:
        s = spec_mod.load(path)
        cuda = [v for v in s.variants if v.backend == "cuda"]
        triton = [v for v in s.variants if v.backend == "triton"]
        if cuda:
            fits = [v for v in cuda if capability and arch_runs_on(v.arch, capability)]
            n = len(fits) if nvcc_ok else 0
            if capability is None:
                why = "no GPU to run them" + (" (nvcc builds them: `kgen build`)" if nvcc_ok else ", no nvcc to build them")
            elif not nvcc_ok:
                why = "no usable nvcc to build them"
            else:
                here = f"sm_{capability[0]}{capability[1]}"
                archs = ", ".join(sorted({v.arch for v in fits}))
                why = f"built for {archs}, which run on {here}" if fits else f"no variant's arch runs on {here}"
            cuda_runs += n
            rows.append((s.family, "cuda", f"{n} of {len(cuda)}", why))
        if triton:
            if not triton_ok:
                n, why = 0, "Triton does not import"
            elif capability is None:
                n, why = len(triton), "Triton interpreter (`kgen verify`, tests); ops on CPU tensors use the reference"
            else:
                n, why = len(triton), "compiled for this GPU"
            rows.append((s.family, "triton", f"{n} of {len(triton)}", why))
        rows.append((s.family, "reference", "yes", "PyTorch, any device"))
    return rows, cuda_runs


def doctor(specs, require: list[str], console) -> int:
    """Print the report for `specs` (paths); 1 when a requirement or the cache fails."""
    import torch
    from rich.markup import escape
    from rich.table import Table

    triton, numpy = _version("triton"), _version("numpy")
    capability, gpu = _gpu()
    nvcc, nvcc_ok = _nvcc()
    cache, cache_ok = _cache()
    launcher = _launcher()
    env = [f"{k}={v}" for k, v in sorted(os.environ.items())
           if k.startswith("KGEN_") or k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")]

    facts = [("kgen", f"{kgen.__version__} ({Path(kgen.__file__).parent})"),
             ("Python", f"{sys.version.split()[0]} ({sys.executable})"),
             ("torch", f"{torch.__version__}, built with CUDA {torch.version.cuda or '- (CPU build)'}"),
             ("Triton", triton or "NOT INSTALLED (`pip install triton`)"),
             ("numpy", numpy or "not installed: the Triton interpreter (CPU) needs it"),
             ("nvcc", nvcc), ("GPU", gpu), ("launcher", launcher), ("cache", cache)] + ([("environment", " ".join(env))] if env else [])
    grid = Table.grid(padding=(0, 2))
    for name, value in facts:
        grid.add_row(name, escape(value))  # paths and variables are text, not rich markup
    console.print(grid)

    rows, cuda_runs = _spec_rows(specs, capability, nvcc_ok, triton is not None)
    table = Table(title="shipped specs: variants that can run here")
    for col in ("family", "backend", "runnable", "why"):
        table.add_column(col)
    for row in rows:
        table.add_row(*map(escape, row))
    console.print(table)

    have = {"gpu": capability is not None, "nvcc": nvcc_ok, "cuda": cuda_runs > 0,
            "triton": triton is not None and capability is not None}
    problems = [f"--require {r}: missing {REQUIREMENTS[r]}" for r in require if not have[r]]
    if not cache_ok:
        problems.append(f"the cache dir {config.cache_dir()} is not writable: nothing can be built")
    from kgen.runtime import dispatch

    problems += [f"user spec {path} is skipped: {err}" for path, err in dispatch.broken_user_specs()]
    problems += dispatch.env_problems()
    for p in problems:
        console.print(f"[bold red]problem:[/] {escape(p)}")
    if not problems:
        console.print("ok" + (f" (required: {', '.join(require)})" if require else ""))
    return 1 if problems else 0
