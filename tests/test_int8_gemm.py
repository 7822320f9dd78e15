"""int8_gemm: every Triton variant under the interpreter (CPU) or on the GPU against the
exact int64 product and float64 at awkward sizes, split and unsplit; input checks; the ops
through dispatch; compile-only SASS of the CUDA variants; on a GPU also the CUDA variants,
CUDA graph replay and torch.compile(fullgraph=True)."""

import re
from pathlib import Path

import pytest
import torch

from kgen import ops, spec
from kgen.families import int8_gemm as ig
from kgen.families.int8_gemm import launch as ig_launch
from kgen.families.int8_gemm import reference
from kgen.families.int8_gemm.golden import w8a16_error_ratio
from kgen.runtime import build, dispatch, toolchain, tune, tuning_table
from kgen.runtime.op import error_ratio
from tests.conftest import HAS_GPU, requires_nvcc

ROOT = Path(__file__).resolve().parent.parent
SPEC = spec.load(ROOT / "kgen" / "specs" / "int8_gemm.yaml")
TRITON = [v.name for v in SPEC.variants if v.backend == "triton"]
CUDA = [v.name for v in SPEC.variants
        if v.backend == "cuda" and not (ig.plans.is_gemv(v) or ig.plans.is_wgmma(v))]
GEMV = [v.name for v in SPEC.variants if ig.plans.is_gemv(v)]
WGMMA = [v.name for v in SPEC.variants if ig.plans.is_wgmma(v)]
DEV = torch.device("cuda" if HAS_GPU else "cpu")
_LOADED: dict = {}


