"""Building variants into cache entries: nvcc driven by ninja for CUDA, Triton ahead of time.

`build(variants)` returns one `BuildResult` per variant; nothing is compiled when every
entry is already in the cache (not even `nvcc --version`: its answer is memoised).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import kgen
from kgen import config
from kgen.errors import CompileError, KgenError, ToolchainError
from kgen.render import render
from kgen.runtime import cache, interpret, toolchain
from kgen.spec import Variant

CUDA_SOURCE, CUDA_LIB, BUILD_LOG = "kernel.cu", "lib.so", "build.log"
TRITON_SOURCE = "kernel.py"
DEFAULT_TRITON_ARCH = "sm_90"


@dataclass
class BuildResult:
    variant: Variant
    status: str  # "built" | "cached" | "failed" | "skipped" (no toolchain)
    entry: cache.Entry | None = None
    seconds: float = 0.0
    error: KgenError | None = None
    target: str | None = None
    resources: dict = field(default_factory=dict)  # kernel -> {registers, shared, local, stack}

    def summary(self) -> dict:
        """Worst case over the entry's kernels: max registers, shared memory and per-thread
        stack (a large stack is local memory too: arrays the compiler could not keep in
        registers, read and written with LDL/STL like spills), total spill (local) bytes."""
        res = self.resources or (self.entry.manifest.get("resources", {}) if self.entry else {})
        if not res:
            return {}
        return {"registers": max(r["registers"] for r in res.values()),
                "shared": max(r["shared"] for r in res.values()),
                "spill": sum(r["local"] for r in res.values()),
                "stack": max(r.get("stack", 0) for r in res.values())}


@functools.cache
def kgen_fingerprint() -> str:
    """kgen's version plus the code that shapes artifacts beyond the rendered text."""
    h = hashlib.sha256(kgen.__version__.encode())
    for mod in ("build.py", "toolchain.py"):
        h.update((Path(__file__).parent / mod).read_bytes())
    return h.hexdigest()


def _aot_fingerprint(family: str) -> str:
    """The source of the file holding the family's `triton_aot`: the signatures, constants
    and compile options (num_warps, num_stages) of an ahead-of-time build come from there,
    not from the rendered text, so a change there must not be served from the cache."""
    from kgen.families import module_of

    hook = getattr(module_of(family), "triton_aot", None)  # (optional: build_triton skips without it)
    path = inspect.getsourcefile(hook) if hook is not None else None
    return sha(Path(path).read_text()) if path else ""


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def gencode(arch: str) -> str:
    num = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def cuda_command(nvcc: str, arch: str, src: str, out: str) -> list[str]:
    # Static cudart (nvcc's default): the .so needs no CUDA library on the loader path and
    # shares the driver's primary context with PyTorch.
    return [nvcc, "-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC", gencode(arch),
            *config.extra_nvcc_flags(), "-o", out, src]


def cuda_key(variant: Variant, text: str, nvcc: str) -> str:
    return cache.digest({
        "kind": "cuda-so", "source": sha(text),
        "command": shlex.join(cuda_command(nvcc, variant.arch, "{src}", "{out}")),
        "compiler": toolchain.tool_version(nvcc), "kgen": kgen_fingerprint(),
        "env": config.code_env("cuda"),
    })


def _ninja_escape_path(p: Path) -> str:
    return str(p).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


@contextlib.contextmanager
def _locked(paths: list[Path]):
    """Hold the locks of several entries, taken in sorted order so builders never deadlock."""
    with contextlib.ExitStack() as stack:
        for p in sorted(set(paths)):  # (a variant named twice: one lock, not a self-deadlock)
            stack.enter_context(cache.lock(p))
        yield


def build_cuda(variants: list[Variant], on_progress: Callable[[str], None] | None = None) -> list[BuildResult]:
    nvcc = toolchain.nvcc()
    toolchain.require_release(nvcc)
    results: dict[str, BuildResult] = {}
    todo = []
    for v in variants:
        text = render(v).text
        path = cache.entry_path(v.family, v.name, cuda_key(v, text, nvcc))
        entry = cache.lookup(path)
        if entry:
            results[v.name] = BuildResult(v, "cached", entry, target=v.arch)
        else:
            todo.append((v, text, path))
    if todo:
        with _locked([p for _, _, p in todo]):
            pending = []
            for v, text, path in todo:
                entry = cache.lookup(path)  # a racing builder may have published it meanwhile
                if entry:
                    results[v.name] = BuildResult(v, "cached", entry, target=v.arch)
                else:
                    pending.append((v, text, path))
            for r in _ninja_build(nvcc, pending, on_progress):
                results[r.variant.name] = r
    return [results[v.name] for v in variants]


