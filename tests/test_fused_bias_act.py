"""fused_bias_act: the op, its checks, autograd, torch.library integration, and every
variant against a float64 reference (Triton under the interpreter here; all on a GPU)."""

from pathlib import Path

import pytest
import torch

from kgen import ops, spec
from kgen.families import fused_bias_act as fba
from kgen.runtime import dispatch

ROOT = Path(__file__).resolve().parent.parent
SPEC = spec.load(ROOT / "kgen" / "specs" / "fused_bias_act.yaml")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _assert_close(out, ref, tol, what=""):
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element was not written?)"
    err = (out.double() - ref.double()).abs() - (tol.atol + tol.rtol * ref.double().abs())
    assert err.max() <= 0, f"{what}: worst excess {err.max().item():.3g}"


# --------------------------------------------------------------------------- the op on CPU


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("act", fba.ACTIVATIONS)
def test_cpu_op_matches_float64(dtype, act):
    t = DTYPES[dtype]
    x, b, y = torch.randn(7, 33).to(t), torch.randn(33).to(t), torch.randn(7, 33).to(t)
    ref = fba.reference(x, b, y, 0.5, act, compute=torch.float64)
    _assert_close(ops.fused_bias_act(x, b, y, alpha=0.5, act=act), ref, SPEC.numerics[dtype], act)
    xi = x.clone()
    assert ops.fused_bias_act(xi, b, y, alpha=0.5, act=act, inplace=True) is xi
    _assert_close(xi, ref, SPEC.numerics[dtype], f"{act} in place")


def test_in_place_kernel_write_bumps_the_version(monkeypatch):
    """A kernel writing x in place (behind autograd's back) bumps x's version as torch's
    in-place ops do: a graph that saved x refuses to backward instead of using the new
    values. Run here with the kernel path forced and its launch a version-blind write."""
    op = fba.op
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(op._KERNELS, "lookup", lambda key: "kernel")
    monkeypatch.setattr(op, "launch", lambda kernel, x, bias, y, alpha, act, out:
                        out.data.copy_(fba.reference(x, bias, y, alpha, act)))
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(3, 4)
    z = x * w  # saves x for w's gradient
    v = x._version
    assert ops.fused_bias_act(x, torch.ones(4), act="relu", inplace=True) is x
    assert x._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    with torch.inference_mode():
        t = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="inference tensor"):
        ops.fused_bias_act(t, torch.ones(4), inplace=True)
    with torch.inference_mode():
        ops.fused_bias_act(t, torch.ones(4), inplace=True)


def test_leading_dims_and_no_y():
    x, b = torch.randn(2, 3, 5), torch.randn(5)
    out = ops.fused_bias_act(x, b, act="relu")
    assert out.shape == (2, 3, 5)
    torch.testing.assert_close(out, torch.relu(x + b))


def test_alpha_may_be_any_real_number_type():
    import numpy as np

    x, b, y = torch.randn(3, 4), torch.randn(4), torch.randn(3, 4)
    for alpha in (2, 2.0, np.float32(2.0), np.float64(2.0)):
        torch.testing.assert_close(ops.fused_bias_act(x, b, y, alpha=alpha), x + 2 * y + b)


def test_non_contiguous_input_out_of_place():
    x = torch.randn(9, 4).t()  # 4 x 9, not contiguous
    b = torch.randn(9)
    torch.testing.assert_close(ops.fused_bias_act(x, b, act="silu"),
                               torch.nn.functional.silu(x + b))


