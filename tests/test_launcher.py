"""The host-side launch path: the CPython trampoline and the ctypes fallback pass the same
ints and floats, in order, to a launcher with kgen's C ABI."""

import ctypes
import shutil
import subprocess

import pytest

from kgen.runtime import loader

PROBE = r"""
static long long seen_i[16]; static double seen_f[16];
int kgen_launch(const long long* i, const double* f) {
  for (int k = 0; k < 5; ++k) seen_i[k] = i[k];
  seen_f[0] = f[0]; seen_f[1] = f[1];
  return (int)(i[0] + i[4]);
}
long long seen_int(int k) { return seen_i[k]; }
double seen_float(int k) { return seen_f[k]; }
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("probe")
    (d / "probe.c").write_text(PROBE)
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(d / "probe.so"), str(d / "probe.c")], check=True)
    lib = ctypes.CDLL(str(d / "probe.so"))
    lib.seen_int.restype, lib.seen_int.argtypes = ctypes.c_longlong, [ctypes.c_int]
    lib.seen_float.restype, lib.seen_float.argtypes = ctypes.c_double, [ctypes.c_int]
    return lib


def _check_call(raw, ptr, lib):
    big = 0x7F12_3456_7890  # a typical device pointer: more than 32 bits
    rc = raw(ptr, 3, big, 0.25, True, -7, 2**40, -1.5)
    assert [lib.seen_int(k) for k in range(5)] == [3, big, 1, -7, 2**40]
    assert (lib.seen_float(0), lib.seen_float(1)) == (0.25, -1.5)
    assert rc == ctypes.c_int(3 + 2**40).value  # the launcher's int return comes back


def test_trampoline_passes_ints_and_floats_in_order(probe):
    tramp = loader.trampoline()
    if tramp is None:
        pytest.fail("the trampoline did not build (Python.h and cc are present in CI)")
    ptr = ctypes.cast(probe.kgen_launch, ctypes.c_void_p).value
    _check_call(tramp.call, ptr, probe)


def test_trampoline_takes_up_to_40_arguments(probe):
    """The widest launcher kgen ships, fused_mlp's TMA ring at 8 layers with every bias, takes 33
    arguments (launch.cuh.j2); the trampoline takes up to 40 and refuses more, launching nothing."""
    tramp = loader.trampoline()
    if tramp is None:
        pytest.fail("the trampoline did not build (Python.h and cc are present in CI)")
    ptr = ctypes.cast(probe.kgen_launch, ctypes.c_void_p).value
    assert tramp.call(ptr, *range(1, 41)) == 1 + 5 and probe.seen_int(4) == 5
    with pytest.raises(TypeError, match="40 arguments"):
        tramp.call(ptr, *range(2, 43))
    assert probe.seen_int(0) == 1  # (not called)


def test_ctypes_fallback_passes_the_same(probe):
    ptr = ctypes.cast(probe.kgen_launch, ctypes.c_void_p).value
    _check_call(loader._ctypes_raw(probe.kgen_launch), ptr, probe)


def test_trampoline_rejects_non_numbers(probe):
    ptr = ctypes.cast(probe.kgen_launch, ctypes.c_void_p).value
    with pytest.raises(TypeError):
        loader.trampoline().call(ptr, "not a number")


@pytest.mark.parametrize("cc", ["/nonexistent/kgen-cc", "kgen-no-such-compiler"])
def test_a_missing_compiler_falls_back_to_ctypes(tmp_path, cc):
    """CC naming no compiler (a path or a name not on PATH): the trampoline is None with a
    warning that says so, and kgen's launches take ctypes; it used to raise FileNotFoundError
    on every CUDA variant's load."""
    import os
    import sys

    code = "from kgen.runtime import loader; print('tramp', loader.trampoline())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "CC": cc, "KGEN_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "tramp None" in r.stdout
    assert f"CC={cc!r} is not a compiler found on PATH" in r.stderr and "ctypes" in r.stderr
