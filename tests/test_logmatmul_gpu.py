"""logmatmul on a GPU (the `gpu` marker; skipped where none exists): every variant's golden
numerics, awkward sizes, the CUDA forms' K splits and tensor-core sizes, the fast paths under
CUDA-graph capture, dispatch determinism, torch.compile and block-sparse. The CPU half, and
the helpers these share, are in test_logmatmul.py."""

import contextlib

import pytest
import torch

from kgen.families import logmatmul as lmm
from kgen.families.logmatmul import backward_launch, launch, numerics
from kgen.runtime import dispatch
from test_logmatmul import (CUDA, MMA, MMA_FORMS, SPEC, TRITON, _assert_ok, _mod, _pattern, _variant,
                             assert_nan_as_pytorch, nan_case)
from test_logmatmul import poison  # noqa: F401 - the fixture, by name
from test_logmatmul import assert_negative_weights_as_formula

gpu = pytest.mark.gpu
ALL_GPU = [v.name for v in SPEC.variants]


def _gpu_mod(name):
    v = _variant(name)
    if v.backend == "cuda" and not dispatch.arch_runs_on(v.arch, torch.cuda.get_device_capability()):
        pytest.skip(f"{v.arch} code does not run here")
    return _mod(name)


@gpu
@pytest.mark.parametrize("name,B,K", [(n, B, K) for n in TRITON for B, K in ((5, 300), (64, 4096))])
def test_gpu_triton_fast_path_bound_and_in_a_cuda_graph(name, B, K):
    """A Triton variant's fast path on the GPU: after the recording call every launch is a
    bound one, the output equals `forward`'s bit for bit (N off every tile), and a capture
    of the call replays what an eager call computes for new inputs."""
    from kgen.runtime import triton_launch as tlaunch

    mod = _gpu_mod(name)
    N = 333
    x, w = torch.randn(B, K, device="cuda") * 3, torch.rand(N, K, device="cuda")
    fast = launch.triton_direct(mod, B, N, K, x.device)
    fast(x, w)  # launches and records
    n, d = tlaunch.STATS["direct"], tlaunch.STATS["driver"]
    out = fast(x, w)
    plan = launch._triton_plan(mod, B, N, K, x.device)
    launches = 1 + plan[4] + (plan[1] > 1)  # the forward, the exp pass, the K-split combine
    assert tlaunch.STATS["direct"] == n + launches
    assert tlaunch.STATS["driver"] == d + launches  # through the trampoline's cuLaunchKernel
    assert torch.equal(out, launch.forward(mod, x, w))
    _assert_capture_replays(fast, x, w)