@pytest.mark.parametrize("case,exc,match", [
    ("int dtype", TypeError, "supported: float32"),
    ("bias dtype", TypeError, "bias dtype"),
    ("y dtype", TypeError, "y dtype"),
    ("bias length", ValueError, r"expected \(33,\)"),
    ("y shape", ValueError, "must match"),
    ("bias device", ValueError, "bias is on meta"),
    ("y device", ValueError, "y is on meta"),
    ("act", ValueError, "unknown act 'tanh'"),
    ("act list", ValueError, r"unknown act \['relu'\]"),
    ("act list inplace", ValueError, r"unknown act \['relu'\]"),
    ("alpha requires grad", TypeError, "alpha is a constant"),
    ("alpha", TypeError, "alpha must be a float"),
    ("scalar x", ValueError, "at least one dimension"),
    ("inplace non-contiguous", ValueError, "contiguous"),
    ("inplace overlap", ValueError, "overlap"),
    ("inplace grad", ValueError, "not differentiable"),
    ("not a tensor", TypeError, "must be tensors"),
])
def test_bad_inputs_raise_before_launch(case, exc, match):
    x, b, y = torch.randn(7, 33), torch.randn(33), torch.randn(7, 33)
    kw = {}
    if case == "int dtype":
        x, b = x.int(), b.int()
    elif case == "bias dtype":
        b = b.double()
    elif case == "y dtype":
        y = y.half()
    elif case == "bias length":
        b = torch.randn(32)
    elif case == "y shape":
        y = torch.randn(33, 7)
    elif case == "bias device":
        b = b.to("meta")
    elif case == "y device":
        y = y.to("meta")
    elif case == "act":
        kw["act"] = "tanh"
    elif case == "alpha":
        kw["alpha"] = "1"
    elif case.startswith("act list"):
        kw["act"], kw["inplace"] = ["relu"], case.endswith("inplace")
    elif case == "alpha requires grad":
        kw["alpha"] = torch.tensor(0.5, requires_grad=True)
    elif case == "scalar x":
        x, b = torch.tensor(1.0), torch.randn(1)
    elif case == "inplace non-contiguous":
        x, y, kw["inplace"] = torch.randn(33, 7).t(), None, True
    elif case == "inplace overlap":
        big = torch.randn(8, 33)
        x, y, kw["inplace"] = big[:7], big[1:], True
    elif case == "inplace grad":
        x, kw["inplace"] = x.requires_grad_(), True
    elif case == "not a tensor":
        x = x.tolist()
    with pytest.raises(exc, match=match):
        ops.fused_bias_act(x, b, y, **kw)


# --------------------------------------------------------------------------- autograd, library


@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (7,), (2, 3, 5)])
def test_gradients_at_edge_shapes(shape):
    """Zero columns or rows, 1-D and 3-D x: every gradient has its input's shape; bias's sums
    dz over all leading dims (1-D x: it is dz itself)."""
    x = torch.randn(shape, requires_grad=True)
    b = torch.randn(shape[-1], requires_grad=True)
    y = torch.randn(shape, requires_grad=True)
    ops.fused_bias_act(x, b, y, alpha=0.5, act="silu").sum().backward()
    x64 = x.detach().double().requires_grad_()
    torch.nn.functional.silu(x64 + 0.5 * y.detach().double() + b.detach().double()).sum().backward()
    assert x.grad.shape == x.shape and y.grad.shape == y.shape and b.grad.shape == b.shape
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)  # float32 recomputation
    torch.testing.assert_close(y.grad, 0.5 * x.grad)
    torch.testing.assert_close(b.grad, x.grad.reshape(-1, shape[-1]).sum(0) if x.numel() else torch.zeros(shape[-1]))


