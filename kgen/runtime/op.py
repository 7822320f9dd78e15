"""What every family's op needs, written once: the kernel a call runs, the op itself, and
the golden-numerics comparison.

- `Kernels(family, bucket)`: per (device, dtype, shape bucket), the variant dispatch chooses
  (tuning table, KGEN_AUTOTUNE, spec order; KGEN_LOG=dispatch says which and why), built
  and loaded on the first call and cached for the process; None means the family's PyTorch
  reference (CPU tensors, nothing could be built, or the reference won the tuning).
- `define(name, impl, fake=..., backward=..., setup_context=...)`: registers `kgen::<name>`
  with torch.library (schema from `impl`'s annotations, the fake impl, autograd) and returns
  the function to call. In eager mode it calls `impl` directly — through an
  `autograd.Function` when a gradient is needed — because a torch.library op's first call
  imports torch._dynamo (seconds) and every call pays the dispatcher (~15 us); under
  torch.compile, or on tensor subclasses (fake, functional), it calls the registered op;
  under torch.func transforms (vmap, grad, jvp, ...) and forward-mode AD, the family's
  `composition` (its PyTorch reference, `with_reference`), which they trace through
  (kgen.runtime.transforms: the registered op's kernel for that, and its vmap rule).
- `Override()`: a per-thread "run this instead of dispatch's choice" (`with
  OVERRIDE.using(impl):`), for tests and benchmarks that pin one variant or the reference.
- `sm_count(device, off_gpu)`: the device's SM count (cached), for launch plans.
- `once_differentiable(name)`: the decorator every op's backward carries (second
  derivatives raise an error naming the op).
- `autocast(*tensors)`: under torch.autocast, the floating-point tensors in the autocast
  dtype, as F.linear's inputs are (for ops with linear layers: bf16 activations with an
  fp32 master weight work, its gradient arrives in float32 through the cast).
- `error_ratio(out, ref, tol)`: the worst |out - ref| / (atol + rtol |ref|), inf for NaN.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Callable

import torch
import torch.autograd.forward_ad as _forward_ad

from kgen.errors import KgenError
from kgen.runtime import transforms
# (families import _any_autocast, dispatch_modes and vmap_batched from here)
from kgen.runtime.transforms import (_any_autocast, _functorch_active, _has_tangents, _needs_grad,  # noqa: F401
                                     _refuse_tangents, dispatch_modes, vmap_batched)

_PLAIN = (torch.Tensor, torch.nn.Parameter)


MISSING = object()

# Eager fast paths allocate their outputs as torch.empty_like(prototype), the prototype kept
# per call signature: no size / dtype / device arguments to parse (about half of
# torch.empty's host time; logmatmul, H100). Up to PROTO_ELEMENTS it is a real tensor,
# larger a broadcast scalar (4 bytes held), whose empty_like is a fresh contiguous tensor.
PROTO_ELEMENTS = 4096


def prototype(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor whose `torch.empty_like` is a new contiguous `shape` tensor (see above)."""
    if math.prod(shape) <= PROTO_ELEMENTS:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty((1,) * len(shape), dtype=dtype, device=device).expand(shape)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device: launch plans ask on
    every call); `off_gpu` for any other device (the Triton interpreter), which a family
    picks small so that its tests see several splits there too."""
    if device.type != "cuda":
        return off_gpu
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


def autocast(*tensors):
    """`tensors` (None passes through) unchanged, or, where torch.autocast is on for their
    device, each floating-point one cast to the autocast dtype — what F.linear does with its
    input, weight and bias. Call it first in an op whose math is a linear layer."""
    if not _any_autocast():  # the common case: one C call on the op's hot path
        return tensors
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    # (float64 stays float64, as autocast leaves it: the op then says whether it takes it)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_FROM and t.dtype != dtype else t
                 for t in tensors)


# The dtypes torch.autocast casts (its "eligible" floating-point types; never float64).
_AUTOCAST_FROM = (torch.float32, torch.float16, torch.bfloat16)


class Override:
    """What a family's op runs instead of dispatch's choice, per thread: inside `with
    override.using(impl):` `override.get()` is `impl` (whatever the family runs: a loaded
    variant's module, its own wrapper, or None for the reference), outside it MISSING.
    Nested uses restore the outer one. For tests and benchmarks that pin an implementation.
    `open` lists the implementations of the blocks open in any thread: an op's eager fast
    path (which skips the per-thread lookup) steps aside while it is non-empty."""

    __slots__ = ("_local", "open")

    def __init__(self):
        self._local = threading.local()
        self.open: list = []

    def get(self):
        return getattr(self._local, "impl", MISSING)

    @contextlib.contextmanager
    def using(self, impl):
        saved = self.get()
        self._local.impl = impl
        self.open.append(impl)  # list append / pop: atomic, whatever thread opens a block
        try:
            yield
        finally:
            self.open.pop()
            # (restored by assignment, MISSING included: Dynamo cannot trace a `del` of a
            # threading.local attribute, and torch.compile of a torch.func transform traces
            # the families' compositions through here)
            self._local.impl = saved


_ENV_SEEN: list = [None]  # the (KGEN_BACKEND, KGEN_AUTOTUNE) values check_dispatch_env last accepted


def check_dispatch_env() -> None:
    """KgenError where KGEN_BACKEND or KGEN_AUTOTUNE holds a value dispatch refuses, or
    KGEN_VARIANT names no variant of any family. The families' off-GPU paths (CPU tensors: no
    variant chosen) call it, so a typo fails on every device, not only once a CUDA tensor
    reaches dispatch. Read each call (three environment lookups), checked again only when the
    values change (a KGEN_VARIANT reads every family's specs, once)."""
    import os

    raw = (os.environ.get("KGEN_BACKEND"), os.environ.get("KGEN_AUTOTUNE"), os.environ.get("KGEN_VARIANT"))
    if raw != _ENV_SEEN[0]:
        from kgen.runtime import dispatch, tune

        dispatch.forced_backend()
        tune.autotune_enabled()
        if raw[2]:
            unknown = [p for p in dispatch.env_problems() if p.startswith("KGEN_VARIANT")]
            if unknown:
                raise KgenError(unknown[0])
        _ENV_SEEN[0] = raw


class Kernels:
    """The loaded variant per (device, dtype, bucket) for one family. `bucket(**shape)` is
    the family's tune_bucket. `get` is the simple form; a family whose calls are short can
    key the cache by something cheaper than the bucket string (the same classes as plain
    integers) and use `lookup(key)` on every call and `choose(key, ...)` on a miss."""

    def __init__(self, family: str, bucket: Callable[..., str]):
        self.family, self.bucket = family, bucket
        self._cache: dict = {}
        self.lookup = lambda key: self._cache.get(key, MISSING)  # the hot path: one dict lookup

    def choose(self, key, device: torch.device, dtype: torch.dtype, shape: dict):
        """Dispatch's choice for `shape`'s bucket (KGEN_LOG=dispatch says which and why),
        cached under `key`."""
        from kgen.runtime import dispatch  # builds and renders: imported at the first miss, as before

        name = str(dtype).removeprefix("torch.")
        kernel, _ = dispatch.choose_logged(self.family, device, name, self.bucket(**shape), shape)
        self._cache[key] = kernel
        return kernel

    def get(self, device: torch.device, dtype: torch.dtype, **shape):
        if device.type != "cuda":
            check_dispatch_env()
            return None
        key = (device.index, dtype, self.bucket(**shape))
        kernel = self._cache.get(key, MISSING)
        return kernel if kernel is not MISSING else self.choose(key, device, dtype, shape)

    def clear(self) -> None:
        self._cache.clear()


def _plain(args) -> bool:
    """True when every tensor argument is an ordinary tensor (not a fake or functional
    one that tracing passes in)."""
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN:
            return False
        if isinstance(a, (list, tuple)) and not _plain(a):
            return False
    return True


def stride_align(n: int) -> int:
    """The largest power of two up to 16 dividing n (16 for n = 0). A Triton kernel whose rows are
    n elements apart takes it as a constexpr A and writes `n = n // A * A` (the same value):
    Triton specialises an integer argument only on n % 16 == 0, so at any other n the
    compiler cannot prove a row starts on a vector boundary nor that a mask on n is constant
    over a vector, and loads one element at a time (int8_gemm at K = 3000: 21x slower,
    BENCHMARKS.md thirty-sixth session)."""
    return min(16, n & -n) if n else 16


def with_reference(impl: Callable, override: "Override") -> Callable:
    """`impl` run with `override` set to None, the family's PyTorch reference: the op's
    composition for `define` where a family's implementation takes that path with no kernel."""
    def composition(*args):
        with override.using(None):
            return impl(*args)

    return composition


def _has_tensor_lists(op) -> bool:
    from torch._library.utils import is_tensorlist_like_type

    schema = op._opoverload._schema
    return any(is_tensorlist_like_type(a.type) for a in (*schema.arguments, *schema.returns))


# op name -> the module whose `define` registered it (one op per name: see define)
_DEFINED: dict[str, str] = {}


def define(name: str, impl: Callable, *, fake: Callable, backward: Callable | None = None,
           setup_context: Callable | None = None, mutates_args=(), composition: Callable | None = None
           ) -> Callable:
    """Register `kgen::<name>` and return the function a family exposes (see the module
    doc). `backward(ctx, *grads)` and `setup_context(ctx, inputs, output)` follow
    `torch.library.register_autograd`; the eager path runs the same two.

    `composition`: the op's math in PyTorch operations, with impl's arguments and outputs
    and its checks (the family's reference, e.g. `with_reference(impl, override)`). Under a
    torch.func transform (vmap, grad, vjp, jvp, jacrev, hessian, ...), whose tensors are
    wrappers no kernel can read, and for inputs carrying a forward-mode tangent
    (torch.autograd.forward_ad), the function calls it instead of impl: the transform traces
    through it as through PyTorch's own ops, to any order. An op without one raises
    NotImplementedError there, naming itself."""
    owner = _DEFINED.setdefault(name, impl.__module__)
    if owner != impl.__module__:  # (torch.library would let the second replace the first, silently)
        raise KgenError(f"kgen::{name} is defined by {owner} already; {impl.__module__} must name its op "
                        "otherwise")
    schema = torch.library.infer_schema(impl, mutates_args=mutates_args)
    op = torch.library.custom_op(f"kgen::{name}", _without_autocast(impl, name), mutates_args=mutates_args,
                                 schema=schema)
    op.register_fake(fake)
    eager_grad = None
    if backward is not None:
        backward = once_differentiable(name)(backward)
        op.register_autograd(backward, setup_context=setup_context)

        class _Eager(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                out = impl(*args)
                setup_context(ctx, args, out)
                return out

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx, *grads)

        _Eager.__name__ = _Eager.__qualname__ = f"{name}_eager"
        if _has_tensor_lists(op):  # Tensor[] / Tensor?[] arguments: autograd through each element
            from torch._library.autograd import supports_tensorlist

            _Eager = supports_tensorlist(_Eager)
        eager_grad = _Eager.apply

    # Where a gradient is needed: the autograd.Function; with no backward, the registered op,
    # whose output's backward raises PyTorch's "no autograd formula" error as a call of
    # torch.ops.kgen.<name> does; in place, nothing (the family's function refuses a gradient
    # before: no per-call check on its host path).
    grad_path = eager_grad if eager_grad is not None else None if mutates_args else op

    def eager(args):
        if grad_path is not None and _needs_grad(args):
            return grad_path(*args)
        return impl(*args)

    def transformed(args):
        if composition is None:
            raise NotImplementedError(
                f"kgen::{name} does not run under torch.func transforms (vmap, grad, jvp, jacrev, ...) nor on "
                "inputs with forward-mode tangents: its kernels take plain tensors and it has no PyTorch "
                "composition to trace through; call it outside the transform (a loop over the batch for vmap)")
        return composition(*args)

    transforms.install(op, name, transformed)

    def call(*args):
        # (a transform first: torch.compile of a torch.func transform traces the composition
        # too, where the registered op, which has no rule for it, gave zero tangents)
        if _functorch_active() or (_forward_ad._current_level >= 0 and _has_tangents(args)):
            run = transformed
        elif torch.compiler.is_compiling() or not _plain(args):
            return op(*args)
        else:
            run = eager
        if _any_autocast():  # the op's own math (kernels, references) is not autocast's to change
            with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
                return run(args)
        return run(args)

    call.op = op
    call.__name__ = call.__qualname__ = name
    call.__doc__ = impl.__doc__
    return call


def _without_autocast(impl: Callable, name: str) -> Callable:
    """`impl` as the registered op runs it: with torch.autocast off inside, so that a call of
    torch.ops.kgen.<name> under autocast computes as the Python function's does (which turns
    it off around the op: `define`), not with autocast's casts inside its reference math;
    and refusing forward-mode tangents where they still reach it: only on a torch whose
    internals `kgen.runtime.transforms.install` could not use (there torch.library's own Autograd kernel
    stays, which would drop them silently). (`define` reads the schema from `impl` itself.)"""
    @functools.wraps(impl)
    def run(*args, **kwargs):
        if _forward_ad._current_level >= 0:  # (the fallback above: normally the composition ran instead)
            _refuse_tangents(name, args)
        if _any_autocast():
            with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
                return impl(*args, **kwargs)
        return impl(*args, **kwargs)

    return run


def once_differentiable(name: str) -> Callable[[Callable], Callable]:
    """Decorates an op's backward(ctx, *grads) (kgen::`name`'s) as once differentiable, as
    `define` does for every op's autograd and the fast paths' autograd.Functions do for
    theirs. Normally backward runs without grad mode and this costs one C call. Where a
    second derivative is asked for (create_graph=True), backward runs without grad mode
    all the same, and each floating-point gradient it returns (in lists too) is an alias
    whose own backward raises an error naming the op: differentiating a gradient again fails
    loudly, rather than silently missing every term that goes through the kernels (their
    outputs carry no graph, so a gradient made partly by torch GEMMs on kernel outputs would
    have some terms and not others, and one made only by kernels none). Unlike
    torch.autograd.function.once_differentiable, whatever the upstream gradients: a
    gradient penalty on x.grad, whose upstream gradient is a constant, raises too. Under
    tracing (fake or functional tensors) backward runs as it is."""
    message = (f"kgen::{name} has no second derivative: trying to differentiate twice a function that was "
               "marked with @once_differentiable").encode()

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def run(ctx, *grads):
            if not _grad_enabled() or not _plain(grads):
                return backward(ctx, *grads)
            with torch.no_grad():
                out = backward(ctx, *grads)
            return _mark_twice(ctx, out, message)

        return run

    return decorate


def _mark_twice(ctx, out, message: bytes):
    flat = [t for item in (out if isinstance(out, tuple) else (out,))
            for t in (item if isinstance(item, (list, tuple)) else (item,))
            if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not flat:
        return out
    # (the saved inputs that need a gradient go through the error node too, so that
    # torch.autograd.grad(f(x.grad), weight) meets it rather than finding weight unused)
    aliases = [t.detach().requires_grad_() for t in flat] + [
        t for t in ctx.saved_tensors if t is not None and t.requires_grad]
    marked = torch._C._functions.DelayedError(message, len(aliases))(*aliases)
    swap = dict(zip(map(id, flat), marked if isinstance(marked, tuple) else (marked,)))

    def sub(item):
        if isinstance(item, (list, tuple)):
            return type(item)(swap.get(id(t), t) for t in item)
        return swap.get(id(item), item)

    return tuple(sub(item) for item in out) if isinstance(out, tuple) else sub(out)


_grad_enabled = torch.is_grad_enabled


def error_ratio(out: torch.Tensor, ref: torch.Tensor, tol) -> float:
    """max |out - ref| / (atol + rtol |ref|) in float64; inf if out holds a NaN that ref does
    not (an element the kernel never wrote, when out was poisoned with NaN)."""
    out, ref = out.double(), ref.double()
    bad = torch.isnan(out) & ~torch.isnan(ref)
    if bool(bad.any()):
        return math.inf
    both = torch.isnan(out) & torch.isnan(ref)
    err = ((out - ref).abs() / (tol.atol + tol.rtol * ref.abs())).masked_fill(both, 0.0)
    return float(err.max()) if err.numel() else 0.0


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN (integers: the type's minimum), so that an element a
    kernel fails to write shows up in the comparison."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)
