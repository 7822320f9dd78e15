"""logmatmul: reference math, every Triton variant under the interpreter (forward and both
gradients against float64, -inf rules, K-split invariance), block-sparse against its dense
equivalent, argument checks, the op under torch.compile, compile-only checks of the CUDA
variants. The `gpu` tests (the same on a GPU, dispatch, graph replay, torch.compile) are in
test_logmatmul_gpu.py, which imports this module's helpers."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from conftest import requires_nvcc
from kgen import spec
from kgen.families import logmatmul as lmm
from kgen.families.logmatmul import launch, numerics
from kgen.runtime import dispatch

ROOT = Path(__file__).resolve().parent.parent
SPEC = spec.load(ROOT / "kgen" / "specs" / "logmatmul.yaml")
TRITON = [v.name for v in SPEC.variants if v.backend == "triton" and v.dtype == "float32"]
TRITON_16 = [v.name for v in SPEC.variants if v.backend == "triton" and v.dtype != "float32"][:1]
CUDA = [v.name for v in SPEC.variants if v.backend == "cuda"]
# the tensor-core CUDA variants (mma = 1), and forms of it beyond the spec's: warps splitting
# an m-tile's K slice (2 and 4 K parts), 8 rows of x a CTA, 1 and 2 chunks of w in flight, two
# m-tiles a warp
MMA = [v.name for v in SPEC.variants if v.backend == "cuda" and v.params["mma"]]
MMA_FORMS = {v.name: v for v in spec.parse(
    "family: logmatmul\nvariants:\n"
    "  - {backend: cuda, arch: [sm_90, sm_80], dtypes: [float32], warps: 4, nodes: 32, vec: 4, unroll: 2, rows: 8, "
    "mma: 1}\n"
    "  - {backend: cuda, arch: [sm_90, sm_80], dtypes: [float32], warps: 4, nodes: 16, vec: 4, mma: 1}\n"
    "  - {backend: cuda, arch: [sm_90, sm_80], dtypes: [float32], warps: 4, nodes: 64, vec: 4, mma: 1, mtiles: 2}\n"
    ).variants}
CPU = torch.device("cpu")
_MODS: dict = {}


def _variant(name):
    return MMA_FORMS[name] if name in MMA_FORMS else SPEC.variant(name)


def _mod(name):
    if name not in _MODS:
        _MODS[name] = lmm.implementation(dispatch.load(_variant(name)))
    return _MODS[name]


@pytest.fixture
def poison(monkeypatch):
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(launch, "_empty", poisoned)


def _assert_ok(results):
    bad = [(case, r) for case, r in results if not r <= 1.0]
    assert not bad, bad


# --------------------------------------------------------------------------- reference


def test_reference_is_the_math():
    x, w = numerics.make_inputs(3, 9, 20, torch.float64, CPU, torch.float64, holes=False)
    naive = torch.log((w[None] * torch.exp(x[:, None, :])).sum(-1))
    torch.testing.assert_close(lmm.reference(x, w, torch.float64), naive, rtol=1e-12, atol=1e-12)


def test_reference_minus_inf_rules_and_gradients():
    """-inf entries, an all -inf row (out -inf), a zero weight row (out -inf); autograd of
    the float64 reference and the written-out backward agree and hold no NaN."""
    x, w = numerics.make_inputs(4, 6, 11, torch.float64, CPU, torch.float64)
    x.requires_grad_(), w.requires_grad_()
    out = lmm.reference(x, w, torch.float64)
    assert torch.isneginf(out[1]).all() and torch.isneginf(out[:, 2]).all()
    assert torch.isfinite(out[0, :2]).all()
    g = torch.randn(out.shape, dtype=torch.float64)
    out.backward(g)
    dx, dw = lmm.reference_backward(x.detach(), w.detach(), out.detach(), g, torch.float64)
    assert not torch.isnan(x.grad).any() and not torch.isnan(w.grad).any()
    torch.testing.assert_close(dx, x.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, w.grad, rtol=1e-10, atol=1e-12)
    assert (x.grad[1] == 0).all() and (w.grad[2] == 0).all()


def test_large_values_do_not_overflow():
    x = torch.tensor([[1000.0, 999.0, -1000.0]])
    w = torch.tensor([[1.0, 2.0, 3.0]])
    out = lmm.logmatmul(x, w)
    want = 1000.0 + math.log(1.0 + 2.0 * math.exp(-1.0))
    assert abs(float(out) - want) < 1e-3


# --------------------------------------------------------------------------- Triton, interpreter


@pytest.mark.parametrize("name", TRITON)
@pytest.mark.parametrize("B,N,K", [(1, 37, 100), (3, 130, 257), (16, 67, 300)])
def test_triton_forward_and_gradients(poison, name, B, N, K):
    tol = SPEC.numerics["float32"]
    _assert_ok(numerics.check_case(_mod(name), B, N, K, torch.float32, torch.float32, CPU, tol, seed=B + K))


@pytest.mark.parametrize("name", TRITON_16)
@pytest.mark.parametrize("w_dtype", ["float32", "same"])
def test_triton_16_bit_inputs(poison, name, w_dtype):
    v = SPEC.variant(name)
    t = getattr(torch, v.dtype)
    wt = torch.float32 if w_dtype == "float32" else t
    _assert_ok(numerics.check_case(_mod(name), 3, 45, 130, t, wt, CPU, SPEC.numerics[v.dtype], seed=5))


@pytest.mark.parametrize("name", TRITON)
def test_k_split_invariance(poison, name):
    """Any number of K splits (more than there are K steps too) gives the same result up to
    float32 rounding; the same split count twice is bit-identical."""
    x, w = numerics.make_inputs(3, 50, 700, torch.float32, CPU)
    mod = _mod(name)
    outs = [launch.forward(mod, x, w, splits=s) for s in (1, 2, 3, 100)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(launch.forward(mod, x, w, splits=3), outs[2])
    assert torch.isneginf(outs[0][1]).all() and torch.isneginf(outs[0][:, 2]).all()


def test_everything_minus_inf(poison):
    """All of x -inf: out is all -inf and both gradients are exactly zero (no NaN)."""
    mod = _mod(TRITON[0])
    x = torch.full((2, 40), float("-inf"), requires_grad=True)
    w = torch.rand(5, 40, requires_grad=True)
    with lmm.using(mod):
        out = lmm.logmatmul(x, w)
        out.sum().backward()
    assert torch.isneginf(out).all()
    assert (x.grad == 0).all() and (w.grad == 0).all()


def nan_case(B: int, K: int = 40, N: int = 5, device=CPU):
    """x and w with a NaN in row 0 of x and in node 1's row of w, an all -inf row 2 of x, a
    -inf entry in row 1 and a zero weight row 3: PyTorch's expression gives NaN outputs in
    row 0 and in column 1 (row 2's included), -inf elsewhere in rows 2 and column 3."""
    g = torch.Generator().manual_seed(B)
    x = torch.randn(B, K, generator=g)
    x[0, 5], x[1, 7] = float("nan"), float("-inf")
    x[2] = float("-inf")
    w = torch.rand(N, K, generator=g)
    w[1, 3], w[3] = float("nan"), 0.0
    return x.to(device), w.to(device)


def assert_nan_as_pytorch(out, dx, dw, x, w):
    """out, dx, dw (the op's, for an all-ones upstream gradient) NaN exactly where the float64
    reference's autograd is, -inf outputs where its are; dx 0 at -inf entries of x (the
    documented rule) instead of its NaN or 0."""
    xr, wr = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    ref = lmm.reference(xr, wr, torch.float64)
    ref.backward(torch.ones_like(ref))
    out, dx, dw = out.cpu(), dx.cpu(), dw.cpu()
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isneginf(out), torch.isneginf(ref))
    assert torch.isnan(out).any() and torch.isneginf(out).any()
    live = ~torch.isneginf(x.cpu())
    assert torch.equal(torch.isnan(dx[live]), torch.isnan(xr.grad[live])) and (dx[~live] == 0).all()
    assert torch.equal(torch.isnan(dw), torch.isnan(wr.grad))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(out[fin].double(), ref[fin].detach(), rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("name", TRITON + TRITON_16)
@pytest.mark.parametrize("B", [3, 12])  # the one-pass backward (B <= bwd_b) and the GEMM form
def test_nan_propagates_as_in_pytorch(poison, name, B):
    """A NaN input gives NaN outputs and gradients where PyTorch's expression does, never a
    plausible -inf (which `s > 0 ? log s : -inf` made of it), in one launch and through the
    K-split combine alike."""
    mod = _mod(name)
    x, w = nan_case(B)
    x = x.to(getattr(torch, SPEC.variant(name).dtype))
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with lmm.using(mod):
        out = lmm.logmatmul(xl, wl)
        out.backward(torch.ones_like(out))
    assert_nan_as_pytorch(out, xl.grad, wl.grad, x, w)
    split = launch.forward(mod, x, w, splits=3)
    assert torch.equal(torch.isnan(split), torch.isnan(out)) and torch.equal(torch.isneginf(split), torch.isneginf(out))


def test_cpu_op_nan_propagates_as_in_pytorch():
    """The CPU path (the float32 reference and its written-out backward) keeps the kernels'
    NaN rule: a NaN output makes NaN the gradient terms it meets (it used to drop them as if
    it were -inf), and an entry of x that is -inf still gets dx = 0."""
    for B in (3, 12):
        x, w = nan_case(B)
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        with lmm.using(None):
            out = lmm.logmatmul(xl, wl)
            out.backward(torch.ones_like(out))
        assert_nan_as_pytorch(out, xl.grad, wl.grad, x, w)


def negative_case(B: int, K: int = 40, device=CPU, with_negative_sum=True):
    """x [B, K] and w with negative weights: node 0 all negative (its sum is negative), node 1
    one negative weight in a positive sum, node 2 +1 and -1 on two equal columns of x and 0
    elsewhere (a sum of exactly 0), nodes 3-4 positive; without node 0 if not
    `with_negative_sum`."""
    g = torch.Generator().manual_seed(B + 100)
    x = torch.randn(B, K, generator=g)
    x[:, 1] = x[:, 0]
    w = torch.rand(5, K, generator=g) + 0.1
    w[0] = -w[0]
    w[1, 3] = -0.05
    w[2] = 0.0
    w[2, 0], w[2, 1] = 1.0, -1.0
    return x.to(device), (w if with_negative_sum else w[1:]).contiguous().to(device)


def assert_negative_weights_as_formula(run, dtype, device=CPU, grad_tol=2e-5):
    """`run(x, w, g)` -> (out, dx, dw): out is log sum_k w exp(x) where the sum is positive
    (against float64), NaN where it is negative (log of a negative number, as the expression
    log(exp(x - m) @ w.T) + m gives), -inf where it is exactly 0; a NaN output makes the
    gradients it meets NaN (every dx, its node's dw row), and without one both gradients are
    the formula's (float64 autograd; bound as numerics.check_case's, relative to the largest)."""
    for B in (3, 12):
        x, w = negative_case(B, device=device)
        x = x.to(dtype)
        g = torch.randn(B, w.shape[0], generator=torch.Generator().manual_seed(B)).to(device)
        out, dx, dw = (t.cpu() for t in run(x, w, g))
        ref = lmm.reference(x.double().cpu(), w.double().cpu(), torch.float64)
        assert torch.isnan(out[:, 0]).all() and torch.isnan(ref[:, 0]).all()
        assert torch.isneginf(out[:, 2]).all() and torch.isneginf(ref[:, 2]).all()
        assert torch.isfinite(out[:, [1, 3, 4]]).all()
        torch.testing.assert_close(out[:, [1, 3, 4]].double(), ref[:, [1, 3, 4]], rtol=2e-5, atol=2e-5)
        assert torch.isnan(dx).all() and torch.isnan(dw[0]).all() and not torch.isnan(dw[1:]).any()
        x, w = negative_case(B, device=device, with_negative_sum=False)
        x = x.to(dtype)
        out, dx, dw = (t.cpu() for t in run(x, w, g[:, 1:]))
        xr, wr = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
        ref = lmm.reference(xr, wr, torch.float64)
        ref.backward(g[:, 1:].double().cpu())
        assert torch.equal(torch.isneginf(out), torch.isneginf(ref)) and not torch.isnan(out).any()
        for got, want in ((dx, xr.grad), (dw, wr.grad)):
            bound = grad_tol * max(1.0, float(want.abs().max()))
            assert float((got.double() - want).abs().max()) <= bound


def _run_op(mod):
    def run(x, w, g):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        with lmm.using(mod):
            out = lmm.logmatmul(xl, wl)
            out.backward(g)
        return out.detach(), xl.grad, wl.grad
    return run


@pytest.mark.parametrize("name", ["reference"] + TRITON + TRITON_16)
def test_negative_weights_give_the_formula_or_nan(poison, name):
    """Negative weights (outside the documented domain) never give a plausible wrong value:
    the formula's value where the sum is positive, NaN where it is negative, on the CPU path
    and every Triton variant (the one-pass backward at B = 3, the GEMM form at 12)."""
    dtype = torch.float32 if name == "reference" else getattr(torch, SPEC.variant(name).dtype)
    tol = 2e-5 if dtype == torch.float32 else numerics.GRAD_TOL[str(dtype).removeprefix("torch.")]
    assert_negative_weights_as_formula(_run_op(None if name == "reference" else _mod(name)), dtype, grad_tol=tol)


@pytest.mark.parametrize("scale", [1e30, 1e-30])
@pytest.mark.parametrize("B", [3, 12])  # the one-pass kernel (B <= bwd_b) and the GEMM form
def test_backward_extreme_weight_scales(poison, scale, B):
    """The backward's factors e' = exp(x - m) 2^S and c' = g exp(m - out) 2^-S stay in
    float32's range when the forward's sums s = exp(out - m) are ~2^100 or ~2^-100 (with
    S = 64 fixed, c' would underflow to 0 at the first). Each gradient is judged against its
    own largest element (float32 sums of ~N terms: 1e-5 of it)."""
    mod = _mod(TRITON[0])
    x, w = numerics.make_inputs(B, 70, 200, torch.float32, CPU, seed=7)
    w = w * scale
    g = torch.randn(B, 70, generator=torch.Generator().manual_seed(8))
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with lmm.using(mod):
        lmm.logmatmul(xl, wl).backward(g)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    lmm.reference(xr, wr, torch.float64).backward(g.double())
    for got, want in ((xl.grad, xr.grad), (wl.grad, wr.grad)):
        big = float(want.abs().max())
        assert big > 0 and torch.isfinite(got).all()
        assert float((got.double() - want).abs().max()) <= 1e-5 * big


# --------------------------------------------------------------------------- block-sparse


def _pattern(R, C, density, bs, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(R, C, generator=g) < density
    keep[0, 0] = True
    if R > 1:
        keep[1] = False  # a block row with no blocks: its outputs are -inf
    rows, cols = keep.nonzero(as_tuple=True)
    row_ptr = torch.zeros(R + 1, dtype=torch.int32)
    row_ptr[1:] = torch.cumsum(keep.sum(1), 0).to(torch.int32)
    blocks = torch.rand(rows.shape[0], bs, bs, generator=g).to(dtype)
    return blocks, row_ptr, cols.to(torch.int32)


@pytest.mark.parametrize("impl", ["reference", TRITON[0], TRITON[1]])
def test_block_sparse_matches_dense(poison, impl):
    bs, R, C, B = 32, 3, 4, 3
    blocks, row_ptr, col_idx = _pattern(R, C, 0.5, bs, seed=1)
    x, _ = numerics.make_inputs(B, 1, C * bs, torch.float32, CPU)
    mod = None if impl == "reference" else _mod(impl)
    xs, bl = x.clone().requires_grad_(), blocks.clone().requires_grad_()
    with lmm.using(mod):
        out = lmm.block_sparse_logmatmul(xs, bl, row_ptr, col_idx, bs)
    g = torch.randn(out.shape)
    out.backward(g)
    w = lmm.dense_from_blocks(blocks.double(), row_ptr, col_idx, bs, C * bs).requires_grad_()
    xd = x.double().requires_grad_()
    ref = lmm.reference(xd, w, torch.float64)
    ref.backward(g.double())
    assert torch.isneginf(out[:, bs:2 * bs]).all()
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out[finite].double(), ref[finite].detach(), rtol=1e-5, atol=3e-5)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    dw_blocks = w.grad.reshape(R, bs, C, bs).permute(0, 2, 1, 3)[launch.block_rows(row_ptr, blocks.shape[0]),
                                                                   col_idx.long()]
    scale = max(1.0, float(xd.grad.abs().max()))
    torch.testing.assert_close(xs.grad.double(), xd.grad, rtol=0, atol=2e-5 * scale)
    scale = max(1.0, float(dw_blocks.abs().max()))
    torch.testing.assert_close(bl.grad.double(), dw_blocks, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("impl", ["reference", TRITON[0], TRITON_16[0]])
def test_a_nan_row_makes_dw_nan_also_where_its_x_is_minus_inf(poison, impl):
    """A row whose outputs are NaN makes NaN every dw term it meets, also at an entry of x
    that is -inf (exp(-inf - NaN), as autograd of the expression gives): the CPU path as the
    kernels; its dx stays 0 there."""
    x = torch.full((2, 4), float("-inf"))
    x[0, 1] = float("nan")
    x[1] = torch.randn(4, generator=torch.Generator().manual_seed(3))
    w = torch.rand(3, 4, generator=torch.Generator().manual_seed(4))
    dtype = torch.float32 if impl == "reference" else getattr(torch, SPEC.variant(impl).dtype)
    xl, wl = x.to(dtype, copy=True).requires_grad_(), w.clone().requires_grad_()
    with lmm.using(None if impl == "reference" else _mod(impl)):
        lmm.logmatmul(xl, wl).sum().backward()
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    torch.logsumexp(xr[:, None, :] + wr.log()[None], -1).sum().backward()
    assert torch.isnan(wl.grad).all() and torch.isnan(wr.grad).all()
    assert (xl.grad[0, [0, 2, 3]] == 0).all() and torch.isnan(xl.grad[0, 1])
    # block-sparse: block row 0's child (columns 0-31) holds the NaN, block row 1's does not
    blocks = torch.rand(2, 32, 32, generator=torch.Generator().manual_seed(5))
    row_ptr, col_idx = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    x = torch.full((2, 64), float("-inf"))
    x[0, 3], x[0, 40] = float("nan"), 0.5
    x[1] = torch.randn(64, generator=torch.Generator().manual_seed(6))
    xl, bl = x.to(dtype).requires_grad_(), blocks.clone().requires_grad_()
    with lmm.using(None if impl == "reference" else _mod(impl)):
        out = lmm.block_sparse_logmatmul(xl, bl, row_ptr, col_idx, 32)
        out.sum().backward()
    assert torch.isnan(out[0, :32]).all() and torch.isfinite(out[0, 32:]).all()
    assert torch.isnan(bl.grad[0]).all() and not torch.isnan(bl.grad[1]).any()
    assert torch.isnan(xl.grad[0, 3]) and torch.isnan(xl.grad).sum() == 1
    assert (xl.grad[0][torch.isneginf(x[0])] == 0).all()


@pytest.mark.parametrize("impl", ["reference", TRITON[0], TRITON[1]])
def test_block_sparse_nan_propagates(poison, impl):
    """A NaN in x or in a block gives NaN outputs exactly where a present block's terms meet
    it (absent blocks are no terms: 0 x NaN is not summed); the empty block row stays -inf;
    the rest as the dense expression without the NaNs."""
    bs, R, C, B = 32, 3, 4, 3
    blocks, row_ptr, col_idx = _pattern(R, C, 0.5, bs, seed=1)
    blocks[0, 2, 5] = float("nan")  # block row 0, node 2
    x, _ = numerics.make_inputs(B, 1, C * bs, torch.float32, CPU)
    x[1, 9] = float("nan")
    with lmm.using(None if impl == "reference" else _mod(impl)):
        out = lmm.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, bs)
    present = lmm.dense_from_blocks(torch.ones_like(blocks), row_ptr, col_idx, bs, C * bs) > 0
    w = lmm.dense_from_blocks(blocks.double(), row_ptr, col_idx, bs, C * bs)
    hit = (present[None] & (torch.isnan(x)[:, None, :] | torch.isnan(w)[None])).any(-1)
    assert hit.any() and not hit.all()
    assert torch.equal(torch.isnan(out), hit)
    xd = x.double()
    ref = lmm.reference(torch.where(torch.isnan(xd), float("-inf"), xd), torch.nan_to_num(w, nan=0.0), torch.float64)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref) & ~hit) and torch.isneginf(out[:, bs:2 * bs]).all()
    torch.testing.assert_close(out[~hit].double(), ref[~hit], rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("impl", ["reference"] + TRITON + TRITON_16)
def test_plus_inf_in_x_gives_nan_on_every_path(poison, impl):
    """+inf in x is outside the domain: every output of its row is NaN (x - max is
    inf - inf), on the CPU path as in the kernels, dense and block-sparse; the other rows are
    the float64 values."""
    x, w = numerics.make_inputs(3, 5, 64, torch.float32, CPU, holes=False)
    x[1, 7] = float("inf")
    blocks, row_ptr, col_idx = _pattern(1, 2, 1.0, 32, seed=2)  # (one block row: no empty one)
    dtype = torch.float32 if impl == "reference" else getattr(torch, SPEC.variant(impl).dtype)
    x = x.to(dtype)
    with lmm.using(None if impl == "reference" else _mod(impl)):
        dense = lmm.logmatmul(x, w)
        sparse = lmm.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, 32)
    wb = lmm.dense_from_blocks(blocks, row_ptr, col_idx, 32, 64)
    for out, weights in ((dense, w), (sparse, wb)):
        assert torch.isnan(out[1]).all()
        fin = torch.tensor([0, 2])
        want = torch.logsumexp(x[fin].double()[:, None, :] + weights.double().log()[None], -1)
        torch.testing.assert_close(out[fin].double(), want, rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("impl,form", [("reference", None)] + [(v, f) for v in TRITON + TRITON_16
                                                                 for f in ("direct", "chunks", "gemm")])
def test_plus_inf_in_x_gives_nan_gradients_on_every_path(monkeypatch, impl, form):
    """The backward of a row with +inf in x: NaN dx at every entry of x but those that are
    -inf (dx 0, as the docstring says), never a plausible 0 (its maximum m is +inf, so e' is 0
    at every finite x: the -inf rule alone read them as -inf), through the one-pass kernel
    writing dx directly, its chunks' partials summed, and the GEMM form; dw NaN where that row's
    x is finite; the other rows' dx the float64 values. Buffers start as a finite sentinel
    (not NaN: an unwritten element would pass for a NaN gradient)."""
    from kgen.families.logmatmul import backward_launch, plans

    monkeypatch.setattr(launch, "_empty", lambda shape, dtype, device: torch.full(shape, 7.0, dtype=dtype,
                                                                                  device=device))
    N = 5 if form != "chunks" else 640
    x, w = numerics.make_inputs(3, N, 64, torch.float32, CPU, holes=False)
    x[1, 7], x[1, 3] = float("inf"), float("-inf")
    dtype = torch.float32 if impl == "reference" else getattr(torch, SPEC.variant(impl).dtype)
    x = x.to(dtype)
    g = torch.randn(3, N, generator=torch.Generator().manual_seed(7))
    if impl == "reference":
        xl = x.clone().requires_grad_()
        lmm.logmatmul(xl, w).backward(g)
        dx = xl.grad
    else:
        mod = _mod(impl)
        if form == "chunks":
            assert plans.bwd_chunks(mod, N, 64, backward_launch.sm_count(CPU))[0] > 1
        with lmm.using(mod):
            out = lmm.logmatmul(x, w)
        dx, dw = backward_launch.backward(mod, x, w, out, g, gemm=form == "gemm")
        finite = torch.isfinite(x[1].float())
        assert torch.isnan(dw[:, finite]).all()
    assert torch.isnan(dx[1, torch.arange(64) != 3]).all() and dx[1, 3] == 0
    fin = torch.tensor([0, 2])
    xd = x[fin].double().requires_grad_()
    torch.logsumexp(xd[:, None, :] + w.double().log()[None], -1).backward(g[fin].double())
    torch.testing.assert_close(dx[fin].double(), xd.grad, rtol=2e-2 if dtype != torch.float32 else 1e-4, atol=1e-4)


def test_cpu_path_checks_the_pattern_values():
    """On the CPU path, which reads row_ptr and col_idx anyway, a malformed pattern is a
    ValueError naming the first bad entry, not a plausible wrong result (a negative column
    wrapping round, a block left out of every row) or an IndexError from inside."""
    blocks = torch.rand(6, 32, 32, generator=torch.Generator().manual_seed(4))
    x = torch.randn(2, 96)  # 3 block columns
    ptr, cols = torch.tensor([0, 3, 6]), torch.tensor([0, 1, 2, 0, 1, 2])
    lmm.block_sparse_logmatmul(x, blocks, ptr, cols, 32)  # well-formed
    bad = [(torch.tensor([1, 3, 6]), cols, "run from 0 to nnz = 6; got 1 .. 6"),
           (torch.tensor([0, 3, 5]), cols, "run from 0 to nnz = 6; got 0 .. 5"),
           (torch.tensor([0, 4, 3, 6]), cols, r"nondecreasing; row_ptr\[1\] = 4 > row_ptr\[2\] = 3"),
           (ptr, torch.tensor([0, 1, 2, 0, 0, 2]), r"col_idx\[4\] = 0 repeats a column of block row 1"),
           (ptr, torch.tensor([0, 1, -1, 0, 1, 2]), r"col_idx\[2\] = -1 is outside"),
           (ptr, torch.tensor([0, 1, 2, 0, 1, 3]), r"col_idx\[5\] = 3 is outside \[0, K / block_size = 3\)")]
    for rp, ci, match in bad:
        with pytest.raises(ValueError, match=match):
            lmm.block_sparse_logmatmul(x, blocks, rp, ci, 32)


def test_block_size_takes_integers_only():
    """block_size: any integer (numpy's, a 0-d integer tensor), never a float truncated."""
    import numpy as np

    blocks, row_ptr, col_idx = _pattern(2, 2, 1.0, 32, seed=3)
    x = torch.randn(2, 64)
    want = lmm.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, 32)
    for bs in (np.int64(32), torch.tensor(32)):
        assert torch.equal(lmm.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, bs), want)
    for bs in (32.0, 32.7, "32", torch.tensor(32.0)):
        with pytest.raises(TypeError, match="block_size must be an int"):
            lmm.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, bs)


