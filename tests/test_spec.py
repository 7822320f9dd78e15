"""Spec loading and validation: good specs expand; each bad spec names file, line and key."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kgen import spec
from kgen.errors import SpecError
from kgen.families import schema_of

BAD = sorted((Path(__file__).parent / "specs" / "bad").glob("*.yaml"))
SHIPPED = sorted((Path(__file__).parent.parent / "kgen" / "specs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_specs_load_and_expand(path):
    s = spec.load(path)
    assert len(s.variants) > 1
    names = [v.name for v in s.variants]
    assert len(set(names)) == len(names)
    for v in s.variants:
        assert re.fullmatch(r"[a-z0-9_]+", v.name), v.name
        defaults = {k.name: k.default for k in schema_of(s.family).knobs[v.backend]}
        for key, value in v.knobs:  # every knob appears in the name (one at its default stays out)
            if value == defaults[key]:
                continue
            if isinstance(value, tuple):  # a list-valued knob (fused_mlp's widths): 367x512x256x1
                assert "x".join(map(str, value)) in v.name
            else:
                assert str(int(value) if isinstance(value, bool) else value) in v.name
    assert set(s.numerics) == set(s.dtypes)


def test_lists_expand_into_the_product():
    s = spec.parse(
        "family: fused_bias_act\n"
        "dtypes: [bfloat16, float16]\n"
        "variants:\n"
        "  - {backend: cuda, arch: [sm_80, sm_90], threads: [128, 256], vec: 8, rows: [1, 2, 4]}\n",
        "inline.yaml",
    )
    assert len(s.variants) == 2 * 2 * 2 * 3
    assert s.variants[0].name == "sm80_t128_v8_r1_bf16"
    v = s.variant("sm90_t256_v8_r4_f16")
    assert v.params == {"threads": 256, "vec": 8, "rows": 4, "order": "down", "unroll": 1}  # defaults fill in
    with pytest.raises(AttributeError):
        v.dtype = "float32"  # frozen


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_spec_names_file_line_and_key(path):
    first = path.read_text().splitlines()[0] if path.read_text() else ""
    m = re.match(r"# expect: (\d+) (\S+)", first)
    assert m, f"{path.name} lacks its '# expect: LINE KEY' header"
    with pytest.raises(SpecError) as ei:
        spec.load(path)
    e = ei.value
    assert (e.line, e.key) == (int(m.group(1)), m.group(2)), str(e)
    assert str(e).startswith(f"{e.path}:{e.line}: {e.key}: ")
    assert e.path.endswith(path.name)


def test_cli_prints_one_line_not_a_traceback():
    bad = next(p for p in BAD if p.stem == "vec_breaks_16b")
    r = subprocess.run([sys.executable, "-m", "kgen.cli", "build", str(bad), "--no-compile", "--out", "/nonexistent"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "vec_breaks_16b.yaml:8: variants[0].vec:" in lines[0]
    assert "16-byte" in lines[0]


def test_missing_file_is_a_spec_error():
    with pytest.raises(SpecError) as ei:
        spec.load("does/not/exist.yaml")
    assert ei.value.key == "<file>"


def test_errors_name_a_file_outside_the_cwd_by_its_whole_path(tmp_path, monkeypatch):
    """Two mine.yaml in different folders must not read alike in an error; the spec itself
    keeps its machine-independent name (what rendered headers and cache keys see)."""
    bad = tmp_path / "a" / "mine.yaml"
    bad.parent.mkdir()
    bad.write_text("family: fused_bias_act\nvariants:\n  - {backend: triton, block_cols: -256, rows: 1, "
                   "num_warps: 2}\n")
    with pytest.raises(SpecError, match=f"^{re.escape(str(bad))}:3: variants\\[0\\].block_cols"):
        spec.load(bad)
    monkeypatch.chdir(bad.parent)
    with pytest.raises(SpecError, match="^mine.yaml:3: "):
        spec.load("mine.yaml")
    bad.write_text(bad.read_text().replace("-256", "256"))
    monkeypatch.chdir(tmp_path)  # (then under the cwd: its relative name)
    assert spec.load(bad).path == "a/mine.yaml"


def test_a_path_through_dot_dot_names_the_spec_as_its_plain_path(monkeypatch):
    """kgen build ../kgen/specs/x.yaml from a subfolder rendered "spec: tools/../kgen/specs/..."
    into every header: every generated file changed, `kgen diff --check` failed, and every
    variant got a second cache key (a full rebuild)."""
    root = Path(spec.__file__).resolve().parent.parent
    monkeypatch.chdir(root / "tools")
    shipped = spec.load(root / "kgen" / "specs" / "fused_bias_act.yaml")
    for p in ("../kgen/specs/fused_bias_act.yaml", root / "tools" / ".." / "kgen" / "specs" / "fused_bias_act.yaml"):
        assert spec.display_path(p) == "kgen/specs/fused_bias_act.yaml"
        assert spec.load(p).path == shipped.path


def _error(text: str) -> SpecError:
    with pytest.raises(SpecError) as ei:
        spec.parse(text, "inline.yaml")
    return ei.value


def test_an_empty_arch_list_is_an_error_not_zero_variants():
    e = _error("family: fused_bias_act\nvariants:\n  - backend: cuda\n    arch: []\n"
               "    threads: 256\n    vec: 4\n    rows: 1\n")
    assert (e.line, e.key) == (4, "variants[0].arch") and "at least one arch" in e.message


def test_a_variant_dtype_must_be_one_of_the_spec_dtypes():
    """The spec's dtypes are all its variants' (numerics, `kgen tune` and `kgen bench` go by
    them): a variant of another dtype is refused where it is listed, not left unverifiable."""
    variants = ("variants:\n"
                "  - {backend: triton, block_cols: 1024, rows: 1, num_warps: 4, dtypes: [float32, bfloat16]}\n")
    e = _error("family: fused_bias_act\ndtypes: [float32]\n" + variants)
    assert (e.line, e.key) == (4, "variants[0].dtypes")
    assert "'bfloat16' is not one of this spec's dtypes (float32)" in e.message
    e = _error("family: fused_bias_act\ndtypes: [float32]\n" + variants
               + "numerics:\n  bfloat16: {rtol: 1e-2, atol: 1e-2}\n")
    assert e.key == "numerics.bfloat16" and "add it to the top-level dtypes" in e.message
    # without top-level dtypes the spec's are the family's: numerics for any variant's dtype
    s = spec.parse("family: fused_bias_act\n" + variants + "numerics:\n  bfloat16: {rtol: 1e-2, atol: 1e-2}\n"
                   "  float32: {rtol: 1e-5, atol: 1e-5}\n", "inline.yaml")
    assert {v.dtype for v in s.variants} == set(s.numerics) and set(s.numerics) <= set(s.dtypes)


@pytest.mark.parametrize("text", [
    "family: fused_bias_act\nvariants: &a [*a]\n",
    "family: fused_bias_act\nvariants: &a\n  - *a\n",
    "family: fused_bias_act\nvariants: &a\n  - {backend: triton, rows: *a}\n",
], ids=["flow", "block", "in-a-mapping"])
def test_a_self_referencing_alias_is_a_spec_error(tmp_path, text):
    path = tmp_path / "loop.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as ei:
        spec.load(path)
    assert ei.value.path == str(path) and ei.value.line == 2 and "contains it" in ei.value.message


def test_an_alias_used_twice_is_fine():
    s = spec.parse("family: fused_bias_act\ndtypes: &d [float32]\nvariants:\n"
                   "  - {backend: triton, block_cols: 1024, rows: 1, num_warps: 4, dtypes: *d}\n"
                   "  - {backend: triton, block_cols: 2048, rows: 1, num_warps: 4, dtypes: *d}\n")
    assert len(s.variants) == 2
