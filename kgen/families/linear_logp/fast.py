"""linear_logp's eager fast path: per exact call signature that the general path served
once, the forward decided once (ForwardLaunch) and, where a gradient is needed, an
autograd.Function (`Step`) whose backward calls backward_launch.backward directly (its plan cached
there, backward_launch.backward_plan) — no torch.library wrapper, no argument checks, no kernel
choice, no reshapes, fewer buffers, and one or two autograd outputs instead of five.

Why: a small call is host-bound. The general path (op.linear_logp -> kgen.runtime.op's
eager call -> an autograd.Function of five outputs) checks the arguments twice, chooses the
kernel, allocates five buffers and decides the splits on every call, and its backward goes
through a second wrapper and the kernel choice again. op.linear_logp decides when this path
serves a call (op._fast: the signature's key, and when it steps aside); this module is what
runs then, the same launches as the general path, so the same bits.
"""

from __future__ import annotations

import torch

from kgen.families.linear_logp import backward_launch, kept, launch
from kgen.families.linear_logp.cuda_variant import CudaForward
from kgen.families.linear_logp.plans import _cdiv
from kgen.runtime.op import once_differentiable


# The fast path's CUDA forward keeps the partials in the allocation of lse2 and ez2 when a
# gradient is needed and they take at most this many bytes (they then live until the
# backward: small calls only); without a gradient always (all three are scratch).
SHARED_PARTIALS_BYTES = 64 << 10


class ForwardLaunch:
    """The forward of one call signature (op.py's fast path: shapes, dtype, device, bias or
    not, entropy or not, alignment), decided once; `run` per call launches what `forward`
    launches for such a call, into fewer buffers where the variant is a CudaForward that
    takes the inputs: logp, entropy if asked, and one float32 buffer [lse2 | ez2 |
    partials] (each part from a 16-byte boundary; the partials in a buffer of their own when
    a gradient is needed and they are larger than SHARED_PARTIALS_BYTES), with the launcher
    call's constant arguments bound (CudaForward.bind_forward). On the float32 few-rows
    path (launch.logits_path) kept.FewRows: the same buffers, its two Triton launches
    replayed. Otherwise `forward` itself."""

    __slots__ = ("mod", "N", "with_entropy", "go", "few", "ez_at", "part_at", "part_len", "shared")

    def __init__(self, mod, hidden, weight, bias, with_entropy: bool):
        N, D = hidden.shape
        V = weight.shape[0]
        self.mod, self.N, self.with_entropy = mod, N, with_entropy
        self.go = None
        cuda = isinstance(mod, CudaForward) and N > 0 and mod.takes(hidden, weight, bias)
        self.few = kept.FewRows(mod, hidden, weight, with_entropy) if (
            N > 0 and not cuda and launch.logits_path(hidden, weight)) else None
        if cuda:  # (float32's gemv kernel before the few-rows path, as launch.forward)
            splits = mod.splits(N, V, hidden.device)
            self.go = mod.bind_forward(N, V, D, splits, with_entropy, hidden.device)
            rows = _cdiv(N, 4) * 4  # floats of lse2 (or ez2) rounded to 16 bytes
            self.ez_at = rows if with_entropy else 0
            self.part_at = 2 * rows if with_entropy else rows
            self.part_len = 4 * splits * N
            self.shared = self.part_len * 4 <= SHARED_PARTIALS_BYTES

    def run(self, hidden, weight, target, bias, temperature: float, ignore_index: int, keep: bool, shape=None):
        """(logp, entropy or None, saved): `saved` the tensors the backward needs of this
        forward, which `rows(saved)` turns into (lse2, ez2); `keep`: whether they are kept
        (a gradient is needed); `shape`: logp's and entropy's (N elements; default [N])."""
        go = self.go
        if go is None:
            if self.few is not None and launch.logits_path(hidden, weight):  # (TF32 may have been switched since)
                logp, entropy, buf = self.few.run(hidden, weight, target, bias, temperature, ignore_index, shape)
                return logp, entropy, (buf,)
            logp, entropy, lse2, ez2 = launch.forward(self.mod, hidden, weight, target, bias, temperature, ignore_index,
                                               self.with_entropy, shape=shape)
            return logp, entropy if self.with_entropy else None, (lse2, ez2)
        dev, f32 = hidden.device, torch.float32
        out = (self.N,) if shape is None else shape
        logp = launch._empty(out, f32, dev)
        entropy = launch._empty(out, f32, dev) if self.with_entropy else None
        shared = self.shared or not keep
        buf = launch._empty((self.part_at + self.part_len if shared else self.part_at,), f32, dev)
        at = buf.data_ptr()
        if shared:
            part = at + 4 * self.part_at
        else:
            part_buf = launch._empty((self.part_len,), f32, dev)
            part = part_buf.data_ptr()
        if target.dtype != torch.int64:
            target = target.long()
        go(hidden.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else 0, target.data_ptr(), part,
           logp.data_ptr(), entropy.data_ptr() if entropy is not None else 0, at,
           at + 4 * self.ez_at if self.with_entropy else 0, ignore_index, launch.LOG2E / temperature)
        return logp, entropy, (buf,)

    def rows(self, saved) -> tuple:
        """(lse2 [N], ez2 [N] or anything without entropy) of a forward's `saved`."""
        if self.few is not None and len(saved) == 1:
            return self.few.rows(saved[0])
        if self.go is None:
            return saved
        buf, N = saved[0], self.N
        lse2 = buf[:N]
        return lse2, buf[self.ez_at:self.ez_at + N] if self.with_entropy else lse2



