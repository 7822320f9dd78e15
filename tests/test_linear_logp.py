"""linear_logp: the Triton kernels under the interpreter (CPU) against a float64 reference,
the op's checks and registration. GPU tests: test_linear_logp_gpu.py."""

import functools
import math
import random

import pytest
import torch

from kgen import ops, render as render_mod, spec
from kgen.families import linear_logp as llp
from kgen.families.linear_logp import backward_launch, cuda_variant, launch, plans
from kgen.runtime import dispatch
from tf32_rounding import tf32_rounded

if torch.cuda.is_available():
    pytest.skip("interpreter tests (CPU tensors); the GPU ones are in test_linear_logp_gpu.py",
                allow_module_level=True)


def make_variant(dtype="float32", BLOCK_N=16, BLOCK_V=32, BLOCK_D=16, NUM_WARPS=4, NUM_STAGES=2, SPLIT_V=2):
    text = (f"family: linear_logp\nvariants:\n  - {{backend: triton, block_n: {BLOCK_N}, block_v: {BLOCK_V}, "
            f"block_d: {BLOCK_D}, num_warps: {NUM_WARPS}, num_stages: {NUM_STAGES}, split_v: {SPLIT_V}}}\n")
    return next(v for v in spec.parse(text, "tests/linear_logp_small.yaml").variants if v.dtype == dtype)


@functools.cache
def variant(**knobs):
    """A small-tile variant rendered by kgen and loaded through the cache, interpreted here."""
    return dispatch.load(make_variant(**knobs)).module


def call(mod, *args, **kwargs):
    """The public op with this kernel module (None: the PyTorch reference)."""
    with llp.using(mod):
        return ops.linear_logp(*args, **kwargs)



# Lanes of rows past N (masked, never stored) compute log2(0) and inf - inf in numpy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def make_inputs(N, V, D, dtype=torch.float32, bias=True, ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(dtype)
    # Logit spread of a few units, like a trained head: exercises the online max.
    weight = (torch.randn(V, D, generator=g) * (2.0 / math.sqrt(D))).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, V, (N,), generator=g)
    if ignore and N > 1:
        target[::3] = -100
    return hidden, weight, target, b