def _assert_capture_replays(fast, x, w):
    """A capture of the fast path `fast(x, w)` (warmed up on a side stream first) replays
    what an eager call computes after x is refilled."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fast(x, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fast(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, fast(x, w))


@gpu
@pytest.mark.parametrize("name", [n for n in TRITON if _variant(n).params["dot"] != "none"])
def test_gpu_tl_dot_tiles_in_both_forms(poison, name):
    """A tl.dot tile takes its exps in the tile loop (one launch) below plans.PRE_PASS_WORK
    and reads them from the exp launch at or above it. Both forms within tolerance of
    float64, forward and gradients, at sizes off every tile."""
    mod = _gpu_mod(name)
    v, dev = _variant(name), torch.device("cuda")
    for B, N, K in ((70, 333, 1030), (67, 3001, 1031)):  # 24M and 207M (PRE_PASS_WORK: 201M)
        pre = launch._triton_plan(mod, B, N, K, dev)[4]
        assert pre == (B * N * K > 1 << 27), (B, N, K, pre)
        _assert_ok(numerics.check_case(mod, B, N, K, getattr(torch, v.dtype), torch.float32, dev,
                                       SPEC.numerics[v.dtype]))


@gpu
@pytest.mark.parametrize("name", ALL_GPU)
def test_gpu_golden(poison, name):
    v = SPEC.variant(name)
    _gpu_mod(name)  # skips an arch this GPU cannot run
    _assert_ok(lmm.golden(dispatch.load(v), torch.device("cuda"), v.dtype, SPEC.numerics[v.dtype]))


@gpu
@pytest.mark.parametrize("name,B", [(n, B) for n in ALL_GPU if "f32" in n
                                    # 11: a CUDA variant's last tile of rows part-full; tensor cores: one
                                    # n-tile of 8 rows full and part-full, two n-tiles part-full
                                    for B in (1, 3, 11, 16) + ((5, 8, 13) if n in MMA else ())])
def test_gpu_awkward_sizes(poison, name, B):
    mod = _gpu_mod(name)
    dev = torch.device("cuda")
    for N, K in ((1000, 4100), (77, 333)):
        _assert_ok(numerics.check_case(mod, B, N, K, torch.float32, torch.float32, dev, SPEC.numerics["float32"]))


@gpu
def test_gpu_dispatch_deterministic_graph_replay_bit_identical():
    dev = torch.device("cuda")
    for B in (1, 8, 64):
        x, w = numerics.make_inputs(B, 4096, 4096, torch.float32, dev)
        g = torch.randn(B, 4096, device=dev)
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()

        def step():
            xl.grad = wl.grad = None
            out = lmm.logmatmul(xl, wl)
            out.backward(g)
            return out.detach().clone(), xl.grad.clone(), wl.grad.clone()

        eager = step()
        again = step()
        for a, b in zip(eager, again):  # no atomics: bit-identical run to run
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
        static_out = torch.empty_like(eager[0])
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            lmm.logmatmul(x, w)  # built and chosen outside the capture
            with torch.cuda.graph(graph):
                static_out.copy_(lmm.logmatmul(x, w))
        torch.cuda.current_stream().wait_stream(s)
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out.nan_to_num(), eager[0].nan_to_num())


@gpu
def test_gpu_torch_compile_fullgraph():
    dev = torch.device("cuda")
    x, w = numerics.make_inputs(4, 300, 512, torch.float32, dev)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    f = torch.compile(lambda a, b: torch.where(torch.isfinite(lmm.logmatmul(a, b)), lmm.logmatmul(a, b), 0).sum(),
                      fullgraph=True)
    f(xl, wl).backward()
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = lmm.reference(xr, wr, torch.float64)
    torch.where(torch.isfinite(ref), ref, 0).sum().backward()
    torch.testing.assert_close(xl.grad.double(), xr.grad, rtol=0, atol=2e-5 * max(1.0, float(xr.grad.abs().max())))
    torch.testing.assert_close(wl.grad.double(), wr.grad, rtol=0, atol=2e-5 * max(1.0, float(wr.grad.abs().max())))


@gpu
@pytest.mark.parametrize("name", TRITON)
def test_gpu_block_sparse(poison, name):
    mod = _gpu_mod(name)
    bs, R, C, B = 128, 8, 8, 5
    blocks, row_ptr, col_idx = _pattern(R, C, 0.25, bs, seed=3)
    blocks, row_ptr, col_idx = blocks.cuda(), row_ptr.cuda(), col_idx.cuda()
    x, _ = numerics.make_inputs(B, 1, C * bs, torch.float32, torch.device("cuda"))
    with lmm.using(mod):
        out = lmm.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, bs)
        dense = lmm.logmatmul(x, lmm.dense_from_blocks(blocks, row_ptr, col_idx, bs, C * bs))
    assert torch.equal(torch.isneginf(out), torch.isneginf(dense))
    f = torch.isfinite(dense)
    torch.testing.assert_close(out[f], dense[f], rtol=1e-5, atol=3e-5)


@gpu
@pytest.mark.parametrize("name", [n for n in CUDA if n.endswith("f32")])
def test_gpu_cuda_wide_range_and_splits(poison, name):
    """x spread over ~+-100 (each thread's own shift differs: the merge rescales exactly),
    -inf holes; any K split gives the same result to float32 rounding."""
    mod = _gpu_mod(name)
    dev = torch.device("cuda")
    for B in sorted({1, 3, min(11, mod.max_b), mod.max_b} | ({5, 8, 13} if name in MMA else set())):
        x, w = numerics.make_inputs(B, 300, 4096, torch.float32, dev, seed=B)
        x = x * 15
        want = lmm.reference(x.double(), w.double(), torch.float64)
        outs = [launch.forward(mod, x, w, splits=s) for s in (None, 1, 3)]
        for out in outs:
            assert torch.equal(torch.isneginf(out), torch.isneginf(want))
            f = torch.isfinite(want)
            # out up to ~100: 1e-5 relative (exp2/log to a few ulp, 4096-term sums) + 3e-5
            torch.testing.assert_close(out[f].double(), want[f], rtol=1e-5, atol=3e-5)


@gpu
@pytest.mark.parametrize("name", [n for n in CUDA if n.startswith("sm90")] or CUDA)
def test_gpu_cuda_backward(poison, name):
    """The CUDA library's backward (float32 w, B <= 16; no Triton fallback allowed here)
    against float64: -inf holes, an all -inf row, a zero weight row, one chunk of N and
    several, K not a multiple of a CTA's 512 columns, weights scaled by 1e30 and 1e-30.
    Each gradient is judged against its own largest element (float32 sums of ~N or ~B terms:
    numerics.GRAD_TOL of it; 16-bit dx rounds once more)."""
    mod = _gpu_mod(name)
    dev = torch.device("cuda")
    t = mod.dtype
    tol = numerics.GRAD_TOL[str(t).removeprefix("torch.")]
    for B, N, K, scale in ((1, 300, 516, 1.0), (2, 5, 1028, 1.0), (5, 300, 4096, 1e30), (8, 70, 200, 1e-30),
                           (8, 1000, 516, 1.0), (11, 300, 1028, 1e30), (16, 70, 260, 1e-30), (13, 1000, 4100, 1.0)):
        x, w = numerics.make_inputs(B, N, K, t, dev, seed=B + N)
        w = w * scale
        g = torch.randn(B, N, generator=torch.Generator().manual_seed(B), dtype=torch.float64).to(dev)
        out = launch.forward(mod, x, w)
        got = mod.backward(x, w, out, g.float())
        assert got is not None, "the CUDA backward declined"
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        lmm.reference(xr, wr, torch.float64).backward(g)
        for have, want, gt in ((got[0], xr.grad, tol), (got[1], wr.grad, numerics.GRAD_TOL["float32"])):
            big = float(want.abs().max())
            assert big > 0 and torch.isfinite(have).all(), (B, N, K, scale)
            assert float((have.double() - want).abs().max()) <= gt * big, (B, N, K, scale)
        again = mod.backward(x, w, out, g.float())
        assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])  # no atomics


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_a_triton_forward_takes_the_cuda_backward(poison, monkeypatch, dtype):
    """Where dispatch gives a Triton tile at B <= 16 with float32 w (the tuned bf16 B <= 16
    buckets at 4096^2 do; here `_module` is patched to give it), the op's backward runs a CUDA
    variant's library backward (spied: its bound launcher ran, and took the call), with
    gradients within GRAD_TOL of float64 and bit-identical run to run."""
    from kgen.families.logmatmul import op as lop

    tri = _gpu_mod(next(v.name for v in SPEC.variants if v.backend == "triton" and v.dtype == dtype))
    monkeypatch.setattr(lop, "_module", lambda *a: tri)
    monkeypatch.setattr(lop, "_BWD_FAST", {})
    ran = []
    real = launch.CudaForward.backward_direct

    def spy(self, *a):  # the op's backward takes the library's bound launcher (backward_direct)
        f = real(self, *a)
        if f is None:
            ran.append(False)
            return None

        def counted(*b):
            got = f(*b)
            ran.append(got is not None)
            return got

        return counted

    monkeypatch.setattr(launch.CudaForward, "backward_direct", spy)
    t = getattr(torch, dtype)
    for B, N, K in ((13, 300, 1028), (4, 77, 516)):
        x, w = numerics.make_inputs(B, N, K, t, torch.device("cuda"), seed=B)  # (w float32)
        g = torch.randn(B, N, generator=torch.Generator().manual_seed(B), dtype=torch.float64).to("cuda")
        grads = []
        for _ in range(2):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            lmm.logmatmul(xg, wg).backward(g.float())
            grads.append((xg.grad, wg.grad))
        assert ran == [True, True] * (1 + (B == 4)), ran
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        lmm.reference(xr, wr, torch.float64).backward(g)
        tol = numerics.GRAD_TOL[dtype]
        for have, want, gt in ((grads[0][0], xr.grad, tol), (grads[0][1], wr.grad, numerics.GRAD_TOL["float32"])):
            big = float(want.abs().max())
            assert big > 0 and torch.isfinite(have).all(), (B, N, K)
            assert float((have.double() - want).abs().max()) <= gt * big, (B, N, K)
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_backward_fast_path_replays_each_form(poison, dtype):
    """The backward's bound launches (backward_launch.backward_direct, the op's backward per
    signature) in each form: the one-pass Triton kernel with one chunk of N and with several,
    the GEMM form (w float32, and w in x's dtype) and a CUDA library's backward. After the
    recording call the Triton launches replay (counted); every call gives
    `backward_launch.backward`'s gradients bit for bit, within GRAD_TOL of float64 (as
    test_gpu_cuda_backward judges them); a CUDA graph capture of it replays what an eager call
    computes for a new upstream gradient."""
    from kgen.runtime import triton_launch as tlaunch

    t, dev = getattr(torch, dtype), torch.device("cuda")
    tri = _gpu_mod(next(v.name for v in SPEC.variants if v.backend == "triton" and v.dtype == dtype))
    cuda = _gpu_mod(next(n for n in CUDA if n.startswith("sm90") and _variant(n).dtype == dtype
                         and not _variant(n).params["mma"]))
    gemm_b = tri.BWD_B + 3
    cases = [(tri, min(3, tri.BWD_B), 50, 1030, torch.float32, 1), (tri, tri.BWD_B, 3001, 1031, torch.float32, None),
             (tri, gemm_b, 333, 1030, torch.float32, 3), (tri, gemm_b, 200, 515, t, 3),
             (cuda, 6, 300, 1028, torch.float32, 0)]
    for mod, B, N, K, wt, launches in cases:
        x, w = numerics.make_inputs(B, N, K, t, dev, w_dtype=wt, seed=B + K)
        g = torch.randn(B, N, generator=torch.Generator().manual_seed(N), dtype=torch.float64).to(dev)
        out = launch.forward(tri, x, w)
        plan = backward_launch._bwd_plan(tri, B, N, K, dev)
        if launches is None:  # several chunks: the partials' sum is a third launch
            assert not plan[0] and plan[1] > 1, plan
            launches = 3
        elif launches == 1:
            assert not plan[0] and plan[1] == 1, plan
            launches = 2
        f = backward_launch.backward_direct(mod, B, N, K, t, wt, x.device)  # (the op passes x's: with its index)
        first = f(x, w, out, g.float())
        n = tlaunch.STATS["direct"]
        again = f(x, w, out, g.float())
        assert tlaunch.STATS["direct"] == n + launches, (B, N, K)
        want_dx, want_dw = backward_launch.backward(mod, x, w, out, g.float())
        for got in (first, again):
            assert torch.equal(got[0], want_dx) and torch.equal(got[1], want_dw), (B, N, K)
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        lmm.reference(xr, wr, torch.float64).backward(g)
        for have, ref, tol in ((first[0], xr.grad, numerics.GRAD_TOL[dtype]),
                               (first[1], wr.grad, numerics.GRAD_TOL[str(wt).removeprefix("torch.")])):
            big = float(ref.abs().max())
            assert big > 0 and torch.isfinite(have).all(), (B, N, K)
            assert float((have.double() - ref).abs().max()) <= tol * big, (B, N, K)
        gf = g.float()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f(x, w, out, gf)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = f(x, w, out, gf)
        gf.copy_(torch.randn_like(gf))
        graph.replay()
        eager = f(x, w, out, gf)
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1]), (B, N, K)


@gpu
@pytest.mark.parametrize("name", [n for n in CUDA if n.startswith("sm90")])
def test_gpu_cuda_fast_path_with_a_k_split(poison, name):
    """The op's eager fast path (CudaForward.direct) where the plan splits K: the partials in
    a scratch of its own, the output bit-identical to the general path's (CudaForward.run)
    and within tolerance of float64; under CUDA-graph capture it replays what an eager call
    computes for new inputs."""
    mod = _gpu_mod(name)
    dev = torch.device("cuda", torch.cuda.current_device())  # as x.device is where the op asks
    B = min(3, mod.max_b)
    for N, K in ((1000, 4104), (77, 8200)):
        x, w = lmm.make_inputs(B, N, K, getattr(torch, _variant(name).dtype), dev)
        assert mod._plan((B, N, K, x.dtype, w.dtype, dev.index))[0] > 1, (N, K)
        fast = mod.direct(B, N, K, x.dtype, w.dtype, dev)
        out = fast(x, w)
        want = torch.empty(B, N, device=dev)
        assert mod.run(x, w, want, B, N, K)
        assert torch.equal(out, want)
        tol = SPEC.numerics[_variant(name).dtype]
        ref = lmm.reference(x.double(), w.double(), torch.float64)
        f = torch.isfinite(ref)
        assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
        torch.testing.assert_close(out[f].double(), ref[f], rtol=tol.rtol, atol=tol.atol)
    _assert_capture_replays(fast, x, w)


@gpu
@pytest.mark.parametrize("name", MMA + list(MMA_FORMS))
def test_gpu_cuda_mma_sizes_splits_and_determinism(poison, name):
    """The tensor-core kernel (no Triton fallback allowed: every shape here is one it takes)
    against float64 at B = 1..max_b (n-tiles full and part-full, row tiles side by side), N off
    the 16-node m-tile, K off the 16-k chunk (a guarded tail), K slices shorter than a loop
    step, forced K splits; -inf holes, an all -inf row, a zero weight row; bit-identical run
    to run."""
    mod = _gpu_mod(name)
    dev = torch.device("cuda")
    tol = SPEC.numerics["float32"]
    for B, N, K in ((1, 1000, 4100), (5, 77, 332), (8, 16, 4), (13, 33, 4096), (16, 1000, 4100), (16, 300, 20),
                    (9, 4096, 1024), (17, 300, 4100), (33, 77, 1028), (mod.max_b, 1000, 332)):
        x, w = numerics.make_inputs(B, N, K, torch.float32, dev, seed=B + N + K)
        x = x * 3
        assert mod.takes(x, w), (B, N, K)
        want = lmm.reference(x.double(), w.double(), torch.float64)
        f = torch.isfinite(want)
        for splits in (None, 1, 3, 100):
            out = launch.forward(mod, x, w, splits=splits)
            assert torch.equal(torch.isneginf(out), torch.isneginf(want)), (B, N, K, splits)
            torch.testing.assert_close(out[f].double(), want[f], rtol=tol.rtol, atol=tol.atol)
        assert torch.equal(launch.forward(mod, x, w), launch.forward(mod, x, w))  # no atomics


@gpu
@pytest.mark.parametrize("name", CUDA + list(MMA_FORMS))
def test_gpu_cuda_nan_propagates_as_in_pytorch(poison, name):
    """Each CUDA form (FMA, tensor-core; one launch, the K-split combine) gives NaN outputs
    where PyTorch's expression does, never -inf, and the op's gradients (the library's CUDA
    backward where it takes the call) NaN where autograd's are."""
    mod = _gpu_mod(name)
    dtype = getattr(torch, _variant(name).dtype)
    dev = torch.device("cuda", torch.cuda.current_device())
    for B in (3, min(12, mod.max_b)):
        x, w = nan_case(B, K=64, device=dev)
        x = x.to(dtype)
        assert mod.takes(x, w), B
        outs = [launch.forward(mod, x, w, splits=s) for s in (1, 3)]
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        with lmm.using(mod):
            out = lmm.logmatmul(xl, wl)
            out.backward(torch.ones_like(out))
        for o in outs:
            assert torch.equal(torch.isnan(o), torch.isnan(out)) and torch.equal(torch.isneginf(o), torch.isneginf(out))
        assert_nan_as_pytorch(out, xl.grad, wl.grad, x, w)


