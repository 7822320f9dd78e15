"""fused_mlp's eager training fast path (kgen/families/fused_mlp/train.py): gradients against
the general path and float64 at awkward widths and B, where it steps aside, empty batches and
frozen layers, the launch it replays (FakeTriton); the `gpu` test runs it and captures a whole
training step in a CUDA graph."""

import pytest
import torch
from torch import nn

import kgen.ops as ops
from kgen.runtime.memo import CallMemo
from kgen.families import fused_mlp as fm
from kgen.nn import FusedMLP
from test_fused_mlp import FAST_CASES, SPEC, TOL, _as_ints, _faked, _module


# ------------------------------------------------------------------ CPU: the training fast path

TRAIN_CASES = [  # variant (None: the eager composition), widths, biases, B, activations, need_x, x's leading dims
    ("triton_367x512x256x1_m32_k64_w8_bf16", (367, 512, 256, 1), True, 129, ("relu", "sigmoid"), True, ()),
    ("triton_13x512x256x64x16_m64_k64_w8_f32", (13, 512, 256, 64, 16), True, 3, ("relu", "relu"), False, (1,)),
    ("triton_mw4096_m32_k64_w4_f32", (13, 1000, 1), [False, True], 3, ("gelu", "none"), False, ()),
    ("triton_mw4096_m32_k64_w4_bf16", (1, 37, 3), False, 1, ("silu", "silu"), True, ()),
    (None, (13, 367, 1000, 5), [True, False, True], 129, ("sigmoid", "gelu"), True, ()),
]


def _as_call(x, ws, bs, acts, need_x=True, need_w=True, need_b=True):
    """The memo call (op._call) of a training call on these tensors: detached aliases with
    the requires_grad flags the call's leaves have (the memo compares them)."""
    return fm.op._call(x.detach().requires_grad_(need_x), [w.detach().requires_grad_(need_w) for w in ws],
                       [None if b is None else b.detach().requires_grad_(need_b) for b in bs], *acts)


def _train_step(x, ws, bs, acts, g, need_x, lead=()):
    """Forward + backward through ops.fused_mlp on fresh leaves: (out, grad_fn's type name,
    [grad of x or None, of each weight, of each present bias])."""
    xl = x.clone().reshape(*lead, *x.shape).requires_grad_(need_x)
    wl = [w.clone().requires_grad_() for w in ws]
    bl = [None if b is None else b.clone().requires_grad_() for b in bs]
    out = ops.fused_mlp(xl, wl, bl, activation=acts[0], last_activation=acts[1])
    kind = type(out.grad_fn).__name__
    out.backward(g.reshape(out.shape))
    return out.reshape(x.shape[0], -1), kind, [xl.grad, *(w.grad for w in wl), *(b.grad for b in bl if b is not None)]