def _kernel(name):
    if name not in _LOADED:
        _LOADED[name] = dispatch.load(SPEC.variant(name))
    return _LOADED[name]


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Split-K partial planes start as garbage: every element must be written before it is read."""
    def empty(shape, dtype, device):
        return torch.full(shape, 12345 if not dtype.is_floating_point else float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(ig_launch, "_empty", empty)


# M in {1, 3, 17, 64}, N not a multiple of any tile, K the smallest step (16: the CUDA
# unit, the grouped-scale unit) and ragged (48, 100: masked K tails).
SHAPES = ((1, 37, 64), (3, 70, 48), (17, 33, 100), (64, 130, 16))


@pytest.mark.parametrize("name", TRITON)
def test_triton_variant_golden(name, poisoned_workspace):
    """int8: int8_mm equal to the int64 product; int8_linear (bf16 out) within the spec's
    tolerance of float64; 16-bit: w8a16_linear per channel and per group of 16 against
    float64. Each unsplit and with 3 K splits (partials + combine)."""
    v = SPEC.variant(name)
    results = ig.golden(_kernel(name), DEV, v.dtype, SPEC.numerics[v.dtype], shapes=SHAPES)
    assert len(results) >= 14
    bad = [(case, r) for case, r in results if not r <= 1.0]
    assert not bad, bad


def test_split_k_is_deterministic_and_spreads_at_m1():
    """At M = 1, N = 4096, K >= 11008 the small-M variant's grid covers every SM of an H100
    (132) at least twice (at K = 4096 its unsplit grid, ~17 us, is quicker than a split call's
    host cost: one split), and split results equal unsplit ones bit for bit."""
    mod = _kernel(next(n for n in TRITON if SPEC.variant(n).params["split_k"] > 1)).module
    assert ig.plans.splits(mod, 1, 4096, 4096, mod.BLOCK_K, 132)[0] == 1
    for K in (11008, 16384):
        s, k_split = ig.plans.splits(mod, 1, 4096, K, mod.BLOCK_K, 132)
        grid = ig.plans.gemm_grid(mod, 1, 4096, s)
        assert grid[0] * grid[1] >= 2 * 132, (K, grid)
        assert k_split % mod.BLOCK_K == 0 and (s - 1) * k_split < K
    name = next(n for n in TRITON if SPEC.variant(n).params["split_k"] > 1 and SPEC.variant(n).dtype == "bfloat16")
    impl = ig.implementation(_kernel(name))
    x = torch.randn(2, 96, device=DEV).to(torch.bfloat16)
    b = torch.randint(-128, 128, (40, 96), dtype=torch.int8, device=DEV)
    s = torch.rand(40, device=DEV)
    outs = [ig.gemm(impl, ig.MODE_W8A16, x, b, torch.empty(2, 40, dtype=x.dtype, device=DEV), scale_b=s, n_splits=n)
            for n in (None, 2, 2)]
    assert torch.equal(outs[1], outs[2])


def _ints(*shape, device=DEV):
    return torch.randint(-128, 128, shape, dtype=torch.int8, device=device)


def test_ops_reference_path_cpu_exact_and_batched():
    """CPU tensors run the PyTorch reference: int8_mm exact (int64 product; all -128 at the
    largest K fits int32), leading batch dims flattened, int8_linear and w8a16 vs float64."""
    a, b = _ints(2, 3, 40, device="cpu"), _ints(5, 40, device="cpu")
    got = ops.int8_mm(a, b)
    assert got.dtype == torch.int32 and got.shape == (2, 3, 5)
    assert torch.equal(got.long(), a.long() @ b.long().t())
    worst = torch.full((1, 2048), -128, dtype=torch.int8)
    assert int(ops.int8_mm(worst, worst)[0, 0]) == 2048 * 16384
    # scales ~1/127 as a quantiser gives: |a @ b.T| reaches 127^2 * 40 = 645k, past float16's 65504
    sa, sb, bias = torch.rand(2, 3) / 127, torch.rand(5) / 127, torch.randn(5)
    out = ops.int8_linear(a, b, sa, sb, bias, out_dtype=torch.float16)
    ref = ig.reference.int8_linear(a.reshape(6, 40), b, sa.reshape(-1), sb, bias, compute=torch.float64)
    assert out.dtype == torch.float16 and out.shape == (2, 3, 5)
    torch.testing.assert_close(out.reshape(6, 5).double(), ref, rtol=1e-3, atol=1e-6)
    x = torch.randn(4, 64).to(torch.bfloat16)
    b2, s2 = _ints(7, 64, device="cpu"), torch.rand(7, 4) / 127
    out = ops.w8a16_linear(x, b2, s2, group_size=16)
    ref = ig.reference.w8a16_linear(x, b2, s2, None, 16, compute=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-4)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: ops.int8_mm(torch.zeros(2, 4), _ints(3, 4, device="cpu")), TypeError, "a has dtype"),
    (lambda: ops.int8_mm(_ints(2, 4, device="cpu"), torch.zeros(3, 4)), TypeError, "b has dtype"),
    (lambda: ops.int8_mm(_ints(2, 4, device="cpu"), _ints(3, 5, device="cpu")), ValueError, "must be \\[N, K\\]"),
    (lambda: ops.int8_mm(_ints(2, 4, device="cpu"), _ints(3, 4, 1, device="cpu")), ValueError, "2-D"),
    (lambda: ops.int8_mm(_ints(1, 131072, device="cpu"), _ints(1, 131072, device="cpu")), ValueError, "overflow"),
    (lambda: ops.int8_linear(_ints(2, 4, device="cpu"), _ints(3, 4, device="cpu"), torch.ones(3), torch.ones(3)),
     ValueError, "scale_a"),
    (lambda: ops.int8_linear(_ints(2, 4, device="cpu"), _ints(3, 4, device="cpu"), torch.ones(2),
                             torch.ones(3, dtype=torch.float64)), TypeError, "scale_b"),
    (lambda: ops.int8_linear(_ints(2, 4, device="cpu"), _ints(3, 4, device="cpu"), torch.ones(2), torch.ones(3),
                             out_dtype=torch.int32), TypeError, "out_dtype"),
    (lambda: ops.int8_linear(_ints(2, 4, device="cpu"), _ints(3, 4, device="cpu"), torch.ones(2), torch.ones(3),
                             torch.ones(4)), ValueError, "bias"),
    (lambda: ops.w8a16_linear(torch.zeros(2, 32), _ints(3, 32, device="cpu"), torch.ones(3)), TypeError, "x has dtype"),
    (lambda: ops.w8a16_linear(torch.zeros(2, 32, dtype=torch.bfloat16), _ints(3, 32, device="cpu"), torch.ones(3),
                              group_size=12), ValueError, "group_size"),
    (lambda: ops.w8a16_linear(torch.zeros(2, 32, dtype=torch.bfloat16), _ints(3, 32, device="cpu"), torch.ones(3),
                              group_size=16), ValueError, "scale_b has shape"),
    (lambda: ops.w8a16_linear(torch.zeros(2, 32, dtype=torch.bfloat16), _ints(3, 32, device="cpu"),
                              torch.ones(3, 2), group_size=16.0), TypeError, "group_size must be an int"),
    (lambda: ops.int8_linear(_ints(2, 4, device="cpu"), _ints(3, 4, device="cpu"), torch.ones(2), torch.ones(3),
                             torch.ones(3, dtype=torch.float16), torch.float32),
     TypeError, r"expected torch.float32$"),
    # None for a tensor: the family's TypeError, not an AttributeError from the fast path's key
    (lambda: ops.int8_mm(_ints(2, 4, device="cpu"), None), TypeError, "b must be a tensor"),
    (lambda: ops.int8_mm(None, _ints(3, 4, device="cpu")), TypeError, "a must be a tensor"),
    (lambda: ops.int8_linear(_ints(2, 4, device="cpu"), None, torch.ones(2), torch.ones(3)),
     TypeError, "b must be a tensor"),
    (lambda: ops.w8a16_linear(torch.zeros(2, 32, dtype=torch.bfloat16), None, torch.ones(3)),
     TypeError, "b must be a tensor"),
    (lambda: ops.w8a16_linear(None, _ints(3, 32, device="cpu"), torch.ones(3)), TypeError, "x must be a tensor"),
    # the registered ops take 2-D a / x (kgen.ops flattens leading dims), and say so
    (lambda: torch.ops.kgen.int8_mm(_ints(2, 3, 4, device="cpu"), _ints(5, 4, device="cpu")), ValueError, "2-D a"),
    (lambda: torch.ops.kgen.int8_linear(_ints(4, device="cpu"), _ints(5, 4, device="cpu"), torch.ones(1),
                                        torch.ones(5), None, torch.bfloat16), ValueError, "2-D a"),
    (lambda: torch.ops.kgen.w8a16_linear(torch.zeros(2, 3, 32, dtype=torch.bfloat16), _ints(6, 32, device="cpu"),
                                         torch.ones(6), None, None), ValueError, "2-D x"),
    (lambda: torch.ops.kgen.w8a16_linear(torch.zeros(2, 3, 32, dtype=torch.bfloat16, device="meta"),
                                         _ints(6, 32, device="cpu").to("meta"), torch.ones(6, device="meta"), None,
                                         None), ValueError, "2-D x"),
])
def test_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_fake_impls_and_compile_on_cpu():
    """The registered ops' fake impls give shapes and dtypes; torch.compile(fullgraph=True)
    traces all three without a graph break."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(5, 32, dtype=torch.int8), torch.empty(7, 32, dtype=torch.int8)
        assert torch.ops.kgen.int8_mm(a, b).shape == (5, 7)
        out = torch.ops.kgen.int8_linear(a, b, torch.empty(5), torch.empty(7), None, torch.float16)
        assert out.dtype == torch.float16 and out.shape == (5, 7)
    a, b = _ints(3, 32, device="cpu"), _ints(7, 32, device="cpu")
    x = torch.randn(3, 32).to(torch.bfloat16)

    def f(a, b, x):
        return ops.int8_mm(a, b), ops.int8_linear(a, b, torch.ones(3), torch.ones(7)), ops.w8a16_linear(x, b, torch.ones(7))

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(a, b, x)
    for g, w in zip(got, f(a, b, x)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("shape", [(2, 3, 0), (0,), (4, 0)])
def test_zero_k_at_any_rank_gives_zeros_plus_bias(shape):
    """K = 0: an empty sum, so int8_mm gives zeros and the linears their bias, for a / x of
    any rank (flattening [..., 0] cannot infer its rows from -1)."""
    a, b = _ints(*shape, device="cpu"), _ints(5, 0, device="cpu")
    lead = shape[:-1]
    assert torch.equal(ops.int8_mm(a, b), torch.zeros(*lead, 5, dtype=torch.int32))
    bias = torch.randn(5)
    y = ops.int8_linear(a, b, torch.ones(lead).reshape(-1) if lead else torch.ones(1), torch.ones(5), bias,
                        torch.float32)
    assert torch.equal(y, bias.expand(*lead, 5))
    x = torch.zeros(shape, dtype=torch.bfloat16)
    assert torch.equal(ops.w8a16_linear(x, b, torch.ones(5), bias.bfloat16()), bias.bfloat16().expand(*lead, 5))


def test_w8a16_group_size_any_integer_and_bias_gradient_in_its_shape():
    """group_size from numpy (an integer all the same) works as an int; a [1, N] bias, which
    the forward takes (N values), gets its gradient in its own shape."""
    import numpy as np

    x = torch.randn(3, 32).to(torch.bfloat16).requires_grad_()
    b, s = _ints(4, 32, device="cpu"), torch.rand(4, 2) / 127
    bias = torch.randn(1, 4, requires_grad=True)
    out = ops.w8a16_linear(x, b, s, bias, group_size=np.int64(16))
    assert torch.equal(out, ops.w8a16_linear(x, b, s, bias, group_size=16))
    g = torch.randn(3, 4).to(torch.bfloat16).float()  # (the output is bf16: its gradient arrives in bf16)
    out.float().backward(g)
    assert bias.grad.shape == (1, 4)
    torch.testing.assert_close(bias.grad, g.sum(0, keepdim=True))


def test_w8a16_gradient_of_x():
    x = torch.randn(3, 32, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    b, s = _ints(5, 32, device="cpu"), torch.rand(5)
    ops.w8a16_linear(x, b, s).float().sum().backward()
    want = (torch.ones(3, 5) @ (b.float() * s[:, None])).to(torch.bfloat16)
    torch.testing.assert_close(x.grad, want)


def _scale_gradient(group_size, device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 48, generator=g).to(torch.bfloat16).to(device)
    b = torch.randint(-128, 128, (5, 48), generator=g, dtype=torch.int8).to(device)
    s0 = (torch.rand(5, 3, generator=g) / 100 if group_size else torch.rand(5, generator=g) / 100).to(device)
    bias = torch.randn(5, generator=g).to(device)
    ops.w8a16_linear(x, b, s0, bias, group_size=group_size)  # (a plain call: the fast path holds the signature)
    s = s0.clone().requires_grad_()
    u = torch.randn(7, 5, generator=g).bfloat16().float().to(device)
    (ops.w8a16_linear(x, b, s, bias, group_size=group_size).float() * u).sum().backward()
    s64 = s0.double().requires_grad_()
    w = reference.dequantized(b, s64, group_size, torch.float64)
    ((x.double() @ w.t() + bias.double()) * u.double()).sum().backward()
    assert s.grad is not None and s.grad.shape == s.shape
    # float32 products of bf16 x and int8 b summed over 7 rows: float32 rounding only
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-5, atol=1e-5 * float(s64.grad.abs().max()))


def test_w8a16_gradient_of_its_scales_at_k_zero():
    """K = 0: the forward is the bias; the scales' gradient is zero (it divided by zero)."""
    x, b = torch.zeros(5, 0, dtype=torch.bfloat16), torch.zeros(6, 0, dtype=torch.int8)
    s = torch.rand(6, requires_grad=True)
    ops.w8a16_linear(x, b, s).float().sum().backward()
    assert torch.equal(s.grad, torch.zeros(6))


@pytest.mark.parametrize("group_size", [None, 16])
def test_w8a16_gradient_of_its_scales(group_size):
    """scale_b with requires_grad gets its gradient (it came back None, silently, while the
    torch.func composition differentiated it): against float64 autograd of the same math,
    per channel and per group, through the fast path's signature too (a plain call first)."""
    _scale_gradient(group_size, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [None, 16])
def test_gpu_w8a16_gradient_of_its_scales(group_size):
    """The same on CUDA, where the plain call's fast path holds the signature: a scale that
    requires grad must take the op's autograd path, not the fast path's bare output."""
    _scale_gradient(group_size, "cuda")


class _FakeGemv:
    """A loaded CUDA gemv variant whose launcher records its arguments (host path on CPU)."""

    name, ptr = "fake_gemv", 4321
    params = {"block_n": 16, "warps_n": 1, "warps_m": 8}

    class variant:
        backend = "cuda"
        params = {"kernel": "gemv"}

    def __init__(self):
        self.calls = []

    def raw(self, *args):
        self.calls.append(args)
        return 0

    def fail(self, rc):
        raise AssertionError(f"launcher error {rc}")


@pytest.mark.parametrize("mode", ["w8a16", "int8_linear", "int8_mm"])
def test_fast_path_launches_what_the_general_path_does(monkeypatch, mode):
    """The ops' eager fast path (a bound launcher per call signature, launch.direct) passes
    the CUDA kernel the same arguments as launch.gemm, takes leading batch dims, and steps
    aside for gradients, `using` blocks, autocast, non-contiguous or unaligned inputs and
    signatures it has not seen (here the CPU reference then serves: no kernel call)."""
    from kgen.families.int8_gemm import op as iop

    monkeypatch.setattr(ig_launch, "current_raw_stream", lambda index: 77)
    kernel = _FakeGemv()
    impl = ig_launch.Impl(None, kernel)
    M, N, K = 3, 40, 256
    b = _ints(N, K, device="cpu")
    sb, bias = torch.rand(N), torch.rand(N)
    if mode == "w8a16":
        a = torch.randn(M, K).to(torch.bfloat16)
        general = dict(mode=ig.MODE_W8A16, scale_b=sb, bias=bias)
        fast = ig_launch.direct(impl, ig.MODE_W8A16, M, N, K, a.dtype, None, sb.dtype, bias.dtype, a.device)
        run = lambda a, **kw: ops.w8a16_linear(a, b, sb, bias, **kw)  # noqa: E731
        key = iop._w8a16_key(a, b, sb, bias, None)
        args, out_dtype = (None, sb, bias), a.dtype
    elif mode == "int8_linear":
        a, sa = _ints(M, K, device="cpu"), torch.rand(M)
        general = dict(mode=ig.MODE_LINEAR, scale_a=sa, scale_b=sb, bias=bias)
        fast = ig_launch.direct(impl, ig.MODE_LINEAR, M, N, K, torch.float16, None, sb.dtype, bias.dtype, a.device)
        run = lambda a, **kw: ops.int8_linear(a, b, sa[:a.shape[-2]].view(*a.shape[:-1]), sb, bias,  # noqa: E731
                                              torch.float16)
        key = iop._linear_key(a, b, sa, sb, bias, torch.float16)
        args, out_dtype = (sa, sb, bias), torch.float16
    else:
        a = _ints(M, K, device="cpu")
        general = dict(mode=ig.MODE_MM)
        fast = ig_launch.direct(impl, ig.MODE_MM, M, N, K, torch.int32, None, None, None, a.device)
        run = lambda a, **kw: ops.int8_mm(a, b)  # noqa: E731
        key = (ig.MODE_MM, a.shape, a.dtype, b.shape, b.dtype, a.device, b.device)
        args, out_dtype = (None, None, None), torch.int32
    ig.gemm(impl, general.pop("mode"), a, b, torch.empty(M, N, dtype=out_dtype), **general)
    out = fast(a, b, *args)
    assert out.shape == (M, N) and out.dtype == out_dtype and out.is_contiguous()
    # a large output comes from a broadcast prototype: still a fresh contiguous tensor
    big = ig_launch.direct(impl, ig.MODE_MM, 16, 400, K, torch.int32, None, None, None, a.device)
    o = big(_ints(16, K, device="cpu"), _ints(400, K, device="cpu"), None, None, None)
    assert o.shape == (16, 400) and o.is_contiguous() and o.stride() == (400, 1)
    kernel.calls.pop()
    g, d = kernel.calls
    assert g[:6] + g[8:] == d[:6] + d[8:]  # all but the output and workspace pointers
    assert d[6] == out.data_ptr() and g[7] == d[7] == 0  # no K split at this size: no workspace

    monkeypatch.setitem(iop._FAST, key, fast)
    kernel.calls.clear()
    assert run(a).shape == (M, N)
    assert run(a.view(1, M, K)).shape == (1, M, N)  # leading batch dims: the same signature
    assert len(kernel.calls) == 2
    unaligned = torch.empty(M * K + 1, dtype=a.dtype)[1:].view(M, K).copy_(a)
    for other in (a.t().contiguous().t(), unaligned, a[:2]):
        run(other)  # the CPU reference serves
    with ig.using(None):
        run(a)
    if mode == "w8a16":
        run(a.clone().requires_grad_())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            run(a)
    assert len(kernel.calls) == 2
    # a signature the CUDA kernel does not take (the gemv kernel: M > 16) gets the Triton
    # module's launcher instead
    monkeypatch.setattr(ig_launch, "triton_direct", lambda mod, mode, M, *rest: ("triton", mode, M))
    assert ig_launch.direct(impl, ig.MODE_W8A16, 17, N, K, torch.bfloat16, None, sb.dtype, None,
                            a.device) == ("triton", ig.MODE_W8A16, 17)


def test_triton_kernels_take_any_k_alignment(poisoned_workspace):
    """The Triton kernels' KA (kgen.runtime.op.stride_align: the largest power of two up to 16
    dividing K, so that the compiler sees the rows' alignment) at K of every alignment: exact
    int8_mm, W8A16 within the golden tolerance; stride_align divides K and is the largest such."""
    from kgen.runtime.op import stride_align

    for K in range(1, 70):
        ka = stride_align(K)
        assert K % ka == 0 and ka in (1, 2, 4, 8, 16) and (ka == 16 or K % (2 * ka))
    i8 = ig.implementation(_kernel(next(n for n in TRITON if SPEC.variant(n).dtype == "int8")))
    w16 = ig.implementation(_kernel(next(n for n in TRITON if SPEC.variant(n).dtype == "bfloat16")))
    for K in (37, 98, 100, 200, 48):
        a, b = _ints(5, K), _ints(19, K)
        got = ig.gemm(i8, ig.MODE_MM, a, b, torch.empty(5, 19, dtype=torch.int32, device=DEV))
        assert torch.equal(got.cpu().long(), a.cpu().long() @ b.cpu().long().t()), K
        x, s = torch.randn(5, K, device=DEV).to(torch.bfloat16), torch.rand(19, device=DEV) / 127
        out = ig.gemm(w16, ig.MODE_W8A16, x, b, torch.empty(5, 19, dtype=torch.bfloat16, device=DEV), scale_b=s)
        assert w8a16_error_ratio(out, x, b, s, None, None, SPEC.numerics["bfloat16"]) <= 1.0, K


@pytest.mark.parametrize("mode", ["w8a16", "int8_linear", "int8_mm"])
def test_triton_fast_path_matches_the_general_path(mode, poisoned_workspace, monkeypatch):
    """launch.triton_direct (the fast path of signatures a Triton variant runs): the same
    output as launch.gemm, bit for bit, into poisoned buffers, unsplit and with K splits,
    on its first call (recorded) and the next ones (replayed on a GPU, where the launches
    skip Triton's launch path: triton_launch.STATS), with leading batch dims; None for a
    non-contiguous input."""
    from kgen.runtime import triton_launch

    dtype = "int8" if mode != "w8a16" else "bfloat16"
    # (the split tile splits these small calls as it does a long grid's)
    monkeypatch.setattr(ig.plans, "TRITON_SPLIT_MIN_US", 0.0)
    names = [n for n in TRITON if SPEC.variant(n).dtype == dtype]
    split = next(n for n in names if SPEC.variant(n).params["split_k"] > 1)
    whole = next(n for n in names if SPEC.variant(n).params["split_k"] == 1)
    for name, (M, N, K) in ((split, (3, 70, 1040)), (whole, (17, 33, 100))):
        impl = ig.implementation(_kernel(name))
        b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=DEV)
        sb, sa = torch.rand(N, device=DEV) / 100, torch.rand(M, device=DEV)
        if mode == "w8a16":
            a = torch.randn(M, K, device=DEV).to(torch.bfloat16)
            bias = torch.randn(N, device=DEV).to(torch.bfloat16)
            args, spec_ = (None, sb, bias), (ig.MODE_W8A16, torch.bfloat16, sb.dtype, bias.dtype)
        elif mode == "int8_linear":
            a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=DEV)
            bias = torch.randn(N, device=DEV)
            args, spec_ = (sa, sb, bias), (ig.MODE_LINEAR, torch.float16, sb.dtype, bias.dtype)
        else:
            a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=DEV)
            args, spec_ = (None, None, None), (ig.MODE_MM, torch.int32, None, None)
        m, out_dtype, sb_dtype, bias_dtype = spec_
        want = ig.gemm(impl, m, a, b, torch.full((M, N), 7, dtype=out_dtype, device=DEV), args[0], args[1], args[2])
        splits, _ = ig_launch._triton_plan(impl.triton, M, N, K, None, DEV)
        assert (splits > 1) == (name == split), (name, splits)
        f = ig_launch.direct(impl, m, M, N, K, out_dtype, None, sb_dtype, bias_dtype, DEV)
        before = triton_launch.STATS["direct"]
        outs = [f(a, b, *args), f(a.clone(), b, *args), f(a.view(1, M, K), b, *args)]
        for out in outs:
            assert out.shape == (M, N) and out.dtype == out_dtype
            assert torch.equal(out, want), (name, (out.float() - want.float()).abs().max())
        if DEV.type == "cuda":  # the second and third calls replayed every launch
            assert triton_launch.STATS["direct"] - before >= 2 * (1 + (splits > 1)), name
        assert f(a.t().contiguous().t() if M > 1 else a[:, ::2], b, *args) is None


