"""Error types with the fields a user needs to act on them."""

from __future__ import annotations


class KgenError(Exception):
    """Base class of every error kgen raises on purpose."""


class SpecError(KgenError):
    """A spec file is malformed. Carries the file, the line and the key at fault."""

    def __init__(self, path: str, line: int | None, key: str, message: str):
        self.path, self.line, self.key, self.message = path, line, key, message
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {key}: {message}")


class CompileError(KgenError):
    """A compiler failed. Carries the command, the compiler's log and the source path."""

    def __init__(self, variant: str, cmd: str, log: str, source: str):
        self.variant, self.cmd, self.log, self.source = variant, cmd, log, source
        super().__init__(
            f"compiling {variant} failed\n  source:  {source}\n  command: {cmd}\n"
            f"--- compiler output ---\n{log.rstrip()}\n"
            "Fix the template or spec knob named above; `kgen build SPEC --no-compile` "
            "renders without compiling."
        )


class ToolchainError(KgenError):
    """A tool kgen needs (nvcc, ninja, cuobjdump) is missing or unusable."""