# --------------------------------------------------------------------------- the op


def test_cpu_op_against_float64():
    """CPU tensors run the float32 reference (forward and the written-out backward)."""
    _assert_ok(numerics.check_case(None, 3, 20, 33, torch.float32, torch.float32, CPU, SPEC.numerics["float32"]))


@pytest.mark.parametrize("args,err", [
    ((torch.zeros(2, 3, dtype=torch.int32), torch.zeros(4, 3)), TypeError),
    ((torch.zeros(2, 3), torch.zeros(4, 3, dtype=torch.float64)), TypeError),
    ((torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.float16)), TypeError),
    ((torch.zeros(2, 3), torch.zeros(4, 5)), ValueError),
    ((torch.zeros(3), torch.zeros(4, 3)), ValueError),
    ((torch.zeros(2, 3), "w"), TypeError),
])
def test_bad_inputs_raise(args, err):
    with pytest.raises(err):
        lmm.logmatmul(*args)


def test_bad_block_sparse_inputs_raise():
    blocks, row_ptr, col_idx = _pattern(2, 2, 1.0, 32, seed=0)
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="power of two"):
        lmm.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, 48)
    with pytest.raises(ValueError, match="multiple"):
        lmm.block_sparse_logmatmul(torch.zeros(2, 70), blocks, row_ptr, col_idx, 32)
    with pytest.raises(TypeError, match="int32 or int64"):
        lmm.block_sparse_logmatmul(x, blocks, row_ptr.float(), col_idx, 32)