# --------------------------------------------------------------------------- compile only

@pytest.fixture(scope="module")
def cuda_builds():
    return {r.variant.name: r for r in build.build_cuda([SPEC.variant(n) for n in CUDA + GEMV + WGMMA])}


@requires_nvcc
@pytest.mark.parametrize("name", CUDA)
def test_cuda_variant_sass(cuda_builds, name):
    """mma.sync m16n8k32 s8 (SASS IMMA.16832.S8.S8) from ldmatrix (LDSM) over a cp.async
    ring (LDGSTS); no local memory in any of the six epilogue instances."""
    r = cuda_builds[name]
    assert r.status in ("built", "cached"), r.error
    lib = r.entry.file(build.CUDA_LIB)
    sass = toolchain.sass(lib)
    assert f"arch = {r.variant.arch}" in sass
    for op in ("IMMA.16832.S8.S8", "LDSM", "LDGSTS"):
        assert op in sass, op
    assert not re.search(r"\b(LDL|STL)\b", sass)
    res = toolchain.resource_usage(lib)
    assert len(res) == 6
    assert all(k["local"] == 0 and k["stack"] == 0 for k in res.values()), res


@requires_nvcc
@pytest.mark.parametrize("name", GEMV)
def test_gemv_variant_sass(cuda_builds, name):
    """The small-M kernel: int8 mma.sync (IMMA.16832.S8.S8) or bf16 / fp16 (HMMA.16816.F32)
    fed by 16-byte no-L1-allocate loads of the weight (LDG.E.NA...128), or with a ring by
    cp.async (LDGSTS); on sm_90 every kernel a programmatic dependent launch's wait; no
    local memory in any of its six kernels (4 GEMV instances, 2 combines); static shared
    memory only for the K-warps' sums (at most schema.gemv_smem bytes, plus the 1 KB the
    system reserves on sm_90, which the report may include)."""
    r = cuda_builds[name]
    assert r.status in ("built", "cached"), r.error
    lib = r.entry.file(build.CUDA_LIB)
    sass = toolchain.sass(lib)
    assert f"arch = {r.variant.arch}" in sass
    mma = "IMMA.16832.S8.S8" if r.variant.dtype == "int8" else "HMMA.16816.F32"
    assert mma in sass
    if r.variant.params["ring"]:
        assert re.search(r"\bLDGSTS\.E\.BYPASS\S*\.128", sass), "no 16-byte cp.async weight loads"
    else:
        assert re.search(r"LDG\.E\.NA\S*\.128", sass), "no 16-byte L1::no_allocate weight loads"
        assert "LDGSTS" not in sass
    assert not re.search(r"\b(LDL|STL)\b", sass)
    # programmatic dependent launches: on sm_90 each kernel waits for the one before it
    # (griddepcontrol.wait, ACQBULK in SASS) before it touches memory; sm_80 has no such wait
    waits, kernels = sass.count("ACQBULK"), sass.count("Function : ")
    assert (waits >= kernels) if r.variant.arch == "sm_90" else waits == 0, (waits, kernels)
    res = toolchain.resource_usage(lib)
    assert len(res) == 6
    assert all(k["local"] == 0 and k["stack"] == 0 for k in res.values()), res
    smem = ig.schema.gemv_smem(r.variant.params)
    assert all(k["shared"] <= (1024 if "combine" in kname else smem + 1024) for kname, k in res.items()), res


