"""fused_mlp as an op: which implementation runs (dispatch per (widths, B bucket, dtype),
`using`; the tuning hooks it reads are in `tuning`), the torch.library ops (forward and
backward, with fake impls and autograd), the public `fused_mlp`, and the golden numerics
`kgen verify` runs."""

from __future__ import annotations

import math
import os

import torch

from kgen.families.fused_mlp import launch, train
from kgen.families.fused_mlp.checks import check_inputs
from kgen.families.fused_mlp.reference import eager, reference
from kgen.families.fused_mlp.schema import fits, widths_of
from kgen.families.fused_mlp.tuning import (  # noqa: F401 (the family package and tests read them here too)
    DLRM_BOTTOM, DLRM_TOP, FAMILY, TUNE_CLASS_FALLBACK, TUNE_DIMS, TUNE_FREE_DIMS, TUNE_SHAPES, TUNE_VARIATIONS, UNTUNED_CLUSTER_B,
    UNTUNED_SMALL_TILES_B, bucket_extras, eager_us, generic_us, implementation, layout_of, make_inputs, runner,
    tune_bucket, tune_choices, tune_inputs, tune_runner, untuned_order)
from kgen.runtime.memo import CallMemo
from kgen.runtime.op import (Kernels, MISSING, Override, _any_autocast, autocast, check_dispatch_env, define,
                             dispatch_modes, error_ratio, poisoned, with_reference)

KERNELS = Kernels(FAMILY, tune_bucket)

_FORCED = Override()
# The eager fast path (`fused_mlp`): per exact call signature (_call), the variant's
# bound launcher (launch.direct), at most 4096 of them; the `using` blocks open in
# any thread (the fast path steps aside while one is). FAST_PATH off: every call takes the
# op (the "before" of tools/fused_mlp_host.py).
_FAST = CallMemo(4096)
_USING = _FORCED.open
FAST_PATH = True
# The training fast path (train.py): per call signature, a train.Entry, remembered by the
# general path's backward. FAST_TRAIN off (KGEN_FUSED_MLP_FAST_TRAIN=0): every call needing a
# gradient takes the op, and its backward recomputes the forward then runs
# reference.backward (the "before" of tools/device_fused_mlp_train.sh).
_TRAIN = CallMemo(4096)
FAST_TRAIN = os.environ.get("KGEN_FUSED_MLP_FAST_TRAIN", "1") != "0"

# Run the op with this implementation (a loaded variant's `.module`, or None: the eager
# composition) instead of dispatch's choice, in this thread. For tests and benchmarks.
using = _FORCED.using


def module_for(device: torch.device, dtype: torch.dtype, widths: tuple, B: int, weights=()):
    """What runs the variant dispatch chose for (widths, B bucket, dtype, the weights' layout:
    tuning.layout_of): a Triton variant's rendered module, a CUDA variant's CudaMLP, or None
    for the eager composition (CPU tensors, nothing fits or builds, or eager won)."""
    forced = _FORCED.get()
    if forced is not MISSING:
        return forced
    if device.type != "cuda":
        check_dispatch_env()  # (a typo in KGEN_BACKEND / KGEN_AUTOTUNE fails here too)
        return None
    extras = bucket_extras(str(dtype).removeprefix("torch."))  # the bucket's process state, as the tuner's
    layout = layout_of(weights, dtype.itemsize)
    if layout is not None:
        extras["layout"] = layout
    key = (device.index, dtype, widths, B.bit_length(), layout, *extras.values())
    kernel = KERNELS.lookup(key)
    if kernel is MISSING:
        kernel = KERNELS.choose(key, device, dtype, {"B": max(B, 1), "widths": "-".join(map(str, widths)), **extras})
        if kernel is not None and not fits(kernel.params, widths):  # a forced variant of other widths
            raise ValueError(f"fused_mlp: KGEN_VARIANT={kernel.name} does not take widths {widths}")
    if kernel is None:
        return None
    if kernel.backend == "triton":
        return kernel.module
    impl = _CUDA.get((kernel.name, device.index))
    if impl is None:
        impl = _CUDA[(kernel.name, device.index)] = implementation(kernel, widths, device)
    return impl


_CUDA: dict = {}  # (CUDA variant name, device index) -> its CudaMLP (an exact variant: one widths)


# --------------------------------------------------------------------------- torch.library


