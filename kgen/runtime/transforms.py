"""The ops under torch.func transforms (vmap, grad, jvp, jacrev, ...) and forward-mode AD:
what `kgen.runtime.op.define` puts in front of the kernels.

- `install(op, name, transformed)`: the registered op's Autograd kernel, which sends a call
  under a transform (or with forward-mode tangents) to the family's composition, and its
  vmap rule (one call a sample, stacked).
- `vmap_batched(t)`: whether a tensor is batched by a vmap (a composition that reads values
  on the host asks); `dispatch_modes()`: whether the eager fast paths must step aside.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.autograd.forward_ad as _forward_ad

# Whether a torch.func transform (vmap, grad, jvp, jacrev, ...) is active: its tensors are
# wrappers without storage that no kernel can take (one C call, ~30 ns).
_functorch_active = torch._C._are_functorch_transforms_active
# Whether a tensor is such a wrapper.
functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def vmap_batched(t: torch.Tensor, _wrapped=functorch_wrapped, _batched=torch._C._functorch.is_batchedtensor,
                 _inner=torch._C._functorch.get_unwrapped) -> bool:
    """Whether `t` is batched by a torch.func.vmap at any level (its values then differ per
    sample and cannot be read on the host; a composition that reads values asks). A tensor
    grad or jvp merely wrapped, as they wrap every argument of a registered op at its
    Autograd key, is not."""
    while _wrapped(t):
        if _batched(t):
            return True
        t = _inner(t)
    return False


def dispatch_modes(_stack=torch._C._len_torch_dispatch_stack, _fwad=_forward_ad, _func=_functorch_active) -> bool:
    """Whether the ops' eager fast paths must step aside: a TorchDispatchMode is active (so
    that the mode sees the op as a torch.library call: FlopCounterMode, a tracer, as it would
    PyTorch's own), a forward-mode AD level is (torch.autograd.forward_ad.dual_level), or a
    torch.func transform is (those two go to the op's composition: `define`). ~80 ns, ~50
    more than the first C call alone."""
    return _stack() > 0 or _fwad._current_level >= 0 or _func()


# Whether torch.autocast is on for any device (one C call; the public form asks per device).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))


def _needs_grad(args) -> bool:
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
        if isinstance(a, (list, tuple)) and _needs_grad(a):
            return True
    return False


def _has_tangents(args) -> bool:
    """Whether an argument (in lists too) carries a forward-mode tangent."""
    for a in args:
        if isinstance(a, (list, tuple)):
            if _has_tangents(a):
                return True
        elif isinstance(a, torch.Tensor) and _forward_ad.unpack_dual(a).tangent is not None:
            return True
    return False


def _refuse_tangents(name: str, args) -> None:
    """NotImplementedError where an argument carries a forward-mode tangent: the kernels (and
    torch.library, which runs them) would return outputs without one, a silently wrong
    directional derivative."""
    if _has_tangents(args):
        raise NotImplementedError(
            f"kgen::{name} has no forward-mode derivative (torch.autograd.forward_ad / torch.func.jvp): "
            "its outputs would carry no tangent; use reverse mode (backward), or the PyTorch expression")


def install(op, name: str, transformed: Callable) -> None:
    """The registered op's Autograd kernel: torch.library's, behind a check that sends a call
    under a torch.func transform, or with forward-mode tangents, to `transformed` (the
    composition). Without it, torch.ops.kgen.<name> under jvp gave zero tangents silently
    (torch.library's kernel calls the op below autograd when nothing requires grad, and no
    kernel below it can see the transform, whose level is popped while it runs the op), and
    under grad raised autograd.Function's setup_context error. Here, at the Autograd key, the
    transform's level is still current and its tensors are plain dual / grad-tracking ones,
    so the composition's PyTorch ops carry the tangents and the graph as PyTorch's own do.
    (torch.library has no public hook for this: its kernel is rebuilt by the function that
    built it and registered again over it.)"""
    try:
        from torch._library.autograd import make_autograd_impl

        library_kernel = make_autograd_impl(op._opoverload, op)
        lib, op_name = op._lib, op._name
    except (ImportError, AttributeError, TypeError):  # another torch's internals: keep its kernel
        return
    level = torch._C._functorch.maybe_current_level
    schema = op._opoverload._schema
    schema_args, mutable = schema.arguments, schema.is_mutable

    def autograd_kernel(keyset, *args, **kwargs):
        if level() is not None or (_forward_ad._current_level >= 0 and _has_tangents((*args, *kwargs.values()))):
            # in schema order: keyword-only ones, and trailing ones equal to their defaults (the
            # dispatcher drops those) put back
            args = (*args, *(kwargs[a.name] if a.name in kwargs else a.default_value for a in schema_args[len(args):]))
            if _any_autocast():
                with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
                    return transformed(args)
            return transformed(args)
        if mutable and _needs_grad(args):  # (torch.library's kernel left the graph as it was: a wrong gradient)
            raise RuntimeError(f"kgen::{name} writes its input in place and is not differentiable; use the "
                               "out-of-place form where a gradient is needed")
        return library_kernel(keyset, *args, **kwargs)

    with warnings.catch_warnings():  # "Overriding a previously registered kernel": this one is meant to
        warnings.simplefilter("ignore")
        try:
            lib.impl(op_name, autograd_kernel, "Autograd", with_keyset=True, allow_override=True)
        except (TypeError, RuntimeError):  # a torch without allow_override: its kernel stays
            return

    def batched(info, in_dims, *args):
        # vmap reaches the op before autograd: one call a sample, stacked, as PyTorch's fallback
        # does, which takes no Tensor[] argument (fused_mlp's weights)
        def each(a, dims, f):  # f(tensor, its batch dim or None) over an argument, lists too
            if isinstance(a, (list, tuple)):
                return [each(t, d, f) for t, d in zip(a, dims or [None] * len(a))]
            return f(a, dims) if isinstance(a, torch.Tensor) else a

        def tensors(a):
            if isinstance(a, (list, tuple)):
                for t in a:
                    yield from tensors(t)
            elif isinstance(a, torch.Tensor):
                yield a

        def stacked(outs):  # the samples' outputs (a tensor, or a tuple / list of them) along dim 0
            if isinstance(outs[0], (list, tuple)):
                return type(outs[0])(stacked(list(o)) for o in zip(*outs))
            return torch.stack(outs)

        if info.batch_size == 0:  # nothing to call: the outputs' shapes from the fake impl, on "meta"
            meta = [each(a, d, lambda t, b: torch.empty(t.shape[:b] + t.shape[b + 1:] if b is not None else t.shape,
                                                         dtype=t.dtype, device="meta")) for a, d in zip(args, in_dims)]
            device = next(tensors(args)).device

            def empty(o):
                if isinstance(o, (list, tuple)):
                    return type(o)(empty(t) for t in o)
                return torch.empty((0, *o.shape), dtype=o.dtype, device=device)

            return empty(op(*meta)), 0
        return stacked([op(*[each(a, d, lambda t, b: t if b is None else t.select(b, i)) for a, d in zip(args, in_dims)])
                        for i in range(info.batch_size)]), 0

    written = [i for i, a in enumerate(schema_args) if a.alias_info is not None and a.alias_info.is_write]

    def batched_in_place(info, in_dims, *args):
        # an op writing its inputs (returning nothing): one call a sample on views of the batched
        # tensors, so that each writes its own sample; as PyTorch's in-place ops, the written
        # tensor must be batched wherever any input is
        for i in written:
            if in_dims[i] is None:
                raise RuntimeError(f"vmap: kgen::{name} writes {schema_args[i].name} in place, which is not batched "
                                   "while other inputs are; each sample would write the same tensor (PyTorch's "
                                   "in-place ops refuse this too): pass a batched tensor, e.g. expand and clone it")
        for i in range(info.batch_size):
            op(*[t.select(d, i) if isinstance(t, torch.Tensor) and d is not None else t for t, d in zip(args, in_dims)])
        return None, None

    op.register_vmap(batched_in_place if mutable else batched)