def test_fake_impl_and_opcheck():
    x, w = torch.randn(3, 8, device="meta"), torch.rand(5, 8, device="meta")
    assert torch.ops.kgen.logmatmul(x, w).shape == (3, 5)
    xr, wr = torch.randn(3, 8), torch.rand(5, 8)
    torch.library.opcheck(torch.ops.kgen.logmatmul.default, (xr, wr))


def test_torch_compile_fullgraph_forward_and_backward():
    x, w = torch.randn(3, 17, requires_grad=True), torch.rand(6, 17, requires_grad=True)
    f = torch.compile(lambda a, b: lmm.logmatmul(a, b).exp().sum(), fullgraph=True, backend="aot_eager")
    f(x, w).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    lmm.reference(x, w).exp().sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)


def test_tune_hooks():
    assert lmm.tune_bucket(1, 4096, 4096) == "B<=1.N<=4096.K<=4096"
    assert lmm.tune_bucket(9, 4000, 3000) == "B<=16.N<=4096.K<=4096"
    shapes = {(s["B"], s["N"], s["K"]) for s in lmm.TUNE_SHAPES}
    assert {(b, 4096, 4096) for b in (1, 2, 4, 8, 16, 64, 256)} <= shapes
    inputs = lmm.tune_inputs(CPU, "float32", B=2, N=8, K=16)
    assert lmm.tune_runner(None, inputs)().shape == (2, 8)