@requires_nvcc
@pytest.mark.parametrize("name", WGMMA)
def test_wgmma_variant_sass(cuda_builds, name):
    """The Hopper kernel: WGMMA with s8 operands (SASS IGMMA) fed by TMA (UTMALDG) through
    mbarriers (SYNCS), each kernel a programmatic dependent launch's wait (ACQBULK); no local
    memory or stack in its four kernels (int8_mm and int8_linear, each with its combine)."""
    r = cuda_builds[name]
    assert r.status in ("built", "cached"), r.error
    lib = r.entry.file(build.CUDA_LIB)
    sass = toolchain.sass(lib)
    assert "arch = sm_90a" in sass
    for op in ("IGMMA.64", "UTMALDG.2D", "SYNCS", "WARPGROUP.ARRIVE"):
        assert op in sass, op
    assert "IMMA" not in sass.replace("IGMMA", "")  # no mma.sync fallback inside
    assert not re.search(r"\b(LDL|STL)\b", sass)
    # none of ptxas's warnings that a WGMMA was serialised (C7510, C7511, C7515) or register
    # reallocation ignored (C7508)
    log = r.entry.file(build.BUILD_LOG).read_text()
    assert not re.search(r"C75(08|10|11|15)", log), log
    assert sass.count("ACQBULK") >= sass.count("Function : ") == 12
    res = toolchain.resource_usage(lib)
    assert len(res) == 12
    assert all(k["local"] == 0 and k["stack"] == 0 for k in res.values()), res
    # static shared memory within what the schema plans with (plus the 1 KB the report may
    # include): the CTAs-an-SM rule and the spec's shared-memory check read it
    static = ig.schema.wgmma_static_smem(r.variant.params)
    assert all(k["shared"] <= static + 1024 for k in res.values()), (static, res)


