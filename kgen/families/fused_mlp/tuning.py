"""fused_mlp's tuning hooks (buckets, inputs, what the tuner times: `runner`, the op's own
fast path; `tune_choices`: the training backward's forms), what the op runs for a loaded
variant (`implementation`), the training backward a call takes (`backward_choice`), and the
order dispatch tries for widths nothing was tuned for (`untuned_order`). kgen's core reads
them through the family package; `op` uses them to choose a kernel."""

from __future__ import annotations

import functools

import torch

from kgen.families.fused_mlp import fused_backward, launch
from kgen.families.fused_mlp.cuda import CudaMLP
from kgen.families.fused_mlp.reference import backward_lean, eager
from kgen.families.fused_mlp.schema import fits, ring_reads, widths_of
from kgen.runtime.op import sm_count

FAMILY = "fused_mlp"

# --------------------------------------------------------------------------- tuning

# Buckets: the exact widths (a flag: only the same widths compare) and B rounded up to a
# power of two. The activations are not in the bucket: they are pointwise work in registers.
TUNE_DIMS = ("B", "widths")
# Rows beyond the tuned ones (B > 65536) take the nearest tuned bucket's winner however many
# they are (tuning_table.nearest): the largest tuned B's, not spec order's first (an exact CUDA
# variant, 2-7x slower than the Triton tiles from B = 16384).
TUNE_FREE_DIMS = ("B",)
DLRM_TOP, DLRM_BOTTOM = "367-512-256-1", "13-512-256-64-16"
# The weights' layout is part of a bucket where it changes what can run: `padded` (a bucket
# flag) where every weight whose rows are not whole 16-byte vectors (the top MLP's W0, 367
# wide; the bottom's, 13) comes row-padded to whole vectors, as FusedMLP lays them out
# (pad_weights), and the rest are contiguous (`layout_of`). The TMA ring variants read only such
# weights in place (their tensor maps need 16-byte row pitches; dense ones through a copy made
# each call, cuda.CudaMLP.scratch), so the same widths and B have two winners: one for
# dense weights, one for padded. A padded bucket nobody tuned takes the dense
# bucket's entry (TUNE_CLASS_FALLBACK: every variant runs padded weights at least as fast).
TUNE_SHAPES = tuple({"B": b, "widths": w, "activation": "relu", "last_activation": last, **layout}
                    for layout in ({}, {"layout": "padded"})
                    for w, last in ((DLRM_TOP, "sigmoid"), (DLRM_BOTTOM, "relu"))
                    for b in ((128, 512, 2048, 16384, 65536) if not layout else (128, 512, 1024, 2048, 4096, 16384)))
TUNE_CLASS_FALLBACK = {"padded": ""}  # tuning_table.stand_in: a padded bucket's untuned entry is the dense one's
TUNE_VARIATIONS = ({}, {"layout": "padded"})  # what `kgen tune --shapes` adds to each shape (layout=padded: only that)


def tune_bucket(B: int, widths, precision: str | None = None, layout: str | None = None, **_) -> str:
    """Widths, B rounded up to a power of two, for float32 the dot precision (TF32 on or
    off: different kernels, and eager's own matmuls change speed with it too), and `padded`
    for row-padded weights (`layout_of`)."""
    if layout not in (None, "padded"):
        raise ValueError(f"layout {layout!r}: the weights' layouts are dense (none given) and 'padded'")
    w = "-".join(map(str, widths_of(widths)))
    return (f"w{w}.B<={1 << max(0, B - 1).bit_length()}" + (f".{precision}" if precision else "")
            + (".padded" if layout == "padded" else ""))