@gpu
@pytest.mark.parametrize("name", CUDA + list(MMA_FORMS))
def test_gpu_plus_inf_in_x_gives_nan_gradients(name):
    """A row with +inf in x through each CUDA form and its backward (the library's where it
    takes the call: dx written directly with one chunk of N, summed over chunks with many):
    dx NaN at every entry but the -inf ones (0), never a plausible 0 (the row's m is +inf, so
    e' is 0 at every finite x); the other rows' dx the float64 values."""
    mod = _gpu_mod(name)
    dtype = getattr(torch, _variant(name).dtype)
    dev = torch.device("cuda", torch.cuda.current_device())
    for N in (5, 2048):
        gen = torch.Generator(device=dev).manual_seed(N)
        x = torch.randn(3, 256, device=dev, generator=gen)
        w = torch.rand(N, 256, device=dev, generator=gen)
        x[1, 7], x[1, 3] = float("inf"), float("-inf")
        x = x.to(dtype)
        g = torch.randn(3, N, device=dev, generator=gen)
        xl = x.clone().requires_grad_()
        with lmm.using(mod):
            lmm.logmatmul(xl, w).backward(g)
        dx = xl.grad
        assert torch.isnan(dx[1, torch.arange(256, device=dev) != 3]).all() and dx[1, 3] == 0, (name, N)
        xd = x[::2].double().requires_grad_()
        torch.logsumexp(xd[:, None, :] + w.double().log()[None], -1).backward(g[::2].double())
        torch.testing.assert_close(dx[::2].double(), xd.grad, rtol=2e-2 if dtype != torch.float32 else 1e-4,
                                   atol=1e-4)