@pytest.mark.parametrize("act", fba.ACTIVATIONS)
def test_gradients_match_float64_autograd(act):
    torch.manual_seed(0)
    x, b, y = (torch.randn(6, 10, requires_grad=True), torch.randn(10, requires_grad=True),
               torch.randn(6, 10, requires_grad=True))
    g = torch.randn(6, 10)
    ops.fused_bias_act(x, b, y, alpha=-1.5, act=act).backward(g)
    x64, b64, y64 = (t.detach().double().requires_grad_() for t in (x, b, y))
    fba.reference(x64, b64, y64, -1.5, act, compute=torch.float64).backward(g.double())
    for got, want in ((x.grad, x64.grad), (b.grad, b64.grad), (y.grad, y64.grad)):
        # float32 recomputation of z and act'(z): a few ulp of the largest term
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_registered_op_passes_opcheck():
    x, b, y = torch.randn(5, 12), torch.randn(12), torch.randn(5, 12)
    torch.library.opcheck(torch.ops.kgen.fused_bias_act.default, (x, b, y, 0.25, "gelu"))
    torch.library.opcheck(torch.ops.kgen.fused_bias_act_.default, (x.clone(), b, y, 0.25, "relu"))


def test_fake_impl_gives_shape_without_running():
    x, b = torch.empty(4, 3, 8, device="meta"), torch.empty(8, device="meta")
    out = torch.ops.kgen.fused_bias_act(x, b, None, 1.0, "silu")
    assert out.shape == (4, 3, 8) and out.device.type == "meta"
    with pytest.raises(ValueError):
        torch.ops.kgen.fused_bias_act(x, torch.empty(7, device="meta"), None, 1.0, "silu")


def test_compile_fullgraph_has_no_graph_break():
    def f(x, b, y):
        return ops.fused_bias_act(x, b, y, alpha=2.0, act="sigmoid") * 3

    x, b, y = torch.randn(3, 16), torch.randn(16), torch.randn(3, 16)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, b, y), f(x, b, y))


# --------------------------------------------------------------------------- every variant


def _variants(backend=None):
    return [v for v in SPEC.variants if backend is None or v.backend == backend]


@pytest.mark.parametrize("name", [v.name for v in _variants("triton")])
def test_triton_variant_under_interpreter_matches_float64(name):
    """Awkward sizes, all activations, with and without y, in place; poisoned outputs."""
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU test below")
    v = SPEC.variant(name)
    results = fba.golden(dispatch.load(v), torch.device("cpu"), v.dtype, SPEC.numerics[v.dtype])
    bad = [(c, e) for c, e in results if not e <= 1.0]
    assert len(results) == len(fba.GOLDEN_SHAPES) * len(fba.ACTIVATIONS) * 3
    assert not bad, bad


@pytest.mark.parametrize("rows, cols, grid, wide, even", [
    (2, 1024, 2, False, True),
    (3, 1000, 3, False, False),
    (2**21 - 2, 1024, 2**21 - 2, False, True),  # the last program's offsets end at 2^31 - 1024
    (2**21 - 1, 1024, 2**21 - 1, True, True),  # ... at 2^31: 64-bit indices
    (3, 2**30 + 1, 3 * 2**20 + 1, True, False),
])
def test_triton_flat_launch_widens_indices_past_int32(rows, cols, grid, wide, even):
    """Order flat's Triton kernel indexes in 32 bits only while every program's offsets fit
    (WIDE otherwise) and drops its masks only where its block divides n (EVEN). Host logic
    only: a fake kernel records the launch; the tensors are broadcast views (no memory)."""
    calls = []

    class Kernel:
        def __getitem__(self, g):
            return lambda *args, **kw: calls.append((g, args, kw))

    class Mod:
        ORDER, BLOCK_COLS, ROWS, NUM_WARPS = "flat", 1024, 1, 4
        fused_bias_act_kernel = Kernel()

    class Variant:
        backend, module, name, params = "triton", Mod, "fake_flat", {}

    x = torch.empty(1).expand(rows, cols)
    fba.launch(Variant, x, torch.empty(1).expand(cols), None, 1.0, "relu", x)
    (g, args, kw), = calls
    assert g == (grid,) and args[5:] == (rows * cols, cols)
    assert kw["WIDE"] is wide and kw["EVEN"] is even and kw["HAS_Y"] is False


@pytest.mark.parametrize("name", ["triton_c1024_r1_w4_oflat_f32", next(
    v.name for v in SPEC.variants if v.backend == "triton" and v.params.get("order") != "flat")])