def test_untuned_shapes_put_the_batchs_tile_first():
    """dispatch's hook where nothing is tuned: spec order below B = 16 and for small weights
    at B = 16, but the tensor-core CUDA form first at 8-64 rows of float32 over large weights
    and a CUDA FMA form at 17-64 rows over little work (the tensor-core form over many
    outputs, also at 5-16 rows); else from B = 16 the tl.dot variant whose rows match the
    batch first (16 to B = 32, 64 below 512, else 128), small weights and few outputs the
    small-batch Triton form; the rest after it."""
    vs = dispatch._ordered("logmatmul", "float32", (9, 0))

    def order(B, N, K):
        return lmm.untuned_order(vs, {"B": B, "N": N, "K": K})

    assert order(7, 4096, 4096) == vs and order(8, 2048, 2047) == vs and order(16, 512, 512) == vs
    # 8-64 rows of float32 over 4M weights or more: the tensor-core CUDA form first
    for B, N, K in ((8, 4096, 4096), (16, 777, 12004), (12, 300, 20000), (16, 2048, 2048), (17, 777, 12004),
                    (40, 6000, 800), (64, 4096, 4096)):
        first, *rest = order(B, N, K)
        assert first.backend == "cuda" and first.params["mma"] == 1, (B, N, K)
        assert rest == [v for v in vs if v is not first]
    for B, N, K in ((16, 2048, 2047), (65, 4096, 4096)):
        assert order(B, N, K)[0].params.get("mma", 0) == 0, (B, N, K)
    bf16 = dispatch._ordered("logmatmul", "bfloat16", (9, 0))  # (no tensor-core form: tl.dot at B = 16)
    assert lmm.untuned_order(bf16, {"B": 16, "N": 4096, "K": 4096})[0].params["block_b"] == 16
    for B, rows in ((17, 16), (32, 16), (64, 64), (127, 64), (130, 64), (256, 64), (511, 64), (512, 128), (4096, 128)):
        dtype_vs = bf16 if B <= 64 else vs  # (float32 to B = 64: the tensor-core form, above)
        first, *rest = lmm.untuned_order(dtype_vs, {"B": B, "N": 4096, "K": 4096})
        assert first.backend == "triton" and first.params["block_b"] == rows and first.params["dot"] != "none"
        assert rest == [v for v in dtype_vs if v is not first]
    # 17-64 rows up to FMA_OUTPUTS outputs and FMA_WORK multiply-adds: a CUDA FMA form (row
    # tiles side by side); float32 from MMA_OUTPUTS outputs at a short K or over MMA_MIN_WEIGHTS
    # weights, or beyond FMA_OUTPUTS, the tensor-core one; K in whole 16-byte vectors of x's
    # dtype only (the CUDA forms' loads), the Triton rules otherwise; 5-16 rows over many
    # outputs the tensor-core form or the 16-row tl.dot tile
    for dtype_vs, B, N, K, form in ((vs, 64, 512, 512, "fma"), (vs, 17, 1500, 2000, "fma"),
                                    (vs, 24, 1500, 2000, "mma"),
                                    (vs, 64, 2000, 300, "mma"), (vs, 64, 700, 700, "fma"), (vs, 17, 300, 2000, "fma"),
                                    (vs, 40, 64, 4096, "fma"), (vs, 64, 500, 8000, "mma"), (vs, 33, 513, 510, "triton"),
                                    (vs, 53, 2391, 32, "mma"), (vs, 28, 1200, 400, "fma"), (vs, 60, 1200, 400, "mma"),
                                    (bf16, 40, 3616, 240, "triton"), (bf16, 31, 2000, 800, "fma"),
                                    (vs, 11, 10077, 16, "mma"), (vs, 15, 4120, 368, "mma"), (vs, 5, 5422, 856, "fma"),
                                    (vs, 4, 20000, 64, "fma"), (bf16, 9, 13781, 16, "triton"), (bf16, 15, 3623, 616, "fma"),
                                    (bf16, 20, 2000, 2000, "fma"), (bf16, 40, 3000, 1000, "triton"),
                                    (bf16, 40, 300, 2004, "triton"), (bf16, 17, 4096, 4096, "triton"),
                                    (bf16, 64, 512, 512, "fma")):
        first = lmm.untuned_order(dtype_vs, {"B": B, "N": N, "K": K})[0]
        got = "triton" if first.backend == "triton" else "mma" if first.params.get("mma", 0) else "fma"
        assert got == form, (B, N, K, first.name)
    # a CUDA form without row tiles (a user's `rows: 0`) is passed over beyond the rows it holds
    untiled = [dataclasses.replace(v, knobs=tuple({**v.params, "rows": 0}.items()))
               if v.backend == "cuda" and not v.params["mma"]
               else v for v in vs]
    assert lmm.untuned_order(untiled, {"B": 64, "N": 512, "K": 512})[0].backend == "triton"
    assert lmm.untuned_order(untiled, {"B": 4, "N": 512, "K": 512})[0].backend == "cuda"
    # small weights but many outputs or much work: the small-batch form's programs grow with B x N
    # and its time with B x N x K
    # (B x N over 32K: the 16-row tile, one launch as the small-batch form is, runs ahead)
    for B, N, K in ((60, 4679, 25), (130, 1200, 60), (24, 12000, 9), (121, 1102, 99), (107, 829, 1262),
                    (370, 188, 22), (65, 1200, 120), (272, 400, 52), (130, 300, 546), (94, 730, 900)):
        first = order(B, N, K)[0]
        assert first.backend == "triton" and first.params["dot"] != "none", (B, N, K)
    for B, N, K in ((86, 102, 15), (160, 152, 868), (62, 88, 283), (250, 130, 64)):
        assert order(B, N, K)[0].params["dot"] == "none", (B, N, K)
    # odd K from ODD_K_SMALL_K: the small-batch form up to 96K outputs (float32) or 32K
    # (16-bit x), whatever the weights' size; the tiles beyond, and at an even or shorter K
    for dtype_vs, B, N, K, small in ((vs, 130, 300, 545, True), (vs, 115, 312, 657, True), (vs, 57, 1401, 1341, True),
                                     (vs, 60, 2000, 1001, False), (vs, 130, 300, 511, False),
                                     (vs, 130, 300, 546, False), (vs, 16, 2000, 1001, False),
                                     (bf16, 100, 300, 545, True), (bf16, 130, 300, 545, False)):
        first = lmm.untuned_order(dtype_vs, {"B": B, "N": N, "K": K})[0]
        assert (first.backend == "triton" and first.params["dot"] == "none") == small, (B, N, K, first.name)
    # the largest tile a dtype has up to the batch's rows; 16 rows where K is odd (the tiles'
    # loads then are single elements; K % 4 == 2 loads pairs and keeps the rows rule)
    for B, N, K, rows in ((276, 350, 4001, 16), (64, 4096, 4097, 16), (64, 4096, 4098, 64), (256, 4096, 4096, 64),
                          (300, 4096, 1028, 64), (64, 4096, 4096, 64), (137, 2275, 450, 64)):
        v = lmm.rules._by_batch(bf16, B, N, K)
        assert v.params["block_b"] == rows and v.params["dot"] != "none", (B, N, K, v.name)
    # 16 where the wide tile's programs are short of a wave (fewer still at a wide K):
    # cdiv(B, rows) x cdiv(N, 64) against 128 at K <= 128, 32 beyond; and where the work is
    # under 64M at K > 16 (every tile then takes its exps in the tile loop)
    f32 = dispatch._ordered("logmatmul", "float32", (9, 0))
    for B, N, K, rows in ((110, 1200, 120, 16), (130, 2500, 120, 16), (100, 4679, 120, 16), (200, 2500, 120, 16),
                          (60, 1900, 1026, 16), (100, 1200, 1024, 64), (70, 12000, 1024, 64), (120, 4679, 120, 64),
                          (370, 1880, 22, 16), (300, 4000, 22, 16), (386, 3152, 16, 64), (600, 4000, 16, 128),
                          (700, 1200, 16, 16), (600, 2000, 128, 128)):  # 700 x 1200: 120 programs of 128 rows
        v = lmm.rules._by_batch(f32, B, N, K)
        assert v.params["block_b"] == rows and v.params["dot"] != "none", (B, N, K, v.name)