def run(mod, hidden, weight, target, bias, temperature=0.7, entropy=True, seed=1, oracle=False, **op_kwargs):
    """Forward + backward with random upstream gradients for both outputs; oracle: the
    float64 reference instead of `mod`; op_kwargs: the op's other keywords."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    if oracle:
        logp, ent = llp.reference(h, w, target, b, temperature=temperature, compute=torch.float64)
        ent = ent if entropy else None
    else:
        out = call(mod, h, w, target, b, temperature=temperature, return_entropy=entropy, **op_kwargs)
        logp, ent = out if entropy else (out, None)
    g = torch.Generator().manual_seed(seed)
    g_logp = torch.randn(logp.shape, generator=g)
    g_ent = torch.randn(logp.shape, generator=g)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0)
    loss.backward()
    return logp, ent, h.grad, w.grad, (b.grad if b is not None else None)


def assert_close(actual, expected, rtol, atol, what):
    if expected is None:
        assert actual is None, what
        return
    assert actual.shape == expected.shape, what
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=what)


def check_against_reference(mod, hidden, weight, target, bias, temperature=0.7, entropy=True, **op_kwargs):
    got = run(mod, hidden, weight, target, bias, temperature, entropy, **op_kwargs)
    want = run(None, hidden, weight, target, bias, temperature, entropy, oracle=True)
    for name, a, e in zip(("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"), got, want):
        if name.startswith("grad"):
            assert a is None or a.dtype == hidden.dtype, name
            rtol, atol = GRAD_TOL[hidden.dtype]
            # Judged against the size of the whole gradient, not element by element.
            atol *= 1.0 if e is None else max(1.0, e.abs().max().item())
        else:
            assert a is None or a.dtype == torch.float32, name
            rtol, atol = OUT_TOL
        assert_close(a, e, rtol, atol, name)


# Tolerances vs float64 on the same (exactly representable) inputs. The interpreter runs
# tl.dot in float32 through numpy, so float32 rounding of D- and V-long sums is ~1e-6
# relative (observed <= 5e-7 of scale): logp and entropy, float32 for every input dtype.
OUT_TOL = (2e-5, 2e-5)
# Gradients: float32 inputs as above. 16-bit inputs round dz to 16 bits before the two
# gradient GEMMs and round the outputs (2^-9 bf16, 2^-12 fp16 per element, then summed
# over V or N): observed up to 1.3e-2 of scale for bf16 and 8e-4 for fp16.
GRAD_TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@pytest.mark.parametrize("N", [1, 7, 33])
@pytest.mark.parametrize("V", [1, 50, 257])
@pytest.mark.parametrize("D", [16, 40])
def test_matches_float64_reference(N, V, D):
    """Bias, ignored rows, temperature 0.7, entropy, random upstream gradients."""
    check_against_reference(variant(), *make_inputs(N, V, D))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("borrow", [False, True])
def test_half_precision(monkeypatch, dtype, borrow):
    """16-bit inputs with the float32 grad_hidden accumulator in its own buffer, or (borrow)
    in grad_weight's tail with one-tile V chunks (N=7, V=257: 2N rows fit in half of V)."""
    if borrow:
        monkeypatch.setattr(backward_launch, "WORKSPACE_BYTES", 1)
        monkeypatch.setattr(backward_launch, "ACCUMULATOR_BYTES", 0)
    check_against_reference(variant(), *make_inputs(7, 257, 40, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("N, V, D", [(1, 50, 16), (33, 257, 40), (7, 300, 36)])
def test_half_precision_tile_loads(monkeypatch, dtype, tma, N, V, D):
    """16-bit logit tiles through TMA tensor descriptors (boxes reaching past N, V and D,
    which TMA fills with zeros) and through masked pointer loads, forward and dz kernels.
    D = 36 (72-byte rows) is not whole 16-byte units: pointer loads either way."""
    monkeypatch.setattr(plans, "TMA", tma)
    inputs = make_inputs(N, V, D, dtype=dtype)
    assert llp._tma(inputs[0], inputs[1]) == (tma and D % 8 == 0)
    check_against_reference(variant(), *inputs)


def test_no_bias_no_entropy_temperature_one():
    check_against_reference(variant(), *make_inputs(33, 50, 40, bias=False), temperature=1.0,
                            entropy=False)


@pytest.mark.parametrize("used", ["entropy", "logp"])
def test_gradient_of_one_output_only(used):
    """A loss of one output: the other's gradient arrives as None (no zeros materialised),
    and the kernels give the float64 reference's gradients for it alone."""
    hidden, weight, target, bias = make_inputs(7, 257, 40)
    g = torch.randn(7, generator=torch.Generator().manual_seed(5))
    grads = []
    for mod, compute in ((variant(), None), (None, torch.float64)):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        if compute is None:
            logp, ent = call(mod, *leaves[:2], target, leaves[2], temperature=0.7, return_entropy=True)
        else:
            logp, ent = llp.reference(*leaves[:2], target, leaves[2], temperature=0.7, compute=compute)
        ((ent if used == "entropy" else logp) * g).sum().backward()
        grads.append([x.grad for x in leaves])
    for name, a, b in zip(("grad_h", "grad_w", "grad_b"), *grads):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b.double(), rtol=2e-5, atol=2e-5 * scale, msg=name)


def test_leading_dims_and_int32_target():
    hidden, weight, target, bias = make_inputs(12, 50, 16)
    logp, ent = call(variant(), hidden.reshape(3, 4, 16), weight, target.int().reshape(3, 4),
                                bias, temperature=1.3, return_entropy=True)
    ref_logp, ref_ent = llp.reference(hidden, weight, target, bias, temperature=1.3,
                                      compute=torch.float64)
    assert logp.shape == ent.shape == (3, 4)
    torch.testing.assert_close(logp.reshape(-1).double(), ref_logp, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent.reshape(-1).double(), ref_ent, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("split", [1, 3, 45, 64])
def test_split_v_invariance(split):
    """SPLIT_V 1, 3 and more than the 9 V tiles (empty slices; the combine reads 32 splits a
    step: 45 leaves a partial last step) agree up to rounding."""
    hidden, weight, target, bias = make_inputs(33, 257, 40)
    base = run(variant(SPLIT_V=2), hidden, weight, target, bias)
    other = run(variant(SPLIT_V=split), hidden, weight, target, bias)
    # Only the merge order of the per-slice sums differs: lse moves by float32 rounding
    # (~1e-7 relative, times |logits| ~ 15 here), which the gradients carry: 1e-6 of scale.
    for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w", "grad_b"), base, other):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale, msg=name)


def backward_args(mod, N, dtype, seed, bias=True):
    """llp.backward's arguments after a forward at (N, V = 257, D = 40), temperature 0.7,
    with entropy and random upstream gradients for both outputs."""
    hidden, weight, target, bias = make_inputs(N, 257, 40, dtype=dtype, bias=bias)
    logp, ent, lse2, ez2 = llp.forward(mod, hidden, weight, target, bias, 0.7, -100, True)
    g = torch.Generator().manual_seed(seed)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return mod, hidden, weight, target, bias, lse2, ez2, g_logp, g_ent, 0.7, -100


@pytest.mark.parametrize("N, D, V, dtype, want", [
    (8192, 4096, 128256, torch.bfloat16, ("tail", 4096, 128256 - 8192)),  # alias_from rounded down to 256
    (4096, 2048, 151936, torch.bfloat16, ("separate", 2048, 151936)),  # the other 2048 rows: 16 MiB
    (512, 1024, 32000, torch.float16, ("direct", 0, 32000)),  # dz of all V in 31 MiB: one GEMM, no sums
    (1024, 1024, 32000, torch.float16, ("separate", 0, 32000)),  # 4 MiB of sums: all rows in one buffer
    (16384, 4096, 32000, torch.bfloat16, ("tail", 8192, 15616)),  # 16384 tail rows of 32000
    (65536, 1024, 32000, torch.bfloat16, ("rows", 0, 32000)),  # 65536 tail rows > V
    (1000, 512, 5000, torch.float32, ("output", 0, 5000)),
])
def test_accumulator_plan(N, D, V, dtype, want):
    plan = plans.accumulator_plan(N, D, V, dtype, 256, backward_launch.ACCUMULATOR_BYTES,
                                  backward_launch.WORKSPACE_BYTES)
    assert (plan.home, plan.own_rows, plan.alias_from) == want
    assert plan.alias_from % 256 == 0 or plan.alias_from == V
    if plan.home == "tail":  # the rows past own_rows fit in grad_weight's rows from alias_from on
        assert (N - plan.own_rows) * D * 4 <= (V - plan.alias_from) * D * 2
    if plan.home == "rows":  # the whole vocabulary for 896 rows a block in the workspace: no sums kept
        assert (plan.row_block, plan.block_width, plan.separate_bytes) == (896, V, 0)
        assert plan.row_block * V * 2 <= backward_launch.WORKSPACE_BYTES
    assert plan.separate_bytes <= backward_launch.ACCUMULATOR_BYTES


def check_schedule(chunks, N, D, V, esize, granule, chunk, free_until, extra_rows):
    """plans.chunk_schedule's contract: [0, V) covered in order with an edge at free_until;
    the in-place chunks first, wider than the workspace, granule multiples, their dz and
    bias sums 16-byte aligned in grad_weight rows >= v1 and < free_until, each as wide as
    fits; then workspace chunks, all granule multiples but the last."""
    assert chunks[0].v0 == 0 and chunks[-1].v1 == V
    assert all(a.v1 == b.v0 for a, b in zip(chunks, chunks[1:]))
    assert all(c.v0 < c.v1 for c in chunks)
    assert free_until in [c.v1 for c in chunks]
    wide = [c for c in chunks if c.at is not None]
    assert chunks[:len(wide)] == wide
    rows = N + extra_rows
    for c in wide:
        width = c.v1 - c.v0
        assert width % granule == 0 and width > chunk
        assert c.at >= c.v1 * D and c.at * esize % 16 == 0
        assert c.at + rows * plans.dz_stride(width) <= free_until * D
        # one granule more would not fit
        at = -(-(c.v1 + granule) * D * esize // 16) * 16 // esize
        assert at + rows * plans.dz_stride(width + granule) > free_until * D
    assert all(c.v1 - c.v0 <= chunk for c in chunks[len(wide):])
    assert all((c.v1 - c.v0) % granule == 0 for c in chunks[:-1])
    return wide


# Chunks (before: workspace ones only, after) and in-place chunks at the benchmark shapes,
# bf16, default budgets, granule 256, no bias: the float32 sums (8*N*D bytes a chunk) are
# read and written 3.3x, 3.1x and 2.5x less at three of them; N = 16384 > 4*D leaves
# little room.
SCHEDULES = {
    (4096, 2048, 151936): (30, 9, [50432, 33792, 22528, 14848, 9984, 6656]),
    (8192, 4096, 128256): (37, 12, [39936, 26624, 17664, 11776, 7936, 5376]),
    (16384, 4096, 32000): (19, 18, [3072, 2304, 2048]),
    (2048, 8192, 128256): (10, 4, [100864, 20224]),
}


@pytest.mark.parametrize("shape", SCHEDULES)
def test_chunk_schedule_at_benchmark_shapes(shape):
    N, D, V = shape
    before, after, widths = SCHEDULES[shape]
    plan = plans.accumulator_plan(N, D, V, torch.bfloat16, 256, backward_launch.ACCUMULATOR_BYTES,
                                  backward_launch.WORKSPACE_BYTES)
    chunk = plans.workspace_chunk(N, V, 2, 256, backward_launch.WORKSPACE_BYTES - plan.separate_bytes)
    old = plans.chunk_schedule(N, D, V, 2, 256, chunk, plan.alias_from, in_place=False)
    new = plans.chunk_schedule(N, D, V, 2, 256, chunk, plan.alias_from)
    assert all(c.at is None for c in old)
    check_schedule(old, N, D, V, 2, 256, chunk, plan.alias_from, 0)
    wide = check_schedule(new, N, D, V, 2, 256, chunk, plan.alias_from, 0)
    assert (len(old), len(new), [c.v1 - c.v0 for c in wide]) == (before, after, widths)
    # after the in-place chunks, workspace chunks as before, from where they end
    v = wide[-1].v1
    rest = backward_launch._chunks(v, plan.alias_from, chunk) + backward_launch._chunks(plan.alias_from, V, chunk)
    assert [(c.v0, c.v1) for c in new[len(wide):]] == rest
    # with bias, 2 * cdiv(N, 128) rows of bias sums after each dz: about as wide
    bias_rows = 2 * -(-N // 128)
    with_bias = plans.chunk_schedule(N, D, V, 2, 256, chunk, plan.alias_from, bias_rows)
    assert len(check_schedule(with_bias, N, D, V, 2, 256, chunk, plan.alias_from, bias_rows)) >= len(wide) - 1


def test_chunk_schedule_small_shapes():
    """Random small shapes in both element sizes; without room (N much larger than D, or a
    workspace as wide as what fits) the workspace chunks alone, as before."""
    rng = random.Random(0)
    seen = 0
    for _ in range(2000):
        N, D, V = rng.randrange(1, 300), rng.randrange(1, 300), rng.randrange(1, 3000)
        esize, granule = rng.choice((2, 4)), rng.choice((8, 16, 32))
        chunk = granule * rng.randrange(1, 8)
        # V, or a "tail" home's alias_from: a granule multiple
        free_until = min(V, rng.choice((V, max(granule, V // 2 // granule * granule))))
        extra = rng.randrange(0, 5)
        chunks = plans.chunk_schedule(N, D, V, esize, granule, chunk, free_until, extra)
        old = plans.chunk_schedule(N, D, V, esize, granule, chunk, free_until, extra, in_place=False)
        wide = check_schedule(chunks, N, D, V, esize, granule, chunk, free_until, extra)
        if not wide:
            assert chunks == old
        seen += bool(wide)
    assert seen > 500
    # no room: N >> D, or the workspace at least as wide as a chunk in place could be
    for args in ((4096, 64, 32000, 2, 256, 256, 32000), (1024, 1024, 32000, 2, 256, 16384, 32000)):
        assert plans.chunk_schedule(*args) == plans.chunk_schedule(*args, in_place=False)
        assert [(c.v0, c.v1) for c in plans.chunk_schedule(*args)] == backward_launch._chunks(0, args[-1], args[-2])


# Budgets that send the gradients at D = 40, V = 257 (granule 32, 32-column workspace
# chunks but where noted) to each home of the float32 sums: (N, dtype, bias,
# workspace_bytes, accumulator_bytes, expected plan, in-place chunks: their (v0, v1)).
BF16, F32 = torch.bfloat16, torch.float32
HOMES = {
    # the whole vocabulary's dz in the workspace: grad_hidden by one GEMM in bf16, no sums
    "direct": (7, BF16, True, 7 * 288 * 2, 0, ("direct", 0), []),
    "separate, all rows": (7, BF16, True, 1, 1 << 30, ("separate", 0), [(0, 192)]),
    # two in-place chunks, the second's dz over the first's (and the rows it wrote)
    "separate, all rows, N=33": (33, BF16, True, 1, 1 << 30, ("separate", 0), [(0, 128), (128, 192)]),
    "separate, all rows, no bias": (33, BF16, False, 1, 1 << 30, ("separate", 0), [(0, 128), (128, 192)]),
    "own buffer + separate": (7, BF16, True, 1, 700, ("separate", 3), [(0, 192)]),
    # sums of rows 3..6 in grad_weight rows 224..256: two tail chunks, the last one's dz
    # reused; the in-place chunk's dz ends before row 224
    "own buffer + grad_weight tail": (7, BF16, True, 1, 0, ("tail", 3), [(0, 160)]),
    # two in-place chunks: the second's dz ends at the tail's sums, which the first summed into
    "own buffer + grad_weight tail, N=16": (16, BF16, True, 1, 0, ("tail", 8), [(0, 128), (128, 192)]),
    "own buffer + grad_weight tail, no bias": (20, BF16, False, 1, 0, ("tail", 10), [(0, 128), (128, 192)]),
    # float32 (TF32 off: the Triton dW and dH kernels, reading dz with its row stride)
    "output, float32": (7, F32, True, 1, 0, ("output", 0), [(0, 192)]),
    "output, float32, N=33": (33, F32, True, 1, 0, ("output", 0), [(0, 128), (128, 192)]),
    # 64-row blocks with float32 sums over 192-column chunks
    "row blocks, chunked": (300, BF16, True, 300 * 2 * 64, 64 * 40 * 4, ("rows", 0), []),
    # 128-row blocks holding all 257 columns: grad_hidden written by one GEMM a block
    "row blocks, whole vocabulary": (300, BF16, True, 128 * 264 * 2, 64 * 40 * 4, ("rows", 0), []),
}


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("home", HOMES)
def test_backward_accumulator_homes(monkeypatch, home, in_place):
    """Each home of grad_hidden's float32 sums (several chunks; sums converted in place in
    grad_hidden's buffer, one row at a time; grad_weight's tail computed
    after grad_hidden; row blocks with a partial last one), with the first chunks' dz and
    bias sums in grad_weight's unwritten rows or (in_place False) all in the workspace,
    every buffer poisoned with NaN (a grad_weight row read before it is written shows),
    gives the gradients of a one-chunk backward with a separate accumulator."""
    N, dtype, bias, workspace, budget, (kind, own), wide = HOMES[home]
    mod = variant()
    plan = plans.accumulator_plan(N, 40, 257, dtype, 32, budget, workspace)
    assert (plan.home, plan.own_rows) == (kind, own)
    if home.startswith("row blocks"):
        assert (plan.row_block, plan.block_width) == ((128, 257) if "whole" in home else (64, 192))
    args = backward_args(mod, N, dtype, seed=3, bias=bias)
    one = llp.backward(*args, workspace_bytes=1 << 30, accumulator_bytes=1 << 30)
    monkeypatch.setattr(launch, "_empty", lambda shape, dt, dev: torch.full(shape, float("nan"), dtype=dt, device=dev))
    monkeypatch.setattr(backward_launch, "CONVERT_BYTES", 1)  # sums in grad_hidden's buffer converted row by row
    monkeypatch.setattr(backward_launch, "IN_PLACE", in_place)
    monkeypatch.setattr(backward_launch, "PLAN_CACHE", False)  # the plan made for this call: its schedule recorded
    schedules = []

    def recorded(*a, **k):
        schedules.append(plans.chunk_schedule(*a, **k))
        return schedules[-1]

    monkeypatch.setattr(backward_launch, "chunk_schedule", recorded)
    many = llp.backward(*args, workspace_bytes=workspace, accumulator_bytes=budget)
    assert [(c.v0, c.v1) for c in schedules[0] if c.at is not None] == (wide if in_place else [])
    assert all(torch.isfinite(t).all() for t in many if t is not None)
    # Same float32 sums, different chunk boundaries for grad_hidden's accumulation order;
    # outputs rounded to bf16 once, so at most one unit of its last place apart.
    tol = 8e-3 if dtype == BF16 else 2e-6
    for name, a, b in zip(("grad_h", "grad_w", "grad_b"), one, many):
        assert (a is None) == (b is None) == (not bias and name == "grad_b"), name
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)


# (N, dtype, bias, entropy, workspace_bytes, accumulator_bytes): the short path ("direct",
# N and V off every tile), each home of the float32 sums, row blocks, float32 and fp16.
PLAN_CASES = [(7, BF16, True, True, None, None), (7, BF16, False, False, None, None),
              (33, BF16, True, True, 1, 1 << 30), (16, BF16, False, True, 1, 0), (7, BF16, True, False, 1, 700),
              (300, BF16, True, True, 300 * 2 * 64, 64 * 40 * 4), (33, F32, True, True, 1, 0),
              (7, F32, False, True, None, None), (9, torch.float16, True, True, None, None)]


def _backward_case(mod, N, dtype, bias, entropy, workspace, budget):
    args = list(backward_args(mod, N, dtype, seed=5, bias=bias))
    if not entropy:
        args[8] = None  # grad_entropy: none requested
    return args, dict(workspace_bytes=workspace, accumulator_bytes=budget)


@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_backward_plan_cache_is_bitwise(monkeypatch, case):
    """A backward through a cached plan (its second call) gives the gradients of one that
    makes its plan anew (PLAN_CACHE off) bit for bit, and of the general path where the
    short one applies; the plan is made once per key."""
    mod = variant()
    args, budgets = _backward_case(mod, *case)
    monkeypatch.setattr(backward_launch, "_PLANS", {})
    monkeypatch.setattr(backward_launch, "PLAN_CACHE", False)
    fresh = llp.backward(*args, **budgets)
    monkeypatch.setattr(backward_launch, "PLAN_CACHE", True)
    made = []
    real = backward_launch._make_plan
    monkeypatch.setattr(backward_launch, "_make_plan", lambda *a: made.append(real(*a)) or made[-1])
    first = llp.backward(*args, **budgets)
    cached = llp.backward(*args, **budgets)
    assert len(made) == 1 and len(backward_launch._PLANS) == 1
    # the general path for the same plan (the short path's views and launches are its own)
    monkeypatch.setattr(backward_launch, "_PLANS", {})
    monkeypatch.setattr(backward_launch, "_make_plan", lambda *a: real(*a)._replace(one_chunk=False))
    general = llp.backward(*args, **budgets)
    # the short path: one chunk of all of V and cuBLAS's GEMMs (not float32's Triton dH)
    assert made[0].one_chunk == (budgets["workspace_bytes"] is None and not made[0].dh_cols), made[0].acc
    for name, *outs in zip(("grad_h", "grad_w", "grad_b"), fresh, first, cached, general):
        assert (outs[0] is None) == (not case[2] and name == "grad_b"), name
        if outs[0] is not None:
            assert torch.isfinite(outs[0]).all(), name
            assert all(torch.equal(outs[0], o) for o in outs[1:]), name


def test_backward_plan_key(monkeypatch):
    """What a plan depends on is in its key: a change of shape, dtype, bias, budgets,
    switches, precision, implementation or alignment (the CUDA dz kernel's condition) gets
    its own plan, equal to one made anew; the same call again gets the same plan object."""
    monkeypatch.setattr(backward_launch, "_PLANS", {})
    mod = variant()
    cuda = llp.CudaForward.__new__(llp.CudaForward)
    cuda.triton = mod
    cuda.takes_dz = lambda h, w, b: b is None and h.data_ptr() % 16 == 0 and cuda_variant.CUDA_DZ != "never"
    h, w, _, b = make_inputs(7, 257, 40, dtype=torch.bfloat16)
    odd = torch.empty(7 * 40 + 1, dtype=torch.bfloat16)[1:].view(7, 40)  # 2 bytes off 16
    odd.copy_(h)
    calls = [(mod, h, w, b, None, None), (mod, h, w, None, None, None), (mod, h[:5], w, b, None, None),
             (mod, h, w[:200], b, None, None), (mod, h.half(), w.half(), b.half(), None, None),
             (mod, h.float(), w.float(), b.float(), None, None), (mod, h, w, b, 1, None), (mod, h, w, b, 1, 0),
             (variant(SPLIT_V=3, BLOCK_V=64), h, w, b, None, None), (cuda, h, w, None, None, None),
             (cuda, odd, w, None, None, None), (cuda, h, w, b, None, None)]
    switches = [(backward_launch, "IN_PLACE", False), (backward_launch, "WORKSPACE_BYTES", 1),
                (backward_launch, "ACCUMULATOR_BYTES", 0),
                (cuda_variant, "CUDA_DZ", "never"), (cuda_variant, "CUDA_DZ_MAX_FLOP", 0),
                (torch.backends.cuda.matmul, "allow_tf32", not torch.backends.cuda.matmul.allow_tf32)]
    seen = {}
    for _ in range(2):
        for i, c in enumerate(calls):
            for s in [None] + switches:
                # (set and restored by hand: allow_tf32 is torch's C++ state, which
                # monkeypatch fails to restore; see the TF32 test below)
                saved = getattr(*s[:2]) if s is not None else None
                try:
                    if s is not None:
                        setattr(*s)
                    got = backward_launch.backward_plan(*c)
                    with monkeypatch.context() as m:
                        m.setattr(backward_launch, "PLAN_CACHE", False)
                        assert got == backward_launch.backward_plan(*c), (i, s)
                    assert seen.setdefault((i, s and s[1]), got) is got, (i, s)
                finally:
                    if s is not None:
                        setattr(*s[:2], saved)
    assert len(backward_launch._PLANS) == len({id(plan) for plan in seen.values()})  # (a switch may not change a key)
    assert calls[9][0] is cuda and seen[(9, None)].cuda is cuda and seen[(10, None)].cuda is None
    assert seen[(9, "CUDA_DZ")].cuda is None and seen[(9, None)].one_chunk


def test_float32_backward_chunks(monkeypatch):
    """float32 (TF32 off: the Triton dz kernel's "tf32x3" recompute; dW by cuBLAS, dH by the
    Triton kernel over transposed weight copies or by cuBLAS, DH_TRITON) over several chunks
    (some wider than the workspace: dH in pieces of its columns) equals one chunk, with every
    buffer poisoned first."""
    def poisoned(shape, dtype_, device):
        return torch.full(shape, float("nan") if dtype_.is_floating_point else 1 << 30, dtype=dtype_, device=device)

    monkeypatch.setattr(launch, "_empty", poisoned)
    args = backward_args(variant(), 7, torch.float32, seed=3)
    got = []
    for dh in (True, False):
        monkeypatch.setattr(backward_launch, "DH_TRITON", dh)
        for budget in (1 << 30, 1):
            plan = backward_launch.backward_plan(args[0], args[1], args[2], args[4], budget, budget)
            assert bool(plan.dh_cols) == dh and (budget > 1 or len(plan.chunks) > 1)
            if dh and budget == 1:
                assert any(c.v1 - c.v0 > plan.dh_cols for c in plan.chunks)  # pieces
            got.append(llp.backward(*args, workspace_bytes=budget, accumulator_bytes=budget))
    for i, grads in enumerate(got[1:]):
        for name, a, b in zip(("grad_h", "grad_w", "grad_b"), got[0], grads):
            assert torch.isfinite(b).all(), (name, i)
            torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-6, msg=f"{name} {i}")


def test_float32_tf32_dw_from_transposed_hidden(monkeypatch, tf32):
    """float32 with TF32 on over several chunks (some in grad_weight's unwritten rows):
    grad_weight's GEMMs read a transposed copy of hidden kept in grad_weight's last rows
    (backward_launch.HT_COPY, backward_plan's ht_from), the chunks over those rows hidden
    itself; with every buffer poisoned first, equal within float32 rounding to the same
    backward without the copy and to one chunk."""
    def poisoned(shape, dtype_, device):
        return torch.full(shape, float("nan") if dtype_.is_floating_point else 1 << 30, dtype=dtype_, device=device)

    monkeypatch.setattr(launch, "_empty", poisoned)
    tf32(True)
    args = backward_args(variant(), 7, torch.float32, seed=5)
    V = args[2].shape[0]
    got = []
    for ht, budget in ((True, 1), (False, 1), (True, 1 << 30)):
        monkeypatch.setattr(backward_launch, "HT_COPY", ht)
        plan = backward_launch.backward_plan(args[0], args[1], args[2], args[4], budget, budget)
        if budget == 1:
            assert (plan.ht_from < V) == ht and any(c.at is not None for c in plan.chunks)
            assert all(c.v1 <= plan.ht_from or c.v0 >= plan.ht_from for c in plan.chunks)
        else:
            assert plan.one_chunk and plan.ht_from == V
        got.append(llp.backward(*args, workspace_bytes=budget, accumulator_bytes=budget))
    for i, grads in enumerate(got[1:]):
        for name, a, b in zip(("grad_h", "grad_w", "grad_b"), got[0], grads):
            assert torch.isfinite(a).all() and torch.isfinite(b).all(), (name, i)
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, msg=f"{name} {i}")


@pytest.mark.parametrize("entropy", [True, False])
def test_float32_few_rows_take_the_logits_path(monkeypatch, entropy):
    """float32 at a few rows (launch.logits_path; on the GPU only, forced here): the logits
    by one GEMM and the `kept` kernels over them, forward and backward, with every buffer
    poisoned first: against float64, and within float32 rounding of the tile kernels
    (the same sums in another order); the tile kernels not launched."""
    def poisoned(shape, dtype_, device):
        if dtype_.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype_, device=device)
        return torch.full(shape, 1 << 30, dtype=dtype_, device=device)

    mod = variant()
    inputs = make_inputs(7, 257, 40)
    tiles = run(mod, *inputs, entropy=entropy)
    monkeypatch.setattr(launch, "_empty", poisoned)
    monkeypatch.setattr(launch, "logits_path", lambda hidden, weight: True)
    for name in ("linear_logp_fwd_kernel", "linear_logp_bwd_dz_kernel"):
        monkeypatch.setattr(mod, name, None)  # (a launch of either would fail)
    got = run(mod, *inputs, entropy=entropy)
    check_against_reference(mod, *inputs, entropy=entropy)
    for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w", "grad_b"), got, tiles):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_poisoned_outputs_are_fully_written(monkeypatch, dtype):
    """Every buffer starts as NaN (ints as out-of-range values): no element of any output
    is left unwritten, and no workspace element is read before it is written."""
    def poisoned(shape, dtype_, device):
        if dtype_.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype_, device=device)
        return torch.full(shape, 1 << 30, dtype=dtype_, device=device)

    monkeypatch.setattr(launch, "_empty", poisoned)
    monkeypatch.setattr(backward_launch, "WORKSPACE_BYTES", 1)  # many chunks
    monkeypatch.setattr(backward_launch, "ACCUMULATOR_BYTES", 0)  # bf16: borrow grad_weight's tail
    for split in (1, 64):
        got = run(variant(SPLIT_V=split), *make_inputs(7, 257, 40, dtype=dtype))
        for name, t in zip(("logp", "entropy", "grad_h", "grad_w", "grad_b"), got):
            assert torch.isfinite(t).all(), f"{name} (SPLIT_V={split}) has unwritten elements"
    check_against_reference(variant(SPLIT_V=64), *make_inputs(7, 257, 40, dtype=dtype))


def logits_level_grads(hidden, weight, target, bias, z_hidden, z_weight, temperature, g_logp, g_ent):
    """(logp, entropy, grad_hidden, grad_weight, grad_bias) in float64 with the logits taken
    from (z_hidden, z_weight) and the gradient GEMMs from (hidden, weight): what linear_logp
    computes when its logit tiles read rounded operands and its gradient GEMMs do not."""
    f64 = torch.float64
    z = z_hidden.to(f64) @ z_weight.to(f64).T + bias.to(f64)
    z = (z / temperature).requires_grad_()
    valid = target != -100
    lsm = torch.log_softmax(z, -1)
    logp = torch.where(valid, lsm.gather(1, torch.where(valid, target, 0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(lsm.exp() * lsm).sum(-1), 0.0)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    dz = z.grad / temperature
    return logp.detach(), ent.detach(), dz @ weight.to(f64), dz.T @ hidden.to(f64), dz.sum(0)


def test_float32_under_tf32_rounds_operands_to_nearest(monkeypatch, tf32):
    """With TF32 allowed, float32 logit tiles loaded by TMA reach the dot rounded to the
    nearest TF32 value (ties to even, the descriptors' loads), as cuBLAS rounds its operands
    (the tensor cores would truncate: a -7e-4 relative bias on an H200). Forward and the
    backward's recomputed dz alike: logp, entropy and the gradients (whose GEMMs take the
    operands as they are) equal, within float32 sums, the float64 values from the rounded
    operands, and not those from the operands as they are. With every buffer NaN first, so
    the target logit is taken from the forward's own tile (partials plane 2, written) rather
    than the combine's float32 gather-dot, which would not match TF32 logits. (The
    interpreter's dots are float32: the rounding shows.)"""
    from kgen.runtime import tf32_descriptors
    import triton
    if not hasattr(triton.tools.tensor_descriptor.TensorDescriptor, "round_f32_to_tf32"):
        pytest.skip(f"Triton {triton.__version__}'s interpreter does not round descriptor loads (3.7+ does)")
    tf32(True)
    assert llp._target_in_tile(torch.float32, llp._precision(torch.float32))
    assert not llp._target_in_tile(torch.bfloat16, llp._precision(torch.bfloat16))
    monkeypatch.setattr(launch, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))
    hidden, weight, target, bias = make_inputs(33, 257, 40)
    assert plans._tile_sources(variant(), hidden, weight)[2]
    assert tf32_descriptors.rounding_descriptor(hidden, [16, 16]).round_f32_to_tf32
    got = run(variant(), hidden, weight, target, bias)
    g = torch.Generator().manual_seed(1)  # (run's upstream gradients)
    g_logp, g_ent = torch.randn(33, generator=g), torch.randn(33, generator=g)
    rh, rw = (tf32_rounded(t, "even") for t in (hidden, weight))
    want = logits_level_grads(hidden, weight, target, bias, rh, rw, 0.7, g_logp, g_ent)
    plain = logits_level_grads(hidden, weight, target, bias, hidden, weight, 0.7, g_logp, g_ent)
    for name, a, w, p in zip(("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"), got, want, plain):
        scale = max(1.0, float(w.abs().max()))
        err, off = float((a.detach().double() - w).abs().max()), float((p - w).abs().max())
        assert err < 2e-5 * scale, (name, err)  # float32 sums (OUT_TOL, GRAD_TOL)
        assert off > 20 * err, (name, off, err)  # (the rounding is visible at that bound)


def count_kept(monkeypatch) -> list:
    """A list that gets an item each time the op keeps the logits (kept.forward_kept)."""
    kept, real = [], llp.kept.forward_kept
    monkeypatch.setattr(llp.op, "forward_kept", lambda *a: kept.append(1) or real(*a))
    return kept


KEEP_CASES = [(7, 257, 40, torch.float32, True, True), (33, 50, 16, torch.bfloat16, True, False),
              (1, 300, 36, torch.float16, False, True), (20, 513, 24, torch.bfloat16, False, False)]


@pytest.mark.parametrize("case", KEEP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_keep_logits_matches_float64_and_the_default_path(monkeypatch, case):
    """keep_logits: the logits pass (forward) and the dz-from-logits pass (backward),
    interpreted, with every buffer poisoned (NaN): each output fully written, within the
    reference's tolerances against float64 (the same math on the same float32 logits), and
    equal to the recomputing path up to float32 summation order (gradients: up to one
    16-bit rounding of dz, so the 16-bit dtypes are held to their GRAD_TOL)."""
    N, V, D, dtype, bias, entropy = case
    monkeypatch.setattr(llp.op, "KEEP_LOGITS_MIN_FLOP", 0)  # tiny shapes: kept all the same
    monkeypatch.setattr(launch, "_empty", lambda shape, dtype_, device: torch.full(
        shape, float("nan") if dtype_.is_floating_point else 1 << 30, dtype=dtype_, device=device))
    kept = count_kept(monkeypatch)
    inputs = make_inputs(N, V, D, dtype=dtype, bias=bias)
    got = run(variant(dtype=str(dtype).split(".")[1]), *inputs, entropy=entropy, keep_logits=True)
    assert kept, "the forward did not keep the logits"
    for name, t in zip(("logp", "entropy", "grad_h", "grad_w", "grad_b"), got):
        assert t is None or torch.isfinite(t).all(), f"{name} has unwritten elements"
    check_against_reference(variant(dtype=str(dtype).split(".")[1]), *inputs, entropy=entropy, keep_logits=True)
    default = run(variant(dtype=str(dtype).split(".")[1]), *inputs, entropy=entropy)
    for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w", "grad_b"), got, default):
        if a is None:
            assert b is None, name
            continue
        rtol, atol = GRAD_TOL[dtype] if name.startswith("grad") else OUT_TOL
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol * max(1.0, b.abs().max().item()),
                                   msg=name)


def test_keep_logits_without_a_gradient_keeps_nothing(monkeypatch):
    """No gradient to come (no_grad, or no input requiring one): the default forward runs,
    nothing is kept, the results are the default path's bit for bit."""
    monkeypatch.setattr(llp.op, "KEEP_LOGITS_MIN_FLOP", 0)
    monkeypatch.setattr(llp.op, "forward_kept", lambda *a: pytest.fail("logits kept without a gradient"))
    hidden, weight, target, bias = make_inputs(7, 257, 40)
    mod = variant()
    want = call(mod, hidden, weight, target, bias, return_entropy=True)
    with torch.no_grad():
        got = call(mod, hidden.requires_grad_(), weight, target, bias, return_entropy=True, keep_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got = call(mod, hidden.detach(), weight, target, bias, return_entropy=True, keep_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_keep_logits_only_where_it_pays(monkeypatch):
    """Below KEEP_LOGITS_MIN_FLOP logit FLOPs (2 N D V) keep_logits is ignored (host-bound
    calls: the default is faster); at or above it the logits are kept."""
    kept = count_kept(monkeypatch)
    hidden, weight, target, bias = make_inputs(7, 50, 16)
    flop = 2 * 7 * 16 * 50
    for threshold, want in ((flop + 1, []), (flop, [1])):
        monkeypatch.setattr(llp.op, "KEEP_LOGITS_MIN_FLOP", threshold)
        kept.clear()
        run(variant(), hidden, weight, target, bias, keep_logits=True)
        assert kept == want, threshold


def test_keep_logits_out_of_range_targets_give_nan_rows(monkeypatch):
    monkeypatch.setattr(llp.op, "KEEP_LOGITS_MIN_FLOP", 0)
    hidden, weight, target, bias = make_inputs(7, 50, 16)
    target[1], target[4] = 50, -3
    h = hidden.clone().requires_grad_()
    logp, ent = call(variant(), h, weight, target, bias, return_entropy=True, keep_logits=True)
    bad = torch.zeros(7, dtype=torch.bool)
    bad[[1, 4]] = True
    assert torch.isnan(logp[bad]).all() and torch.isnan(ent[bad]).all()
    assert torch.isfinite(logp[~bad]).all() and torch.isfinite(ent[~bad]).all()


def test_backward_follows_a_forward_that_ran_the_reference(monkeypatch):
    """Where the tuning table gives the PyTorch reference for a forward's shape bucket (and a
    kernel without a shape, as the backward asks), the backward runs the reference too: the
    reference forward's lse2 and ez2 are zeros, which a kernel backward would take for the
    row statistics. Against float64, forward and gradients."""
    mod = variant()
    monkeypatch.setattr(llp.op, "_module", lambda device, dtype, shape=None: None if shape is not None else mod)
    hidden, weight, target, bias = make_inputs(5, 300, 24)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    logp, ent = ops.linear_logp(leaves[0], leaves[1], target, leaves[2], temperature=0.7, return_entropy=True)
    g = torch.Generator().manual_seed(1)
    ((logp * torch.randn(5, generator=g)).sum() + (ent * torch.randn(5, generator=g)).sum()).backward()
    got = (logp, ent, *(x.grad for x in leaves))
    want = run(None, hidden, weight, target, bias, oracle=True)
    for name, a, e in zip(("logp", "entropy", "grad_h", "grad_w", "grad_b"), got, want):
        torch.testing.assert_close(a, e.float(), rtol=1e-4, atol=1e-5, msg=name)


def test_keep_logits_under_compile_and_on_the_reference_path(monkeypatch):
    """torch.compile(fullgraph=True) of forward + backward with keep_logits: the registered
    op's fake gives the kept logits' shape and the gradients are eager's bit for bit
    (interpreted kernels); on the reference path (no kernel) keep_logits changes nothing."""
    monkeypatch.setattr(llp.op, "KEEP_LOGITS_MIN_FLOP", 0)
    hidden, weight, target, bias = make_inputs(9, 70, 16)

    def f(h, w, b):
        logp, ent = ops.linear_logp(h, w, target, b, temperature=0.9, return_entropy=True, keep_logits=True)
        return (logp - 0.1 * ent).sum()

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        fn(*leaves).backward()
        return [x.grad for x in leaves]

    with llp.using(variant()):
        eager = grads(f)
        compiled = grads(torch.compile(f, fullgraph=True, backend="aot_eager"))
    for a, e in zip(compiled, eager):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    plain = grads(lambda h, w, b: ops.linear_logp(h, w, target, b, temperature=0.9, return_entropy=True)[0].sum()
                  - 0.1 * ops.linear_logp(h, w, target, b, temperature=0.9, return_entropy=True)[1].sum())
    for a, e in zip(grads(f), plain):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


_KEPT_AOT = """
import json, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kgen import config
from kgen.families.linear_logp import schema
from kgen.runtime import build, dispatch, toolchain

config.pin_triton_defaults()
tmp = Path(tempfile.mkdtemp())
for name in sys.argv[1:]:
    v = dispatch.shipped_spec("linear_logp").variant(name)
    for fn, sig, const, opts in schema.triton_aot(v, dispatch.load(v).module)[1:]:
        c = triton.compile(ASTSource(fn, sig, const, build._divisibility(fn, sig)),
                           target=GPUTarget("cuda", 90, 32), options=opts)
        (tmp / "k.cubin").write_bytes(c.asm["cubin"])
        (usage,) = toolchain.resource_usage(tmp / "k.cubin").values()
        print(json.dumps({"name": name, "kernel": fn.__name__, **usage}))
"""


@pytest.mark.aot
def test_keep_logits_kernels_compile_without_stack_or_spills():
    """keep_logits' two kernels, every option on, and float32's dH kernel, as `kgen build`
    compiles them (schema.triton_aot) for sm_90, in each dtype, in a process that does not
    interpret Triton: no local memory, no stack (keep_logits' first tiles, 32 x 256, had 255
    registers and 112-320 B; the dH kernel's load-add-store epilogue 8-56 B)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    names = ["triton_n128_v256_d64_w8_s3_sv4_bf16", "triton_n128_v256_d64_w8_s3_sv4_f16",
             "triton_n128_v128_d32_w8_s4_sv4_f32"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", _KEPT_AOT, *names], capture_output=True, text=True, env=env, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(row["name"], row["kernel"]) for row in rows] == [
        (n, k) for n in names for k in ("linear_logp_logits_fwd_kernel", "linear_logp_bwd_dz_logits_kernel",
                                        *(["linear_logp_bwd_dh_kernel"] if n.endswith("f32") else []))]
    for row in rows:
        assert row["local"] == 0 and row["stack"] == 0, row


def test_ignored_rows_are_zero_and_get_no_gradient():
    hidden, weight, target, bias = make_inputs(7, 50, 16)
    target[:] = -100
    target[2] = 5
    logp, ent, gh, gw, gb = run(variant(), hidden, weight, target, bias)
    mask = target == -100
    assert (logp[mask] == 0).all() and (ent[mask] == 0).all()
    assert (gh[mask] == 0).all()


@pytest.mark.parametrize("entropy", [True, False])
def test_an_ignored_row_of_nan_hidden_gets_no_gradient(entropy):
    """A padded position is often both ignored and NaN (a fully masked attention row): its
    logp and entropy are 0 and it gives grad_bias, grad_hidden and the other rows nothing --
    on the kernels (dz 0 there, not p * 0 = NaN) as on the CPU path. grad_weight's GEMM still
    multiplies the row's NaN hidden by its 0s, as torch does (NaN there on every path)."""
    hidden, weight, target, bias = make_inputs(7, 50, 16)
    hidden[3, 5] = float("nan")
    target[3] = -100
    want = run(None, hidden, weight, target, bias, entropy=entropy)
    clean = hidden.clone()
    clean[3] = 0
    for mod in (None, variant()):
        logp, ent, gh, gw, gb = run(mod, hidden, weight, target, bias, entropy=entropy)
        assert logp[3] == 0 and (not entropy or ent[3] == 0), mod
        assert (gh[3] == 0).all() and torch.isfinite(gh).all() and torch.isfinite(gb).all(), mod
        _, _, gh_c, _, gb_c = run(mod, clean, weight, target, bias, entropy=entropy)
        assert torch.equal(gh, gh_c) and torch.equal(gb, gb_c), mod  # the row contributes nothing
        torch.testing.assert_close(gb, want[4], rtol=2e-5, atol=2e-5)
        assert torch.isnan(gw).any()


def test_empty_batch():
    hidden, weight, target, bias = make_inputs(1, 50, 16)
    logp, ent, gh, gw, gb = run(variant(), hidden[:0], weight, target[:0], bias)
    assert logp.shape == (0,) and gh.shape == (0, 16)
    assert (gw == 0).all() and (gb == 0).all()


def test_reference_path_on_cpu():
    """mod=None: the float32 PyTorch path, differentiable, bf16 gradients in bf16."""
    check_against_reference(None, *make_inputs(7, 50, 16))
    _, _, gh, gw, gb = run(None, *make_inputs(7, 50, 16, dtype=torch.bfloat16))
    assert gh.dtype == gw.dtype == gb.dtype == torch.bfloat16


def test_render_is_deterministic():
    v = spec.load("kgen/specs/linear_logp.yaml").variant("triton_n128_v256_d64_w8_s3_sv4_bf16")
    text = render_mod.render(v).text
    assert text == render_mod.render(v).text
    assert text.startswith("# generated by kgen")
    assert "BLOCK_V = 256\n" in text and "SPLIT_V = 4\n" in text
    compile(text, "linear_logp.py", "exec")


def test_registered_op_and_fake():
    x, w, t = torch.randn(5, 16), torch.randn(11, 16), torch.randint(0, 11, (5,))
    torch.library.opcheck(torch.ops.kgen.linear_logp.default, (x, w, t, None, 0.5, -100, True, False))
    torch.library.opcheck(torch.ops.kgen.linear_logp.default, (x, w, t, None, 0.5, -100, True, False, True))
    meta = torch.ops.kgen.linear_logp(x.to("meta"), w.to("meta"), t.to("meta"), None, 1.0, -100, False, False)
    assert [m.shape for m in meta] == [(5,), (0,), (5,), (0,), (0,)]
    meta = torch.ops.kgen.linear_logp(x.to("meta"), w.to("meta"), t.to("meta"), None, 1.0, -100, True, False, True)
    assert [m.shape for m in meta] == [(5,), (5,), (5,), (5,), (5, 11)]


def test_registered_op_refuses_leading_batch_dims():
    """torch.ops.kgen.linear_logp took a 3-D hidden: eager returned logp [2, 3] where its fake
    impl says [2] (torch.compile failed in an assertion), and the backward failed unpacking
    hidden's shape. kgen.ops.linear_logp flattens leading dims; the registered op says so."""
    h, w, t = torch.randn(2, 3, 8), torch.randn(11, 8), torch.randint(0, 11, (2, 3))
    for hh, tt in ((h, t), (h, t.reshape(6))):
        with pytest.raises(ValueError, match="hidden must be 2-D .N, D. and target 1-D"):
            torch.ops.kgen.linear_logp(hh, w, tt, None, 1.0, -100, True, False)
        with pytest.raises(ValueError, match="hidden must be 2-D"):
            torch.ops.kgen.linear_logp(hh.to("meta"), w.to("meta"), tt.to("meta"), None, 1.0, -100, True, False)
    g = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="linear_logp_backward: hidden must be 2-D"):
        torch.ops.kgen.linear_logp_backward(h, w, t, None, g, g, g, None, 1.0, -100)
    assert ops.linear_logp(h, w, t).shape == (2, 3)


def test_compile_fullgraph_has_no_graph_break():
    x, w, t = torch.randn(6, 16), torch.randn(11, 16), torch.randint(0, 11, (6,))

    def f(x, w, t):
        logp, ent = ops.linear_logp(x, w, t, temperature=0.9, return_entropy=True)
        return (logp - 0.1 * ent).sum()

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, t), f(x, w, t))


def test_spec_rejects_tiles_beyond_shared_memory():
    from kgen.errors import SpecError

    with pytest.raises(SpecError, match="shared memory") as ei:
        spec.parse("family: linear_logp\ndtypes: [float32]\nvariants:\n"
                   "  - {backend: triton, block_n: 256, block_v: 256, block_d: 128, num_warps: 8,\n"
                   "     num_stages: 4, split_v: 1}\n", "inline.yaml")
    assert ei.value.key == "variants[0].num_stages" and ei.value.line == 5


def test_spec_rejects_float32_tma_boxes_past_the_swizzle_span():
    # float32 tiles load through TMA with 128-byte rows (block_d <= 32); 64 columns would
    # be 256 bytes, which the 128-byte swizzle cannot take.
    from kgen.errors import SpecError

    with pytest.raises(SpecError, match="128-byte swizzle") as ei:
        spec.parse("family: linear_logp\ndtypes: [float32]\nvariants:\n"
                   "  - {backend: triton, block_n: 64, block_v: 64, block_d: 64, num_warps: 4,\n"
                   "     num_stages: 2, split_v: 1}\n", "inline.yaml")
    assert ei.value.key == "variants[0].block_d"


# --------------------------------------------------------------------------- bad inputs

H, W, T, B = make_inputs(4, 10, 16)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(hidden=H.tolist()), TypeError, "hidden"),
    (dict(hidden=H.double(), weight=W.double()), TypeError, "hidden"),
    (dict(weight=W.half()), TypeError, "weight"),
    (dict(bias=B.half()), TypeError, "bias"),
    (dict(bias=[0.0] * 10), TypeError, "bias"),
    (dict(target=T.float()), TypeError, "target"),
    (dict(temperature="1"), TypeError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(weight=W[None]), ValueError, "weight"),
    (dict(weight=W[:0]), ValueError, "weight"),
    (dict(hidden=H[:, :8]), ValueError, "hidden"),
    (dict(target=T[:3]), ValueError, "target"),
    (dict(bias=B[:9]), ValueError, "bias"),
    (dict(target=torch.tensor([0, 1, 10, 2]), check_targets=True), ValueError, "target"),
    (dict(target=torch.tensor([0, -1, 3, 2]), check_targets=True), ValueError, "target"),
    (dict(weight=W.to("meta")), ValueError, "weight"),
])
def test_bad_inputs_raise(kwargs, error, match):
    args = dict(hidden=H, weight=W, target=T, bias=B, temperature=1.0, ignore_index=-100)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        call(variant(), args.pop("hidden"), args.pop("weight"), args.pop("target"),
                        args.pop("bias"), **args)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_targets_out_of_range_give_nan_rows_or_raise_in_checked_mode(impl, monkeypatch):
    """By default no host check: a target outside [0, V) (not ignore_index) makes that row's
    logp and entropy NaN, the other rows are untouched; checked mode (argument or
    KGEN_CHECK_TARGETS=1) raises ValueError naming the value."""
    mod = variant() if impl == "triton" else None
    target = torch.tensor([0, 10, 3, -5])  # V = 10
    logp, ent = call(mod, H, W, target, B, return_entropy=True)
    assert torch.isnan(logp[[1, 3]]).all() and torch.isnan(ent[[1, 3]]).all()
    good = torch.tensor([0, 2, 3, 2])
    want_logp, want_ent = llp.reference(H, W, good, B, compute=torch.float64)
    torch.testing.assert_close(logp[[0, 2]].double(), want_logp[[0, 2]], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent[[0, 2]].double(), want_ent[[0, 2]], rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="target holds 10, outside"):
        call(mod, H, W, target, B, check_targets=True)
    monkeypatch.setenv("KGEN_CHECK_TARGETS", "1")
    with pytest.raises(ValueError, match="target holds 10, outside"):
        call(mod, H, W, target, B)
    call(mod, H, W, target, B, check_targets=False)  # the argument wins over the environment


