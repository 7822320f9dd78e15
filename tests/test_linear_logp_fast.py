"""linear_logp's eager fast path (kgen.families.linear_logp.fast, op._fast): taken from the
second call of a signature, the general path's outputs and gradients bit for bit, and
stepping aside where it must. CPU tests run the Triton kernels under the interpreter (the
op's kernel choice replaced by a small-tile variant) and a stand-in CUDA forward whose
launcher writes the interpreter's outputs through the addresses it is given; the GPU test
runs dispatch's choice, in a CUDA graph too."""

import ctypes
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kgen import ops, spec
from kgen.families import linear_logp as llp
from kgen.families.linear_logp import cuda_variant, fast, launch, op
from kgen.runtime import dispatch

ROOT = Path(__file__).resolve().parent.parent
# Lanes of rows past N (masked, never stored) compute log2(0) and inf - inf in numpy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
_MODULES: dict = {}


def small_variant(dtype: str):
    """A small-tile Triton variant (interpreted on the CPU), loaded once per dtype."""
    if dtype not in _MODULES:
        text = ("family: linear_logp\nvariants:\n  - {backend: triton, block_n: 16, block_v: 32, block_d: 16, "
                "num_warps: 4, num_stages: 2, split_v: 2}\n")
        v = next(v for v in spec.parse(text, "tests/linear_logp_fast.yaml").variants if v.dtype == dtype)
        _MODULES[dtype] = dispatch.load(v).module
    return _MODULES[dtype]


@pytest.fixture
def choose(monkeypatch):
    """choose(impl): the op's kernel choice for CPU tensors is `impl` (forward and backward),
    with an empty fast-path table and counter."""
    monkeypatch.setattr(op, "_FAST", {})
    monkeypatch.setattr(op, "STATS", {"fast": 0})
    monkeypatch.setattr(op, "FAST", True)
    real = op._module

    def set_impl(impl):
        monkeypatch.setattr(op, "_module", lambda device, dtype, shape=None:
                            impl if device.type == "cpu" else real(device, dtype, shape))
    return set_impl


def inputs(N, D, V, dtype, bias=True, lead=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * (2.0 / math.sqrt(D))).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    if N > 1:
        t[1::3] = -100
    if lead is not None:
        h, t = h.reshape(*lead, D), t.reshape(lead)
    return h, w, t, b


def step(h, w, t, b, *, entropy=True, temperature=0.7, use=("logp", "entropy"), seed=1, **kw):
    """Forward + backward with random upstream gradients for the outputs in `use`:
    (logp, entropy or None, grad_hidden, grad_weight, grad_bias or None)."""
    leaves = [x.clone().requires_grad_() if x is not None else None for x in (h, w, b)]
    out = ops.linear_logp(leaves[0], leaves[1], t, leaves[2], temperature=temperature, return_entropy=entropy, **kw)
    logp, ent = out if entropy else (out, None)
    g = torch.Generator().manual_seed(seed)
    loss = 0
    if "logp" in use:
        loss = (logp * torch.randn(logp.shape, generator=g)).sum()
    if "entropy" in use and ent is not None:
        loss = loss + (ent * torch.randn(ent.shape, generator=g)).sum()
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), *(x.grad if x is not None else None for x in leaves)


def assert_bitwise(got, want):
    for name, a, e in zip(("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"), got, want):
        assert (a is None) == (e is None), name
        if a is not None:
            assert a.dtype == e.dtype and a.shape == e.shape, name
            assert torch.equal(a.isnan(), e.isnan()) and torch.equal(a.nan_to_num(), e.nan_to_num()), name


def general_then_fast(monkeypatch, fn):
    """fn() on the general path (fast path off), then twice with it on: the first call
    served by the general path (which remembers the signature), the second by the fast one."""
    monkeypatch.setattr(op, "FAST", False)
    want = fn()
    monkeypatch.setattr(op, "FAST", True)
    first = fn()
    assert op.STATS["fast"] == 0 and len(op._FAST) == 1
    second = fn()
    assert op.STATS["fast"] >= 1, "the second call of a signature takes the fast path"
    return want, first, second


