"""Loading built entries: a CUDA shared library (called through a small CPython
trampoline), a Triton module by import."""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kgen.errors import CompileError
from kgen.runtime import build, cache, toolchain
from kgen.spec import Variant

log = logging.getLogger("kgen")
_LAUNCHER_SRC = Path(__file__).with_name("launcher.c")


@dataclass
class Kernel:
    """One loaded variant. CUDA: `raw(ptr, *ints_and_floats) -> rc` calls the launcher
    (`fail(rc)` raises for a non-zero code); Triton: `module` holds the kernels."""

    variant: Variant
    entry: cache.Entry
    raw: Any = None
    ptr: int = 0
    module: Any = None
    lib: Any = None  # keeps the shared library loaded

    def __post_init__(self):
        # plain attributes: read on every launch
        self.name, self.backend, self.params = self.variant.name, self.variant.backend, self.variant.params

    def fail(self, rc: int):
        msg = self.lib.kgen_error_string(rc).decode() if self.lib is not None else "?"
        raise RuntimeError(f"{self.variant.qualname}: CUDA error {rc} at launch: {msg}")


def trampoline_toolchain() -> tuple[str | None, str]:
    """(the C compiler's resolved path, the Python headers' directory) that `trampoline`
    builds launcher.c with, or (None, why there is none). The compiler is $CC where set
    (one word: a name on PATH or a path), else cc or gcc."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        return None, f"no Python.h in {include} (this Python's development headers)"
    want = os.environ.get("CC")
    cc = shutil.which(want) if want else (shutil.which("cc") or shutil.which("gcc"))
    if cc is None:
        return None, f"CC={want!r} is not a compiler found on PATH" if want else "no C compiler (cc or gcc) on PATH"
    return str(Path(cc).resolve()), include


@functools.cache
def trampoline():
    """The compiled `launcher.c` module, or None when this Python has no headers or no C
    compiler, or the build fails (then ctypes calls the launcher, at ~3 us more host time per
    call, and replayed Triton launches go through Triton's own launcher)."""
    cc, include = trampoline_toolchain()
    if cc is None:
        log.warning("kgen: %s; CUDA launches go through ctypes (slower)", include)
        return None
    src = _LAUNCHER_SRC.read_text()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    so = "kgen_launcher" + suffix
    command = [cc, "-O2", "-shared", "-fPIC", f"-I{include}", "-o", "{out}", "{src}", "-ldl"]
    key = cache.digest({"kind": "launcher", "source": build.sha(src), "command": " ".join(command),
                        "compiler": toolchain.tool_version(cc), "python": sys.version, "kgen": build.kgen_fingerprint()})

    def make(staging: Path):
        (staging / "launcher.c").write_text(src)
        cmd = [a.replace("{out}", str(staging / so)).replace("{src}", str(staging / "launcher.c")) for a in command]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise CompileError("launcher", " ".join(cmd), r.stdout + r.stderr, str(staging / "launcher.c"))
        return ["launcher.c", so], {"command": " ".join(cmd)}

    try:
        entry = cache.obtain("_runtime", "launcher", key, make)
    except (CompileError, OSError) as e:  # (OSError: the compiler could not be run)
        log.warning("kgen: the launcher trampoline did not compile; using ctypes: %s", e)
        return None
    loader = importlib.machinery.ExtensionFileLoader("kgen_launcher", str(entry.file(so)))
    spec = importlib.util.spec_from_loader("kgen_launcher", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _ctypes_raw(fn):
    fn.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_double)]
    fn.restype = ctypes.c_int

    def raw(_ptr, *args):
        ints = [a for a in args if not isinstance(a, float)]
        floats = [a for a in args if isinstance(a, float)]
        return fn((ctypes.c_longlong * max(1, len(ints)))(*ints), (ctypes.c_double * max(1, len(floats)))(*floats))

    return raw


def load_cuda(variant: Variant, entry: cache.Entry, symbol: str = "kgen_launch") -> Kernel:
    lib = ctypes.CDLL(str(entry.file(build.CUDA_LIB)))
    fn = getattr(lib, symbol)
    lib.kgen_error_string.argtypes, lib.kgen_error_string.restype = [ctypes.c_int], ctypes.c_char_p
    tramp = trampoline()
    raw = tramp.call if tramp is not None else _ctypes_raw(fn)
    return Kernel(variant, entry, raw=raw, ptr=ctypes.cast(fn, ctypes.c_void_p).value, lib=lib)


def load_triton(variant: Variant, entry: cache.Entry) -> Kernel:
    return Kernel(variant, entry, module=build.load_triton_module(entry))