def test_out_of_range_target_rows_get_nan_gradients():
    """The forward's NaN row is not a dropped term: its gradients are NaN too (so a
    GradScaler-style finite check skips the step), on both paths; the other rows' are as if
    the bad row were ignored."""
    for mod in (None, variant()):
        target = torch.tensor([0, 10, 3, -5])  # V = 10
        _, _, gh, gw, gb = run(mod, H, W, target, B)
        assert torch.isnan(gh[[1, 3]]).all(), mod
        assert torch.isnan(gw).any() and torch.isnan(gb).any(), mod
        _, _, gh_ok, _, _ = run(mod, H, W, torch.tensor([0, -100, 3, -100]), B)
        torch.testing.assert_close(gh[[0, 2]], gh_ok[[0, 2]], rtol=1e-6, atol=1e-6)


def masked_oracle(hidden, weight, target, bias, temperature, seed=1):
    """float64 logp, entropy and their gradients, written independently of kgen: log_softmax,
    and the entropy -sum p log p over the columns whose logit is not -inf (0 log 0 = 0, with
    no NaN in its gradient: Categorical's clamp to finfo.min overflows there), ignored rows 0."""
    h, w, b = (t.double().requires_grad_() for t in (hidden, weight, bias))
    z = (h @ w.T + b) / temperature
    valid = target != -100
    all_logp = torch.log_softmax(z, -1)
    logp = all_logp.gather(1, torch.where(valid, target, 0)[:, None]).squeeze(1)
    ent = -(torch.softmax(z, -1) * torch.where(torch.isneginf(z), 0.0, all_logp)).sum(-1)
    logp, ent = torch.where(valid, logp, 0.0), torch.where(valid, ent, 0.0)
    g = torch.Generator().manual_seed(seed)
    g_logp, g_ent = torch.randn(logp.shape, generator=g), torch.randn(logp.shape, generator=g)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad, b.grad


