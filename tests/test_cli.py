"""The CLI as a user runs it: verify, cache, build and diff of a user spec, errors."""

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
    (tmp_path / "c" / "tuning.json").write_text("{}")  # the user's tuning table
    (tmp_path / "c" / "notes.txt").write_text("not kgen's")  # KGEN_CACHE_DIR may be a shared folder
    r = _kgen("cache", "clear", env=env)
    assert r.returncode == 0 and "removed 1 build entries" in r.stdout and "tuning.json" in r.stdout
    assert "0 entries" in _kgen("cache", "info", env=env).stdout
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["notes.txt", "tuning.json"]


USER_SPEC = """family: fused_bias_act
variants:
  - {backend: triton, block_cols: 256, rows: 1, num_warps: 2, dtypes: [float32]}
"""


def test_building_a_user_spec_keeps_the_family_folder(tmp_path):
    """`kgen build mine.yaml` adds its files to generated/<family>/ and `kgen diff mine.yaml
    --check` compares only them; the shipped spec's build still removes a stale file."""
    out = tmp_path / "generated"
    assert _kgen("build", "kgen/specs/fused_bias_act.yaml", "--no-compile", "--out", str(out)).returncode == 0
    shipped = sorted(p.name for p in (out / "fused_bias_act").iterdir())
    mine = tmp_path / "mine.yaml"
    mine.write_text(USER_SPEC)
    r = _kgen("build", str(mine), "--no-compile", "--out", str(out))
    assert r.returncode == 0, r.stderr
    now = sorted(p.name for p in (out / "fused_bias_act").iterdir())
    assert set(now) == set(shipped) | {"triton_c256_r1_w2_f32.py"}
    assert _kgen("diff", str(mine), "--check", "--out", str(out)).returncode == 0
    (out / "fused_bias_act" / "stale.py").write_text("")
    assert _kgen("diff", "kgen/specs/fused_bias_act.yaml", "--check", "--out", str(out)).returncode == 1
    assert _kgen("build", "kgen/specs/fused_bias_act.yaml", "--no-compile", "--out", str(out)).returncode == 0
    assert not (out / "fused_bias_act" / "stale.py").exists()


