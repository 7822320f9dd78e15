"""fused_mlp: the Triton kernels under the interpreter on CPU (forward and every gradient
against float64 at awkward widths and B), the op and its autograd, kgen.nn.FusedMLP, bad
inputs; the `gpu` tests run every variant, dispatch, CUDA graphs and torch.compile."""

import pytest
import torch
from torch import nn

import kgen.ops as ops
from kgen.runtime.memo import CallMemo
from kgen.families import fused_mlp as fm
from kgen.nn import FusedMLP
from kgen.runtime import dispatch
from tests.conftest import requires_nvcc

SPEC = dispatch.shipped_spec("fused_mlp")
TOL = SPEC.numerics
ACT_PAIRS = (("relu", "none"), ("sigmoid", "sigmoid"), ("gelu", "relu"), ("silu", "gelu"), ("none", "silu"))


def _module(name):
    return dispatch.load(SPEC.variant(name)).module


# ------------------------------------------------------------------ CPU: kernels under the interpreter

# one variant of each kind (exact top, exact bottom, generic) per dtype
CPU_VARIANTS = ("triton_367x512x256x1_m32_k64_w8_bf16", "triton_13x512x256x64x16_m64_k64_w8_f32",
                "triton_mw4096_m32_k64_w4_bf16", "triton_mw4096_m64_k64_w4_f32", "triton_13x512x256x64x16_m32_k64_w8_f16")


@pytest.mark.parametrize("name", CPU_VARIANTS)
def test_golden_forward(name):
    """Forward against float64 at B 1, 3, 129, every activation pair, biases on and off
    (generic variants at awkward widths with one-wide layers, 1000 and 5 layers), into a
    NaN-poisoned output."""
    v = SPEC.variant(name)
    k = dispatch.load(v)
    if not v.params["widths"]:  # the interpreter is slow: the generic widths at B 1 and 129 only
        fm.op.GOLDEN_B, saved = (1, 129), fm.op.GOLDEN_B
    try:
        res = fm.golden(k, "cpu", v.dtype, TOL[v.dtype])
    finally:
        if not v.params["widths"]:
            fm.op.GOLDEN_B = saved
    assert res and all(r <= 1 for _, r in res), [c for c in res if c[1] > 1]


@pytest.mark.parametrize("name,widths", [("triton_367x512x256x1_m32_k64_w8_bf16", (367, 512, 256, 1)),
                                         ("triton_13x512x256x64x16_m64_k64_w8_f32", (13, 512, 256, 64, 16)),
                                         ("triton_mw4096_m32_k64_w4_f32", (13, 1000, 1)),
                                         ("triton_mw4096_m32_k64_w4_bf16", (1, 37, 3))])
@pytest.mark.parametrize("acts", ACT_PAIRS)
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_vs_float64(name, widths, acts, bias):
    v = SPEC.variant(name)
    B = 3 if acts[0] != "relu" else 129
    res = fm.grad_check(_module(name), "cpu", getattr(torch, v.dtype), B, widths, *acts, bias=bias, tol=TOL[v.dtype])
    # Within the tolerance, or within a multiple of eager PyTorch's own error in the dtype:
    # in 16-bit dtypes ReLU's mask flips wherever a rounded z lands on the other side of 0
    # (each flip moves a weight gradient by one row's whole contribution), and the
    # interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest, a bias that
    # compounds through the layers: 4x here, 2x in the GPU test.
    k = 4 if v.dtype != "float32" else 2
    assert all(r <= max(1.0, k * e) for _, r, e in res), res


def _nan_like_eager(name, device):
    """A NaN in a row of x gives that row NaN outputs through ReLU hidden layers (fmaxf /
    tl.maximum would make it 0 and the row finite), and NaN gradients where eager autograd's
    are; the other rows as eager's."""
    v = SPEC.variant(name)
    widths = v.params["widths"] or (13, 40, 7)
    x, ws, bs = fm.make_inputs(device, getattr(torch, v.dtype), 5, widths)
    x[0, 3] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (x, *ws, *bs)]
    L = len(ws)
    with fm.using(_module(name)):
        out = ops.fused_mlp(leaves[0], leaves[1:1 + L], leaves[1 + L:], activation="relu", last_activation="relu")
        out.sum().backward()
    eager = [t.clone().requires_grad_() for t in (x, *ws, *bs)]
    ref = fm.eager(eager[0], eager[1:1 + L], eager[1 + L:], "relu", "relu")[0]
    ref.sum().backward()
    assert torch.isnan(out[0]).all() and torch.equal(torch.isnan(out), torch.isnan(ref))
    tol = TOL[v.dtype]
    torch.testing.assert_close(out[1:].float(), ref[1:].float(), rtol=tol.rtol, atol=tol.atol)
    for a, b in zip(leaves, eager):
        assert torch.equal(torch.isnan(a.grad), torch.isnan(b.grad))


@pytest.mark.parametrize("name", CPU_VARIANTS[1:4])
def test_nan_like_eager(name):
    _nan_like_eager(name, "cpu")


# User-spec exact widths whose plans take every path (schema.plan): a layer too wide for
# registers feeding another (scratch, twice in a row: the two buffers alternate), a wide
# layer absorbed by the next, a chunked layer on a register input, one whole dot, a
# one-layer MLP, one-wide layers.
PLAN_CASES = {
    (13, 300, 290, 270, 5): [("chunked", "x", "scratch"), ("chunked", "scratch", "scratch"),
                             ("chunked", "scratch", "absorb")],
    # a scratch buffer written again at another width (300, then 280)
    (13, 300, 290, 280, 270, 5): [("chunked", "x", "scratch"), ("chunked", "scratch", "scratch"),
                                  ("chunked", "scratch", "scratch"), ("chunked", "scratch", "absorb")],
    (20, 300, 100, 600, 3): [("chunked", "x", "absorb"), ("chunked", "reg", "absorb")],
    (5, 20, 30, 600): [("chunked", "x", "absorb"), ("chunked", "reg", "out")],
    (5, 20, 30, 7): [("chunked", "x", "absorb"), ("whole", "reg", None)],
    (1, 5): [("chunked", "x", "out")],
    # padded weights (schema.weight_strides, float32): W1 [127, 130] absorbed at stride 132,
    # its K mask past the stride (130 columns in 64-wide chunks); (13, 300, 290, ...)'s W2 at 292
    (5, 130, 127, 3): [("chunked", "x", "absorb"), ("whole", "reg", None)],
}


def _user_variant(widths, dtype="float32", split=1):
    from kgen import spec

    s = spec.parse(f"family: fused_mlp\nvariants:\n  - backend: triton\n    widths: {list(widths)}\n"
                   f"    block_m: 16\n    block_k: 64\n    num_warps: 4\n    dtypes: [{dtype}]\n    split: {split}\n")
    (v,) = s.variants
    return v


def test_scratch_rows_one_stride_apart():
    """A scratch region is only ever written at one row width, so that each program's rows
    are its own at every layer: the exact kernels' scratch rows SCRATCH_WIDTH apart, the
    generic kernel's hidden layers in regions of their own width (launch.hidden_regions),
    never the region their input is in. A buffer written again by a narrower layer put a
    program's rows onto other programs' wider rows, which the GPU ran concurrently (wrong
    rows at random; test_gpu_generic_scratch_rows_are_each_programs_own)."""
    import re

    from kgen.render import render

    exact = render(_user_variant((13, 300, 290, 280, 270, 5))).text
    width = int(re.search(r"^SCRATCH_WIDTH = (\d+)", exact, re.M).group(1))
    strides = re.findall(r"s[01]_ptr \+ rows\[:, None\] \* (\w+)", exact)
    assert width == 300 and len(strides) >= 6 and set(strides) == {str(width)}, strides
    for widths in ((13, 512, 256, 64, 16), (5, 100, 100, 100, 100, 3), (5, 100, 200, 100, 200, 100, 3),
                   (3, 64, 128, 64, 128, 64, 32, 16, 2), (13, 1), (1, 37, 3)):
        regions, rows = fm.launch.hidden_regions(widths)
        hidden = widths[1:-1]
        assert [w for _, w in regions] == list(hidden) and rows <= sum(hidden)
        written = {}
        for i, (at, w) in enumerate(regions):
            assert written.setdefault(at, w) == w, (widths, i)  # one width a region
            assert at + w <= rows and (i == 0 or at != regions[i - 1][0])  # not its input's region
            assert all(a + v <= at or at + w <= a for a, v in regions if a != at)  # regions apart
    assert fm.launch.hidden_regions((5, 100, 100, 100, 100, 3))[1] == 200  # equal widths: two regions


@pytest.mark.parametrize("widths", list(PLAN_CASES), ids=lambda w: "x".join(map(str, w)))
@pytest.mark.parametrize("tf32", [True, False])
def test_exact_plans_golden(widths, tf32):
    """Every kind of step an exact variant's plan has, against float64 (every activation
    pair, biases on and off, B 1, 3, 129, poisoned outputs), and the plan is the one named;
    float32 with TF32 on runs the variant's main kernel, with it off its "tf32x3" one (its
    own plan: 32-column chunks, 128-column register tiles)."""
    v = _user_variant(widths)
    main, x3 = fm.schema.kernels(widths, 64, "float32")
    assert [(s["kind"], s["src"], s.get("sink")) for s in main["steps"]] == PLAN_CASES[widths]
    assert dispatch.load(v).module.WEIGHT_STRIDES == list(fm.schema.weight_strides(widths, 4))
    assert x3["name"] == "fused_mlp_fwd_kernel_x3"
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        assert fm.launch.precision(torch.float32) == ("tf32" if tf32 else "tf32x3")
        res = fm.golden(dispatch.load(v), "cpu", "float32", TOL["float32"])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert len(res) == 15 and all(r <= 1 for _, r in res), [c for c in res if c[1] > 1]


# (widths, dtype, split): layer 0's 64-column chunks shared unevenly (300 columns: 5 chunks, the
# last one masked, over 3 programs: 1, 2, 2), and the chain after the split through a scratch
# layer and a one-wide last layer; the DLRM top MLP as shipped
SPLIT_CASES = [((13, 300, 100, 600, 3), "float32", 3), ((40, 200, 48, 1), "bfloat16", 4),
               ((367, 512, 256, 1), "float16", 8)]


@pytest.mark.parametrize("widths,dtype,split", SPLIT_CASES, ids=lambda c: str(c).replace(", ", "-"))
def test_split_variants_golden_and_reproducible(widths, dtype, split):
    """A split variant (layer 0's columns over `split` programs a row tile, the last to arrive
    summing their float32 partials of layer 1 in order) against float64 (every activation pair,
    biases on and off, B 1, 3, 129, poisoned outputs); launched twice the same bits, its row
    tiles' counters back at zero after each launch, and with `save` the same output and every
    layer's z within one rounding of the unsplit variant's."""
    v, whole = _user_variant(widths, dtype, split), _user_variant(widths, dtype)
    mod = dispatch.load(v).module
    assert mod.SPLITS["fused_mlp_fwd_kernel"] == split
    if widths[0] != 367:  # (the shipped top MLP: its golden run is the GPU test's; here one B)
        res = fm.golden(dispatch.load(v), "cpu", dtype, TOL[dtype])
        assert len(res) == 15 and all(r <= 1 for _, r in res), [c for c in res if c[1] > 1]
    t = getattr(torch, dtype)
    x, ws, bs = fm.make_inputs("cpu", t, 37, widths)
    outs = []
    for _ in range(2):
        out, zs, launches, _, counters = fm.launch._plan(mod, x, ws, bs, "relu", "sigmoid", True, None)
        assert launches[-1][1] == (3, split)  # (37 rows: 3 row tiles of 16)
        out.fill_(float("nan"))
        for launch in launches:
            fm.launch.triton_launch.launch(*launch)
        assert counters.shape == (3,) and not counters.any()
        outs.append((out, zs))
    (a, za), (b, zb) = outs
    assert torch.equal(a, b) and all(torch.equal(p, q) for p, q in zip(za, zb) if p is not None)
    ref, zr = fm.launch.forward(dispatch.load(whole).module, x, ws, bs, "relu", "sigmoid", save=True)
    ulp = {"float32": 2.0 ** -20, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}[dtype]  # one rounding, relative
    for got, want in zip([a, *za], [ref, *zr]):
        if want is not None:  # (partials summed in another order than one accumulator's: a z may round apart)
            assert ((got.float() - want.float()).abs() <= ulp * want.float().abs().clamp_min(1.0)).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_row_padded_weight_read_in_place_whatever_its_padding(dtype):
    """A weight the exact kernel reads at a wider row stride (DLRM top's 367-wide W0: 368),
    given already laid out at that stride, is read in place -- no pad launch -- with the same
    bits as the contiguous one padded by the op; NaN in its padding changes nothing (the
    kernel's masks stop at the width). Float32 with TF32 on copies every weight (rounded)
    anyway. Any other layout is copied to a contiguous one first."""
    from kgen.families.fused_mlp import launch

    t = getattr(torch, dtype)
    name = "triton_367x512x256x1_m16_k64_w4_sp4_" + ("bf16" if dtype == "bfloat16" else "f32")
    mod = dispatch.load(SPEC.variant(name)).module
    x, ws, bs = fm.make_inputs("cpu", t, 19, (367, 512, 256, 1))
    store = torch.full((512, 368), float("nan"), dtype=t)
    store[:, :367] = ws[0]
    padded = [store[:, :367], *ws[1:]]
    assert launch.readable(mod, x, padded)[0] is padded[0]
    _, _, launches, _, _ = launch._plan(mod, x, padded, bs, "relu", "sigmoid", False, None)
    assert [fn.__name__ for fn, *_ in launches] == [  # (TF32 off on the CPU: float32's "tf32x3" kernel)
        "fused_mlp_fwd_kernel" + ("_x3" if dtype == "float32" else "")]
    got = launch.forward(mod, x, padded, bs, "relu", "sigmoid")[0]
    want = launch.forward(mod, x, ws, bs, "relu", "sigmoid")[0]
    assert torch.equal(got, want) and not got.isnan().any()
    if dtype == "float32":  # TF32 on: every weight goes to a rounded copy, read from a contiguous one
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            assert launch.readable(mod, x, padded)[0].is_contiguous()
            assert torch.equal(launch.forward(mod, x, padded, bs, "relu", "sigmoid")[0],
                               launch.forward(mod, x, ws, bs, "relu", "sigmoid")[0])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    strided = ws[0].t().contiguous().t()  # column-major: copied, then padded by the op
    assert launch.readable(mod, x, [strided, *ws[1:]])[0].is_contiguous()
    assert torch.equal(launch.forward(mod, x, [strided, *ws[1:]], bs, "relu", "sigmoid")[0], want)


def test_split_knob_errors():
    """`split` applies to exact variants whose layer 0 streams into layer 1's accumulator in
    at least `split` column chunks: a clear spec error otherwise."""
    from kgen import spec
    from kgen.errors import KgenError

    def parse(body):
        return spec.parse("family: fused_mlp\nvariants:\n  - backend: triton\n    block_m: 16\n    block_k: 64\n"
                          f"    num_warps: 4\n{body}")

    with pytest.raises(KgenError, match="split.*exact variants"):
        parse("    max_width: 256\n    split: 2\n")
    with pytest.raises(KgenError, match="split 2 needs layer 0 .13 -> 300. streamed.*to scratch"):
        parse("    widths: [13, 300, 290, 270, 5]\n    split: 2\n")
    with pytest.raises(KgenError, match="split 4 needs .* at least 4 column chunks; it has 3 column chunk"):
        parse("    widths: [20, 150, 30]\n    split: 4\n")
    assert [v.name for v in parse("    widths: [20, 150, 30]\n    split: 3\n    dtypes: [bfloat16]\n").variants] == [
        "triton_20x150x30_m16_k64_w4_sp3_bf16"]


