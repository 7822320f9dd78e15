"""fused_mlp's fused backward (kgen/families/fused_mlp/fused_backward.py): on the CPU its
Triton kernels under the interpreter against float64 and against reference.backward_lean
at awkward widths and B, every activation, biases on and off, subsets of the gradients,
poisoned buffers, the split over B, bitwise determinism, and the training fast path taking
it; the `gpu` tests run DLRM's MLPs through kgen.nn.FusedMLP and a CUDA-graph capture."""

import sys

import pytest
import torch
import triton
import triton.language as tl

import kgen.ops as ops
from kgen.runtime.memo import CallMemo
from kgen.nn import FusedMLP
from kgen.families import fused_mlp as fm
from kgen.families.fused_mlp import fused_backward as fb
from kgen.families.fused_mlp import train, tuning
from kgen.runtime import dispatch
from kgen.runtime.op import error_ratio
from test_fused_mlp_train import _as_call

ref = sys.modules["kgen.families.fused_mlp.reference"]  # the package exports a function of that name
TOL = dispatch.shipped_spec("fused_mlp").numerics
ACT_PAIRS = (("relu", "sigmoid"), ("sigmoid", "none"), ("gelu", "relu"), ("silu", "gelu"), ("none", "silu"))


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every buffer the kernels write (outputs, dz scratch, split workspace) starts as NaN,
    so an element never written shows up."""
    def empty(*shape, dtype=None, device=None):
        return torch.full(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape, float("nan"),
                          dtype=dtype, device=device)

    monkeypatch.setattr(fb, "_empty", empty)


def _pre_activations(x, ws, bs, acts):
    """Each layer's z, negative entries and all (the eager composition's roundings): every
    backward takes it in place of what the forwards keep, a ReLU layer's output relu(z)
    (test_relu_outputs_saved_by_eager_serve_every_backward_as_z_does), and here it is the
    harder input (the ReLU masks come from z's signs)."""
    h, zs = x, []
    for i, (w, b) in enumerate(zip(ws, bs)):
        a = ref.layer_act(i, len(ws), *acts)
        zs.append(torch.nn.functional.linear(h, w, b))
        h = ref.act(zs[-1], a) if a != "none" else zs[-1]
    return zs


def _case(widths, B, acts, dtype, bias=True, seed=0, device="cpu"):
    """Inputs, the saved zs (_pre_activations: z, negative entries and all, with the eager
    composition's roundings), and an upstream gradient."""
    x, ws, bs = fm.make_inputs(device, dtype, B, widths, seed=seed, bias=bias)
    L = len(ws)
    zs = _pre_activations(x, ws, bs, acts)
    zs = [z if i < L - 1 or acts[1] != "none" else None for i, z in enumerate(zs)]
    g = torch.randn(B, widths[-1], generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    return x, ws, bs, zs, g


def _float64(x, ws, bs, acts, g):
    """Every gradient from float64 autograd on the same inputs: [x, each weight, each bias or None]."""
    leaves = [x.double().requires_grad_(), *(w.double().requires_grad_() for w in ws)]
    bl = [None if b is None else b.double().requires_grad_() for b in bs]
    ref.reference(leaves[0], leaves[1:], bl, *acts).backward(g.double())
    return [leaves[0].grad, *(w.grad for w in leaves[1:]), *(None if b is None else b.grad for b in bl)]


def _check(widths, B, acts, dtype, bias=True, needs=None, seed=0):
    """The fused backward against float64 and against backward_lean in the same dtype;
    gradients not asked for are None. Returns the fused gradients."""
    x, ws, bs, zs, g = _case(widths, B, acts, dtype, bias, seed)
    L = len(ws)
    hb = [b is not None for b in bs]
    needs = needs or (True,) * (1 + 2 * L)
    gx, gws, gbs = fb.backward(g, x, ws, hb, zs, *acts, needs)
    lx, lws, lbs = ref.backward_lean(g, x, ws, hb, zs, *acts, needs)
    want = _float64(x, ws, bs, acts, g)
    tol = TOL[str(dtype).removeprefix("torch.")]
    # Against backward_lean (the same math and roundings, another order of summation), as a
    # fraction of the gradient's largest element: float32 1e-5 (sums of up to 70 products
    # in another order, ~1e-7 relative each); float16: every dz and g is rounded to the
    # dtype, and a float32 sum in another order can land on the neighbouring value (one ulp,
    # 2^-11), which the next layers carry on and add up: 4 ulps. bfloat16: not compared
    # here: the interpreter truncates float32 -> bfloat16 (PyTorch rounds to nearest), a
    # bias toward zero in every dz that a column sum over B rows adds up (seen: 1.8% of a
    # bias gradient at B = 70); the GPU test compares it. Against float64: the spec's
    # tolerance, or a multiple of backward_lean's own error (in 16-bit dtypes a ReLU mask
    # flips where the rounded z lands on the other side of 0, for both; bfloat16: 4x for
    # the truncation, as tests/test_fused_mlp.py's gradient test).
    close = {torch.float32: 1e-5, torch.bfloat16: None, torch.float16: 4 * 2 ** -11}[dtype]
    k = 4 if dtype == torch.bfloat16 else 2
    for i, (got, lean, w) in enumerate(zip([gx, *gws, *gbs], [lx, *lws, *lbs], want)):
        asked = needs[i] and (i <= L or hb[i - 1 - L])
        assert (got is None) == (not asked) == (lean is None), (i, got is None, asked)
        if got is None:
            continue
        assert got.dtype == dtype and got.shape == w.shape, (i, got.dtype, got.shape)
        assert not torch.isnan(got).any(), i
        scale = float(w.abs().max()) or 1.0
        if close is not None:
            assert float((got.double() - lean.double()).abs().max()) <= close * scale, (i, got, lean)
        r, r_lean = error_ratio(got / scale, w / scale, tol), error_ratio(lean / scale, w / scale, tol)
        assert r <= max(1.0, k * r_lean), (i, r, r_lean)
    return gx, gws, gbs


# ------------------------------------------------------------------ CPU: the kernels under the interpreter

@pytest.mark.parametrize("widths,B", [((13, 37, 5, 1), 70), ((7, 33, 17), 3), ((5, 3), 1), ((1, 19, 2), 33)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"B{v}")
@pytest.mark.parametrize("acts", ACT_PAIRS, ids="/".join)
def test_float32_every_activation(widths, B, acts):
    """Every activation in both places at widths of no tile's size (one-wide layers too) and
    B not a multiple of the row tile, biases on."""
    _check(widths, B, acts, torch.float32)


def test_eight_layers_every_slot():
    """The most layers the family takes: every pointer slot of both kernels in use, partial biases."""
    _check((3, 4, 5, 6, 7, 8, 9, 10, 2), 5, ("gelu", "sigmoid"), torch.float32, bias=[i % 2 == 0 for i in range(8)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("widths,B,acts,bias", [((13, 37, 5, 1), 70, ("relu", "sigmoid"), True),
                                               ((7, 33, 17), 3, ("gelu", "none"), False),
                                               ((5, 3), 1, ("silu", "silu"), True),
                                               ((3, 40, 24, 9), 20, ("sigmoid", "relu"), [True, False, True])])
def test_16bit(dtype, widths, B, acts, bias):
    _check(widths, B, acts, dtype, bias)


@pytest.mark.parametrize("needs", [
    (False, False, True, False, False, True, False),  # layer 1's weight, layer 2's bias: layer 0 not visited
    (False, True, False, False, False, False, False),  # layer 0's weight only: the whole chain
    (True, False, False, False, False, False, False),  # x only: dz of every layer, no dW program
    (False, False, False, False, True, False, True),  # biases only: bias-only tiles (no dot)
], ids=["w1b2", "w0", "x", "b0b2"])
def test_subsets_of_needs(needs):
    _check((6, 9, 4, 3), 21, ("relu", "silu"), torch.float32, needs=needs)


def test_plan_skips_what_is_not_needed():
    """Layers below the lowest gradient asked for get no dz scratch; only layers with a
    gradient asked for get dW programs; last_act none: the last dz is grad itself."""
    p = fb.plan((6, 9, 4, 3), torch.float32, torch.device("cpu"), 21, (True,) * 3, ("relu", "none"),
                (False, False, True, False, False, False, False))
    assert sorted(p.dz_at) == [1] and p.chain_kw["LOWEST"] == 1 and not p.chain_kw["NEED_X"]
    assert p.w_at[0] == p.w_at[2] == -1 and p.w_at[1] == 0 and p.b_at == [-1, -1, -1]
    ts = p.dw_kw["TS"]
    assert ts[1] == ts[0] == 0 and ts[2] > ts[1] and ts[3] == ts[2]
    assert fb.plan((6, 9), torch.float32, torch.device("cpu"), 0, (True,), ("relu", "none"), (True,) * 3) is None
    assert fb.plan((6, 9), torch.float32, torch.device("cpu"), 5, (False,), ("relu", "none"),
                   (False, False, True)) is None  # only the bias of a layer with none


def test_row_padded_weight_read_in_place_by_the_chain():
    """With `pad`, a weight the dz chain reads from a zero-padded copy (a 367-wide W0 of
    70 KB: rows 368 apart) given already laid out at that stride (launch.row_padded, NaN in
    its padding) is read as it is: no pad launch for it, the same gradients bit for bit.
    train.gradients passes such a weight through; a contiguous one is padded as before."""
    from kgen.families.fused_mlp import launch

    widths, B, acts = (367, 96, 3), 5, ("relu", "sigmoid")
    x, ws, bs, zs, g = _case(widths, B, acts, torch.float32)
    hb, needs = (True, True), (True,) * 5
    p = fb.plan(widths, torch.float32, torch.device("cpu"), B, hb, acts, needs, pad=True)
    assert [e[0] for e in p.pads] == ["x", 0] and p.ws[0] == 368
    store = torch.full((96, 368), float("nan"))
    store[:, :367] = ws[0]
    padded = store[:, :367]
    assert p.reads_in_place(0, padded) and not p.reads_in_place(0, ws[0]) and not p.reads_in_place(1, ws[1])
    assert not p.reads_in_place(0, launch.row_padded(ws[0], 376))  # another stride: copied contiguous
    kw = dict(scratch=torch.empty(p.dz_numel), flat=torch.empty(p.E), ws=None, gx=torch.empty(B, 367))
    pads = lambda weights: sum(k is fb.fused_mlp_bwd_pad_kernel for k, *_ in p.launches(g, x, weights, zs, **kw))
    assert pads(ws) == 2 and pads([padded, ws[1]]) == 1
    want = p(g, x, ws, zs)
    got = fb.plan(widths, torch.float32, torch.device("cpu"), B, hb, acts, needs, pad=True)(g, x, [padded, ws[1]], zs)
    flat = lambda r: [r[0], *r[1], *r[2]]
    assert all(torch.equal(a, b) for a, b in zip(flat(got), flat(want)))
    again = train.gradients(p, g, x, [padded, ws[1]], hb, zs, acts, needs)
    assert all(torch.equal(a, b) for a, b in zip(flat(again), flat(want)))


def test_split_over_rows_and_determinism(monkeypatch):
    """With the split over B forced (S > 1: float32 partials, then the ordered sum), the
    gradients still match; two runs are bitwise equal, with and without the split."""
    widths, B, acts = (13, 37, 5, 1), 70, ("gelu", "sigmoid")
    hb = (True,) * 3
    plain = fb.plan(widths, torch.float32, torch.device("cpu"), B, hb, acts, (True,) * 7)
    assert plain.S == 1 and plain.dw_kw["E"] == 0
    monkeypatch.setattr(fb, "SPLIT_MIN_ROWS", 16)
    p = fb.plan(widths, torch.float32, torch.device("cpu"), B, hb, acts, (True,) * 7)
    assert p.S > 1 and p.dw_grid[1] == p.S and p.dw_kw["E"] == p.E
    first = _check(widths, B, acts, torch.float32)
    again = _check(widths, B, acts, torch.float32)
    for a, b in zip([first[0], *first[1], *first[2]], [again[0], *again[1], *again[2]]):
        assert torch.equal(a, b)
    monkeypatch.setattr(fb, "SPLIT_MIN_ROWS", 10 ** 9)
    x, ws, bs, zs, g = _case(widths, B, acts, torch.bfloat16)
    runs = [fb.backward(g, x, ws, hb, zs, *acts, (True,) * 7) for _ in range(2)]
    for a, b in zip([runs[0][0], *runs[0][1], *runs[0][2]], [runs[1][0], *runs[1][1], *runs[1][2]]):
        assert torch.equal(a, b)


def test_split_choice(monkeypatch):
    """S = 1 at small B or where the tiles fill the GPU; else about SPLIT_WAVES programs per
    SM, each range a multiple of the row step and at least SPLIT_MIN_ROWS rows (the rule at
    SPLIT_MIN_ROWS 2048 and SPLIT_WAVES 2; the shipped values are measured ones)."""
    monkeypatch.setattr(fb, "SPLIT_MIN_ROWS", 2048)
    monkeypatch.setattr(fb, "SPLIT_WAVES", 2)
    assert fb.split(22, 2048, 64, 132, 10 ** 5) == (1, 2048)
    S, rows = fb.split(22, 65536, 64, 132, 10 ** 5)
    assert S == 12 and rows % 64 == 0 and (S - 1) * rows < 65536 <= S * rows
    assert fb.split(300, 65536, 64, 132, 10 ** 5)[0] == 1
    assert fb.split(22, 5000, 64, 132, 10 ** 5)[0] == 2
    monkeypatch.undo()
    S, rows = fb.split(22, 65536, 64, 132, 10 ** 5)  # shipped: ~SPLIT_WAVES programs per SM
    assert S == -(-fb.SPLIT_WAVES * 132 // 22) and rows % 64 == 0 and (S - 1) * rows < 65536 <= S * rows


def test_second_call_replays_the_first_calls_launches(monkeypatch):
    """After a plan's first call (Triton's own launches, through triton_launch.launch) the
    next call replays the same binaries with the same grids and arguments, its new
    buffers' addresses in place of the old (scratch views at the same offsets): all three
    launches, the split forced on. Kernels: FakeTriton JITFunctions (test_triton_launch)."""
    from test_triton_launch import FakeTriton

    from kgen.runtime import triton_launch as tlaunch

    monkeypatch.setattr(tlaunch, "current_device", lambda: None)  # x's device index on the CPU
    monkeypatch.setattr(tlaunch, "current_raw_stream", lambda index: 77)
    tlaunch.clear()
    fakes = {}
    for name, dns in (("fused_mlp_bwd_dz_kernel", ["B", "act", "last_act"]),
                      ("fused_mlp_bwd_dw_kernel", ["B", "rows_per_split", "act"]),
                      ("fused_mlp_bwd_sum_kernel", ["S", "E"])):
        fakes[name] = FakeTriton(getattr(fb, name).fn, do_not_specialize=dns)
        monkeypatch.setattr(fb, name, fakes[name].jit)
    allocs = []
    monkeypatch.setattr(fb, "_empty", lambda *a, **k: allocs.append(torch.empty(*a, **k)) or allocs[-1])
    monkeypatch.setattr(fb, "SPLIT_MIN_ROWS", 16)
    widths, acts = (13, 37, 5, 1), ("gelu", "sigmoid")
    p = fb.plan(widths, torch.float32, torch.device("cpu"), 70, (True, False, True), acts, (True,) * 7)
    assert p.S > 1
    calls = []
    for seed in (0, 1):
        x, ws, bs, zs, g = _case(widths, 70, acts, torch.float32, bias=[True, False, True], seed=seed)
        n = sum(len(f.launches) for f in fakes.values())
        p(g, x, ws, zs)
        gx, scratch, flat, wsp = allocs[-4:]
        calls.append(([f.launches[-1] for f in fakes.values()], p.launches(g, x, ws, zs, scratch, flat, wsp, gx)))
        assert sum(len(f.launches) for f in fakes.values()) == n + 3
    (first, _), (second, want) = calls
    assert [c[0] for c in first] == ["plain"] * 3 and [c[0] for c in second] == ["direct"] * 3
    for a, b, (_, grid, args, _) in zip(first, second, want):
        assert b[1] is a[1] and b[2] == (*grid, *(1,) * (3 - len(grid)))
        assert list(b[5][:len(args)]) == [t.data_ptr() if isinstance(t, torch.Tensor) else t for t in args]


@pytest.mark.aot
@pytest.mark.parametrize("option", ["fused", "fused_m32_pad"])
def test_dlrm_top_compiles_within_its_resources(option):
    """DLRM top's plan at B = 65536 in bfloat16 (the three launches, the split on; with the
    option, the tuner's other chain tile and x's and W0's padded copies first) compiles ahead
    of time for sm_90 within sm_90's 227 KB of shared memory, with no local memory and at
    most a small stack (tools/fused_mlp_bwd_aot.py, in a process that does not interpret
    Triton). STACK_LIMIT catches a tile change that spills in earnest (the dW kernel's 128 x
    128 tile with 4 warps keeps 8 B under Triton 3.9; a 128 x 128 chain tile took 255
    registers and more)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(root / "tools" / "fused_mlp_bwd_aot.py"), "--mlp", "top", "--dtype",
                        "bfloat16", "--B", "65536", "--option", option, "--json"], capture_output=True, text=True,
                       env=env, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    pads = ["fused_mlp_bwd_pad_kernel"] * 2 if option.endswith("_pad") else []
    assert [row["kernel"] for row in rows] == [*pads, "fused_mlp_bwd_dz_kernel", "fused_mlp_bwd_dw_kernel",
                                               "fused_mlp_bwd_sum_kernel"], rows
    assert rows[1]["S"] > 1
    for row in rows:
        assert row["local"] == 0 and row["stack"] <= STACK_LIMIT and row["shared"] <= 227 * 1024, row


STACK_LIMIT = 512  # bytes per thread; see test_dlrm_top_compiles_within_its_resources


def _train_entry(monkeypatch, x, ws, bs, acts, need_x=True):
    monkeypatch.setattr(fm.op, "_TRAIN", CallMemo())
    entry = train.make(None, x, ws, bs, *acts)
    fm.op._TRAIN.put(_as_call(x, ws, bs, acts, need_x), entry)
    return entry


def _step(x, ws, bs, acts, g, need_x=True):
    xl = x.clone().requires_grad_(need_x)
    wl = [w.clone().requires_grad_() for w in ws]
    bl = [None if b is None else b.clone().requires_grad_() for b in bs]
    out = ops.fused_mlp(xl, wl, bl, activation=acts[0], last_activation=acts[1])
    assert type(out.grad_fn).__name__ == "StepBackward"
    out.backward(g)
    return [xl.grad, *(w.grad for w in wl), *(b.grad for b in bl if b is not None)]


@pytest.mark.parametrize("need_x", [True, False])
def test_train_fast_path_takes_it(monkeypatch, need_x):
    """train.Step's backward runs the fused backward where its device is in DEVICES (the
    interpreter here), one plan per entry and `needs`, and gives backward_lean's gradients;
    KGEN_FUSED_MLP_FUSED_BWD=0 (ENABLED False) and other devices leave it on backward_lean."""
    widths, acts = (5, 11, 6, 2), ("silu", "sigmoid")
    x, ws, bs = fm.make_inputs("cpu", torch.float32, 9, widths, bias=[True, False, True])
    g = torch.randn(9, 2, generator=torch.Generator().manual_seed(4))
    entry = _train_entry(monkeypatch, x, ws, bs, acts, need_x)
    lean = _step(x, ws, bs, acts, g, need_x)
    assert not entry.plans  # the CPU is not in DEVICES
    monkeypatch.setattr(fb, "DEVICES", ("cuda", "cpu"))
    fused = _step(x, ws, bs, acts, g, need_x)
    (p,) = entry.plans.values()
    assert isinstance(p, fb.Plan) and p.state == "ok" and p.need_x == need_x
    for a, b in zip(fused, lean):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(fb, "ENABLED", False)
    entry.plans.clear()
    _step(x, ws, bs, acts, g, need_x)
    assert not entry.plans
    # a bucket whose tuned choice is another chain tile: a plan with that tile, the same gradients
    monkeypatch.setattr(fb, "ENABLED", True)
    entry.plans.clear()
    monkeypatch.setattr(train, "backward_choice", lambda *a: "fused_m32")
    tiled = _step(x, ws, bs, acts, g, need_x)
    (p,) = entry.plans.values()
    assert (p.chain_kw["BLOCK_M"], p.chain_kw["BLOCK_N"], p.chain_kw["num_warps"]) == fb.CHAIN_OPTIONS["m32"]
    for a, b in zip(tiled, lean):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a bucket whose tuned choice is backward_lean: no plan, the same gradients
    entry.plans.clear()
    monkeypatch.setattr(train, "backward_choice", lambda *a: "lean")
    again = _step(x, ws, bs, acts, g, need_x)
    assert list(entry.plans.values()) == [None]
    for a, b in zip(again, lean):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_first_training_step_gives_the_later_steps_gradients(monkeypatch, fused):
    """The op's own backward (a signature's first training step, and every step where the
    training fast path steps aside: torch.compile, autocast, `using`) runs the fast path's
    backward, train.gradients, on the zs of a forward launched again with `save`: its
    gradients equal train.Step's bit for bit, through the fused backward (the interpreter
    here) and through backward_lean. (They used to come from reference.backward's per-layer
    GEMMs, float32 rounding away from the later steps'.) KGEN_FUSED_MLP_FAST_TRAIN=0 keeps
    reference.backward."""
    widths, acts = (7, 13, 6, 3), ("gelu", "sigmoid")
    x, ws, bs = fm.make_inputs("cpu", torch.float32, 10, widths, bias=[True, False, True])
    g = torch.randn(10, 3, generator=torch.Generator().manual_seed(5))
    if fused:
        monkeypatch.setattr(fb, "DEVICES", ("cuda", "cpu"))
    calls = []
    monkeypatch.setattr(train, "gradients", lambda *a, f=train.gradients: calls.append(a[0]) or f(*a))
    monkeypatch.setattr(fm.op, "_TRAIN", CallMemo())

    def general():
        xl = x.clone().requires_grad_()
        wl = [w.clone().requires_grad_() for w in ws]
        bl = [None if b is None else b.clone().requires_grad_() for b in bs]
        out = ops.fused_mlp(xl, wl, bl, activation=acts[0], last_activation=acts[1])
        assert type(out.grad_fn).__name__ != "StepBackward"
        out.backward(g)
        return [xl.grad, *(w.grad for w in wl), *(b.grad for b in bl if b is not None)]

    first = general()
    assert len(calls) == 1 and isinstance(calls[0], fb.Plan) == fused
    entry = _train_entry(monkeypatch, x, ws, bs, acts)
    later = _step(x, ws, bs, acts, g)
    assert len(calls) == 2 and isinstance(calls[1], fb.Plan) == fused
    for a, b in zip(first, later):
        assert torch.equal(a, b)
    # torch.compile: the op's backward, a custom op whose outputs may not alias (the plan's
    # parameter gradients are views of one buffer: copied out), the same gradients
    leaves = [t.clone().requires_grad_() for t in (x, *ws, *(b for b in bs if b is not None))]
    it = iter(leaves[4:])
    bl = [next(it) if b is not None else None for b in bs]
    f = torch.compile(lambda *t: (fm.fused_mlp(t[0], list(t[1:4]), bl, activation=acts[0], last_activation=acts[1])
                                  * g).sum(), fullgraph=True, backend="aot_eager")
    f(*leaves[:4]).backward()
    assert len(calls) == 3
    for a, b in zip(later, [t.grad for t in leaves]):
        assert torch.equal(a, b)
    monkeypatch.setattr(fm.op, "FAST_TRAIN", False)
    before = general()
    assert len(calls) == 3  # reference.backward, not train.gradients
    for a, b in zip(before, later):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_padded_copies_give_the_same_gradients(monkeypatch, dtype):
    """`pad` (a tuned option): x and the chain's weights whose rows are not whole 16-byte
    vectors are read from zero-padded copies in the scratch, one pad launch each before the
    chain; the gradients are bitwise those of the plan without it (the same products, the
    padding's zeros added). Under the interpreter, every weight padded (ALIGN_MIN_BYTES 0)."""
    from kgen.families.fused_mlp import schema

    monkeypatch.setattr(schema, "ALIGN_MIN_BYTES", 0)
    widths, acts, B = (13, 21, 6, 3), ("gelu", "sigmoid"), 37
    x, ws, bs = fm.make_inputs("cpu", dtype, B, widths)
    g = torch.randn(B, 3, generator=torch.Generator().manual_seed(6)).to(dtype)
    zs = fm.eager(x, ws, bs, *acts, save=True)[1]
    needs = (True,) * 7
    plain = fb.plan(widths, dtype, x.device, B, (True,) * 3, acts, needs)
    padded = fb.plan(widths, dtype, x.device, B, (True,) * 3, acts, needs, pad=True)
    v = 16 // dtype.itemsize
    aligned = fb.plan((16, 24, 8, 3), dtype, x.device, B, (True,) * 3, acts, needs, pad=True)
    assert not aligned.pads  # rows already whole 16-byte vectors: nothing to copy
    assert padded.xs == 16 and padded.ws == tuple(-(-k // v) * v for k in widths[:-1])
    assert [w for w, *_ in padded.pads] == ["x", 0, 1, 2] and not plain.pads
    launched = []
    real = fb.triton_launch.launch
    monkeypatch.setattr(fb.triton_launch, "launch", lambda *a: launched.append(a[0]) or real(*a))
    want, got = plain(g, x, ws, zs), padded(g, x, ws, zs)
    assert launched.count(fb.fused_mlp_bwd_pad_kernel) == 4
    flat = lambda r: [r[0], *r[1], *r[2]]  # noqa: E731
    for a, b in zip(flat(got), flat(want)):
        assert torch.equal(a, b)


def test_fused_options_parse():
    assert tuning.fused_option("fused") == (None, False)
    assert tuning.fused_option("fused_pad") == (None, True)
    assert tuning.fused_option("fused_m32") == (fb.CHAIN_OPTIONS["m32"], False)
    assert tuning.fused_option("fused_m32_pad") == (fb.CHAIN_OPTIONS["m32"], True)
    assert tuning.fused_option("fused_w8_pad") == (fb.CHAIN_OPTIONS["w8"], True)
    assert tuning.BACKWARDS == (*tuning.FUSED_OPTIONS, "lean")
    for name in ("lean", "fused_c999"):
        with pytest.raises(KeyError):
            tuning.fused_option(name)
    assert tuning.BACKWARDS == ("fused", "fused_m32", "fused_w8", "fused_pad", "fused_m32_pad", "fused_w8_pad", "lean")


def test_no_chain_tile_of_more_than_64_rows():
    """Triton 3.6 miscompiles the dz chain at 128 rows for some widths on sm_90 (silently wrong
    grad_x, or an illegal shared-memory read; fused_backward.CHAIN): no table row or tuner
    option has one, and a caller's is refused before anything is built or launched."""
    tiles = [row[1:] for rows in fb.CHAIN.values() for row in rows] + list(fb.CHAIN_OPTIONS.values())
    assert tiles and all(t[0] <= fb.MAX_CHAIN_ROWS == 64 for t in tiles), tiles
    with pytest.raises(ValueError, match="128 rows"):
        fb.plan((7, 28, 3), torch.float16, torch.device("cpu"), 100, (True,) * 2, ("relu", "none"), (True,) * 5,
                chain=(128, 64, 4))


@pytest.mark.parametrize("chain", [(64, 128, 4), (64, 128, 8), (32, 128, 4)], ids=lambda t: "x".join(map(str, t)))
def test_wgmma_chain_tiles_take_chunks_of_at_least_64(chain):
    """The dz chain's WGMMA tiles (>= 64 rows) bound every chunk below by WGMMA_MIN_CHUNK
    (Triton 3.6 miscompiled them with 16- and 32-wide dots at some widths; fused_backward.CHAIN);
    mma.sync tiles keep the padded widths. Under the interpreter, at widths where the wide chunks
    run past every layer but one (zero-masked), every gradient matches backward_lean's within
    the GPU test's 8 ulps of its largest element (the same math, another summation order)."""
    widths, B, acts, dtype = (7, 28, 3, 6, 33), 131, ("gelu", "gelu"), torch.float16
    x, ws, bs, zs, g = _case(widths, B, acts, dtype, bias=True)
    L = len(ws)
    hb, needs = (True,) * L, (True,) * (1 + 2 * L)
    p = fb.plan(widths, dtype, x.device, B, hb, acts, needs, chain=chain)
    want_ps = tuple(max(64 if chain[0] >= 64 else 16, fm.schema.padded(w)) for w in widths)
    assert p.chain_kw["PS"] == want_ps and p.chain_kw["BLOCK_M"] == chain[0]
    got = p(g, x, ws, zs)
    want = ref.backward_lean(g, x, ws, hb, zs, *acts, needs)
    for a, b in zip([got[0], *got[1], *got[2]], [want[0], *want[1], *want[2]]):
        scale = float(b.float().abs().max()) or 1.0
        assert float((a.float() - b.float()).abs().max()) <= 8 * 2.0 ** -10 * scale


def test_tuner_leaves_out_a_fused_option_that_disagrees_with_lean(monkeypatch, caplog):
    """tune_choices times a fused option only where its first call's gradients match
    backward_lean's (tuning.agrees): a kernel Triton miscompiled for these widths (as the
    128-row and 64 x 128 x 4 chain tiles were, fused_backward.CHAIN) is never chosen. Here the
    "w8" tile's grad_x is doubled after it runs; the other options stay, and a warning names it."""
    monkeypatch.setattr(fb, "DEVICES", ("cuda", "cpu"))
    x, ws, bs, _, _ = _case((7, 28, 3, 6, 33), 70, ("gelu", "gelu"), torch.float16)
    inputs = dict(x=x, weights=ws, biases=bs, activation="gelu", last_activation="gelu")
    honest = set(tuning.tune_choices(inputs)["backward"])
    assert {"fused", "fused_m32", "fused_w8", "lean"} <= honest
    real = fb.Plan.__call__

    def broken(self, g, x, ws, zs):
        got = real(self, g, x, ws, zs)
        if self.chain_kw["BLOCK_M"] == fb.CHAIN_OPTIONS["w8"][0] and self.chain_kw["num_warps"] == 8:
            got[0].mul_(2)
        return got

    monkeypatch.setattr(fb.Plan, "__call__", broken)
    with caplog.at_level("WARNING", logger="kgen"):
        options = set(tuning.tune_choices(inputs)["backward"])
    assert options == {o for o in honest if "w8" not in o}
    assert "fused_w8 disagrees with the lean backward (gradient 0" in caplog.text


def test_agrees_bounds_and_nans():
    """tuning.agrees: within AGREE of each gradient's largest element; a NaN only where the
    reference has one; None gradients skipped."""
    want = (torch.tensor([1.0, -2.0, float("nan")]), [torch.ones(2, 2)], [None])
    ok = (want[0] + torch.tensor([0.03, 0.0, 0.0]), [torch.ones(2, 2)], [None])  # bf16: 0.125, fp16: 0.0156
    assert tuning.agrees(ok, want, torch.bfloat16) and not tuning.agrees(ok, want, torch.float16)
    nan = (torch.tensor([float("nan"), -2.0, float("nan")]), want[1], want[2])
    assert not tuning.agrees(nan, want, torch.bfloat16)
    far = (want[0], [torch.full((2, 2), 1.5)], [None])
    assert not tuning.agrees(far, want, torch.float32)


def test_backward_choice_default_rule():
    """Where no table holds the bucket (the CPU has none): the fused backward for 16-bit
    dtypes at any B, for float32 up to F32_FUSED_MAX_B rows (measured: it lost to per-layer
    GEMMs above; tuning.py)."""
    from kgen.families.fused_mlp import tuning

    cpu, top = torch.device("cpu"), (367, 512, 256, 1)
    assert tuning.backward_choice(cpu, torch.bfloat16, top, 1 << 20) == "fused"
    assert tuning.backward_choice(cpu, torch.float16, top, 1) == "fused"
    assert tuning.backward_choice(cpu, torch.float32, top, tuning.F32_FUSED_MAX_B) == "fused"
    assert tuning.backward_choice(cpu, torch.float32, top, tuning.F32_FUSED_MAX_B + 1) == "lean"


@pytest.mark.parametrize("failure", ["compile", "pass_manager"])
def test_train_fast_path_falls_back_where_it_does_not_build(monkeypatch, failure):
    """A plan whose kernels fail to build (a CompilationError, or Triton's MLIR pipeline
    failing: a RuntimeError "PassManager::run failed") warns once and leaves the signature
    on backward_lean (same gradients); any other RuntimeError of a launch propagates."""
    from triton.compiler.errors import CompilationError

    widths, acts = (4, 7, 3), ("relu", "none")
    x, ws, bs = fm.make_inputs("cpu", torch.float32, 5, widths)
    g = torch.randn(5, 3, generator=torch.Generator().manual_seed(5))
    entry = _train_entry(monkeypatch, x, ws, bs, acts)
    want = _step(x, ws, bs, acts, g)
    monkeypatch.setattr(fb, "DEVICES", ("cuda", "cpu"))

    def other(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(fb.triton_launch, "launch", other)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _step(x, ws, bs, acts, g)
    entry.plans.clear()

    def broken(*a, **k):
        if failure == "compile":
            raise CompilationError("src", None, "no")
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(fb.triton_launch, "launch", broken)
    with pytest.warns(UserWarning, match="did not build"):
        got = _step(x, ws, bs, acts, g)
    got2 = _step(x, ws, bs, acts, g)
    (p,) = entry.plans.values()
    assert p.state == "failed"
    for a, b, c in zip(got, got2, want):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


# ------------------------------------------------------------------ GPU

DLRM = [((367, 512, 256, 1), ("relu", "sigmoid")), ((13, 512, 256, 64, 16), ("relu", "relu"))]


@pytest.mark.gpu
@pytest.mark.parametrize("widths", [(7, 28, 3, 6, 33), (30, 43, 153), (10, 13, 35, 32, 21, 5),
                                    (3, 58, 31, 297, 177, 112)], ids=lambda w: "-".join(map(str, w)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_every_chain_tile_at_widths_that_broke_128_rows(widths, dtype):
    """Every dz-chain tile the tables or the tuner can pick (fused_backward.CHAIN's rows and
    CHAIN_OPTIONS), each forced at B = 4099, at widths where Triton 3.6 had miscompiled the
    128-row tiles (wrong grad_x or an illegal address; forty-ninth session) and, before the
    chunk floor of WGMMA tiles (fused_backward.WGMMA_MIN_CHUNK), 64 x 128 x 4: grad_x and every
    weight gradient against backward_lean's (the same math and roundings, another summation
    order: each rounded dz can land one ulp away and the layers below carry it on;
    tuning.disagreement's bound, 8 ulps of the dtype of the gradient's largest element, where
    the miscompiled tiles were off by ~1x of it), and no NaN left in the poisoned buffers."""
    B, acts = 4099, ("gelu", "gelu")
    x, ws, bs, zs, g = _case(widths, B, acts, dtype, bias=False, device="cuda")
    L = len(ws)
    needs, hb = (True,) * (1 + 2 * L), (False,) * L
    lx, lws, _ = ref.backward_lean(g, x, ws, hb, zs, *acts, needs)
    tiles = {row[1:] for row in fb.CHAIN[2]}
    tiles |= set(fb.CHAIN_OPTIONS.values())
    for chain in sorted(tiles):
        p = fb.plan(widths, dtype, x.device, B, hb, acts, needs, chain=chain)
        gx, gws, _ = p(g, x, ws, zs)
        worst, at = tuning.disagreement((gx, gws, []), (lx, lws, []), dtype)  # (the tuner's own check)
        assert worst <= 1.0, (chain, widths, worst, at)


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["fused", "fused_pad"])
def test_gpu_pad_weights_training_step_same_bits(monkeypatch, backward):
    """kgen.nn.FusedMLP(pad_weights=True) at DLRM top's widths, bf16: its training steps (the
    general path's, then the fast path's) give bitwise the gradients and outputs of the dense
    module with the same parameters; with `fused_pad` the chain reads the row-padded W0 in
    place (no pad launch)."""
    monkeypatch.setattr(fm.op, "_TRAIN", CallMemo())
    monkeypatch.setattr(train, "backward_choice", lambda *a: backward)
    torch.manual_seed(0)
    widths, acts = DLRM[0]
    dense = FusedMLP(widths, *acts, dtype=torch.bfloat16, device="cuda")
    padded = FusedMLP(widths, *acts, dtype=torch.bfloat16, device="cuda", pad_weights=True)
    padded.load_state_dict(dense.state_dict())
    assert padded.weights[0].stride() == (368, 1)
    x = torch.randn(1000, widths[0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1000, 1, device="cuda", dtype=torch.bfloat16)

    def step(m):
        m.zero_grad(set_to_none=True)
        x.grad = None
        out = m(x)
        out.backward(g)
        return [out.detach(), x.grad.clone(), *(p.grad.clone() for p in m.parameters())]

    for _ in range(3):
        for a, b in zip(step(dense), step(padded)):
            assert torch.equal(a, b)
    entry = fm.op._TRAIN.get(fm.op._call(x, list(padded.weights), list(padded.biases), *acts))
    (p,) = entry.plans.values()
    assert p.reads_in_place(0, padded.weights[0]) == (backward == "fused_pad")
    # one plan called with W0 dense (its launches recorded for replay), then row-padded, then
    # dense again: a replay recorded for one layout never runs on the other
    x2, ws = x.detach(), [w.detach() for w in dense.weights]
    zs = fm.launch.saved(fm.module_for(x.device, x.dtype, widths, 1000), x2, ws, list(dense.biases), *acts)
    p = fb.plan(widths, torch.bfloat16, x.device, 1000, (True,) * 3, acts, (True,) * 7,
                pad=backward == "fused_pad")
    flat = lambda r: [r[0], *r[1], *r[2]]
    want = [t.clone() for t in flat(p(g, x2, ws, zs))]
    for weights in ([padded.weights[0].detach(), *ws[1:]], ws, [padded.weights[0].detach(), *ws[1:]]):
        assert all(torch.equal(a, b) for a, b in zip(flat(p(g, x2, weights, zs)), want))


@pytest.mark.gpu
@pytest.mark.parametrize("widths,acts", DLRM, ids=["top", "bottom"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("B", [1000, 20000])
@pytest.mark.parametrize("backward", ["fused", "fused_m32", "fused_w8", "fused_pad"])
def test_gpu_dlrm_training_step(monkeypatch, widths, acts, dtype, B, backward):
    """A training step through kgen.nn.FusedMLP on CUDA at DLRM's widths takes the fused
    backward (after the general path's first step), its gradients match float64 (the
    spec's tolerance, or twice eager PyTorch's own error in the dtype) and backward_lean's,
    a second step gives bitwise the same gradients, and both B run the split over B."""
    if tuning.fused_option(backward)[0] is not None and dtype == torch.float32:
        pytest.skip("the chain options are tuned for 16-bit dtypes only (tuning.backward_choice)")
    # a memo of its own: another test's step of the same signature (the DLRM compile test's,
    # x without a gradient) would leave a second plan in the shared entry
    monkeypatch.setattr(fm.op, "_TRAIN", CallMemo())
    # the fused kernels whatever the tables choose (float32's buckets go to backward_lean), with
    # the shipped chain tiles or a tuned option's (fused_backward.CHAIN_OPTIONS)
    monkeypatch.setattr(train, "backward_choice", lambda *a: backward)
    torch.manual_seed(0)
    m = FusedMLP(widths, *acts, dtype=dtype, device="cuda")
    x = torch.randn(B, widths[0], device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(B, widths[-1], device="cuda", dtype=dtype)

    def step():
        m.zero_grad(set_to_none=True)
        x.grad = None
        m(x).backward(g)
        return [x.grad.clone(), *(p.grad.clone() for p in m.parameters())]

    step()  # the general path: its backward remembers the signature
    entry = fm.op._TRAIN.get(fm.op._call(x, list(m.weights), list(m.biases), *acts))
    got = step()
    (p,) = entry.plans.values()
    assert isinstance(p, fb.Plan) and p.state == "ok"
    assert p.S > 1 or B < 2 * fb.SPLIT_MIN_ROWS  # the split over B runs (both B here, at the shipped tiles)
    again = step()
    for a, b in zip(got, again):
        assert torch.equal(a, b)
    saved = fb.ENABLED
    fb.ENABLED = False
    try:
        lean = step()
    finally:
        fb.ENABLED = saved
    leaves = [x.detach().double().requires_grad_(), *(p.detach().double().requires_grad_() for p in m.parameters())]
    L = len(widths) - 1
    ref.reference(leaves[0], leaves[1:1 + L], leaves[1 + L:], *acts).backward(g.double())
    eager_leaves = [t.detach().clone().requires_grad_() for t in (x, *m.parameters())]
    ref.eager(eager_leaves[0], eager_leaves[1:1 + L], eager_leaves[1 + L:], *acts)[0].backward(g)
    tol = TOL[str(dtype).removeprefix("torch.")]
    for i, (a, b, w, e) in enumerate(zip(got, lean, leaves, eager_leaves)):
        scale = float(w.grad.abs().max()) or 1.0
        # fused vs lean: the same roundings, sums in another order (16-bit: a few ulps of the
        # largest element, carried through the layers; float32 with TF32 off both ~1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=3e-2 if dtype != torch.float32 else 1e-4)
        r = error_ratio(a / scale, w.grad / scale, tol)
        assert r <= max(1.0, 2 * error_ratio(e.grad / scale, w.grad / scale, tol)), (i, r)


@pytest.mark.gpu
@pytest.mark.parametrize("widths,acts", DLRM, ids=["top", "bottom"])
def test_gpu_float32_tf32_large_batch(widths, acts):
    """float32 with TF32 on (as torch.matmul would use it) at B above the chain's small-B
    tiles: the fused backward compiles and runs (its 64-row chain crashed Triton 3.6's
    pipeliner for the top MLP) and matches backward_lean, whose GEMMs use TF32 too, within
    1e-2 of each gradient's largest element (TF32's 10-bit mantissa, sums in another order:
    2-3e-3 measured on an H100)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        B, L = 20000, len(widths) - 1
        x, ws, bs = fm.make_inputs("cuda", torch.float32, B, widths)
        # the exact Triton variant's forward (its z), not dispatch's choice: the H200's table
        # gives the top MLP's float32 TF32 buckets to eager PyTorch
        (v,) = [v for v in dispatch.shipped_spec("fused_mlp").variants if v.backend == "triton"
                and v.dtype == "float32" and tuple(v.params["widths"]) == widths and v.params["block_m"] == 64]
        _, zs = fm.launch.forward(dispatch.load(v).module, x, ws, bs, *acts, save=True)
        g = torch.randn(B, widths[-1], device="cuda")
        needs = (True,) * (1 + 2 * L)
        gx, gws, gbs = fb.backward(g, x, ws, [True] * L, zs, *acts, needs)
        lx, lws, lbs = ref.backward_lean(g, x, ws, [True] * L, zs, *acts, needs)
        for a, b in zip([gx, *gws, *gbs], [lx, *lws, *lbs]):
            scale = float(b.abs().max()) or 1.0
            torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=1e-2)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_float32_tf32_gradients_as_accurate_as_eager(tf32, seed):
    """float32 with TF32 on through a deep MLP with narrow layers (the random-shape sweep's
    case of the forty-sixth session: B = 90, widths 100-8-4-547-37-601-14, relu, biases):
    every gradient of the op's training step is within 1.25x eager PyTorch's own error
    against float64 (max |error| / max |gradient|). Eager's is itself far outside the
    float32 tolerance here (TF32 through seven layers); with the tensor cores truncating
    the operands, as Triton hands them over, kgen's was 2-7x eager's; rounded as cuBLAS
    rounds them it matched eager's to the second digit (H200)."""
    tf32(True)
    widths, acts = (100, 8, 4, 547, 37, 601, 14), ("relu", "relu")
    x, ws, bs = fm.make_inputs("cuda", torch.float32, 90, widths, seed=seed, bias=True)
    g = torch.randn(90, widths[-1], device="cuda", generator=torch.Generator("cuda").manual_seed(seed))

    def grads(fn, conv):
        leaves = [conv(t.detach()).requires_grad_() for t in (x, *ws, *bs)]
        L = len(ws)
        fn(leaves[0], leaves[1:1 + L], leaves[1 + L:]).backward(conv(g))
        return [t.grad for t in leaves]

    for _ in range(2):  # (the second call: the training fast path)
        got = grads(lambda x_, w_, b_: ops.fused_mlp(x_, w_, b_, activation=acts[0], last_activation=acts[1]),
                    torch.clone)
    want = grads(lambda *t: fm.reference(*t, *acts), torch.Tensor.double)
    eager = grads(lambda *t: fm.eager(*t, *acts)[0], torch.clone)
    for i, (a, w, e) in enumerate(zip(got, want, eager)):
        scale = float(w.abs().max()) or 1.0
        err, own = (float((t.double() - w).abs().max()) / scale for t in (a, e))
        assert err <= 1.25 * own + 1e-6, (i, err, own)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("backward", ["fused", "lean"])
def test_gpu_training_step_in_a_cuda_graph(monkeypatch, dtype, backward):
    """A training step with the fused backward (or backward_lean, where the tables choose
    it) captured in a CUDA graph replays, for a new input, bitwise the gradients an eager
    step gives (the same kernels, no atomics)."""
    monkeypatch.setattr(train, "backward_choice", lambda *a: backward)
    monkeypatch.setattr(fm.op, "_TRAIN", CallMemo())
    widths, acts = DLRM[0]
    m = FusedMLP(widths, *acts, dtype=dtype, device="cuda")
    x = torch.randn(4096, widths[0], device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(4096, 1, device="cuda", dtype=dtype)

    def step():
        m.zero_grad(set_to_none=True)
        x.grad = None
        out = m(x)
        out.backward(g)
        return out.detach(), [x.grad, *(p.grad for p in m.parameters())]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # the general path once, then the fast path (its kernels built)
            step()
    torch.cuda.current_stream().wait_stream(s)
    entry = fm.op._TRAIN.get(fm.op._call(x, list(m.weights), list(m.biases), *acts))
    if backward == "fused":
        assert any(isinstance(p, fb.Plan) and p.state == "ok" for p in entry.plans.values())
    else:
        assert list(entry.plans.values()) == [None]
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
    out_e, eager = step()
    assert torch.equal(out_g, out_e)
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("widths,acts,option", [
    ((367, 512, 256, 1), ("relu", "sigmoid"), "fused_pad"),
    ((368, 512, 256, 1), ("relu", "sigmoid"), "fused"),
    ((64, 256, 128, 8), ("gelu", "none"), "fused_m32"),
    ((13, 512, 256, 64, 16), ("relu", "relu"), "fused_m32_pad"),
], ids=["top-pad", "368", "64", "bottom-m32-pad"])
def test_gpu_fused_backward_reproducible_at_large_b(widths, acts, option):
    """At B = 20000 (dW's 128-wide tiles, a 3-stage pipeline, the split over B) with x's rows
    whole 16-byte vectors (a padded copy, or a width that needs none), eight calls of the
    fused backward give bitwise the same gradients, and its bias gradients match
    backward_lean's. The bias sums once rode as a second body in the dW tiles' loop, where
    Triton 3.6's pipeliner let them read dz tiles the next stage was overwriting: dW_0 and
    db_0 differed from call to call in 5 of 6 (thirty-first session)."""
    B, dtype = 20000, torch.bfloat16
    x, ws, bs, zs, g = _case(widths, B, acts, dtype, device="cuda")
    L = len(ws)
    needs = (True,) * (1 + 2 * L)
    chain, pad = tuning.fused_option(option)
    p = fb.plan(widths, dtype, x.device, B, (True,) * L, acts, needs, chain, pad)
    assert p.S > 1 and bool(p.pads) == pad
    first = None
    for _ in range(8):
        gx, gws, gbs = p(g, x, ws, zs)
        got = [gx, *gws, *gbs]
        if first is None:
            first = [t.clone() for t in got]
        for a, b in zip(got, first):
            assert torch.equal(a, b)
    _, _, lean_b = ref.backward_lean(g, x, ws, [True] * L, zs, *acts, needs)
    for a, b in zip(first[1 + L:], lean_b):
        # the same float32 column sums of the same dz in another order, rounded once
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * float(b.float().abs().max()))


def _tf32_nearest(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest TF32 value (10 explicit mantissa bits), ties away from zero, in
    float64 arithmetic: cvt.rna.tf32.f32's rounding (and cuBLAS's for TF32 operands)."""
    d = x.double()
    _, e = torch.frexp(d)  # d = m * 2^e, |m| in [0.5, 1): 11 significant bits are m * 2^11
    q = torch.ldexp(torch.ones_like(d), (e - 11).clamp(min=-136))  # TF32's subnormal step: 2^-136
    r = torch.copysign(torch.floor(d.abs() / q + 0.5) * q, d)  # (-0.0 stays -0.0)
    r = torch.where(r.abs() > 3.4028234663852886e38, torch.copysign(torch.full_like(d, torch.inf), d), r)
    return torch.where(torch.isfinite(d), r, d).float()


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, ROUND(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


def test_tf32_operands_rounded_to_nearest(tf32):
    """With TF32 on, the float32 Triton kernels round each dot operand to the nearest TF32
    value (ties away from zero, as cvt.rna and cuBLAS) instead of letting the tensor cores
    truncate it: truncation biased every product by -7e-4 relative (H200, forty-sixth session)
    and put fused_mlp's TF32 gradients 2-7x further from float64 than eager's. Both copies of
    the rounding -- the backward kernels' `_tf32_round` and the float32 forward modules'
    `tf32_round` (templates/common/triton_tf32.py.j2) -- against a float64 rounding of ties,
    near-ties, the largest float32 (to inf), subnormals, +-0, inf and NaN; and a float32
    forward with TF32 on equals the float64 product of the rounded operands (the interpreter
    multiplies in float32)."""
    from kgen.families.fused_mlp import fused_backward_kernels as fbk

    (v,) = [v for v in dispatch.shipped_spec("fused_mlp").variants
            if v.backend == "triton" and v.dtype == "float32" and v.name.startswith("triton_mw4096_m32")]
    rounders = {"backward": fbk._tf32_round, "forward": dispatch.load(v).module.tf32_round}

    bits = torch.tensor([0x3F800FFF, 0x3F801000, 0x3F801001, 0xBF801000, 0x3F803000, 0x3F9FF000, 0x7F7FFFFF,
                         0x7F7FE000, 0x00000001, 0x00001000, 0x00800FFF, 0x80000000, 0x00000000, 0x7F800000,
                         0xFF800000, 0x7FC00000, 0x7FFFF000], dtype=torch.int64).to(torch.int32)
    special = bits.view(torch.float32)
    x = torch.cat([special, torch.randn(4000) * torch.exp2(torch.randint(-60, 60, (4000,)).float())])
    want = _tf32_nearest(x)
    for name, fn in rounders.items():
        y = torch.full_like(x, 7.0)
        _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), ROUND=fn, BLOCK=1024)
        nan = torch.isnan(want)
        assert torch.isnan(y[nan]).all(), name
        assert torch.equal(y[~nan].view(torch.int32), want[~nan].view(torch.int32)), (
            name, x[~nan][y[~nan] != want[~nan]][:8], y[~nan][y[~nan] != want[~nan]][:8])

    # applied: one layer, TF32 on, the generic float32 variant (awkward widths: masked tiles)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(37, 100, generator=g), torch.randn(53, 100, generator=g) / 10
    exact = x.double() @ w.double().T
    rounded = _tf32_nearest(x).double() @ _tf32_nearest(w).double().T
    scale = float(exact.abs().max())
    tf32(True)
    out, _ = fm.forward(dispatch.load(v).module, x, [w], [None], "none", "none")
    assert float((out.double() - rounded).abs().max()) < 1e-6 * scale  # float32 sums of the rounded products
    assert float((exact - rounded).abs().max()) > 1e-4 * scale  # (the rounding is visible at that bound)


def test_tf32_backward_chain_reads_rounded_weights(tf32):
    """Float32 with TF32 on, the fused backward's dz chain reads every weight it multiplies
    from a TF32-rounded copy (Plan.copies: one launch before the chain, W0 included when x's
    gradient is asked for, zero-padded to the chain's stride) and rounds its other operand in
    the kernel: grad_x of a two-layer MLP without activations equals, within float32 sums,
    the float64 products of the rounded operands, dz0 = rna(g) @ rna(W1) rounded to float32,
    then rna(dz0) @ rna(W0) -- and not the unrounded products (TF32 truncation would be
    further still)."""
    tf32(True)
    g0 = torch.Generator().manual_seed(11)
    B, widths = 37, (29, 45, 19)
    x = torch.randn(B, widths[0], generator=g0)
    ws = [torch.randn(widths[i + 1], widths[i], generator=g0) / 5 for i in range(2)]
    g = torch.randn(B, widths[2], generator=g0)
    needs = (True, False, False, False, False)
    p = fb.plan(widths, torch.float32, x.device, B, (False, False), ("none", "none"), needs)
    assert [c[0] for c in p.copies] == [0, 1] and not p.pads
    gx, gws, gbs = fb.backward(g, x, ws, [False, False], [None, None], "none", "none", needs)
    assert gws == [None, None] and gbs == [None, None]
    r = _tf32_nearest
    dz0 = (r(g).double() @ r(ws[1]).double()).float()
    want = r(dz0).double() @ r(ws[0]).double()
    plain = (g.double() @ ws[1].double()) @ ws[0].double()
    scale = float(want.abs().max())
    assert float((gx.double() - want).abs().max()) < 1e-5 * scale
    assert float((plain - want).abs().max()) > 1e-4 * scale


@pytest.mark.parametrize("widths, B, acts", [((1, 443, 1, 1, 90), 2, ("silu", "silu")),
                                             ((37, 1, 20, 1), 67, ("relu", "gelu"))],
                         ids=["1-443-1-1-90", "37-1-20-1"])
def test_tf32_backward_one_wide_layers_in_float32(tf32, widths, B, acts):
    """Float32 with TF32 on, a one-wide layer's products (input or output width <=
    schema.TF32_FULL_MAX; every layer here) in the fused backward are computed to float32's
    accuracy from the weights themselves (no rounded copy), as cuBLAS computes them: every
    gradient within 1e-5 of its largest element of float64 autograd's (the saved z: float32
    eager on the CPU, exact to float32), where TF32 products were 1e-4-7e-3 off (the 1 x 1 dW,
    a batch sum that cancels: up to 190x the float32 tolerance on an H200). A control MLP
    without one-wide layers stays TF32 (its copies made, its gradients ~1e-4 off)."""
    tf32(True)
    for w, b, expect_full in ((widths, B, True), ((13, 40, 9), 33, False)):
        L = len(w) - 1
        x, ws, bs, zs, g = _case(w, b, acts, torch.float32, seed=3)
        needs = (True,) * (1 + 2 * L)
        p = fb.plan(w, torch.float32, x.device, b, (True,) * L, acts, needs)
        assert (p.copies == []) == expect_full
        gx, gws, gbs = fb.backward(g, x, ws, [True] * L, zs, *acts, needs)
        want = _float64(x, ws, bs, acts, g)
        errs = [float((a.double() - r).abs().max() / r.abs().max()) for a, r in zip([gx, *gws, *gbs], want)]
        assert all(e < 1e-5 for e in errs) if expect_full else max(errs) > 2e-5, (w, errs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("acts", [("relu", "sigmoid"), ("relu", "relu"), ("gelu", "relu")], ids="/".join)
def test_relu_outputs_saved_by_eager_serve_every_backward_as_z_does(monkeypatch, dtype, acts):
    """eager(save=True) keeps a ReLU layer's output relu(z), as a kernel's forward does
    (test_forward_save_keeps_a_relu_layers_output), in z's place (x with negative entries:
    many z < 0). From either, backward_lean, reference.backward and the
    fused backward give bitwise the same gradients; with `outputs`, backward_lean takes a
    ReLU layer's entry as the next layer's input instead of recomputing relu(z)."""
    widths, B = (13, 37, 20, 5), 33
    x, ws, bs = fm.make_inputs("cpu", dtype, B, widths, seed=3)
    g = torch.randn(B, widths[-1], generator=torch.Generator().manual_seed(4)).to(dtype)
    zs = _pre_activations(x, ws, bs, acts)
    _, kept = ref.eager(x, ws, bs, *acts, save=True)
    for i, (z, k) in enumerate(zip(zs, kept)):
        a = ref.layer_act(i, len(ws), *acts)
        assert torch.equal(k, torch.relu(z) if a == "relu" else z)
        assert a != "relu" or bool((z < 0).any())  # (the two differ)
    hb, needs = [True] * 3, (True,) * 7
    flat = lambda r: [r[0], *r[1], *r[2]]  # noqa: E731
    want = flat(ref.backward_lean(g, x, ws, hb, zs, *acts, needs))
    calls = []
    real_act = ref.act
    monkeypatch.setattr(ref, "act", lambda z, name: calls.append(name) or real_act(z, name))
    got = flat(ref.backward_lean(g, x, ws, hb, kept, *acts, needs, outputs=True))
    assert "relu" not in calls and (acts[0] != "gelu" or calls)  # gelu's input is still recomputed
    monkeypatch.setattr(ref, "act", real_act)
    for k, (w, gt) in enumerate(zip(want, got)):
        assert torch.equal(w, gt), k
    for f in (lambda s: ref.backward_lean(g, x, ws, hb, s, *acts, needs),
              lambda s: ref.backward(g, x, ws, bs, s, *acts),
              lambda s: fb.backward(g, x, ws, hb, s, *acts, needs)):
        from_z, from_kept = flat(f(zs)), flat(f(kept))
        assert all(torch.equal(a, b) for a, b in zip(from_z, from_kept))