@gpu
@pytest.mark.parametrize("name", ["dispatch"] + CUDA + list(MMA_FORMS))
def test_gpu_negative_weights_give_the_formula_or_nan(poison, name):
    """Negative weights on every CUDA form (FMA, tensor-core) and dispatch's choice: the
    formula's value where the sum is positive, NaN where it is negative, -inf where it is 0,
    and the gradients as test_logmatmul's CPU check says (the library's CUDA backward where
    it takes the call). Tensor-core forms: their stated tolerance."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if name == "dispatch":
        mod, dtype = None, torch.float32
    else:
        mod, dtype = _gpu_mod(name), getattr(torch, _variant(name).dtype)

    def run(x, w, g):
        assert mod is None or mod.takes(x, w)
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        with lmm.using(mod) if mod is not None else contextlib.nullcontext():  # None: dispatch's choice
            out = lmm.logmatmul(xl, wl)
            out.backward(g)
        if mod is not None:
            for s in (1, 3):
                o = launch.forward(mod, x, w, splits=s)
                assert torch.equal(torch.isnan(o), torch.isnan(out)) and torch.equal(torch.isneginf(o), torch.isneginf(out))
        return out.detach(), xl.grad, wl.grad

    mma = name != "dispatch" and _variant(name).params.get("mma")
    # dx in x's dtype: numerics.GRAD_TOL's bound for 16-bit x; the tensor-core forms' products
    # of rounded operands (float32 x only): 2e-3 of the largest gradient
    tol = numerics.GRAD_TOL[str(dtype).removeprefix("torch.")] if dtype != torch.float32 else 2e-3 if mma else 2e-5
    assert_negative_weights_as_formula(run, dtype, dev, grad_tol=tol)


# --------------------------------------------------------------------------- block-sparse on CUDA


def _bsl_inputs(R, C, bs, B, x_dtype, w_dtype, seed):
    """A block-CSR pattern of R x C blocks with a random count per block row (row 0 full, row
    1 empty, the rest from none to all), block 1 all zero; x = 3 N(0, 1) with -inf entries
    (every 7th) and its row 2 all -inf. On the GPU, int32 row_ptr and int64 col_idx."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(R, C, generator=g) < torch.rand(R, 1, generator=g)
    keep[0] = True
    keep[1] = False
    _, cols = keep.nonzero(as_tuple=True)
    row_ptr = torch.zeros(R + 1, dtype=torch.int32)
    row_ptr[1:] = torch.cumsum(keep.sum(1), 0)
    blocks = torch.rand(cols.shape[0], bs, bs, generator=g, dtype=torch.float64)
    blocks[1] = 0
    x = torch.randn(B, C * bs, generator=g, dtype=torch.float64) * 3
    x.view(-1)[::7] = float("-inf")
    if B > 2:
        x[2] = float("-inf")
    dev = torch.device("cuda")
    return x.to(x_dtype).to(dev), blocks.to(w_dtype).to(dev), row_ptr.to(dev), cols.to(dev)