@pytest.mark.parametrize("kind", ["exact", "generic"])
def test_float32_one_wide_layers_keep_float32_accuracy_with_tf32_on(kind):
    """Float32 with TF32 on: a layer with an input or output width of 1 (schema.TF32_FULL_MAX)
    is computed to float32's accuracy, as torch.matmul's cuBLAS kernels compute it at every
    B; the others (37 -> 70, 40 -> 5) in TF32, as cuBLAS's usually are. The exact plan has
    all three forms: an absorbed dot (70 -> 1), a whole register tile's dot (1 -> 40), its
    row reductions (5 -> 1). Each saved entry (a ReLU layer's output relu(z)) against a
    float64 layer on kgen's own input to it (the entry before), ReLU'd alike: a
    float32 sum of <= 70 products is within 1e-5 of the largest |z|; a TF32 one is ~1e-4 off
    (10-bit mantissa operands), as the one-wide layers were (ReLU is 1-Lipschitz)."""
    widths = (37, 70, 1, 40, 5, 1)
    mod = dispatch.load(_user_variant(widths)).module if kind == "exact" else _module("triton_mw4096_m32_k64_w4_f32")
    x, ws, bs = fm.make_inputs("cpu", torch.float32, 131, widths, seed=7)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        out, zs = fm.forward(mod, x, ws, bs, "relu", "relu", save=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    errs = []
    for i, (w, b, z) in enumerate(zip(ws, bs, zs)):
        h = x if i == 0 else zs[i - 1]
        ref = torch.nn.functional.linear(h.double(), w.double(), b.double())
        kept = torch.relu(ref)
        errs.append(float((z.double() - kept).abs().max() / ref.abs().max()))
    full = [min(widths[i], widths[i + 1]) <= fm.schema.TF32_FULL_MAX for i in range(len(ws))]
    assert full == [False, True, True, False, True]
    assert all((e <= 1e-5) == f for e, f in zip(errs, full)), errs
    torch.testing.assert_close(out, zs[-1], rtol=0, atol=0)


def test_exact_plan_bf16_scratch_and_save():
    """bfloat16 through the scratch and absorb paths: the output and every saved z equal
    the eager composition's (the same roundings; the interpreter's dots are float32 sums,
    so up to one bf16 ulp where a sum's order differs)."""
    widths = (13, 300, 290, 270, 5)
    mod = dispatch.load(_user_variant(widths, "bfloat16")).module
    assert mod.SCRATCH_WIDTH == 300  # layers 0 and 1 go to scratch
    x, ws, bs = fm.make_inputs("cpu", torch.bfloat16, 37, widths, bias=[True, False, True, True])
    out, zs = fm.forward(mod, x, ws, bs, "silu", "gelu", save=True)
    ref_out, ref_zs = fm.eager(x, ws, bs, "silu", "gelu", save=True)
    torch.testing.assert_close(out, ref_out, rtol=2 ** -7, atol=2 ** -7)
    assert len(zs) == len(ref_zs) == 4
    for z, r in zip(zs, ref_zs):
        torch.testing.assert_close(z, r, rtol=2 ** -7, atol=2 ** -7)


def test_dlrm_plans():
    """The shipped DLRM variants: the 512-wide layer streamed into the 256-wide one's
    accumulator, then whole register tiles, no scratch (the SCRATCH_WIDTH of float32
    variants is their TF32-off kernel's). float32 with TF32 off (128-column
    register tiles at most): the 512-wide layer through the scratch, the 256-wide one
    streamed into the next."""
    top = fm.schema.plan((367, 512, 256, 1), 64, 2)
    assert [(s["kind"], s["src"], s.get("sink")) for s in top] == [("chunked", "x", "absorb"), ("whole", "reg", None)]
    bottom = fm.schema.plan((13, 512, 256, 64, 16), 64, 2)
    assert [(s["kind"], s["src"], s.get("sink")) for s in bottom] == [
        ("chunked", "x", "absorb"), ("whole", "reg", None), ("whole", "reg", None)]
    # the input row tile loaded once (bf16: 384 columns x 2 B) before the column loop, its
    # K chunks unrolled; float32 (1536 B a row) keeps the K loop
    assert top[0]["unroll"] and len(top[0]["k_chunks"]) == 6
    top32, top_x3 = fm.schema.kernels((367, 512, 256, 1), 64, "float32")
    assert [(s["kind"], s["src"], s.get("sink")) for s in top32["steps"]] == [("chunked", "x", "absorb"),
                                                                               ("whole", "reg", None)]
    assert not top32["steps"][0]["unroll"]
    assert [(s["kind"], s["src"], s.get("sink")) for s in top_x3["steps"]] == [
        ("chunked", "x", "scratch"), ("chunked", "scratch", "absorb")]
    for v in SPEC.variants:
        if v.params["widths"] and v.backend == "triton":  # (the CUDA ones: test_cuda_plan_and_checks)
            assert _module(v.name).SCRATCH_WIDTH == (512 if v.dtype == "float32" else 0), v.name


def _kernels(mod):
    return [getattr(mod, n) for n in ("fused_mlp_fwd_kernel", "fused_mlp_fwd_kernel_x3") if hasattr(mod, n)]


def _kernel_signature(f):
    import inspect

    fn = getattr(f, "fn", f)
    constexprs = [n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)]
    dns = f.do_not_specialize if hasattr(f, "do_not_specialize") else f.kwargs.get("do_not_specialize")
    return constexprs, list(dns or [])


@pytest.mark.parametrize("name", [v.name for v in SPEC.variants if v.dtype != "float16" and v.backend == "triton"])
def test_one_compile_serves_every_call(name):
    """What Triton compiles a kernel for: activations, biases, `save` and B are runtime
    values it does not specialise on (B = 1, multiples of 16 and each activation pair were
    each one more 5-25 s JIT compile); only the precision, the tile and (generic) the widths
    are constexprs. float32 exact variants: two kernels (TF32 on, off)."""
    kernels = _kernels(_module(name))
    exact = bool(SPEC.variant(name).params["widths"])
    assert len(kernels) == (2 if exact and name.endswith("_f32") else 1)
    for f in kernels:
        constexprs, dns = _kernel_signature(f)
        assert set(dns) == {"B", "bias_mask", "act", "last_act", "save"}
        if exact:
            assert constexprs == ["PRECISION", "BLOCK_M"]
        else:
            assert set(constexprs) == {*(f"D{i}" for i in range(fm.MAX_LAYERS + 1)), "NUM_LAYERS", "PRECISION",
                                       "BLOCK_M", "BLOCK_K", "NUM_STAGES"}


_AOT_SCRIPT = """
import json, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kgen import config, spec
from kgen.families.fused_mlp import schema
from kgen.runtime import build, dispatch, toolchain

config.pin_triton_defaults()
variants = [v for v in dispatch.shipped_spec("fused_mlp").variants
            if v.backend == "triton" and bool(v.params["widths"]) != (sys.argv[2:] == ["generic"])]
for w in json.loads(sys.argv[1]):
    variants += spec.parse("family: fused_mlp\\nvariants:\\n  - backend: triton\\n    widths: %s\\n    block_m: 16\\n"
                           "    block_k: 64\\n    num_warps: 4\\n    dtypes: [float32]\\n" % w).variants
tmp = Path(tempfile.mkdtemp())
for v in variants:
    for fn, sig, const, opts in schema.triton_aot(v, dispatch.load(v).module):
        c = triton.compile(ASTSource(fn, sig, const, build._divisibility(fn, sig)),
                           target=GPUTarget("cuda", 90, 32), options=opts)
        (tmp / "k.cubin").write_bytes(c.asm["cubin"])
        (usage,) = toolchain.resource_usage(tmp / "k.cubin").values()
        print(json.dumps({"name": v.name, "kernel": fn.__name__, "precision": const.get("PRECISION"), **usage,
                          "shared": int(c.metadata.shared)}))
"""


@pytest.mark.aot
def test_generic_variants_compile_without_spills():
    """Every shipped generic variant compiles ahead of time for sm_90 at the DLRM bottom
    MLP's widths (schema.triton_aot), each dtype, with no spills: the interpreter runs
    kernels Triton's compiler refuses. Versions refuse different things: Triton 3.6 makes
    `tl.maximum(bf16 z, 0.0)` float32 and refused an `if` that redefined z with it, where
    3.9 keeps bf16 and took it (CI runs the `aot` tests under 3.6 too: .ci/run)."""
    import json
    import os
    import subprocess
    import sys

    generic = {v.name for v in SPEC.variants if not v.params["widths"] and v.backend == "triton"}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, "[]", "generic"], capture_output=True, text=True, env=env,
                       cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    kernels = [row for row in rows if row["kernel"] == "fused_mlp_fwd_kernel"]
    assert {row["name"] for row in kernels} == generic and len(kernels) == len(generic)
    assert all(row["local"] == 0 and row["shared"] <= 227 * 1024 for row in rows), rows


@pytest.mark.aot
def test_exact_variants_compile_without_stack_or_spills():
    """Every shipped exact-width variant, and the variants of PLAN_CASES (as the golden test
    runs them), compile ahead of time for sm_90 (in a process that does not interpret Triton:
    the interpreter does not check what Triton's compiler does, e.g. a loop-carried tile's
    shape) with no spills, within sm_90's 227 KB of shared memory, and (the shipped ones)
    no stack; float32: both kernels (TF32 on; off, "tf32x3", which splits every operand) and the
    TF32-rounded weight copies launched first. The unrolled kernels before had 255 registers
    and 336-1712 B stacks."""
    import json
    import os
    import subprocess
    import sys

    exact = [v.name for v in SPEC.variants if v.params["widths"] and v.backend == "triton"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    cases = json.dumps([list(w) for w in PLAN_CASES])
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, cases], capture_output=True, text=True, env=env, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    pads = [row for row in rows if row["kernel"] == "pad_rows_kernel"]
    copies = [row for row in rows if row["kernel"] == "tf32_weights_kernel"]
    rows = [row for row in rows if row["kernel"] not in ("pad_rows_kernel", "tf32_weights_kernel")]
    # the weight pads: the shipped top-MLP variants reading a 368-wide copy of W0 (all but m128)
    assert {row["name"] for row in pads if row["name"] in exact} == {
        n for n in exact if n.startswith("triton_367x") and SPEC.variant(n).params["align"]}
    assert all(row["local"] == 0 and row["stack"] == 0 for row in pads), pads
    f32 = [n for n in exact if n.endswith("_f32")]
    # float32's TF32-rounded weight copies (every float32 variant; the PLAN_CASES are float32)
    assert sorted(row["name"] for row in copies if row["name"] in exact) == sorted(f32)
    assert len(copies) == len(f32) + len(PLAN_CASES)
    assert all(row["local"] == 0 and row["stack"] == 0 for row in copies), copies
    assert len(rows) == len(exact) + len(f32) + 2 * len(PLAN_CASES), rows
    assert {(row["name"], row["precision"]) for row in rows} >= {(n, p) for n in f32 for p in ("tf32", "tf32x3")}
    for row in rows:  # a user's plans at 16-row tiles may keep a few bytes of stack (8 B seen)
        assert row["local"] == 0 and row["shared"] <= 227 * 1024, row
        assert row["stack"] == 0 or row["name"] not in exact, row


def _eager_rows_apart(x, ws, bs, acts):
    """fm.eager(x, ..., save=True) computed for each row apart from the others: torch's CPU
    bf16 GEMM on some CPUs (torch 2.13, AVX512) makes the row beside a NaN one NaN too
    (F.linear of a [45, 19] x with x[3, 0] = NaN: rows 2 and 3), which no row-wise kernel does."""
    rows = [fm.eager(x[i:i + 1], ws, bs, *acts, save=True) for i in range(x.shape[0])]
    outs = torch.cat([r[0] for r in rows])
    zs = [None if rows[0][1][i] is None else torch.cat([r[1][i] for r in rows]) for i in range(len(rows[0][1]))]
    return outs, zs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["exact", "generic"])
def test_forward_save_keeps_a_relu_layers_output(kind, dtype):
    """With `save`, a kernel keeps a ReLU layer's output relu(z) in z's place, as the eager
    composition does (reference.eager; the backward's next-layer input and dz mask), and z
    for other activations (x with negative entries: many z < 0).
    Each entry against eager's (float32: 1e-5, other summation orders; bf16: one ulp where
    an interpreted float32 sum rounds the other way); a ReLU entry is never negative, a NaN
    stays NaN (max.NaN, as torch.relu). backward_lean takes the kernel's entries as outputs
    (`outputs`) with bitwise the gradients it gives recomputing relu from them."""
    import sys

    fmref = sys.modules["kgen.families.fused_mlp.reference"]  # (the package exports a function of that name)
    widths = (19, 37, 20, 5)
    name = {torch.float32: "triton_mw4096_m32_k64_w4_f32", torch.bfloat16: "triton_mw4096_m32_k64_w4_bf16"}[dtype]
    mod = dispatch.load(_user_variant(widths, str(dtype).split(".")[1])).module if kind == "exact" else _module(name)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}[dtype]
    for acts in (("relu", "sigmoid"), ("relu", "relu"), ("silu", "none")):
        x, ws, bs = fm.make_inputs("cpu", dtype, 45, widths, seed=11)
        x[3, 0] = float("nan")  # row 3's every z NaN
        out, zs = fm.forward(mod, x, ws, bs, *acts, save=True)
        ref_out, ref_zs = _eager_rows_apart(x, ws, bs, acts)
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol, equal_nan=True)
        for i, (z, r) in enumerate(zip(zs, ref_zs)):
            if z is None:  # (only where the backward needs none: the last layer, no activation)
                assert i == len(ws) - 1 and acts[1] == "none"
                continue
            torch.testing.assert_close(z, r, rtol=tol, atol=tol, equal_nan=True)
            assert bool(z[3].isnan().all())
            relu = fmref.layer_act(i, len(ws), *acts) == "relu"
            assert bool((z.nan_to_num() < 0).any()) != relu, (acts, i)
        # the gradients of the rows after the NaN one
        g = torch.randn(41, widths[-1], generator=torch.Generator().manual_seed(2)).to(dtype)
        rest = [None if z is None else z[4:] for z in zs]
        needs = (True,) * 7
        flat = lambda r: [r[0], *r[1], *r[2]]  # noqa: E731
        kept = flat(fmref.backward_lean(g, x[4:], ws, [True] * 3, rest, *acts, needs, outputs=True))
        recomputed = flat(fmref.backward_lean(g, x[4:], ws, [True] * 3, rest, *acts, needs))
        assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))


def test_generic_partial_biases_and_save():
    """Layers with and without a bias in one call; the saved z equal the eager composition's."""
    mod = _module("triton_mw4096_m32_k64_w4_f32")
    x, ws, bs = fm.make_inputs("cpu", torch.float32, 5, (13, 33, 7, 2), bias=[True, False, True])
    out, zs = fm.forward(mod, x, ws, bs, "gelu", "sigmoid", save=True)
    ref_out, ref_zs = fm.eager(x, ws, bs, "gelu", "sigmoid", save=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for z, r in zip(zs, ref_zs):
        torch.testing.assert_close(z, r, rtol=1e-5, atol=1e-6)


def test_op_uses_variant_and_autograd():
    """The op through a forced Triton module: forward and gradients equal the eager path's."""
    x, ws, bs = fm.make_inputs("cpu", torch.float32, 3, (13, 512, 256, 64, 16))
    leaves = [t.clone().requires_grad_() for t in (x, *ws, *bs)]
    with fm.using(_module("triton_13x512x256x64x16_m64_k64_w8_f32")):
        out = ops.fused_mlp(leaves[0], leaves[1:5], leaves[5:], activation="silu", last_activation="sigmoid")
        out.sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (x, *ws, *bs)]
    ref = fm.eager(ref_leaves[0], ref_leaves[1:5], ref_leaves[5:], "silu", "sigmoid")[0]
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ CPU: the op (eager composition)


def test_fused_mlp_module_matches_sequential_and_round_trip():
    seq = nn.Sequential(nn.Linear(13, 20), nn.GELU(approximate="tanh"), nn.Identity(), nn.Linear(20, 7),
                        nn.GELU(approximate="tanh"), nn.Sequential(nn.Linear(7, 1), nn.Sigmoid()))
    m = FusedMLP.from_sequential(seq)
    assert m.widths == (13, 20, 7, 1) and m.activation == "gelu" and m.last_activation == "sigmoid"
    x = torch.randn(4, 2, 13)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = m(x1), seq(x2)
    assert y1.shape == (4, 2, 1)
    torch.testing.assert_close(y1, y2)
    y1.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(m.weights[1].grad, seq[3].weight.grad)
    torch.testing.assert_close(m.biases[2].grad, seq[5][0].bias.grad)
    back = m.to_sequential()
    torch.testing.assert_close(back(x), y2.detach())
    m2 = FusedMLP.from_sequential(back)
    torch.testing.assert_close(m2(x), y2.detach())