def test_cuda_backward_chunks_cover_n_within_shared_memory():
    from kgen.families.logmatmul.plans import BWD_B, BWD_CUDA_SMEM, bwd_cuda_chunks, pow2_at_least

    for B in range(1, BWD_B + 1):
        for N, K in ((1, 4), (5, 1028), (300, 516), (4096, 4096), (100000, 512), (3, 65536)):
            chunks, rows = bwd_cuda_chunks(B, N, K, 132)
            # (the kernel keeps pow2(B) factors a row: 3 rows of x take 4)
            assert (chunks - 1) * rows < N <= chunks * rows and 4 * pow2_at_least(B) * rows <= BWD_CUDA_SMEM
    assert bwd_cuda_chunks(1, 4096, 4096, 132) == (66, 63)  # 8 column tiles x 66 chunks: 528 CTAs
    assert bwd_cuda_chunks(16, 4096, 4096, 132) == (33, 125)  # 9-16 rows: 16 tiles of 256 columns


class _FakeCuda:
    """A loaded CUDA variant whose launcher records its arguments (host-path tests on CPU)."""

    name, ptr = "fake", 1234
    params = {"vec": 4, "nodes": 4, "warps": 4, "waves": 4, "unroll": 2, "rows": 0}

    class variant:
        dtype = "float32"

    def __init__(self):
        self.calls = []

    def raw(self, *args):
        self.calls.append(args)
        return 0

    def fail(self, rc):
        raise RuntimeError(rc)