def _spy_bsl(monkeypatch, mod) -> list:
    """Count the library's block-sparse launches (CudaForward.bsl calls kgen_bsl_launch)."""
    assert mod._bsl is not None, "the library has no kgen_bsl_launch"
    raw, ptr = mod._bsl
    calls = []

    def spy(*args):
        calls.append(args[-2])  # the splits it launched with
        return raw(*args)

    monkeypatch.setattr(mod, "_bsl", (spy, ptr))
    return calls


@gpu
@pytest.mark.parametrize("name", CUDA)
def test_gpu_cuda_block_sparse(poison, monkeypatch, name):
    """The library's block-sparse forward (kgen_bsl_launch; no Triton fallback: the spy counts
    its launches) at block sizes 32..256 and B = 1..16, blocks float32 and (16-bit variants)
    in x's dtype: against float64 on the dense equivalent (the dense tolerance: out up to
    ~40, 1e-5 relative + 3e-5), -inf exactly where the reference has it (the empty block row,
    x's all -inf row), no NaN; forced K splits 1, 2, 5 and the default plan agree within it;
    the dense CUDA op on dense_from_blocks too; a rerun bit-identical. B = 17 runs the Triton
    kernel (no launch) to the same result."""
    mod = _gpu_mod(name)
    calls = _spy_bsl(monkeypatch, mod)
    tol = SPEC.numerics[str(mod.dtype).removeprefix("torch.")]
    w_dtypes = (torch.float32,) if mod.mma or mod.dtype is torch.float32 else (torch.float32, mod.dtype)
    for bs, R, C in ((32, 9, 24), (64, 6, 16), (128, 5, 10), (256, 3, 5)):
        for w_dtype in w_dtypes:
            for B in (1, 3, 4, 8, 11, 16, 17):
                x, blocks, row_ptr, col_idx = _bsl_inputs(R, C, bs, B, mod.dtype, w_dtype, seed=bs + B)
                w = lmm.dense_from_blocks(blocks, row_ptr, col_idx, bs, C * bs)
                want = lmm.reference(x.double(), w.double(), torch.float64)
                f = torch.isfinite(want)
                case = (bs, w_dtype, B)
                n = len(calls)
                outs = [launch.bsl_forward(mod, x, blocks, row_ptr, col_idx, bs, splits=s) for s in (None, 1, 2, 5)]
                assert len(calls) == (n if B > 16 else n + 4), case
                if B <= 16:
                    assert calls[-3:] == [1, 2, 5], case
                    outs.append(launch.forward(mod, x, w))  # the dense op (CUDA, or its Triton companion)
                for out in outs:
                    assert not torch.isnan(out).any(), case
                    assert torch.equal(torch.isneginf(out), torch.isneginf(want)), case
                    torch.testing.assert_close(out[f].double(), want[f], rtol=tol.rtol, atol=tol.atol)
                again = launch.bsl_forward(mod, x, blocks, row_ptr, col_idx, bs)
                assert torch.equal(again, outs[0]), case  # no atomics


