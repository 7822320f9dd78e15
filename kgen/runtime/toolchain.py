"""Finding the compilers and binary tools, and naming their versions for cache keys."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from kgen import config
from kgen.errors import KgenError, ToolchainError

_NVCC_HELP = (
    "nvcc (the CUDA compiler) was not found. Install the CUDA toolkit (12.4 or newer) and put "
    "its bin/ on PATH, or set CUDA_HOME or KGEN_NVCC. Triton variants and the PyTorch "
    "reference work without it."
)


# the oldest CUDA the CUDA templates are built and tested with (README; `kgen doctor` says so too)
MIN_NVCC = (12, 4)


def nvcc() -> str:
    path = config.nvcc_path()
    if not path or not shutil.which(path):
        named = os.environ.get("KGEN_NVCC")
        if named:  # (the user named one: say that one is missing, not "set KGEN_NVCC")
            raise ToolchainError(f"KGEN_NVCC={named} names no executable nvcc. Point it at the CUDA toolkit's "
                                 "bin/nvcc (12.4 or newer), or unset it to search PATH and CUDA_HOME.")
        raise ToolchainError(_NVCC_HELP)
    return str(Path(shutil.which(path)).resolve())


def require_release(nvcc_path: str) -> None:
    """ToolchainError where `nvcc_path` is older than MIN_NVCC (its `--version`, memoised):
    its CUDA variants are then skipped with that reason, as without nvcc (they used to be
    built with it, against the README's promise)."""
    release = nvcc_release(tool_version(nvcc_path))
    if release < MIN_NVCC:
        raise ToolchainError(f"{nvcc_path} is CUDA {release[0]}.{release[1]}; kgen's CUDA templates need "
                             f"{MIN_NVCC[0]}.{MIN_NVCC[1]} or newer. Triton variants and the PyTorch reference "
                             "work without it.")


def tool_version(path: str) -> str:
    """A compiler's `--version` for cache keys, remembered across processes.

    A warm cache must not run any compiler, so the answer is memoised in the cache dir,
    keyed by the binary's path, size and mtime (a reinstalled toolkit changes them).
    """
    st = os.stat(path)
    stamp = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    return _memo(stamp, lambda: _run_version(path))


_MEMO_LOCK = threading.Lock()


@functools.cache
def _memo(stamp: str, compute) -> str:
    """compute() for `stamp`, remembered in the cache's toolchain.json. The file is a memo, not
    a requirement: a cache that cannot be written (read-only, full) only costs the recompute.
    Threads take turns (each read-modify-write whole); processes publish by atomic replace of
    a temporary file of their own."""
    from kgen.runtime.cache import root

    with _MEMO_LOCK:
        try:
            memo_file = root() / "toolchain.json"
        except KgenError:  # (no usable cache dir: `kgen doctor` reports that; the value stands)
            return compute()
        try:
            memo = json.loads(memo_file.read_text())
        except (OSError, ValueError):
            memo = {}
        if not isinstance(memo, dict):  # valid JSON of another shape ([], null): as unreadable
            memo = {}
        if not isinstance(memo.get(stamp), str):
            memo[stamp] = compute()
            try:
                fd, tmp = tempfile.mkstemp(dir=memo_file.parent, prefix="toolchain.", suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(memo, indent=1, sort_keys=True))
                os.replace(tmp, memo_file)
            except OSError:
                try:
                    os.unlink(tmp)
                except (OSError, UnboundLocalError):
                    pass
        return memo[stamp]


def _run_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as e:
        raise ToolchainError(f"{path} --version failed: {e}. {_NVCC_HELP}") from None
    lines = [ln for ln in out.splitlines() if "release" in ln or ln.startswith("Build")]
    if lines:  # nvcc: its release and build lines
        return " / ".join(lines)
    first = out.strip().splitlines()[:1]  # other compilers: their first line
    return first[0] if first else path


def nvcc_release(version: str) -> tuple[int, int]:
    m = re.search(r"release (\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def cuobjdump() -> str:
    """cuobjdump from the CUDA toolkit, else the copy Triton's wheel carries."""
    found = shutil.which("cuobjdump")
    if not found:
        nv = config.nvcc_path()
        cand = Path(nv).resolve().parent / "cuobjdump" if nv and shutil.which(nv) else None
        found = str(cand) if cand and cand.is_file() else None
    if not found:
        try:
            import triton

            cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
            found = str(cand) if cand.is_file() else None
        except ImportError:
            pass
    if not found:
        raise ToolchainError("cuobjdump not found: install the CUDA toolkit or `pip install triton`")
    return found


def ninja() -> str:
    found = shutil.which("ninja")
    if not found:
        try:
            import ninja as ninja_pkg

            found = str(Path(ninja_pkg.BIN_DIR) / "ninja")
        except ImportError:
            pass
    if not found:
        raise ToolchainError("ninja not found: `pip install ninja`")
    return found


def resource_usage(binary: Path) -> dict:
    """Registers, shared memory and local memory (spills and stack) of each kernel in a
    cubin or shared library, read with `cuobjdump --dump-resource-usage`."""
    out = subprocess.run([cuobjdump(), "--dump-resource-usage", str(binary)],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise ToolchainError(f"cuobjdump --dump-resource-usage {binary} failed:\n{out.stderr}")
    kernels, name = {}, None
    for line in out.stdout.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line))
            kernels[name] = {"registers": int(fields.get("REG", 0)),
                             "shared": int(fields.get("SHARED", 0)),
                             "local": int(fields.get("LOCAL", 0)),
                             "stack": int(fields.get("STACK", 0))}
            name = None
    return kernels


def sass(binary: Path) -> str:
    out = subprocess.run([cuobjdump(), "--dump-sass", str(binary)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise ToolchainError(f"cuobjdump --dump-sass {binary} failed:\n{out.stderr}")
    return out.stdout