def test_a_user_spec_leaves_the_shipped_variants_files(tmp_path):
    """A spec of yours that has one of the shipped variants too adds only its other files:
    the shipped one's stays byte for byte (it was rewritten with the user spec's header),
    and `kgen diff mine.yaml --check` agrees."""
    out = tmp_path / "generated"
    assert _kgen("build", "kgen/specs/fused_bias_act.yaml", "--no-compile", "--out", str(out)).returncode == 0
    theirs = out / "fused_bias_act" / "triton_c1024_r1_w4_f32.py"
    before = theirs.read_text()
    mine = tmp_path / "mine.yaml"
    mine.write_text(USER_SPEC + "  - {backend: triton, block_cols: 1024, rows: 1, num_warps: 4, dtypes: [float32]}\n")
    r = _kgen("build", str(mine), "--no-compile", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert theirs.read_text() == before and (out / "fused_bias_act" / "triton_c256_r1_w2_f32.py").exists()
    assert _kgen("diff", str(mine), "--check", "--out", str(out)).returncode == 0


def test_a_user_specs_sources_do_not_depend_on_the_cwd(tmp_path, monkeypatch):
    """The rendered source (the build cache's key) of a spec of yours names it by its file
    name, whatever directory it is loaded from: no rebuild from another cwd."""
    from kgen import spec
    from kgen.render import render

    (tmp_path / "sub").mkdir()
    mine = tmp_path / "mine.yaml"
    mine.write_text(USER_SPEC)
    texts = set()
    for cwd, path in ((tmp_path, "mine.yaml"), (tmp_path / "sub", "../mine.yaml"), (ROOT, str(mine))):
        monkeypatch.chdir(cwd)
        texts.add(render(spec.load(path).variants[0]).text)
    assert len(texts) == 1 and "spec:    mine.yaml\n" in texts.pop()
    monkeypatch.chdir(tmp_path)  # a shipped spec keeps its package-relative name
    assert "spec:    kgen/specs/fused_bias_act.yaml\n" in render(
        spec.load(ROOT / "kgen/specs/fused_bias_act.yaml").variants[0]).text


def test_bad_paths_and_values_are_one_line_errors(tmp_path):
    """No traceback for a path that cannot be written, an unknown --arch, a bad KGEN_JOBS, a
    YAML tag the loader does not take, a file that is not UTF-8."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(USER_SPEC)
    (tmp_path / "afile").write_text("")
    merge = tmp_path / "merge.yaml"
    merge.write_text("family: fused_bias_act\nvariants:\n  - <<: {backend: triton}\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe garbage")
    for args, env, want in (
            (("build", str(mine), "--no-compile", "--out", str(tmp_path / "afile")), {}, "Not a directory"),
            (("build", str(mine), "--arch", "sm_12"), {}, "invalid choice"),
            (("list", str(merge)), {}, "merge.yaml:3: <yaml>"),
            (("list", str(binary)), {}, "not UTF-8"),
            # a cache "directory" that is a file: info and clear said "0 entries" and exited 0
            (("cache", "info"), {"KGEN_CACHE_DIR": str(tmp_path / "afile")}, "is not a directory"),
            (("cache", "clear"), {"KGEN_CACHE_DIR": str(tmp_path / "afile")}, "is not a directory"),
            # a variant named, then left out by --arch: an empty table and exit 0 said nothing
            (("build", "kgen/specs/fused_bias_act.yaml", "--no-compile", "--out", str(tmp_path / "g"),
              "--variants", "sm80_t256_v4_r1_oflat_f32", "--arch", "sm_90"), {}, "leaves out sm80_t256_v4_r1_oflat_f32"),
    ):
        r = _kgen(*args, env=env)
        assert r.returncode != 0 and want in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_kgen_jobs_must_be_a_positive_integer(monkeypatch):
    import pytest

    from kgen import config
    from kgen.errors import KgenError

    for bad in ("abc", "0", "-2", "1.5"):
        monkeypatch.setenv("KGEN_JOBS", bad)
        with pytest.raises(KgenError, match=f"KGEN_JOBS={bad}"):
            config.build_jobs()
    monkeypatch.setenv("KGEN_JOBS", "3")
    assert config.build_jobs() == 3


def test_python_dash_m_kgen():
    r = subprocess.run([sys.executable, "-m", "kgen", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "new-family" in r.stdout


def test_an_old_or_missing_named_nvcc_is_a_clear_reason(tmp_path, monkeypatch):
    """A CUDA toolkit older than 12.4 is refused for builds (CUDA variants skipped with the
    reason; they were built, though the README says not), and KGEN_NVCC naming nothing says
    so (the message told the user to set KGEN_NVCC)."""
    import pytest

    from kgen.errors import ToolchainError
    from kgen.runtime import toolchain

    monkeypatch.setenv("KGEN_CACHE_DIR", str(tmp_path / "c"))
    old = tmp_path / "nvcc"
    old.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 11.8, V11.8.89'\n")
    old.chmod(0o755)
    with pytest.raises(ToolchainError, match="CUDA 11.8; kgen's CUDA templates need 12.4"):
        toolchain.require_release(str(old))
    monkeypatch.setenv("KGEN_NVCC", str(tmp_path / "nowhere" / "nvcc"))
    with pytest.raises(ToolchainError, match="KGEN_NVCC=.*nowhere/nvcc names no executable nvcc"):
        toolchain.nvcc()


def test_an_unknown_variant_names_the_spec_as_given(tmp_path):
    """`--variants` naming no variant: the hint's `kgen list` command is the path the user
    gave, which works from where they ran it (a shipped spec's package-relative name did not)."""
    spec_path = str(ROOT / "kgen/specs/fused_bias_act.yaml")
    r = subprocess.run([sys.executable, "-m", "kgen.cli", "build", spec_path, "--no-compile", "--out",
                        str(tmp_path / "g"), "--variants", "bogus"], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0 and f"`kgen list {spec_path}` lists them" in r.stderr, r.stderr
