"""Compile-only checks: every CUDA variant compiles for its target with the instructions it
was written for and no local memory; Triton variants compile ahead of time for sm_90."""

import os
import re
import shutil

import pytest

from kgen import spec
from kgen.errors import CompileError
from kgen.runtime import build, toolchain

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FBA = spec.load(ROOT / "kgen" / "specs" / "fused_bias_act.yaml")
# In CI a missing compiler is a failure, not a skip.
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CI"),
                                reason="nvcc not installed")


@pytest.fixture(scope="module")
def fba_builds():
    results = build.build(list(FBA.variants), triton_arch="sm_90")
    return {r.variant.name: r for r in results}


@needs_nvcc
@pytest.mark.parametrize("name", [v.name for v in FBA.variants if v.backend == "cuda"])
def test_cuda_variant_compiles_with_16_byte_accesses(fba_builds, name):
    r = fba_builds[name]
    assert r.status in ("built", "cached"), r.error
    lib = r.entry.file(build.CUDA_LIB)
    sass = toolchain.sass(lib)
    assert f"arch = {r.variant.arch}" in sass
    # the vector path's loads and stores are single 16-byte accesses (8 bytes for vec*size=8)
    width = r.variant.params["vec"] * spec.DTYPES[r.variant.dtype][0] * 8
    assert f"LDG.E.{width}" in sass and f"STG.E.{width}" in sass
    assert "LDL" not in sass and "STL" not in sass  # no local memory
    res = toolchain.resource_usage(lib)
    assert len(res) == 20  # 5 activations x (with, without y) x (vector, tail)
    assert all(k["local"] == 0 and k["stack"] == 0 for k in res.values()), res


@pytest.mark.parametrize("name", [v.name for v in FBA.variants if v.backend == "triton"])
def test_triton_variant_compiles_ahead_of_time(fba_builds, name):
    r = fba_builds[name]
    assert r.status in ("built", "cached"), r.error
    cubins = [f for f in r.entry.manifest["files"] if f.endswith(".cubin")]
    assert cubins
    sass = toolchain.sass(r.entry.file(cubins[0]))
    assert re.search(r"code for sm_90a?\b", sass) and "LDG.E" in sass
    assert all(k["local"] == 0 for k in r.entry.manifest["resources"].values())


@needs_nvcc
def test_compile_error_carries_command_log_and_source(monkeypatch):
    from kgen import render as render_mod

    v = FBA.variants[0]
    real = render_mod.render

    def broken(variant):
        r = real(variant)
        return render_mod.Rendered(r.variant, r.filename, r.text + "\nthis is not C++;\n")

    monkeypatch.setattr(build, "render", broken)
    (result,) = build.build_cuda([v])
    assert result.status == "failed"
    e = result.error
    assert isinstance(e, CompileError)
    assert "nvcc" in e.cmd and "-gencode=arch=compute_90,code=sm_90" in e.cmd
    assert "error" in e.log and "this is not C++" in Path(e.source).read_text()
    assert v.qualname in str(e)


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    from kgen.errors import ToolchainError

    monkeypatch.setenv("KGEN_NVCC", "/nonexistent/nvcc")
    with pytest.raises(ToolchainError, match="CUDA_HOME or KGEN_NVCC"):
        toolchain.nvcc()