def _per_layer(biases, bias_mask: int, L: int) -> list:
    """One entry per layer (the present biases in order, None where bit i of bias_mask is
    clear); ValueError where the mask does not describe `biases` (the torch.ops form)."""
    if not 0 <= bias_mask < 1 << L or bin(bias_mask).count("1") != len(biases):
        raise ValueError(f"fused_mlp: bias_mask {bias_mask:#b} does not match {len(biases)} biases for {L} layers "
                         "(bit i set: layer i has the next bias)")
    it = iter(biases)
    return [next(it) if (bias_mask >> i) & 1 else None for i in range(L)]


def _flat(x, widths):
    x2 = x.reshape(math.prod(x.shape[:-1]), widths[0])  # (not -1: ambiguous under vmap over an empty batch)
    return x2 if x2.is_contiguous() else x2.contiguous()


def _contig(ts):
    return [t if t is None or t.is_contiguous() else t.contiguous() for t in ts]


def _forward_impl(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], bias_mask: int,
                  activation: str, last_activation: str) -> torch.Tensor:
    """The forward op: `biases` holds the present biases, layer i having one when bit i of
    `bias_mask` is set (a Tensor[] without holes autograd handles per element)."""
    bl = _per_layer(biases, bias_mask, len(weights))
    widths = check_inputs(x, weights, bl, activation, last_activation)
    x2 = _flat(x, widths)
    mod = module_for(x.device, x.dtype, widths, x2.shape[0], weights)
    if mod is None:
        out = eager(x2, weights, bl, activation, last_activation)[0]
    else:
        out = launch.forward(mod, x2, weights, _contig(bl), activation, last_activation)[0]  # (weights: readable)
    if FAST_PATH and x.is_cuda and _FORCED.get() is MISSING and type(x) is torch.Tensor:
        _remember(mod, x, weights, bl, activation, last_activation, widths)
    return out.reshape(*x.shape[:-1], widths[-1])


def _call(x, weights, biases, activation, last_activation) -> tuple:
    """A call as the fast paths' memos (kgen.runtime.memo) keep it: the key (x's shape, the
    activations, the layer count, which layers have a bias, float32's TF32 setting) and the
    tensors (x, the weights, the present biases), whose type, shape, strides, dtype, device
    and requires_grad the memo compares; so that a call found there passes check_inputs and
    gets the same variant, kernel and arguments but for its pointers."""
    present = [b for b in biases if b is not None]
    pattern = True if len(present) == len(biases) else tuple(b is None for b in biases)
    key = (x.shape, activation, last_activation, len(weights), pattern, x.dtype is _F32 and _allow_tf32())
    return key, (x, *weights, *present)


_F32 = torch.float32
# (torch.backends.cuda.matmul.allow_tf32 reads this through a module __getattr__: ~1.4 us)
_allow_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", None) or (lambda: torch.backends.cuda.matmul.allow_tf32)


def _remember(mod, x, weights, biases, activation, last_activation, widths=None):
    """After a general-path call: the fast-path launcher of this call's signature, where it
    has one (plain tensors; a variant's launch: contiguous, 16-byte aligned, the binary
    bound). `mod` None: dispatch gave the call to the eager composition, which then runs
    without the op around it (torch.library's dispatch, the checks and the choice: ~40 us a
    call on an H100 host); `widths` its widths."""
    if not all(type(t) in _PLAIN for t in (*weights, *(b for b in biases if b is not None))):
        return
    if x.is_cuda and torch.cuda.is_current_stream_capturing():  # a launch's prototype output: in the graph's pool
        return
    call = _call(x, weights, biases, activation, last_activation)
    if _FAST.has(call):
        return
    if mod is None and x.dim() == 2:  # (the call fixes x's shape) no reshapes: ~3 us a call
        def f(x, weights, biases):
            return eager(x, weights, biases, activation, last_activation)[0]
    elif mod is None:
        w0, wl = widths[0], widths[-1]

        def f(x, weights, biases):
            out = eager(x.reshape(-1, w0), weights, biases, activation, last_activation)[0]
            return out.reshape(*x.shape[:-1], wl)
    else:
        f = launch.direct(mod, x, weights, biases, activation, last_activation)
    if f is not None:  # (with whether a call like this one needs a gradient where grad mode is on)
        _FAST.put(call, (f, any(t.requires_grad for t in call[1])))


def _forward_fake(x, weights, biases, bias_mask, activation, last_activation):
    widths = check_inputs(x, weights, _per_layer(biases, bias_mask, len(weights)), activation, last_activation)
    return x.new_empty((*x.shape[:-1], widths[-1]))