MASKS = {"tail splits": slice(64, None), "one inner tile": slice(32, 64), "scattered": slice(1, None, 3),
         "all but three": slice(3, None)}


@pytest.mark.parametrize("value", [-math.inf, torch.finfo(torch.float32).min])
@pytest.mark.parametrize("where", list(MASKS))
@pytest.mark.parametrize("tiles", ["reference", "sv2_bv32", "sv4_bv16"])
def test_bias_masked_columns(tiles, where, value):
    """Columns masked by a -inf bias (or a finite one that scales to -inf) hold no mass: logp,
    entropy and every gradient as float64 log_softmax / Categorical give, whatever the V
    tiling (a split whose tiles are all masked gave NaN rows), and 0 gradient to the masked
    columns. Tolerance: OUT_TOL / GRAD_TOL as the unmasked tests (float32 sums)."""
    mod = {"reference": None, "sv2_bv32": variant(), "sv4_bv16": variant(BLOCK_V=16, SPLIT_V=4)}[tiles]
    hidden, weight, target, bias = make_inputs(7, 130, 16)
    bias[MASKS[where]] = value
    live = (bias > -1e30).nonzero().squeeze(1)
    target = torch.where(target == -100, target, live[torch.arange(len(target)) % len(live)])  # on live columns
    got = run(mod, hidden, weight, target, bias)
    want = masked_oracle(hidden, weight, target, bias, 0.7)
    for name, a, e in zip(("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"), got, want):
        rtol, atol = GRAD_TOL[torch.float32] if name.startswith("grad") else OUT_TOL
        atol *= max(1.0, e.abs().max().item())
        assert_close(a, e, rtol, atol, name)
    masked = bias <= -1e30
    assert (got[3][masked] == 0).all() and (got[4][masked] == 0).all()