def test_a_triton_forwards_backward_runs_a_cuda_library_where_one_takes_it(monkeypatch):
    """B <= 16 with float32 w, a forward dispatch put on a Triton module: the backward runs a
    CUDA variant of x's dtype wrapped around that module (its library's one pass over w),
    loaded once per module; a CUDA forward, B past BWD_B, 16-bit w, a CPU tensor, a `using`
    block and CUDA_BACKWARD off keep the module, as does a dtype no CUDA variant loads for."""
    from types import SimpleNamespace as NS

    from kgen.families.logmatmul import op as lop

    picked = []

    def select(family, device, dtype, backend=None, shape=None):
        picked.append((family, dtype, backend))
        return _FakeCuda()

    monkeypatch.setattr(dispatch, "select", select)
    monkeypatch.setattr(lop, "_BWD_CUDA", {})
    tri = object()  # a Triton module
    gpu = torch.device("cuda", 0)
    x, w32 = NS(shape=(12, 64), device=gpu, dtype=torch.float32), NS(dtype=torch.float32)
    got = lop._backward_module(tri, x, w32)
    assert isinstance(got, launch.CudaForward) and got.triton is tri
    assert picked == [("logmatmul", "float32", "cuda")]
    assert lop._backward_module(tri, x, w32) is got and len(picked) == 1  # loaded once
    assert lop._backward_module(got, x, w32) is got
    assert lop._backward_module(tri, NS(shape=(17, 64), device=gpu, dtype=torch.float32), w32) is tri
    assert lop._backward_module(tri, x, NS(dtype=torch.bfloat16)) is tri
    assert lop._backward_module(tri, NS(shape=(12, 64), device=torch.device("cpu"), dtype=torch.float32), w32) is tri
    with lop.using(tri):
        assert lop._backward_module(tri, x, w32) is tri
    monkeypatch.setattr(launch, "CUDA_BACKWARD", False)
    assert lop._backward_module(tri, x, w32) is tri
    monkeypatch.setattr(launch, "CUDA_BACKWARD", True)
    monkeypatch.setattr(dispatch, "select", lambda *a, **k: picked.append("none"))
    xb = NS(shape=(3, 64), device=gpu, dtype=torch.bfloat16)
    assert lop._backward_module(tri, xb, w32) is tri and lop._backward_module(tri, xb, w32) is tri
    assert picked.count("none") == 1  # remembered


def test_fast_path_launches_what_the_general_path_does(monkeypatch):
    """The op's eager fast path (a bound launcher per call signature) passes the kernel the
    same arguments as CudaForward.run, and steps aside for gradients, `using` blocks,
    non-contiguous or unaligned inputs and signatures it has not seen."""
    from kgen.families.logmatmul import op as lop

    monkeypatch.setattr(launch, "current_raw_stream", lambda index: 77)
    kernel = _FakeCuda()
    mod = launch.CudaForward(kernel, None)
    B, N, K = 3, 40, 512
    x, w = torch.randn(B, K), torch.rand(N, K)
    mod._plans[(B, N, K, torch.float32, torch.float32, None)] = (1, K)  # the plan a GPU would make
    assert mod.run(x, w, torch.empty(B, N), B, N, K)
    fast = mod.direct(B, N, K, torch.float32, torch.float32, x.device)
    out = fast(x, w)
    assert out.shape == (B, N) and out.dtype == torch.float32 and out.is_contiguous()
    general, direct = kernel.calls
    assert general[:5] + general[8:] == direct[:5] + direct[8:]  # all but the output pointers
    assert direct[5] == direct[6] == direct[7] == out.data_ptr()
    # a K split: the partials in one scratch a call, part_s from the first 16-byte boundary
    # past part_m's splits x B floats; the rest as the general path passes it
    x2, w2 = torch.randn(B, 1024), torch.rand(N, 1024)
    mod._plans[(B, N, 1024, torch.float32, torch.float32, None)] = (3, 352)
    kernel.calls.clear()
    assert mod.run(x2, w2, torch.empty(B, N), B, N, 1024)
    out2 = mod.direct(B, N, 1024, torch.float32, torch.float32, x.device)(x2, w2)
    g2, d2 = kernel.calls
    assert g2[:5] + g2[8:] == d2[:5] + d2[8:] and d2[11:13] == (3, 352)
    assert d2[7] == out2.data_ptr() and d2[6] - d2[5] == 4 * 12 and len({d2[5], d2[6], d2[7]}) == 3
    kernel.calls[:] = [general, direct]
    # a signature the kernel does not take (K = 33: rows not whole 16-byte vectors): the
    # Triton companion's launcher, as the general path would run the companion
    companion = object()
    mod.triton = companion
    seen = []
    monkeypatch.setattr(launch, "triton_direct", lambda m, *a: seen.append((m, *a)) or "companion's")
    assert mod.direct(B, N, 33, torch.float32, torch.float32, x.device) == "companion's"
    assert seen == [(companion, B, N, 33, x.device)] and kernel.calls == [general, direct]
    mod.triton = None

    monkeypatch.setitem(lop._FAST, (x.shape, w.shape, x.dtype, w.dtype, x.device, w.device), fast)
    kernel.calls.clear()
    lmm.logmatmul(x, w)
    assert len(kernel.calls) == 1
    unaligned = torch.randn(B * K + 1)[1:].view(B, K)
    for args in ((x.t().contiguous().t(), w), (unaligned, w), (x.requires_grad_(), w), (x[:2], w)):
        lmm.logmatmul(*args)  # the CPU reference serves
    x.requires_grad_(False)
    with lmm.using(None):
        lmm.logmatmul(x, w)
    assert len(kernel.calls) == 1


@pytest.mark.parametrize("name", [TRITON[0], TRITON[-1]])
def test_triton_forward_at_every_k_alignment(name):
    """The Triton forward's KA (the largest power of two up to 16 dividing K, which the
    kernels fold into K so that the compiler sees the rows' alignment) at K of every
    alignment, split and unsplit: within float32 rounding of the float64 reference."""
    mod = _mod(name)
    for K in (37, 98, 100, 200, 48, 1001):
        x, w = torch.randn(3, K) * 3, torch.rand(21, K)
        out = launch.forward(mod, x, w)
        torch.testing.assert_close(out, lmm.reference(x.double(), w.double()).float(), rtol=1e-5, atol=1e-5)


def test_fast_path_of_a_triton_variant_runs_its_forward(monkeypatch):
    """A Triton variant's fast path (launch.triton_direct): the forward the op runs, bit for
    bit, at a shape off every tile; it declines non-contiguous inputs (the op copies them)."""
    from kgen.families.logmatmul import op as lop

    mod = _mod(TRITON[0])
    B, N, K = 3, 37, 100
    x, w = torch.randn(B, K) * 3, torch.rand(N, K)
    fast = launch.triton_direct(mod, B, N, K, CPU)
    for _ in range(2):  # the first call launches and tries to record; the interpreter never does
        out = fast(x, w)
        assert torch.equal(out, launch.forward(mod, x, w))
    torch.testing.assert_close(out, lmm.reference(x.double(), w.double()).float(), rtol=1e-5, atol=1e-5)
    assert fast(x.t().contiguous().t(), w) is None and fast(x, w.t().contiguous().t()) is None
    calls = []
    monkeypatch.setitem(lop._FAST, (x.shape, w.shape, x.dtype, w.dtype, x.device, w.device),
                        lambda x, w: calls.append(1) or fast(x, w))
    assert torch.equal(lmm.logmatmul(x, w), out) and calls == [1]


