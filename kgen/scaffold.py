"""`kgen new-family NAME`: write a working, pip-installable kernel family package to start
from — `out = alpha * x + y` with one CUDA and one Triton tiling, its op, tests and README.

The package's files are Jinja templates in kgen/templates/_scaffold/. What they produce
holds Jinja and C++ of its own (the family's kernel templates, `<<<grid, block>>>`), so
they are rendered with their own delimiters: `[[ name ]]`, `[% if %]`, `[# comment #]`.
"""

from __future__ import annotations

import functools
import keyword
import re
from pathlib import Path

from kgen.errors import KgenError

# scaffold template (under kgen/templates/_scaffold/) -> file in the package ({name}: NAME)
FILES = {
    "pyproject.toml.j2": "pyproject.toml",
    "README.md.j2": "README.md",
    "gitignore.j2": ".gitignore",
    "package/__init__.py.j2": "kgen_{name}/__init__.py",
    "package/bench.py.j2": "kgen_{name}/bench.py",
    "package/spec.yaml.j2": "kgen_{name}/specs/{name}.yaml",
    "package/cuda.cu.j2": "kgen_{name}/templates/{name}/cuda.cu.j2",
    "package/triton.py.j2": "kgen_{name}/templates/{name}/triton.py.j2",
    "tests/conftest.py.j2": "tests/conftest.py",
    "tests/test_family.py.j2": "tests/test_{name}.py",
}
# A family's name is its module's suffix (kgen_NAME), its op (torch.ops.kgen.NAME) and its
# folder in generated/ and in the template search path.
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def check_name(name: str) -> None:
    """Raise KgenError unless `name` can name a new family."""
    if not _NAME.match(name) or keyword.iskeyword(name):
        raise KgenError(f"new-family: {name!r} is not a family name: use a lowercase Python identifier "
                        "(letters, digits, _; a letter first), e.g. my_axpy")
    from kgen.families import FAMILY_NAMES, origin

    if name in FAMILY_NAMES():
        raise KgenError(f"new-family: family {name!r} already exists ({origin(name)}); pick another name")
    from kgen import ops

    # The scaffold's op takes the family's name, and torch.ops.kgen.<name> is one op: a family
    # also defines ops that kgen.ops does not show (linear_logp_backward, fused_bias_act_).
    if name in dir(ops) or name in _kgen_ops():
        raise KgenError(f"new-family: {name!r} is already an op (torch.ops.kgen.{name}), and the new family's "
                        "op would take its name; pick another name")
    # kgen's template folders come first in the search path: NAME/cuda.cu.j2 must be the family's
    if (Path(__file__).resolve().parent / "templates" / name).exists():
        raise KgenError(f"new-family: {name!r} is the name of one of kgen's template folders; pick another name")


def _kgen_ops() -> set[str]:
    """The names of the `kgen::` ops registered with PyTorch, overloads folded (kgen.ops is
    imported first: that registers every family's)."""
    import torch

    from kgen import ops  # noqa: F401

    return {n.removeprefix("kgen::").split(".")[0] for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("kgen::")}


@functools.cache
def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("kgen", "templates/_scaffold"),
        undefined=jinja2.StrictUndefined,
        variable_start_string="[[", variable_end_string="]]",
        block_start_string="[%", block_end_string="%]",
        comment_start_string="[#", comment_end_string="#]",
        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False,
    )


def commands(name: str) -> list[str]:
    """What the package's README tells a user to run in its folder first; CI runs them."""
    spec = f"kgen_{name}/specs/{name}.yaml"
    return ["pip install -e '.[test]'", f"kgen build {spec}", f"TRITON_INTERPRET=1 kgen verify {spec}",
            "python -m pytest"]


def render(name: str) -> dict[str, str]:
    """The package's files, path (relative to its folder) -> text."""
    import kgen

    context = {"name": name, "kgen_version": kgen.__version__, "commands": commands(name)}
    env = _environment()
    return {out.format(name=name): env.get_template(src).render(context) for src, out in FILES.items()}


def create(name: str, directory: str | Path | None = None) -> Path:
    """Write the package for family `name` into `directory` (default ./NAME), which must be
    absent or empty; returns the folder."""
    check_name(name)
    dest = Path(directory if directory is not None else name)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise KgenError(f"new-family: {dest} exists and is not an empty folder; give another --dir")
    files = render(name)  # everything rendered before anything is written
    for rel, text in files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return dest