def _backward_impl(grad: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
                   bias_mask: int, activation: str, last_activation: str, need_x: bool) -> list[torch.Tensor]:
    """[grad_x (empty when not need_x), grad_w per layer, grad_b per present bias]."""
    bl = _per_layer(biases, bias_mask, len(weights))
    widths = (x.shape[-1], *(w.shape[0] for w in weights))
    x2, g2 = _flat(x, widths), _flat(grad, widths[-1:])
    mod = module_for(x.device, x.dtype, widths, x2.shape[0], weights)
    ws = list(weights)  # (as given: train.gradients copies those its kernels do not read in place)
    if x2.shape[0] == 0:
        gx, gws = x2.clone(), [torch.zeros_like(w) for w in ws]
        gbs = [None if b is None else torch.zeros_like(b) for b in bl]
    else:
        g2, bs = g2.to(x.dtype), _contig(bl)
        if not FAST_TRAIN:
            gx, gws, gbs = launch.backward(mod, g2, x2, ws, bs, activation, last_activation, need_x)
        else:
            # the training fast path's backward (train.gradients, with the entry's plan where this
            # call makes or finds one), so that the first step's gradients are the later steps'
            zs = launch.saved(mod, x2, ws, bs, activation, last_activation)
            # (an entry is made after a `save` launch: its launcher binds that binary; none while
            # capturing a CUDA graph, where a new plan's first launches would load its kernels)
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            entry = None
            if FAST_PATH and x.is_cuda and not capturing and _FORCED.get() is MISSING and type(x) is torch.Tensor:
                entry = _remember_train(mod, x, weights, bl, activation, last_activation)
            acts, has_bias, B = (activation, last_activation), tuple(b is not None for b in bl), x2.shape[0]
            needs = (need_x, *(True,) * len(ws), *has_bias)
            if entry is not None:
                p = entry.fused(x2, ws, B, needs)
            elif capturing:
                p = None  # backward_lean
            else:
                p = train.plan_for(x2, widths, B, has_bias, acts, needs)
            gx, gws, gbs = train.gradients(p, g2, x2, ws, has_bias, zs, acts, needs)
            if p is not None:  # (the plan's gradients are views of one buffer: an op's outputs may not alias)
                gws = [g.clone() for g in gws]
                gbs = [None if g is None else g.clone() for g in gbs]
    gx = gx.reshape(x.shape) if need_x else x.new_empty(0)
    return [gx, *gws, *(g for g in gbs if g is not None)]


def _remember_train(mod, x, weights, biases, activation, last_activation):
    """In a general-path backward (not while capturing a CUDA graph): the training fast
    path's entry for this call's signature (plain tensors only; else None), made and kept
    where there is none yet."""
    if not all(type(t) in _PLAIN for t in (*weights, *(b for b in biases if b is not None))):
        return None
    call = _call(x, weights, biases, activation, last_activation)
    entry = _TRAIN.get(call)
    if entry is None:
        entry = train.make(mod, x, weights, biases, activation, last_activation)
        _TRAIN.put(call, entry)
    return entry


def _backward_fake(grad, x, weights, biases, bias_mask, activation, last_activation, need_x):
    gx = x.new_empty(x.shape) if need_x else x.new_empty(0)
    return [gx, *(w.new_empty(w.shape) for w in weights), *(b.new_empty(b.shape) for b in biases)]


def _setup_context(ctx, inputs, output):
    x, weights, biases, bias_mask, activation, last_activation = inputs
    ctx.save_for_backward(x, *weights, *biases)
    ctx.L, ctx.mask, ctx.acts = len(weights), bias_mask, (activation, last_activation)


def _backward(ctx, grad):
    saved = ctx.saved_tensors
    x, L = saved[0], ctx.L
    ws, bs = list(saved[1:1 + L]), list(saved[1 + L:])
    need_x = bool(ctx.needs_input_grad[0])
    res = _backward_op(grad, x, ws, bs, ctx.mask, *ctx.acts, need_x)
    return (res[0] if need_x else None), list(res[1:1 + L]), list(res[1 + L:]), None, None, None


_backward_op = define("fused_mlp_backward", _backward_impl, fake=_backward_fake)
_op = define("fused_mlp", _forward_impl, fake=_forward_fake, backward=_backward, setup_context=_setup_context,
             composition=with_reference(_forward_impl, _FORCED))

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_step = train.Step.apply
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def _fast(x, weights, biases, activation, last_activation):
    """The eager fast path (see fused_mlp), or None: the op serves this call."""
    if type(x) is not torch.Tensor or type(weights) not in (list, tuple):
        return None
    if biases is None:
        biases = (None,) * len(weights)
    elif type(biases) not in (list, tuple) or len(biases) != len(weights):
        return None
    try:
        call = _call(x, weights, biases, activation, last_activation)
        grad = _grad_enabled()
        if grad and FAST_TRAIN and _TRAIN.size:
            entry = _TRAIN.get(call)  # (its tensors' requires_grad as the backward's call had them)
            if entry is not None:
                return _step(entry, *call[1])
        hit = _FAST.get(call)
    except (AttributeError, TypeError):  # not tensors, an unhashable activation: the op says what is wrong
        return None
    if hit is None or (hit[1] and grad):  # a call that needs a gradient: the op's
        return None
    return hit[0](x, weights, biases)


