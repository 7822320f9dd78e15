"""kgen: YAML specs -> Jinja -> CUDA and Triton sources -> cached builds -> PyTorch ops.

Importing kgen touches no disk and imports neither torch nor triton; `kgen.ops` does.
"""

__version__ = "0.1.0"

from kgen.errors import CompileError, KgenError, SpecError, ToolchainError  # noqa: E402


def add_spec(path):
    """Add a spec file whose variants join their family's shipped ones (dispatch, tuning,
    KGEN_VARIANT) in this process; `KGEN_SPEC_PATH` does the same from the environment."""
    from kgen.runtime.dispatch import add_spec as _add

    return _add(path)


def register_family(module, name=None) -> str:
    """Make a kernel family module (or its import name) known; see docs/families.md."""
    from kgen.families import register_family as _register

    return _register(module, name)


__all__ = ["CompileError", "KgenError", "SpecError", "ToolchainError", "__version__", "add_spec",
           "register_family"]
