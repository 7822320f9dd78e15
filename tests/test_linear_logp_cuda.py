"""linear_logp's CUDA forward kernels (sm_90a WGMMA, mma.sync) on a GPU: each variant that
runs on the device against float64 at the issue's sizes with poisoned buffers, split
invariance, the fallback for inputs the kernels cannot take, CUDA graph replay, and that
dispatch picks them; the sm_90a variants' dz kernel (the backward's recompute) against
float64 and the Triton dz kernel. (The combine is the CUDA kernels' own, in the same
launcher call; the rest of the backward is test_linear_logp_gpu's.)"""

import math
from pathlib import Path

import pytest
import torch

from kgen import ops, spec
from kgen.families import linear_logp as llp
from kgen.families.linear_logp import cuda_variant, launch
from kgen.runtime import dispatch

ROOT = Path(__file__).resolve().parent.parent
SPEC = spec.load(ROOT / "kgen" / "specs" / "linear_logp.yaml")
CUDA = [v.name for v in SPEC.variants if v.backend == "cuda"]
pytestmark = pytest.mark.gpu
_IMPLS: dict = {}


def _impl(name) -> "llp.CudaForward":
    v = SPEC.variant(name)
    if not dispatch.arch_runs_on(v.arch, torch.cuda.get_device_capability()):
        pytest.skip(f"{v.arch} code does not run on this {torch.cuda.get_device_name()}")
    if name not in _IMPLS:
        _IMPLS[name] = llp.implementation(dispatch.load(v))
    return _IMPLS[name]


def _poison(monkeypatch):
    def poisoned(shape, dt, device):
        return torch.full(shape, float("nan") if dt.is_floating_point else 1 << 30, dtype=dt, device=device)

    monkeypatch.setattr(launch, "_empty", poisoned)