def fused_mlp(x: torch.Tensor, weights, biases=None, *, activation: str = "relu",
              last_activation: str = "none") -> torch.Tensor:
    """A whole MLP in one launch: h = x; for each layer i, h = act_i(h @ weights[i].T + biases[i]).

    x `[..., w0]` (bfloat16, float16 or float32); `weights[i]` `[w(i+1), w(i)]` (nn.Linear's
    layout) in x's dtype; `biases[i]` `[w(i+1)]` or None (`biases=None`: no biases);
    `activation` after every layer but the last, `last_activation` after the last, each one
    of none, relu, sigmoid, gelu (tanh form), silu. 1 to 8 layers, widths 1 to 4096.

    Rounding, as eager PyTorch's `F.linear` + activation composition: each layer
    accumulates in float32 and adds its bias in float32, rounds that (z) to x's dtype,
    takes the activation of z in float32 and rounds it to x's dtype. Against a float64
    forward the error after L layers is ~2L roundings of the activations' size (bf16 ~3e-2
    for 4 layers of O(1) activations, fp16 ~4e-3; float32 uses TF32 dots where
    torch.backends.cuda.matmul.allow_tf32 is set, ~1e-3 per layer, else ~1e-6): the
    tolerances in kgen/specs/fused_mlp.yaml. With TF32 on, the forward rounds the operands
    to TF32 as cuBLAS does, and computes a one-wide layer (input or output width 1) in full
    float32, as cuBLAS does at every batch size, and so does the fused backward with such a
    layer's products.

    Differentiable in x, every weight and every bias (the backward recomputes the forward,
    saving each layer's z, then runs the training fast path's backward below on them, so the
    first training step of a signature and its later ones give the same gradients bit for
    bit; deterministic; the training fast path saves the z in the forward instead). On CUDA tensors the variant
    dispatch chose for (widths, B bucket, dtype) runs on the current stream (or the eager
    composition where no variant fits or it won the tuning); CPU tensors run the eager
    composition. Under torch.autocast, x, the weights and biases are cast to its dtype, as
    nn.Linear's are. Also `torch.ops.kgen.fused_mlp` (biases as the present ones plus a bit
    mask).

    Eager inference calls (no gradient needed, no autocast, not tracing, no `using` block)
    whose signature (shapes, dtypes, devices, bias pattern, activations) ran before on a
    variant, with contiguous 16-byte-aligned CUDA inputs, take a fast path: the variant,
    grid and constant arguments cached, the kernel launched directly
    (kgen.runtime.triton_launch), the same launch the op would make; where dispatch gave the
    signature to the eager composition, the composition runs without the op around it. Eager
    calls that need a gradient take the training fast path (train.py) under the same
    conditions, once the op's backward ran for their signature: one forward launch that
    keeps each layer's z, and on CUDA the fused Triton backward on them (fused_backward.py:
    two or three launches for every gradient, no atomics; KGEN_FUSED_MLP_FUSED_BWD=0 runs
    per-layer torch GEMMs instead);
    KGEN_FUSED_MLP_FAST_TRAIN=0 turns the training fast path off."""
    # (tracing first: torch.compile then reads none of the fast path's state, so no guards on it)
    if (not _compiling() and FAST_PATH and (_FAST.size or _TRAIN.size) and not _USING and not _any_autocast()
            and not dispatch_modes()):
        out = _fast(x, weights, biases, activation, last_activation)
        if out is not None:
            return out
    if not isinstance(weights, (list, tuple)):
        raise TypeError("fused_mlp: weights must be a list of tensors")
    if biases is None:
        biases = [None] * len(weights)
    if not isinstance(biases, (list, tuple)):
        raise TypeError("fused_mlp: biases must be a list (tensors or None per layer) or None")
    if len(biases) != len(weights):
        raise ValueError(f"fused_mlp: {len(biases)} biases for {len(weights)} weights; give one per layer")
    x, *cast = autocast(x, *weights, *biases)  # under torch.autocast, as nn.Linear's layers
    weights, biases = cast[:len(weights)], cast[len(weights):]
    mask, present = 0, []
    for i, b in enumerate(biases):
        if b is not None:
            mask |= 1 << i
            present.append(b)
    return _op(x, list(weights), present, mask, activation, last_activation)


