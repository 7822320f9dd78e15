"""Loading built entries: a CUDA shared library through ctypes, a Triton module by import."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from kgen.runtime import build, cache
from kgen.spec import Variant

_CTYPES = {"int": ctypes.c_int, "float": ctypes.c_float, "i64": ctypes.c_longlong, "ptr": ctypes.c_void_p}


@dataclass
class Kernel:
    """One loaded variant: `call(...)` for CUDA (the C launcher), `module` for Triton."""

    variant: Variant
    entry: cache.Entry
    call: Any = None
    module: Any = None

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def backend(self) -> str:
        return self.variant.backend

    @property
    def params(self) -> dict:
        return self.variant.params


def load_cuda(variant: Variant, entry: cache.Entry, signature: tuple[str, tuple[str, ...]]) -> Kernel:
    lib = ctypes.CDLL(str(entry.file(build.CUDA_LIB)))
    name, argtypes = signature
    fn = getattr(lib, name)
    fn.argtypes = [_CTYPES[a] for a in argtypes]
    fn.restype = ctypes.c_int
    errstr = lib.kgen_error_string
    errstr.argtypes, errstr.restype = [ctypes.c_int], ctypes.c_char_p
    qual = variant.qualname

    def call(*args):
        rc = fn(*args)
        if rc:
            raise RuntimeError(f"{qual}: CUDA error {rc} at launch: {errstr(rc).decode()}")

    return Kernel(variant, entry, call=call)


def load_triton(variant: Variant, entry: cache.Entry) -> Kernel:
    return Kernel(variant, entry, module=build.load_triton_module(entry))
