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


def test_untuned_order_puts_few_rows_on_small_tiles():
    """dispatch's hook where nothing is tuned: spec order above 64 rows; up to 64 rows the gemv
    variants first where they take the rows (16-bit ones from GEMV_MIN_WEIGHTS weights, float32
    always), then the 64-row tiles of each backend (narrower vocabulary tiles first), never a
    128-row tile ahead of a 64-row one of its backend; the same variants, only reordered."""
    def order(dtype, capability, N, D, V):
        shape = {"N": N, "D": D, "V": V}
        vs = [v for v in dispatch._ordered("linear_logp", dtype, capability) if llp.variant_fits(v, shape)]
        got = llp.untuned_order(vs, shape)
        assert sorted(v.name for v in got) == sorted(v.name for v in vs)
        return vs, got

    for dtype in ("bfloat16", "float16", "float32"):
        for capability in ((9, 0), (8, 0)):
            vs, got = order(dtype, capability, 65, 1024, 32000)
            assert got == vs
            for N, D, V in ((1, 1024, 32000), (16, 880, 126832), (1, 448, 1707), (8, 2496, 1211), (17, 824, 68505),
                            (64, 1848, 6082)):
                vs, got = order(dtype, capability, N, D, V)
                gemv = dtype == "float32" or V * D >= llp.tuning.GEMV_MIN_WEIGHTS
                first_gemv = got[0].params.get("kernel") == "gemv"
                if N <= 16 and gemv or capability == (9, 0):  # (sm_80 has no 64-row CUDA tile to go first)
                    assert first_gemv == (N <= 16 and gemv), (dtype, capability, N, got[0].name)
                for backend in ("cuda", "triton"):
                    tiles = [llp.tuning._rows(v) for v in got if v.backend == backend and v.params.get("kernel") != "gemv"]
                    assert tiles == sorted(tiles, key=lambda r: r > 64), (dtype, N, tiles)
    # on Hopper, 16-bit, 17-64 rows or small weights: the 64 x 128 WGMMA tile
    for N, D, V in ((1, 448, 1707), (9, 264, 1513), (30, 3088, 1390), (64, 1848, 6082)):
        first = order("bfloat16", (9, 0), N, D, V)[1][0]
        assert (first.arch, first.params["block_m"], first.params["block_n"]) == ("sm_90a", 64, 128), (N, D, V)
