"""`kgen new-family`: the package it writes, the names it refuses, and the family in it
working through kgen.register_family (no pip install: CI installs one and runs its own
README's commands, tests included)."""

import sys

import pytest
import torch

import kgen
from kgen import cli, render, scaffold, spec
from kgen.errors import KgenError
from kgen.runtime import dispatch

NAME = "scaffolded_axpy"  # registered once per test process: torch.ops.kgen.<NAME> cannot be defined twice


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The scaffold written by the CLI, its module imported and registered with kgen."""
    dest = tmp_path_factory.mktemp("scaffold") / NAME
    assert cli.main(["new-family", NAME, "--dir", str(dest)]) == 0
    sys.path.insert(0, str(dest))
    try:
        assert kgen.register_family(f"kgen_{NAME}") == NAME
    finally:
        sys.path.remove(str(dest))
    return dest


def test_writes_the_package(package):
    written = sorted(p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file())
    assert written == sorted(out.format(name=NAME) for out in scaffold.FILES.values())
    meta = (package / "pyproject.toml").read_text()
    assert f'name = "kgen-{NAME}"' in meta
    assert f'[project.entry-points."kgen.families"]\n{NAME} = "kgen_{NAME}"' in meta
    assert 'markers = ["gpu: ' in meta
    readme = (package / "README.md").read_text()
    assert "\n".join(scaffold.commands(NAME)) in readme
    for py in package.rglob("*.py"):
        compile(py.read_text(), str(py), "exec")


@pytest.mark.parametrize("name,why", [
    ("1op", "not a family name"), ("my-op", "not a family name"), ("MyOp", "not a family name"),
    ("class", "not a family name"), ("_private", "not a family name"),
    ("fused_bias_act", "already exists"), ("common", "template folders"),
])
def test_refuses_bad_names(tmp_path, name, why):
    with pytest.raises(KgenError, match=why):
        scaffold.create(name, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_a_non_empty_folder_and_takes_an_empty_one(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert cli.main(["new-family", "other_axpy", "--dir", str(tmp_path / "full")]) == 1
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    assert scaffold.create("other_axpy", tmp_path / "empty") == tmp_path / "empty"
    assert (tmp_path / "empty" / "kgen_other_axpy" / "specs" / "other_axpy.yaml").is_file()


def test_registered_family_loads_renders_and_lists(package):
    s = spec.load(package / f"kgen_{NAME}" / "specs" / f"{NAME}.yaml")
    assert {v.backend for v in s.variants} == {"cuda", "triton"}
    assert {v.arch for v in s.variants if v.backend == "cuda"} == {"sm_80", "sm_90"}
    for v in s.variants:
        assert f"variant: {v.qualname}" in render.render(v).text
    assert [v.name for v in dispatch.family_variants(NAME)] == [v.name for v in s.variants]
    from kgen import ops

    assert getattr(ops, NAME) is sys.modules[f"kgen_{NAME}"].OPS[NAME]


def test_registered_family_passes_golden_for_its_triton_variants(package):
    fam = sys.modules[f"kgen_{NAME}"]
    s = spec.load(package / f"kgen_{NAME}" / "specs" / f"{NAME}.yaml")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter
    triton = [v for v in s.variants if v.backend == "triton"]
    assert triton
    for v in triton:
        results = fam.golden(dispatch.load(v), device, v.dtype, s.numerics[v.dtype])
        assert results and all(ratio <= 1.0 for _, ratio in results), (v.name, results)


def test_op_of_the_registered_family_on_cpu(package):
    fam = sys.modules[f"kgen_{NAME}"]
    x, y = torch.randn(5, 7, requires_grad=True), torch.randn(5, 7)
    out = getattr(fam, NAME)(x, y, alpha=2.0)
    torch.testing.assert_close(out, 2 * x + y)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    with pytest.raises(ValueError, match="must match"):
        getattr(fam, NAME)(x, torch.randn(7, 5))


@pytest.mark.parametrize("name", ["linear_logp_backward", "fused_bias_act_", "logmatmul_backward",
                                  "fused_mlp_backward", "linear_logp_dist", "int8_mm"])
def test_refuses_the_name_of_any_registered_kgen_op(tmp_path, name):
    """A family's op is torch.ops.kgen.<name>; shipped families define ops kgen.ops does not
    show (backward and in-place ones), and a plugin redefining one breaks that family."""
    with pytest.raises(KgenError, match=r"already an op \(torch\.ops\.kgen\."):
        scaffold.create(name, tmp_path / "out")
    assert not (tmp_path / "out").exists()