def layout_of(weights, itemsize: int) -> str | None:
    """"padded" where at least one weight's width is not whole 16-byte vectors and every
    weight's rows are whole vectors apart (rows contiguous, their stride a multiple of 16
    bytes: launch.row_padded, FusedMLP's pad_weights; a whole-vector width may be contiguous);
    None otherwise (dense weights, any other layout, or widths whose rows all are whole
    vectors already)."""
    padded = False
    for w in weights:
        k, s = w.shape[1], w.stride(0)
        if w.shape[0] > 1 and (w.stride(1) != 1 or s < k or (s * itemsize) % 16):
            return None
        padded = padded or (w.shape[0] > 1 and (k * itemsize) % 16 != 0)  # (one row: no layout to speak of)
    return "padded" if padded else None


def bucket_extras(dtype: str) -> dict:
    """float32's precision from torch.backends.cuda.matmul.allow_tf32 (launch.precision), a
    part of its bucket; nothing for the 16-bit dtypes."""
    return {"precision": launch.precision(torch.float32)} if dtype == "float32" else {}




def make_inputs(device, dtype, B: int, widths, seed: int = 0, bias=True):
    """x ~ N(0, 1) and nn.Linear's initialisation U(-1/sqrt(in), 1/sqrt(in)) for weights and
    biases; `bias`: True, False or a per-layer list."""
    widths = widths_of(widths)
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, widths[0], generator=g)
    ws, bs = [], []
    for i in range(len(widths) - 1):
        k = widths[i] ** -0.5
        ws.append((torch.rand(widths[i + 1], widths[i], generator=g) * 2 - 1) * k)
        on = bias[i] if isinstance(bias, (list, tuple)) else bias
        bs.append((torch.rand(widths[i + 1], generator=g) * 2 - 1) * k if on else None)
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), [to(w) for w in ws], [to(b) for b in bs]