def test_fused_mlp_module_pad_weights_layout_survives_to_and_state_dict(monkeypatch):
    """pad_weights=True: the DLRM top MLP's W0 (367 wide, the one weight the exact kernels
    read at a wider stride) in row-padded storage, rows 368 apart, its shape and values
    nn.Linear's; the others dense. Kept through .to() (a dtype of another itemsize too) and
    load_state_dict; its state_dict loads into nn.Linear; outputs and gradients equal the
    dense module's, the gradients dense (what optimizers and DDP expect). Off by default.
    (The layout is made on CUDA only: "cpu" added to PAD_DEVICES runs its bookkeeping here.)"""
    from kgen.families.fused_mlp import module as fm_module

    monkeypatch.setattr(fm_module, "PAD_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    dense = FusedMLP([367, 512, 256, 1], last_activation="sigmoid")
    padded = FusedMLP([367, 512, 256, 1], last_activation="sigmoid", pad_weights=True)
    assert all(w.is_contiguous() for w in dense.weights) and "pad_weights" not in repr(dense)
    assert "pad_weights=True" in repr(padded)
    padded.load_state_dict(dense.state_dict())
    w0 = padded.weights[0]
    assert w0.shape == (512, 367) and w0.stride() == (368, 1) and isinstance(w0, nn.Parameter)
    assert all(w.is_contiguous() for w in list(padded.weights)[1:])
    assert torch.equal(w0, dense.weights[0])
    for t in (torch.bfloat16, torch.float64, torch.float32):
        padded.to(t)
        dense.to(t)
        assert padded.weights[0] is w0 and w0.dtype == t and w0.stride() == (368, 1)
        assert torch.equal(w0, dense.weights[0])
    lin = nn.Linear(367, 512)
    lin.load_state_dict({"weight": padded.state_dict()["weights.0"], "bias": padded.state_dict()["biases.0"]})
    assert torch.equal(lin.weight, w0)
    x = torch.randn(5, 367)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = padded(xa), dense(xb)
    assert torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    assert torch.equal(xa.grad, xb.grad) and w0.grad.is_contiguous()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(padded.parameters(), dense.parameters()))
    m = FusedMLP.from_sequential(padded.to_sequential(), pad_weights=True)
    assert m.weights[0].stride() == (368, 1) and torch.equal(m.weights[0], w0)
    import copy
    import pickle

    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert c.weights[0].stride() == (368, 1) and torch.equal(c.weights[0], w0) and c.pad_weights
    assert FusedMLP([13, 512, 256, 64, 16], pad_weights=True).weights[0].is_contiguous()  # 13 KB: not padded
    assert FusedMLP([1001, 64, 1], pad_weights=True).weights[0].is_contiguous()  # no exact variant: not padded
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    parametrize.register_parametrization(padded.weights, "0", Double())
    padded.to(torch.float64)  # a parametrized weight is left as it is
    assert torch.equal(padded.weights[0], 2 * padded.weights.parametrizations["0"].original)


def test_pad_weights_is_dense_on_the_cpu_and_fused_optimizers_step_it_right():
    """pad_weights=True lays weights out on CUDA only: a CPU module keeps them dense (PyTorch's
    CPU fused optimizer kernels take a padded weight as flat memory: Adam(fused=True) moved
    511 of W0's 512 rows wrongly, no error), and .cpu() of a padded module is dense again.
    Adam / AdamW / SGD with fused=True then step it as they step the dense module."""
    torch.manual_seed(0)
    x = torch.randn(8, 367)
    src = FusedMLP([367, 512, 256, 1], last_activation="sigmoid")
    for opt in (lambda p: torch.optim.Adam(p, lr=1e-2, fused=True), lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
                lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True)):
        pp = FusedMLP([367, 512, 256, 1], last_activation="sigmoid", pad_weights=True)
        dd = FusedMLP([367, 512, 256, 1], last_activation="sigmoid")
        assert pp.weights[0].is_contiguous()
        for m in (pp, dd):
            m.load_state_dict(src.state_dict())
            o = opt(m.parameters())
            for _ in range(2):
                o.zero_grad()
                m(x).sum().backward()
                o.step()
        assert all(torch.equal(a, b) for a, b in zip(pp.parameters(), dd.parameters()))


def test_module_reads_its_lists_in_index_order_and_runs_their_pre_hooks():
    """FusedMLP reads weights and biases in the lists' index order whatever their dicts' order
    (a parametrization removed with leave_parametrized=True registers "0" again at the end:
    W1 ran as layer 0, a wrong output and no error), and runs the lists' forward pre-hooks
    (torch.nn.utils.prune recomputes a pruned weight in one: the forward used a stale one)."""
    from torch.nn.utils import parametrize, prune

    torch.manual_seed(2)
    x = torch.randn(4, 6)

    def expected(m):
        w, b = list(m.weights), list(m.biases)
        return torch.relu(x @ w[0].T + b[0]) @ w[1].T + b[1]

    class Half(nn.Module):
        def forward(self, w):
            return 0.5 * w

    m = FusedMLP([6, 9, 3])
    parametrize.register_parametrization(m.weights, "0", Half())
    parametrize.remove_parametrizations(m.weights, "0", leave_parametrized=True)
    assert list(m.weights._parameters) == ["1", "0"]
    torch.testing.assert_close(m(x), expected(m))
    m = FusedMLP([6, 9, 3])
    prune.l1_unstructured(m.weights, name="0", amount=0.5)
    torch.testing.assert_close(m(x), expected(m))
    with torch.no_grad():
        m.weights.get_parameter("0_orig").mul_(3)  # the pruned weight follows its original
    want = torch.relu(x @ (m.weights.get_parameter("0_orig") * m.weights.get_buffer("0_mask")).T
                      + m.biases[0]) @ m.weights[1].T + m.biases[1]
    torch.testing.assert_close(m(x), want)
    m(x).sum().backward()
    assert m.weights.get_parameter("0_orig").grad is not None


def test_cuda_variant_row_stride():
    """cuda.row_stride: the row stride a CUDA variant reads a weight at: its width where
    contiguous, a row-padded one's own (16-byte multiple), else None (copied first)."""
    from kgen.families.fused_mlp import launch
    from kgen.families.fused_mlp.cuda import row_stride

    w = torch.randn(512, 367, dtype=torch.bfloat16)
    assert row_stride(w) == 367 and row_stride(launch.row_padded(w, 368)) == 368
    assert row_stride(torch.empty(512, 370, dtype=torch.bfloat16)[:, :367]) is None  # rows 740 bytes apart
    assert row_stride(w.t().contiguous().t()) is None
    assert row_stride(torch.empty(1, 9, dtype=torch.bfloat16)[:, :5]) == 5  # one row: contiguous


def test_fused_mlp_module_no_bias_and_dtype():
    m = FusedMLP([5, 6, 3], activation="relu", bias=False, dtype=torch.bfloat16)
    assert m.biases is None and m.weights[0].dtype == torch.bfloat16
    seq = m.to_sequential()
    assert seq[0].bias is None
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    torch.testing.assert_close(m(x), seq(x))


def test_fused_mlp_module_reads_its_parameters_as_they_are_now():
    """FusedMLP.forward reads its ParameterLists' dicts (not a __getattr__ per index): the
    parameters in index order after one is replaced, and through a parametrization (which
    moves a weight out of the dict: the list's own iteration then)."""
    from torch.nn.utils import parametrize

    from kgen.families.fused_mlp.module import _params

    m = FusedMLP([6, 9, 5, 3], activation="relu")
    x = torch.randn(4, 6)
    m.weights[1] = nn.Parameter(torch.randn(5, 9))  # replaced in place: still index 1
    m.biases[0] = nn.Parameter(torch.randn(9))
    assert all(a is b for a, b in zip(_params(m.weights), list(m.weights)))
    assert all(a is b for a, b in zip(_params(m.biases), list(m.biases)))
    torch.testing.assert_close(m(x), m.to_sequential()(x))

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    plain = m(x)
    parametrize.register_parametrization(m.weights, "2", Double())
    ws = _params(m.weights)
    assert [tuple(w.shape) for w in ws] == [(9, 6), (5, 9), (3, 5)]
    torch.testing.assert_close(ws[2], 2 * m.weights.parametrizations["2"].original)
    bs = list(m.biases)
    ref = torch.relu(torch.relu(x @ ws[0].T + bs[0]) @ ws[1].T + bs[1]) @ ws[2].T + bs[2]
    torch.testing.assert_close(m(x), ref)
    assert not torch.allclose(m(x), plain)


@pytest.mark.parametrize("seq,err,match", [
    (nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), TypeError, "Tanh"),
    (nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)), ValueError, "tanh form"),
    (nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.SiLU(), nn.Linear(2, 2)), ValueError, "different"),
    (nn.Sequential(nn.ReLU(), nn.Linear(3, 4)), ValueError, "does not follow"),
    (nn.Sequential(nn.Linear(3, 4), nn.Linear(5, 2)), ValueError, "feeds"),
    (nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False)), ValueError, "bias"),
    (nn.Sequential(), ValueError, "no nn.Linear"),
])
def test_from_sequential_errors(seq, err, match):
    with pytest.raises(err, match=match):
        FusedMLP.from_sequential(seq)


def test_from_sequential_not_sequential():
    with pytest.raises(TypeError, match="nn.Sequential"):
        FusedMLP.from_sequential(nn.Linear(3, 4))


class _Doubled(nn.Linear):  # a LoRA-like layer: nn.Linear's parameters, another function
    def forward(self, x):
        return 2 * super().forward(x)


class _Renamed(nn.Linear):  # nn.Linear's own forward (as nn.MultiheadAttention's out_proj)
    pass


def _hooked():
    lin = nn.Linear(3, 4)
    lin.register_forward_hook(lambda m, i, o: 2 * o)
    return lin


def test_from_sequential_refuses_what_it_would_compute_differently():
    """A conversion never silently computes another function: an nn.Linear subclass with a
    forward of its own, forward hooks (weight_norm's pre-hook too) and mixed dtypes raise;
    a subclass that keeps nn.Linear's forward converts."""
    for seq, match in ((nn.Sequential(nn.Linear(3, 4), nn.ReLU(), _Doubled(4, 2)), "_Doubled"),
                       (nn.Sequential(_hooked(), nn.ReLU()), "forward hooks"),
                       (nn.Sequential(nn.utils.weight_norm(nn.Linear(3, 4))), "forward hooks")):
        with pytest.raises(TypeError, match=match):
            FusedMLP.from_sequential(seq)
    inner = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    inner.register_forward_pre_hook(lambda m, i: None)
    with pytest.raises(TypeError, match="nested Sequential has forward hooks"):
        FusedMLP.from_sequential(nn.Sequential(inner, nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="float64"):
        FusedMLP.from_sequential(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2).double()))
    seq = nn.Sequential(_Renamed(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    torch.testing.assert_close(FusedMLP.from_sequential(seq)(x), seq(x))
    shared = nn.Linear(4, 4)  # one layer twice, and tied weights: copies would untie them
    tied = nn.Linear(4, 4)
    tied.weight = shared.weight
    for seq in (nn.Sequential(shared, nn.ReLU(), shared), nn.Sequential(shared, nn.ReLU(), tied)):
        with pytest.raises(ValueError, match="shared"):
            FusedMLP.from_sequential(seq)


class _DoubledIdentity(nn.Identity):  # skipped as an Identity, but computes 2x
    def forward(self, x):
        return 2 * x


class _TripledSequential(nn.Sequential):
    def forward(self, x):
        return 3 * super().forward(x)


def test_from_sequential_refuses_identity_and_sequential_with_a_forward_of_their_own():
    """nn.Identity and nn.Sequential are looked through only where they compute what their
    base does: a subclass with its own forward is a TypeError naming it, nested or at the top."""
    for seq in (nn.Sequential(nn.Linear(5, 7), _DoubledIdentity(), nn.ReLU(), nn.Linear(7, 2)),
                nn.Sequential(_TripledSequential(nn.Linear(5, 7), nn.ReLU()), nn.Linear(7, 2)),
                _TripledSequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))):
        with pytest.raises(TypeError, match="forward of its own"):
            FusedMLP.from_sequential(seq)


def test_from_sequential_keeps_frozen_layers_frozen():
    seq = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    seq[0].requires_grad_(False)
    m = FusedMLP.from_sequential(seq)
    assert [p.requires_grad for p in (*m.weights, *m.biases)] == [False, True, False, True]
    back = m.to_sequential()
    assert [p.requires_grad for p in back.parameters()] == [False, False, True, True]
    x = torch.randn(3, 5)
    m(x).sum().backward()
    assert m.weights[0].grad is None and m.weights[1].grad is not None


@pytest.mark.parametrize("widths", [4, [4.5, 3], "43", None])
def test_fused_mlp_module_widths_must_be_ints(widths):
    with pytest.raises(TypeError, match="sequence of ints"):
        FusedMLP(widths)


def test_registered_op_checks_its_bias_mask():
    """torch.ops.kgen.fused_mlp's biases are the present ones and a bit per layer: a mask
    that does not describe them raises, rather than dropping a bias (mask 0 with one given)
    or failing inside (a set bit with none given)."""
    x, w, b = torch.randn(3, 4), torch.randn(2, 4), torch.randn(2)
    for biases, mask in (([b], 0), ([], 1), ([b], 3), ([b, b], 1)):
        with pytest.raises(ValueError, match="bias_mask"):
            torch.ops.kgen.fused_mlp(x, [w], biases, mask, "none", "none")
        with pytest.raises(ValueError, match="bias_mask"):
            torch.ops.kgen.fused_mlp(x.to("meta"), [w.to("meta")], [t.to("meta") for t in biases], mask, "none",
                                     "none")
    torch.testing.assert_close(torch.ops.kgen.fused_mlp(x, [w], [b], 1, "none", "none"), x @ w.T + b)


def test_partial_biases_gradients_and_empty_batch():
    w = [torch.randn(4, 3, requires_grad=True), torch.randn(2, 4, requires_grad=True)]
    b = [None, torch.randn(2, requires_grad=True)]
    x = torch.randn(3, 3, requires_grad=True)
    ops.fused_mlp(x, w, b, activation="silu").sum().backward()
    assert w[0].grad.shape == (4, 3) and b[1].grad.shape == (2,) and x.grad.shape == (3, 3)
    assert ops.fused_mlp(torch.randn(0, 3), [w[0].detach()], None).shape == (0, 4)


def test_opcheck_fake_and_compile():
    x, ws, bs = fm.make_inputs("cpu", torch.float32, 3, (5, 7, 2))
    torch.library.opcheck(torch.ops.kgen.fused_mlp.default, (x, ws, bs, 3, "gelu", "sigmoid"))
    meta = torch.ops.kgen.fused_mlp(x.to("meta"), [w.to("meta") for w in ws], [b.to("meta") for b in bs], 3,
                                    "relu", "none")
    assert meta.shape == (3, 2) and meta.device.type == "meta"
    m = FusedMLP([5, 7, 2], last_activation="sigmoid")
    xg = torch.randn(4, 5, requires_grad=True)
    f = torch.compile(lambda t: m(t).sum(), fullgraph=True, backend="aot_eager")
    f(xg).backward()
    xr = xg.detach().clone().requires_grad_()
    m.to_sequential()(xr).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)


@pytest.mark.parametrize("call,err,match", [
    (lambda x, w, b: ops.fused_mlp(x.double(), w, b), TypeError, "dtype"),
    (lambda x, w, b: ops.fused_mlp(x, w[0], b), TypeError, "list"),
    (lambda x, w, b: ops.fused_mlp(x, w, b[:1]), ValueError, "biases"),
    (lambda x, w, b: ops.fused_mlp(x, w, b, activation="tanh"), ValueError, "activation"),
    (lambda x, w, b: ops.fused_mlp(x, w, b, last_activation="softmax"), ValueError, "last_activation"),
    (lambda x, w, b: ops.fused_mlp(x, [w[1], w[0]], b), ValueError, "shape"),
    (lambda x, w, b: ops.fused_mlp(x, [w[0].half(), w[1]], b), TypeError, "weights\\[0\\] dtype"),
    (lambda x, w, b: ops.fused_mlp(x, w, [b[0][:2], b[1]]), ValueError, "biases\\[0\\]"),
    (lambda x, w, b: ops.fused_mlp(x, w * 5, b * 5), ValueError, "shape|layers"),
    (lambda x, w, b: ops.fused_mlp(x, [], []), ValueError, "layers"),
    (lambda x, w, b: ops.fused_mlp(x, [torch.randn(4097, 5)], None), ValueError, "width"),
    (lambda x, w, b: ops.fused_mlp(x.sum(), w, b), ValueError, "dimension"),
    (lambda x, w, b: ops.fused_mlp(x, [w[0].to_sparse(), w[1]], b), TypeError, "weights\\[0\\] has layout"),
    (lambda x, w, b: ops.fused_mlp(x, [w[0], w[1].to_sparse_csr()], [None, None]), TypeError, "layout"),
    (lambda x, w, b: ops.fused_mlp(x.to_sparse(), w, b), TypeError, "x has layout"),
])
def test_bad_inputs(call, err, match):
    x, ws, bs = fm.make_inputs("cpu", torch.float32, 3, (5, 7, 2))
    with pytest.raises(err, match=match):
        call(x, ws, bs)


def test_nine_layers_rejected():
    ws = [torch.randn(4, 4) for _ in range(9)]
    with pytest.raises(ValueError, match="1 to 8"):
        ops.fused_mlp(torch.randn(2, 4), ws, None)


