"""Spec loading: YAML text -> validated, frozen dataclasses -> expanded variants.

Every error is a `SpecError` naming the file, the line and the key; nothing downstream
reads raw dicts. A family declares its knobs (`Knob`) in its module's `SCHEMA`; this
module knows nothing about any one family.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from kgen.errors import SpecError

# dtype name -> (bytes per element, short name used in variant names)
DTYPES: Mapping[str, tuple[int, str]] = {
    "float32": (4, "f32"),
    "bfloat16": (2, "bf16"),
    "float16": (2, "f16"),
    "int8": (1, "i8"),  # int8_gemm: the operand type of its int8 x int8 kernels
}
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
BACKENDS = ("cuda", "triton")
_SPEC_KEYS = ("family", "description", "dtypes", "variants", "numerics")
_VARIANT_KEYS = ("backend", "arch", "dtypes")
_IDENT = re.compile(r"^[a-z][a-z0-9_]*$")


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class Knob:
    """One tunable parameter of a family's backend: its type, range and name fragment."""

    name: str
    abbr: str  # fragment in the variant name: f"{abbr}{value}"
    kind: type = int
    choices: tuple | None = None
    lo: int | None = None
    hi: int | None = None
    pow2: bool = False
    default: Any = None  # None: required

    def check(self, value: Any) -> str | None:
        if self.kind is tuple:  # a list of integers that is one value (e.g. fused_mlp's widths)
            if not isinstance(value, tuple) or not value:
                return f"expected a non-empty list of integers, got {value!r}"
            for x in value:
                problem = Knob(self.name, self.abbr, lo=self.lo, hi=self.hi, pow2=self.pow2).check(x)
                if problem:
                    return problem
            return None
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            return f"expected an integer, got {_yaml_kind(value)} {value!r}"
        if self.kind is bool and not isinstance(value, bool):
            return f"expected true or false, got {value!r}"
        if self.kind is str and not isinstance(value, str):
            return f"expected a string, got {_yaml_kind(value)} {value!r}"
        if self.choices is not None and value not in self.choices:
            return f"{value!r} is not one of {', '.join(map(str, self.choices))}"
        if self.lo is not None and value < self.lo:
            return f"{value} is below the minimum {self.lo}"
        if self.hi is not None and value > self.hi:
            return f"{value} is above the maximum {self.hi}"
        if self.pow2 and (value <= 0 or value & (value - 1)):
            return f"{value} is not a power of two"
        return None


@dataclass(frozen=True)
class Schema:
    """What a family accepts: its dtypes, its knobs per backend, and a cross-knob check.

    `check(backend, arch, dtype, knobs) -> [(key, message)]` returns the violations that
    involve several knobs at once (e.g. vector width x dtype size > 16 bytes).
    """

    dtypes: tuple[str, ...]
    knobs: Mapping[str, tuple[Knob, ...]]  # backend -> knobs, in name order
    check: Callable[[str, str | None, str, Mapping[str, Any]], list[tuple[str, str]]] = (
        lambda backend, arch, dtype, knobs: []
    )
    archs: tuple[str, ...] = ARCHS


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Variant:
    family: str
    backend: str
    arch: str | None  # None for Triton: its target is chosen at build time
    dtype: str
    knobs: tuple[tuple[str, Any], ...]
    spec_path: str
    line: int
    name: str = field(init=False)

    def __post_init__(self):
        parts = [self.backend if self.arch is None else self.arch.replace("_", "")]
        parts += [f"{abbr}{_fmt(v)}" for abbr, v in self._named_knobs()]
        parts.append(DTYPES[self.dtype][1])
        object.__setattr__(self, "name", "_".join(parts))

    def _named_knobs(self):
        from kgen.families import schema_of

        by_name = {k.name: k for k in schema_of(self.family).knobs[self.backend]}
        # A knob at its default stays out of the name, so adding a knob renames nothing.
        return [(by_name[k].abbr, v) for k, v in self.knobs if v != by_name[k].default]

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.knobs)

    @property
    def qualname(self) -> str:
        return f"{self.family}/{self.name}"


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