@pytest.mark.parametrize("name,widths,bias,B,acts,need_x,lead", TRAIN_CASES, ids=lambda c: str(c)[:40])
def test_train_fast_path_gradients(monkeypatch, name, widths, bias, B, acts, need_x, lead):
    """The training fast path (train.Step: the forward launched once with `save`, the
    backward on its zs, reference.backward_lean) gives the general path's output and
    gradients (the op: the forward, then in the backward the forward again and
    reference.backward), and both are within the float64 tolerance (or eager's own error in
    16-bit dtypes, as test_gradients_vs_float64). x not needing a gradient gets none."""
    from kgen.families.fused_mlp import train

    dtype = torch.float32 if name is None else getattr(torch, SPEC.variant(name).dtype)
    mod = None if name is None else _module(name)
    monkeypatch.setattr(fm.op, "_TRAIN", CallMemo())
    x, ws, bs = fm.make_inputs("cpu", dtype, B, widths, bias=bias)
    g = torch.randn(B, widths[-1], generator=torch.Generator().manual_seed(3)).to(dtype)

    monkeypatch.setattr(fm.op, "FAST_TRAIN", False)
    with fm.using(mod):
        out_g, kind_g, general = _train_step(x, ws, bs, acts, g, need_x, lead)
    monkeypatch.setattr(fm.op, "FAST_TRAIN", True)
    xs = x.reshape(*lead, *x.shape)
    fm.op._TRAIN.put(_as_call(xs, ws, bs, acts, need_x), train.make(mod, xs, ws, bs, *acts))
    out_f, kind_f, fast = _train_step(x, ws, bs, acts, g, need_x, lead)
    assert kind_f == "StepBackward" and kind_g != kind_f
    assert torch.equal(out_f, out_g)
    assert (fast[0] is None) == (general[0] is None) == (not need_x)

    tol = TOL[str(dtype).removeprefix("torch.")]
    leaves = [t.double().requires_grad_() for t in (x, *ws, *(b for b in bs if b is not None))]
    it = iter(leaves[1 + len(ws):])
    fm.reference(leaves[0], leaves[1:1 + len(ws)], [next(it) if b is not None else None for b in bs],
                 *acts).backward(g.double())
    eleaves = [t.clone().requires_grad_() for t in (x, *ws, *(b for b in bs if b is not None))]
    it = iter(eleaves[1 + len(ws):])
    fm.eager(eleaves[0], eleaves[1:1 + len(ws)], [next(it) if b is not None else None for b in bs],
             *acts)[0].backward(g)
    from kgen.runtime.op import error_ratio

    for i, (f, gen, r, e) in enumerate(zip(fast, general, leaves, eleaves)):
        if i == 0 and not need_x:
            continue
        ref = r.grad.reshape(f.shape)
        scale = float(ref.abs().max()) or 1.0
        # the two paths differ only in the order of the bias sums and sigmoid's derivative
        torch.testing.assert_close(f / scale, gen / scale, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
        ratio = error_ratio(f / scale, ref / scale, tol)
        assert ratio <= max(1.0, 2 * error_ratio(e.grad.reshape(f.shape) / scale, ref / scale, tol)), (i, ratio)


def test_train_fast_path_steps_aside(monkeypatch):
    """With an entry for the signature, the general path (the op) still serves: under
    `using`, torch.autocast, torch.compile tracing (and a real torch.compile(fullgraph)),
    KGEN_FUSED_MLP_FAST_TRAIN=0, another signature, no gradient needed (the inference
    path), and tensor subclasses; the entry is taken otherwise, also for nn.Parameters."""
    from kgen.families.fused_mlp import train

    monkeypatch.setattr(fm.op, "_TRAIN", CallMemo())
    widths, acts = (5, 7, 2), ("gelu", "sigmoid")
    x, ws, bs = fm.make_inputs("cpu", torch.float32, 4, widths)
    params = [nn.Parameter(w.clone()) for w in ws]
    fm.op._TRAIN.put(_as_call(x, ws, bs, acts, need_w=False, need_b=False), train.make(None, x, ws, bs, *acts))
    fm.op._TRAIN.put(fm.op._call(x, params, bs, *acts), train.make(None, x, params, bs, *acts))

    def kind(xx, w=ws, b=bs):
        out = ops.fused_mlp(xx, w, b, activation=acts[0], last_activation=acts[1])
        return type(out.grad_fn).__name__ if out.grad_fn is not None else None

    xg = x.clone().requires_grad_()
    assert kind(xg) == "StepBackward" and kind(x, params) == "StepBackward"
    with fm.using(None):
        assert kind(xg) not in ("StepBackward", None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kind(xg) not in ("StepBackward", None)
    assert kind(torch.randn(5, 5, requires_grad=True)) not in ("StepBackward", None)
    with torch.no_grad():
        assert kind(xg) is None
    monkeypatch.setattr(fm.op, "FAST_TRAIN", False)
    assert kind(xg) not in ("StepBackward", None)
    monkeypatch.setattr(fm.op, "FAST_TRAIN", True)
    monkeypatch.setattr(fm.op, "_compiling", lambda: True)
    assert kind(xg) not in ("StepBackward", None)
    monkeypatch.setattr(fm.op, "_compiling", torch.compiler.is_compiling)

    class Sub(torch.Tensor):
        pass

    assert kind(x.clone().as_subclass(Sub).requires_grad_()) != "StepBackward"
    f = torch.compile(lambda t: fm.fused_mlp(t, params, bs, activation=acts[0], last_activation=acts[1]).sum(),
                      fullgraph=True, backend="aot_eager")
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    f(xc).backward()
    with fm.using(None):
        ops.fused_mlp(xe, ws, bs, activation=acts[0], last_activation=acts[1]).sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad)
    assert kind(xg) == "StepBackward"  # and after compiling, eager again


def test_train_fast_path_empty_batch_and_frozen_layers(monkeypatch):
    """B = 0 gives zero gradients of the right shapes; parameters not requiring a gradient
    get none and the layers below the lowest one needing it are not visited."""
    from kgen.families.fused_mlp import train

    monkeypatch.setattr(fm.op, "_TRAIN", CallMemo())
    widths, acts = (6, 9, 4, 3), ("relu", "none")
    for B in (0, 5):
        x, ws, bs = fm.make_inputs("cpu", torch.float32, B, widths)
        wl = [w.clone().requires_grad_(i == 2) for i, w in enumerate(ws)]
        bl = [b.clone().requires_grad_(i >= 1) for i, b in enumerate(bs)]
        fm.op._TRAIN.put(fm.op._call(x, wl, bl, *acts), train.make(None, x, ws, bs, *acts))
        calls = []
        with monkeypatch.context() as m:
            m.setattr(torch, "mm", lambda a, b, mm=torch.mm: calls.append(1) or mm(a, b))
            out = ops.fused_mlp(x, wl, bl, activation=acts[0], last_activation=acts[1])
            assert type(out.grad_fn).__name__ == "StepBackward"
            out.sum().backward()
        assert wl[0].grad is None and wl[1].grad is None and bl[0].grad is None
        want = [t.clone().requires_grad_() for t in (*ws, *bs)]
        fm.eager(x, want[:3], want[3:], *acts)[0].sum().backward()
        torch.testing.assert_close(wl[2].grad, want[2].grad)
        torch.testing.assert_close(bl[1].grad, want[4].grad)
        torch.testing.assert_close(bl[2].grad, want[5].grad)
        # layer 2: dz.T @ h and dz @ W2 (for layer 1's bias); layer 1: no weight grad, no propagation
        assert len(calls) == (2 if B else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("widths,acts,dtype", [((367, 512, 256, 1), ("relu", "sigmoid"), torch.bfloat16),
                                               ((13, 512, 256, 64, 16), ("relu", "relu"), torch.float32),
                                               ((13, 100, 37, 5), ("silu", "gelu"), torch.bfloat16)])
def test_gpu_train_fast_path_gradients_and_graph(widths, acts, dtype):
    """On the GPU: after one general-path step the training fast path takes the call (its
    bound `save` launch, no second forward), its output is bit-identical to the general
    path's and its gradients match (bit for bit those of the first step, the general path's
    backward running the same train.gradients); a whole training step captured in a CUDA graph replays
    the eager fast path's gradients for a new input."""
    from kgen.runtime import triton_launch as tlaunch

    m = FusedMLP(widths, *acts, dtype=dtype, device="cuda")
    x = torch.randn(300, widths[0], device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(300, widths[-1], device="cuda", dtype=dtype)

    def step():
        m.zero_grad(set_to_none=True)
        x.grad = None
        out = m(x)
        out.backward(g)
        # detached: a kept autograd graph keeps its AccumulateGrad nodes, made on the stream
        # of that step, and a captured backward must not meet them (cudaErrorStreamCaptureImplicit)
        return out.detach(), [x.grad, *(p.grad for p in m.parameters())]

    try:
        fm.op.FAST_TRAIN = False
        out_b, before = step()
        fm.op.FAST_TRAIN = True
        _, first = step()  # the general path: its backward remembers the signature
        n = tlaunch.STATS["direct"]
        assert type(m(x).grad_fn).__name__ == "StepBackward"
        forward_launches = tlaunch.STATS["direct"] - n
        out_a, after = step()
        entry = fm.op._TRAIN.get(fm.op._call(x, list(m.weights), list(m.biases), *acts))
        mod = fm.module_for(x.device, dtype, widths, 300)
        if mod is not None:  # a variant, not the eager composition
            assert entry.go is not None
            # a CUDA variant's training forward: its Triton companion's
            tri = mod.triton if isinstance(mod, fm.cuda.CudaMLP) else mod
            pads = sum(s != w.shape[1] for s, w in zip(getattr(tri, "WEIGHT_STRIDES", ()), m.weights))
            assert forward_launches == 1 + pads  # one forward launch (after a pad of each padded weight), replayed
        assert torch.equal(out_a, out_b)
        for a, b in zip(after, first):  # the general path's backward is the fast path's: bit for bit
            assert torch.equal(a, b)
        for a, b in zip(after, before):
            scale = float(b.abs().max()) or 1.0
            torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=2e-2 if dtype != torch.float32 else 1e-4)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        m.zero_grad(set_to_none=True)
        x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = m(x)
            out_g.backward(g)
        captured = [x.grad, *(p.grad for p in m.parameters())]
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
        graph.replay()
        out_e, eager_grads = step()
        torch.testing.assert_close(out_g, out_e, rtol=0, atol=0)  # the same kernel
        for a, b in zip(captured, eager_grads):  # cuBLAS may pick another algorithm in a capture
            torch.testing.assert_close(a, b)
    finally:
        fm.op.FAST_TRAIN = True


@pytest.mark.parametrize("name,widths,bias,tf32,acts", FAST_CASES, ids=lambda c: str(c)[:40])
def test_train_fast_path_launches_what_save_does(monkeypatch, name, widths, bias, tf32, acts):
    """launch.direct(save=True), the training fast path's forward: the binary, grid and
    arguments of launch.forward(save=True), with new output and z buffers (one per saved
    layer, distinct) and the scratch halves at the same offsets."""
    from kgen.runtime import triton_launch as tlaunch

    monkeypatch.setattr(tlaunch, "current_device", lambda: None)
    monkeypatch.setattr(tlaunch, "current_raw_stream", lambda index: 77)
    monkeypatch.setattr(fm.op, "_TRAIN", CallMemo())
    tlaunch.clear()
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        _train_launch_case(name, widths, bias, tf32, acts)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _train_launch_case(name, widths, bias, tf32, acts):
    from kgen.families.fused_mlp import train

    mod, fakes = _faked(name)
    fake = fakes["fused_mlp_fwd_kernel_x3" if not tf32 and name.endswith("_f32") else "fused_mlp_fwd_kernel"]
    x, ws, bs = fm.make_inputs("cpu", getattr(torch, SPEC.variant(name).dtype), 6, widths, bias=bias)
    for _ in range(2):
        _, zs = fm.forward(mod, x, ws, bs, *acts, save=True)
    general = fake.launches[-1]
    assert general[0] == "direct"
    go = fm.launch.direct(mod, x, ws, bs, *acts, save=True)
    assert go is not None
    fm.op._TRAIN.put(_as_call(x, ws, bs, acts, need_w=False, need_b=False), train.make(mod, x, ws, bs, *acts, go=go))
    out = ops.fused_mlp(x.requires_grad_(), ws, bs, activation=acts[0], last_activation=acts[1])
    assert type(out.grad_fn).__name__ == "StepBackward"
    kind, binary, grid, stream, _, args = fake.launches[-1]
    assert kind == "direct" and binary is general[1] and stream == 77 and grid[0] == general[2][0]
    want = _as_ints(general[5])
    z_at = [i for i, a in enumerate(general[5]) if any(a is z for z in zs if z is not None)]
    assert len(z_at) == sum(z is not None for z in zs) and len({args[i] for i in z_at}) == len(z_at)
    scratch = [i for i, a in enumerate(general[5]) if isinstance(a, torch.Tensor) and i > 1 and i not in z_at
               and a.data_ptr() not in {t.data_ptr() for t in (x, *ws, *(b for b in bs if b is not None))}]
    for i in scratch:
        assert args[i] - args[scratch[0]] == want[i] - want[scratch[0]]
    same = [i for i in range(len(args)) if i != 1 and i not in z_at and i not in scratch]
    assert args[1] == out.data_ptr() and [args[i] for i in same] == [want[i] for i in same]