def test_wgmma_plans_and_checks():
    """K splits of the Hopper kernel: about half as many CTAs as SMs where the tiles are fewer,
    each split >= 4 K panels and the partials at most a quarter of the weight; two CTAs an SM
    only where two rings and their registers fit; the spec rules."""
    big = {"block_m": 128, "block_n": 256, "block_k": 128, "stages": 4, "warps_m": 2, "warps_n": 1}
    small = {"block_m": 64, "block_n": 64, "block_k": 128, "stages": 6, "warps_m": 1, "warps_n": 1}
    assert ig.schema.wgmma_ctas_per_sm(big) == 1 and ig.schema.wgmma_ctas_per_sm(small) == 2
    assert ig.plans.wgmma_splits(big, 4096, 4096, 4096, 132) == 1
    assert ig.plans.wgmma_splits(big, 64, 4096, 11008, 132) == 4  # 16 tiles: 64 CTAs
    assert ig.plans.wgmma_splits(small, 17, 4096, 4096, 132) == 1  # 64 tiles already
    assert ig.plans.wgmma_fill_splits(small, 64, 1024, 4096, 132) == 4  # 16 tiles
    # ... but a split costs the op ~7 us of host time: 16 tiles over K = 4096, ~9 us unsplit,
    # do not split; over K = 16384 (~27 us) they do
    assert ig.plans.wgmma_splits(small, 64, 1024, 4096, 132) == 1
    assert ig.plans.wgmma_splits(small, 64, 1024, 16384, 132) == ig.plans.wgmma_fill_splits(small, 64, 1024, 16384, 132) > 1
    for M, N, K in ((64, 4096, 11008), (17, 1000, 272), (64, 22016, 4096), (200, 4096, 4096), (1, 64, 65536)):
        for knobs in (big, small):
            s = ig.plans.wgmma_splits(knobs, M, N, K, 132)
            tiles = -(-M // knobs["block_m"]) * -(-N // knobs["block_n"])
            assert s == 1 or tiles * s <= 66 + tiles // 2, (M, N, K, s)  # about half as many CTAs as SMs
            assert s == 1 or (s * M * N <= N * K // 16 and K // 128 // s >= 4)  # partials, panels a split
    assert ig.plans.wgmma_splits(big, 1, 37, 256, 132) == 1  # 2 K panels: no split
    for knobs, dtype, arch, key in ((dict(big, block_m=256, warps_m=4), "int8", "sm_90a", "block_m"),
                                    (dict(big, block_k=64), "int8", "sm_90a", "block_k"),
                                    (dict(big, warps_n=2), "int8", "sm_90a", "warps_m"),
                                    (dict(big, stages=5), "int8", "sm_90a", "stages"),
                                    (big, "bfloat16", "sm_90a", "dtypes"),
                                    (big, "int8", "sm_90", "arch")):
        problems = ig.schema._check_variant("cuda", arch, dtype, dict(knobs, kernel="wgmma", ring=0))
        assert key in [k for k, _ in problems], (knobs, dtype, arch, problems)
    assert not ig.schema._check_variant("cuda", "sm_90a", "int8", dict(big, kernel="wgmma", ring=0))
    # the tiled mma.sync kernel is not built for sm_90a
    assert ig.schema._check_variant("cuda", "sm_90a", "int8", dict(big, kernel="mma", ring=0))


def test_a_choice_is_memoised_per_bucket_only_where_it_is_the_buckets(monkeypatch):
    """The untuned preference reads the exact M (int8, N = 4096 on 132 SMs: the 64 x 128
    WGMMA tile at M = 513, 128 x 256 at M = 1024, one bucket), so the op keeps it per exact
    shape; a tuned winner holds for its whole bucket. (A CUDA device's index is all the memo
    reads: _choose is stubbed.)"""
    wg = [v for v in SPEC.variants if ig.plans.is_wgmma(v)]
    tile = lambda M: sorted(wg, key=lambda v: ig.plans.preference(v, M, 4096, 132))[0].params  # noqa: E731
    assert (tile(513)["block_n"], tile(1024)["block_n"]) == (128, 256)
    dev = torch.device("cuda", 0)
    for why, calls in (("spec order, by shape", [513, 1024, 700]), ("tuned", [513])):
        seen = []

        def choose(device, dtype, M, N, K, grouped, fused=False, why=why):
            seen.append(M)
            return ("impl", M), why

        monkeypatch.setattr(ig.op, "_choose", choose)
        monkeypatch.setattr(ig.op, "_IMPLS", {})
        monkeypatch.setattr(ig.op, "_BY_SHAPE", {})
        got = [ig.op._impl(dev, torch.int8, M, 4096, 4096, False) for M in (513, 1024, 513, 700, 1024)]
        assert seen == calls, (why, seen)
        if why == "tuned":  # the bucket's first shape's choice, for every shape of it
            assert got == [("impl", 513)] * 5
        else:
            assert got == [("impl", 513), ("impl", 1024), ("impl", 513), ("impl", 700), ("impl", 1024)]
        assert ig.op._impl(dev, torch.int8, 1025, 4096, 4096, False) == ("impl", 1025)  # the next bucket


def test_gemv_plans():
    """Spec order without a table entry puts the gemv variants first at M <= 16 and last
    above; the K split fills an H100 at N = 4096 and keeps the partials small at M = 16."""
    for M, first in ((1, True), (16, True), (17, False), (64, False), (1024, False)):
        for dtype in ("int8", "bfloat16"):
            vs = [v for v in SPEC.variants if v.dtype == dtype]
            best = sorted(vs, key=lambda v: ig.plans.preference(v, M))[0]
            assert ig.plans.is_gemv(best) == first, (M, dtype, best.name)
            assert not ig.plans.is_gemv(sorted(vs, key=lambda v: ig.plans.preference(v, M))[-1]) or M > 16
    # above M = 16, int8 prefers the Hopper WGMMA kernel (where the device has it), its tile by M
    for M, tile in ((17, (64, 64)), (64, (64, 64)), (65, (64, 128)), (256, (64, 128)), (257, (128, 256)),
                    (8192, (128, 256))):
        vs = sorted((v for v in SPEC.variants if v.dtype == "int8"), key=lambda v: ig.plans.preference(v, M))
        assert ig.plans.is_wgmma(vs[0]) and (vs[0].params["block_m"], vs[0].params["block_n"]) == tile, (M, vs[0].name)
        without = [v for v in vs if not ig.plans.is_wgmma(v)]  # an Ampere GPU's order
        assert without[0].backend == "triton" or M <= 32, (M, without[0].name)
    # with N and the SMs known, the WGMMA tile of least predicted time (H200-measured winners)
    wg = [v for v in SPEC.variants if ig.plans.is_wgmma(v)]
    for M, N, tile in ((295, 1189, (64, 64)), (3225, 634, (128, 128)), (100, 11562, (128, 128)),
                       (4096, 4096, (128, 256)), (2000, 700, (128, 128))):
        p = sorted(wg, key=lambda v: ig.plans.preference(v, M, N, 132))[0].params
        assert (p["block_m"], p["block_n"]) == tile, (M, N, p)
    # above M = 128 (N and the SMs known) the largest unsplit tile whose grid fills the SMs,
    # else a split one
    for M, N, split in ((133, 2811, True), (256, 4096, True), (256, 12288, False), (1024, 4096, False)):
        vs = sorted((v for v in SPEC.variants if v.dtype == "bfloat16" and not ig.plans.is_gemv(v)),
                    key=lambda v: ig.plans.preference(v, M, N, 132))
        assert (vs[0].params.get("split_k", 1) > 1) == split, (M, N, vs[0].name)
    # ... and with K known too, the grid of least predicted time (plans.tile_grid_us; H200,
    # the faster of the two measured, BENCHMARKS.md fifty-first session: fp16 208 x 4671 x
    # 3776 unsplit 60.2 us against split 72.1, 682 x 1782 x 9776 157.0 against 180.9; split
    # where the unsplit grid is small: 160 x 1499 x 6144 42.9 against 94.4, 250 x 3803 x 6144
    # 78.5 against 93.4, 133 x 2811 x 7984 48 against 113)
    for M, N, K, split in ((208, 4671, 3776, False), (682, 1782, 9776, False), (160, 1499, 6144, True),
                           (250, 3803, 6144, True), (133, 2811, 7984, True), (250, 4571, 2048, False)):
        for dtype in ("bfloat16", "float16"):
            vs = sorted((v for v in SPEC.variants if v.dtype == dtype and not ig.plans.is_gemv(v)),
                        key=lambda v: ig.plans.preference(v, M, N, 132, K))
            assert (vs[0].params.get("split_k", 1) > 1) == split, (M, N, K, vs[0].name)
    # ... also at M 17-128 for W8A16 (H200 GPU us, the chosen tile against the next best,
    # BENCHMARKS.md fifty-second session: fp16 42 x 291 x 992 16 x 64 split 7.3 against
    # 64 x 128's 15.4; bf16 70 x 349 x 7632 14.2 against 26.3; fp16 127 x 3433 x 5728 64 x 128
    # split 44.3 against 16 x 64's 69.2; fp16 95 x 11004 x 13440 128 x 128 197.2 against 208)
    for dtype, M, N, K, tile in (("float16", 42, 291, 992, (16, 64)), ("bfloat16", 70, 349, 7632, (16, 64)),
                                 ("float16", 127, 3433, 5728, (64, 128)), ("float16", 95, 11004, 13440, (128, 128))):
        vs = sorted((v for v in SPEC.variants if v.dtype == dtype and not ig.plans.is_gemv(v)),
                    key=lambda v: ig.plans.preference(v, M, N, 132, K))
        assert (vs[0].params["block_m"], vs[0].params["block_n"]) == tile, (dtype, M, N, K, vs[0].name)
    assert ig.plans.gemv_splits(64, 1, 4096, 4096, 132) * 64 * 4 >= 12 * 132  # 64 CTAs of 4 warps x splits
    assert ig.plans.gemv_splits(16, 1, 4096, 4096, 132, 1, 8) == 1  # 256 CTAs of 8 K-warps fill the SMs
    assert ig.plans.gemv_fill_splits(16, 1, 1024, 4096, 132, 1, 8) == 2  # ranges of >= 4 steps a warp
    # ... but a split costs the op ~6 us of host time: only a grid predicted slower than that
    # splits (512 warps over 4 MiB: ~6 us unsplit; 64 warps over 8 MiB: ~55 us)
    assert ig.plans.gemv_splits(16, 1, 1024, 4096, 132, 1, 8) == 1
    assert ig.plans.gemv_splits(16, 1, 128, 65536, 132, 1, 8) == ig.plans.gemv_fill_splits(16, 1, 128, 65536, 132, 1, 8) > 4
    assert ig.plans.gemv_splits(64, 1, 65536, 4096, 132) == 1
    s = ig.plans.gemv_splits(64, 16, 4096, 11008, 132)
    assert 1 < s and 2 * s * 16 * 4096 * 4 <= 4096 * 11008 / 8 + 1
    assert ig.plans.gemv_splits(64, 1, 100, 16, 132) == 1  # K = 16: one step
    # among the gemv variants: one K-warp a CTA from N = 2048 where its plan does not split
    # (H200 GPU us, BENCHMARKS.md fifty-ninth session: fp16 2 x 12805 x 560 6.2 against the
    # 8-K-warp CTAs' 12.3, whose warps each stream a step or two; its grid does not fill the
    # SMs, which the earlier rule asked for), else the K-warp CTAs (fp16 5 x 3560 x 7792: the
    # one-K-warp plan splits, 19.4 against 10.0; 12 x 1819 x 1792: N under 2048)
    for M, N, K, one_k_warp in ((2, 12805, 560, True), (5, 3560, 7792, False), (12, 1819, 1792, False)):
        gemv = sorted((v for v in SPEC.variants if v.dtype == "float16" and ig.plans.is_gemv(v)),
                      key=lambda v: ig.plans.preference(v, M, N, 132, K))
        assert (gemv[0].params["warps_m"] == 1) == one_k_warp, (M, N, K, gemv[0].name)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA)
def test_cuda_variant_golden(name, poisoned_workspace):
    v = SPEC.variant(name)
    if not dispatch.arch_runs_on(v.arch, torch.cuda.get_device_capability()):
        pytest.skip(f"{v.arch} does not run here")
    impl = ig.implementation(_kernel(name))
    results = ig.golden(_kernel(name), DEV, v.dtype, SPEC.numerics[v.dtype], split_options=(None,))
    bad = [(case, r) for case, r in results if not r <= 1.0]
    assert not bad, bad
    # inputs the kernel cannot take (K % 16, a misaligned) go to the Triton companion
    a, b = _ints(33, 40), _ints(50, 40)
    assert not impl.cuda_takes(a, b)
    out = ig.gemm(impl, ig.MODE_MM, a, b, torch.empty(33, 50, dtype=torch.int32, device=DEV))
    assert torch.equal(out.cpu().long(), a.cpu().long() @ b.cpu().long().t())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64, 300])
