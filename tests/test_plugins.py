"""Specs and families from outside the package (KGEN_SPEC_PATH, kgen.add_spec, the
`kgen.families` entry-point group, kgen.register_family) and KGEN_LOG=dispatch."""

import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import kgen
from kgen import families
from kgen import spec as spec_mod
from kgen.errors import KgenError, SpecError
from kgen.render import render
from kgen.runtime import dispatch, tune, tuning_table

ROOT = Path(__file__).resolve().parent.parent
MY_FBA = """\
family: fused_bias_act
dtypes: [float32]
variants:
  - backend: triton
    block_cols: 4096
    rows: 2
    num_warps: 8
numerics:
  float32: {rtol: 1.0e-5, atol: 1.0e-6}
"""
MINE = "triton_c4096_r2_w8_f32"


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No user specs, no tuning tables, a fake GPU for dispatch.choose."""
    monkeypatch.delenv("KGEN_SPEC_PATH", raising=False)
    for k in ("KGEN_VARIANT", "KGEN_BACKEND", "KGEN_AUTOTUNE", "KGEN_LOG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("KGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning_table, "SHIPPED_DIR", tmp_path / "no-tables")
    monkeypatch.setattr(tuning_table, "device_key", lambda index: "Fake GPU|sm_90|132")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    tuning_table._shipped.cache_clear()
    tune.TABLES.invalidate()
    dispatch._added.clear()
    dispatch._user_specs.cache_clear()
    yield tmp_path
    dispatch._added.clear()
    dispatch._user_specs.cache_clear()
    tuning_table._shipped.cache_clear()
    tune.TABLES.invalidate()


CUDA0 = types.SimpleNamespace(type="cuda", index=0)


# --------------------------------------------------------------------------- user specs


def test_a_spec_on_the_path_is_listed_and_can_be_forced(clean, monkeypatch):
    (clean / "mine.yaml").write_text(MY_FBA)
    monkeypatch.setenv("KGEN_SPEC_PATH", os.pathsep.join([str(clean / "nothing-here"), str(clean)]))
    names = [v.name for v in dispatch.family_variants("fused_bias_act")]
    assert MINE in names and names.index(MINE) == len(names) - 1  # after the shipped ones
    monkeypatch.setenv("KGEN_VARIANT", MINE)
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", "rows<=1.cols<=1.tail.y")
    assert (kernel.name, why) == (MINE, "forced")
    # kgen list names the file each variant came from
    env = {**os.environ, "KGEN_SPEC_PATH": str(clean / "mine.yaml")}
    out = subprocess.run([sys.executable, "-m", "kgen.cli", "list"], env=env, capture_output=True, text=True,
                         check=True).stdout
    line = next(ln for ln in out.splitlines() if MINE in ln)
    assert "mine.yaml:4" in line
    assert "kgen/specs/fused_bias_act.yaml" in out


def test_a_copy_of_a_shipped_spec_changes_nothing(clean, monkeypatch):
    before = dispatch.family_variants("fused_bias_act")
    shutil.copy(ROOT / "kgen/specs/fused_bias_act.yaml", clean / "copy.yaml")
    monkeypatch.setenv("KGEN_SPEC_PATH", str(clean / "copy.yaml"))
    after = dispatch.family_variants("fused_bias_act")
    assert after == before  # the same variants, from the same (shipped) file
    assert [render(v).text for v in after] == [render(v).text for v in before]  # same cache keys


def test_add_spec(clean):
    p = clean / "mine.yaml"
    p.write_text(MY_FBA)
    s = kgen.add_spec(p)
    assert s.family == "fused_bias_act" and MINE in [v.name for v in dispatch.family_variants("fused_bias_act")]
    (clean / "bad.yaml").write_text(MY_FBA.replace("block_cols: 4096", "block_cols: 3000"))
    with pytest.raises(SpecError, match="block_cols"):
        kgen.add_spec(clean / "bad.yaml")
    assert len(dispatch._added) == 1  # the bad one was not added


def test_tuning_considers_user_variants(clean, monkeypatch):
    (clean / "mine.yaml").write_text(MY_FBA)
    monkeypatch.setenv("KGEN_SPEC_PATH", str(clean / "mine.yaml"))
    assert MINE in [v.name for v in dispatch.runnable("fused_bias_act", "float32", torch.device("cpu"))]


def test_kgen_log_dispatch_names_the_choice_its_file_and_why(clean, monkeypatch, capsys):
    (clean / "mine.yaml").write_text(MY_FBA)
    monkeypatch.setenv("KGEN_SPEC_PATH", str(clean / "mine.yaml"))
    monkeypatch.setenv("KGEN_VARIANT", MINE)
    monkeypatch.setenv("KGEN_LOG", "dispatch")
    dispatch._logged.clear()
    for _ in range(2):
        dispatch.choose_logged("fused_bias_act", CUDA0, "float32", "rows<=8.cols<=64.vec16.y")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1  # once per (op, device, dtype, bucket)
    assert MINE in err[0] and "mine.yaml:4" in err[0] and "forced" in err[0]


def test_a_broken_user_spec_is_skipped_named_and_breaks_nothing_else(clean, monkeypatch, caplog):
    """A malformed spec, or one of a family that is not installed, among good ones on
    KGEN_SPEC_PATH: dispatch skips it with one warning naming it; the good spec's variants
    and every other family work; `kgen list` and `kgen doctor` name it and exit 1."""
    (clean / "a_mine.yaml").write_text(MY_FBA)
    (clean / "b_broken.yaml").write_text(MY_FBA.replace("block_cols: 4096", "block_cols: -256"))
    (clean / "c_nofamily.yaml").write_text("family: no_such_family\nvariants: [{backend: triton}]\n")
    monkeypatch.setenv("KGEN_SPEC_PATH", str(clean))
    dispatch._warned_broken.clear()
    with caplog.at_level("WARNING", logger="kgen"):
        assert MINE in [v.name for v in dispatch.family_variants("fused_bias_act")]
        assert dispatch.family_variants("linear_logp")
        dispatch.family_variants("logmatmul")
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 2 and "b_broken.yaml" in said[0] and "c_nofamily.yaml" in said[1]
    env = {**os.environ, "KGEN_SPEC_PATH": str(clean)}
    for cmd in (["list"], ["doctor"]):
        r = subprocess.run([sys.executable, "-m", "kgen.cli", *cmd], env=env, capture_output=True, text=True)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        both = r.stdout + r.stderr
        assert "b_broken.yaml" in both and "no_such_family" in both
    assert MINE in subprocess.run([sys.executable, "-m", "kgen.cli", "list"], env=env, capture_output=True,
                                  text=True).stdout


def test_kgen_backend_must_be_a_backend(clean, monkeypatch):
    """A typo in KGEN_BACKEND is an error, not spec order logged as "forced"."""
    monkeypatch.setenv("KGEN_BACKEND", "trition")
    with pytest.raises(KgenError, match="KGEN_BACKEND=trition is not one of cuda, triton, reference"):
        dispatch.choose("fused_bias_act", CUDA0, "float32", "rows<=1.cols<=1.tail.y")
    assert dispatch.env_problems() == ["KGEN_BACKEND=trition is not one of cuda, triton, reference"]
    monkeypatch.setenv("KGEN_BACKEND", "triton")
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", "rows<=1.cols<=1.tail.y")
    assert why == "forced" and kernel.variant.backend == "triton"


@pytest.mark.parametrize("var,value", [("KGEN_BACKEND", "trition"), ("KGEN_AUTOTUNE", "enable"),
                                       ("KGEN_VARIANT", "triton_no_such_variant")])
def test_dispatch_env_typo_fails_on_cpu_tensors_too(clean, monkeypatch, var, value):
    """A bad KGEN_BACKEND or KGEN_AUTOTUNE, or a KGEN_VARIANT no family has, is an error from
    every family's op on CPU tensors as well (they choose no variant, so dispatch never read
    it there), not only once a CUDA tensor reaches dispatch; the same call runs once the
    value is fixed."""
    import kgen.ops as ops

    x = torch.randn(3, 8)
    calls = {
        "fused_bias_act": lambda: ops.fused_bias_act(x, torch.randn(8)),
        "fused_mlp": lambda: ops.fused_mlp(x, [torch.randn(5, 8)], [None]),
        "linear_logp": lambda: ops.linear_logp(x, torch.randn(11, 8), torch.tensor([1, 2, 3])),
        "logmatmul": lambda: ops.logmatmul(x, torch.rand(4, 8)),
        "int8_mm": lambda: ops.int8_mm(torch.ones(3, 8, dtype=torch.int8), torch.ones(5, 8, dtype=torch.int8)),
    }
    monkeypatch.setenv(var, value)
    for name, call in calls.items():
        with pytest.raises(KgenError, match=var):
            call()
    fixed = {"KGEN_BACKEND": "triton", "KGEN_AUTOTUNE": "0", "KGEN_VARIANT": "triton_c1024_r1_w4_f32"}[var]
    monkeypatch.setenv(var, fixed)
    for call in calls.values():
        call()


def test_kgen_variant_pins_its_own_family_only(clean, monkeypatch):
    """KGEN_VARIANT names one family's variant: that family's calls are forced, the other
    families' are not (one op can be pinned in a model calling several); a name no family
    has, or this family's variant of another dtype, is an error."""
    (clean / "mine.yaml").write_text(MY_FBA)
    monkeypatch.setenv("KGEN_SPEC_PATH", str(clean / "mine.yaml"))
    monkeypatch.setenv("KGEN_VARIANT", MINE)
    assert [v.name for v in dispatch.candidates("fused_bias_act", "float32", (9, 0))] == [MINE]
    others = dispatch.candidates("logmatmul", "float32", (9, 0))
    assert others and MINE not in [v.name for v in others]
    with pytest.raises(KgenError, match="names no fused_bias_act variant for bfloat16"):
        dispatch.candidates("fused_bias_act", "bfloat16", (9, 0))
    monkeypatch.setenv("KGEN_VARIANT", "no_such_variant")
    with pytest.raises(KgenError, match="names no logmatmul variant"):
        dispatch.candidates("logmatmul", "float32", (9, 0))


