"""kgen: YAML specs -> Jinja -> CUDA and Triton sources -> cached builds -> PyTorch ops.

Importing kgen touches no disk and imports neither torch nor triton; `kgen.ops` does.
"""

__version__ = "0.1.0"

from kgen.errors import CompileError, KgenError, SpecError, ToolchainError  # noqa: E402

__all__ = ["CompileError", "KgenError", "SpecError", "ToolchainError", "__version__"]