def _inputs(N, V, D, dtype, seed, bias=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    w = (torch.randn(V, D, device="cuda", generator=g) * (2.0 / math.sqrt(D))).to(dtype)
    b = (torch.randn(V, device="cuda", generator=g) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    if N > 1:
        t[::5] = -100
    return h, w, b, t


def _check(got, h, w, t, b, T, dtype_name):
    """logp and entropy within the spec's tolerance of float64; every element written."""
    want = llp.reference(h, w, t, b, temperature=T, compute=torch.float64)
    tol = SPEC.numerics[dtype_name]
    for name, a, e in zip(("logp", "entropy"), got, want):
        assert torch.isfinite(a).all(), f"{name}: unwritten (NaN) elements"
        torch.testing.assert_close(a.double(), e, rtol=tol.rtol, atol=tol.atol, msg=name)


def _rows(impl, N: int) -> int:
    """N rows, or for the small-N kernel (gemv) the most it takes less 3 where N is more."""
    return N if not impl.gemv or N <= impl.block_m else impl.block_m - 3


@pytest.mark.parametrize("name", CUDA)
@pytest.mark.parametrize("N", [1, 7, 16, 4099])
@pytest.mark.parametrize("V,D", [(50257, 2048), (128256, 4096), (151936, 2048), (151936, 4096)])
def test_forward_against_float64(monkeypatch, name, N, V, D):
    """Bias, ignored rows, temperature 0.8 and entropy; the kernel itself takes these inputs."""
    impl = _impl(name)
    if N == 4099 and (impl.gemv or V * D > 151936 * 2048 and name != CUDA[0]):
        pytest.skip("the largest size runs for the first tiled variant only (time; gemv: N <= block_m)")
    dtype = getattr(torch, impl.kernel.variant.dtype)
    h, w, b, t = _inputs(N, V, D, dtype, seed=N + V + D)
    assert impl.takes(h, w, b)
    _poison(monkeypatch)
    logp, ent, _, _ = llp.forward(impl, h, w, t, b, 0.8, -100, True)
    _check((logp, ent), h, w, t, b, 0.8, impl.kernel.variant.dtype)


@pytest.mark.parametrize("name", CUDA)
def test_without_bias_and_entropy(monkeypatch, name):
    impl = _impl(name)
    dtype = getattr(torch, impl.kernel.variant.dtype)
    h, w, _, t = _inputs(_rows(impl, 333), 32003, 1024, dtype, seed=2, bias=False)
    assert impl.takes(h, w, None)
    _poison(monkeypatch)
    logp, ent, lse2, ez2 = llp.forward(impl, h, w, t, None, 1.0, -100, False)
    assert ent.numel() == 0 and ez2.numel() == 0
    want, _ = llp.reference(h, w, t, None, compute=torch.float64)
    tol = SPEC.numerics[impl.kernel.variant.dtype]
    torch.testing.assert_close(logp.double(), want, rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("name", CUDA)
@pytest.mark.parametrize("splits", [1, None])
def test_logits_far_above_the_first_tiles(monkeypatch, name, splits):
    """The kernels sum exp2(z - m) against a reference m taken from a thread's first tile
    and fold a tile again only when a logit lies more than ~32 (base 2) above it. Every
    1237th column from V/3 on carries bias + 100 (+144 in base 2 at T = 1: exp2 of it
    against the first tiles' reference overflows), and a few rows are scaled 6x: later
    tiles must take the refold path, with and without V splits."""
    impl = _impl(name)
    dtype = getattr(torch, impl.kernel.variant.dtype)
    N, V, D = _rows(impl, 131), 40009, 264
    h, w, b, t = _inputs(N, V, D, dtype, seed=11)
    assert impl.takes(h, w, b)
    b = b.float()
    b[V // 3::1237] += 100.0
    b = b.to(dtype)
    h[::17] *= 6
    t[1::7] = V // 3 + 1237  # some targets on a spike
    _poison(monkeypatch)
    logp, ent, _, _ = llp.forward(impl, h, w, t, b, 1.0, -100, True, splits=splits)
    _check((logp, ent), h, w, t, b, 1.0, impl.kernel.variant.dtype)


@pytest.mark.parametrize("name", CUDA)
def test_split_invariance(name):
    """Any number of splits, including more than there are V tiles: rounding only."""
    impl = _impl(name)
    dtype = getattr(torch, impl.kernel.variant.dtype)
    h, w, b, t = _inputs(_rows(impl, 517), 50257, 1024, dtype, seed=7)
    assert impl.takes(h, w, b)
    tiles = -(-50257 // impl.block_n)
    outs = [llp.forward(impl, h, w, t, b, 1.0, -100, True, splits=s) for s in (1, 5, None, tiles + 3)]
    for logp, ent, _, _ in outs[1:]:
        torch.testing.assert_close(logp, outs[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, outs[0][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CUDA)
def test_inputs_the_kernel_cannot_take_fall_back(monkeypatch, name):
    """D not a multiple of 8, and a hidden pointer off 16-byte alignment: the Triton
    forward serves them (no crash, same numbers)."""
    impl = _impl(name)
    dtype = getattr(torch, impl.kernel.variant.dtype)
    h, w, b, t = _inputs(65, 3001, 1001, dtype, seed=4)
    assert not impl.takes(h, w, b)
    _poison(monkeypatch)
    _check(llp.forward(impl, h, w, t, b, 1.0, -100, True)[:2], h, w, t, b, 1.0, impl.kernel.variant.dtype)
    h, w, b, t = _inputs(65, 3001, 1024, dtype, seed=5)
    storage = torch.empty(65 * 1024 + 1, dtype=dtype, device="cuda")
    shifted = storage[1:].view(65, 1024)
    shifted.copy_(h)
    assert shifted.is_contiguous() and not impl.takes(shifted, w, b)
    _check(llp.forward(impl, shifted, w, t, b, 1.0, -100, True)[:2], h, w, t, b, 1.0, impl.kernel.variant.dtype)


@pytest.mark.parametrize("name", CUDA)
def test_cuda_graph_replay(name):
    from test_linear_logp_gpu import check_graph_replay

    impl = _impl(name)
    check_graph_replay(llp.using(impl), getattr(torch, impl.kernel.variant.dtype), N=_rows(impl, 129))


def test_dispatch_prefers_the_cuda_kernel():
    """The first CUDA variant that runs: on Hopper (cc 9.0) the sm_90a one with the 2-CTA
    cluster; elsewhere the first mma.sync variant."""
    cap = torch.cuda.get_device_capability()
    llp._MODULES.clear()
    impl = llp._module(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    assert isinstance(impl, llp.CudaForward)
    runs = [v for v in SPEC.variants if v.backend == "cuda" and v.dtype == "bfloat16"
            and dispatch.arch_runs_on(v.arch, cap)]
    assert impl.kernel.variant.arch == ("sm_90a" if cap == (9, 0) else runs[0].arch)
    assert impl.name == runs[0].name
    assert impl.triton.SPLIT_V >= 1  # the Triton companion that combines and differentiates


SM90A = [n for n in CUDA if SPEC.variant(n).arch == "sm_90a"]


@pytest.mark.parametrize("name", SM90A)
@pytest.mark.parametrize("N,V,D,v0,v1,entropy,glogp", [
    (7, 3001, 264, 0, 3001, True, True),          # one chunk, the vocabulary's ragged end
    (333, 50257, 1032, 300, 1337, True, True),    # a chunk off the tile grid on both sides
    (333, 50257, 1032, 40000, 50257, False, True),
    (129, 20000, 520, 5000, 9000, True, False),   # entropy only (g_logp zeros, passed as None)
])
def test_cuda_dz_kernel(monkeypatch, name, N, V, D, v0, v1, entropy, glogp):
    """The sm_90a dz kernel writes exactly columns [0, v1 - v0) of every row of a
    NaN-poisoned [N, stride] buffer (stride wider than the chunk), matching float64 within
    bf16/fp16 rounding of dz (relative 2^-8 of each element, the storage type's half ulp
    with margin) plus 2e-3 of the largest |dz| (the logits are float32 sums of rounded
    products), and the Triton dz kernel on the same chunk to the same tolerance."""
    impl = _impl(name)
    monkeypatch.setattr(cuda_variant, "CUDA_DZ", "always")  # at any size
    dtype = getattr(torch, impl.kernel.variant.dtype)
    h, w, _, t = _inputs(N, V, D, dtype, seed=N + v0)
    t[1::11] = v0 + 5  # targets inside the chunk
    T = 0.7
    logp, ent, lse2, ez2 = llp.forward(impl, h, w, t, None, T, -100, entropy)
    g = torch.Generator(device="cuda").manual_seed(3)
    g_logp = torch.randn(N, device="cuda", generator=g) if glogp else None
    g_ent = torch.randn(N, device="cuda", generator=g) if entropy else None
    width, stride = v1 - v0, v1 - v0 + 18 - (v1 - v0) % 2
    dz = torch.full((N, stride), float("nan"), dtype=dtype, device="cuda")
    assert impl.takes_dz(h, w, None)
    impl.dz(h, w, t, lse2, ez2 if entropy else None, g_logp, g_ent, dz, v0, v1, T, -100)
    assert torch.isfinite(dz[:, :width]).all(), "unwritten dz elements"
    assert torch.isnan(dz[:, width:]).all(), "written past the chunk"
    want = llp.reference_dz(h, w, t, lse2, ez2 if entropy else None, g_logp, g_ent, T, -100, v0, v1,
                            compute=torch.float64)
    atol = 2e-3 * want.abs().max().item()
    torch.testing.assert_close(dz[:, :width].double(), want, rtol=2 ** -8, atol=atol)
    # the Triton dz kernel (the companion's) on the same chunk
    mod = impl.triton
    tri = torch.full((N, stride), float("nan"), dtype=dtype, device="cuda")
    h_src, w_src, tma = llp.plans._tile_sources(mod, h, w)
    zero = torch.zeros(N, device="cuda")
    mod.linear_logp_bwd_dz_kernel[llp.plans.dz_grid(mod, N, width)](
        h_src, w_src, w, t, lse2, ez2 if entropy else lse2, g_logp if glogp else zero,
        g_ent if entropy else zero, tri, tri, N, V, D, v0, v1, stride, math.log2(math.e) / T, 1.0 / T, -100,
        HAS_BIAS=False, WRITE_BPART=False, WITH_ENTROPY=entropy, HAS_GLOGP=glogp, TMA=tma,
        PRECISION=llp.plans._precision(dtype), GROUP=llp.plans.GROUP, **llp.plans._tiles(mod))
    torch.testing.assert_close(dz[:, :width].double(), tri[:, :width].double(), rtol=2 ** -8, atol=atol)


@pytest.mark.parametrize("name", SM90A)
@pytest.mark.parametrize("N,V,D,bias", [(1031, 40009, 1032, False), (1031, 40009, 1032, True), (9, 517, 264, False)])
def test_backward_with_cuda_dz_against_float64(monkeypatch, name, N, V, D, bias):
    """The whole backward with the CUDA dz kernel (several chunks: a small workspace), every
    buffer poisoned, against float64, and against the Triton dz path (KGEN_LINEAR_LOGP_CUDA_DZ
    off). With a bias the Triton dz kernel runs (column sums for grad_bias)."""
    impl = _impl(name)
    monkeypatch.setattr(cuda_variant, "CUDA_DZ", "always")  # at any size
    dtype = getattr(torch, impl.kernel.variant.dtype)
    h, w, b, t = _inputs(N, V, D, dtype, seed=V + D, bias=bias)
    assert impl.takes_dz(h, w, b) is (not bias)
    T = 0.9
    logp, ent, lse2, ez2 = llp.forward(impl, h, w, t, b, T, -100, True)
    g = torch.Generator(device="cuda").manual_seed(5)
    g_logp, g_ent = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    _poison(monkeypatch)
    budget = dict(workspace_bytes=N * 2 * 4096, accumulator_bytes=1 << 30)
    got = llp.backward(impl, h, w, t, b, lse2, ez2, g_logp, g_ent, T, -100, **budget)
    monkeypatch.setattr(cuda_variant, "CUDA_DZ", "never")
    assert not impl.takes_dz(h, w, None)
    tri = llp.backward(impl, h, w, t, b, lse2, ez2, g_logp, g_ent, T, -100, **budget)
    want = llp.reference_backward(h.double(), w.double(), t, b.double() if bias else None, g_logp.double(),
                                  g_ent.double(), T, -100)
    for nm, a, c, e in zip(("grad_hidden", "grad_weight", "grad_bias"), got, tri, want):
        if not bias and nm == "grad_bias":
            continue
        assert torch.isfinite(a).all(), f"{nm}: unwritten elements"
        # bf16/fp16 outputs of float32 sums: a unit of the last place (2^-7 relative) plus
        # 1e-2 of the largest gradient (dz itself rounded to 16 bits before the GEMMs)
        atol = 1e-2 * e.abs().max().item()
        torch.testing.assert_close(a.double(), e, rtol=2 ** -7, atol=atol, msg=nm)
        torch.testing.assert_close(a.double(), c.double(), rtol=2 ** -7, atol=atol, msg=nm)


@pytest.mark.parametrize("name", SM90A)
def test_cuda_dz_policy(monkeypatch, name):
    """By default the CUDA dz kernel serves host-bound sizes only (cuda_variant.CUDA_DZ_MAX_FLOP);
    KGEN_LINEAR_LOGP_CUDA_DZ's "always" / "never" override it; a bias always takes the Triton
    kernel (grad_bias's column sums)."""
    impl = _impl(name)
    dtype = getattr(torch, impl.kernel.variant.dtype)
    small = [torch.empty(s, dtype=dtype, device="cuda") for s in ((8, 512), (1024, 512))]
    large = [torch.empty(s, dtype=dtype, device="cuda") for s in ((4096, 2048), (151936, 2048))]
    assert impl.takes_dz(*small, None) and not impl.takes_dz(*large, None)
    assert not impl.takes_dz(*small, small[1][:, 0].contiguous())
    monkeypatch.setattr(cuda_variant, "CUDA_DZ", "always")
    assert impl.takes_dz(*large, None)
    monkeypatch.setattr(cuda_variant, "CUDA_DZ", "never")
    assert not impl.takes_dz(*small, None)


@pytest.mark.parametrize("name", SM90A)
def test_cuda_dz_in_a_cuda_graph_and_under_torch_compile(name):
    """Forward + backward at a host-bound size without bias (the default policy's CUDA dz
    kernel): captured in a CUDA graph after a warm-up and replayed, the gradients are the
    eager call's bit for bit (no atomics: the same kernels in the same order); through
    torch.compile(fullgraph=True), the same gradients (the op is opaque to Inductor, and the
    upstream gradients of the sums are exact)."""
    impl = _impl(name)
    dtype = getattr(torch, impl.kernel.variant.dtype)
    h, w, _, t = _inputs(64, 4099, 1032, dtype, seed=9, bias=False)
    assert impl.takes_dz(h, w, None)
    g = torch.randn(64, device="cuda")
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()

    def loss(hl, wl):
        logp, ent = ops.linear_logp(hl, wl, t, temperature=0.9, return_entropy=True)
        return (logp * g).sum() + ent.sum()

    def fb():
        return torch.autograd.grad(loss(hl, wl), (hl, wl))

    with llp.using(impl):
        want = fb()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fb()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fb()
        for x in got:
            x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        compiled = torch.compile(loss, fullgraph=True)
        grads = torch.autograd.grad(compiled(hl, wl), (hl, wl))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


GEMV = [n for n in CUDA if SPEC.variant(n).params["kernel"] == "gemv"]


@pytest.mark.parametrize("name", GEMV)
@pytest.mark.parametrize("splits", [1, 3, None, 188])
def test_gemv_shares_that_split_groups(monkeypatch, name, splits):
    """The small-N kernel's warps take equal shares of the vocabulary's (16-row group, step)
    sequence, so a share may start or end inside a group (D = 1032: 17 or 33 steps a group,
    never a whole number of groups a warp): every row count up to block_m (both pass widths),
    against float64 with poisoned buffers, and the same bits on a second call. 188 splits: a
    group a CTA (V = 3001), its 16 warps sharing 65 steps; None: the plan's (132 on an H200)."""
    impl = _impl(name)
    dtype = getattr(torch, impl.kernel.variant.dtype)
    for N in sorted({1, 2, 8, 9, impl.block_m}):
        h, w, b, t = _inputs(N, 3001, 1032, dtype, seed=N)
        assert impl.takes(h, w, b)
        _poison(monkeypatch)
        got = llp.forward(impl, h, w, t, b, 0.9, -100, True, splits=splits)
        _check(got[:2], h, w, t, b, 0.9, impl.kernel.variant.dtype)
        again = llp.forward(impl, h, w, t, b, 0.9, -100, True, splits=splits)
        assert all(torch.equal(a, c) for a, c in zip(got, again)), N


F32_GEMV = [n for n in GEMV if SPEC.variant(n).dtype == "float32"]


@pytest.mark.parametrize("name", F32_GEMV)
@pytest.mark.parametrize("N", [1, 5, 16])
def test_float32_gemv_in_both_precisions(monkeypatch, tf32, name, N):
    """The float32 gemv kernel, precision read per call. TF32 allowed: one product of operands
    rounded to the nearest TF32 value (sm_90 cvt.rn: ties to even; sm_80: ties away), so logp
    and entropy equal float64 from the rounded operands within float32 sums and ex2.approx
    (bound 5e-5), where float64 from the operands as they are differs by ~1e-3. TF32 off:
    three products (~2^-21 relative), within the spec's float32 tolerance of float64. The
    same launch bound once (bind_forward, as the fast path holds it) follows the setting;
    every buffer poisoned; D = 1004 (16-byte rows, not a multiple of 8), V = 3001."""
    from tf32_rounding import tf32_rounded

    impl = _impl(name)
    h, w, b, t = _inputs(N, 3001, 1004, torch.float32, seed=40 + N)
    assert impl.takes(h, w, b)
    _poison(monkeypatch)
    ties = "even" if torch.cuda.get_device_capability() >= (9, 0) else "away"
    rh, rw = (tf32_rounded(x, ties) for x in (h, w))
    for on in (True, False, True):
        tf32(on)
        logp, ent, _, _ = llp.forward(impl, h, w, t, b, 0.9, -100, True)
        if on:
            want = llp.reference(rh, rw, t, b, temperature=0.9, compute=torch.float64)
            plain = llp.reference(h, w, t, b, temperature=0.9, compute=torch.float64)
            for nm, a, r, p in zip(("logp", "entropy"), (logp, ent), want, plain):
                err, off = (a.double() - r).abs().max().item(), (p - r).abs().max().item()
                assert err <= 5e-5 and off > 20 * err, (nm, err, off)
        else:
            _check((logp, ent), h, w, t, b, 0.9, "float32")
    go = impl.bind_forward(N, 3001, 1004, 1, False, h.device)
    for on in (False, True):
        tf32(on)
        outs = [torch.full((N,), float("nan"), device="cuda") for _ in range(3)]
        part = torch.empty(4 * N, device="cuda")
        go(h.data_ptr(), w.data_ptr(), 0, t.data_ptr(), part.data_ptr(), outs[0].data_ptr(), 0, outs[1].data_ptr(),
           0, -100, math.log2(math.e))
        want = llp.reference(*((rh, rw) if on else (h, w)), t, compute=torch.float64)[0]
        assert (outs[0].double() - want).abs().max().item() <= (5e-5 if on else 2e-5), on
