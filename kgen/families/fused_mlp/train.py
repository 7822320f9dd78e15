"""fused_mlp's eager training fast path: an autograd.Function whose forward launches the
variant once with `save` through a bound launcher (launch.direct, as the inference fast path)
and keeps each layer's z, and whose backward runs on them — no second forward, no
torch.library dispatch, no per-call checks or kernel choice. The backward: on CUDA, the
fused Triton backward (fused_backward.py: two or three launches for every gradient, its
plan kept per entry and `needs`) where the bucket's tuned choice (tuning.backward_choice)
says it wins; elsewhere (that choice "lean", the CPU, B = 0, KGEN_FUSED_MLP_FUSED_BWD=0, its
kernels failing to build) reference.backward_lean (per layer 4-5 torch calls).

Why: a training step at B <= 16384 is host-bound. The general path (the op through autograd)
runs check_inputs and the kernel choice, launches the forward, and in the backward launches
it again with `save` (the op returns only the output) before the same backward (`gradients`).
This path is taken per exact call signature that the general path has served once (its
backward remembers it, `remember`), only eagerly: op.fused_mlp steps aside from it under
torch.compile, autocast, `using` blocks, tensor subclasses and KGEN_FUSED_MLP_FAST_TRAIN=0.
CUDA-graph capture records it like any launch (the bound launcher runs on the current stream).
"""

from __future__ import annotations

import torch

from kgen.families.fused_mlp import fused_backward, launch
from kgen.families.fused_mlp.reference import backward_lean, eager
from kgen.families.fused_mlp.tuning import backward_choice, fused_option
from kgen.runtime.op import once_differentiable
from kgen.runtime.triton_launch import current_device


class Entry:
    """One call signature's training forward: the variant's module (None: the eager
    composition), its bound `save` launcher (None: launch.forward each call), and what the
    backward needs to know of the signature."""

    __slots__ = ("mod", "go", "acts", "has_bias", "L", "out_shape", "w0", "plans")

    def __init__(self, mod, go, acts, has_bias, out_shape, w0):
        self.mod, self.go, self.acts, self.has_bias = mod, go, acts, has_bias
        self.L, self.out_shape, self.w0 = len(has_bias), out_shape, w0
        self.plans = {}  # (needs, precision) -> fused_backward.Plan, or None: backward_lean

    def fused(self, x, ws, B: int, needs):
        """The fused backward's plan for this call (plan_for), kept per `needs` and precision
        (where it can apply at all: `applies`, read each call)."""
        if not applies(x, B):
            return None
        key = (needs, launch.precision(x.dtype))
        p = self.plans.get(key, False)
        if p is False:
            widths = (self.w0, *(w.shape[0] for w in ws))
            p = self.plans[key] = plan_for(x, widths, B, self.has_bias, self.acts, needs)
        return p

    def forward(self, x, weights, biases):
        """(out [..., wL], zs) for plain x and per-layer biases."""
        if self.go is not None:
            res = self.go(x, weights, biases)
            if res is not None:
                out, zs = res
                return out, zs
        # the general launch (an unaligned or non-contiguous call, a hook, no bound binary)
        x2 = x.reshape(-1, self.w0)
        x2 = x2 if x2.is_contiguous() else x2.contiguous()
        ws = [w if w.is_contiguous() else w.contiguous() for w in weights]
        bs = [b if b is None or b.is_contiguous() else b.contiguous() for b in biases]
        if self.mod is None:
            out, zs = eager(x2, ws, bs, *self.acts, save=True)
            zs = [z if i < self.L - 1 or self.acts[1] != "none" else None for i, z in enumerate(zs)]
        else:
            out, zs = launch.forward(self.mod, x2, ws, bs, *self.acts, save=True)
        return out.reshape(self.out_shape), zs


def applies(x, B: int) -> bool:
    """Whether the fused backward can serve B rows of x: on (KGEN_FUSED_MLP_FUSED_BWD),
    B > 0, a device in fused_backward.DEVICES, the current one (Triton launches there)."""
    if not fused_backward.ENABLED or B == 0 or x.device.type not in fused_backward.DEVICES:
        return False
    return not x.is_cuda or x.device.index == current_device()