def test_triton_launch_is_bound_after_the_first_call(monkeypatch, name):
    """A repeated Triton launch with 16-byte-aligned pointers replays the binary Triton chose
    (FakeTriton, test_triton_launch) with the new pointers and alpha, the rest of its
    arguments and its grid as the first launch had them; an unaligned call or a new shape
    takes Triton's launch again."""
    from types import SimpleNamespace

    from test_triton_launch import FakeTriton

    from kgen.runtime import triton_launch as tlaunch

    real = dispatch.load(SPEC.variant(name))
    fake = FakeTriton(real.module.fused_bias_act_kernel.fn)
    mod = SimpleNamespace(**{k: getattr(real.module, k, None) for k in ("ORDER", "BLOCK_COLS", "ROWS", "NUM_WARPS")},
                          fused_bias_act_kernel=fake.jit)
    kernel = SimpleNamespace(backend="triton", module=mod, name=name, params={})
    monkeypatch.setattr(tlaunch, "current_device", lambda: None)
    monkeypatch.setattr(tlaunch, "current_raw_stream", lambda index: 77)
    monkeypatch.setattr(fba.launcher, "_BOUND", {})
    tlaunch.clear()
    dt = getattr(torch, SPEC.variant(name).dtype)
    x, y, b = torch.randn(5, 1000, dtype=dt), torch.randn(5, 1000, dtype=dt), torch.randn(1000, dtype=dt)
    out = torch.empty_like(x)
    fba.launch(kernel, x, b, y, 0.5, "gelu", out)
    first = fake.launches[-1]
    assert first[0] == "plain" and len(fba.launcher._BOUND) == 1
    x2, y2, out2 = x.clone(), y.clone(), torch.empty_like(x)
    fba.launch(kernel, x2, b, y2, 0.25, "gelu", out2)
    kind, binary, grid, stream, _, args = fake.launches[-1]
    assert kind == "direct" and binary is first[1] and stream == 77
    assert grid == (*first[2], 1, 1)[:3]
    assert list(args[:5]) == [x2.data_ptr(), y2.data_ptr(), b.data_ptr(), out2.data_ptr(), 0.25]
    assert tuple(args[5:]) == tuple(first[5][5:])
    unaligned = torch.randn(5 * 1000 + 1, dtype=dt)[1:].view(5, 1000)
    fba.launch(kernel, unaligned, b, y2, 0.5, "gelu", out2)
    # Triton's own launch (a new specialisation: x not 16-byte aligned), and nothing bound
    assert fake.launches[-1][0] == "plain" and fake.launches[-1][5][0] is unaligned and len(fba.launcher._BOUND) == 1
    x4 = x[:4]
    fba.launch(kernel, x4, b, y[:4], 0.5, "gelu", out[:4])  # another shape: triton_launch's launch, then bound
    assert fake.launches[-1][5][0] is x4 and len(fba.launcher._BOUND) == 2


def test_bound_launch_passes_what_launch_passes(monkeypatch):
    """launcher.bound (the eager fast path's launcher) hands a CUDA variant's entry point the
    arguments `launch` does, into a new output like x."""
    from types import SimpleNamespace

    calls = []
    kernel = SimpleNamespace(backend="cuda", ptr=99, name="fake", params={"threads": 256, "order": "rows"},
                             raw=lambda *a: calls.append(a) or 0, fail=lambda rc: pytest.fail(f"rc {rc}"))
    monkeypatch.setattr(fba.launcher, "_raw_stream", lambda dev: 77)
    x, y, b = torch.randn(5, 40), torch.randn(5, 40), torch.randn(40)
    out = torch.empty_like(x)
    fba.launch(kernel, x, b, y, 0.25, "silu", out)
    got = fba.launcher.bound(kernel, x.get_device(), 5, 40, True, "silu")(x, b, y, 0.25)
    assert got.shape == x.shape and got.dtype == x.dtype and got.data_ptr() != out.data_ptr()
    general, fast = calls
    assert general[:7] + general[8:] == fast[:7] + fast[8:] and fast[7] == got.data_ptr()


