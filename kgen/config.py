"""Every environment knob kgen reads, in one place, read lazily (never at import)."""

from __future__ import annotations

import os
from pathlib import Path

# Variables that change generated code or how it is compiled, per backend; their values are
# part of that backend's cache keys, so changing one rebuilds instead of loading a stale
# artifact (and changing the other backend's variables rebuilds nothing).
CODE_AFFECTING_ENV = {"cuda": ("KGEN_NVCC_FLAGS",), "triton": ("TRITON_DEFAULT_FP_FUSION",)}


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
    if not env:
        return max(1, os.cpu_count() or 1)
    if not env.isdigit() or int(env) < 1:
        from kgen.errors import KgenError

        raise KgenError(f"KGEN_JOBS={env} must be a positive integer (how many nvcc run at once)")
    return int(env)


def pin_triton_defaults() -> None:
    """Keep Triton's FP fusion on (its default through 3.9, announced to flip in 3.10) unless
    the user chose: kgen's numerics should not change with a Triton upgrade. The variable is
    part of every Triton cache key (CODE_AFFECTING_ENV). Called before Triton compiles anything."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def code_env(backend: str) -> dict[str, str]:
    """The code-affecting variables a build's cache key holds. KGEN_NVCC_FLAGS as the flags it
    gives (split on whitespace; none: left out), so that an empty or re-spaced value finds the
    same entry (each rebuilt an identical binary)."""
    env = {k: os.environ[k] for k in CODE_AFFECTING_ENV[backend] if k in os.environ}
    if "KGEN_NVCC_FLAGS" in env:
        flags = " ".join(env.pop("KGEN_NVCC_FLAGS").split())
        if flags:
            env["KGEN_NVCC_FLAGS"] = flags
    return env


def log_topics() -> set[str]:
    """`KGEN_LOG`: comma-separated topics to report on stderr (`dispatch`: each choice)."""
    return {t.strip() for t in os.environ.get("KGEN_LOG", "").split(",") if t.strip()}