@pytest.mark.parametrize("tiles", ["reference", "sv4_bv16"])
def test_target_on_a_masked_column_and_rows_with_every_column_masked(tiles):
    """A target on a masked column: logp -inf (float64 log_softmax's). A row whose every column
    is masked has no distribution: NaN logp and entropy and NaN or inf gradients, never a
    plausible value; an ignored such row stays 0 and adds no gradient."""
    mod = None if tiles == "reference" else variant(BLOCK_V=16, SPLIT_V=4)
    hidden, weight, target, bias = make_inputs(5, 40, 16, ignore=False)
    bias[20:] = -math.inf
    target[:] = torch.tensor([1, 25, 3, 39, 0])
    logp, ent = call(mod, hidden, weight, target, bias, return_entropy=True)
    assert torch.isneginf(logp[[1, 3]]).all() and torch.isfinite(logp[[0, 2, 4]]).all()
    assert torch.isfinite(ent).all()
    bias[:] = -math.inf
    target[[1, 3]] = -100
    logp, ent, gh, gw, gb = run(mod, hidden, weight, target, bias)
    assert torch.isnan(logp[[0, 2, 4]]).all() and torch.isnan(ent[[0, 2, 4]]).all()
    assert (logp[[1, 3]] == 0).all() and (ent[[1, 3]] == 0).all()
    assert not torch.isfinite(gh[[0, 2, 4]]).any() and (gh[[1, 3]] == 0).all()
    target[:] = -100  # every row ignored: all zeros, finite gradients
    logp, ent, gh, gw, gb = run(mod, hidden, weight, target, bias)
    assert (logp == 0).all() and (ent == 0).all()
    assert (gh == 0).all() and (gw == 0).all() and (gb == 0).all()