@gpu
@pytest.mark.parametrize("name", [n for n in CUDA if "_n8_" in n and n.endswith("f32")])  # one per arch
def test_gpu_cuda_block_sparse_op_int64_indices_and_fallbacks(poison, monkeypatch, name):
    """Through the op: int32 and int64 index arrays alike; a K-split plan at a shape with few
    node groups; an unaligned x goes to the Triton kernel (no launch) to the same result."""
    mod = _gpu_mod(name)
    calls = _spy_bsl(monkeypatch, mod)
    bs, R, C, B = 64, 2, 256, 3  # 16 node groups; block row 0 full (virtual K 16384): a K split
    x, blocks, row_ptr, col_idx = _bsl_inputs(R, C, bs, B, torch.float32, torch.float32, seed=1)
    want = lmm.reference(x.double(), lmm.dense_from_blocks(blocks, row_ptr, col_idx, bs, C * bs).double(),
                         torch.float64)
    f = torch.isfinite(want)
    with lmm.using(mod):
        a = lmm.block_sparse_logmatmul(x, blocks, row_ptr.long(), col_idx.long(), bs)
        b = lmm.block_sparse_logmatmul(x, blocks, row_ptr, col_idx.int(), bs)
        assert len(calls) == 2 and calls[0] > 1, calls
        shifted = torch.empty(B * C * bs + 1, device="cuda")[1:].view(B, C * bs).copy_(x)
        c = lmm.block_sparse_logmatmul(shifted, blocks, row_ptr, col_idx, bs)
        assert len(calls) == 2
    for out in (a, b, c):
        assert torch.equal(torch.isneginf(out), torch.isneginf(want))
        torch.testing.assert_close(out[f].double(), want[f], rtol=1e-5, atol=3e-5)
    assert torch.equal(a, b)


