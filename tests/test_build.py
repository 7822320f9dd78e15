"""Compile-only checks: every CUDA variant compiles for its target with the instructions it
was written for and no local memory; Triton variants compile ahead of time for sm_90."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from kgen import spec
from kgen.errors import CompileError
from kgen.runtime import build, toolchain

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FBA = spec.load(ROOT / "kgen" / "specs" / "fused_bias_act.yaml")
SHIPPED = [spec.load(p) for p in sorted((ROOT / "kgen" / "specs").glob("*.yaml"))]
TRITON = [v for s in SHIPPED for v in s.variants if v.backend == "triton"]
# Families whose shipped Triton variants compile without a per-thread stack (arrays the
# compiler keeps in local memory, LDL/STL like spills; `kgen build` reports it). fused_mlp's
# generic (up-to-4096-wide) variants carry 16-40 B stacks with Triton 3.9 on sm_90 (issue
# 22); its exact-width ones have none, which tests/test_fused_mlp.py checks.
STACK_FREE = {"fused_bias_act", "linear_logp", "int8_gemm", "logmatmul"}
# In CI a missing compiler is a failure, not a skip.
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CI"),
                                reason="nvcc not installed")


@pytest.fixture(scope="module")
def fba_builds():
    results = build.build(list(FBA.variants), triton_arch="sm_90")
    return {r.variant.name: r for r in results}


@pytest.fixture(scope="module")
def triton_builds():
    # Ahead-of-time compiles run in a process that does not interpret Triton (this one may:
    # see kgen/runtime/interpret.py); here they are then cache hits.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for s in SHIPPED:
        code = (f"from kgen import spec; from kgen.runtime import build; s = spec.load({str(ROOT / s.path)!r}); "
                "rs = build.build([v for v in s.variants if v.backend == 'triton'], triton_arch='sm_90'); "
                "print([r.status for r in rs])")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
        assert r.returncode == 0 and "failed" not in r.stdout, r.stdout + r.stderr
    return {r.variant.qualname: r for r in build.build(TRITON, triton_arch="sm_90")}


def test_no_ahead_of_time_build_while_interpreting(monkeypatch, tmp_path):
    import sys as _sys

    triton_loaded = "triton.language" in _sys.modules
    monkeypatch.setenv("KGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (r,) = build.build([TRITON[0]])
    assert r.status == "skipped" and "TRITON_INTERPRET" in str(r.error)
    # and Triton was not imported under the variable (that would make this process's
    # library functions interpreted for every later test)
    assert ("triton.language" in _sys.modules) == triton_loaded


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("ON", True), ("y", True), ("0", False),
                                       ("", False), ("false", False), ("off", False), ("no", False)])
def test_triton_interpret_reads_as_triton_reads_it(monkeypatch, value, on):
    """TRITON_INTERPRET=false (off, no) is off to Triton; kgen took any value but "" and "0"
    for on: `kgen build` skipped every Triton build, and loading a variant set the variable to
    1, so the process's Triton kernels ran interpreted (on a GPU: on the CPU, silently)."""
    from kgen.runtime import interpret

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpret.active() is on


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
    # programmatic dependent launches: on sm_90 every kernel waits for the one before it
    # (griddepcontrol.wait, ACQBULK in SASS) before it touches memory; sm_80 has no such wait
    waits, kernels = sass.count("ACQBULK"), sass.count("Function : ")
    assert (waits >= kernels) if r.variant.arch == "sm_90" else waits == 0, (waits, kernels)
    res = toolchain.resource_usage(lib)
    # 5 activations x (with, without y) x (vector, tail); order flat's vector path has two
    # instances, the bias one 16-byte load (cols % vec == 0) or read per element
    assert len(res) == (30 if r.variant.params["order"] == "flat" else 20)
    assert all(k["local"] == 0 and k["stack"] == 0 for k in res.values()), res


LLP = spec.load(ROOT / "kgen" / "specs" / "linear_logp.yaml")
LLP_CUDA = [v for v in LLP.variants if v.backend == "cuda"]


@pytest.fixture(scope="module")
def llp_builds():
    return {r.variant.name: r for r in build.build(LLP_CUDA)}