# (N, D, V, bias, entropy, temperature, use, leading dims, int32 target)
CASES = [
    (3, 40, 77, True, True, 0.7, ("logp", "entropy"), None, False),
    (3, 40, 77, False, True, 1.0, ("entropy",), None, False),  # only the entropy has a gradient
    (7, 40, 77, True, True, 1.3, ("logp",), None, True),  # the entropy returned, unused
    (1, 24, 50, False, False, 1.0, ("logp",), None, False),
    (6, 40, 33, True, False, 0.5, ("logp",), (2, 3), False),  # leading dims
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_fast_path_is_the_general_path_bitwise(monkeypatch, choose, dtype, case):
    N, D, V, bias, entropy, temperature, use, lead, int32 = case
    choose(small_variant(dtype))
    h, w, t, b = inputs(N, D, V, getattr(torch, dtype), bias, lead)
    if int32:
        t = t.int()
    want, first, second = general_then_fast(
        monkeypatch, lambda: step(h, w, t, b, entropy=entropy, temperature=temperature, use=use))
    assert_bitwise(first, want)
    assert_bitwise(second, want)
    assert second[0].shape == (lead or (N,)) and second[2].shape == h.shape
    # no gradient needed: the fast path's forward alone
    with torch.no_grad():
        before = op.STATS["fast"]
        out = ops.linear_logp(h, w, t, b, temperature=temperature, return_entropy=entropy)
        assert op.STATS["fast"] == before + 1
    for a, e in zip(out if entropy else (out,), want[:2]):
        assert torch.equal(a.nan_to_num(), e.nan_to_num())


def test_fast_path_new_scalars_and_signatures(monkeypatch, choose):
    """Temperature and ignore_index are per call (one entry serves them all); a new shape,
    dtype, bias pattern or entropy flag is a new signature (the general path first)."""
    choose(small_variant("float32"))
    h, w, t, b = inputs(5, 16, 40, torch.float32)
    with torch.no_grad():
        ops.linear_logp(h, w, t, b)
        for T, ii in ((0.5, -100), (2, -100), (1.0, int(t[0]))):
            monkeypatch.setattr(op, "FAST", False)
            want = ops.linear_logp(h, w, t, b, temperature=T, ignore_index=ii)
            monkeypatch.setattr(op, "FAST", True)
            before = op.STATS["fast"]
            got = ops.linear_logp(h, w, t, b, temperature=T, ignore_index=ii)
            assert op.STATS["fast"] == before + 1
            assert_bitwise((got,), (want,))  # (ignore_index t[0]: the -100 rows are out of range, NaN)
        before = op.STATS["fast"]
        ops.linear_logp(h[:4], w, t[:4], b)
        ops.linear_logp(h, w, t, None)
        ops.linear_logp(h, w, t, b, return_entropy=True)
        assert op.STATS["fast"] == before and len(op._FAST) == 4
        # what the checks refuse still raises (the general path serves it)
        for kw, err in ((dict(temperature=0.0), ValueError), (dict(temperature=True), TypeError),
                        (dict(temperature=float("nan")), ValueError), (dict(ignore_index=1.5), TypeError)):
            with pytest.raises(err):
                ops.linear_logp(h, w, t, b, **kw)
        with pytest.raises(TypeError):
            ops.linear_logp(h, w, t.float(), b)
        assert op.STATS["fast"] == before


def test_fast_path_steps_aside(monkeypatch, choose):
    """Not taken in `using` blocks, under autocast, for tensor subclasses, non-contiguous
    inputs, with the switch off, under torch.compile tracing (the compiled graph calls the
    registered op), and in checked mode."""
    mod = small_variant("float32")
    choose(mod)
    h, w, t, b = inputs(4, 16, 24, torch.float32)
    ops.linear_logp(h, w, t, b)  # remembered
    ops.linear_logp(h, w, t, b)
    assert op.STATS["fast"] == 1
    with llp.using(mod):
        ops.linear_logp(h, w, t, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ops.linear_logp(h, w, t, b)

    class Sub(torch.Tensor):
        pass
    ops.linear_logp(h.as_subclass(Sub), w, t, b)
    wide = torch.empty(4, 32)
    wide[:, :16] = h
    ops.linear_logp(wide[:, :16], w, t, b)
    monkeypatch.setattr(op, "FAST", False)
    ops.linear_logp(h, w, t, b)
    monkeypatch.setattr(op, "FAST", True)
    assert op.STATS["fast"] == 1

    def f(h, w, t, b):
        return ops.linear_logp(h, w, t, b, temperature=0.9).sum()
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(h, w, t, b)
    assert op.STATS["fast"] == 1
    assert torch.equal(got, f(h, w, t, b)) and op.STATS["fast"] == 2  # eager again: the fast path


def test_fast_path_switch_reads_the_environment():
    code = "import kgen.families.linear_logp.op as op; print(op.FAST)"
    env = dict(os.environ, KGEN_LINEAR_LOGP_FAST="0", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("grad", [False, True])
def test_out_of_range_targets_on_the_fast_path(monkeypatch, choose, grad):
    """Out-of-range targets give NaN rows on the fast path as on the general one (no host
    check); checked mode (argument or KGEN_CHECK_TARGETS=1) steps aside and raises."""
    choose(small_variant("float32"))
    h, w, t, b = inputs(4, 16, 10, torch.float32)
    t = torch.tensor([0, 3, 2, 1])
    hr = h.clone().requires_grad_(grad)
    ops.linear_logp(hr, w, t, b, return_entropy=True)
    bad = torch.tensor([0, 10, 3, -5])
    before = op.STATS["fast"]
    logp, ent = ops.linear_logp(hr, w, bad, b, return_entropy=True)
    assert op.STATS["fast"] == before + 1
    assert torch.isnan(logp[[1, 3]]).all() and torch.isnan(ent[[1, 3]]).all()
    assert not torch.isnan(logp[[0, 2]]).any()
    with pytest.raises(ValueError, match="target holds 10, outside"):
        ops.linear_logp(hr, w, bad, b, return_entropy=True, check_targets=True)
    monkeypatch.setenv("KGEN_CHECK_TARGETS", "1")
    with pytest.raises(ValueError, match="target holds 10, outside"):
        ops.linear_logp(hr, w, bad, b, return_entropy=True)
    assert op.STATS["fast"] == before + 1
    ops.linear_logp(hr, w, bad, b, return_entropy=True, check_targets=False)  # the argument wins
    assert op.STATS["fast"] == before + 2


# --------------------------------------------------------------------------- the CUDA forward's buffers


def _at(address: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The n elements of `dtype` at a CPU address, as a tensor over that memory."""
    return torch.frombuffer((ctypes.c_byte * (n * dtype.itemsize)).from_address(address), dtype=dtype, count=n)


class StandInCuda:
    """A CUDA variant's launcher on the CPU: kgen_launch's contract (partials, then the
    combine into logp, entropy, lse2, ez2) computed by the Triton companion under the
    interpreter from the memory at the addresses it is given, then its partials region
    filled with NaN (a buffer overlapping it shows). Records each call's arguments."""

    def __init__(self, triton_mod):
        self.triton, self.calls = triton_mod, []

    def raw(self, ptr, index, h, w, b, t, part, N, V, D, splits, group, with_entropy, stream, logp, ent, lse2, ez2,
            ignore_index, exact, scale):
        assert exact == 0  # (float32's gemv only: 16-bit kernels ignore it)
        self.calls.append((N, V, D, splits, group, with_entropy, ignore_index, scale))
        dt = self.dtype
        hidden, weight = _at(h, N * D, dt).view(N, D), _at(w, V * D, dt).view(V, D)
        bias = _at(b, V, dt) if b else None
        outs = launch.forward(self.triton, hidden, weight, _at(t, N, torch.int64), bias, llp.LOG2E / scale,
                              ignore_index, bool(with_entropy))
        for address, value in zip((logp, ent, lse2, ez2), outs):
            if address:
                _at(address, N, torch.float32).copy_(value)
        _at(part, 4 * splits * N, torch.float32).fill_(float("nan"))
        return 0


def stand_in_cuda(monkeypatch, dtype):
    from types import SimpleNamespace

    fake = StandInCuda(small_variant(dtype))
    fake.dtype = getattr(torch, dtype)
    kernel = SimpleNamespace(params={"block_m": 64, "block_n": 32, "split_v": 3, "cluster": 1}, name="stand-in",
                             lib=None, variant=SimpleNamespace(arch="sm_90a", dtype=dtype), raw=fake.raw, ptr=1,
                             fail=None)
    impl = llp.CudaForward(kernel, fake.triton)
    impl._resident[None] = 4  # CPU tensors: device index None, "4 SMs"
    monkeypatch.setattr(cuda_variant, "current_raw_stream", lambda index: 0)
    return impl, fake


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("entropy,bias", [(True, True), (False, False)])
def test_fast_cuda_forward_buffers(monkeypatch, choose, shared, entropy, bias):
    """The fast path's CUDA forward (fast.ForwardLaunch: lse2, ez2 and the partials in one
    buffer, or the partials apart) launches what the general path does, with the same
    arguments but the addresses, and gives the same outputs and gradients bit for bit;
    every buffer starts as NaN (launch._empty poisoned)."""
    impl, fake = stand_in_cuda(monkeypatch, "bfloat16")
    choose(impl)
    monkeypatch.setattr(fast, "SHARED_PARTIALS_BYTES", 1 << 20 if shared else 0)
    monkeypatch.setattr(launch, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))
    h, w, t, b = inputs(9, 24, 70, torch.bfloat16, bias)
    want, first, second = general_then_fast(monkeypatch, lambda: step(h, w, t, b, entropy=entropy))
    assert_bitwise(first, want)
    assert_bitwise(second, want)
    assert len(set(fake.calls)) == 1 and len(fake.calls) == 3  # the same launch three times
    (entry,) = op._FAST.values()
    assert entry.launch.go is not None and entry.launch.shared == shared
    with torch.no_grad():
        out = ops.linear_logp(h, w, t, b, temperature=0.7, return_entropy=entropy)
    assert op.STATS["fast"] == 2 and len(set(fake.calls)) == 1
    for a, e in zip(out if entropy else (out,), want[:2]):
        assert torch.equal(a.nan_to_num(), e.nan_to_num())


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_fast_path_bitwise_no_wait_and_graph(bias):
    """dispatch's choice on the GPU (bf16, a small call): the fast path from the second call
    on, its outputs and gradients equal to the general path's bit for bit, no host wait, and
    a forward + backward captured in a CUDA graph replaying to the eager results."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    N, D, V = 8, 512, 1024
    h = torch.randn(N, D, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, D, device=dev, generator=g) * D ** -0.5).to(torch.bfloat16)
    b = (torch.randn(V, device=dev, generator=g) * 0.5).to(torch.bfloat16) if bias else None
    t = torch.randint(0, V, (N,), device=dev, generator=g)
    t[3] = -100
    g_logp, g_ent = torch.randn(N, device=dev, generator=g), torch.randn(N, device=dev, generator=g)
    leaves = [x.clone().requires_grad_() if x is not None else None for x in (h, w, b)]

    def run():
        for x in leaves:
            if x is not None:
                x.grad = None
        logp, ent = ops.linear_logp(leaves[0], leaves[1], t, leaves[2], temperature=0.9, return_entropy=True)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        return [logp.detach(), ent.detach()] + [x.grad for x in leaves if x is not None]

    saved = op.FAST
    try:
        op.FAST = False
        want = run()
        op.FAST = True
        op._FAST.clear()
        run()
        before = op.STATS["fast"]
        got = run()
        assert op.STATS["fast"] == before + 1
        for a, e in zip(got, want):
            assert torch.equal(a, e)
        # no host wait: the call returns while work queued before it still runs
        torch.cuda.synchronize()
        done = torch.cuda.Event()
        torch.cuda._sleep(1_000_000_000)
        done.record()
        run()
        assert not done.query(), "the fast path waited for the GPU"
        torch.cuda.synchronize()
        # a training step captured in a CUDA graph (warmed up on a side stream)
        hs = leaves[0]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                logp, ent = ops.linear_logp(hs, leaves[1], t, leaves[2], temperature=0.9, return_entropy=True)
                torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), [x for x in leaves if x is not None])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        before = op.STATS["fast"]
        with torch.cuda.graph(graph):
            logp, ent = ops.linear_logp(hs, leaves[1], t, leaves[2], temperature=0.9, return_entropy=True)
            grads = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(),
                                        [x for x in leaves if x is not None])
        assert op.STATS["fast"] == before + 1  # captured through the fast path
        for seed in (5, 6):
            with torch.no_grad():
                hs.copy_(torch.randn(N, D, device=dev, generator=torch.Generator(device=dev).manual_seed(seed)))
            graph.replay()
            torch.cuda.synchronize()
            eager = run()
            for a, e in zip([logp, ent, *grads], eager):
                assert torch.equal(a, e)
    finally:
        op.FAST = saved


@pytest.mark.gpu
@pytest.mark.parametrize("N,entropy,bias", [(20, True, True), (29, False, False), (100, True, False)])
def test_gpu_fast_path_float32_few_rows(monkeypatch, tf32, N, entropy, bias):
    """float32 with TF32 off at a few rows the gemv variants do not take (N > 16; launch.logits_path:
    the cuBLAS logits, then two Triton launches forward and one backward, which the fast path
    replays, kept.FewRows): each call's outputs and gradients equal the general path's bit for
    bit, every buffer poisoned first, across temperatures and ignore_index values (1 is one
    Triton specialises on: a replay per value) and under CUDA graph capture; the replay served
    the later calls. (N = 100: past F32_LOGITS_MAX_ROWS, within F32_LOGITS_MAX_ELEMS at this V.)"""
    from kgen.runtime import triton_launch

    tf32(False)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(N)
    D, V = 264, 3001
    h = torch.randn(N, D, device=dev, generator=g)
    w = torch.randn(V, D, device=dev, generator=g) * D ** -0.5
    b = torch.randn(V, device=dev, generator=g) * 0.5 if bias else None
    t = torch.randint(0, V, (N,), device=dev, generator=g)
    t[::3] = 1  # ignored where ignore_index is 1
    g_logp, g_ent = torch.randn(N, device=dev, generator=g), torch.randn(N, device=dev, generator=g)
    leaves = [x.clone().requires_grad_() if x is not None else None for x in (h, w, b)]
    monkeypatch.setattr(launch, "_empty", lambda shape, dtype, device: torch.full(
        shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device))

    def run(temperature, ignore_index):
        for x in leaves:
            if x is not None:
                x.grad = None
        out = ops.linear_logp(leaves[0], leaves[1], t, leaves[2], temperature=temperature,
                              ignore_index=ignore_index, return_entropy=entropy)
        logp, ent = out if entropy else (out, None)
        loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0)
        loss.backward()
        return [x.detach() for x in (logp, ent) if x is not None] + [x.grad for x in leaves if x is not None]

    calls = [(0.9, -100), (1.3, -100), (0.7, 1), (1.0, -100), (0.7, 1)]
    monkeypatch.setattr(op, "FAST", False)
    want = [run(*c) for c in calls]
    monkeypatch.setattr(op, "FAST", True)
    op._FAST.clear()
    run(*calls[0])
    (entry,) = op._FAST.values()
    few = entry.launch.few
    assert launch.logits_path(h, w) and few is not None and not few.replays
    before, driver = op.STATS["fast"], triton_launch.STATS["driver"]
    for c, e in zip(calls, want):
        for a, b_ in zip(run(*c), e):
            assert torch.equal(a, b_), c
    assert op.STATS["fast"] == before + len(calls) and set(few.replays) == {-100, 1}
    assert None not in few.replays.values() and len(few.dz_replays) == 2 and None not in few.dz_replays.values()
    # the forward's two launches and the backward's one, all but the first call of each ignore_index
    assert triton_launch.STATS["driver"] >= driver + 3 * (len(calls) - 2)
    # captured in a CUDA graph (warmed up on a side stream), replayed against eager calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run(0.8, -100)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear_logp(leaves[0], leaves[1], t, leaves[2], temperature=0.8, return_entropy=entropy)
    with torch.no_grad():
        leaves[0].copy_(torch.randn(N, D, device=dev, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager = ops.linear_logp(leaves[0], leaves[1], t, leaves[2], temperature=0.8, return_entropy=entropy)
    for a, e in zip(out if entropy else (out,), eager if entropy else (eager,)):
        assert torch.equal(a, e)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 7, 16])
def test_gpu_fast_path_float32_gemv(monkeypatch, tf32, N):
    """float32 at N <= 16 where dispatch takes the float32 gemv variant (spec order at an
    untuned bucket): the fast path binds its launcher once (ForwardLaunch.go, not the few-rows
    path) and reads the precision per call: with TF32 off and on, forward outputs and
    gradients equal the general path's bit for bit (every buffer poisoned first), and the
    two settings give different logp (TF32 rounding visible, ~1e-3); under CUDA graph
    capture the replay equals an eager call."""
    tf32(False)
    dev = torch.device("cuda", torch.cuda.current_device())  # (_module keys on the index)
    g = torch.Generator(device=dev).manual_seed(N)
    D, V = 264, 3001
    h = torch.randn(N, D, device=dev, generator=g)
    w = torch.randn(V, D, device=dev, generator=g) * D ** -0.5
    b = torch.randn(V, device=dev, generator=g) * 0.5
    t = torch.randint(0, V, (N,), device=dev, generator=g)
    g_logp, g_ent = torch.randn(N, device=dev, generator=g), torch.randn(N, device=dev, generator=g)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    monkeypatch.setattr(launch, "_empty", lambda shape, dtype, device: torch.full(
        shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device))
    mod = op._module(dev, torch.float32, (N, D, V))
    if not (isinstance(mod, cuda_variant.CudaForward) and mod.gemv):
        pytest.skip(f"dispatch takes {getattr(mod, 'name', mod)} here, not a float32 gemv variant")

    def run(temperature):
        for x in leaves:
            x.grad = None
        logp, ent = ops.linear_logp(*leaves[:2], t, leaves[2], temperature=temperature, return_entropy=True)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        return [logp.detach(), ent.detach()] + [x.grad for x in leaves]

    got = {}
    for on in (False, True, False):
        tf32(on)
        monkeypatch.setattr(op, "FAST", False)
        want = [run(c) for c in (0.9, 1.3)]
        monkeypatch.setattr(op, "FAST", True)
        run(0.9)  # (the general path; the entry after it)
        entry = next(e for e in op._FAST.values() if e.dims == (N, D, V) and e.mod is op._module(dev, torch.float32,
                                                                                                (N, D, V)))
        assert entry.launch.go is not None and entry.launch.few is None
        before = op.STATS["fast"]
        for c, e in zip((0.9, 1.3), want):
            for a, b_ in zip(run(c), e):
                assert torch.equal(a, b_), (on, c)
        assert op.STATS["fast"] == before + 2
        got.setdefault(on, want[0][0])
    assert (got[True] - got[False]).abs().max().item() > 1e-5
    # captured in a CUDA graph (warmed up on a side stream), replayed against an eager call
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            ops.linear_logp(h, w, t, b, temperature=0.8)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = ops.linear_logp(h, w, t, b, temperature=0.8)
    h.copy_(torch.randn(N, D, device=dev, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        assert torch.equal(out, ops.linear_logp(h, w, t, b, temperature=0.8))