def _nothing_tuned(monkeypatch):
    """No tuning table entry, own or nearby, and empty op memos: the op's choices are the
    untuned rule's (rules._by_batch). Returns the op module."""
    from kgen.families.logmatmul import op as lop
    from kgen.runtime import tuning_table

    monkeypatch.setattr(tuning_table, "lookup", lambda k: None)
    monkeypatch.setattr(tuning_table, "nearest", lambda k: None)
    monkeypatch.setattr(lop, "_MODULES", {})
    monkeypatch.setattr(lop, "_BY_SHAPE", {})
    monkeypatch.setattr(lop, "_FAST", {})
    return lop


@gpu
def test_gpu_untuned_small_shapes_run_the_small_batch_form(poison, monkeypatch):
    """With nothing tuned (nor nearby): B > 16 with small weights and few outputs runs the
    small-batch Triton form (not a 16-row tl.dot tile), more outputs the 16-row tile
    (rules.SMALL_OUTPUTS), odd K from 512 up to rules.ODD_K_OUTPUTS the small-batch form; B <= 16
    where the CUDA kernel cannot take K (rows not whole 16-byte vectors) runs its Triton
    companion through the fast path. Each
    within tolerance of float64, forward and gradients, and bitwise equal to a second call."""
    lop = _nothing_tuned(monkeypatch)
    dev = torch.device("cuda")
    for B, N, K, small in ((31, 23, 545, True), (160, 152, 868, True), (250, 130, 64, True), (370, 188, 22, False),
                          (130, 300, 545, True), (130, 300, 546, False), (60, 2000, 1001, False),
                          (130, 1200, 60, False)):
        mod = lop._module(dev, torch.float32, B, N, K)
        assert (getattr(mod, "DOT", None) == "none") == small, (B, N, K, getattr(mod, "VARIANT", mod))
        _assert_ok(numerics.check_case(mod, B, N, K, torch.float32, torch.float32, dev, SPEC.numerics["float32"]))
    for B, N, K in ((6, 39, 33), (1, 239, 25)):
        mod = lop._module(dev, torch.float32, B, N, K)
        if type(mod) is launch.CudaForward:
            assert not mod.takes(torch.empty(B, K, device=dev), torch.empty(N, K, device=dev))
            assert mod.direct(B, N, K, torch.float32, torch.float32, dev) is not None
        x, w = lmm.make_inputs(B, N, K, torch.float32, dev)
        a, b = lmm.logmatmul(x, w), lmm.logmatmul(x, w)  # the second through the fast path
        assert torch.equal(a, b)
        _assert_ok(numerics.check_case(mod, B, N, K, torch.float32, torch.float32, dev,
                                       SPEC.numerics["float32"]))