def test_ops_dispatch_on_gpu(M):
    """The ops as dispatch runs them, at a Llama-like width: exact / within tolerance."""
    N, K = 4096, 4096
    a, b = _ints(M, K), _ints(N, K)
    assert torch.equal(ops.int8_mm(a, b).cpu().long(), a.cpu().long() @ b.cpu().long().t())
    sa, sb = torch.rand(M, device=DEV) / 127, torch.rand(N, device=DEV) / 127
    got = ops.int8_linear(a, b, sa, sb, torch.randn(N, device=DEV))
    assert got.dtype == torch.bfloat16
    x = torch.randn(M, K, device=DEV).to(torch.bfloat16)
    s = (torch.rand(N, device=DEV) + 0.5) / (127 * K ** 0.5)
    got = ops.w8a16_linear(x, b, s)
    ref = ig.reference.w8a16_linear(x, b, s, compute=torch.float64)
    torch.testing.assert_close(got.double(), ref, rtol=8e-3, atol=1e-4)


@pytest.mark.gpu
def test_cuda_graph_replay_and_compile():
    M, N, K = 4, 1000, 512
    a, b = _ints(M, K), _ints(N, K)
    x = torch.randn(M, K, device=DEV).to(torch.bfloat16)
    s = torch.rand(N, device=DEV) / 127
    ops.int8_mm(a, b), ops.w8a16_linear(x, b, s)  # build and choose outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c = ops.int8_mm(a, b)
        y = ops.w8a16_linear(x, b, s)
    a.copy_(_ints(M, K))
    x.copy_(torch.randn(M, K, device=DEV))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(c.cpu().long(), a.cpu().long() @ b.cpu().long().t())
    torch.testing.assert_close(y.double(), ig.reference.w8a16_linear(x, b, s, compute=torch.float64),
                               rtol=8e-3, atol=1e-4)
    f = torch.compile(lambda a, b, x: (ops.int8_mm(a, b), ops.w8a16_linear(x, b, s)), fullgraph=True)
    c2, y2 = f(a, b, x)
    assert torch.equal(c2, c) and torch.equal(y2, y)


def test_w8a16_under_autocast_takes_an_fp32_bias():
    """Under torch.autocast (CPU: bfloat16) an fp32 bias (a master parameter) is cast to
    the autocast dtype, as F.linear's is: the same as casting it by hand."""
    x = torch.randn(3, 32).bfloat16()
    b, s = _ints(5, 32, device="cpu"), torch.rand(5) / 127
    bias = torch.randn(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.w8a16_linear(x, b, s, bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ops.w8a16_linear(x, b, s, bias.bfloat16()))


# The Hopper kernel: M from 1 to past two 128-row tiles, N and K off every tile (K a multiple
# of 16, TMA's unit; 272 and 1040 end in a partial 128-byte panel), long K (3008: 24 panels).
WGMMA_SHAPES = ig.GPU_SHAPES + ((130, 4104, 1040), (300, 333, 128), (1029, 2000, 3008), (17, 1000, 272),
                                 (517, 1291, 2080))  # N odd: the staged epilogue


@pytest.mark.gpu
@pytest.mark.parametrize("name", WGMMA)
def test_wgmma_variant_golden(name, poisoned_workspace):
    """The sm_90a kernel itself (cuda_takes asserted: no fallback hides it) unsplit, with the
    call's own K split and with 1 and 3 forced splits, into poisoned outputs and partial
    planes: int8_mm equal to the int64 product, int8_linear within the spec's tolerance of
    float64; a rerun bit-identical; what TMA cannot take (K % 16) goes to Triton."""
    v = SPEC.variant(name)
    if not dispatch.arch_runs_on(v.arch, torch.cuda.get_device_capability()):
        pytest.skip(f"{v.arch} does not run here")
    impl = ig.implementation(_kernel(name))
    a, b = _ints(130, 1040), _ints(4104, 1040)
    assert impl.wgmma and impl.cuda_takes(a, b)
    results = ig.golden(_kernel(name), DEV, "int8", SPEC.numerics["int8"], shapes=WGMMA_SHAPES,
                        split_options=(None, 1, 3))
    bad = [(case, r) for case, r in results if not r <= 1.0]
    assert not bad, bad
    once = ig.gemm(impl, ig.MODE_MM, a, b, torch.empty(130, 4104, dtype=torch.int32, device=DEV), n_splits=3)
    again = ig.gemm(impl, ig.MODE_MM, a, b, torch.empty(130, 4104, dtype=torch.int32, device=DEV), n_splits=3)
    assert torch.equal(once, again)
    a, b = _ints(33, 40), _ints(50, 40)
    assert not impl.cuda_takes(a, b)
    out = ig.gemm(impl, ig.MODE_MM, a, b, torch.empty(33, 50, dtype=torch.int32, device=DEV))
    assert torch.equal(out.cpu().long(), a.cpu().long() @ b.cpu().long().t())


@pytest.mark.gpu
def test_wgmma_in_a_cuda_graph_and_under_compile():
    """The sm_90a kernel through the ops (int8_mm with a K split: workspace and combine inside
    the graph; int8_linear unsplit): graph replay on new inputs equal to eager, and
    torch.compile(fullgraph=True) equal too."""
    runs = [n for n in WGMMA if dispatch.arch_runs_on(SPEC.variant(n).arch, torch.cuda.get_device_capability())]
    if not runs:
        pytest.skip("no sm_90a device")
    impl = ig.implementation(_kernel(runs[0]))
    M, N, K = 40, 1000, 16384  # int8_mm splits K here (a long unsplit grid); int8_linear at M = 300 does not
    a, b, a2 = _ints(M, K), _ints(N, K), _ints(300, K)
    sa, sb = torch.rand(300, device=DEV) / 64, torch.rand(N, device=DEV) / 64
    bias = torch.randn(N, device=DEV)
    assert impl.splits(M, N, K, DEV) > 1
    with ig.using(impl):
        run = lambda: (ops.int8_mm(a, b), ops.int8_linear(a2, b, sa, sb, bias))  # noqa: E731
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c, y = run()
        a.copy_(_ints(M, K))
        a2.copy_(_ints(300, K))
        graph.replay()
        torch.cuda.synchronize()
        c0, y0 = run()
        assert torch.equal(c, c0) and torch.equal(y, y0)
        assert torch.equal(c.cpu().long(), a.cpu().long() @ b.cpu().long().t())
        f = torch.compile(lambda a, a2: (ops.int8_mm(a, b), ops.int8_linear(a2, b, sa, sb, bias)), fullgraph=True)
        c2, y2 = f(a, a2)
    assert torch.equal(c2, c0) and torch.equal(y2, y0)


@pytest.mark.gpu
def test_int8_linear_never_runs_the_reference_where_a_kernel_is_tuned(monkeypatch):
    """Where the reference (torch._int_mm) won int8_mm's bucket, int8_linear runs the bucket's
    fastest kgen candidate instead (the reference's epilogue is separate PyTorch passes);
    int8_mm keeps the reference. Exact / within tolerance either way."""
    M, N, K = 40, 700, 512
    cap = torch.cuda.get_device_capability()
    pick = next(v for v in dispatch.runnable("int8_gemm", "int8", DEV) if v.backend == "triton")
    entry = {"winner": tune.REFERENCE, "times_us": {tune.REFERENCE: 10.0, pick.name: 11.0}}
    monkeypatch.setattr(tuning_table, "lookup", lambda k: entry if "int8_gemm" in k and "|int8|" in k else None)
    monkeypatch.setattr(ig.op, "_IMPLS", {})
    monkeypatch.setattr(ig.op, "_BY_SHAPE", {})
    assert ig.op._impl(DEV, torch.int8, M, N, K, False) is None
    impl = ig.op._fused_impl(DEV, M, N, K)
    assert impl is not None and impl.cuda is None and impl.triton is dispatch.load(pick).module, (pick.name, cap)
    a, b = _ints(M, K), _ints(N, K)
    sa, sb = torch.rand(M, device=DEV) / 127, torch.rand(N, device=DEV) / 127
    got = ops.int8_linear(a, b, sa, sb, out_dtype=torch.float32)
    ref = ig.reference.int8_linear(a, b, sa, sb, None, compute=torch.float64)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-3)
    assert torch.equal(ops.int8_mm(a, b).cpu().long(), a.cpu().long() @ b.cpu().long().t())