class Entry:
    """One call signature: the forward's implementation `mod` (dispatch's choice for
    `dims` = (N, D, V)), its ForwardLaunch, N and D, logp's shape (hidden's leading dims;
    None when hidden is 2-D and target 1-D), whether the entropy is returned, and
    `backward_module(device, dtype)`: the backward's implementation, chosen when the
    backward runs (op._module without a shape, as the general path's backward)."""

    __slots__ = ("mod", "dims", "launch", "N", "D", "shape", "with_entropy", "backward_module")

    def __init__(self, mod, hidden, weight, bias, with_entropy: bool, backward_module):
        V, D = weight.shape
        N = hidden.numel() // D
        flat = hidden.dim() == 2
        self.mod, self.dims = mod, (N, D, V)  # the forward's implementation, chosen for (N, D, V)
        self.N, self.D, self.with_entropy = N, D, with_entropy
        self.shape = None if flat else tuple(hidden.shape[:-1])
        h2 = hidden if flat else hidden.view(N, D)
        self.launch = ForwardLaunch(mod, h2, weight, bias, with_entropy)
        self.backward_module = backward_module

    def forward(self, hidden, weight, target, bias, temperature: float, ignore_index: int):
        """The call without a gradient: logp, or (logp, entropy)."""
        if self.shape is not None:
            hidden, target = hidden.view(self.N, self.D), target.view(self.N)
        logp, entropy, _ = self.launch.run(hidden, weight, target, bias, temperature, ignore_index, False, self.shape)
        return (logp, entropy) if self.with_entropy else logp


class Step(torch.autograd.Function):
    """apply(entry, hidden, weight, target, bias, temperature, ignore_index) -> logp, or
    (logp, entropy) with the entry's entropy. Saves hidden and target as 2-D / 1-D views,
    weight, bias and the forward's rows (ForwardLaunch.rows)."""

    @staticmethod
    def forward(ctx, entry, hidden, weight, target, bias, temperature, ignore_index):
        if entry.shape is not None:
            hidden, target = hidden.view(entry.N, entry.D), target.view(entry.N)
        logp, entropy, saved = entry.launch.run(hidden, weight, target, bias, temperature, ignore_index, True,
                                                entry.shape)
        ctx.save_for_backward(hidden, weight, target, bias, *saved)
        ctx.entry, ctx.temperature, ctx.ignore_index = entry, temperature, ignore_index
        # No zero tensors made for an output without a gradient: it arrives as None.
        ctx.set_materialize_grads(False)
        return (logp, entropy) if entry.with_entropy else logp

    @staticmethod
    @once_differentiable("linear_logp")
    def backward(ctx, grad_logp, grad_entropy=None):
        entry = ctx.entry
        hidden, weight, target, bias, *saved = ctx.saved_tensors
        lse2, ez2 = entry.launch.rows(saved)
        N, shape = entry.N, entry.shape
        if grad_logp is None:  # only the entropy has a gradient
            grad_logp = torch.zeros_like(lse2)
        elif shape is not None:
            grad_logp = grad_logp.reshape(N)
        if not grad_logp.is_contiguous():
            grad_logp = grad_logp.contiguous()
        if grad_entropy is not None:
            if shape is not None:
                grad_entropy = grad_entropy.reshape(N)
            if not grad_entropy.is_contiguous():
                grad_entropy = grad_entropy.contiguous()
        mod = entry.backward_module(hidden.device, hidden.dtype)
        few = entry.launch.few
        if mod is not None and few is not None and len(saved) == 1 and launch.logits_path(hidden, weight):
            gh, gw, gb = few.backward(mod, hidden, weight, target, bias, saved[0], grad_logp, grad_entropy,
                                      ctx.temperature, ctx.ignore_index)
        elif mod is None:  # the reference, as the general path's backward would run it
            from kgen.families.linear_logp.reference import reference_backward

            gh, gw, gb = reference_backward(hidden, weight, target, bias, grad_logp, grad_entropy,
                                            ctx.temperature, ctx.ignore_index)
        else:
            gh, gw, gb = backward_launch.backward(mod, hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy,
                                         ctx.temperature, ctx.ignore_index)
        if shape is not None:
            gh = gh.view(*shape, entry.D)
        return None, gh, gw, None, gb if bias is not None else None, None, None