def test_spec_variants_and_fits():
    names = {v.name for v in SPEC.variants}
    assert "triton_367x512x256x1_m32_k64_w8_bf16" in names and "triton_mw4096_m32_k64_w4_f32" in names
    top = SPEC.variant("triton_367x512x256x1_m32_k64_w8_bf16")
    gen = SPEC.variant("triton_mw4096_m32_k64_w4_bf16")
    assert top.params["widths"] == (367, 512, 256, 1)
    assert fm.variant_fits(top, {"widths": "367-512-256-1"}) and not fm.variant_fits(top, {"widths": (367, 512, 1)})
    assert fm.variant_fits(gen, {"widths": (1, 4096, 1)}) and not fm.variant_fits(gen, {"widths": (1,) * 10})
    assert fm.tune_bucket(B=2000, widths="13-512-256-64-16") == "w13-512-256-64-16.B<=2048"


def test_float32_buckets_carry_the_tf32_setting(monkeypatch):
    """float32's bucket names its dot precision (TF32 on: "tf32", off: "tf32x3"), taken from
    torch's setting by the tuner (`tune.with_extras`) as by dispatch: a table entry tuned
    with TF32 on is never used with it off. The 16-bit dtypes' buckets do not change."""
    from kgen.runtime import tune

    matmul = torch.backends.cuda.matmul
    was = matmul.allow_tf32
    shape = {"B": 100, "widths": "13-512-256-64-16"}
    seen = []
    monkeypatch.setattr(fm.KERNELS, "choose", lambda key, device, dtype, shp: seen.append(fm.tune_bucket(**shp)))
    monkeypatch.setattr(fm.KERNELS, "lookup", lambda key: fm.op.MISSING)
    cuda = torch.device("cuda", 0)
    try:
        for on, p in ((True, "tf32"), (False, "tf32x3")):
            matmul.allow_tf32 = on
            tuned = tune.with_extras(fm, "float32", shape)
            assert fm.tune_bucket(**tuned) == f"w13-512-256-64-16.B<=128.{p}"
            assert fm.tune_inputs(torch.device("cpu"), "float32", **tuned)["x"].dtype is torch.float32
            assert tune.with_extras(fm, "bfloat16", shape) == shape
            fm.module_for(cuda, torch.float32, (13, 512, 256, 64, 16), 100)
            assert seen[-1] == fm.tune_bucket(**tuned)  # dispatch looks up the bucket the tuner records
    finally:
        matmul.allow_tf32 = was
    fm.module_for(cuda, torch.bfloat16, (13, 512, 256, 64, 16), 100)
    assert seen[-1] == "w13-512-256-64-16.B<=128"


def test_padded_weights_have_their_own_bucket(monkeypatch, tmp_path):
    """Row-padded weights (FusedMLP's pad_weights) are a bucket of their own, `padded`, which
    dispatch looks up as the tuner records it (its inputs then row-padded too); dense weights,
    other layouts and widths of whole 16-byte rows keep the plain bucket; a padded bucket
    nobody tuned takes the dense bucket's entry (TUNE_CLASS_FALLBACK); `kgen tune --shapes`
    tunes both layouts, or the one given."""
    from kgen import tune_cli
    from kgen.families.fused_mlp import launch
    from kgen.runtime import tuning_table

    top = (367, 512, 256, 1)
    x, ws, bs = fm.make_inputs("cpu", torch.bfloat16, 3, top)
    padded = [launch.row_padded(ws[0], 368), *ws[1:]]
    assert fm.layout_of(padded, 2) == "padded" and fm.layout_of(ws, 2) is None
    assert fm.layout_of([launch.row_padded(ws[0], 370), *ws[1:]], 2) is None  # 740-byte rows: not whole vectors
    assert fm.layout_of([padded[0], ws[1].t().contiguous().t(), ws[2]], 2) is None  # a transposed weight
    assert fm.layout_of(fm.make_inputs("cpu", torch.bfloat16, 3, (64, 32, 8))[1], 2) is None  # whole rows already
    # a whole-vector width may be row-padded too; a one-row weight has no layout
    assert fm.layout_of([padded[0], launch.row_padded(ws[1], 520), ws[2]], 2) == "padded"
    assert fm.layout_of(fm.make_inputs("cpu", torch.bfloat16, 3, (64, 100, 1))[1], 2) is None
    # the TMA ring variants read the weights in place where they are padded, or whole rows by
    # their widths (a one-wide last layer's, a dot, not read through a tensor map); dense
    # weights of other widths through a copy (cuda.CudaMLP.scratch): candidates either way
    ring = SPEC.variant("sm90a_367x512x256x1_c4_m16_w8_st11_bf16")
    assert fm.variant_fits(ring, {"widths": top, "layout": "padded"}) and fm.variant_fits(ring, {"widths": top})
    assert not fm.variant_fits(ring, {"widths": (368, 512, 256, 1)})
    # ... but not a one-row weight read through a tensor map at a width not whole vectors
    # (its pitch is its width however it is laid out: cuda.CudaMLP.takes refuses it)
    from types import SimpleNamespace

    one = SimpleNamespace(params={**ring.params, "widths": [100, 1]}, dtype="bfloat16")
    assert not fm.variant_fits(one, {"widths": (100, 1)}) and not fm.variant_fits(one, {"widths": (100, 1), "layout": "padded"})
    one.params["widths"] = [104, 1]
    assert fm.variant_fits(one, {"widths": (104, 1)})
    one.params["widths"] = [64, 100, 1]  # (the one-wide last layer after another: a dot, no tensor map)
    assert fm.variant_fits(one, {"widths": (64, 100, 1)})
    from kgen.families.fused_mlp.schema import ring_reads

    assert ring_reads((64, 100, 1), "bfloat16", None) and not ring_reads((64, 100, 3), "bfloat16", None)
    assert not ring_reads((100, 1), "bfloat16", None) and ring_reads((100, 1), "bfloat16", "padded")
    seen = []
    monkeypatch.setattr(fm.KERNELS, "choose", lambda key, device, dtype, shp: seen.append(fm.tune_bucket(**shp)))
    monkeypatch.setattr(fm.KERNELS, "lookup", lambda key: fm.op.MISSING)
    cuda = torch.device("cuda", 0)
    fm.module_for(cuda, torch.bfloat16, top, 700, padded)
    fm.module_for(cuda, torch.bfloat16, top, 700, ws)
    assert seen == ["w367-512-256-1.B<=1024.padded", "w367-512-256-1.B<=1024"]
    tuned = fm.tune_inputs(torch.device("cpu"), "bfloat16", 700, "367-512-256-1", layout="padded")
    assert fm.layout_of(tuned["weights"], 2) == "padded" and tuned["weights"][0].stride() == (368, 1)
    with pytest.raises(ValueError, match="layout 'pad'"):
        fm.tune_bucket(B=1, widths="8-8", layout="pad")
    k = tuning_table.key("fused_mlp", "H100|9.0|132", "bfloat16", "w367-512-256-1.B<=1024.padded")
    assert tuning_table.stand_in(k) == k.removesuffix(".padded")
    shapes = tune_cli.shapes_arg(fm, ["B=700,widths=367-512-256-1"])
    assert [s.get("layout") for s in shapes] == [None, "padded"]
    assert [s.get("layout") for s in tune_cli.shapes_arg(fm, ["B=700,widths=367-512-256-1,layout=padded"])] == ["padded"]


def test_spec_widths_knob_errors():
    from kgen import spec
    from kgen.errors import SpecError

    with pytest.raises(SpecError, match="max_width"):
        spec.parse("family: fused_mlp\nvariants:\n  - backend: triton\n    block_m: 16\n    block_k: 64\n"
                   "    num_warps: 4\n")
    with pytest.raises(SpecError, match="above the maximum"):
        spec.parse("family: fused_mlp\nvariants:\n  - backend: triton\n    widths: [5, 5000]\n    block_m: 16\n"
                   "    block_k: 64\n    num_warps: 4\n")
    for knob in ("align: 0", "block_n: 32"):  # exact variants' knobs
        with pytest.raises(SpecError, match="exact variants"):
            spec.parse("family: fused_mlp\nvariants:\n  - backend: triton\n    max_width: 256\n    block_m: 16\n"
                       f"    block_k: 64\n    num_warps: 4\n    {knob}\n")
    with pytest.raises(SpecError, match="block_n"):
        spec.parse("family: fused_mlp\nvariants:\n  - backend: triton\n    widths: [5, 6]\n    block_m: 16\n"
                   "    block_k: 64\n    block_n: 48\n    num_warps: 4\n")
    s = spec.parse("family: fused_mlp\nvariants:\n  - backend: triton\n    widths: [[5, 6], [7, 8, 9]]\n"
                   "    block_m: 16\n    block_k: 64\n    num_warps: 4\n    dtypes: [float32]\n")
    assert [v.name for v in s.variants] == ["triton_5x6_m16_k64_w4_f32", "triton_7x8x9_m16_k64_w4_f32"]


# ------------------------------------------------------------------ the CUDA cluster variant

CUDA_VARIANTS = [v.name for v in SPEC.variants if v.backend == "cuda"]
# Widths a user's spec might give the CUDA variant, for the paths the shipped DLRM ones (x 367 /
# 13 wide, odd layer counts for the top) do not take: x's rows whole 16-byte vectors (loaded
# without the shift), no unaligned weight at all, an even layer count (the cluster barrier
# between row tiles), a last layer on one CTA of 8
USER_CUDA = {
    "64-256-128-10 c4 m32": "widths: [64, 256, 128, 10]\n    cluster: 4\n    block_m: 32\n    warps: 8\n"
                            "    dtypes: [bfloat16]\n",
    "40-96-48-24-3 c2 m16": "widths: [40, 96, 48, 24, 3]\n    cluster: 2\n    block_m: 16\n    warps: 4\n"
                            "    dtypes: [float16]\n",
    "21-72-5 c8 m16": "widths: [21, 72, 5]\n    cluster: 8\n    block_m: 16\n    warps: 4\n    dtypes: [bfloat16]\n",
}


# ... and the WGMMA variant's: 128-row tiles with barrier layers (the top MLP's outputs reuse
# its input's and weights' shared memory), x of whole vectors with a last layer on 2 CTAs of 4,
# an even layer count on a cluster of 2 whose layers are 48, 24 and 16 columns a CTA
USER_WGMMA = {
    "367-512-256-1 c8 m128": "widths: [367, 512, 256, 1]\n    cluster: 8\n    block_m: 128\n    warps: 8\n"
                             "    dtypes: [bfloat16]\n",
    "64-256-128-10 c4 m128": "widths: [64, 256, 128, 10]\n    cluster: 4\n    block_m: 128\n    warps: 8\n"
                             "    dtypes: [bfloat16]\n",
    "40-96-48-24-3 c2 m64": "widths: [40, 96, 48, 24, 3]\n    cluster: 2\n    block_m: 64\n    warps: 4\n"
                            "    dtypes: [float16]\n",
}


# ... and the TMA ring kernel's (every K a multiple of 8: the weights' rows whole 16-byte vectors
# without padding): a 136-wide layer (a half-empty second tile), a last layer written from the
# accumulators (10 wide); four layers of one tile each (the second warpgroup idle) on one CTA;
# a one-wide last layer as a dot of a two-tile layer, 64 rows a CTA on a cluster of 4; one layer
# of one output (a ring layer, not a dot)
USER_RING = {
    "64-256-136-10 c2 m16 st8": "widths: [64, 256, 136, 10]\n    cluster: 2\n    block_m: 16\n    warps: 8\n"
                                "    stages: 8\n    dtypes: [bfloat16]\n",
    "40-96-48-24-3 c1 m32 st6": "widths: [40, 96, 48, 24, 3]\n    cluster: 1\n    block_m: 32\n    warps: 8\n"
                                "    stages: 6\n    dtypes: [float16]\n",
    "24-200-1 c4 m64 st4": "widths: [24, 200, 1]\n    cluster: 4\n    block_m: 64\n    warps: 8\n"
                           "    stages: 4\n    dtypes: [bfloat16]\n",
    "256-1 c1 m16 st4": "widths: [256, 1]\n    cluster: 1\n    block_m: 16\n    warps: 8\n"
                        "    stages: 4\n    dtypes: [bfloat16]\n",
    # split rings: a narrow last layer some CTAs own no tile of; an uneven split (3 tiles over 2,
    # the last 48 features) into a dot; one ring layer of 5 tiles over 4 CTAs into a dot; two (5
    # and 4 tiles) over 4 (three peers a panel)
    "64-256-136-10 c2 m16 st8 sn1": "widths: [64, 256, 136, 10]\n    cluster: 2\n    block_m: 16\n    warps: 8\n"
                                    "    stages: 8\n    split_n: 1\n    dtypes: [bfloat16]\n",
    "40-304-200-1 c2 m32 st6 sn1": "widths: [40, 304, 200, 1]\n    cluster: 2\n    block_m: 32\n    warps: 8\n"
                                   "    stages: 6\n    split_n: 1\n    dtypes: [float16]\n",
    "24-520-1 c4 m64 st4 sn1": "widths: [24, 520, 1]\n    cluster: 4\n    block_m: 64\n    warps: 8\n"
                               "    stages: 4\n    split_n: 1\n    dtypes: [bfloat16]\n",
    "32-520-512-1 c4 m16 st6 sn1": "widths: [32, 520, 512, 1]\n    cluster: 4\n    block_m: 16\n    warps: 8\n"
                                   "    stages: 6\n    split_n: 1\n    dtypes: [bfloat16]\n",
    # dense weights of widths not whole 16-byte vectors, each read through a row-padded copy
    # its launcher makes (three copies back to back in the scratch: plan_pads)
    "36-20-12-3 c1 m16 st4": "widths: [36, 20, 12, 3]\n    cluster: 1\n    block_m: 16\n    warps: 8\n"
                             "    stages: 4\n    dtypes: [float16]\n",
}


def _user_cuda(key):
    from kgen import spec

    arch, body = (("sm_90a", USER_WGMMA[key]) if key in USER_WGMMA else ("sm_90a", USER_RING[key]) if key in USER_RING
                  else ("sm_90", USER_CUDA[key]))
    return spec.parse(f"family: fused_mlp\nvariants:\n  - backend: cuda\n    arch: {arch}\n    " + body).variants[0]


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("widths,cluster,block_m", [
    ((367, 512, 256, 1), 8, 64), ((367, 512, 256, 1), 8, 128), ((13, 512, 256, 64, 16), 8, 128),
    ((64, 256, 128, 10), 4, 128), ((40, 96, 48, 24, 3), 2, 64), ((1000, 8), 1, 64)])
def test_wgmma_plan_regions(widths, cluster, block_m):
    """The WGMMA plan: every layer's padded output columns covered by its active CTAs, each
    CTA's slice one contiguous run; no region a peer may write into (layer i's output) overlaps
    what this CTA may still read then -- layer i's input and weights unless it is a barrier
    layer, every later layer's weights, the biases -- and everything within shared memory."""
    from kgen.families.fused_mlp import cuda_plans as plans

    p = plans.wgmma_plan(widths, cluster, block_m)
    L = p["layers"]
    assert p["smem"] <= plans.SMEM_MAX - 1024 and p["threads"] >= 128 * p["warpgroups"]
    bias = (0, sum(l["n"] for l in L) * 4)
    w = [(l["w_off"], l["w_off"] + l["w_bytes"]) for l in L]
    a = [(l["a_off"], l["a_off"] + block_m * 2 * l["kp"]) for l in L]
    for l in L:
        assert l["active"] * l["n"] >= l["groups"] * 8 and (l["active"] - 1) * l["n"] < l["groups"] * 8
        assert l["n"] % 8 == 0 and l["n"] <= plans.WGMMA_N_MAX and l["kp"] % 16 == 0
        assert all(o % 16 == 0 for o in (l["w_off"], l["a_off"], l["b_off"]))
        assert not any(_overlaps(w[l["i"]], r) for r in [bias] + w[:l["i"]] + w[l["i"] + 1:])
        if l["last"]:
            continue
        nxt = L[l["i"] + 1]
        assert l["out_off"] == nxt["a_off"] and l["slice_bytes"] == block_m * l["n"] * 2
        out = (l["out_off"], l["out_off"] + block_m * 2 * max(nxt["kp"], l["active"] * l["n"]))
        live = [bias] + w[l["i"] + 1:] + ([] if l["barrier"] else [w[l["i"]], a[l["i"]]])
        assert not any(_overlaps(out, r) for r in live), (l["i"], out, live)
    if block_m == 64:  # these fit without reusing anything
        assert not any(l["barrier"] for l in L)
    if (widths, block_m) == ((367, 512, 256, 1), 128):  # 128 rows of x and of the 512-wide output: both reused
        assert [l["barrier"] for l in L] == [True, True, False]


