"""Kernel families: kgen's own (the modules of this package) and anyone else's, found by
one code path.

A family is a Python module (or package) that provides the contract in docs/families.md:
`SCHEMA` (a `kgen.spec.Schema`), `TEMPLATES` (backend -> template name), and
`template_context(variant) -> dict`; optionally `TEMPLATE_DIR` (where its templates live;
kgen's `common/` helpers stay includable), `SPECS` (the spec files it ships), `OPS` (its
public functions, for `kgen.ops`), `golden` (for `kgen verify`), `triton_aot` (for `kgen
build`), the tuning hooks (kgen.runtime.tune) and a `kgen.benchmarks`-style `run`.

Where families come from, in this order (a later source never replaces an earlier name):
1. kgen's own: the modules of this package;
2. installed packages: the `kgen.families` entry-point group (`name = "module"`);
3. `kgen.register_family(module)` at run time.
A family that fails to import or misses part of the contract is reported with one
`KgenError` naming it and where it came from, when it is asked for; the other families,
and `import kgen.ops`, are unaffected.
"""

from __future__ import annotations

import functools
import importlib
import logging
import pkgutil
import threading
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from kgen.errors import KgenError

log = logging.getLogger("kgen")
ENTRY_POINT_GROUP = "kgen.families"
REQUIRED = ("SCHEMA", "TEMPLATES", "template_context")

_lock = threading.RLock()
_registered: dict[str, ModuleType] = {}  # kgen.register_family
_loaded: dict[str, ModuleType] = {}
_broken: dict[str, str] = {}  # name -> why (one message, raised on every request)


@functools.cache
def builtin_names() -> tuple[str, ...]:
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


@functools.cache
def _entry_points() -> dict:
    from importlib.metadata import entry_points

    found = {}
    try:
        eps = entry_points(group=ENTRY_POINT_GROUP)
    except Exception as e:  # noqa: BLE001 - broken metadata must not break kgen's own families
        log.warning("kgen: cannot read the %s entry points: %s", ENTRY_POINT_GROUP, e)
        return found
    for ep in eps:
        if ep.name in builtin_names() or ep.name in found:
            log.warning("kgen: ignoring entry point %s = %s: family %r is already defined",
                        ep.name, ep.value, ep.name)
            continue
        found[ep.name] = ep
    return found


def FAMILY_NAMES() -> tuple[str, ...]:  # noqa: N802 - kept from the first layout
    """Every family's name: kgen's own, installed plugins, registered ones (sorted)."""
    return tuple(sorted({*builtin_names(), *_entry_points(), *_registered}))


def origin(family: str) -> str:
    """Where a family comes from, for messages and `kgen list`."""
    if family in builtin_names():
        return f"kgen.families.{family}"
    if family in _entry_points():
        ep = _entry_points()[family]
        return f"entry point {ep.name} = {ep.value}"
    if family in _registered:
        return f"kgen.register_family({_registered[family].__name__})"
    return "nowhere"


# knob names a family's SCHEMA may not use: a spec variant's own keys
_RESERVED_KNOBS = ("backend", "arch", "dtypes", "dtype")


def _check_contract(family: str, mod: ModuleType) -> None:
    missing = [a for a in REQUIRED if not hasattr(mod, a)]
    if missing:
        raise KgenError(f"kernel family {family!r} ({origin(family)}) misses {', '.join(missing)}; "
                        f"docs/families.md lists what a family module provides")
    from kgen import spec

    problem = _schema_problem(mod.SCHEMA, spec)
    if problem:  # (a malformed one used to fail later, inside every spec listing: all families' ops)
        raise KgenError(f"kernel family {family!r} ({origin(family)}): its SCHEMA {problem}; "
                        "docs/families.md describes kgen.spec.Schema")