def test_an_op_name_is_one_op():
    """A second family defining kgen::<name> (a plugin named after a shipped op) is refused
    where it is defined; the shipped op keeps working (torch.library would let the second
    definition replace the first silently)."""
    from kgen.runtime.op import define

    def int8_mm(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
        return x

    int8_mm.__module__ = "kgen_someone_elses_family"
    with pytest.raises(KgenError, match="kgen::int8_mm is defined by kgen.families.int8_gemm"):
        define("int8_mm", int8_mm, fake=lambda x, y, alpha: x)
    a = torch.randint(-128, 128, (3, 8), dtype=torch.int8)
    assert torch.equal(torch.ops.kgen.int8_mm(a, a), a.long() @ a.long().T)


# --------------------------------------------------------------------------- plugin families

PLUGIN = '''
"""A family outside kgen: out = 2 * x (float32), one Triton variant knob."""
from pathlib import Path

import torch

from kgen.runtime.op import error_ratio, poisoned
from kgen.spec import Knob, Schema

FAMILY = "{name}"
SCHEMA = Schema(dtypes=("float32",), knobs={{"triton": (Knob("block", "b", lo=32, hi=4096, pow2=True),)}})
TEMPLATES = {{"triton": "{name}/triton.py.j2"}}
TEMPLATE_DIR = Path(__file__).with_name("{name}_templates")
SPECS = [Path(__file__).with_name("{name}.yaml")]


def template_context(variant):
    return dict(variant.params)


def triton_aot(variant, mod):
    sig = {{"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}}
    return [(mod.double_kernel, sig, {{"BLOCK": mod.BLOCK}}, {{"num_warps": 1}})]


def golden(kernel, device, dtype, tol):
    x = torch.randn(1000, device=device)
    out = poisoned((1000,), torch.float32, device)
    mod = kernel.module
    mod.double_kernel[(-(-1000 // mod.BLOCK),)](x, out, 1000, BLOCK=mod.BLOCK)
    return [("1000", error_ratio(out, 2 * x.double(), tol))]
'''
TEMPLATE = '''{{ header }}
import triton
import triton.language as tl

BLOCK = {{ block }}


@triton.jit
def double_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
'''
SPEC = """\
family: {name}
variants:
  - backend: triton
    block: [128, 1024]
numerics:
  float32: {{rtol: 1.0e-6, atol: 0.0}}
"""


def _write_plugin(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.py").write_text(PLUGIN.format(name=name))
    (root / f"{name}_templates" / name).mkdir(parents=True)
    (root / f"{name}_templates" / name / "triton.py.j2").write_text(TEMPLATE)
    (root / f"{name}.yaml").write_text(SPEC.format(name=name))
    return root / f"{name}.yaml"


def _entry_point(root: Path, name: str, module: str) -> None:
    dist = root / f"kgen_{name}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kgen-{name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[kgen.families]\n{name} = {module}\n")


def _forget(name: str) -> None:
    for d in (families._registered, families._loaded, families._broken):
        d.pop(name, None)
    families._entry_points.cache_clear()


def test_a_family_registered_at_run_time_lists_renders_and_verifies(tmp_path, monkeypatch):
    spec_path = _write_plugin(tmp_path, "plug_rt")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert kgen.register_family("plug_rt") == "plug_rt"
        assert "plug_rt" in families.FAMILY_NAMES()
        s = spec_mod.load(spec_path)
        assert [v.name for v in s.variants] == ["triton_b128_f32", "triton_b1024_f32"]
        assert "2 * tl.load" in render(s.variants[0]).text
        assert [v.name for v in dispatch.family_variants("plug_rt")] == ["triton_b128_f32", "triton_b1024_f32"]
        fam = families.module_of("plug_rt")
        for v in s.variants:  # under the interpreter (conftest), as `kgen verify` runs on a CPU
            [(case, worst)] = fam.golden(dispatch.load(v), torch.device("cpu"), "float32", s.numerics["float32"])
            assert worst <= 1.0
        with pytest.raises(KgenError, match="already exists"):
            kgen.register_family(types.ModuleType("fused_bias_act"))
    finally:
        _forget("plug_rt")


def test_a_module_missing_the_contract_is_refused_by_name():
    bad = types.ModuleType("half_done")
    bad.SCHEMA = None
    with pytest.raises(KgenError, match=r"half_done.*misses TEMPLATES, template_context"):
        kgen.register_family(bad)
    assert "half_done" not in families.FAMILY_NAMES()


@pytest.mark.parametrize("schema,match", [
    ("{'dtypes': ('float32',)}", "is a dict, not a kgen.spec.Schema"),
    ("Schema(dtypes=('float64',), knobs={'triton': ()})", "dtypes \\['float64'\\] must be some of"),
    ("Schema(dtypes=('float32',), knobs={'rocm': ()})", "knobs must map some of the backends"),
    ("Schema(dtypes=('float32',), knobs={'triton': (Knob('arch', 'a'),)})", "knob 'arch' .* own key"),
])
def test_a_malformed_schema_is_refused_by_name(schema, match, clean, monkeypatch):
    """A family module whose SCHEMA kgen cannot use (not a Schema, a dtype kgen has no name for,
    a backend it does not build, a knob named as a variant's own key) is refused when registered,
    naming it; a user spec of such a family is skipped, and the shipped families still list
    (a float64 dtype raised KeyError in every family's listing, `kgen list` exited 1)."""
    mod = types.ModuleType("plug_bad_schema")
    exec(f"from kgen.spec import Schema, Knob\nSCHEMA = {schema}\nTEMPLATES = None\n"
         "def template_context(variant):\n    return {}\n", mod.__dict__)
    with pytest.raises(KgenError, match=r"plug_bad_schema.*SCHEMA " + match):
        kgen.register_family(mod)
    assert "plug_bad_schema" not in families.FAMILY_NAMES()
    (clean / "bad.yaml").write_text("family: plug_bad_schema\nvariants: [{backend: triton}]\n")
    monkeypatch.setenv("KGEN_SPEC_PATH", str(clean))
    dispatch._warned_broken.clear()
    assert dispatch.family_variants("fused_bias_act")
    assert [f.name for f, _ in dispatch.broken_user_specs()] == ["bad.yaml"]


def _cli(tmp_path: Path):
    """`kgen ...` in a fresh process with tmp_path/site's installed families and its own cache,
    TRITON_INTERPRET unset but where a call sets it: run(*args, **env) -> CompletedProcess."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)]),
           "KGEN_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    return lambda *a, **kw: subprocess.run([sys.executable, "-m", "kgen.cli", *a], env={**env, **kw},
                                           capture_output=True, text=True, cwd=tmp_path)


def test_an_installed_family_builds_verifies_and_lists(tmp_path):
    spec_path = _write_plugin(tmp_path / "site", "plug_ep")
    _entry_point(tmp_path / "site", "plug_ep", "plug_ep")
    run = _cli(tmp_path)
    r = run("list")
    assert r.returncode == 0, r.stderr
    assert "plug_ep  (entry point plug_ep = plug_ep, 2 variants)" in r.stdout
    r = run("build", str(spec_path), "--out", str(tmp_path / "gen"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "gen" / "plug_ep" / "triton_b128_f32.py").is_file() and "built" in r.stdout
    r = run("verify", str(spec_path), TRITON_INTERPRET="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 variants verified, 0 failed" in r.stdout


def test_a_family_without_its_optional_hooks_builds_and_says_what_verify_needs(tmp_path):
    """docs/families.md lists triton_aot and golden as optional: `kgen build` raised an
    AttributeError from its cache key, `kgen verify` another, both as tracebacks."""
    spec_path = _write_plugin(tmp_path / "site", "plug_min")
    module = tmp_path / "site" / "plug_min.py"
    text = module.read_text()
    module.write_text(text[:text.index("def triton_aot(")])
    _entry_point(tmp_path / "site", "plug_min", "plug_min")
    run = _cli(tmp_path)
    r = run("build", str(spec_path), "--out", str(tmp_path / "gen"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "gen" / "plug_min" / "triton_b128_f32.py").is_file()
    assert "2 triton variants not compiled: family plug_min defines no triton_aot" in r.stderr
    r = run("verify", str(spec_path), TRITON_INTERPRET="1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "family plug_min defines no golden" in r.stderr


def test_a_template_error_in_a_users_family_is_one_line_naming_the_template(tmp_path, monkeypatch):
    """An undefined name in a family's template came out of `kgen build` as a jinja2 traceback."""
    spec_path = _write_plugin(tmp_path, "plug_tpl")
    tpl = tmp_path / "plug_tpl_templates" / "plug_tpl" / "triton.py.j2"
    tpl.write_text(tpl.read_text().replace("BLOCK = {{ block }}", "BLOCK = {{ blok }}"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        kgen.register_family("plug_tpl")
        v = spec_mod.load(spec_path).variants[0]
        with pytest.raises(KgenError, match=r"plug_tpl/triton.py.j2:5: UndefinedError: 'blok' is undefined") as e:
            render(v)
        assert e.value.__cause__ is None and e.value.__suppress_context__
    finally:
        _forget("plug_tpl")


def test_a_cuda_arch_without_its_template_is_a_spec_error(tmp_path, monkeypatch):
    """A family whose CUDA templates are per arch ({"sm_90": ...}) took a spec asking for
    sm_80 and failed later with a bare KeyError ("kgen: sm_80", no file, line or key)."""
    _write_plugin(tmp_path, "plug_arch")
    module = tmp_path / "plug_arch.py"
    module.write_text(module.read_text().replace(
        'knobs={"triton": (Knob("block", "b", lo=32, hi=4096, pow2=True),)}',
        'knobs={"triton": (Knob("block", "b", lo=32, hi=4096, pow2=True),), "cuda": ()}').replace(
        'TEMPLATES = {"triton": "plug_arch/triton.py.j2"}',
        'TEMPLATES = {"triton": "plug_arch/triton.py.j2", "cuda": {"sm_90": "plug_arch/cuda.cu.j2"}}'))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        kgen.register_family("plug_arch")
        spec = "family: plug_arch\nvariants:\n  - backend: cuda\n    arch: [sm_90, sm_80]\nnumerics:\n  float32: {rtol: 1.0e-6, atol: 0.0}\n"
        with pytest.raises(SpecError, match=r"variants\[0\]\.arch.*no CUDA template for sm_80 .*covers sm_90") as e:
            spec_mod.parse(spec, "arch.yaml")
        assert e.value.line == 4
        assert [v.arch for v in spec_mod.parse(spec.replace(", sm_80", ""), "arch.yaml").variants] == ["sm_90"]
    finally:
        _forget("plug_arch")


def test_a_broken_plugin_is_one_clear_error_and_the_shipped_families_still_work(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "plug_broken.py").write_text("raise ImportError('no module named cutlass_magic')\n")
    _entry_point(site, "plug_broken", "plug_broken")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    code = textwrap.dedent("""
        import torch
        from kgen import ops
        from kgen.families import module_of
        x = torch.ones(2, 3)
        print("result", ops.fused_bias_act(x, torch.ones(3), act="relu").sum().item())
        try:
            module_of("plug_broken")
        except Exception as e:
            print("error", type(e).__name__, e)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "result 12.0" in r.stdout
    err_line = next(ln for ln in r.stdout.splitlines() if ln.startswith("error"))
    assert "KgenError" in err_line and "plug_broken" in err_line and "cutlass_magic" in err_line
    assert len([ln for ln in r.stderr.splitlines() if "plug_broken" in ln]) == 1  # one warning
    r = subprocess.run([sys.executable, "-m", "kgen.cli", "list"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "fused_bias_act  (kgen.families.fused_bias_act" in r.stdout
    assert "plug_broken" in r.stderr and "cutlass_magic" in r.stderr

    # A user spec of the broken family on KGEN_SPEC_PATH: its family's load error (a KgenError,
    # not a SpecError) escaped dispatch's spec reading, so every family's dispatch raised it
    # and `kgen list` printed no family at all.
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "theirs.yaml").write_text("family: plug_broken\ndtypes: [float32]\nvariants:\n  - backend: triton\n")
    (specs / "mine.yaml").write_text(MY_FBA)
    env["KGEN_SPEC_PATH"] = str(specs)
    code = textwrap.dedent("""
        from kgen.runtime import dispatch
        names = [v.name for v in dispatch.family_variants("fused_bias_act")]
        print("variants", len(names), "mine" if names[-1] == "%s" else names[-1])
    """ % MINE)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "mine" in r.stdout.split("variants")[1]
    assert "theirs.yaml skipped" in r.stderr and "cutlass_magic" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kgen.cli", "list"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "fused_bias_act  (kgen.families.fused_bias_act" in r.stdout
    assert "theirs.yaml skipped" in r.stderr


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_an_op_runs_the_users_variant_and_says_so(tmp_path):
    (tmp_path / "mine.yaml").write_text(MY_FBA)
    env = {**os.environ, "KGEN_SPEC_PATH": str(tmp_path), "KGEN_VARIANT": MINE, "KGEN_LOG": "dispatch",
           "PYTHONPATH": str(ROOT)}
    code = textwrap.dedent("""
        import torch
        from kgen import ops
        from kgen.families import fused_bias_act as fba
        x = torch.randn(333, 5000, device="cuda")
        b, y = torch.randn(5000, device="cuda"), torch.randn(333, 5000, device="cuda")
        out = ops.fused_bias_act(x, b, y, alpha=0.5, act="silu")
        ref = fba.reference(x, b, y, 0.5, "silu", compute=torch.float64)
        print("worst", ((out.double() - ref).abs() / (1e-6 + 1e-5 * ref.abs())).max().item())
    """)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split("worst")[1]) <= 1.0
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("kgen dispatch:"))
    assert MINE in line and "mine.yaml:4" in line and "forced" in line