def tune_inputs(device, dtype: str, B: int, widths, activation: str = "relu", last_activation: str = "none",
                precision: str | None = None, layout: str | None = None) -> dict:
    x, ws, bs = make_inputs(device, getattr(torch, dtype), B, widths)
    if layout == "padded":  # (as FusedMLP's pad_weights: rows of whole 16-byte vectors)
        v = 16 // x.element_size()
        ws = [launch.row_padded(w, -(-w.shape[1] // v) * v) for w in ws]
    return {"x": x, "weights": ws, "biases": bs, "activation": activation, "last_activation": last_activation}


def tune_runner(kernel, inputs: dict):
    """One inference forward of `kernel` (None: the eager composition, as the op's fast path
    runs it for a signature eager won) into fresh outputs."""
    x, ws, bs = inputs["x"], inputs["weights"], inputs["biases"]
    a, last = inputs["activation"], inputs["last_activation"]
    if kernel is None:
        return lambda: eager(x, ws, bs, a, last)[0]
    widths = (x.shape[1], *(w.shape[0] for w in ws))
    if not fits(kernel.params, widths):
        raise ValueError(f"{kernel.name} does not take widths {widths}")
    return runner(implementation(kernel, widths), x, ws, bs, a, last)


def runner(mod, x, weights, biases, activation: str, last_activation: str):
    """() -> out: one forward of the implementation `mod` as the op runs it when called again
    with this signature: its eager fast path (launch.direct, bound by one `forward` first)
    where it has one, else `forward`. The tuner times this, so that a Triton variant's host
    cost is the op's (a bound launch), not `forward`'s: timed through `forward`, the H200's
    Triton variants of the bottom MLP at B <= 2048 paid ~29 us a call against 15 us of GPU
    time and lost to a CUDA variant taking 28 us of GPU time (BENCHMARKS.md, twenty-eighth
    session)."""
    def plain():
        return launch.forward(mod, x, weights, biases, activation, last_activation)[0]

    if not x.is_cuda:
        return plain
    plain()
    fast = launch.direct(mod, x, weights, biases, activation, last_activation)
    return plain if fast is None else (lambda: fast(x, weights, biases))


def implementation(kernel, widths: tuple, device=None):
    """What the op runs for a loaded variant: a Triton variant's module, or a CUDA variant
    with its Triton companion (spec order's first Triton variant that takes `widths`: it
    serves the backward's forward and the inputs the CUDA kernel does not take)."""
    if kernel.backend == "triton":
        return kernel.module
    from kgen.runtime import dispatch

    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    companion = dispatch.select(FAMILY, device, kernel.variant.dtype,
                                backend="triton", shape={"B": 1, "widths": "-".join(map(str, widths))})
    if companion is None:
        raise RuntimeError(f"{FAMILY}: no Triton variant for {kernel.variant.dtype} widths {widths} could be built "
                           f"to serve the backward of {kernel.name}")
    return CudaMLP(kernel, companion.module)


# --------------------------------------------------------------------------- the training backward

# The training fast path's backward (train.Entry.fused) is a choice per bucket, timed by the
# tuner beside the kernels (`tune_choices`) and kept in the table's entry: "fused" (the fused
# Triton backward, fused_backward.py: 2-3 launches; its options below) or "lean"
# (reference.backward_lean: per layer the activation's backward and cuBLAS GEMMs, 4-5 torch
# calls). Measured on an H200
# (GPU us in a CUDA graph, DLRM top / bottom at B = 128, 2048, 16384, 65536; BENCHMARKS.md,
# thirtieth session): bf16 fused 48.6 / 68.9 / 207 / 567 against lean 48.7 / 94.3 / 274 / 806
# (top), 17.9 / 32.2 / 90.9 / 299 against 59.8 / 91.8 / 206 / 578 (bottom); float32 with TF32
# fused lost at every top B (69.5 / 147 / 656 / 2399 against 48.7 / 106 / 346 / 1127) and at
# the bottom's B >= 16384 (388 / 1391 against 291 / 883), won at its B <= 2048 (36.8 / 79.0
# against 72.1 / 107). Where no table holds the bucket: fused for the 16-bit dtypes, and for
# float32 up to F32_FUSED_MAX_B rows (host-bound steps, where its fewer launches pay). For
# 16-bit dtypes the tuner also times the fused backward with other dz-chain tiles
# (fused_backward.CHAIN_OPTIONS, "fused_<tile>"): which chain tile wins depends on the widths
# (the DLRM top MLP's wider first layer took 128 x 128 at B >= 16384, the bottom's not, before
# 128-row chain tiles were dropped as miscompiled; fused_backward.CHAIN). Where
# x's rows or a large weight's are not whole 16-byte vectors (the top MLP's 367), each fused
# option also with `pad` ("..._pad": zero-padded copies, fused_backward.Plan).
F32_FUSED_MAX_B = 2048


def option_name(tile: str | None, pad: bool) -> str:
    """A fused option's name: "fused", then "_<tile>" (a CHAIN_OPTIONS key), then "_pad"."""
    return "_".join(["fused", *([tile] if tile else []), *(["pad"] if pad else [])])


# fused option name -> (chain tile or None: CHAIN's row, pad)
FUSED_OPTIONS = {option_name(t, pad): (fused_backward.CHAIN_OPTIONS.get(t), pad)
                 for pad in (False, True) for t in (None, *fused_backward.CHAIN_OPTIONS)}
BACKWARDS = (*FUSED_OPTIONS, "lean")


def fused_option(choice: str) -> tuple[tuple | None, bool]:
    """(chain tile or None: CHAIN's row, pad) of a fused option of BACKWARDS (KeyError for
    any other name)."""
    return FUSED_OPTIONS[choice]


def backward_choice(device: torch.device, dtype: torch.dtype, widths: tuple, B: int) -> str:
    """One of BACKWARDS ("fused", "fused_<tile>" with a CHAIN_OPTIONS tile, either with
    "_pad", or "lean"): the training backward for B rows of `widths` in `dtype` (float32
    under the process's TF32 setting) on `device`: the tuning table's choice for the bucket
    or the nearest tuned one, else the default above."""
    from kgen.runtime import tuning_table

    d = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        dev = tuning_table.device_key(device.index)
        k = tuning_table.key(FAMILY, dev, d, tune_bucket(B, widths, **bucket_extras(d)))
        got = tuning_table.choice(k, "backward")
        if got in FUSED_OPTIONS and dtype == torch.float32 and FUSED_OPTIONS[got][0] is not None:
            return option_name(None, FUSED_OPTIONS[got][1])  # (chain tiles: timed for 16-bit only)
        if got in BACKWARDS:
            return got
    return "fused" if dtype != torch.float32 or B <= F32_FUSED_MAX_B else "lean"


# How far a fused option's gradients may be from backward_lean's (the same math and roundings,
# another summation order), as a fraction of each gradient's largest element, for the tuner to
# keep it: 8 ulps of a 16-bit dtype (as tests/test_fused_mlp_backward.py's GPU tests), 1e-3 for
# float32 (TF32 dots). Chain kernels Triton miscompiled were off by 0.8-3.7x of the largest
# element (fused_backward.CHAIN).
AGREE = {torch.float16: 8 * 2.0 ** -10, torch.bfloat16: 8 * 2.0 ** -7, torch.float32: 1e-3}


def disagreement(got, want, dtype) -> tuple[float, int]:
    """How far fused backward gradients `got` ((grad_x, [grad_w], [grad_b])) are from `want`
    (backward_lean's): the largest over the gradients of (largest difference / that gradient's
    largest element) / AGREE[dtype] (inf where a NaN is not where want has one), and the index of
    that gradient in (x, weights, biases) order; gradients None in either are skipped."""
    flat = lambda r: [r[0], *r[1], *r[2]]  # noqa: E731
    worst, at = 0.0, -1
    for i, (a, b) in enumerate(zip(flat(got), flat(want))):
        if a is None or b is None:
            continue
        a, b = a.float(), b.float()
        scale = float(b.nan_to_num(0.0, 0.0, 0.0).abs().max()) or 1.0
        err = float((a - b).abs().nan_to_num(0.0, float("inf"), float("inf")).max())
        r = err / (AGREE[dtype] * scale) if torch.equal(a.isnan(), b.isnan()) else float("inf")
        if r > worst or at < 0:
            worst, at = r, i
    return worst, at


def agrees(got, want, dtype, name: str = "") -> bool:
    """Whether `got` is within AGREE of `want` (`disagreement` <= 1); warns (naming option
    `name`) where it is not: the tuner then never picks that option."""
    worst, at = disagreement(got, want, dtype)
    if worst <= 1.0:
        return True
    from kgen.runtime import dispatch

    dispatch.log.warning("kgen: fused_mlp backward option %s disagrees with the lean backward (gradient %d: "
                         "%.3g of its largest element); not a candidate", name, at, worst * AGREE[dtype])
    return False


def tune_choices(inputs: dict) -> dict:
    """{"backward": {option: one backward of every gradient}} on CUDA inputs: the fused Triton
    kernels (first: the default), for 16-bit dtypes also with CHAIN_OPTIONS' chain tiles, each
    also with `pad` where it changes anything, and backward_lean, on what one eager forward
    keeps (reference.eager: z, a ReLU layer's output, as a kernel's forward keeps them) and a
    random upstream gradient; backward_lean taking a ReLU layer's kept output as the next
    layer's input (`outputs`), as it runs in a step. A fused option is left out where its kernels
    do not build or take the call (its plan returns None), where its first call's gradients
    disagree with backward_lean's (`agrees`: a miscompiled kernel is never chosen), or
    KGEN_FUSED_MLP_FUSED_BWD=0."""
    x, ws, bs = inputs["x"], inputs["weights"], inputs["biases"]
    a, last = inputs["activation"], inputs["last_activation"]
    B, L = x.shape[0], len(ws)
    if x.device.type not in fused_backward.DEVICES or B == 0:  # (CUDA; tests add the interpreter's CPU)
        return {}
    with torch.no_grad():
        _, zs = eager(x, ws, bs, a, last, save=True)
    g = torch.randn(B, ws[-1].shape[0], device=x.device, dtype=x.dtype)
    has_bias, needs = tuple(b is not None for b in bs), (True,) * (1 + 2 * L)
    options = {}
    if fused_backward.ENABLED:
        lean = backward_lean(g, x, ws, has_bias, zs, a, last, needs)  # (what each fused option must agree with)
        widths = (x.shape[1], *(w.shape[0] for w in ws))
        tiles = [None, *(fused_backward.CHAIN_OPTIONS if x.dtype != torch.float32 else ())]
        for pad in (False, True):
            for tile in tiles:
                chain = fused_backward.CHAIN_OPTIONS.get(tile)
                p = fused_backward.plan(widths, x.dtype, x.device, B, has_bias, (a, last), needs, chain, pad)
                if p is None or (pad and not p.pads):  # (pad: nothing to copy at these widths)
                    continue
                got = p(g, x, ws, zs)  # the first call builds: None where it did not
                if got is not None and agrees(got, lean, x.dtype, option_name(tile, pad)):
                    options[option_name(tile, pad)] = functools.partial(p, g, x, ws, zs)
    options["lean"] = lambda: backward_lean(g, x, ws, has_bias, zs, a, last, needs, outputs=True)
    return {"backward": options}


# --------------------------------------------------------------------------- kernel choice

# Where nothing was tuned for the widths (dispatch's spec-order step, in its stead): the
# exact variants built for them, then the generic ones where a cost model says they beat the
# eager composition. A generic program runs every layer of its row tile in turn, a dot of
# block_k x block_k a step, so its time is about waves x (UNTUNED_PROGRAM_US + steps x the
# step's cost x block_m / 32), steps = sum over layers of cdiv(N, block_k) x cdiv(K,
# block_k), waves of UNTUNED_SLOTS_PER_SM programs an SM (H200, 32-row tiles: ~1.05 us a
# 16-bit step, ~2 a float32 step with TF32 off (three dots), 3 us a program). Eager pays
# EAGER_LAYER_US of host a layer (its launches: 12-40 us a layer on that host, from run to
# run) or its GPU time where that is longer (FLOPs at EAGER_TFLOPS, hidden activations
# written and read twice at EAGER_GBPS, 3 us a kernel). A generic variant stays a candidate
# while its prediction is at most UNTUNED_EAGER_FACTOR x eager's, each predicted for the
# bucket's largest B (dispatch's choice serves the whole bucket). Fitted on 97 random widths
# and B in two runs (BENCHMARKS.md, forty-third session), the time (max of host and GPU) of
# what the rule picks over the fastest candidate's, geomean: 1.12 (worst 11.0: float32 8869 x
# 75-893-1 on 64-row tiles, 817 us against eager's 74) under the old bounds (<= 2^18
# weights, weights x B <= 2^31, 64-row tiles first past B = 8192), 1.03 (worst 1.84) under
# this one; 1.05 against the old 1.045 on the second run alone (its eager host cost ~1.5x
# the first's). It keeps the old bounds' cases: 1024-4096-1024 (1669 us against eager's
# 18.8) and 784-512-512-10 (121 against 17) to eager, 32-64-64-1 (4.8 against 14.4) and
# 63-256x4-4 at B <= 4096 (44 against 105) generic. The generic tiles smallest first (64-row
# tiles beat 32-row ones by at most 1.3x there and lost by up to 2.4x, float32 past B =
# 8000), but for float32 with TF32 off past UNTUNED_SMALL_TILES_B rows, largest first: there
# the 64-row tile took 0.65-1.01x the 32-row one's time at 19 random widths (geomean ~0.82;
# widths up to 1000, B 8774-52845), except where a one-wide layer reads a wide input (75-893-1
# at B = 8869: 650 us against 336), which keeps the smallest first (BENCHMARKS.md,
# sixty-eighth session); and 16-bit past those rows where a layer is wider than 128 (two
# block_k steps): there 0.65-1.18x at 20 random widths (geomean 0.90; narrower, 0.80-1.21x,
# geomean 1.01, at 12). The exact variants (a model's own widths, tuned) keep their order:
# the CUDA cluster variants (DLRM's widths) are a chain of latencies a row tile: first only
# up to B = 128; the Triton tiles smallest first up to B = 8192 (more programs), largest
# first beyond (the tuned tables' winners on both GPUs).
UNTUNED_PROGRAM_US = 3.0
UNTUNED_STEP_US = {"16-bit": 1.05, "tf32x3": 2.0, "tf32": 1.5}  # a 32-row step; tf32: between (not fitted)
UNTUNED_SLOTS_PER_SM = 2
UNTUNED_EAGER_FACTOR = 1.0
EAGER_LAYER_US = 25.0
EAGER_KERNEL_US = 3.0
EAGER_TFLOPS = {"16-bit": 300.0, "tf32x3": 50.0, "tf32": 150.0}
EAGER_GBPS = 3000.0
UNTUNED_CLUSTER_B = 128
# ... and the TMA ring variants first from there up to UNTUNED_RING_B rows where they take the
# weights (`_ring_rank`): 12.5-16.2 us against the dispatch's 13.6-27.4 at B = 512-4096 (H100, bf16
# top MLP, row-padded W0, eighty-first session); at B <= 128 they come last (12.5 us against the
# clusters' 8.2), past 4096 after the Triton tiles (8192: 31.0, the Triton m32's 31.0)
UNTUNED_RING_B = 4096
RING_C4_SHARE = 0.9  # 32 clusters of 4 (128 CTAs) took two waves on the H100's 132 SMs
UNTUNED_SMALL_TILES_B = 8192
UNTUNED_ONE_WIDE_K = 64
UNTUNED_WIDE_16BIT = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sms() -> int:
    """SMs of the current CUDA device (132, an H100's or H200's, without one)."""
    cuda = torch.cuda.is_available()
    return sm_count(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"), 132)


def _dot_class(dtype: str, shape: dict) -> str:
    return shape.get("precision") or "tf32x3" if dtype == "float32" else "16-bit"


def generic_us(params: dict, dtype: str, B: int, widths, shape: dict) -> float:
    """Predicted GPU time of a generic variant (knobs `params`) on B rows of `widths`."""
    bk, bm = params["block_k"], params["block_m"]
    steps = sum(_cdiv(n, bk) * _cdiv(k, bk) for k, n in zip(widths, widths[1:]))
    waves = _cdiv(_cdiv(B, bm), UNTUNED_SLOTS_PER_SM * _sms())
    return waves * (UNTUNED_PROGRAM_US + steps * UNTUNED_STEP_US[_dot_class(dtype, shape)] * bm / 32)


def eager_us(dtype: str, B: int, widths, shape: dict) -> float:
    """Predicted time of the eager composition: its host cost or its GPU time."""
    layers = len(widths) - 1
    size = 4 if dtype == "float32" else 2
    flops = sum(2 * B * k * n for k, n in zip(widths, widths[1:]))
    moved = B * size * (widths[0] + widths[-1] + 4 * sum(widths[1:-1]))
    gpu = flops / (EAGER_TFLOPS[_dot_class(dtype, shape)] * 1e6) + moved / (EAGER_GBPS * 1e3) \
        + EAGER_KERNEL_US * (2 * layers - 1)
    return max(EAGER_LAYER_US * layers, gpu)


def _large_tiles_first(dtype: str, B: int, widths, shape: dict) -> bool:
    """Whether the generic variants go largest row tile first: past UNTUNED_SMALL_TILES_B
    rows, float32 with TF32 off but where a one-wide layer reads more than one block_k step
    (it runs as a float32 FMA loop, which a 64-row tile makes ~2x slower), and 16-bit where
    a layer is wider than UNTUNED_WIDE_16BIT."""
    if B <= UNTUNED_SMALL_TILES_B:
        return False
    dots = _dot_class(dtype, shape)
    if dots == "tf32x3":
        return not any(n == 1 and k > UNTUNED_ONE_WIDE_K for k, n in zip(widths, widths[1:]))
    return dots == "16-bit" and max(widths) > UNTUNED_WIDE_16BIT


def _split_first(exact: list, B: int) -> list:
    """`exact` with the split variants (the `split` knob) whose B rows make at most
    UNTUNED_SLOTS_PER_SM programs an SM first, most programs a row tile first (the least of
    W0 and W1 each program streams: what a program's time follows at small B), then the
    most programs; the other split variants last (past that many programs a row tile's
    partials only add traffic; H100, the split probe, BENCHMARKS.md seventy-eighth session)."""
    def programs(v):
        return _cdiv(B, v.params["block_m"]) * v.params["split"]

    split = [v for v in exact if v.params["split"] > 1]
    first = sorted((v for v in split if programs(v) <= UNTUNED_SLOTS_PER_SM * _sms()),
                   key=lambda v: (-v.params["split"], -programs(v)))
    return first + [v for v in exact if v.params["split"] == 1] + [v for v in split if v not in first]


def untuned_order(variants, shape: dict) -> list:
    """dispatch's hook for widths nothing was tuned for: `variants` (those that take the
    widths, in spec order) to try in turn; none left means the eager composition."""
    widths = widths_of(shape["widths"])
    B = 1 << max(0, int(shape["B"]) - 1).bit_length()  # the bucket's (its choice serves all of it)
    by_tile = {"key": lambda v: v.params["block_m"], "reverse": B > UNTUNED_SMALL_TILES_B}
    cuda = [v for v in variants if v.backend == "cuda"]
    exact = sorted((v for v in variants if v.backend == "triton" and v.params["widths"]), **by_tile)
    exact = _split_first(exact, B)
    generic = sorted((v for v in variants if v.backend == "triton" and not v.params["widths"]),
                     key=lambda v: v.params["block_m"])
    if generic and _large_tiles_first(generic[0].dtype, B, widths, shape):
        generic.reverse()
    if generic:
        eager = eager_us(generic[0].dtype, B, widths, shape)
        generic = [v for v in generic
                   if generic_us(v.params, v.dtype, B, widths, shape) <= UNTUNED_EAGER_FACTOR * eager]
    ring = [v for v in cuda if v.params.get("stages")]
    cuda = [v for v in cuda if not v.params.get("stages")]
    if ring and UNTUNED_CLUSTER_B < B <= UNTUNED_RING_B and ring_reads(widths, ring[0].dtype, shape.get("layout")):
        return sorted(ring, key=lambda v: _ring_rank(v.params, B)) + exact + generic + cuda
    return cuda + exact + generic + ring if B <= UNTUNED_CLUSTER_B else exact + generic + cuda + ring


def _ring_rank(params: dict, B: int) -> tuple:
    """A TMA ring variant's place among the others for B rows: fewest waves of CTAs first (one
    CTA an SM; clusters of 4 place on at most RING_C4_SHARE of the SMs; a split variant's
    cluster shares one row tile), then the split variants (half the weights through each SM),
    then the larger cluster (fewer L2 reads of the weights), then the smaller row tile. H100,
    top MLP, row-padded W0, bf16 (tools/fused_mlp_ring_bench.py, eighty-second session): split c2
    m16 10.0 us at B = 512-1024 where c4 m16 takes 12.6; at 2048 split c2 m16 (256 CTAs: two
    waves) 20.1 where split c2 m32 takes 11.7; at 4096 split c2 m64 15.7 where c2 m32 takes 16.3."""
    split = bool(params.get("split_n"))
    ctas = -(-B // params["block_m"]) * (params["cluster"] if split else 1)
    capacity = int(_sms() * (RING_C4_SHARE if params["cluster"] >= 4 else 1.0))
    return -(-ctas // max(1, capacity)), not split, -params["cluster"], params["block_m"]