def plan_for(x, widths, B: int, has_bias, acts, needs):
    """The fused backward's plan for B rows of x's dtype and device (None: backward_lean
    serves the call: where the tuning table's choice for the bucket, or the default, is
    "lean" (tuning.backward_choice), B = 0, a device not in fused_backward.DEVICES or not the
    current one, KGEN_FUSED_MLP_FUSED_BWD=0)."""
    if not applies(x, B):
        return None
    choice = backward_choice(x.device, x.dtype, widths, B)
    if choice == "lean":
        return None
    return fused_backward.plan(widths, x.dtype, x.device, B, has_bias, acts, needs, *fused_option(choice))


def gradients(p, g, x2, ws, has_bias, zs, acts, needs):
    """(grad_x or None, [grad_w or None], [grad_b or None]) for 2-D g and x2 and the forward's
    zs: through plan `p` (plan_for), or backward_lean where p is None or declines. Both the
    training fast path (Step) and the op's general backward run this, so a signature's first
    training step (the op's) and its later ones (Step's) give the same gradients bit for bit."""
    res = p(_contig(g), _contig(x2), ws, zs) if p is not None else None  # (the plan copies weights as needed)
    if res is None:
        res = backward_lean(g, x2, ws, has_bias, zs, *acts, needs, outputs=True)
    return res


def make(mod, x, weights, biases, activation: str, last_activation: str, go=None) -> Entry:
    """The entry for this call's signature (biases: one per layer, tensor or None): with a
    bound launcher where launch.direct makes one for CUDA tensors (its `save` binary launched
    before), or `go` (tests)."""
    if go is None and mod is not None and x.is_cuda:
        go = launch.direct(mod, x, weights, biases, activation, last_activation, save=True)
    out_shape = (*x.shape[:-1], weights[-1].shape[0])
    return Entry(mod, go, (activation, last_activation), tuple(b is not None for b in biases), out_shape,
                 x.shape[-1])


class Step(torch.autograd.Function):
    """apply(entry, x, *weights, *present biases) -> out. Saves x, the weights and the zs."""

    @staticmethod
    def forward(ctx, entry, x, *params):
        L = entry.L
        it = iter(params[L:])
        biases = [next(it) if on else None for on in entry.has_bias]
        out, zs = entry.forward(x, params[:L], biases)
        ctx.entry, ctx.n_z = entry, sum(z is not None for z in zs)
        ctx.save_for_backward(x, *params[:L], *(z for z in zs if z is not None))
        return out

    @staticmethod
    @once_differentiable("fused_mlp")
    def backward(ctx, grad):
        entry = ctx.entry
        L = entry.L
        saved = ctx.saved_tensors
        x, ws, zsaved = saved[0], saved[1:1 + L], saved[1 + L:]
        zs = list(zsaved) + [None] * (L - len(zsaved))  # only the last layer's can be absent
        B = x.numel() // entry.w0
        g = grad.reshape(B, grad.shape[-1])
        if g.dtype != x.dtype:
            g = g.to(x.dtype)
        needs = ctx.needs_input_grad
        need_b = [False] * L
        k = 1 + L
        for i, on in enumerate(entry.has_bias):
            if on:
                k += 1
                need_b[i] = needs[k]
        needs = (needs[1], *needs[2:2 + L], *need_b)  # x, each weight, each layer's bias
        x2 = x.reshape(B, entry.w0)
        if B == 0:
            gx = x.new_zeros(x.shape) if needs[0] else None
            gws = [torch.zeros_like(w) if n else None for w, n in zip(ws, needs[1:1 + L])]
            gbs = [w.new_zeros(w.shape[0]) if n else None for w, n in zip(ws, need_b)]
        else:
            gx, gws, gbs = gradients(entry.fused(x, ws, B, needs), g, x2, ws, entry.has_bias, zs, entry.acts, needs)
            if gx is not None:
                gx = gx.reshape(x.shape)
        return (None, gx, *gws, *(gbs[i] for i, on in enumerate(entry.has_bias) if on))


def _contig(t):
    return t if t.is_contiguous() else t.contiguous()