@gpu
def test_gpu_untuned_batches_17_to_64_run_the_cuda_forms(poison, monkeypatch):
    """With nothing tuned (nor nearby), 17-64 rows run the CUDA forms (rules._by_batch): an FMA
    form over few outputs and little work, float32's tensor-core form over many outputs, the
    Triton tiles beyond FMA_WORK for 16-bit x and wherever K is not whole 16-byte vectors;
    5-16 rows over many outputs the tensor-core form or the 16-row tl.dot tile.
    Each within tolerance of float64 (x in its dtype, w float32 and x's dtype), and the public
    op (its fast path, second call) bitwise equal to the first call."""
    lop = _nothing_tuned(monkeypatch)
    dev = torch.device("cuda")
    for dtype, B, N, K, form in ((torch.float32, 17, 513, 516, "fma"), (torch.float32, 64, 700, 700, "fma"),
                                 (torch.float32, 53, 2391, 32, "mma"), (torch.float32, 24, 1501, 2000, "mma"),
                                 (torch.float32, 33, 513, 510, "triton"), (torch.bfloat16, 41, 241, 2568, "fma"),
                                 (torch.bfloat16, 40, 3616, 240, "triton"), (torch.float16, 29, 1001, 1000, "fma"),
                                 (torch.float32, 11, 10077, 16, "mma"), (torch.float32, 5, 5423, 856, "fma"),
                                 (torch.bfloat16, 9, 13781, 16, "triton")):
        mod = lop._module(dev, dtype, B, N, K)
        if form == "triton":
            assert type(mod) is not launch.CudaForward, (B, N, K)
        else:
            assert type(mod) is launch.CudaForward and bool(mod.mma) == (form == "mma"), (B, N, K)
        for w_dtype in {torch.float32, dtype}:
            _assert_ok(numerics.check_case(mod, B, N, K, dtype, w_dtype, dev, SPEC.numerics[str(dtype)[6:]]))
            x, w = numerics.make_inputs(B, N, K, dtype, dev, w_dtype)
            a, b = lmm.logmatmul(x, w), lmm.logmatmul(x, w)
            assert torch.equal(a, b)