def test_compile_with_a_traced_temperature():
    """temperature as an argument of the compiled function (dynamo makes it a symbolic float
    on its second value) and dynamic=True: the argument checks trace, no graph break."""
    x, w, t = torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,))

    def f(x, temperature):
        return ops.linear_logp(x, w, t, temperature=temperature)

    for cf in (torch.compile(f, fullgraph=True, backend="aot_eager"),
               torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)):
        for temperature in (0.5, 2.0, 3.0):
            torch.testing.assert_close(cf(x, temperature), f(x, temperature))
    with pytest.raises(Exception, match="temperature must be finite and > 0"):
        torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)(x, -1.0)


def test_ignore_index_is_not_out_of_range():
    target = torch.tensor([0, 7, 3, 2])
    call(variant(), H, W, target, B, ignore_index=7)  # 7 < V: ignored, fine
    call(variant(), H, W, torch.tensor([0, 12345, 3, 2]), B, ignore_index=12345)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_target_check_kernel(dtype):
    """The one-launch range check the op queues before its kernels (interpreted here): set
    exactly when some target is outside [0, V) and not ignore_index, wherever it lies in
    N = 2500 (not a multiple of the 1024-target step), with in-range and out-of-range
    ignore_index values."""
    mod, V, N = variant(), 50257, 2500
    g = torch.Generator().manual_seed(5)
    for ignore_index in (-100, V, 7):
        for where, value in ((None, None), (0, -1), (1023, V), (1024, -5), (N - 1, V + 9), (N - 1, 1 << 35)):
            if dtype == torch.int32 and value == 1 << 35:
                continue
            t = torch.randint(0, V, (N,), generator=g).to(dtype)
            t[::9] = ignore_index
            if where is not None:
                t[where] = value
            flag = torch.full((1,), -1, dtype=torch.int32)
            mod.linear_logp_target_check_kernel[(1,)](t, flag, N, V, ignore_index, BLOCK=llp.TARGET_CHECK_BLOCK)
            want = bool((((t < 0) | (t >= V)) & (t != ignore_index)).any())
            assert flag.item() == int(want), (ignore_index, where, value)