@pytest.mark.gpu
def test_untuned_shapes_run_the_shape_preference(monkeypatch):
    """With no table entry (nor one nearby), int8 above M = 16 runs the WGMMA kernel on
    Hopper (its tile by M; on an H200 at 151 x 445 x 1456 8.5 us against the Triton
    tile's 47.8 a call); exact. W8A16 above 1024 rows (N, K multiples of 8) runs the reference."""
    monkeypatch.setattr(tuning_table, "lookup", lambda k: None)
    monkeypatch.setattr(tuning_table, "nearest", lambda k: None)
    monkeypatch.setattr(ig.op, "_IMPLS", {})
    monkeypatch.setattr(ig.op, "_BY_SHAPE", {})
    sm90a = torch.cuda.get_device_capability() == (9, 0)
    # W8A16 above W8A16_REFERENCE_M rows: the reference (dequantised weight, cuBLAS), but
    # for N or K not a multiple of 8 (cuBLAS's slower kernels)
    assert ig.op._impl(DEV, torch.bfloat16, 2658, 256, 3472, False) is None
    assert ig.op._impl(DEV, torch.bfloat16, 1000, 256, 3472, False) is not None
    assert ig.op._impl(DEV, torch.float16, 4493, 5269, 5856, False) is not None
    for M, N, K in ((151, 445, 1456), (600, 333, 272)):
        impl = ig.op._impl(DEV, torch.int8, M, N, K, False)
        assert impl is not None and (impl.wgmma if sm90a else not impl.gemv), (M, impl.name)
        a, b = _ints(M, K), _ints(N, K)
        assert torch.equal(ops.int8_mm(a, b).cpu().long(), a.cpu().long() @ b.cpu().long().t())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_w8a16_library_reference_rounds_once(dtype):
    """w8a16_pytorch (the op's CUDA reference; here its CPU form of the same math) against
    float64 on the golden's inputs (small scales and a bias: outputs near zero), per channel
    and per group, within the spec's tolerance; the formula it replaced (the product rounded
    to x's dtype, then scaled, or the dequantised weight rounded) is far outside it."""
    t = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    for M, N, K, group in ((33, 100, 512, 16), (5, 77, 1024, 128), (7, 61, 1040, None)):
        x = torch.randn(M, K, generator=g).to(t)
        b = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
        s = (torch.rand(N, K // group if group else 1, generator=g) + 0.5) / (127 * K ** 0.5)
        s = s.squeeze(1) if group is None else s
        bias = torch.randn(N, generator=g).to(t)
        want = ig.reference.w8a16_linear(x, b, s, bias, group, compute=torch.float64)
        assert error_ratio(ig.reference.w8a16_pytorch(x, b, s, bias, group), want, SPEC.numerics[dtype]) <= 1
        w = ig.reference.dequantized(b, s, group, torch.float32).to(t)
        assert error_ratio(torch.nn.functional.linear(x, w) + bias, want, SPEC.numerics[dtype]) > 1


def test_w8a16_error_ratio_bounds_accumulation_not_mistakes():
    """golden.w8a16_error_ratio widens the spec's tolerance by K units of roundoff (2^-24) of the
    sum of |terms| (the tensor cores' float32 accumulation) and no more: the float64 product
    rounded once is within it, a product whose K additions each lost most of a unit of
    roundoff, all one way, is at its edge (outside the spec's rtol / atol alone) and half as
    much again is outside it, one column's scale off by 10 % and an
    unwritten (NaN) element are far outside. (At K = 8192 the widening is a few % of a typical
    output: the goldens' small K hold the kernels to rtol / atol.)"""
    g = torch.Generator().manual_seed(5)
    M, N, K = 9, 40, 8192
    x = torch.randn(M, K, generator=g).to(torch.float16)
    b = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    s = torch.rand(N, generator=g) / 127
    tol = SPEC.numerics["float16"]
    want = ig.reference.w8a16_linear(x, b, s, None, None, compute=torch.float64)
    assert w8a16_error_ratio(want.to(torch.float16), x, b, s, None, None, tol) <= 1
    terms = x.double().abs() @ (b.double().abs() * s.double()[:, None]).t()
    drift = want + 0.9 * K * 2.0 ** -24 * terms
    assert error_ratio(drift, want, tol) > 1 >= w8a16_error_ratio(drift, x, b, s, None, None, tol)
    assert w8a16_error_ratio(want + 1.5 * K * 2.0 ** -24 * terms, x, b, s, None, None, tol) > 1
    wrong = s.clone()
    wrong[7] *= 1.1
    assert w8a16_error_ratio(ig.reference.w8a16_linear(x, b, wrong, None, None, compute=torch.float64),
                             x, b, s, None, None, tol) > 2
    hole = want.to(torch.float16)
    hole[3, 5] = float("nan")
    assert w8a16_error_ratio(hole, x, b, s, None, None, tol) == float("inf")


@pytest.mark.gpu
def test_w8a16_reference_within_the_tolerance():
    """The CUDA reference (the tables' winner for W8A16 at large M) rounds once, within the
    spec's tolerance against float64 (plus the tensor cores' float32 accumulation error,
    golden.w8a16_error_ratio, as the kernels are held to): per-channel and grouped scales,
    with and without bias, scales as the golden makes them (outputs near zero) and larger,
    K up to 8192."""
    for dtype in ("bfloat16", "float16"):
        t = getattr(torch, dtype)
        for M, N, K, group, with_bias in ((1025, 300, 512, None, False), (77, 1000, 4096, None, True),
                                          (300, 257, 1024, 128, True), (16, 64, 512, 16, False),
                                          (500, 2000, 8192, None, False)):
            x, b = torch.randn(M, K, device=DEV).to(t), _ints(N, K)
            for s in (torch.rand(N, K // group if group else 1, device=DEV) / 127,
                      (torch.rand(N, K // group if group else 1, device=DEV) + 0.5) / (127 * K ** 0.5)):
                s = s.squeeze(1) if group is None else s
                bias = torch.randn(N, device=DEV).to(t) if with_bias else None
                with ig.using(None):
                    got = ops.w8a16_linear(x, b, s, bias, group_size=group)
                assert got.dtype == t and got.shape == (M, N)
                ratio = w8a16_error_ratio(got, x, b, s, bias, group, SPEC.numerics[dtype])
                assert ratio <= 1, (dtype, M, N, K, group, ratio)


# gemv: M in {1, 3, 9, 16} (one and two 8-token groups, ragged), N not a multiple of the 64 /
# 128-row CTA (37, 200), K the smallest (16: one partial step), ragged steps (48, 272) and
# long (1040 = 16 full steps + 16); grouped scales need K % 64 == 0 (192, 1024).
GEMV_SHAPES = ((1, 37, 16), (3, 200, 48), (9, 37, 272), (16, 200, 1040), (1, 4096, 4096))


@pytest.mark.gpu
@pytest.mark.parametrize("name", GEMV)
def test_gemv_variant_golden(name, poisoned_workspace):
    """The small-M kernel itself (cuda_takes is asserted, so no fallback hides it), unsplit,
    with the call's own split and with 3 forced splits (partials + combine), into poisoned
    outputs and workspaces: int8_mm equal to the int64 product; int8_linear (bf16, fp16,
    f32 out, float32 or out-dtype bias) and w8a16_linear (per channel with float32 / 16-bit
    scales, per group of 64 and 128, bias or not) within the spec's tolerance of float64."""
    v = SPEC.variant(name)
    if not dispatch.arch_runs_on(v.arch, torch.cuda.get_device_capability()):
        pytest.skip(f"{v.arch} does not run here")
    impl = ig.implementation(_kernel(name))
    tol = SPEC.numerics[v.dtype]
    poison = ig.launch._empty  # the fixture's: NaN / 12345 everywhere
    g = torch.Generator(device=DEV).manual_seed(1)
    bad = []
    for M, N, K in GEMV_SHAPES:
        b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=DEV, generator=g)
        for n_splits in (1, None, 3):
            tag = f"{M}x{N}x{K} splits={n_splits}"
            if v.dtype == "int8":
                a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=DEV, generator=g)
                assert impl.cuda_takes(a, b, ig.MODE_MM)
                want = a.cpu().long() @ b.cpu().long().t()
                out = ig.gemm(impl, ig.MODE_MM, a, b, poison((M, N), torch.int32, DEV), n_splits=n_splits)
                if not torch.equal(out.cpu().long(), want):
                    bad.append(f"int8_mm {tag}")
                sa = torch.rand(M, device=DEV, generator=g) / 64
                sb = torch.rand(N, device=DEV, generator=g) / 64
                for out_dtype, bias_dtype in ((torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                              (torch.float32, None)):
                    bias = torch.randn(N, device=DEV, generator=g).to(bias_dtype) if bias_dtype else None
                    ref = ig.reference.int8_linear(a, b, sa, sb, bias, compute=torch.float64)
                    out = ig.gemm(impl, ig.MODE_LINEAR, a, b, poison((M, N), out_dtype, DEV), sa, sb, bias,
                                  n_splits=n_splits)
                    r = error_ratio(out, ref, tol)
                    if not r <= 1.0:
                        bad.append((f"int8_linear {out_dtype} {tag}", r))
            else:
                t = getattr(torch, v.dtype)
                x = torch.randn(M, K, device=DEV, generator=g).to(t)
                assert impl.cuda_takes(x, b, ig.MODE_W8A16)
                for group in (None, 64, 128):
                    if group and K % group:
                        continue
                    for sdt in (torch.float32, t):
                        cols = K // group if group else 1
                        s = ((torch.rand(N, cols, device=DEV, generator=g) + 0.5) / (127 * K ** 0.5)).to(sdt)
                        s = s.squeeze(1) if group is None else s
                        bias = torch.randn(N, device=DEV, generator=g).to(t) if sdt == t else None
                        ref = ig.reference.w8a16_linear(x, b, s, bias, group, compute=torch.float64)
                        out = ig.gemm(impl, ig.MODE_W8A16, x, b, poison((M, N), t, DEV), scale_b=s, bias=bias,
                                      group_size=group, n_splits=n_splits)
                        r = error_ratio(out, ref, tol)
                        if not r <= 1.0:
                            bad.append((f"w8a16 group={group} scale {sdt} {tag}", r))
    assert not bad, bad
    # what it cannot take goes to the Triton companion: M > 16, K % 16, groups of 16
    a, b = _ints(17, 64), _ints(50, 64)
    if v.dtype == "int8":
        assert not impl.cuda_takes(a, b) and not impl.cuda_takes(_ints(2, 40), _ints(5, 40))
        out = ig.gemm(impl, ig.MODE_MM, a, b, torch.empty(17, 50, dtype=torch.int32, device=DEV))
        assert torch.equal(out.cpu().long(), a.cpu().long() @ b.cpu().long().t())
    else:
        x = torch.randn(2, 64, device=DEV).to(getattr(torch, v.dtype))
        assert not impl.cuda_takes(x, b, ig.MODE_W8A16, 16) and impl.cuda_takes(x, b, ig.MODE_W8A16, 64)


@pytest.mark.gpu
def test_gemv_graph_replay_and_dispatch(monkeypatch):
    """The gemv kernels under CUDA graph capture (split: workspace and combine inside the
    graph); and dispatch at M <= 16 with nothing tuned for the bucket runs a gemv variant."""
    runs = [n for n in GEMV if dispatch.arch_runs_on(SPEC.variant(n).arch, torch.cuda.get_device_capability())]
    if not runs:
        pytest.skip("no gemv variant runs here")
    i8 = ig.implementation(_kernel(next(n for n in runs if SPEC.variant(n).dtype == "int8")))
    bf = ig.implementation(_kernel(next(n for n in runs if SPEC.variant(n).dtype == "bfloat16")))
    M, N, K = 5, 1000, 2048
    a, b = _ints(M, K), _ints(N, K)
    x = torch.randn(M, K, device=DEV).to(torch.bfloat16)
    s = (torch.rand(N, device=DEV) + 0.5) / (127 * K ** 0.5)
    c = torch.empty(M, N, dtype=torch.int32, device=DEV)
    y = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
    run = lambda: (ig.gemm(i8, ig.MODE_MM, a, b, c, n_splits=4), ig.gemm(bf, ig.MODE_W8A16, x, b, y, scale_b=s))  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    a.copy_(_ints(M, K))
    x.copy_(torch.randn(M, K, device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(c.cpu().long(), a.cpu().long() @ b.cpu().long().t())
    torch.testing.assert_close(y.double(), ig.reference.w8a16_linear(x, b, s, compute=torch.float64),
                               rtol=8e-3, atol=1e-4)
    monkeypatch.setattr(tuning_table, "lookup", lambda k: None)  # nothing tuned, nothing nearby
    monkeypatch.setattr(tuning_table, "nearest", lambda k: None)
    monkeypatch.delenv("KGEN_AUTOTUNE", raising=False)
    impl, _ = ig.op._choose(DEV, torch.int8, 3, 777, 512, False)
    assert impl is not None and impl.gemv, impl and impl.name


def test_fast_path_keys_hold_b_device_and_int8_linear_grad(monkeypatch):
    """The eager fast paths as a GPU process fills them (dispatch emulated on the CPU: a Triton
    variant under the interpreter): a later call whose b is on another device gets the general
    path's ValueError (the keys lacked b's device: the launch took a foreign pointer), and an
    int8_linear call whose scales or bias need a gradient is not served detached (the fast
    launcher has no autograd: the general path's op has)."""
    from kgen.families.int8_gemm import op as iop

    i8 = ig.implementation(_kernel(next(n for n in TRITON if SPEC.variant(n).dtype == "int8")))
    bf = ig.implementation(_kernel(next(n for n in TRITON if SPEC.variant(n).dtype == "bfloat16")))
    monkeypatch.setattr(iop, "_impl", lambda device, dtype, M, N, K, grouped: i8 if dtype == torch.int8 else bf)
    monkeypatch.setattr(iop, "_FAST", {})
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-128, 128, (3, 32), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (5, 32), dtype=torch.int8, generator=g)
    sa, sb, x = torch.rand(3, generator=g), torch.rand(5, generator=g), torch.randn(3, 32, generator=g).bfloat16()
    calls = (lambda b: ops.int8_mm(a, b), lambda b: ops.int8_linear(a, b, sa, sb), lambda b: ops.w8a16_linear(x, b, sb))
    for f in calls:
        f(b)  # (the signature kept)
    assert len(iop._FAST) == 3
    for f in calls:
        with pytest.raises(ValueError, match="meta"):
            f(b.to("meta"))
    s = sa.clone().requires_grad_()
    out = ops.int8_linear(a, b, s, sb, out_dtype=torch.float32)
    assert out.requires_grad
    out.sum().backward()
    assert s.grad is not None


def test_w8a16_second_derivative_in_x_fails_loudly():
    """A second derivative of w8a16_linear in x (frozen scales): the op's 'no second
    derivative' error, not a silent None (x was saved only when scale_b needed a gradient, so
    the error node never saw it)."""
    g = torch.Generator().manual_seed(5)
    b = torch.randint(-128, 128, (6, 32), dtype=torch.int8, generator=g)
    x = torch.randn(4, 32, generator=g).half().requires_grad_()
    out = ops.w8a16_linear(x, b, torch.rand(6, generator=g) / 127)
    gx, = torch.autograd.grad(out.float().pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(gx.float().sum(), x, allow_unused=True)


def test_grouped_w8a16_reference_scales_each_group_after_its_product():
    """Per-group W8A16 on the CPU path: each group's product scaled after the dot, as the
    kernels and w8a16_pytorch do. A huge finite scale over a zero dot gives 0 (the dequantised
    weight overflowed: NaN), as the per-channel form of the same math does."""
    x = torch.tensor([[1.0, 1.0] + [0.0] * 14]).bfloat16()
    b = torch.zeros(1, 16, dtype=torch.int8)
    b[0, 0], b[0, 1] = 127, -127
    s = torch.tensor([1e37])
    assert ops.w8a16_linear(x, b, s).item() == 0.0
    assert ops.w8a16_linear(x, b, s.view(1, 1), group_size=16).item() == 0.0
    assert reference.w8a16_pytorch(x, b, s.view(1, 1), None, 16).item() == 0.0


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_gradients_in_scales_and_bias(out_dtype):
    """int8_linear is differentiable in scale_a, scale_b and bias through .backward() (it had
    no autograd formula: only torch.func's composition gave them), against float64 autograd of
    the same expression, with leading batch dims; a second derivative fails loudly.
    Tolerance: float32 sums of K-term int products (exact) times scales, ~1e-6 relative."""
    g = torch.Generator().manual_seed(11)
    a = torch.randint(-128, 128, (2, 3, 37), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (19, 37), dtype=torch.int8, generator=g)
    sa = (torch.rand(2, 3, generator=g) / 50).requires_grad_()
    sb = (torch.rand(19, generator=g) / 50).requires_grad_()
    bias = torch.randn(19, generator=g).requires_grad_()
    up = torch.randn(2, 3, 19, generator=g)
    out = ops.int8_linear(a, b, sa, sb, bias, out_dtype)
    (out.float() * up).sum().backward()
    d = [t.detach().double().requires_grad_() for t in (sa, sb, bias)]
    c = (a.reshape(6, 37).double() @ b.double().t()) * d[0].reshape(6, 1) * d[1].reshape(1, 19) + d[2]
    (c.reshape(2, 3, 19) * up.to(out_dtype).double()).sum().backward()  # (out's gradient arrives in its dtype)
    for got, want in zip((sa.grad, sb.grad, bias.grad), d):
        torch.testing.assert_close(got.double(), want.grad, rtol=1e-5, atol=1e-6)
    sa2 = sa.detach().requires_grad_()
    gs, = torch.autograd.grad(ops.int8_linear(a, b, sa2, sb.detach(), None, torch.float32).pow(2).sum(), sa2,
                              create_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(gs.sum(), sa2)