def test_fast_path_takes_only_the_calls_it_was_kept_for(monkeypatch):
    """The public function's fast path runs a kept launcher only for a call of the same
    signature (act, y or not, the tensors' metadata): not in place, not a tensor needing a
    gradient, not another shape or layout, not under a TorchDispatchMode; alpha passes
    through."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kgen.runtime.memo import CallMemo

    monkeypatch.setattr(fba.op, "_FAST", CallMemo(16))
    x, y, b = torch.randn(5, 40), torch.randn(5, 40), torch.randn(40)
    seen = []

    def fast(x, b, y, alpha):
        seen.append(alpha)
        return torch.zeros_like(x)

    fba.op._FAST.put((("gelu", False), (x, b, y)), fast)
    assert torch.equal(ops.fused_bias_act(x.clone(), b, y.clone(), alpha=3, act="gelu"), torch.zeros_like(x))
    assert seen == [3.0]

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    others = [
        lambda: ops.fused_bias_act(x, b, y, act="relu"),  # another act
        lambda: ops.fused_bias_act(x, b, None, act="gelu"),  # no y
        lambda: ops.fused_bias_act(x[:4], b, y[:4], act="gelu"),  # another shape
        lambda: ops.fused_bias_act(x.t().contiguous().t(), b, y, act="gelu"),  # another layout
        lambda: ops.fused_bias_act(x.clone().requires_grad_(), b, y, act="gelu"),  # a gradient
        lambda: ops.fused_bias_act(x.clone(), b, y, act="gelu", inplace=True),
    ]
    for call in others:
        out = call()
        assert not torch.equal(out, torch.zeros_like(out))
    with Mode():
        ops.fused_bias_act(x, b, y, act="gelu")
    assert seen == [3.0]
    # the CPU reference path keeps nothing
    assert fba.op._FAST.size == 1
    # what the op's implementation may keep: plain, contiguous tensors needing no gradient
    keepable = fba.op._keepable
    assert keepable((x, b, y)) and keepable((x, b))
    assert not keepable((x.t(), b)) and not keepable((x.clone().requires_grad_(), b))
    assert not keepable((torch.nn.Parameter(x), b))


def test_triton_flat_index_widths_and_masks_agree():
    """The Triton flat kernel's 64-bit-index path (WIDE) and unmasked path (EVEN), which
    dispatch takes only past 2^31 elements or at whole blocks, give the 32-bit masked path's
    result bit for bit (the interpreter here, the GPU where there is one)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mod = dispatch.load(SPEC.variant("triton_c1024_r1_w4_oflat_f32")).module
    x, y, b = torch.randn(64, 96, device=dev), torch.randn(64, 96, device=dev), torch.randn(96, device=dev)
    outs = []
    for wide, even in ((False, False), (True, False), (False, True), (True, True)):
        out = torch.full_like(x, float("nan"))
        mod.fused_bias_act_kernel[(6,)](x, y, b, out, 0.5, x.numel(), 96, ACT=fba.schema.ACT_CODE["gelu"], HAS_Y=True,
                                        BLOCK_COLS=1024, WIDE=wide, EVEN=even, num_warps=4)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def _nan_passes_every_activation(name, device):
    """NaN in x (and in y) comes out NaN under every activation, as PyTorch's expression gives
    it (relu included: fmaxf / tl.maximum would make it 0); -inf and +inf as the reference."""
    v = SPEC.variant(name)
    t = getattr(torch, v.dtype)
    x = torch.randn(3, 136, dtype=t, device=device)
    x[0, 5], x[1, 0], x[2, 7], x[2, 9] = float("nan"), float("nan"), float("-inf"), float("inf")
    y = torch.randn_like(x)
    y[1, 100] = float("nan")
    bias = torch.randn(136, dtype=t, device=device)
    kernel = dispatch.load(v)
    for act in fba.ACTIVATIONS:
        for yy in (None, y):
            out = torch.full_like(x, 7.0)
            fba.launch(kernel, x, bias, yy, 0.5, act, out)
            ref = fba.reference(x, bias, yy, 0.5, act, compute=torch.float64)
            assert torch.equal(torch.isnan(out), torch.isnan(ref)), (act, yy is None)
            assert torch.isnan(out[0, 5]) and torch.isnan(out[1, 0]), act
            assert torch.equal(torch.isinf(out), torch.isinf(ref)) and torch.equal(out[torch.isinf(ref)].double(),
                                                                                   ref[torch.isinf(ref)]), act