def _schema_problem(schema, spec) -> str | None:
    """What is wrong with a family module's SCHEMA, or None."""
    if not isinstance(schema, spec.Schema):
        return f"is a {type(schema).__name__}, not a kgen.spec.Schema"
    bad = [d for d in schema.dtypes if d not in spec.DTYPES]
    if not schema.dtypes or bad:
        return f"dtypes {list(schema.dtypes)} must be some of {', '.join(spec.DTYPES)}"
    if not isinstance(schema.knobs, Mapping) or not schema.knobs or any(b not in spec.BACKENDS for b in schema.knobs):
        return f"knobs must map some of the backends {', '.join(spec.BACKENDS)} to their knobs"
    for backend, knobs in schema.knobs.items():
        if not all(isinstance(k, spec.Knob) for k in knobs):
            return f"knobs[{backend!r}] must be kgen.spec.Knob objects"
        clash = [k.name for k in knobs if k.name in _RESERVED_KNOBS]
        if clash:
            return f"knob {clash[0]!r} ({backend}) takes the name of a spec variant's own key"
    return None


def module_of(family: str) -> ModuleType:
    """The family's module, imported on first use. Raises KgenError for an unknown family
    or a broken one (the same message every time)."""
    mod = _loaded.get(family)
    if mod is not None:
        return mod
    with _lock:
        if family in _loaded:
            return _loaded[family]
        if family in _broken:
            raise KgenError(_broken[family])
        if family in builtin_names():
            mod = importlib.import_module(f"{__name__}.{family}")
        elif family in _entry_points() or family in _registered:
            try:
                mod = _registered.get(family) or _entry_points()[family].load()
                _check_contract(family, mod)
            except KgenError as e:
                _broken[family] = str(e)
                raise
            except Exception as e:  # noqa: BLE001 - any failure of a plugin is that plugin's
                _broken[family] = (f"kernel family {family!r} ({origin(family)}) failed to load: "
                                   f"{type(e).__name__}: {e}")
                raise KgenError(_broken[family]) from e
        else:
            raise KgenError(f"unknown kernel family {family!r}; known: {', '.join(FAMILY_NAMES())}")
        _loaded[family] = mod
        _add_templates(mod)
        return mod


def register_family(module: ModuleType | str, name: str | None = None) -> str:
    """Make a family module (or its import name) known at run time; returns its name
    (`name`, else the module's `FAMILY`, else its last name component). Checks the contract
    now, so a mistake is reported where it is made."""
    if isinstance(module, str):
        module = importlib.import_module(module)
    name = name or getattr(module, "FAMILY", None) or module.__name__.rpartition(".")[2]
    with _lock:
        if name in builtin_names() or name in _entry_points():
            raise KgenError(f"kernel family {name!r} already exists ({origin(name)})")
        _registered[name] = module
        _loaded.pop(name, None)
        _broken.pop(name, None)
        try:
            _check_contract(name, module)
        except KgenError:
            del _registered[name]
            raise
    return name


def schema_of(family: str):
    return module_of(family).SCHEMA


def template_dir(mod: ModuleType) -> Path | None:
    """Where a family's templates live: its TEMPLATE_DIR, else `templates/` beside it
    (kgen's own families use kgen/templates, which is always searched)."""
    d = getattr(mod, "TEMPLATE_DIR", None)
    if d is None and not mod.__name__.startswith(__name__ + "."):
        d = Path(mod.__file__).resolve().parent / "templates"
    return Path(d) if d is not None else None


def _add_templates(mod: ModuleType) -> None:
    d = template_dir(mod)
    if d is not None:
        from kgen.render import add_template_dir

        add_template_dir(d)


def shipped_spec_paths(family: str) -> list[Path]:
    """The spec files a family ships: kgen/specs/<family>.yaml for kgen's own; a plugin's
    `SPECS` (paths), else the `specs/*.yaml` beside its module."""
    if family in builtin_names():
        return [Path(__file__).resolve().parent.parent / "specs" / f"{family}.yaml"]
    mod = module_of(family)
    specs = getattr(mod, "SPECS", None)
    if specs is None:
        specs = sorted((Path(mod.__file__).resolve().parent / "specs").glob("*.yaml"))
    return [Path(p) for p in specs]