def _ninja_build(nvcc: str, pending, on_progress) -> list[BuildResult]:
    if not pending:
        return []
    jobs = []
    lines = ["rule nvcc", "  command = $cmd > $log 2>&1", "  description = $name", ""]
    for v, text, path in pending:
        staging = cache.new_staging(v.name)
        src, out, log = staging / CUDA_SOURCE, staging / CUDA_LIB, staging / BUILD_LOG
        src.write_text(text)
        cmd = cuda_command(nvcc, v.arch, str(src), str(out))
        jobs.append((v, path, staging, cmd))
        lines += [f"build {_ninja_escape_path(out)}: nvcc {_ninja_escape_path(src)}",
                  f"  cmd = {shlex.join(cmd).replace('$', '$$')}",
                  f"  log = {shlex.quote(str(log)).replace('$', '$$')}",
                  f"  name = {v.name}", ""]
    with tempfile.TemporaryDirectory(prefix="ninja-", dir=cache.root() / ".staging") as nd:
        (Path(nd) / "build.ninja").write_text("\n".join(lines))
        t0 = time.perf_counter()
        proc = subprocess.Popen([toolchain.ninja(), "-C", nd, "-k", "0", "-j", str(config.build_jobs())],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            m = re.match(r"\[(\d+)/(\d+)\] (.*)", line.strip())
            if m and on_progress:
                on_progress(m.group(3))
        proc.wait()
        wall = time.perf_counter() - t0
        per_target = _ninja_times(Path(nd) / ".ninja_log")
    results = []
    for v, path, staging, cmd in jobs:
        out, log = staging / CUDA_LIB, staging / BUILD_LOG
        log_text = log.read_text(errors="replace") if log.exists() else ""
        seconds = per_target.get(str(out), wall)
        if not out.exists():
            err = CompileError(v.qualname, shlex.join(cmd), log_text or "(no output)",
                               str(staging / CUDA_SOURCE))
            results.append(BuildResult(v, "failed", seconds=seconds, error=err, target=v.arch))
            continue  # the staging dir stays for inspection; the error names its source
        resources = toolchain.resource_usage(out)
        facts = {"variant": v.qualname, "command": shlex.join(cmd), "seconds": round(seconds, 3),
                 "resources": resources, "target": v.arch}
        entry = cache.publish(staging, path, [CUDA_SOURCE, CUDA_LIB, BUILD_LOG], facts)
        results.append(BuildResult(v, "built", entry, seconds, resources=resources, target=v.arch))
    return results


def _ninja_times(log: Path) -> dict[str, float]:
    times = {}
    try:
        for line in log.read_text().splitlines()[1:]:
            start, end, _, output, *_ = line.split("\t")
            times[output] = (int(end) - int(start)) / 1000
    except (OSError, ValueError):
        pass
    return times


# --------------------------------------------------------------------------- Triton


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # triton.jit resolves globals through the module
    spec.loader.exec_module(mod)
    return mod


def triton_source_entry(variant: Variant) -> cache.Entry:
    """The rendered Triton module as a cache entry (no compile: Triton JITs at first call)."""
    text = render(variant).text
    key = cache.digest({"kind": "triton-src", "source": sha(text), "kgen": kgen_fingerprint()})

    def make(staging: Path):
        (staging / TRITON_SOURCE).write_text(text)
        return [TRITON_SOURCE], {"variant": variant.qualname}

    return cache.obtain(variant.family, variant.name, key, make)


def load_triton_module(entry: cache.Entry):
    config.pin_triton_defaults()
    if interpret.active():  # TRITON_INTERPRET=1 set by hand: the interpreter's bf16 fixes too (idempotent)
        interpret.enable()
    name = f"kgen_generated.{entry.path.parent.name}.{entry.path.name.replace('-', '_')}"
    return sys.modules.get(name) or _import_file(entry.file(TRITON_SOURCE), name)


def _divisibility(fn, sig: dict, divisible=()) -> dict:
    """What Triton's JIT would know at a typical call: it specializes a pointer, and an
    integer argument whose value is a multiple of 16, as divisible by 16, and vector loads
    and the pipelined (cp.async) path depend on it — without it an int8 GEMM tile compiled
    with 255 registers and a stack, with it 161 and none (Triton 3.9, sm_90). So an ahead-of-
    time build assumes every pointer aligned (PyTorch's allocations are) and the integers a
    family's `triton_aot` names as a fifth item (sizes and strides that are multiples of 16
    in the calls it is built for)."""
    names = [n for n, t in sig.items() if t.startswith("*") or n in divisible]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def build_triton(variant: Variant, arch: str) -> BuildResult:
    """Compile a Triton variant ahead of time for `arch` (no GPU needed)."""
    config.pin_triton_defaults()
    rendered = render(variant)
    cc = int(arch.removeprefix("sm_").rstrip("a"))
    # The version from the package metadata: importing Triton is left to the compile below.
    key = cache.digest({"kind": "triton-aot", "source": sha(rendered.text),
                        "triton": importlib.metadata.version("triton"), "target": f"cuda:{cc}:32",
                        "kgen": kgen_fingerprint(), "env": config.code_env("triton"),
                        "aot": _aot_fingerprint(variant.family)})
    name = f"{variant.name}-{arch.replace('_', '')}"
    entry = cache.lookup(cache.entry_path(variant.family, name, key))
    if entry:
        return BuildResult(variant, "cached", entry, target=arch)
    from kgen.families import module_of

    if getattr(module_of(variant.family), "triton_aot", None) is None:
        err = ToolchainError(f"family {variant.family} defines no triton_aot (optional: docs/families.md), so "
                             "there is nothing to compile ahead of time; its Triton kernels compile at their first "
                             "call")
        return BuildResult(variant, "skipped", error=err, target=arch)
    if interpret.active():  # and before importing Triton: see kgen/runtime/interpret.py
        err = ToolchainError("Triton ahead-of-time builds need a process without TRITON_INTERPRET=1 "
                             "(see kgen/runtime/interpret.py); run `kgen build` on its own")
        return BuildResult(variant, "skipped", error=err, target=arch)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    made = []  # make() runs only when no racing builder published the entry first

    def make(staging: Path):
        made.append(True)
        src = staging / TRITON_SOURCE
        src.write_text(rendered.text)
        files, resources = [TRITON_SOURCE], {}
        try:
            mod = _import_file(src, f"kgen_aot_{staging.name.replace('-', '_')}")
            seen: dict[str, int] = {}  # a kernel compiled in two forms: the second is <name>.1
            for fn, sig, consts, opts, *divisible in module_of(variant.family).triton_aot(variant, mod):
                # (Triton print()s the whole PTX when ptxas fails: ~3,500 lines on `kgen build`'s
                # stdout before its table; the error itself names the cause)
                with contextlib.redirect_stdout(io.StringIO()):
                    compiled = triton.compile(ASTSource(fn, sig, consts, _divisibility(fn, sig, *divisible)),
                                              target=GPUTarget("cuda", cc, 32), options=opts)
                n = seen[fn.__name__] = seen.get(fn.__name__, -1) + 1
                tag = f"{fn.__name__}.{n}" if n else fn.__name__
                cubin = f"{tag}.cubin"
                (staging / cubin).write_bytes(compiled.asm["cubin"])
                files.append(cubin)
                usage = {f"{k}.{n}" if n else k: v for k, v in toolchain.resource_usage(staging / cubin).items()}
                for k in usage.values():  # Triton's shared memory is dynamic: cuobjdump shows none
                    k["shared"] = max(k["shared"], int(compiled.metadata.shared))
                resources.update(usage)
        except Exception as e:  # noqa: BLE001 - Triton raises many types; all mean "did not compile"
            raise CompileError(variant.qualname, f"triton.compile(target=cuda:{cc})",
                               f"{type(e).__name__}: {e}",
                               f"{rendered.filename} (as `kgen build` renders it under --out, default generated/)") from e
        return files, {"variant": variant.qualname, "seconds": round(time.perf_counter() - t0, 3),
                       "resources": resources, "target": arch, "triton": triton.__version__}

    try:
        entry = cache.obtain(variant.family, name, key, make)
    except CompileError as err:
        return BuildResult(variant, "failed", seconds=time.perf_counter() - t0, error=err, target=arch)
    return BuildResult(variant, "built" if made else "cached", entry, time.perf_counter() - t0,
                       resources=entry.manifest["resources"], target=arch)


def build(variants: list[Variant], triton_arch: str = DEFAULT_TRITON_ARCH,
          on_progress: Callable[[str], None] | None = None) -> list[BuildResult]:
    """Build every variant; CUDA ones in parallel through ninja. Never raises CompileError:
    a failure is a result with status "failed" and the error attached."""
    cuda = [v for v in variants if v.backend == "cuda"]
    try:
        results = {r.variant.name: r for r in build_cuda(cuda, on_progress)} if cuda else {}
    except ToolchainError as e:  # no nvcc: build what this machine can, say why not the rest
        results = {v.name: BuildResult(v, "skipped", error=e, target=v.arch) for v in cuda}
    for v in variants:
        if v.backend == "triton":
            if on_progress:
                on_progress(v.name)
            results[v.name] = build_triton(v, triton_arch)
    return [results[v.name] for v in variants]