def test_wgmma_checks():
    """What the WGMMA variant cannot be is a SpecError naming the knob."""
    from kgen import spec
    from kgen.errors import SpecError

    head = "family: fused_mlp\nvariants:\n  - backend: cuda\n    arch: sm_90a\n"
    for body, match in (
            ("widths: [8, 8]\n    cluster: 2\n    block_m: 64\n    warps: 4\n    dtypes: [float32]",
             "bfloat16 and float16"),
            ("widths: [8, 8]\n    cluster: 2\n    block_m: 32\n    warps: 4", "64 or 128"),
            ("widths: [8, 8]\n    cluster: 2\n    block_m: 128\n    warps: 4", "warps 8 for block_m 128"),
            ("widths: [64, 512, 8]\n    cluster: 1\n    block_m: 64\n    warps: 4", "more than one wgmma's 256"),
            ("widths: [2048, 2048, 8]\n    cluster: 8\n    block_m: 128\n    warps: 8", "shared memory")):
        with pytest.raises(SpecError, match=match):
            spec.parse(head + "    " + body + ("" if "dtypes" in body else "\n    dtypes: [bfloat16]") + "\n")


@pytest.mark.parametrize("widths,cluster,block_m,stages,split", [
    ((367, 512, 256, 1), 4, 16, 11, 0), ((367, 512, 256, 1), 2, 32, 10, 0), ((13, 512, 256, 64, 16), 2, 16, 11, 0),
    ((64, 256, 136, 10), 2, 16, 8, 0), ((40, 96, 48, 24, 3), 1, 32, 6, 0), ((24, 200, 1), 4, 64, 4, 0),
    ((256, 1), 1, 16, 4, 0), ((367, 512, 256, 1), 2, 32, 10, 1), ((367, 512, 256, 1), 2, 64, 6, 1),
    ((64, 256, 136, 10), 2, 16, 8, 1), ((24, 520, 1), 4, 64, 4, 1),
    ((32, 520, 512, 1), 4, 16, 6, 1)])
def test_ring_plan(widths, cluster, block_m, stages, split):
    """The TMA ring plan: every layer's features in 128-row tiles and its K in 64-column panels;
    the chunks of the layers one after another in the ring; a layer reads the buffer the one
    before wrote, each buffer large enough for every layer's panels that use it; a one-wide last
    layer (after another) a dot, not a ring layer; regions disjoint, 1024-byte aligned where
    TMA and the descriptors read them, within sm_90's shared memory."""
    from kgen.families.fused_mlp import cuda_plans as plans

    p = plans.ring_plan(widths, cluster, block_m, stages, bool(split))
    L = p["layers"]
    assert p["dot"] == (len(widths) > 2 and widths[-1] == 1) and len(L) == len(widths) - 1 - p["dot"]
    c0 = 0
    for l in L:
        assert l["mt"] * 128 >= l["N"] > (l["mt"] - 1) * 128 and l["kc"] * 64 >= l["K"] > (l["kc"] - 1) * 64
        assert l["c0"] == c0 and l["src"] == l["i"] % 2
        c0 += l["mt"] * l["kc"]
        size = p["buf_off"][1] - p["buf_off"][0] if l["src"] == 0 else None
        if size is not None:
            assert l["kc"] * p["panel"] <= size
        if l["dst"] is not None:
            assert l["dst"] == L[l["i"] + 1]["src"] and L[l["i"] + 1]["kc"] * 64 >= l["N"]
    assert p["chunks"] == c0 and L[-1]["dst"] is None and L[-1]["last"] != p["dot"]
    ring = stages * plans.RING_SLOT
    assert p["buf_off"][0] == ring and all(o % 1024 == 0 for o in p["buf_off"]) and p["panel"] % 1024 == 0
    ends = [L[-1]["b_off"] + L[-1]["mt"] * 512] + ([p["dot_off"], p["red_off"] + 8 * block_m * 4] if p["dot"] else [])
    if split and p["dot"]:  # the dot's partials of every CTA (bulk-copied: 16-byte aligned)
        assert p["dotp_off"] >= max(ends) and p["dotp_off"] % 16 == 0
        ends.append(p["dotp_off"] + cluster * block_m * 4)
    assert L[0]["b_off"] >= p["buf_off"][1] and p["bar_off"] >= max(ends) and p["bar_off"] % 8 == 0
    bars = 2 * stages + (len(L) + 1 if split else 0)  # full, empty; split: a barrier a layer's panels, the dot's
    assert p["smem"] >= p["bar_off"] + 8 * bars + 1024
    assert p["smem"] <= plans.SMEM_MAX and p["threads"] == 288


def test_ring_checks():
    """What the TMA ring variant cannot be is a SpecError naming the knob."""
    from kgen import spec
    from kgen.errors import SpecError

    head = "family: fused_mlp\nvariants:\n  - backend: cuda\n    arch: {arch}\n    "
    base = {"widths": "[64, 64]", "cluster": 2, "block_m": 16, "warps": 8, "stages": 6, "dtypes": "[bfloat16]"}
    for change, match, arch in (
            ({"dtypes": "[float32]"}, "bfloat16 and float16", "sm_90a"),
            ({"block_m": 128}, "16, 32 or 64", "sm_90a"),
            ({"warps": 4}, "8 consumer warps", "sm_90a"),
            ({"cluster": 8}, "clusters of 1, 2, 4", "sm_90a"),
            ({"stages": 3}, "at least 4 slots", "sm_90a"),
            ({"stages": 14}, "shared memory", "sm_90a"),
            ({}, "leave it out for sm_90", "sm_90"),
            ({"split_n": 1, "cluster": 1}, "cluster of 2 or 4", "sm_90a"),
            ({"split_n": 1, "widths": "[64, 100, 64]"}, "every layer but the last", "sm_90a"),
            ({"split_n": 1, "stages": 0}, "stages > 0", "sm_90a")):
        body = "\n    ".join(f"{k}: {v}" for k, v in {**base, **change}.items())
        with pytest.raises(SpecError, match=match):
            spec.parse(head.format(arch=arch) + body + "\n")
    v = spec.parse(head.format(arch="sm_90a") + "\n    ".join(f"{k}: {v}" for k, v in base.items()) + "\n").variants[0]
    assert v.name.endswith("_st6_bf16") and v.params["stages"] == 6
    split = {**base, "widths": "[64, 256, 64]", "split_n": 1}
    v = spec.parse(head.format(arch="sm_90a") + "\n    ".join(f"{k}: {v}" for k, v in split.items()) + "\n").variants[0]
    assert v.name.endswith("_st6_sn1_bf16") and v.params["split_n"] == 1


def test_cuda_plan_and_checks():
    """The cluster plan: every layer's column groups covered by the cluster's CTAs (the next
    layer's padded width, the last layer's N rounded to 8), weight and bias slices and the
    two activation buffers within sm_90's shared memory; what a CUDA variant cannot be is a
    SpecError naming the knob."""
    from kgen import spec
    from kgen.errors import SpecError
    from kgen.families.fused_mlp import cuda_plans as plans

    p = plans.cuda_plan((367, 512, 256, 1), 16, 32, 8)
    assert [(l["kp"], l["groups"], l["per_cta"], l["aligned"]) for l in p["layers"]] == [
        (368, 64, 4, False), (512, 32, 2, True), (256, 1, 1, True)]
    # 102 KB; the whole 32-row tile of x, 32 x 46 chunks over 256 threads, two registers each
    # (367-wide rows are not whole vectors): 12, loaded at each tile's start, not carried ahead
    assert p["ctas_per_sm"] == 2 and (p["x_vectors"], p["x_registers"], p["x_prefetch"]) == (6, 12, False)
    assert plans.cuda_plan((367, 512, 256, 1), 8, 16, 16)["x_prefetch"]  # the shipped B <= 128 one: 2 chunks
    for l in p["layers"]:
        assert l["per_cta"] * 16 >= l["groups"] and l["per_cta"] % l["nb"] == 0 and l["sa"] % 16 == 8
    assert p["smem"] <= plans.SMEM_MAX and p["buf_off"][0] >= p["weights_bytes"]
    assert len(CUDA_VARIANTS) >= 4 and {SPEC.variant(n).arch for n in CUDA_VARIANTS} == {"sm_90", "sm_90a"}
    head = "family: fused_mlp\nvariants:\n  - backend: cuda\n    arch: sm_90\n"
    with pytest.raises(SpecError, match="bfloat16 and float16"):
        spec.parse(head + "    widths: [8, 8]\n    cluster: 2\n    block_m: 16\n    warps: 4\n    dtypes: [float32]\n")
    with pytest.raises(SpecError, match="shared memory"):
        spec.parse(head + "    widths: [4096, 4096, 8]\n    cluster: 2\n    block_m: 16\n    warps: 16\n"
                          "    dtypes: [bfloat16]\n")
    with pytest.raises(SpecError, match="16-byte vectors of x"):
        spec.parse(head + "    widths: [4096, 8]\n    cluster: 1\n    block_m: 64\n    warps: 4\n"
                          "    dtypes: [bfloat16]\n")
    with pytest.raises(SpecError, match="16-row tiles"):
        spec.parse(head + "    widths: [8, 8]\n    cluster: 2\n    block_m: 128\n    warps: 4\n"
                          "    dtypes: [bfloat16]\n")