@dataclass(frozen=True)
class Spec:
    path: str
    family: str
    description: str
    dtypes: tuple[str, ...]
    variants: tuple[Variant, ...]
    numerics: Mapping[str, Tolerance]

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"{self.path} has no variant {name!r}; `kgen list {self.path}` lists them")


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, tuple):
        return "x".join(map(_fmt, v))
    return str(v)


# --------------------------------------------------------------------------- YAML with lines


_SCALARS = yaml.constructor.SafeConstructor()


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5` as a float: YAML 1.1 wants `1.0e-5`, and a
    tolerance silently read as the string '1e-05' would be a confusing error."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _yaml_kind(value: Any) -> str:
    """What a YAML value is, in YAML's words (not the parser's classes: _LList, _LDict)."""
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                    (list, "a list"), (dict, "a mapping")):
        if isinstance(value, t):
            return name
    return "null" if value is None else type(value).__name__


class _LDict(dict):
    """A mapping that remembers the line of each key (1-based)."""

    line: int
    lines: dict


class _LList(list):
    line: int
    lines: list


def _construct(node: yaml.Node, path: str, inside: frozenset = frozenset()) -> Any:
    """`inside`: the ids of the collections being built around `node`. An alias resolves to
    its anchor's node itself, so `variants: &a [*a]` is a node inside itself: without the
    check it would recurse until Python gives up."""
    line = node.start_mark.line + 1
    if id(node) in inside:
        raise SpecError(path, line, "<yaml>", "an alias (*name) refers to a list or mapping that "
                        "contains it (its &anchor starts here); a spec cannot contain itself")
    if isinstance(node, yaml.MappingNode):
        inside = inside | {id(node)}
        out = _LDict()
        out.line, out.lines = line, {}
        for knode, vnode in node.value:
            key = _construct(knode, path, inside)
            if not isinstance(key, str):
                raise SpecError(path, knode.start_mark.line + 1, str(key), "keys must be strings")
            if key in out:
                raise SpecError(path, knode.start_mark.line + 1, key, "duplicate key")
            out[key] = _construct(vnode, path, inside)
            out.lines[key] = knode.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        inside = inside | {id(node)}
        out = _LList(_construct(n, path, inside) for n in node.value)
        out.line, out.lines = line, [n.start_mark.line + 1 for n in node.value]
        return out
    return _SCALARS.construct_object(node)


def _parse_yaml(text: str, path: str) -> Any:
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark, ctx = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        what = getattr(e, "problem", None) or str(e)
        if getattr(e, "context", None) and ctx is not None:
            what = f"{what} ({e.context} started at line {ctx.line + 1})"
        raise SpecError(path, mark.line + 1 if mark else None, "<yaml>", what) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise SpecError(path, None, "<yaml>", "lists or mappings nested too deeply to read") from None
    if node is None:
        raise SpecError(path, 1, "<file>", "the spec is empty")
    try:
        return _construct(node, path)
    except RecursionError:
        raise SpecError(path, None, "<yaml>", "lists or mappings nested too deeply to read") from None
    except yaml.YAMLError as e:  # a tag the loader does not construct (a merge key <<, a custom !tag)
        mark = getattr(e, "problem_mark", None)
        raise SpecError(path, mark.line + 1 if mark else None, "<yaml>",
                        getattr(e, "problem", None) or str(e)) from None


# --------------------------------------------------------------------------- loading


def display_path(path: str | Path) -> str:
    """A machine-independent name for a spec: package-relative for shipped specs,
    cwd-relative when under the cwd, else the bare file name (no absolute paths)."""
    # `..` taken out (tools/../kgen/specs/x.yaml is kgen/specs/x.yaml: the name goes into every
    # rendered header, so into the cache key), then symlinks resolved where that alone does not
    # place it under the package or the cwd
    p = Path(os.path.normpath(Path(path).absolute()))
    pkg_root = Path(__file__).absolute().parent.parent
    for q, bases in ((p, (pkg_root, Path.cwd())), (p.resolve(), (pkg_root.resolve(), Path.cwd().resolve()))):
        for base in bases:
            try:
                return q.relative_to(base).as_posix()
            except ValueError:
                pass
    return p.name


def load(path: str | Path) -> Spec:
    """Read, validate and expand a spec file."""
    shown = display_path(path)
    # (errors name a file outside the package and the cwd by its whole path: two mine.yaml
    # on KGEN_SPEC_PATH must not read alike; the spec itself keeps the machine-independent name)
    full = Path(path).absolute()
    where = str(full) if shown == full.name and full.parent != Path.cwd() else shown
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(where, None, "<file>", f"cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError(where, None, "<file>", f"not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        return parse(text, shown)
    except SpecError as e:
        if where == shown:
            raise
        raise SpecError(where, e.line, e.key, e.message) from None


def parse(text: str, path: str = "<string>") -> Spec:
    from kgen.families import FAMILY_NAMES, schema_of

    doc = _parse_yaml(text, path)
    if not isinstance(doc, _LDict):
        raise SpecError(path, getattr(doc, "line", 1), "<file>", "the spec must be a mapping")
    err = _Errors(path, doc)
    for key in doc:
        if key not in _SPEC_KEYS:
            err(key, f"unknown key; expected one of {', '.join(_SPEC_KEYS)}")
    for key in ("family", "variants"):
        if key not in doc:
            raise SpecError(path, doc.line, key, "required key is missing")

    family = doc["family"]
    if not isinstance(family, str) or family not in FAMILY_NAMES():
        err("family", f"unknown family {family!r}; known: {', '.join(FAMILY_NAMES())}")
    schema = schema_of(family)
    description = doc.get("description", "")
    if not isinstance(description, str):
        err("description", "expected a string")

    dtypes = _dtypes(doc, "dtypes", schema, err) if "dtypes" in doc else schema.dtypes
    numerics = _numerics(doc, path, dtypes) if "numerics" in doc else {}

    entries = doc["variants"]
    if not isinstance(entries, _LList) or not entries:
        err("variants", "expected a non-empty list of variant entries")
    variants: list[Variant] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, _LDict):
            raise SpecError(path, entries.lines[i], f"variants[{i}]", "expected a mapping")
        for v in _expand(entry, i, family, schema, dtypes, path):
            if v.name in seen:
                raise SpecError(
                    path, v.line, f"variants[{i}]",
                    f"variant {v.name} is listed twice (first at line {seen[v.name]})",
                )
            seen[v.name] = v.line
            variants.append(v)
    return Spec(path, family, description, tuple(dtypes), tuple(variants), numerics)


class _Errors:
    def __init__(self, path: str, d: _LDict, prefix: str = ""):
        self.path, self.d, self.prefix = path, d, prefix

    def __call__(self, key: str, message: str, item: int | None = None):
        line = self.d.lines.get(key, self.d.line)
        value = self.d.get(key)
        if item is not None and isinstance(value, _LList):
            line = value.lines[item]
        raise SpecError(self.path, line, self.prefix + key, message)


def _listify(value: Any) -> list:
    return list(value) if isinstance(value, list) else [value]


def _dtypes(d: _LDict, key: str, schema: Schema, err: _Errors) -> list[str]:
    values = _listify(d[key])
    if not values:
        err(key, "expected at least one dtype")
    for j, v in enumerate(values):
        if v not in schema.dtypes:
            err(key, f"dtype {v!r} is not supported by this family ({', '.join(schema.dtypes)})", j)
    if len(set(values)) != len(values):
        err(key, "a dtype is listed twice")
    return values


def _numerics(doc: _LDict, path: str, dtypes: list[str]) -> dict[str, Tolerance]:
    num = doc["numerics"]
    err = _Errors(path, doc)
    if not isinstance(num, _LDict):
        err("numerics", "expected a mapping dtype -> {rtol, atol}")
    out = {}
    sub = _Errors(path, num, "numerics.")
    for dt, tol in num.items():
        if dt not in dtypes:
            sub(dt, f"not one of this spec's dtypes ({', '.join(dtypes)}): add it to the top-level dtypes "
                    "(a variant's dtypes must be among them) or drop this tolerance")
        if not isinstance(tol, _LDict) or set(tol) != {"rtol", "atol"}:
            sub(dt, "expected {rtol: <float>, atol: <float>}")
        tsub = _Errors(path, tol, f"numerics.{dt}.")
        for k in ("rtol", "atol"):
            x = tol[k]
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 <= x < 1) or math.isnan(x):
                tsub(k, f"expected a number in [0, 1), got {x!r}")
        out[dt] = Tolerance(float(tol["rtol"]), float(tol["atol"]))
    return out


def _cuda_templates(family: str) -> dict | None:
    """The family's per-arch CUDA templates ({arch: name}), or None where one template serves
    every arch (or the family has no CUDA backend)."""
    from kgen.families import module_of

    name = getattr(module_of(family), "TEMPLATES", {}).get("cuda")
    return name if isinstance(name, dict) else None


def _expand(entry: _LDict, i: int, family: str, schema: Schema, dtypes: list[str], path: str):
    err = _Errors(path, entry, f"variants[{i}].")
    if "backend" not in entry:
        raise SpecError(path, entry.line, f"variants[{i}].backend", "required key is missing")
    backend = entry["backend"]
    if backend not in BACKENDS or backend not in schema.knobs:
        err("backend", f"unknown backend {backend!r}; this family has {', '.join(schema.knobs)}")
    knobs = schema.knobs[backend]
    known = {k.name: k for k in knobs}
    for key in entry:
        if key not in _VARIANT_KEYS and key not in known:
            allowed = ", ".join([*_VARIANT_KEYS, *known])
            err(key, f"unknown key for backend {backend}; expected one of {allowed}")

    if backend == "cuda":
        if "arch" not in entry:
            raise SpecError(path, entry.line, f"variants[{i}].arch", "required for backend cuda")
        archs = _listify(entry["arch"])
        if not archs:
            err("arch", "expected at least one arch")
        per_arch = _cuda_templates(family)
        for j, a in enumerate(archs):
            if a not in schema.archs:
                err("arch", f"unknown arch {a!r}; expected one of {', '.join(schema.archs)}", j)
            if per_arch is not None and a not in per_arch:
                err("arch", f"family {family} has no CUDA template for {a} (its TEMPLATES['cuda'] covers "
                            f"{', '.join(per_arch)})", j)
    else:
        if "arch" in entry:
            err("arch", "Triton variants take their target at build time (kgen build --arch)")
        archs = [None]
    vdtypes = _dtypes(entry, "dtypes", schema, err) if "dtypes" in entry else dtypes
    # The spec's dtypes are all its variants': numerics, `kgen tune` and `kgen bench` go by
    # them, so a variant of another dtype could be built but never verified.
    for j, dt in enumerate(vdtypes):
        if dt not in dtypes:
            err("dtypes", f"dtype {dt!r} is not one of this spec's dtypes ({', '.join(dtypes)}): "
                          "add it to the spec's top-level dtypes (and its numerics)", j)

    axes: list[list[tuple[str, Any]]] = []
    for knob in knobs:
        if knob.name in entry and knob.kind is tuple:
            # one list is one value; a list of lists is several
            raw = entry[knob.name]
            if isinstance(raw, list) and raw and all(isinstance(x, list) for x in raw):
                values = [tuple(x) for x in raw]
            else:
                values = [tuple(raw) if isinstance(raw, list) else raw]
            for j, v in enumerate(values):
                problem = knob.check(v)
                if problem:
                    err(knob.name, problem, j if len(values) > 1 else None)
        elif knob.name in entry:
            values = _listify(entry[knob.name])
            if not values:
                err(knob.name, "expected at least one value")
            for j, v in enumerate(values):
                problem = knob.check(v)
                if problem:
                    err(knob.name, problem, j if isinstance(entry[knob.name], list) else None)
        elif knob.default is not None:
            values = [knob.default]
        else:
            raise SpecError(path, entry.line, f"variants[{i}].{knob.name}", "required key is missing")
        axes.append([(knob.name, v) for v in values])

    for arch, dtype in itertools.product(archs, vdtypes):
        for combo in itertools.product(*axes):
            params = dict(combo)
            for key, message in schema.check(backend, arch, dtype, params):
                err(key, f"{message} (arch {arch}, dtype {dtype})" if arch else f"{message} (dtype {dtype})")
            yield Variant(family, backend, arch, dtype, tuple(combo), path, entry.line)
