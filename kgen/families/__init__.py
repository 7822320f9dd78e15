"""Kernel families: one module each, found by name (adding one edits nothing here).

A family module provides `SCHEMA` (a `kgen.spec.Schema`), `TEMPLATES` (backend -> template
path under kgen/templates), `template_context(variant) -> dict`, its reference math, input
checks, grid sizes, autograd and the public op.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType


@functools.cache
def FAMILY_NAMES() -> tuple[str, ...]:
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def module_of(family: str) -> ModuleType:
    if family not in FAMILY_NAMES():
        raise KeyError(f"unknown kernel family {family!r}; known: {', '.join(FAMILY_NAMES())}")
    return importlib.import_module(f"{__name__}.{family}")


def schema_of(family: str):
    return module_of(family).SCHEMA
