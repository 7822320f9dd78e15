"""linear_logp on a GPU: every shipped variant through golden numerics, the issue's sizes
against float64 with poisoned outputs, CUDA graph replay and torch.compile."""

import contextlib
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kgen import ops, spec
from kgen.families import linear_logp as llp
from kgen.families.linear_logp import cuda_variant, launch, plans
from kgen.runtime import dispatch
from tf32_rounding import tf32_rounded

ROOT = Path(__file__).resolve().parent.parent
SPEC = spec.load(ROOT / "kgen" / "specs" / "linear_logp.yaml")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", [v.name for v in SPEC.variants])
def test_every_variant_golden(name):
    v = SPEC.variant(name)
    if v.backend == "cuda" and not dispatch.arch_runs_on(v.arch, torch.cuda.get_device_capability()):
        pytest.skip(f"{v.arch} code does not run on this {torch.cuda.get_device_name()}")
    results = llp.golden(dispatch.load(v), torch.device("cuda"), v.dtype, SPEC.numerics[v.dtype])
    bad = [(c, e) for c, e in results if not e <= 1.0]
    assert not bad, bad


def _inputs(N, V, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    w = (torch.randn(V, D, device="cuda", generator=g) * (2.0 / math.sqrt(D))).to(dtype)
    b = (torch.randn(V, device="cuda", generator=g) * 0.5).to(dtype)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    if N > 1:
        t[::5] = -100
    return h, w, b, t


def _path(monkeypatch, path, dtype):
    """The op's implementation for a test: dispatch's choice (the CUDA forward where its arch
    runs), or the first Triton variant with its logit tiles through TMA descriptors or
    through pointer loads."""
    if path.startswith("dispatch") or path == "keep_logits":
        return contextlib.nullcontext()
    monkeypatch.setattr(plans, "TMA", path == "triton-tma")
    mod = dispatch.select("linear_logp", torch.device("cuda"), str(dtype).removeprefix("torch."), backend="triton")
    return llp.using(mod.module)


# "dispatch, no bias": on sm_90a the backward's dz through the CUDA kernel (launch.CudaForward.dz)
# at every size (by default only where a call is host-bound)
# "keep_logits": dispatch with the logits kept for the backward (kept.forward_kept / backward_kept)
@pytest.mark.parametrize("path", ["dispatch", "dispatch, no bias", "triton-tma", "triton-pointers", "keep_logits"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# The backward's float32 sums (plans.accumulator_plan, bf16/fp16): (4099, 151936, 4096) and
# (4099, 50257, 2048) half in grad_hidden's buffer, half in grad_weight's tail; (5001, 32000,
# 1024) half in grad_hidden's buffer, half in a separate one; (12001, 8000, 1024) row blocks.
@pytest.mark.parametrize("N,V,D", [(1, 50257, 2048), (4099, 151936, 4096), (4099, 50257, 2048),
                                   (1, 151936, 4096), (5001, 32000, 1024), (12001, 8000, 1024)])
def test_issue_sizes_against_float64(monkeypatch, path, dtype, N, V, D):
    """The issue's sizes: bias, ignored rows, temperature 0.8, entropy, random upstream
    gradients; every buffer the op allocates starts as NaN."""
    def poisoned(shape, dt, device):
        return torch.full(shape, float("nan") if dt.is_floating_point else 1 << 30, dtype=dt, device=device)

    monkeypatch.setattr(launch, "_empty", poisoned)
    monkeypatch.setattr(llp.op, "KEEP_LOGITS_MIN_FLOP", 0)  # keep_logits: at every size
    h, w, b, t = _inputs(N, V, D, dtype, seed=N + V + D)
    if path == "dispatch, no bias":
        b = None
        monkeypatch.setattr(cuda_variant, "CUDA_DZ", "always")  # at every size (on sm_90a)
    g_logp, g_ent = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
    leaves = [x.clone().requires_grad_() if x is not None else None for x in (h, w, b)]
    with _path(monkeypatch, path, dtype):
        if path.startswith("triton"):
            assert llp._tma(h, w) == (path == "triton-tma")
        logp, ent = ops.linear_logp(*leaves[:2], t, leaves[2], temperature=0.8, return_entropy=True,
                                    keep_logits=path == "keep_logits")
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    got = [logp, ent] + [x.grad for x in leaves if x is not None]
    del logp, ent
    ref = [x.clone().requires_grad_() if x is not None else None for x in (h, w, b)]
    r_logp, r_ent = llp.reference(*ref[:2], t, ref[2], temperature=0.8, compute=torch.float64)
    ((r_logp * g_logp).sum() + (r_ent * g_ent).sum()).backward()
    want = [r_logp.detach(), r_ent.detach()] + [x.grad for x in ref if x is not None]
    tol = SPEC.numerics[str(dtype).removeprefix("torch.")]
    for name, a, e in zip(("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"), got, want):
        assert torch.isfinite(a).all(), f"{name}: unwritten (NaN) elements"
        e = e.double()
        if name.startswith("grad"):
            bound = llp.GRAD_TOL[str(dtype).removeprefix("torch.")] * max(1.0, float(e.abs().max()))
            assert float((a.double() - e).abs().max()) <= bound, name
        else:
            # float32 accumulation over D = 4096 terms of |h w| ~ 2/sqrt(D): ~1e-5 of the
            # logits' scale; the spec's tolerance holds it.
            torch.testing.assert_close(a.double(), e, rtol=tol.rtol * 5, atol=tol.atol * 5, msg=name)
    del got, want, ref
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dispatch_serves_every_row_count_with_a_variant_that_takes_it(dtype):
    # the gemv kernel takes N <= block_m: a bucket (or a nearby one) whose winner it is must
    # not serve more rows through it (dispatch takes the entry's runner-up instead)
    dev = torch.device("cuda")
    for D, V in ((2048, 151936), (4096, 128256), (1024, 32000), (3000, 50257), (700, 5000)):
        for N in (1, 5, 9, 16, 17, 24, 32, 33, 48, 64, 100):
            llp._MODULES.clear()
            impl = llp._module(dev, dtype, (N, D, V))
            if isinstance(impl, launch.CudaForward):
                assert not impl.gemv or N <= impl.block_m, (N, D, V, impl.name)
    llp._MODULES.clear()


def test_split_v_invariance_on_gpu():
    h, w, b, t = _inputs(517, 50257, 1024, torch.bfloat16, seed=7)
    outs = []
    for name in ("triton_n128_v256_d64_w8_s3_sv4_bf16", "triton_n128_v256_d64_w8_s3_sv1_bf16",
                 "triton_n64_v128_d64_w4_s4_sv16_bf16"):
        with llp.using(dispatch.load(SPEC.variant(name)).module):
            outs.append(ops.linear_logp(h, w, t, b, return_entropy=True))
    for logp, ent in outs[1:]:
        torch.testing.assert_close(logp, outs[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, outs[0][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["dispatch", "triton-tma"])
@pytest.mark.parametrize("bad", [-1, 50257, 1 << 40])
def test_target_out_of_range_raises(monkeypatch, path, bad):
    """In checked mode a bad target raises ValueError naming it; by default its row is NaN;
    an out-of-range ignore_index is fine; the next call (corrected) matches float64."""
    h, w, b, t = _inputs(300, 50257, 1024, torch.bfloat16, seed=11)
    with _path(monkeypatch, path, torch.bfloat16):
        ops.linear_logp(h, w, t, b)  # build and load first
        t_bad = t.clone()
        t_bad[123] = bad
        with pytest.raises(ValueError, match=f"target holds {bad}, outside"):
            ops.linear_logp(h, w, t_bad, b, check_targets=True)
        logp = ops.linear_logp(h, w, t_bad, b)  # default: no host check, that row NaN
        assert torch.isnan(logp[123]) and not torch.isnan(logp[:123]).any() and not torch.isnan(logp[124:]).any()
        ignored = torch.where(t_bad == -100, torch.full_like(t_bad, bad), t_bad)
        ops.linear_logp(h, w, ignored, b, ignore_index=bad)  # ignored rows may hold any value
        t_bad[123] = 7
        logp = ops.linear_logp(h, w, t_bad, b)
        torch.cuda.synchronize()
    want, _ = llp.reference(h, w, t_bad, b, compute=torch.float64)
    # float32 accumulation over D = 1024 terms: within the spec's tolerance (2e-5).
    torch.testing.assert_close(logp.double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("path", ["dispatch", "triton-tma"])
def test_no_host_wait_by_default(monkeypatch, path):
    """The call returns while the GPU is still busy with work queued before it: the op's
    default path waits on the host for nothing (forward and backward). The first call of
    each kernel builds and loads it (loading a module may wait for the device), so one
    forward + backward runs first, as the first step of a training loop would."""
    h, w, b, t = _inputs(300, 50257, 1024, torch.bfloat16, seed=5)
    with _path(monkeypatch, path, torch.bfloat16):
        hg = h.clone().requires_grad_()
        ops.linear_logp(hg, w, t, b).sum().backward()  # build and load forward and backward
        torch.cuda.synchronize()
        done = torch.cuda.Event()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead of the op
        done.record()
        logp = ops.linear_logp(hg, w, t, b)
        logp.sum().backward()
        assert not done.query(), "the op waited for the GPU"
        torch.cuda.synchronize()


@pytest.mark.parametrize("path", ["dispatch", "triton-tma"])
def test_cuda_graph_replay(monkeypatch, path):
    check_graph_replay(_path(monkeypatch, path, torch.bfloat16), torch.bfloat16)


def check_graph_replay(context, dtype, N: int = 129):
    """Capture the op once (inside `context`), replay it on new inputs, compare with float64."""
    h, w, b, t = _inputs(N, 50257, 512, dtype, seed=3)
    with context:
        ops.linear_logp(h, w, t, b)  # build, load, tensor maps: outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = ops.linear_logp(h, w, t, b)
    for seed in (11, 12):
        h.copy_(torch.randn(h.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, _ = llp.reference(h, w, t, b, compute=torch.float64)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_float32_triton_dh_against_cublas_and_float64(monkeypatch, tf32):
    """float32 with TF32 off where backward_plan takes the Triton dH kernel (DH_TRITON on; its
    grid fills the GPU; the workspace budget small enough for many chunks, the first ones
    wider than it: dH in pieces): gradients against float64 and against the cuBLAS dH, and
    bit for bit run to run (its atomic epilogue has one adder per element a launch). Bounds:
    "tf32x3" products and float32 sums over V = 20011 columns keep ~1e-6 of the largest
    gradient; 1e-5."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the Triton dH kernel reads its tiles by TMA (sm_90+)")
    tf32(False)
    _float32_backward_forms(monkeypatch, "DH_TRITON", 11, lambda plan: bool(plan.dh_cols), 1e-5, 1e-5,
                            skip="the dH grid (136 programs) is below this GPU's SM count")


def test_float32_tf32_dw_from_transposed_hidden(monkeypatch, tf32):
    """float32 with TF32 on over several chunks: grad_weight's GEMMs read hidden's transposed
    copy in grad_weight's last rows (backward_launch.HT_COPY): gradients against float64
    and against the backward without the copy, bit for bit run to run. Bounds: TF32 rounds
    the GEMMs' operands to 11 bits (2^-11 relative a product, partly cancelling over N =
    2100 and V = 20011 terms: ~5e-4 of the largest gradient measured); 3e-3 against float64,
    2e-3 between the two forms."""
    tf32(True)
    _float32_backward_forms(monkeypatch, "HT_COPY", 12, lambda plan: plan.ht_from < 20011, 3e-3, 2e-3)


def test_gpu_float32_tf32_operands_rounded_to_nearest(monkeypatch, tf32):
    """float32 with TF32 on: the logit tiles TMA loads reach the tensor cores rounded to the
    nearest TF32 value (ties to even; on Triton 3.6 through runtime.tf32_descriptors'
    backport), as cuBLAS rounds its operands (the tensor cores would truncate: logits biased
    by -7e-4 relative, logp errors 3x eager's on an H200). logp and entropy against float64
    from the rounded operands: float32 sums over D = 1000 and V = 20011 and ex2.approx keep
    ~1e-5; bound 5e-5, where the float64 values from the operands as they are differ by
    ~1e-3. The backward's dz kernel recomputes the logits the same way: with g_logp = 1 and
    no entropy gradient, grad_bias sums over V to sum_rows (1 - sum_v p) / T, 0 up to float32
    rounding (~1e-6 a row) when the recomputed logits match the forward's lse, ~1e-3 a row
    when they do not; bound 1e-4 a row."""
    from kgen.runtime import tf32_descriptors

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA loads (sm_90+); pointer loads leave float32 tiles to the tensor cores' truncation")
    tf32(True)
    N, V, D = 300, 20011, 1000
    h, w, b, t = _inputs(N, V, D, torch.float32, seed=31)
    assert tf32_descriptors.rounding_descriptor(h, [64, 32]) is not None
    monkeypatch.setattr(llp.op, "KEEP_LOGITS_MIN_FLOP", float("inf"))
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    with _path(monkeypatch, "triton-tma", torch.float32):
        assert plans._tile_sources(llp.op._module(h.device, h.dtype), h, w)[2]
        logp, ent = ops.linear_logp(*leaves[:2], t, leaves[2], temperature=0.9, return_entropy=True)
        logp.sum().backward()
    rh, rw = (tf32_rounded(x, "even") for x in (h, w))
    want = llp.reference(rh, rw, t, b, temperature=0.9, compute=torch.float64)
    plain = llp.reference(h, w, t, b, temperature=0.9, compute=torch.float64)
    for name, a, r, p in zip(("logp", "entropy"), (logp, ent), want, plain):
        err, off = (a.detach().double() - r).abs().max().item(), (p - r).abs().max().item()
        assert err <= 5e-5 and off > 20 * err, (name, err, off)
    rows = int((t != -100).sum())
    total = leaves[2].grad.double().sum().item()
    print(f"grad_bias sum {total:.3e} over {rows} rows")
    assert abs(total) <= 1e-4 * rows


def _float32_backward_forms(monkeypatch, switch: str, seed: int, takes, to_float64: float, between: float,
                            skip: str = ""):
    """A float32 training step at 2100 x 1024 x 20011 over several chunks (an 8 MiB
    workspace) with backward_launch.<switch> on, off and on again (TF32 as the caller set
    it; `takes(plan)`: whether the plan runs the switched form; `skip`: skip where it does
    not, else assert): gradients within to_float64 (of the largest) of float64, within
    `between` of the other form, and bit for bit run to run."""
    from kgen.families.linear_logp import backward_launch

    h, w, b, t = _inputs(2100, 20011, 1024, torch.float32, seed=seed)
    monkeypatch.setattr(backward_launch, "WORKSPACE_BYTES", 8 << 20)
    runs = {}
    for on in (True, False, True):
        monkeypatch.setattr(backward_launch, switch, on)
        plan = backward_launch.backward_plan(llp.op._module(h.device, h.dtype), h, w, b)
        if on and skip and not takes(plan):
            pytest.skip(skip)
        assert takes(plan) == on and len(plan.chunks) > 1
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        logp, ent = ops.linear_logp(*leaves[:2], t, leaves[2], temperature=0.9, return_entropy=True)
        (logp.sum() - 0.3 * ent.sum()).backward()
        runs.setdefault(on, []).append([x.grad for x in leaves])
    ref = [x.double().requires_grad_() for x in (h, w, b)]
    lp, en = llp.reference(ref[0], ref[1], t, ref[2], temperature=0.9, compute=torch.float64)
    (lp.sum() - 0.3 * en.sum()).backward()
    first, again = runs[True]
    for name, a, a2, c, r in zip(("hidden", "weight", "bias"), first, again, runs[False][0], ref):
        assert torch.equal(a, a2), name
        scale = r.grad.abs().max().item()
        assert (a.double() - r.grad).abs().max().item() <= to_float64 * scale, name
        assert (a - c).abs().max().item() <= between * scale, name


@pytest.mark.parametrize("N", [300, 8])
def test_float32_backward_in_a_fresh_autograd_thread(N):
    """A fresh process's first float32 backward (TF32 off) on an sm_90+ GPU: at N = 300 its
    first CUDA work in autograd's worker thread is the Triton dz kernel with TMA descriptor
    arguments, which Triton's launcher encodes before it makes a context current; that
    thread starts with none (streams.bind_context), and the call failed with "invalid
    device context". At N = 8 (launch.logits_path) it is the cuBLAS logits GEMM, for which
    torch warned that it had to set the primary context. Gradients against float64: the
    "tf32x3" recompute and float32 GEMMs keep ~1e-6 of the largest gradient (bound 1e-5)."""
    code = textwrap.dedent(f"""
        import torch
        from kgen import ops
        torch.backends.cuda.matmul.allow_tf32 = False
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn({N}, 256, device="cuda", generator=g).requires_grad_()
        w = (torch.randn(5003, 256, device="cuda", generator=g) / 16).requires_grad_()
        t = torch.randint(0, 5003, ({N},), device="cuda", generator=g)
        ops.linear_logp(h, w, t).sum().backward()
        hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        torch.log_softmax(hd @ wd.T, -1).gather(1, t[:, None]).sum().backward()
        for a, b in ((h.grad, hd.grad), (w.grad, wd.grad)):
            err = ((a.double() - b).abs().max() / b.abs().max()).item()
            assert err < 1e-5, err
        print("gradients ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "gradients ok" in r.stdout, r.stderr[-4000:]
    assert "no current CUDA context" not in r.stderr, r.stderr[-4000:]


def test_torch_compile_fullgraph_forward_and_backward():
    h, w, b, t = _inputs(257, 50257, 512, torch.bfloat16, seed=5)

    def f(h, w, b, t):
        logp, ent = ops.linear_logp(h, w, t, b, temperature=1.3, return_entropy=True)
        return (logp + 0.01 * ent).sum()

    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    eager = [x.clone().requires_grad_() for x in (h, w, b)]
    torch.compile(f, fullgraph=True)(*leaves, t).backward()
    f(*eager, t).backward()
    for a, e in zip(leaves, eager):
        torch.testing.assert_close(a.grad, e.grad, rtol=0, atol=0)  # the same kernels, same order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_logits_compile_graph_and_no_host_wait(monkeypatch, dtype):
    """keep_logits: within GRAD_TOL of the default (recomputing) path; under
    torch.compile(fullgraph=True) and in a captured CUDA graph of forward + backward bit for
    bit what eager gives (the same kernels in the same order); no host wait."""
    N = 1031
    monkeypatch.setattr(llp.op, "KEEP_LOGITS_MIN_FLOP", 0)  # (1.1e11 logit FLOPs: kept all the same)
    kept = []
    real = llp.kept.forward_kept
    monkeypatch.setattr(llp.op, "forward_kept", lambda *a: kept.append(1) or real(*a))
    h, w, b, t = _inputs(N, 50257, 1024, dtype, seed=7)
    g_logp = torch.randn(N, device="cuda")

    def step(h, w, b, keep=True):
        logp, ent = ops.linear_logp(h, w, t, b, temperature=0.9, return_entropy=True, keep_logits=keep)
        return (logp * g_logp).sum() + 0.1 * ent.sum()

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        fn(*leaves).backward()
        return [x.grad for x in leaves]

    default = grads(lambda *a: step(*a, keep=False))
    assert not kept
    eager = grads(step)
    assert kept, "the logits were not kept"
    for name, a, e in zip(("grad_hidden", "grad_weight", "grad_bias"), eager, default):
        bound = llp.GRAD_TOL[str(dtype).removeprefix("torch.")] * max(1.0, float(e.abs().max()))
        assert float((a.double() - e.double()).abs().max()) <= bound, name
    for a, e in zip(grads(torch.compile(step, fullgraph=True)), eager):
        torch.testing.assert_close(a, e, rtol=0, atol=0)

    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*leaves).backward()
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*leaves).backward()
    for x in leaves:
        x.grad.fill_(float("nan"))
    graph.replay()
    for a, e in zip((x.grad for x in leaves), eager):
        torch.testing.assert_close(a, e, rtol=0, atol=0)

    torch.cuda.synchronize()
    done = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead of the op
    done.record()
    step(*[x.detach().requires_grad_() for x in (h, w, b)]).backward()
    assert not done.query(), "keep_logits waited for the GPU"
    torch.cuda.synchronize()


def _masked_case(N, V, D, dtype, seed):
    """Inputs whose bias masks columns: a -inf tail (whole splits and tiles), and every 7th
    column at the dtype's lowest finite value (scaled, -inf); targets on live columns."""
    h, w, b, t = _inputs(N, V, D, dtype, seed)
    b[V // 2:] = -math.inf
    b[::7] = torch.finfo(dtype).min
    live = torch.isfinite(b.float() * 1.4426950408889634).nonzero().squeeze(1)
    t = torch.where(t == -100, t, live[torch.arange(N, device="cuda") % len(live)])
    return h, w, b, t


CUDA_NAMES = [v.name for v in SPEC.variants if v.backend == "cuda" and v.dtype == "bfloat16"]


@pytest.mark.parametrize("name", CUDA_NAMES + ["dispatch"])
def test_bias_masked_columns_on_every_kernel(monkeypatch, name):
    """A vocabulary masked through the bias: each CUDA forward (and dispatch's forward +
    backward) gives float64 log_softmax's logp and the masked-aware entropy; the masked
    columns get 0 gradient. Tolerance: the spec's bf16 numerics (logits' float32 sums), the
    family's GRAD_TOL for gradients."""
    if name != "dispatch":
        v = SPEC.variant(name)
        if not dispatch.arch_runs_on(v.arch, torch.cuda.get_device_capability()):
            pytest.skip(f"{v.arch} code does not run here")
        ctx = llp.using(dispatch.load(v).module)
        N = 8 if "gemv" in name else 700
    else:
        ctx, N = contextlib.nullcontext(), 700
    h, w, b, t = _masked_case(N, 5000, 1024, torch.bfloat16, seed=3)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    g_logp, g_ent = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
    with ctx:
        logp, ent = ops.linear_logp(*leaves[:2], t, leaves[2], temperature=0.8, return_entropy=True)
        if name == "dispatch":
            ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    ref = [x.clone().requires_grad_() for x in (h, w, b)]
    r_logp, r_ent = llp.reference(*ref[:2], t, ref[2], temperature=0.8, compute=torch.float64)
    tol = SPEC.numerics["bfloat16"]
    for what, a, e in (("logp", logp, r_logp), ("entropy", ent, r_ent)):
        assert torch.isfinite(a).all(), what
        torch.testing.assert_close(a.double(), e.detach(), rtol=tol.rtol * 5, atol=tol.atol * 5, msg=what)
    if name == "dispatch":
        ((r_logp * g_logp).sum() + (r_ent * g_ent).sum()).backward()
        for what, a, e in zip(("grad_hidden", "grad_weight", "grad_bias"), leaves, ref):
            assert torch.isfinite(a.grad).all(), what
            bound = llp.GRAD_TOL["bfloat16"] * max(1.0, float(e.grad.abs().max()))
            assert float((a.grad.double() - e.grad.double()).abs().max()) <= bound, what
        masked = ~torch.isfinite(b.float() * 1.4426950408889634)
        assert (leaves[1].grad[masked] == 0).all() and (leaves[2].grad[masked] == 0).all()


@pytest.mark.parametrize("cuda_dz", ["always", "never"])
@pytest.mark.parametrize("bias", [True, False])
def test_an_ignored_row_of_nan_hidden_gets_no_gradient(monkeypatch, bias, cuda_dz):
    """An ignored row whose hidden state is NaN (a padded position) contributes nothing to
    grad_hidden or grad_bias through the CUDA dz epilogue and the Triton dz kernel: its dz is
    0, not p * 0 = NaN. The same call with that row zeroed gives bitwise the same gradients."""
    monkeypatch.setattr(cuda_variant, "CUDA_DZ", cuda_dz)
    h, w, b, t = _inputs(300, 50257, 1024, torch.bfloat16, seed=14)
    t[40] = -100
    clean = h.clone()
    clean[40] = 0
    h[40, 7] = float("nan")
    grads = []
    for hid in (h, clean):
        leaves = [x.clone().requires_grad_() for x in (hid, w, b)]
        logp, ent = ops.linear_logp(leaves[0], leaves[1], t, leaves[2] if bias else None, return_entropy=True)
        (logp.sum() + ent.sum()).backward()
        assert logp[40] == 0 and ent[40] == 0
        grads.append([leaves[0].grad] + ([leaves[2].grad] if bias else []))
    assert (grads[0][0][40] == 0).all()
    for a, e in zip(*grads):
        assert torch.isfinite(a).all() and torch.equal(a, e)


@pytest.mark.parametrize("bias", [True, False])
def test_out_of_range_target_gives_nan_gradients(monkeypatch, bias):
    """Dispatch's kernels (no bias: the CUDA dz epilogue at every size on sm_90a): a bad
    target's row has NaN logp and NaN gradients, not a silently dropped term."""
    monkeypatch.setattr(cuda_variant, "CUDA_DZ", "always")
    h, w, b, t = _inputs(300, 50257, 1024, torch.bfloat16, seed=13)
    t[17] = 50257
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    logp = ops.linear_logp(leaves[0], leaves[1], t, leaves[2] if bias else None)
    logp.nansum().backward()
    assert torch.isnan(logp[17]) and torch.isnan(leaves[0].grad[17]).all()
    assert torch.isnan(leaves[1].grad).any()