def test_backward_direct_of_a_triton_variant_runs_its_backward(poison):
    """The backward's bound form (backward_launch.backward_direct) of a Triton variant under the
    interpreter, in each form: the one-pass kernel with one chunk of N and with several, the GEMM
    form with w float32 and in x's dtype. Call after call it gives `backward`'s gradients bit for
    bit into new (poisoned) buffers, within GRAD_TOL of float64; the interpreter's launches are
    never recorded for replay."""
    from kgen.families.logmatmul import backward_launch

    for name in (TRITON[0], TRITON_16[0]):
        mod = _mod(name)
        t = getattr(torch, _variant(name).dtype)
        bb = mod.BWD_B
        for B, N, K, wt, form in ((min(2, bb), 20, 70, torch.float32, (False, 1)), (bb, 300, 70, torch.float32, None),
                                  (bb + 2, 37, 100, torch.float32, (True, 1)), (bb + 2, 37, 100, t, (True, 1))):
            plan = backward_launch._bwd_plan(mod, B, N, K, CPU)
            assert plan[:2] == form if form else not plan[0] and plan[1] > 1, (name, B, N, K, plan)
            x, w = numerics.make_inputs(B, N, K, t, CPU, w_dtype=wt, seed=B + N)
            g = torch.randn(B, N, generator=torch.Generator().manual_seed(N), dtype=torch.float64)
            out = launch.forward(mod, x, w)
            f = backward_launch.backward_direct(mod, B, N, K, t, wt, CPU)
            got = [f(x, w, out, g.float()) for _ in range(2)]
            want = backward_launch.backward(mod, x, w, out, g.float())
            for dx, dw in got:
                assert torch.equal(dx, want[0]) and torch.equal(dw, want[1]), (name, B, N, K, wt)
            assert got[0][0].data_ptr() != got[1][0].data_ptr()
            xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
            lmm.reference(xr, wr, torch.float64).backward(g)
            for have, ref, gt in ((got[0][0], xr.grad, t), (got[0][1], wr.grad, wt)):
                bound = numerics.GRAD_TOL[str(gt).removeprefix("torch.")] * max(1.0, float(ref.abs().max()))
                assert float((have.double() - ref).abs().max()) <= bound, (name, B, N, K, wt)
            cells = [c.cell_contents for c in f.__closure__]
            recorded = [c for c in cells if isinstance(c, backward_launch._Recorded)]
            assert recorded and all(r.rep is None for r in recorded)


@pytest.mark.parametrize("name,B,N,K,splits,pre", [(TRITON[0], 3, 37, 100, 1, False), (TRITON[-1], 5, 70, 300, 1, False),
                                                   (TRITON[-1], 2, 40, 4096, 3, False),
                                                   (TRITON[-1], 50, 3990, 1024, 2, True)])  # 204M: the exp launch