@needs_nvcc
@pytest.mark.parametrize("name", [v.name for v in LLP_CUDA])
def test_linear_logp_cuda_variant_uses_its_instructions(llp_builds, name):
    """sm_90a: WGMMA from TMA-loaded shared memory; the mma.sync template: ldmatrix + HMMA;
    the gemv kernel: HMMA fed by 16-byte weight loads that skip L1 (and on sm_90 the wait of
    a programmatic dependent launch); its float32 form TF32 HMMA on operands rounded in
    registers (F2FP on sm_90). No local memory, and none of the ptxas warnings that
    mean a WGMMA was serialised (C7510, C7511, C7515) or register reallocation ignored (C7508)."""
    r = llp_builds[name]
    assert r.status in ("built", "cached"), r.error
    lib = r.entry.file(build.CUDA_LIB)
    sass = toolchain.sass(lib)
    assert f"arch = {r.variant.arch}" in sass
    gemv = r.variant.params["kernel"] == "gemv"
    if gemv:  # hidden through L1 (LDG.E.128.CONSTANT), and the weight not: cp.async or no-allocate loads
        f32 = r.variant.dtype == "float32"
        wanted = ("HMMA.1688.F32.TF32" if f32 else "HMMA.16816.F32", "LDG.E.128.CONSTANT")
        wanted += ("ACQBULK",) if r.variant.arch == "sm_90" else ()
        wanted += ("F2FP.TF32.F32",) if f32 and r.variant.arch == "sm_90" else ()
        ring = r.variant.params["ring"] > 0
        wanted += ("LDGSTS.E.BYPASS", "LDS.128") if ring else ()
        assert ring or re.search(r"LDG\.E\.NA\.LTC\d+B\.128\.CONSTANT", sass)  # straight into registers
        assert "LDSM" not in sass
    elif r.variant.arch == "sm_90a":
        wanted = ("HGMMA.64x", "UTMALDG", "SYNCS")
    else:
        wanted = ("HMMA.16816.F32", "LDSM", "LDGSTS")
    if r.variant.params["cluster"] > 1:  # weight panels multicast to the cluster, freed in every CTA
        wanted += ("UTMALDG.2D.MULTICAST", "SYNCS.ARRIVE.TRANS64.RED", "UCGABAR_WAIT")
    for op in wanted:
        assert op in sass, op
    assert "LDL" not in sass and "STL" not in sass
    res = toolchain.resource_usage(lib)
    # the partials kernel: (bias, no bias) x (entropy, no entropy), and on sm_90a also its dz
    # form (no bias) x (entropy, no entropy), the gemv kernel at 8 and at block_m rows a pass
    # (float32: each with one TF32 product and with three); its combine: (entropy, no entropy)
    kernels = (16 if r.variant.dtype == "float32" else 8) if gemv else 6 if r.variant.arch == "sm_90a" else 4
    fwd = "fwd_gemv" if gemv else "fwd_sm"
    assert sum(fwd in k for k in res) == kernels and sum("combine" in k for k in res) == 2, list(res)
    assert all(k["local"] == 0 and k["stack"] == 0 for k in res.values()), res
    log = r.entry.file(build.BUILD_LOG).read_text()
    assert not re.search(r"C75(08|10|11|15)", log), log


@pytest.mark.aot
@pytest.mark.parametrize("name", [v.qualname for v in TRITON])
def test_triton_variant_compiles_ahead_of_time(triton_builds, name):
    r = triton_builds[name]
    assert r.status in ("built", "cached"), r.error
    cubins = [f for f in r.entry.manifest["files"] if f.endswith(".cubin")]
    assert cubins
    sass = [toolchain.sass(r.entry.file(c)) for c in cubins]
    assert all(re.search(r"code for sm_90a?\b", s) for s in sass) and any("LDG.E" in s for s in sass)
    res = r.entry.manifest["resources"]
    assert all(k["local"] == 0 for k in res.values()), res
    if r.variant.family in STACK_FREE:
        assert all(k["stack"] == 0 for k in res.values()), res


def test_a_kernel_built_in_two_forms_keeps_both(triton_builds):
    """logmatmul's tl.dot tiles take their exps in the tile loop or from an exp launch
    (plans.pre_pass): the build compiles the forward both ways, the second as `.1`, each with
    its own cubin and resource entry; the FMA form has one form."""
    for name, forms in (("logmatmul/triton_b64_n64_k32_dtf32x3_w4_s3_f32", 2),
                        ("logmatmul/triton_b16_n64_k64_dtf32x3_w4_f32", 2), ("logmatmul/triton_b4_n16_k128_w4_f32", 1)):
        m = triton_builds[name].entry.manifest
        fwd = sorted(k for k in m["resources"] if k.startswith("logmatmul_fwd_kernel"))
        assert fwd == ["logmatmul_fwd_kernel", "logmatmul_fwd_kernel.1"][:forms], fwd
        assert sum(f.startswith("logmatmul_fwd_kernel") and f.endswith(".cubin") for f in m["files"]) == forms


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


@needs_nvcc
def test_prebuild_leaves_each_cuda_variant_cached_for_its_load(monkeypatch, tmp_path):
    from kgen.runtime import dispatch

    monkeypatch.setenv("KGEN_CACHE_DIR", str(tmp_path))
    vs = [v for v in FBA.variants if v.backend == "cuda"][:2]
    assert dispatch.prebuild([*vs, None]) == {}
    assert [r.status for r in build.build_cuda(vs[:1])] == ["cached"]
    assert [r.status for r in build.build_cuda(vs[1:])] == ["cached"]


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    from kgen.errors import ToolchainError

    monkeypatch.setenv("KGEN_NVCC", "/nonexistent/nvcc")  # named: that one is missing
    with pytest.raises(ToolchainError, match="KGEN_NVCC=/nonexistent/nvcc names no executable nvcc"):
        toolchain.nvcc()
    monkeypatch.delenv("KGEN_NVCC")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    monkeypatch.setattr(toolchain.config, "nvcc_path", lambda: None)
    with pytest.raises(ToolchainError, match="CUDA_HOME or KGEN_NVCC"):
        toolchain.nvcc()
