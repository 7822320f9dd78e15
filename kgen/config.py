"""Every environment knob kgen reads, in one place, read lazily (never at import)."""

from __future__ import annotations

import os
from pathlib import Path

# Variables that change generated code or how it is compiled; their values are part of
# every cache key so that changing one rebuilds instead of loading a stale artifact.
CODE_AFFECTING_ENV = ("KGEN_NVCC_FLAGS", "TRITON_DEFAULT_FP_FUSION")


def cache_dir() -> Path:
    """`$KGEN_CACHE_DIR`, else the platform's per-user cache dir (never the cwd)."""
    env = os.environ.get("KGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kgen", appauthor=False))


def nvcc_path() -> str | None:
    """`$KGEN_NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on PATH."""
    import shutil

    env = os.environ.get("KGEN_NVCC")
    if env:
        return env
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def extra_nvcc_flags() -> list[str]:
    return os.environ.get("KGEN_NVCC_FLAGS", "").split()


def build_jobs() -> int:
    env = os.environ.get("KGEN_JOBS")
    return int(env) if env else max(1, os.cpu_count() or 1)


def code_env() -> dict[str, str]:
    return {k: os.environ[k] for k in CODE_AFFECTING_ENV if k in os.environ}
