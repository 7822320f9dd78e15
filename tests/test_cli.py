"""The CLI's verify and cache commands, as a user runs them."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = """family: fused_bias_act
dtypes: [float32]
variants:
  - {{backend: triton, block_cols: 2048, rows: 4, num_warps: 4}}
numerics:
  float32: {{rtol: {rtol}, atol: {atol}}}
"""


def _kgen(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kgen.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_verify_passes_and_fails_on_numerics(tmp_path):
    if os.environ.get("TRITON_INTERPRET") != "1":
        import pytest

        pytest.skip("on a GPU the GPU tests verify every variant")
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(SPEC.format(rtol=1e-5, atol=1e-6))
    bad.write_text(SPEC.format(rtol=0.0, atol=0.0))  # nothing computed in float32 is exact
    r = _kgen("verify", str(good))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 variants verified, 0 failed" in r.stdout
    r = _kgen("verify", str(bad))
    assert r.returncode == 1 and "FAILED" in r.stdout


def test_cache_info_and_clear(tmp_path):
    env = {"KGEN_CACHE_DIR": str(tmp_path / "c")}
    assert _kgen("build", "kgen/specs/fused_bias_act.yaml", "--no-compile", "--out", str(tmp_path / "g"),
                 env=env).returncode == 0
    code = ("from kgen import spec; from kgen.runtime import build; "
            "build.triton_source_entry(spec.load('kgen/specs/fused_bias_act.yaml').variants[-1])")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    r = _kgen("cache", "info", env=env)
    assert r.returncode == 0 and "1 entries" in r.stdout and str(tmp_path / "c") in r.stdout
    r = _kgen("cache", "clear", env=env)
    assert r.returncode == 0 and "removed 1 entries" in r.stdout
    assert "0 entries" in _kgen("cache", "info", env=env).stdout