@pytest.mark.parametrize("name", [v.name for v in _variants("triton")])
def test_triton_nan_passes_every_activation_under_interpreter(name):
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU test")
    _nan_passes_every_activation(name, torch.device("cpu"))


def _runs_here(name):
    """The variant, or a skip where its CUDA arch does not run on this GPU."""
    v = SPEC.variant(name)
    cap = torch.cuda.get_device_capability()
    if v.backend == "cuda" and not dispatch.arch_runs_on(v.arch, cap):
        pytest.skip(f"{v.arch} does not run on sm_{cap[0]}{cap[1]}")
    return v


@pytest.mark.gpu
@pytest.mark.parametrize("name", [v.name for v in _variants()])
def test_gpu_nan_passes_every_activation(name):
    _runs_here(name)
    _nan_passes_every_activation(name, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", [v.name for v in _variants()])
def test_every_variant_on_gpu_matches_float64(name):
    v = _runs_here(name)
    results = fba.golden(dispatch.load(v), torch.device("cuda"), v.dtype, SPEC.numerics[v.dtype])
    bad = [(c, e) for c, e in results if not e <= 1.0]
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_dispatch_follows_the_tuning_table_and_is_right(dtype):
    t = DTYPES[dtype]
    x = torch.randn(1000, 4104, device="cuda").to(t)
    b, y = torch.randn(4104, device="cuda").to(t), torch.randn(1000, 4104, device="cuda").to(t)
    out = ops.fused_bias_act(x, b, y, alpha=0.3, act="gelu")
    chosen = fba.op._kernel(x.device, t, 1000, 4104, True)
    expected, why = dispatch.choose("fused_bias_act", x.device, dtype, fba.tune_bucket(1000, 4104, True))
    assert getattr(chosen, "name", None) == getattr(expected, "name", None), why
    _assert_close(out, fba.reference(x, b, y, 0.3, "gelu", compute=torch.float64), SPEC.numerics[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_fast_path_is_the_general_path(monkeypatch, backend):
    """A repeated call of plain tensors takes the eager fast path (kept by the first call),
    bit for bit the general path's result, into a fresh output, on the current stream;
    calls needing a gradient are not kept and still differentiate."""
    from kgen.runtime.memo import CallMemo

    name = next(v.name for v in SPEC.variants if v.backend == backend and v.dtype == "bfloat16"
                and (v.arch is None or dispatch.arch_runs_on(v.arch, torch.cuda.get_device_capability())))
    kernel = dispatch.load(SPEC.variant(name))
    monkeypatch.setattr(fba.op, "_FAST", CallMemo(16))
    monkeypatch.setattr(fba.op, "_kernel", lambda *a: kernel)
    monkeypatch.setattr(fba.op._KERNELS, "lookup", lambda key: kernel)
    x = torch.randn(77, 1003, device="cuda").to(torch.bfloat16)
    b, y = torch.randn(1003, device="cuda").to(torch.bfloat16), torch.randn_like(x)
    first = ops.fused_bias_act(x, b, y, alpha=0.5, act="gelu")
    assert fba.op._FAST.size == 1
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        again = [ops.fused_bias_act(x, b, y, alpha=0.5, act="gelu") for _ in range(2)]
    torch.cuda.synchronize()
    assert all(torch.equal(a, first) and a.data_ptr() != first.data_ptr() for a in again)
    _assert_close(first, fba.reference(x, b, y, 0.5, "gelu", compute=torch.float64), SPEC.numerics["bfloat16"])
    xg = x.clone().requires_grad_()
    ops.fused_bias_act(xg, b, y, alpha=0.5, act="gelu").float().sum().backward()
    assert xg.grad is not None and fba.op._FAST.size == 1


@pytest.mark.gpu
def test_gpu_gradients():
    x = torch.randn(129, 1000, device="cuda", requires_grad=True)
    b = torch.randn(1000, device="cuda", requires_grad=True)
    y = torch.randn(129, 1000, device="cuda", requires_grad=True)
    g = torch.randn(129, 1000, device="cuda")
    ops.fused_bias_act(x, b, y, alpha=0.5, act="silu").backward(g)
    x64, b64, y64 = (t.detach().double().requires_grad_() for t in (x, b, y))
    fba.reference(x64, b64, y64, 0.5, "silu", compute=torch.float64).backward(g.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.grad.double(), y64.grad, rtol=1e-5, atol=1e-5)
    # bias grad sums 129 rows in float32
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    x = torch.randn(37, 1000, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    ops.fused_bias_act(x, b, act="relu")  # build and load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.fused_bias_act(x, b, act="relu")
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _assert_close(out, fba.reference(x, b, None, 1.0, "relu", compute=torch.float64),
                      SPEC.numerics["bfloat16"], "graph replay")


@pytest.mark.gpu
def test_torch_compile_fullgraph_on_gpu():
    def f(x, b, y):
        return ops.fused_bias_act(x, b, y, alpha=0.5, act="gelu").float().sum(-1)

    x = torch.randn(64, 4104, device="cuda", dtype=torch.float16)
    b, y = torch.randn(4104, device="cuda", dtype=torch.float16), torch.randn_like(x)
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(x, b, y), f(x, b, y), rtol=1e-3, atol=1e-2)


@pytest.mark.gpu
def test_gpu_in_place_bumps_the_version():
    """On the GPU the kernel writes x in place: x's version moves, so autograd refuses a
    graph that saved the old x (as after x.add_(1)) instead of using the new values."""
    w = torch.randn(300, 77, device="cuda", requires_grad=True)
    x = torch.randn(300, 77, device="cuda")
    z = x * w
    v = x._version
    ref = fba.reference(x, torch.ones(77, device="cuda"), None, 1.0, "gelu")
    assert ops.fused_bias_act(x, torch.ones(77, device="cuda"), act="gelu", inplace=True) is x
    assert x._version > v
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_in_place_takes_disjoint_views_empty_and_meta_tensors():
    """inplace=True: y and x as disjoint halves of one buffer (x.chunk / split), empty tensors
    and meta tensors are not overlaps (all were refused: one storage pointer, or a null one);
    a y that does overlap x partially still is refused."""
    from kgen import ops

    torch.manual_seed(0)
    b = torch.randn(8)
    buf = torch.randn(6, 8)
    x, y = buf[:3], buf[3:]
    want = x + y + b
    got = ops.fused_bias_act(x, b, y, act="none", inplace=True)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:3], want)
    assert ops.fused_bias_act(torch.empty(3, 0), torch.empty(0), inplace=True).shape == (3, 0)
    assert ops.fused_bias_act(torch.empty(4, 8, device="meta"), torch.empty(8, device="meta"),
                              inplace=True).shape == (4, 8)
    with pytest.raises(ValueError, match="overlap"):
        ops.fused_bias_act(buf[:3], b, buf[2:5], inplace=True)