def test_splits_fill_whole_waves(monkeypatch):
    """The per-call splits on a 132-SM GPU (no GPU needed: the SM count is what it reads):
    >= SPLIT_V unless there are fewer V tiles, <= one V tile each, and the programs fill
    whole waves or make >= 16 of them; on the CPU (interpreter) the variant's SPLIT_V. And
    the CUDA kernel's choice at the benchmark shapes (66 resident 2-CTA clusters)."""
    from types import SimpleNamespace

    monkeypatch.setattr(plans, "_device_props", lambda index: SimpleNamespace(multi_processor_count=132))
    mod = SimpleNamespace(SPLIT_V=4, BLOCK_N=128, BLOCK_V=256)
    dev = torch.device("cuda", 0)
    want = {(8192, 128256): 33, (4096, 151936): 33, (4099, 151936): 4, (1, 151936): 132,
            (65536, 128256): 5, (1, 1000): 4, (7, 300): 2}
    for (N, V), splits in want.items():
        got = llp.triton_splits(mod, N, V, dev)
        assert got == splits, (N, V, got)
        programs, tiles = -(-N // 128) * got, -(-V // 256)
        assert min(4, tiles) <= got <= tiles
        assert programs % 132 == 0 or programs >= 16 * 132 or got == tiles
    assert llp.triton_splits(mod, 8192, 128256, torch.device("cpu")) == 4
    # sm_90a, cluster 2: 32 / 16 row groups of 256 rows, split_v 33 -> 1056 / 528 clusters
    assert llp.wave_splits(32, 33, 501, 66) == 33 and llp.wave_splits(16, 33, 594, 66) == 33


def test_autocast_takes_an_fp32_master_weight_like_f_linear():
    """Under torch.autocast (CPU here: bfloat16), bf16 activations with a float32 weight and
    bias work as with F.linear: the op sees both in bf16, equal to casting them by hand, and
    the float32 leaves get float32 gradients (through the cast)."""
    hidden, weight, target, bias = make_inputs(9, 50, 24)
    h = hidden.bfloat16().requires_grad_()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = ops.linear_logp(h, w, target, b)
    logp.sum().backward()
    want = ops.linear_logp(h.detach(), weight.bfloat16(), target, bias.bfloat16())
    assert torch.equal(logp.detach(), want)
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0
    with pytest.raises(TypeError):  # outside autocast the dtypes must agree, as before
        ops.linear_logp(h.detach(), weight, target, bias)


def test_keep_logits_under_autocast_with_an_fp32_master_weight(monkeypatch):
    """keep_logits under torch.autocast (CPU: bfloat16) with float32 weight and bias: the
    logits are kept (from the bf16 casts, as the op sees them), the float32 leaves get
    float32 gradients, equal to the default path's within bf16's GRAD_TOL (logp: OUT_TOL)."""
    monkeypatch.setattr(llp.op, "KEEP_LOGITS_MIN_FLOP", 0)
    kept = count_kept(monkeypatch)
    hidden, weight, target, bias = make_inputs(9, 50, 24)

    def step(keep):
        h = hidden.bfloat16().requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        with llp.using(variant(dtype="bfloat16")):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp = ops.linear_logp(h, w, target, b, keep_logits=keep)
            logp.sum().backward()
        return logp.detach(), h.grad, w.grad, b.grad

    got = step(True)
    assert kept, "the logits were not kept"
    want = step(False)
    torch.testing.assert_close(got[0], want[0], rtol=OUT_TOL[0], atol=OUT_TOL[1])  # float32 summation order
    assert [g.dtype for g in got[1:]] == [torch.bfloat16, torch.float32, torch.float32]
    rtol, atol = GRAD_TOL[torch.bfloat16]
    for name, a, e in zip(("grad_hidden", "grad_weight", "grad_bias"), got[1:], want[1:]):
        torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=atol * max(1.0, e.abs().max().item()),
                                   msg=name)


def _stand_in_dz(calls):
    """CudaForward.dz's contract in float32 (llp.reference_dz), for checking the backward's
    wiring on the CPU; records (rows, v0, v1, row stride)."""
    def dz(h, w, t, lse2, ez2, g_logp, g_ent, out, v0, v1, temperature, ignore_index):
        calls.append((h.shape[0], v0, v1, out.stride(0)))
        assert out.data_ptr() % 16 == 0 and out.stride(0) % 2 == 0 and out.stride(1) == 1
        want = llp.reference_dz(h, w, t, lse2, ez2, g_logp, g_ent, temperature, ignore_index, v0, v1)
        out[:len(t), :v1 - v0] = want.to(out.dtype)  # rows from N on: a row block's, untouched
    return dz


@pytest.mark.parametrize("home", ["direct", "own buffer + grad_weight tail, N=16", "separate, all rows, N=33",
                                  "row blocks, chunked"])
@pytest.mark.parametrize("entropy", [True, False])
def test_backward_routes_dz_to_the_cuda_kernel(monkeypatch, home, entropy):
    """Where CudaForward.takes_dz holds (sm_90a, no bias), every dz pass is one
    CudaForward.dz call -- the chunk's rows (row blocks: a slice), its columns and its dz
    view -- and the gradients are the Triton dz kernel's within bf16 rounding of dz; with a
    bias the Triton kernel runs (its column sums make grad_bias)."""
    N, _, _, workspace, budget, _, _ = HOMES[home]
    mod = variant()
    hidden, weight, target, _ = make_inputs(N, 257, 40, dtype=torch.bfloat16)
    _, _, lse2, ez2 = llp.forward(mod, hidden, weight, target, None, 0.7, -100, entropy)
    g = torch.Generator().manual_seed(4)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g) if entropy else None
    calls = []
    cuda = llp.CudaForward.__new__(llp.CudaForward)
    cuda.triton = mod
    cuda.takes_dz = lambda h, w, b: b is None
    cuda.dz = _stand_in_dz(calls)
    monkeypatch.setattr(launch, "_empty", lambda shape, dt, dev: torch.full(shape, float("nan"), dtype=dt, device=dev))
    args = (hidden, weight, target, None, lse2, ez2, g_logp, g_ent, 0.7, -100)
    budgets = dict(workspace_bytes=workspace, accumulator_bytes=budget)
    got = llp.backward(cuda, *args, **budgets)
    want = llp.backward(mod, *args, **budgets)
    plan = plans.accumulator_plan(N, 40, 257, torch.bfloat16, 32, budget, workspace)
    assert calls and all(v1 > v0 for _, v0, v1, _ in calls)
    assert {n for n, *_ in calls} == ({N} if plan.home != "rows" else {N, plan.row_block, N % plan.row_block} - {0})
    for name, a, b in zip(("grad_h", "grad_w"), got, want):
        assert torch.isfinite(a).all(), name
        # dz is rounded to bf16 on both paths from float32 logits summed in different
        # orders: an element may land a unit of bf16's last place apart (up to 2^-7 of the
        # largest dz), which the GEMMs spread into any output, near zero too; then the
        # outputs' own rounding (2^-7 relative). 2^-6 of the largest gradient covers both.
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=2 ** -6 * b.abs().max().item(), msg=name)
    calls.clear()
    bias = torch.zeros(257, dtype=torch.bfloat16)
    llp.backward(cuda, hidden, weight, target, bias, *args[4:], **budgets)
    assert not calls


def test_cuda_forward_grids(monkeypatch):
    """CudaForward's split choices on a fake 132-SM sm_90a device (no GPU needed): the
    forward's wave_splits with split_v's minimum, the dz kernel's without it."""
    from types import SimpleNamespace

    variant_ = SimpleNamespace(arch="sm_90a", dtype="bfloat16", params={"consumers": 2})
    kernel = SimpleNamespace(params={"block_m": 128, "block_n": 256, "split_v": 33, "cluster": 2},
                             name="fake", variant=variant_, lib=None)
    monkeypatch.setattr(plans, "_device_props", lambda index: SimpleNamespace(multi_processor_count=132))
    cuda = llp.CudaForward(kernel, None)
    dev = torch.device("cuda", 0)
    # 32 row groups of 2 x 128 rows, 66 clusters resident (one CTA an SM)
    assert cuda.splits(8192, 128256, dev) == plans.wave_splits(32, 33, 501, 66) == 33
    assert cuda.dz_splits(8192, 3584, dev) == plans.wave_splits(32, 1, 14, 66) == 14
    assert cuda.dz_splits(8, 1024, dev) == 4  # one row group: a split a tile
    assert cuda.group(8192, 4096) == 8  # 16 MB of hidden rows: 8 row groups of 2 MB


