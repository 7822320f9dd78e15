"""Every shipped linear_logp Triton variant under the interpreter against float64 (CI)."""

from pathlib import Path

import pytest
import torch

from kgen import spec
from kgen.families import linear_logp as llp
from kgen.runtime import dispatch

SPEC = spec.load(Path(__file__).resolve().parent.parent / "kgen" / "specs" / "linear_logp.yaml")


@pytest.mark.parametrize("name", [v.name for v in SPEC.variants if v.backend == "triton"])  # CUDA: compile-only here
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_shipped_variant_under_interpreter(name):
    if torch.cuda.is_available():
        pytest.skip("on a GPU: test_linear_logp_gpu.py runs every variant")
    v = SPEC.variant(name)
    results = llp.golden(dispatch.load(v), torch.device("cpu"), v.dtype, SPEC.numerics[v.dtype])
    assert len(results) == 15
    bad = [(c, e) for c, e in results if not e <= 1.0]
    assert not bad, bad
