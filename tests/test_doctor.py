"""`kgen doctor`, as a user runs it (on this machine, whatever it has)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _doctor(*args, cache, **env):
    return subprocess.run([sys.executable, "-m", "kgen.cli", "doctor", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "KGEN_CACHE_DIR": str(cache), **env})


def test_reports_versions_cache_and_specs(tmp_path):
    cache = tmp_path / "cache"  # absent: doctor creates it, as a build would
    r = _doctor(cache=cache)
    assert r.returncode == 0, r.stdout + r.stderr
    for word in ("Python", "Triton", "numpy", "nvcc", "GPU", torch.__version__,
                 f"{cache}: 0 entries, 0.0 MiB, writable", "fused_bias_act", "linear_logp", "reference"):
        assert word in r.stdout, word
    assert cache.is_dir() and (cache.stat().st_mode & 0o777) == 0o700
    assert list(cache.iterdir()) == []  # the probe file is gone


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_require_gpu_fails_without_one(tmp_path):
    r = _doctor("--require", "gpu", cache=tmp_path)
    assert r.returncode == 1 and "--require gpu: missing" in r.stdout
    assert _doctor("--require", "triton", cache=tmp_path).returncode == 1  # the interpreter does not count


def test_unwritable_cache_is_an_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = _doctor(cache=blocker / "cache")  # under a regular file: not creatable, even as root
    assert r.returncode == 1
    assert "NOT WRITABLE" in r.stdout and "not writable" in r.stdout


def test_unknown_requirement_is_a_usage_error(tmp_path):
    r = _doctor("--require", "tpu", cache=tmp_path)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_launcher_row_names_the_compiler_or_why_not(tmp_path):
    """The launcher row: the C trampoline with the compiler it would be built with, or ctypes
    and why (here: CC names no compiler); either way nothing is built into the cache."""
    from kgen.runtime import loader

    cc, _ = loader.trampoline_toolchain()
    r = _doctor(cache=tmp_path / "c1")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("launcher"))
    assert (f"C trampoline (built on first use with {cc})" if cc else "ctypes:") in line
    r = _doctor(cache=tmp_path / "c2", CC="/nonexistent/kgen-cc")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ctypes: CC='/nonexistent/kgen-cc' is not a compiler found on PATH" in " ".join(r.stdout.split())
    assert list((tmp_path / "c2").iterdir()) == []


def test_a_variant_name_no_family_has_is_a_problem(tmp_path):
    """KGEN_VARIANT with a typo raised only on a GPU, and only in the op of its family; doctor,
    which reported KGEN_BACKEND's and KGEN_AUTOTUNE's bad values, said nothing of it."""
    r = _doctor(cache=tmp_path, KGEN_VARIANT="triton_c1024_r1_w4_f33")
    assert r.returncode == 1 and "KGEN_VARIANT=triton_c1024_r1_w4_f33 names no variant of any family" in r.stdout
    r = _doctor(cache=tmp_path, KGEN_VARIANT="triton_c1024_r1_w4_f32")
    assert r.returncode == 0 and "names no variant" not in r.stdout, r.stdout