def test_triton_fast_path_replays_the_forward_launches(monkeypatch, name, B, N, K, splits, pre):
    """With the launches recorded (FakeTriton, test_triton_launch), the fast path's later calls
    launch the binaries `forward` launched, with the same grids and arguments (pointers as
    integers): x and w as given, the output and scratch new; a hook set since sends the call
    back through Triton's own launch. A wide tl.dot tile launches its exp pass first only at
    large work (plans.pre_pass)."""
    from types import SimpleNamespace

    from test_triton_launch import FakeTriton

    from kgen.runtime import triton_launch as tlaunch

    real = _mod(name)
    fakes = {k: FakeTriton(getattr(real, k).fn) for k in ("logmatmul_exp_kernel", "logmatmul_fwd_kernel",
                                                          "logmatmul_combine_kernel")}
    mod = SimpleNamespace(**{k: getattr(real, k) for k in ("BLOCK_B", "BLOCK_N", "BLOCK_K", "WAVES", "DOT",
                                                           "NUM_WARPS", "NUM_STAGES")},
                          **{k: f.jit for k, f in fakes.items()})
    monkeypatch.setattr(tlaunch, "current_device", lambda: None)
    monkeypatch.setattr(tlaunch, "current_raw_stream", lambda index: 77)
    monkeypatch.setattr(launch, "k_split", lambda *a: (splits, -(-K // splits)))
    tlaunch.clear()
    x, w = torch.randn(B, K), torch.rand(N, K)
    launch.forward(mod, x, w)
    general = [f.launches[-1] for f in fakes.values() if f.launches]
    fast = launch.triton_direct(mod, B, N, K, CPU)
    fast(x, w)  # records
    for f in fakes.values():
        f.launches.clear()
    out = fast(x, w)
    direct = [f.launches[-1] for f in fakes.values() if f.launches]
    assert len(direct) == len(general) == 1 + pre + (splits > 1)
    inputs = {x.data_ptr(), w.data_ptr()}
    for (kind, binary, grid, _, _, args), g in zip(direct, general):
        assert kind == "direct" and binary is g[1] and grid[0] == g[2][0]
        want = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in g[5]]
        for a, b in zip(args, want):
            if b in inputs or not isinstance(b, int) or b < 1 << 20:  # inputs and scalars: the same
                assert a == b
    fwd_args = direct[1 if pre else 0][5]
    assert fwd_args[4] == out.data_ptr()
    assert all(f.launches[-1][0] == "direct" for f in fakes.values() if f.launches)
    # a hook set since: Triton's own launch for every kernel of the call
    monkeypatch.setattr(tlaunch, "_hooked", lambda rt: True)
    for f in fakes.values():
        f.launches.clear()
    fast(x, w)
    assert [f.launches[-1][0] for f in fakes.values() if f.launches] == ["plain"] * len(general)


# --------------------------------------------------------------------------- CUDA, compile only


@pytest.fixture(scope="module")
def cuda_builds():
    from kgen.runtime import build

    return {r.variant.name: r for r in build.build([SPEC.variant(n) for n in CUDA])}


@requires_nvcc
def test_cuda_rows_knob_tiles_the_batch(monkeypatch):
    """`rows`: CTAs hold at most that many rows of x; B up to CUDA_TILED_MAX_B runs as
    tiles side by side. The knob is checked against what registers hold, and the K-split plan counts
    the tiles' CTAs."""
    from kgen.errors import SpecError
    from kgen.families.logmatmul import schema

    ctx = schema.template_context(SPEC.variant("sm90_w4_n8_v4_b4_f32"))
    assert (ctx["ROWS"], ctx["MAX_B"], ctx["batch_instances"]) == (4, 64, [1, 2, 4])
    plain = spec.parse("family: logmatmul\nvariants:\n  - {backend: cuda, arch: sm_90, dtypes: [float32], "
                       "warps: 4, nodes: 8, vec: 4}\n").variants[0]
    ctx = schema.template_context(plain)
    assert (ctx["ROWS"], ctx["MAX_B"], ctx["batch_instances"]) == (8, 8, [1, 2, 4, 8])
    for rows in (3, 16):  # not a power of two; more than 8 nodes' sums fit beside the loads
        with pytest.raises(SpecError, match="rows"):
            spec.parse("family: logmatmul\nvariants:\n  - {backend: cuda, arch: sm_90, dtypes: [float32], "
                       f"warps: 4, nodes: 8, vec: 4, rows: {rows}}}\n")

    class Kernel:  # what CudaForward reads of a built variant
        name, lib = "k", None
        variant = SPEC.variant("sm90_w4_n8_v4_b4_f32")
        params = dict(variant.params)

    mod = launch.CudaForward(Kernel, None)
    assert (mod.max_b, mod.rows) == (64, 4)
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)  # an H100
    # N = 1024: 128 node groups. B = 4: 128 CTAs, 4 K splits for ~4 per SM; B = 16: 4 CTAs a
    # node group, 512 CTAs, no split
    assert mod._plan((4, 1024, 16384, torch.float32, torch.float32, 0))[0] == 4
    assert mod._plan((16, 1024, 16384, torch.float32, torch.float32, 0)) == (1, 16384)


def test_cuda_mma_knob_checks_and_plan(monkeypatch):
    """`mma`: the tensor-core kernel takes float32 only, 16 nodes per m-tile of a warp (m-tiles
    dividing the warps), 8 or 16 rows of x a CTA; its K slices step by a warp's loop step and
    its plan fills an H100 at B <= 16 with one wave of CTAs."""
    from kgen.errors import SpecError
    from kgen.families.logmatmul import plans, schema

    assert MMA, "the spec has a tensor-core variant"
    v = SPEC.variant(MMA[0])
    ctx = schema.template_context(v)
    assert (ctx["MMA"], ctx["NODES"], ctx["ROWS"], ctx["MAX_B"], ctx["batch_instances"]) == (1, 64, 16, 64, [8, 16])
    assert schema.template_context(SPEC.variant(CUDA[0]))["MMA"] == 0
    ctx = schema.template_context(MMA_FORMS["sm90_w4_n32_v4_u2_b8_m1_f32"])
    assert (ctx["ROWS"], ctx["MAX_B"], ctx["batch_instances"]) == (8, 64, [8])
    base = "family: logmatmul\nvariants:\n  - {backend: cuda, arch: sm_90, "
    for knobs, bad in (("dtypes: [bfloat16], warps: 4, nodes: 64, vec: 8, mma: 1", "mma=1 takes float32"),
                       ("dtypes: [float16], warps: 4, nodes: 64, vec: 8, mma: 1", "mma=1 takes float32"),
                       ("dtypes: [float32], warps: 4, nodes: 24, vec: 4, mma: 1", "nodes=24"),
                       ("dtypes: [float32], warps: 4, nodes: 48, vec: 4, mma: 1", "nodes=48"),
                       ("dtypes: [float32], warps: 2, nodes: 64, vec: 4, mma: 1", "nodes=64"),
                       ("dtypes: [float32], warps: 4, nodes: 64, vec: 4, rows: 4, mma: 1", "rows=4"),
                       ("dtypes: [float32], warps: 4, nodes: 16, vec: 4", "at most 8 without mma"),
                       ("dtypes: [float32], warps: 4, nodes: 4, vec: 4, mtiles: 2", "mtiles=2"),
                       ("dtypes: [float32], warps: 4, nodes: 16, vec: 4, mma: 1, mtiles: 2", "nodes=16"),
                       ("dtypes: [float32], warps: 2, nodes: 128, vec: 4, mma: 1, mtiles: 2", "nodes=128"),
                       ("dtypes: [float32], warps: 4, nodes: 64, vec: 4, mma: 2", "maximum")):
        with pytest.raises(SpecError, match=bad):
            spec.parse(base + knobs + "}\n")
    spec.parse(base + "dtypes: [float32], warps: 8, nodes: 32, vec: 4, rows: 16, mma: 1}\n")  # 4 K parts

    # a step: unroll chunks of 16 k times the warps splitting an m-tile's slice (FMA: threads x 16 bytes)
    assert plans.cuda_k_step(v.params, True) == 64
    assert plans.cuda_k_step(MMA_FORMS["sm90_w4_n16_v4_m1_f32"].params, True) == 64  # 4 K parts x 1 chunk
    assert plans.cuda_k_step(MMA_FORMS["sm90_w4_n64_v4_m1_t2_f32"].params, True) == 32  # 2 K parts (32 nodes a warp)
    assert plans.cuda_k_step(SPEC.variant(CUDA[0]).params, True) == 512
    assert plans.cuda_k_step(SPEC.variant(CUDA[0]).params, False) == 1024

    class Kernel:  # what CudaForward reads of a built variant
        name, lib = "k", None
        variant = v
        params = dict(v.params)

    mod = launch.CudaForward(Kernel, None)
    assert (mod.max_b, mod.rows, mod.mma) == (64, 16, 1)
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)  # an H100
    f32, bf16 = torch.float32, torch.bfloat16
    # N = K = 4096: 64 node groups of 64 nodes, one row tile up to B = 16, 8 K splits: 512 CTAs
    for B in (1, 5, 8, 13, 16):
        assert mod._plan((B, 4096, 4096, f32, f32, 0)) == (8, 512)
    assert mod._plan((12, 11008, 4096, f32, f32, 0)) == (3, 1408)  # 172 node groups x 3
    assert mod._plan((3, 77, 332, f32, f32, 0)) == (1, 384)  # small: one launch (2 CTAs)
    # B = 17..64: row tiles of 16 side by side, the K splits shrinking as the tiles grow
    assert mod._plan((17, 4096, 4096, f32, f32, 0)) == (4, 1024)  # 64 node groups x 2 tiles x 4
    assert mod._plan((64, 4096, 4096, f32, f32, 0)) == (2, 2048)  # 64 x 4 x 2
    for key in ((65, 4096, 4096, f32, f32, 0), (4, 4096, 4098, f32, f32, 0), (4, 4096, 4096, f32, bf16, 0),
                (4, 4096, 4096, bf16, bf16, 0), (1, 8, schema.CUDA_MAX_K + 4, f32, f32, 0)):
        assert mod._plan(key) is None, key
    Kernel.params = dict(MMA_FORMS["sm90_w4_n32_v4_u2_b8_m1_f32"].params)
    mod = launch.CudaForward(Kernel, None)
    # rows = 8: B = 13 runs as 2 row tiles a node group (128 groups x 2), 2 splits
    assert (mod.rows, mod._plan((13, 4096, 4096, f32, f32, 0))) == (8, (2, 2048))


@requires_nvcc
@pytest.mark.parametrize("name", list(MMA_FORMS))
def test_cuda_mma_forms_compile_to_tensor_cores_without_local_memory(name):
    """The tensor-core kernel beyond the spec's knobs (K parts merged in shared memory, 8-row
    CTAs, 1-2 chunks in flight): mma.sync tf32 (HMMA), 16-byte loads, no local memory."""
    from kgen.runtime import build, toolchain

    (r,) = build.build([MMA_FORMS[name]])
    assert r.status in ("built", "cached"), r.error
    lib = r.entry.file(build.CUDA_LIB)
    sass = toolchain.sass(lib)
    assert "HMMA.1688.F32.TF32" in sass and "LDG.E.128" in sass
    assert "LDL" not in sass and "STL" not in sass
    res = toolchain.resource_usage(lib)
    assert res and all(k["local"] == 0 and k["stack"] == 0 for k in res.values()), res


@pytest.mark.parametrize("name", CUDA)
def test_cuda_variant_compiles_with_16_byte_loads_and_no_local_memory(cuda_builds, name):
    from kgen.runtime import build, toolchain

    r = cuda_builds[name]
    assert r.status in ("built", "cached"), r.error
    lib = r.entry.file(build.CUDA_LIB)
    sass = toolchain.sass(lib)
    assert f"arch = {r.variant.arch}" in sass
    assert "LDG.E.128" in sass, "no 16-byte weight loads"
    assert "LDL" not in sass and "STL" not in sass  # no local memory
    if r.variant.params["mma"]:
        assert "HMMA.1688.F32.TF32" in sass, "no tf32 mma.sync"
    # programmatic dependent launches: on sm_90 every kernel waits for the one before it
    # (griddepcontrol.wait is ACQBULK in SASS) before it touches memory; sm_80 has no such wait
    waits = sass.count("ACQBULK")
    kernels = sass.count("Function : ")
    assert (waits >= kernels) if r.variant.arch == "sm_90" else waits == 0, (waits, kernels)
    res = toolchain.resource_usage(lib)
    assert res and all(k["local"] == 0 and k["stack"] == 0 for k in res.values()), res