@pytest.mark.parametrize("bias", [True, False, [False, True, True]], ids=["every", "none", "some"])
def test_cuda_direct_arguments(monkeypatch, bias):
    """The CUDA cluster variant's fast launcher passes the C launcher's arguments in the order
    launch.cuh.j2 reads them (device, stream, B, bias mask, activations, the weights' row
    strides, x, out, the weights, the present biases) with this call's pointers and a new
    output each call (a row-padded weight: its own row stride), the TMA ring's scratch last,
    and returns None where the launcher answers MISALIGNED; another error code raises. (A fake launcher: the
    kernel itself runs in the GPU tests.)"""
    from types import SimpleNamespace

    from kgen.families.fused_mlp import cuda
    from kgen.families.fused_mlp.schema import ACT_CODE

    calls, answer = [], [0]

    def raw(ptr, *args):
        calls.append((ptr, args))
        return answer[0]

    def fail(rc):
        raise RuntimeError(f"CUDA error {rc}")

    widths = (13, 40, 24, 8)
    kernel = SimpleNamespace(name="fake", params={"widths": list(widths)}, variant=SimpleNamespace(dtype="bfloat16"),
                             raw=raw, ptr=1234, fail=fail)
    monkeypatch.setattr(cuda, "current_raw_stream", lambda index: 77)
    impl = cuda.CudaMLP(kernel, None)
    x, ws, bs = fm.make_inputs("cpu", torch.bfloat16, 6, widths, bias=bias)
    x = x.reshape(2, 3, widths[0])
    ws[1] = fm.launch.row_padded(ws[1], 48)  # rows 48 apart (96 bytes)
    f = impl.direct(x, ws, bs, "gelu", "sigmoid")
    present = [b for b in bs if b is not None]
    mask = sum(1 << i for i, b in enumerate(bs) if b is not None)
    for _ in range(2):  # a second call: its own output
        x2, bs2 = x.clone(), [b.clone() if b is not None else None for b in bs]
        ws2 = [w.clone() if i != 1 else fm.launch.row_padded(w.clone(), 48) for i, w in enumerate(ws)]
        out = f(x2, ws2, bs2)
        assert out.shape == (2, 3, widths[-1]) and out.dtype == torch.bfloat16
        ptr, args = calls[-1]
        assert ptr == 1234 and args == (
            None, 77, 6, mask, ACT_CODE["gelu"], ACT_CODE["sigmoid"], 13, 48, 24, x2.data_ptr(), out.data_ptr(),
            *(w.data_ptr() for w in ws2), *(b.data_ptr() for b in bs2 if b is not None))
        assert len(args) == 8 + 2 * len(ws) + len(present)
    answer[0] = cuda.MISALIGNED
    assert f(x, ws, bs) is None
    answer[0] = 700
    with pytest.raises(RuntimeError, match="700"):
        f(x, ws, bs)
    # the TMA ring's launcher takes one more: the scratch it copies W0 (13 wide: rows not whole
    # 16-byte vectors) into, row-padded to 16 (40 x 16 elements), alive while the launcher runs;
    # the row strides as given; 0 where nothing is copied. The fast path and run() alike.
    import weakref

    made, empty = [], torch.empty

    def recorded(*a, **kw):
        t = empty(*a, **kw)
        made.append(weakref.ref(t))
        return t

    def ring_raw(ptr, *args):
        calls.append((ptr, args))
        held = [t() for t in made if t() is not None and t().data_ptr() == args[-1]]
        assert args[-1] == 0 or [t.numel() for t in held] == [40 * 16]
        return 0

    monkeypatch.setattr(torch, "empty", recorded)
    kernel.params["stages"], kernel.raw = 6, ring_raw
    ring = cuda.CudaMLP(kernel, None)
    x6 = x.reshape(6, widths[0])
    for weights in (ws, [fm.launch.row_padded(w, -(-w.shape[1] // 8) * 8) for w in ws]):
        f = ring.direct(x, weights, bs, "gelu", "sigmoid")
        for call in (lambda: f(x, weights, bs), lambda: ring.run(x6, weights, bs, "gelu", "sigmoid")):
            call()
            _, args = calls[-1]
            assert args[6:9] == tuple(cuda.row_stride(w) for w in weights)
            assert len(args) == 9 + 2 * len(ws) + len(present)
            assert (args[-1] != 0) == (weights is ws)


def test_ring_takes_weights_its_tensor_maps_read():
    """The TMA ring variant's `takes`: every weight it reads through a tensor map with rows of
    whole 16-byte vectors (row-padded where its width is not), a one-wide last layer's weight
    (a dot, read in registers) whatever its width; the other CUDA variants take them all."""
    from types import SimpleNamespace

    from kgen.families.fused_mlp import cuda, launch

    def impl(widths, stages):
        kernel = SimpleNamespace(name="fake", params={"widths": list(widths), "stages": stages},
                                 variant=SimpleNamespace(dtype="bfloat16"))
        return cuda.CudaMLP(kernel, None)

    for widths in ((64, 100, 1), (367, 512, 256, 1)):
        x, ws, bs = fm.make_inputs("cpu", torch.bfloat16, 5, widths)
        ring, other = impl(widths, 6), impl(widths, 0)
        assert ring.tma == len(widths) - 2 and other.tma == 0 and other.takes(x, ws, bs)
        assert ring.takes(x, ws, bs) == (widths[0] % 8 == 0)
        pw = [launch.row_padded(w, -(-w.shape[1] // 8) * 8) for w in ws]
        assert ring.takes(x, pw, bs)
    x, ws, bs = fm.make_inputs("cpu", torch.bfloat16, 5, (100, 1))  # one layer: read through a tensor map
    assert impl((100, 1), 6).tma == 1 and not impl((100, 1), 6).takes(x, ws, bs)
    # a dense weight it cannot read in place: taken, its launcher copying it row-padded into
    # the scratch it is given (cuda_ring.cu.j2, plan_pads: the copies back to back in layer
    # order, each rows x the width rounded up to whole vectors); none where nothing is copied
    assert not impl((100, 1), 6).takes(x, ws, bs, pitch=False)  # (one row: its pitch is its width)
    for widths in ((367, 512, 256, 1), (36, 20, 12, 3), (64, 100, 1)):
        x, ws, bs = fm.make_inputs("cpu", torch.bfloat16, 5, widths)
        ring = impl(widths, 6)
        copy = [i for i in range(ring.tma) if widths[i] % 8]
        assert ring.unpitched(ws) == copy and ring.takes(x, ws, bs, pitch=False) and ring.takes(x, ws, bs) == (not copy)
        scratch = ring.scratch(ws)
        assert (scratch is None) == (not copy) and impl(widths, 0).unpitched(ws) == []
        assert not copy or (scratch.dtype, scratch.numel()) == (
            torch.bfloat16, sum(widths[i + 1] * -(-widths[i] // 8) * 8 for i in copy))
        pw = [launch.row_padded(w, -(-w.shape[1] // 8) * 8) if i in copy else w for i, w in enumerate(ws)]
        assert ring.takes(x, pw, bs) and ring.unpitched(pw) == [] and ring.scratch(pw) is None
    assert not ring.takes(x.float(), ws, bs, pitch=False)  # (the other checks still apply)


@requires_nvcc
def test_cuda_variants_sass():
    """Every shipped CUDA variant compiles for sm_90: mma.sync (HMMA.16816.F32) from ldmatrix
    (LDSM), st.async into the other CTAs' shared memory with mbarriers (no GPU-wide fence per
    row tile), the dependent launch's wait before any memory access (ACQBULK), no local memory
    or stack; on sm_90a, no serialised WGMMA."""
    import re

    from kgen.runtime import build, toolchain

    users = list(USER_CUDA) + list(USER_WGMMA) + list(USER_RING)
    results = build.build_cuda([SPEC.variant(n) for n in CUDA_VARIANTS] + [_user_cuda(k) for k in users])
    assert len(results) == len(CUDA_VARIANTS) + len(users)
    for r in results:
        assert r.status in ("built", "cached"), r.error
        lib = r.entry.file(build.CUDA_LIB)
        sass = toolchain.sass(lib)
        res = toolchain.resource_usage(lib)
        # (the TMA ring's launcher has a second kernel: pad_rows, its row-padded weight copy)
        assert len(res) == 1 + bool(r.variant.params["stages"]), res
        assert all(k["local"] == 0 and k["stack"] == 0 for k in res.values()), res
        assert not r.variant.params["stages"] or any("pad_rows" in k for k in res), res
        assert not re.search(r"\b(LDL|STL)\b", sass), r.variant.name
        if r.variant.params["stages"]:
            # the TMA ring: WGMMA (HGMMA) with the batch as N, TMA loads (multicast on a
            # cluster), mbarriers, the dependent launch's wait; no GPU-wide fence; one or two
            # indirect branches (the activation's switch) a layer; no serialised WGMMA. Each
            # kernel's own SASS: its launcher's pad_rows waits for the kernel before too
            # (ACQBULK), so that the ring reads the copy after it was written
            functions = {f.split("\n", 1)[0]: f for f in sass.split("Function : ")[1:]}
            (pad,) = [f for n, f in functions.items() if "pad_rows" in n]
            (sass,) = [f for n, f in functions.items() if "fused_mlp_ring" in n]
            assert "ACQBULK" in pad and "STG.E.128" in pad, r.variant.name
            rows = r.variant.params["block_m"]
            split = r.variant.params["split_n"]  # (split: bulk copies of the panels to the peers, no multicast)
            ops = [f"HGMMA.64x{rows}x16.F32", "SYNCS", "ACQBULK", "UCGABAR_ARV",
                   "UTMALDG.2D.MULTICAST" if r.variant.params["cluster"] > 1 and not split else "UTMALDG.2D"]
            ops += ["UBLKCP"] if split else []
            assert not (split and "MULTICAST" in sass), r.variant.name
            for op in ops:
                assert op in sass, (r.variant.name, op)
            assert not re.search(r"MEMBAR\.\w+\.GPU", sass), r.variant.name
            assert sass.count("BRX") <= 2 * (len(r.variant.params["widths"]) - 1), (r.variant.name, sass.count("BRX"))
            log = r.entry.file(build.BUILD_LOG).read_text()
            assert not re.search(r"C75(08|10|11|15|19|20)", log), (r.variant.name, log)
            continue
        if r.variant.arch == "sm_90a":
            # WGMMA (HGMMA) on shared-memory operands, bulk copies into the peers (UBLKCP) and
            # their mbarriers (SYNCS), the dependent launch's wait; no GPU-wide fence at all; one
            # or two indirect branches (the activation's switch) a layer, not one an element
            for op in ("HGMMA.64x", "UBLKCP", "SYNCS", "ACQBULK", "UCGABAR_ARV"):
                assert op in sass, (r.variant.name, op)
            assert not re.search(r"MEMBAR\.\w+\.GPU", sass), r.variant.name
            assert sass.count("BRX") <= 2 * (len(r.variant.params["widths"]) - 1), (r.variant.name, sass.count("BRX"))
            # none of ptxas's warnings that a WGMMA was serialised (C7510: one in a called
            # function, 2x slower in the thirty-ninth session's prototype; C7511, C7515) or
            # register reallocation ignored (C7508)
            log = r.entry.file(build.BUILD_LOG).read_text()
            assert not re.search(r"C75(08|10|11|15)", log), (r.variant.name, log)
            continue
        # STAS.128: st.async of 16 bytes into another CTA's shared memory; SYNCS: the
        # mbarriers those complete on; the cluster barrier only at the start and the end
        for op in ("HMMA.16816.F32", "LDSM", "UCGABAR_ARV", "ACQBULK", "STAS.128", "SYNCS"):
            assert op in sass, (r.variant.name, op)
        # one GPU-wide fence (the start's barrier, after the mbarriers' init), none a row tile
        assert sass.count("MEMBAR") <= 2, (r.variant.name, sass.count("MEMBAR"))


# ------------------------------------------------------------------ GPU


def _compiled(kernel) -> int:
    """How many binaries Triton's JIT holds for a kernel (on every device)."""
    return sum(len(c[0]) for c in kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.parametrize("v", SPEC.variants, ids=lambda v: v.name)
def test_gpu_nan_like_eager(v):
    if v.backend == "cuda" and not dispatch.arch_runs_on(v.arch, torch.cuda.get_device_capability()):
        pytest.skip(f"{v.arch} code does not run here")
    _nan_like_eager(v.name, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("v", SPEC.variants, ids=lambda v: v.name)
def test_gpu_golden_every_variant(v):
    """Every variant against float64: every activation pair, biases on and off, B 1, 3,
    129 (generic variants at each of their golden widths), into poisoned outputs. All of it
    takes one JIT compile per variant and widths: activations, biases, `save` and B are
    runtime arguments (each used to be one more 5-25 s compile)."""
    k = dispatch.load(v)
    if v.backend == "cuda":
        res = fm.golden(k, "cuda", v.dtype, TOL[v.dtype])
        assert res and all(r <= 1 for _, r in res), [c for c in res if c[1] > 1]
        return
    before = sum(_compiled(f) for f in _kernels(k.module))
    res = fm.golden(k, "cuda", v.dtype, TOL[v.dtype])
    assert res and all(r <= 1 for _, r in res), [c for c in res if c[1] > 1]
    n_widths = 1 if v.params["widths"] else len({r[0].split()[0] for r in res})
    assert 1 <= sum(_compiled(f) for f in _kernels(k.module)) <= before + n_widths


def _untuned(widths, B, dtype="bfloat16"):
    vs = [v for v in dispatch._ordered("fused_mlp", dtype, (9, 0)) if fm.variant_fits(v, {"widths": widths})]
    return [v.name for v in fm.untuned_order(vs, {"B": B, "widths": "-".join(map(str, widths))})]


def test_untuned_widths_keep_generic_variants_where_they_beat_eager():
    """Widths nothing was tuned for: the generic variants while the cost model predicts them
    no slower than the eager composition, smaller row tiles first at every B; none (eager)
    for a wide network, for a wide layer at few rows, or at many rows of float32; the exact
    variants for their widths, the CUDA cluster ones first only up to B = 128, the Triton
    tiles by size."""
    m32, m64 = "triton_mw4096_m32_k64_w4_bf16", "triton_mw4096_m64_k64_w4_bf16"
    assert _untuned((1024, 4096, 1024), 256) == []  # 8.4 M weights: 1669 us against eager's 18.8
    assert _untuned((784, 512, 512, 10), 256) == []  # 121 against 17
    assert _untuned((175, 949), 75) == []  # one wide layer at few rows: 44.7 against 18.4
    tiny = (32, 64, 64, 1)
    assert _untuned(tiny, 300) == [m32, m64]
    assert _untuned(tiny, 65536) == [m32, m64]
    assert _untuned((13, 1, 23, 16, 2), 11690) == [m32, m64]  # 8 against eager's 115
    # float32 (TF32 off) at many rows: 363 us (32-row tiles) against eager's 74
    assert _untuned((75, 893, 1), 8869, "float32") == []
    nerf = (63, 256, 256, 256, 256, 4)  # 214 k weights: small, but not at B = 65536
    assert _untuned(nerf, 4096)[0] == "triton_mw4096_m32_k64_w4_bf16" and _untuned(nerf, 65536) == []
    top = (367, 512, 256, 1)  # 319 k weights: the exact variants only
    small, large = _untuned(top, 100), _untuned(top, 65536)
    assert small[0].startswith("sm90_") and not any("mw4096" in n for n in small)
    # a CUDA cluster variant (mma.sync or WGMMA) last
    assert sorted(small) == sorted(large) and large[-1].startswith("sm90")
    def tile(n):
        return int(n.split("_m")[1].split("_")[0])

    # the row tiles largest first at many rows, the split variants last (B x split partials)
    whole = [n for n in large if n.startswith("triton_") and "_sp" not in n]
    tiles = [tile(n) for n in whole]
    assert tiles == sorted(tiles, reverse=True) and len(tiles) >= 2
    triton = [n for n in large if n.startswith("triton_")]
    assert triton[:len(whole)] == whole and all("_sp" in n for n in triton[len(whole):])
    mid = [n for n in _untuned(top, 2048) if n.startswith("triton_")]
    assert sorted(mid) == sorted(n for n in large if n.startswith("triton_"))
    # at 2048 rows the split variants of at most 2 programs an SM first, most programs a row tile
    # first (the H100's probe: m32 split 4 17.1 us, split 2 18.0, the unsplit m16 21.1)
    assert mid[:2] == ["triton_367x512x256x1_m32_k64_w4_sp4_bf16", "triton_367x512x256x1_m32_k64_w4_sp2_bf16"]
    assert [tile(n) for n in mid if "_sp" not in n] == sorted(tiles)  # ties: spec order
    assert _untuned(top, 128)[3:5] == ["triton_367x512x256x1_m16_k64_w4_sp8_bf16",
                                       "triton_367x512x256x1_m16_k64_w4_sp4_bf16"]  # (after the clusters)
    # the TMA ring variants: for dense weights they read through a copy (W0 367 wide) last at
    # every B; for row-padded ones first from 256 to 4096 rows, last at 128 and past 4096
    assert small[-6:] == large[-6:] == [n for n in large if "_st" in n]

    def padded(B):
        shape = {"B": B, "widths": "367-512-256-1", "layout": "padded"}
        return [v.name for v in fm.untuned_order(
            [v for v in dispatch._ordered("fused_mlp", "bfloat16", (9, 0)) if fm.variant_fits(v, shape)], shape)]

    ring = [n for n in padded(128) if "_st" in n]
    assert len(ring) == 6 and padded(128)[-6:] == ring and padded(8192)[-6:] == ring
    # (fewest waves of CTAs, then split, then the larger cluster, then the smaller tile; 132 SMs
    # without a GPU; a split variant's cluster shares one row tile: c2 m16 split is 256 CTAs at
    # 2048 rows, two waves)
    first = {256: "c2_m16_w8_st10_sn1", 1024: "c2_m16_w8_st10_sn1", 2048: "c2_m32_w8_st10_sn1",
             4096: "c2_m64_w8_st6_sn1"}
    for B, want in first.items():
        order = padded(B)
        assert sorted(order[:6]) == sorted(ring) and f"_{want}_" in order[0], (B, order[:6])
    # float32's split variant: 512 programs at 2048 rows, last
    assert _untuned(top, 2048, "float32") == ["triton_367x512x256x1_m16_k64_w4_f32", "triton_367x512x256x1_m64_k64_w8_f32",
                                              "triton_367x512x256x1_m16_k64_w4_sp4_f32"]


def test_untuned_float32_takes_large_generic_tiles_at_many_rows():
    """Float32 with TF32 off past 8192 rows: the generic 64-row tile first (0.65-1.01x the
    32-row one's time at 19 random widths on an H200), but where a one-wide layer reads more
    than 64 inputs (75-893-1: 650 us against 336); 16-bit there where a layer is wider than
    128; at fewer rows, at narrower 16-bit widths, or with TF32 on, the 32-row tile first."""
    m32, m64 = "triton_mw4096_m32_k64_w4_f32", "triton_mw4096_m64_k64_w4_f32"
    assert _untuned((2, 79, 4, 76), 13380, "float32") == [m64, m32]  # 30.2 against 38.1 us
    assert _untuned((17, 1, 7, 2, 16, 1), 40528, "float32") == [m64, m32]  # one-wide layers, 16 inputs
    assert _untuned((2, 79, 4, 76), 8192, "float32") == [m32, m64]
    assert _untuned((8, 70, 1), 20000, "float32") == [m32, m64]  # a one-wide layer of 70 inputs
    b32, b64 = "triton_mw4096_m32_k64_w4_bf16", "triton_mw4096_m64_k64_w4_bf16"
    assert _untuned((2, 79, 4, 76), 13380) == [b32, b64]  # 16-bit: no layer wider than 128
    assert _untuned((199, 2, 19, 110, 27, 68), 28765) == [b64, b32]  # 46.4 against 56.6 us
    assert _untuned((199, 2, 19, 110, 27, 68), 8192) == [b32, b64]
    vs = [v for v in dispatch._ordered("fused_mlp", "float32", (9, 0)) if fm.variant_fits(v, {"widths": (2, 79, 4, 76)})]
    tf32 = fm.untuned_order(vs, {"B": 13380, "widths": "2-79-4-76", "precision": "tf32"})
    assert [v.name for v in tf32] == [m32, m64]


def test_tune_runner_runs_the_variant_and_eager():
    """The tuner's runner of a variant (on CPU: `forward`, no bound launch) writes fresh
    outputs equal to the op's forward of that variant, bit for bit; the reference's runner is
    the eager composition; a variant that does not take the widths is refused."""
    from kgen.families.fused_mlp import launch

    widths = (13, 512, 256, 64, 16)
    inputs = fm.tune_inputs("cpu", "float32", 3, "-".join(map(str, widths)), "gelu", "sigmoid")
    x, ws, bs = inputs["x"], inputs["weights"], inputs["biases"]
    k = dispatch.load(SPEC.variant("triton_13x512x256x64x16_m64_k64_w8_f32"))
    run = fm.tune_runner(k, inputs)
    a, b = run(), run()
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)
    assert torch.equal(a, launch.forward(k.module, x, ws, bs, "gelu", "sigmoid")[0])
    assert torch.equal(fm.tune_runner(None, inputs)(), fm.eager(x, ws, bs, "gelu", "sigmoid")[0])
    with pytest.raises(ValueError, match="does not take widths"):
        fm.tune_runner(dispatch.load(SPEC.variant("triton_367x512x256x1_m32_k64_w8_bf16")), inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["triton", "cuda"])
def test_gpu_tune_runner_times_the_fast_path(monkeypatch, kind):
    """The tuner times a variant as the op runs a repeated call (its eager fast path): a
    Triton variant's runner launches through the bound replay (triton_launch counts a direct
    launch a call, no plain one), a CUDA variant's through its bound launcher (CudaMLP.run,
    the general path's, is not called); outputs bit-identical to `forward`'s."""
    from kgen.families.fused_mlp import launch
    from kgen.families.fused_mlp.cuda import CudaMLP
    from kgen.runtime import triton_launch

    widths = (13, 512, 256, 64, 16)
    name = "triton_13x512x256x64x16_m32_k64_w8_bf16" if kind == "triton" else "sm90_13x512x256x64x16_c8_m16_w8_bf16"
    v = SPEC.variant(name)
    if kind == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("sm_90 code")
    inputs = fm.tune_inputs("cuda", "bfloat16", 300, "-".join(map(str, widths)), "relu", "relu")
    x, ws, bs = inputs["x"], inputs["weights"], inputs["biases"]
    k = dispatch.load(v)
    run = fm.tune_runner(k, inputs)
    want = launch.forward(fm.implementation(k, widths), x, ws, bs, "relu", "relu")[0]
    before = dict(triton_launch.STATS)
    monkeypatch.setattr(CudaMLP, "run", lambda *a, **kw: pytest.fail("the general path ran"))
    outs = [run() for _ in range(3)]
    assert all(torch.equal(o, want) for o in outs)
    direct, plain, driver = (triton_launch.STATS[s] - before[s] for s in ("direct", "plain", "driver"))
    assert (direct, plain) == ((3, 0) if kind == "triton" else (0, 0))
    assert driver == direct  # each replayed through the trampoline's cuLaunchKernel


@pytest.mark.gpu
def test_gpu_eager_dispatch_has_a_fast_path(monkeypatch):
    """Where dispatch gives a signature to the eager composition, the second inference call
    runs it without the op around it (fm.op._FAST holds it), bit-identical to the op's; a
    call needing gradients still takes the op (and its backward)."""
    monkeypatch.setattr(fm.op, "module_for", lambda *a, **k: None)  # as if eager won the bucket
    monkeypatch.setattr(fm.op, "_FAST", CallMemo())
    x, ws, bs = fm.make_inputs("cuda", torch.float32, 300, (367, 512, 256, 1))
    with torch.no_grad():
        first = ops.fused_mlp(x, ws, bs, activation="relu", last_activation="sigmoid")
        assert len(fm.op._FAST) == 1
        calls, real_op = [], fm.op._op
        monkeypatch.setattr(fm.op, "_op", lambda *a: calls.append(a))  # the op is not called again
        again = ops.fused_mlp(x, ws, bs, activation="relu", last_activation="sigmoid")
        x3 = x.view(3, 100, x.shape[-1])  # a 3-D x: its own signature, reshaped around eager
        monkeypatch.setattr(fm.op, "_op", real_op)
        first3 = ops.fused_mlp(x3, ws, bs, activation="relu", last_activation="sigmoid")
        monkeypatch.setattr(fm.op, "_op", lambda *a: calls.append(a))
        again3 = ops.fused_mlp(x3, ws, bs, activation="relu", last_activation="sigmoid")
    assert not calls and torch.equal(first, again)
    assert torch.equal(first, fm.eager(x, ws, bs, "relu", "sigmoid")[0])
    assert len(fm.op._FAST) == 2 and first3.shape == (3, 100, 1) and torch.equal(first3, again3)
    assert torch.equal(first3.reshape(300, 1), first)
    monkeypatch.undo()
    xg = x.clone().requires_grad_()
    ops.fused_mlp(xg, ws, bs, activation="relu", last_activation="sigmoid").sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name", [v.name for v in SPEC.variants if v.backend == "triton" and not v.params["widths"]])
def test_gpu_generic_scratch_rows_are_each_programs_own(name):
    """A generic variant's hidden layers share two scratch buffers; a layer narrower than the
    one before used to lay its rows at its own width, onto rows of other programs that could
    still be reading them. With the whole grid resident at once and a few SMs holding one
    program where the others hold two (those run ahead), that returned wrong rows at random
    (float32, TF32 off, DLRM bottom MLP, 256 programs on the H100's 132 SMs: B = 16384 with
    64-row tiles or 8192 with 32-row ones, 3-5e-2 against 1e-7). Here: grids of 1 to 3
    programs an SM, a few short of 2, float64 reference, three calls each (the race's outcome
    varied call to call); tolerance: the dtype's golden one."""
    from kgen.runtime.op import error_ratio

    v = SPEC.variant(name)
    dtype = getattr(torch, v.dtype)
    widths = (13, 512, 256, 64, 16)
    mod = fm.implementation(dispatch.load(v), widths)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32: the "tf32x3" kernel, the slowest (widest window)
    try:
        for programs in (sms, 2 * sms - 20, 2 * sms - 8, 2 * sms - 2, 3 * sms - 8):
            B = programs * mod.BLOCK_M - 7  # a partial last tile too
            x, ws, bs = fm.make_inputs("cuda", dtype, B, widths, seed=programs)
            want = fm.reference(x, ws, bs, "relu", "relu")
            with fm.using(mod):
                for _ in range(3):
                    out = ops.fused_mlp(x, ws, bs, activation="relu", last_activation="relu")
                    assert error_ratio(out, want, TOL[v.dtype]) <= 1, (B, programs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.parametrize("widths,acts", [((367, 512, 256, 1), ("relu", "sigmoid")),
                                         ((13, 512, 256, 64, 16), ("relu", "relu")),
                                         ((13, 1000, 1), ("gelu", "none")), ((1, 37, 3), ("silu", "silu"))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [3, 5000])
def test_gpu_op_dispatch_and_gradients(widths, acts, dtype, B):
    x, ws, bs = fm.make_inputs("cuda", dtype, B, widths)
    tol = TOL[str(dtype).removeprefix("torch.")]
    out = ops.fused_mlp(x, ws, bs, activation=acts[0], last_activation=acts[1])
    from kgen.runtime.op import error_ratio

    assert error_ratio(out, fm.reference(x, ws, bs, *acts), tol) <= 1
    mod = fm.module_for(x.device, dtype, widths, B)
    res = fm.grad_check(mod, "cuda", dtype, B, widths, *acts, tol=tol)
    assert all(r <= max(1.0, 2 * e) for _, r, e in res), res


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_VARIANTS)
def test_gpu_cuda_variant(name):
    """A CUDA cluster variant: the kernel itself runs the inference calls it takes (several
    row tiles per cluster, the last one partial) against float64 into a poisoned output,
    bit-identical run to run; an x not 16-byte aligned, and a forward with `save` (the
    backward's), go to its Triton companion; the op's eager fast path launches it. (The TMA
    ring variants read row-padded weights in place, dense ones through a row-padded copy:
    W0's 367-wide rows are not whole vectors.)"""
    from kgen.families.fused_mlp import launch
    from kgen.families.fused_mlp.cuda import CudaMLP
    from kgen.runtime.op import error_ratio, poisoned

    v = SPEC.variant(name)
    widths, dtype = tuple(v.params["widths"]), getattr(torch, v.dtype)
    impl = fm.implementation(dispatch.load(v), widths)
    assert type(impl) is CudaMLP
    # B = 40001 is more row tiles than clusters fit at once: the persistent loop runs
    assert 1 <= impl.max_clusters(torch.cuda.current_device()) < -(-40001 // v.params["block_m"])
    acts = ("gelu", "sigmoid")
    for B in (1, 1000, 40001):
        x, ws, bs = fm.make_inputs("cuda", dtype, B, widths, seed=B, bias=[True, False] + [True] * (len(widths) - 3))
        dense = ws
        if v.params["stages"]:
            assert not impl.takes(x, ws, bs)
            ws = [launch.row_padded(w, -(-w.shape[1] // 8) * 8) for w in ws]
        assert impl.takes(x, ws, bs)
        got = poisoned((B, widths[-1]), dtype, "cuda")
        launch.forward(impl, x, ws, bs, *acts, out=got)
        assert error_ratio(got, fm.reference(x, ws, bs, *acts), TOL[v.dtype]) <= 1
        assert torch.equal(launch.forward(impl, x, ws, bs, *acts)[0], got)
    buf = torch.empty(B * widths[0] + 1, dtype=dtype, device="cuda")
    xu = buf[1:].view(B, widths[0])
    xu.copy_(x)
    assert not impl.takes(xu, ws, bs)
    assert error_ratio(launch.forward(impl, xu, ws, bs, *acts)[0], fm.reference(x, ws, bs, *acts), TOL[v.dtype]) <= 1
    out, zs = launch.forward(impl, x, ws, bs, *acts, save=True)
    assert len(zs) == len(ws) and error_ratio(out, fm.reference(x, ws, bs, *acts), TOL[v.dtype]) <= 1
    f = launch.direct(impl, x, ws, bs, *acts)
    assert f is not None and torch.equal(f(x, ws, bs), got)
    assert f(xu, ws, bs) is None  # unaligned: the general path
    # every weight row-padded (rows whole 16-byte vectors apart, NaN in the padding): read in
    # place (cp.async, a row's last vector cut at the width), the same bits, fast path too
    pw = []
    for w in ws:
        store = torch.full((w.shape[0], -(-w.shape[1] // 8) * 8 + 8), float("nan"), dtype=dtype, device="cuda")
        store[:, :w.shape[1]] = w
        pw.append(store[:, :w.shape[1]])
    k0 = ws[0].shape[1]
    odd = torch.empty(ws[0].shape[0], next(s for s in range(k0 + 1, k0 + 9) if s % 8), dtype=dtype, device="cuda")
    assert impl.takes(x, pw, bs) and not impl.takes(x, [odd[:, :k0], *pw[1:]], bs)  # rows not 16 bytes apart
    assert torch.equal(launch.forward(impl, x, pw, bs, *acts)[0], got)
    fp = launch.direct(impl, x, pw, bs, *acts)
    assert fp is not None and torch.equal(fp(x, pw, bs), got)
    if v.params["stages"]:
        # dense W0 (367-wide rows): the ring itself runs the call, on a row-padded copy its
        # launcher makes each call (CudaMLP.scratch), in forward and in the fast path; no companion
        companion, impl.triton = impl.triton, None
        try:
            assert torch.equal(launch.forward(impl, x, dense, bs, *acts)[0], got)
            fd = launch.direct(impl, x, dense, bs, *acts)
            assert fd is not None and torch.equal(fd(x, dense, bs), got) and torch.equal(fd(x, dense, bs), got)
        finally:
            impl.triton = companion
    # the C launcher checks every pointer: a weight or a bias off by one element launches nothing
    wu = torch.empty(ws[1].numel() + 1, dtype=dtype, device="cuda")[1:].view(ws[1].shape).copy_(ws[1])
    assert f(x, [ws[0], wu, *ws[2:]], bs) is None
    bu = torch.empty(bs[0].numel() + 1, dtype=dtype, device="cuda")[1:].copy_(bs[0])
    assert f(x, ws, [bu, *bs[1:]]) is None
    # every layer with a bias, and none: the launcher's other two argument patterns
    for bias in ([True] * len(ws), [False] * len(ws)):
        _, _, b2 = fm.make_inputs("cuda", dtype, B, widths, seed=7, bias=bias)
        f2 = launch.direct(impl, x, ws, b2, *acts)
        got2 = poisoned((B, widths[-1]), dtype, "cuda")
        launch.forward(impl, x, ws, b2, *acts, out=got2)
        assert error_ratio(got2, fm.reference(x, ws, b2, *acts), TOL[v.dtype]) <= 1
        assert f2 is not None and torch.equal(f2(x, ws, b2), got2)
    with fm.using(impl):
        assert torch.equal(ops.fused_mlp(x, ws, bs, activation=acts[0], last_activation=acts[1]), got)


@pytest.mark.gpu
@pytest.mark.parametrize("key", list(USER_CUDA) + list(USER_WGMMA) + list(USER_RING))
def test_gpu_cuda_variant_user_widths(key):
    """A CUDA variant a user's spec builds (USER_CUDA: aligned x, no unaligned weight, an even
    layer count, a one-CTA last layer) against float64 into a poisoned output, at one row tile,
    a few per cluster and more than the clusters that fit, bit-identical run to run. A TMA ring
    on dense weights its tensor maps cannot read (rows not whole 16-byte vectors) runs on its
    launcher's row-padded copies, made after the kernel before on the stream (a weight changed
    in place just before) and again at each CUDA graph replay."""
    from kgen.families.fused_mlp import launch
    from kgen.families.fused_mlp.cuda import CudaMLP
    from kgen.runtime.op import error_ratio, poisoned

    v = _user_cuda(key)
    widths, dtype = tuple(v.params["widths"]), getattr(torch, v.dtype)
    impl = fm.implementation(dispatch.load(v), widths)
    assert type(impl) is CudaMLP
    companion, impl.triton = impl.triton, None  # (the companion never runs these calls)
    try:
        for B, acts in ((1, ("relu", "none")), (777, ("silu", "sigmoid")), (50001, ("gelu", "relu"))):
            x, ws, bs = fm.make_inputs("cuda", dtype, B, widths, seed=B, bias=[i % 2 == 0 for i in range(len(widths) - 1)])
            copies = impl.unpitched(ws)
            assert impl.takes(x, ws, bs, pitch=False) and impl.takes(x, ws, bs) == (not copies)
            got = poisoned((B, widths[-1]), dtype, "cuda")
            launch.forward(impl, x, ws, bs, *acts, out=got)
            assert error_ratio(got, fm.reference(x, ws, bs, *acts), TOL[v.dtype]) <= 1, (key, B)
            assert torch.equal(launch.forward(impl, x, ws, bs, *acts)[0], got)
            if copies:
                padded = [launch.row_padded(w, -(-w.shape[1] // 8) * 8) for w in ws]
                assert torch.equal(launch.forward(impl, x, padded, bs, *acts)[0], got)
                for i in copies:  # each weight changed in place right before the call
                    ws[i].mul_(-0.5)
                    now = launch.forward(impl, x, ws, bs, *acts)[0]
                    padded = [launch.row_padded(w, -(-w.shape[1] // 8) * 8) for w in ws]
                    assert torch.equal(now, launch.forward(impl, x, padded, bs, *acts)[0]), (key, B, i)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = launch.forward(impl, x, ws, bs, *acts)[0]
                for w in ws:
                    w.mul_(1.5)
                g.replay()
                padded = [launch.row_padded(w, -(-w.shape[1] // 8) * 8) for w in ws]
                assert torch.equal(out, launch.forward(impl, x, padded, bs, *acts)[0]), (key, B)
    finally:
        impl.triton = companion


@pytest.mark.gpu
def test_gpu_graph_replay():
    m = FusedMLP([367, 512, 256, 1], last_activation="sigmoid", dtype=torch.bfloat16, device="cuda")
    x = torch.randn(2048, 367, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        m(x)  # build outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = m(x)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_split_counters_per_stream_and_in_graphs():
    """A split variant's row-tile counters: the current stream's own buffer, back at zero after
    every launch; another stream's launches, running beside them, use another buffer and give
    the same bits; a CUDA graph captures a zeroed buffer of its own (its replays agree too)."""
    from kgen.families.fused_mlp import launch

    mod = dispatch.load(SPEC.variant("triton_367x512x256x1_m16_k64_w4_sp4_bf16")).module
    x, ws, bs = fm.make_inputs("cuda", torch.bfloat16, 1000, (367, 512, 256, 1))
    ref = fm.eager(x.double(), [w.double() for w in ws], [b.double() for b in bs], "relu", "sigmoid")[0]
    want = launch.forward(mod, x, ws, bs, "relu", "sigmoid")[0]
    torch.testing.assert_close(want.double(), ref, rtol=TOL["bfloat16"].rtol, atol=TOL["bfloat16"].atol)
    run = fm.op.runner(mod, x, ws, bs, "relu", "sigmoid")  # the eager fast path (its replay takes the counters)
    assert torch.equal(run(), want) and torch.equal(run(), want)
    mine = launch.split_counters(x.device, 63)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    outs, theirs = [], []
    with torch.cuda.stream(side):
        theirs = launch.split_counters(x.device, 63)
    for _ in range(20):  # (both streams' launches queued at once: they overlap on the GPU)
        outs.append(launch.forward(mod, x, ws, bs, "relu", "sigmoid")[0])
        with torch.cuda.stream(side):
            outs.append(launch.forward(mod, x, ws, bs, "relu", "sigmoid")[0])
    torch.cuda.synchronize()
    assert theirs.data_ptr() != mine.data_ptr() and not mine.any() and not theirs.any()
    assert all(torch.equal(o, want) for o in outs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = launch.forward(mod, x, ws, bs, "relu", "sigmoid")[0]
    for _ in range(3):
        g.replay()
        outs.append(launch.forward(mod, x, ws, bs, "relu", "sigmoid")[0])
    torch.cuda.synchronize()
    assert torch.equal(captured, want) and all(torch.equal(o, want) for o in outs) and not mine.any()


@pytest.mark.gpu
def test_gpu_row_padded_weights_read_in_place():
    """A row-padded W0 (DLRM top, bf16, launch.row_padded: rows 368 apart) goes to an exact
    Triton kernel as it is: one launch a call, through the fast path too (no pad), the same
    bits as contiguous weights; a CUDA variant reads it in place too (cuda.row_stride)."""
    from kgen.families.fused_mlp import launch

    x, ws, bs = fm.make_inputs("cuda", torch.bfloat16, 1000, (367, 512, 256, 1))
    padded = [launch.row_padded(ws[0], 368), *ws[1:]]
    assert padded[0].stride() == (368, 1)
    for name in ("triton_367x512x256x1_m32_k64_w4_sp2_bf16", "triton_367x512x256x1_m16_k64_w4_bf16",
                 "sm90_367x512x256x1_c8_m16_w16_bf16", "sm90a_367x512x256x1_c8_m64_w4_bf16"):
        mod = fm.implementation(dispatch.load(SPEC.variant(name)), (367, 512, 256, 1))
        if name.startswith("triton"):
            _, _, launches, _, _ = launch._plan(mod, x, padded, bs, "relu", "sigmoid", False, None)
            assert len(launches) == 1
        else:
            assert mod.takes(x, padded, bs)
        with torch.no_grad():
            want = launch.forward(mod, x, ws, bs, "relu", "sigmoid")[0]
            assert torch.equal(launch.forward(mod, x, padded, bs, "relu", "sigmoid")[0], want)
            run = fm.op.runner(mod, x, padded, bs, "relu", "sigmoid")
            assert torch.equal(run(), want) and torch.equal(run(), want)


@pytest.mark.gpu
def test_gpu_row_padded_weight_under_tf32_keeps_the_fast_path(monkeypatch):
    """Float32 with TF32 on copies every weight rounded (the copy kernel reads them dense), so
    a row-padded W0 is not read in place there: the fast path copies it contiguous each call
    (it used to give the call to the general path: ~100 us of host time a call). Same bits as
    the dense weights, call after call, through launch.direct and FusedMLP(pad_weights=True)."""
    from kgen.families.fused_mlp import launch

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    widths = (367, 512, 256, 1)
    x, ws, bs = fm.make_inputs("cuda", torch.float32, 300, widths)
    padded = [launch.row_padded(ws[0], 368), *ws[1:]]
    mod = fm.implementation(dispatch.load(SPEC.variant("triton_367x512x256x1_m16_k64_w4_f32")), widths)
    assert not launch.in_place(mod, x, padded[0], 0)
    with torch.no_grad():
        want = launch.forward(mod, x, ws, bs, "relu", "sigmoid")[0]
        assert torch.equal(launch.forward(mod, x, padded, bs, "relu", "sigmoid")[0], want)
        fast = launch.direct(mod, x, padded, bs, "relu", "sigmoid")
        assert fast is not None
        padded[0].mul_(0.5)  # the copy is made each call: an in-place change is seen
        want = launch.forward(mod, x, [padded[0].contiguous(), *ws[1:]], bs, "relu", "sigmoid")[0]
        assert torch.equal(fast(x, padded, bs), want) and torch.equal(fast(x, padded, bs), want)
        dense = FusedMLP(widths, last_activation="sigmoid", device="cuda")
        pw = FusedMLP(widths, last_activation="sigmoid", device="cuda", pad_weights=True)
        pw.load_state_dict(dense.state_dict())
        assert pw.weights[0].stride() == (368, 1)
        want = dense(x)
        assert all(torch.equal(pw(x), want) for _ in range(3))


@pytest.mark.gpu
def test_gpu_compile_dlrm_forward_backward():
    class DLRMish(nn.Module):
        def __init__(self):
            super().__init__()
            self.bot = FusedMLP([13, 512, 256, 64, 16], last_activation="relu", dtype=torch.bfloat16, device="cuda")
            self.top = FusedMLP([16 + 351, 512, 256, 1], last_activation="sigmoid", dtype=torch.bfloat16,
                                device="cuda")

        def forward(self, dense, sparse):
            return self.top(torch.cat([self.bot(dense), sparse], dim=1))

    torch.manual_seed(0)
    model = DLRMish()
    dense = torch.randn(1000, 13, device="cuda", dtype=torch.bfloat16)
    sparse = torch.randn(1000, 351, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(dense, sparse)
    out.float().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(dense, sparse)
    ref.float().sum().backward()
    torch.testing.assert_close(out, ref)
    # The compiled step runs the op, whose backward is backward_lean (torch GEMMs and
    # dz.sum(0)); the eager one, after it, the training fast path and its fused backward
    # kernels: the same roundings, sums in another order, so a bf16 gradient element may move
    # by an ulp of the gradient's largest element (2^-8 ~ 4e-3; 1e-2 allowed, as the fused
    # backward's own tests compare them). Elementwise bf16 tolerances failed on a small bias
    # element (3e-5 absolute, 2.5 % of it) with unseeded inputs on an H100.
    for g, p in zip(grads, model.parameters()):
        scale = float(p.grad.abs().max()) or 1.0
        torch.testing.assert_close(g / scale, p.grad / scale, rtol=0, atol=1e-2)


def test_autocast_takes_fp32_parameters_like_nn_linear():
    """Under torch.autocast (CPU: bfloat16), bf16 activations with float32 weights and
    biases work as nn.Linear's layers do: the op sees them in bf16 (equal to casting by
    hand) and the float32 parameters get float32 gradients."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 13, generator=g).bfloat16().requires_grad_()
    ws = [(torch.randn(9, 13, generator=g) / 4).requires_grad_(), (torch.randn(3, 9, generator=g) / 3).requires_grad_()]
    bs = [torch.randn(9, generator=g).requires_grad_(), None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.fused_mlp(x, ws, bs, activation="relu")
    out.float().sum().backward()
    want = ops.fused_mlp(x.detach(), [w.detach().bfloat16() for w in ws], [bs[0].detach().bfloat16(), None])
    assert out.dtype == torch.bfloat16 and torch.equal(out.detach(), want)
    assert all(w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all() for w in ws)
    assert bs[0].grad.dtype == torch.float32


# ------------------------------------------------------------------ CPU: the eager fast path


def _faked(name):
    """A variant's module whose Triton kernels are FakeTriton JITFunctions (test_triton_launch):
    "compiles" keyed by Triton's own specialisation, every launch recorded."""
    from types import SimpleNamespace

    from test_triton_launch import FakeTriton

    real = _module(name)
    ns = {k: getattr(real, k) for k in ("EXACT", "BLOCK_M", "BLOCK_K", "NUM_WARPS", "NUM_STAGES")}
    ns["SCRATCH_WIDTH"] = getattr(real, "SCRATCH_WIDTH", 0)
    fakes = {}
    for k in _kernels(real):
        fakes[k.fn.__name__] = FakeTriton(k.fn, do_not_specialize=["B", "bias_mask", "act", "last_act", "save"])
        ns[k.fn.__name__] = fakes[k.fn.__name__].jit
    if real.EXACT:  # the weight pads (WEIGHT_STRIDES)
        ns["WEIGHT_STRIDES"] = real.WEIGHT_STRIDES
        fakes["pad_rows_kernel"] = FakeTriton(real.pad_rows_kernel.fn)
        ns["pad_rows_kernel"] = fakes["pad_rows_kernel"].jit
    if hasattr(real, "tf32_weights_kernel"):  # float32: the TF32-rounded weights
        fakes["tf32_weights_kernel"] = FakeTriton(real.tf32_weights_kernel.fn)
        ns["tf32_weights_kernel"] = fakes["tf32_weights_kernel"].jit
    return SimpleNamespace(**ns), fakes


def _as_ints(args):
    return [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]


FAST_CASES = [  # variant, widths, biases, TF32, activations
    ("triton_367x512x256x1_m32_k64_w8_bf16", (367, 512, 256, 1), True, True, ("relu", "sigmoid")),
    # float32 with TF32 off: the "tf32x3" kernel, with its two scratch halves
    ("triton_13x512x256x64x16_m64_k64_w8_f32", (13, 512, 256, 64, 16), [True, False, True, False], False,
     ("gelu", "none")),
    ("triton_mw4096_m32_k64_w4_bf16", (13, 100, 37, 5), [False, True, True], True, ("silu", "relu")),  # scratch
    # float32 with TF32 on: every weight from its TF32-rounded copy, made by one launch first
    ("triton_367x512x256x1_m64_k64_w8_f32", (367, 512, 256, 1), True, True, ("relu", "sigmoid")),
    ("triton_mw4096_m32_k64_w4_f32", (13, 100, 37, 5), [False, True, True], True, ("silu", "relu")),
]


@pytest.mark.parametrize("name,widths,bias,tf32,acts", FAST_CASES, ids=lambda c: str(c)[:40])
def test_fast_path_launches_what_the_general_path_does(monkeypatch, name, widths, bias, tf32, acts):
    """The op's eager fast path (launch.direct through op._FAST) launches the binary the
    general path (launch.forward through triton_launch) launched, with the same grid and
    arguments (pointers as integers; only the output and scratch buffers new, the scratch
    halves at the same offsets), and steps aside for gradients, `using`, autocast, tracing,
    non-contiguous or unaligned inputs and signatures it has not seen."""
    from kgen.runtime import triton_launch as tlaunch

    monkeypatch.setattr(tlaunch, "current_device", lambda: None)  # x's device index on the CPU
    monkeypatch.setattr(tlaunch, "current_raw_stream", lambda index: 77)
    monkeypatch.setattr(fm.op, "_FAST", CallMemo())
    tlaunch.clear()
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        _fast_path_case(monkeypatch, name, widths, bias, tf32, acts)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _fast_path_case(monkeypatch, name, widths, bias, tf32, acts):
    mod, fakes = _faked(name)
    kname = "fused_mlp_fwd_kernel_x3" if not tf32 and name.endswith("_f32") else "fused_mlp_fwd_kernel"
    fake = fakes[kname]
    x, ws, bs = fm.make_inputs("cpu", getattr(torch, SPEC.variant(name).dtype), 6, widths, bias=bias)
    x = x.reshape(2, 3, widths[0])
    out, _ = fm.forward(mod, x.reshape(6, widths[0]), ws, bs, *acts)
    general = fake.launches[-1]
    assert general[0] == "plain" and out.shape == (6, widths[-1])
    fm.forward(mod, x.reshape(6, widths[0]), ws, bs, *acts)  # the general path again: direct now
    assert fake.launches[-1][0] == "direct" and fake.launches[-1][1] is general[1]

    fm.op._remember(mod, x, ws, bs, *acts)
    assert len(fm.op._FAST) == 1
    n = len(fake.launches)
    got = ops.fused_mlp(x, ws, bs, activation=acts[0], last_activation=acts[1])
    assert len(fake.launches) == n + 1
    kind, binary, grid, stream, _, args = fake.launches[-1]
    assert kind == "direct" and binary is general[1] and stream == 77
    assert grid == (*general[2], 1, 1)[:3] and grid[0] == -(-6 // mod.BLOCK_M)
    assert got.shape == (2, 3, widths[-1]) and got.dtype == x.dtype and got.is_contiguous()
    want = _as_ints(general[5])
    args = list(args)
    assert args[1] == got.data_ptr()
    # the scratch halves (general: slices of one buffer): the same offsets from a new buffer
    scratch = [i for i, a in enumerate(general[5]) if isinstance(a, torch.Tensor) and i > 1
               and a.data_ptr() not in {t.data_ptr() for t in (x, *ws, *(b for b in bs if b is not None))}]
    padded = [i for i, w in enumerate(ws) if mod.EXACT and mod.WEIGHT_STRIDES[i] != w.shape[1]]
    assert padded == ([0] if widths[0] == 367 else [])  # W0's rows not whole 16-byte vectors: a 368-wide copy
    rounded = tf32 and name.endswith("_f32")  # every weight from a TF32-rounded copy in the scratch
    assert bool(scratch) == (kname.endswith("x3") or not mod.EXACT or bool(padded) or rounded)
    for i in scratch:
        assert args[i] - args[scratch[0]] == want[i] - want[scratch[0]]
    for i in [] if rounded else padded:  # pad_rows replayed first: this call's weight into this call's scratch
        pad = fakes["pad_rows_kernel"].launches[-1]
        assert pad[0] == "direct" and pad[5][:2] == (ws[i].data_ptr(), args[4 + 3 * i])
    if rounded:  # tf32_weights replayed first: this call's weights into this call's scratch, in pairs
        t = fakes["tf32_weights_kernel"].launches[-1]
        w_at = [(4 if mod.EXACT else 2) + 3 * i for i in range(len(ws))]  # the forward's weight arguments
        assert t[0] == "direct" and all(a in scratch for a in w_at)
        assert t[5][:2 * len(ws)] == tuple(v for w, a in zip(ws, w_at) for v in (w.data_ptr(), args[a]))
    same = [i for i in range(len(args)) if i != 1 and i not in scratch]
    assert [args[i] for i in same] == [want[i] for i in same]
    assert all(type(a) is not torch.Tensor for a in args)

    # the general path serves these (CPU tensors: the eager composition; no kernel launch)
    def op(x, ws=ws, bs=bs):
        return ops.fused_mlp(x, ws, bs, activation=acts[0], last_activation=acts[1])

    storage = torch.empty(x.numel() + 1, dtype=x.dtype)
    unaligned = storage[1:].view(x.shape).copy_(x)
    for args_ in [(x.transpose(0, 1).contiguous().transpose(0, 1),), (unaligned,), (x[:1],),
                  (x.clone().requires_grad_(),), (x, [w.clone().requires_grad_() for w in ws])]:
        op(*args_)
    with fm.using(None):
        op(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        op(x.bfloat16() if x.dtype == torch.bfloat16 else x)
    monkeypatch.setattr(fm.op, "_compiling", lambda: True)
    op(x)
    monkeypatch.setattr(fm.op, "_compiling", torch.compiler.is_compiling)
    assert len(fake.launches) == n + 1
    params = [nn.Parameter(w) for w in ws]
    op(x, params)  # parameters (a signature of their own) needing gradients: the op
    assert len(fake.launches) == n + 1
    fm.op._remember(mod, x, params, bs, *acts)
    with torch.no_grad():  # no gradient needed: the fast path
        op(x, params)
    assert len(fake.launches) == n + 2 and len(fm.op._FAST) == 2


def test_fast_path_cache_is_bounded(monkeypatch):
    from kgen.runtime import triton_launch as tlaunch

    monkeypatch.setattr(tlaunch, "current_device", lambda: None)
    monkeypatch.setattr(tlaunch, "current_raw_stream", lambda index: 77)
    monkeypatch.setattr(fm.op, "_FAST", CallMemo(2))
    tlaunch.clear()
    mod, _ = _faked("triton_367x512x256x1_m32_k64_w8_bf16")
    for B in (1, 2, 3, 4, 5):
        x, ws, bs = fm.make_inputs("cpu", torch.bfloat16, B, (367, 512, 256, 1))
        fm.forward(mod, x, ws, bs, "relu", "none")
        fm.op._remember(mod, x, ws, bs, "relu", "none")
        assert 1 <= len(fm.op._FAST) <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("widths,acts,dtype,tf32,B", [
    # the DLRM MLPs in bf16 at a B whose tuned winner (H100 and H200 tables) is a Triton
    # variant: at B <= 2048 the H100's is the CUDA cluster variant, no Triton launch
    ((367, 512, 256, 1), ("relu", "sigmoid"), torch.bfloat16, True, 16384),
    ((13, 512, 256, 64, 16), ("relu", "relu"), torch.bfloat16, True, 16384),
    ((13, 512, 256, 64, 16), ("gelu", "none"), torch.float32, False, 128),  # the "tf32x3" kernel, scratch
    ((13, 100, 37, 5), ("silu", "relu"), torch.bfloat16, True, 128),  # a generic variant, scratch
])
def test_gpu_fast_path_bit_identical_graph_and_compile(widths, acts, dtype, tf32, B):
    """The eager fast path and triton_launch's direct launches give the plain Triton
    launch's output bit for bit; they run under CUDA-graph capture (and the replay computes
    the new input), step aside for a profiler's launch hook and torch.compile(fullgraph)."""
    from kgen.runtime import triton_launch as tlaunch

    assert tlaunch.disabled() is None, tlaunch.disabled()
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    x, ws, bs = fm.make_inputs("cuda", dtype, B, widths, bias=[i % 2 == 0 for i in range(len(widths) - 1)])
    mod = fm.module_for(x.device, dtype, widths, B)
    assert mod.__class__.__name__ != "CudaMLP"  # a Triton variant runs
    # launches a call: a pad_rows for each weight read from a padded copy, then the forward
    per_call = 1 + sum(s != w.shape[1] for s, w in zip(getattr(mod, "WEIGHT_STRIDES", ()), ws))

    def call(t):
        return ops.fused_mlp(t, ws, bs, activation=acts[0], last_activation=acts[1])

    try:
        with torch.no_grad():
            fm.op.FAST_PATH = False
            tlaunch.set_enabled(False)
            plain = call(x)
            tlaunch.set_enabled(True)
            general = [call(x) for _ in range(2)]  # Triton's launch, then a direct one
            fm.op.FAST_PATH = True
            before = dict(tlaunch.STATS)
            outs = [call(x) for _ in range(3)]  # the op (remembers the signature), then the fast path
            assert tlaunch.STATS["direct"] - before["direct"] >= 3 and len(fm.op._FAST) >= 1
            for o in general + outs:
                assert torch.equal(o, plain)

            g = torch.cuda.CUDAGraph()
            n = tlaunch.STATS["direct"]
            with torch.cuda.graph(g):
                captured = call(x)
            assert tlaunch.STATS["direct"] == n + per_call  # the fast path was captured
            x.copy_(torch.randn_like(x))
            for w in ws:  # weights changed in place: the replay's pads copy them again
                w.neg_()
            g.replay()
            fm.op.FAST_PATH = False
            tlaunch.set_enabled(False)
            assert torch.equal(captured, call(x))
            tlaunch.set_enabled(True)
            fm.op.FAST_PATH = True

            from triton import knobs

            seen = []
            hook = seen.append
            knobs.runtime.launch_enter_hook.add(hook)
            try:
                n = tlaunch.STATS["direct"]
                assert torch.equal(call(x), captured)
                assert len(seen) == per_call and tlaunch.STATS["direct"] == n  # Triton's launches ran, with its hook
            finally:
                knobs.runtime.launch_enter_hook.remove(hook)

            compiled = torch.compile(call, fullgraph=True)
            assert torch.equal(compiled(x), captured)
    finally:
        fm.op.FAST_PATH = True
        tlaunch.set_enabled(True)
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32


def test_module_reset_parameters_initialises_as_nn_linear():
    """FusedMLP.reset_parameters (meta-device construction, then to_empty, then
    reset_parameters: the deferred-initialisation recipe): each layer drawn as nn.Linear
    draws its own from the same generator state."""
    m = FusedMLP([13, 40, 7], device="meta").to_empty(device="cpu")
    torch.manual_seed(4)
    m.reset_parameters()
    torch.manual_seed(4)
    lins = [nn.Linear(13, 40), nn.Linear(40, 7)]
    for i, lin in enumerate(lins):
        assert torch.equal(m.weights[i], lin.weight) and torch.equal(m.biases[i], lin.bias)