def test_gemv_forward_takes_and_grid(monkeypatch):
    """The small-N CUDA kernel (kernel: gemv) on a fake 132-SM sm_90 device: it takes at
    most block_m rows (more go to the Triton companion) and the tiled kernels' 16-byte rules;
    one CTA of 16 warps an SM at 128 registers, so one wave of CTAs, fewer where the
    vocabulary has fewer 16-row groups (not 256-row tiles: a CTA's warps share its groups'
    steps); no dz kernel."""
    from types import SimpleNamespace

    params = {"kernel": "gemv", "block_m": 16, "block_n": 256, "block_k": 64, "stages": 2, "consumers": 1,
              "split_v": 1, "cluster": 1, "hidden_stages": 0, "ring": 0}
    variant_ = SimpleNamespace(arch="sm_90", dtype="bfloat16", params=params)
    entry = SimpleNamespace(manifest={"resources": {"fwd": {"registers": 128}}})
    kernel = SimpleNamespace(params=params, name="fake", variant=variant_, lib=None, entry=entry)
    monkeypatch.setattr(plans, "_device_props", lambda index: SimpleNamespace(
        multi_processor_count=132, shared_memory_per_multiprocessor=233472))
    cuda = llp.CudaForward(kernel, None)
    assert cuda.gemv and cuda._dz_ptr is None
    w = torch.empty(1000, 1024, dtype=torch.bfloat16)
    assert cuda.takes(torch.empty(16, 1024, dtype=torch.bfloat16), w, None)
    assert not cuda.takes(torch.empty(17, 1024, dtype=torch.bfloat16), w, None)
    assert not cuda.takes(torch.empty(4, 1020, dtype=torch.bfloat16), torch.empty(1000, 1020, dtype=torch.bfloat16), None)
    assert not cuda.takes(torch.empty(4, 1024), torch.empty(1000, 1024), None)  # float32: not this variant's dtype
    variant_.dtype = "float32"  # a float32 gemv variant: rows of whole 16-byte units, 4 columns
    f32 = llp.CudaForward(kernel, None)
    assert f32.takes(torch.empty(4, 1020), torch.empty(1000, 1020), None)
    assert not f32.takes(torch.empty(4, 1022), torch.empty(1000, 1022), None)
    assert not f32.takes(torch.empty(4, 1024, dtype=torch.bfloat16), w, None)
    variant_.dtype = "bfloat16"
    assert not cuda.takes_dz(torch.empty(4, 1024, dtype=torch.bfloat16), w, None)
    dev = torch.device("cuda", 0)
    assert cuda.splits(8, 151936, dev) == 132
    assert cuda.splits(8, 3364, dev) == 132  # 211 groups (14 tiles of 256 rows)
    assert cuda.splits(8, 1000, dev) == 63  # a group a CTA
    assert cuda.splits(1, 16, dev) == 1


def test_gemv_knob_rules():
    """What the gemv kernel's spec entries may say, each rule its own problem."""
    from kgen.families.linear_logp.schema import _check_variant

    ok = dict(kernel="gemv", block_m=16, block_n=256, block_k=64, stages=2, consumers=1, split_v=1, cluster=1,
              hidden_stages=0, ring=0)
    assert _check_variant("cuda", "sm_90", "bfloat16", ok) == []
    assert _check_variant("cuda", "sm_80", "float16", {**ok, "block_m": 8, "block_n": 64, "block_k": 32}) == []
    for knob, value in (("block_m", 32), ("block_n", 200), ("stages", 4), ("consumers", 2), ("cluster", 2),
                        ("hidden_stages", 8), ("ring", 4)):  # ring 4: 256 KB of rings
        assert [p for p, _ in _check_variant("cuda", "sm_90", "bfloat16", {**ok, knob: value})] == [knob], knob
    # a ring holds the trips in flight, so registers hold one trip: 4 steps of 64 columns fit
    assert _check_variant("cuda", "sm_90", "bfloat16", {**ok, "block_n": 128, "stages": 4, "ring": 3}) == []
    assert [p for p, _ in _check_variant("cuda", "sm_80", "bfloat16", {**ok, "ring": 3})] == ["ring"]  # 164 KB
    assert [p for p, _ in _check_variant("cuda", "sm_90a", "bfloat16", ok)] == ["arch"]
    # float32: gemv only, 64-byte pieces of block_k columns, their registers counted in bytes
    f32 = {**ok, "block_k": 32, "stages": 1}
    assert _check_variant("cuda", "sm_90", "float32", f32) == []
    assert [p for p, _ in _check_variant("cuda", "sm_90", "float32", ok)] == ["stages"]  # 4 pieces x 2 steps x 2
    assert [p for p, _ in _check_variant("cuda", "sm_90", "float32", {**f32, "block_k": 24})] == ["block_k"]
    tile32 = dict(kernel="tile", block_m=128, block_n=128, block_k=32, stages=4, consumers=2, split_v=16, cluster=1,
                  hidden_stages=0, ring=0)
    assert [p for p, _ in _check_variant("cuda", "sm_80", "float32", tile32)] == ["dtypes"]
    # the tiled kernels keep their ring of at least two stages
    tile = dict(kernel="tile", block_m=128, block_n=128, block_k=32, stages=1, consumers=2, split_v=16, cluster=1,
                hidden_stages=0, ring=0)
    assert [p for p, _ in _check_variant("cuda", "sm_80", "bfloat16", tile)] == ["stages"]
    assert [p for p, _ in _check_variant("cuda", "sm_80", "bfloat16", {**tile, "stages": 4, "ring": 2})] == ["ring"]


def test_cpu_path_precision_with_a_large_common_logit_offset():
    """The CPU path shifts each row by its maximum before the differences: logp, entropy and
    the gradients stay within the float32 tolerance of a float64 oracle on the same float32
    logits when every logit carries an offset of 1e3-1e5 (unshifted: logp 4.7e-4 and entropy
    9.8e-4 off at 1e4). Tolerance 2e-5: a few float32 roundings of O(1)-O(10) values."""
    import importlib

    ref = importlib.import_module("kgen.families.linear_logp.reference")
    torch.manual_seed(0)
    N, D, V = 8, 16, 50
    h, w, t = torch.randn(N, D), torch.randn(V, D) * 0.5, torch.randint(0, V, (N,))
    for off in (1e3, 1e4, 1e5):
        b = torch.randn(V) + off
        z = (h @ w.T + b).double()  # float32 inputs, float64 math
        lp = torch.log_softmax(z, -1)
        logp, ent = ops.linear_logp(h, w, t, b, return_entropy=True)
        assert (logp.double() - lp.gather(1, t[:, None]).squeeze(1)).abs().max() < 2e-5, off
        assert (ent.double() - (-(lp.exp() * lp).sum(-1))).abs().max() < 2e-5, off
        g_lp, g_ent = torch.randn(N), torch.randn(N)
        gh, _, _ = ref.reference_backward(h, w, t, b, g_lp, g_ent, 1.0, -100)
        zd = z.clone().requires_grad_()  # (the float32 logits: their own rounding at 1e4 is not the op's)
        lpd = torch.log_softmax(zd, -1)
        ((lpd.gather(1, t[:, None]).squeeze(1) * g_lp.double()).sum()
         + (-(lpd.exp() * lpd).sum(-1) * g_ent.double()).sum()).backward()
        want = zd.grad @ w.double()
        assert (gh.double() - want).abs().max() < 2e-5 * max(1.0, float(want.abs().max())), off


def test_cpu_outputs_are_not_views_and_take_in_place_edits():
    """logp and entropy from the CPU path are tensors of their own (they were views of one
    buffer: an in-place edit raised autograd's 'output of a function that returns multiple
    views' error), for a flat and a batched target."""
    torch.manual_seed(1)
    w = torch.randn(11, 8)
    for shape in ((4,), (2, 3)):
        h = torch.randn(*shape, 8, requires_grad=True)
        t = torch.randint(0, 11, shape)
        logp, ent = ops.linear_logp(h, w, t, return_entropy=True)
        assert len(shape) > 1 or not (logp._is_view() or ent._is_view())  # (batched: views of the op's own)
        logp.mul_(0.5)
        ent[..., 0] = 0
        (logp.sum() + ent.sum()).backward()
        assert h.grad is not None and torch.isfinite(h.grad).all()


def test_int32_targets_with_an_ignore_index_beyond_int32():
    """Targets and ignore_index are compared in int64 on every CPU step: an int32 target and
    an ignore_index no int32 holds (2**32 + 5 wraps to 5 in an int32 comparison) agree between
    the forward (row counted) and the backward (it got no gradient), and the checked mode sees
    a -1 that ignore_index 2**32 - 1 does not match."""
    torch.manual_seed(0)
    w = torch.randn(40, 16) * 0.5
    h = torch.randn(4, 16, requires_grad=True)
    t = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    logp = ops.linear_logp(h, w, t, ignore_index=2**32 + 5)
    logp.sum().backward()
    assert torch.isfinite(logp).all() and bool((h.grad.abs().sum(1) > 0).all())
    with pytest.raises(ValueError):
        ops.linear_logp(h.detach(), w, torch.tensor([-1, 6, 7, 8], dtype=torch.int32), ignore_index=2**32 - 1,
                        check_targets=True)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_row_whose_logits_overflow_has_nan_logp(impl):
    """A row with a +inf logit (float32 logits overflowing) has NaN logp and entropy, as
    log_softmax gives, on the kernels too: the Triton combine's "target on a masked column:
    -inf" rule used to overwrite that NaN where the target's own logit was merely very
    negative. The other rows are untouched."""
    mod = variant() if impl == "triton" else None
    torch.manual_seed(0)
    w = torch.randn(40, 16) * 0.5
    h = torch.randn(4, 16)
    h[0] *= 1e38
    h[3] *= 1e38
    t = torch.tensor([1, 2, -100, 3])
    z = (h @ w.T).double()
    assert torch.isinf(z[0]).any() and torch.isinf(z[3]).any()
    logp, ent = call(mod, h, w, t, None, return_entropy=True)
    assert torch.isnan(logp[[0, 3]]).all() and torch.isnan(ent[[0, 3]]).all(), logp
    assert torch.isfinite(logp[1]) and logp[2] == 0