OPS = {"fused_mlp": fused_mlp}


# --------------------------------------------------------------------------- golden numerics

# Widths the generic variants are checked at: awkward ones (not multiples of any chunk),
# one-wide layers, a 1000-wide one, 5 layers.
GOLDEN_GENERIC_WIDTHS = ((13, 1), (1, 37, 3), (367, 1000, 129, 1), (13, 100, 64, 17, 300, 5))
GOLDEN_B = (1, 3, 129)
# (activation, last_activation, biases): every activation in both places, biases on and off
GOLDEN_CASES = (("relu", "none", True), ("sigmoid", "sigmoid", False), ("gelu", "relu", True),
                ("silu", "gelu", False), ("none", "silu", True))


def golden(kernel, device, dtype: str, tol) -> list[tuple[str, float]]:
    """Forward of one loaded variant at its widths (exact) or GOLDEN_GENERIC_WIDTHS (generic,
    those within its bound), B in GOLDEN_B, GOLDEN_CASES (each activation in both places, biases on every
    layer and on none), against float64, into a NaN-poisoned output (an element never written fails).
    A CUDA variant runs every case itself, never its Triton companion: the TMA ring kernel's
    weights row-padded to whole 16-byte vectors (cuda.CudaMLP.takes), as FusedMLP lays them out."""
    from kgen.families.fused_mlp.cuda import CudaMLP

    t = getattr(torch, dtype)
    p = kernel.params
    all_widths = [tuple(p["widths"])] if p["widths"] else [w for w in GOLDEN_GENERIC_WIDTHS if fits(p, w)]
    out = []
    for widths in all_widths:
        mod = implementation(kernel, widths)
        for B in GOLDEN_B:
            for k, (a, last, bias) in enumerate(GOLDEN_CASES):
                x, ws, bs = make_inputs(device, t, B, widths, seed=B * 31 + k, bias=bias)
                if type(mod) is CudaMLP:
                    if mod.tma:
                        ws = [launch.row_padded(w, -(-w.shape[1] // 8) * 8) if i < mod.tma else w
                              for i, w in enumerate(ws)]
                    if not mod.takes(x, ws, bs):
                        raise AssertionError(f"{kernel.name} does not take its golden inputs (its companion would run)")
                got = poisoned((B, widths[-1]), t, device)
                launch.forward(mod, x, ws, bs, a, last, out=got)
                ref = reference(x, ws, bs, a, last)
                name = f"{'-'.join(map(str, widths))} B={B} {a}/{last}{'' if bias else ' no-bias'}"
                out.append((name, error_ratio(got, ref, tol)))
    return out


def grad_check(mod, device, dtype, B, widths, activation, last_activation, bias=True, tol=None):
    """Each gradient's worst error against float64 autograd, as a ratio of `tol`, beside
    the same ratio for eager PyTorch's autograd in `dtype` (used by the tests; in 16-bit
    dtypes ReLU's mask flips where a rounded z changes sign, an error eager has too):
    [(name, ratio, eager ratio)]. Errors are relative to each gradient's largest element
    (gradients are sums over B rows)."""
    x, ws, bs = make_inputs(device, dtype, B, widths, bias=bias)
    g = torch.randn(B, widths_of(widths)[-1], generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    gx, gws, gbs = launch.backward(mod, g, x, ws, bs, activation, last_activation)
    got = [gx, *gws, *(b for b in gbs if b is not None)]

    def grads(dt):
        leaves = [t.to(dt).requires_grad_() for t in (x, *ws, *(b for b in bs if b is not None))]
        it = iter(leaves[1 + len(ws):])
        bl = [next(it) if b is not None else None for b in bs]
        if dt == torch.float64:
            out = reference(leaves[0], leaves[1:1 + len(ws)], bl, activation, last_activation)
        else:
            out = eager(leaves[0], leaves[1:1 + len(ws)], bl, activation, last_activation)[0]
        out.backward(g.to(dt))
        return [t.grad for t in leaves]

    ref, eg = grads(torch.float64), grads(dtype)
    names = ["x", *(f"w{i}" for i in range(len(ws))), *(f"b{i}" for i, b in enumerate(bs) if b is not None)]
    res = []
    for n, a, e, r in zip(names, got, eg, ref):
        scale = float(r.abs().max()) or 1.0
        res.append((n, error_ratio(a / scale, r / scale, tol), error_ratio(e / scale, r / scale, tol)))
    return res
