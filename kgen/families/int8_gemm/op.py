"""int8_gemm as ops: which implementation runs (dispatch, with the family's shape
preference where nothing is tuned), the tuning hooks, the three torch.library ops, the
public functions, and the golden numerics `kgen verify` runs."""

from __future__ import annotations

import math
from typing import Optional

import torch

from kgen.families.int8_gemm import checks, launch, plans, reference
from kgen.families.int8_gemm.launch import Impl, gemm
from kgen.families.int8_gemm.plans import MODE_LINEAR, MODE_MM, MODE_W8A16
from kgen.runtime.op import (MISSING, Override, _any_autocast, autocast, check_dispatch_env, define, dispatch_modes,
                             with_reference)

FAMILY = "int8_gemm"
_FORCED = Override()
_IMPLS: dict = {}  # per tuned bucket (dispatch.holds_for_bucket); _memo
_BY_SHAPE: dict = {}  # per exact shape, in front of _IMPLS
# The eager fast path (host cost of small calls, where a decode step's GEMV takes ~10 us of
# GPU): per exact call signature (op, shapes, dtypes, device, bias, group size) that went
# to a kernel, its bound launcher (launch.direct: the CUDA kernel's, or the Triton module's
# replayed launches; None: the general path runs). Bounded: a process calling with ever-new
# shapes stops adding.
_FAST: dict = {}
_FAST_MAX = 4096
_USING = _FORCED.open  # `using` blocks open in any thread: the fast path steps aside

# --------------------------------------------------------------------------- kernel choice


def implementation(kernel, companion=None) -> Impl | None:
    """What the op runs for a loaded variant (None: the reference). A CUDA variant gets a
    Triton companion for inputs it cannot take (default: the one spec order picks)."""
    if kernel is None:
        return None
    if kernel.backend == "triton":
        return Impl(kernel.module)
    if companion is None:
        from kgen.runtime import dispatch

        companion = dispatch.triton_companion(FAMILY, kernel, "take the inputs")
    return Impl(companion.module, kernel)


# Run the ops with this implementation (`implementation(kernel)`, or None: the PyTorch
# reference) instead of dispatch's choice, in this thread. For tests and benchmarks.
using = _FORCED.using


def _remember(key, impl, mode, M, N, K, out_dtype, group_size, scale_b, bias, device) -> None:
    """Keep the signature's bound launcher for the fast path (outside `using` blocks and CUDA
    graph capture, where its output prototype would come from the graph's private pool)."""
    if (key not in _FAST and len(_FAST) < _FAST_MAX and _FORCED.get() is MISSING
            and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        _FAST[key] = launch.direct(impl, mode, M, N, K, out_dtype, group_size,
                                   scale_b.dtype if scale_b is not None else None,
                                   bias.dtype if bias is not None else None, device)


def _impl(device: torch.device, dtype: torch.dtype, M: int, N: int, K: int, grouped: bool):
    forced = _FORCED.get()
    if forced is not MISSING:
        return forced
    if device.type != "cuda":
        check_dispatch_env()  # (a typo in KGEN_BACKEND / KGEN_AUTOTUNE fails here too)
        return None
    return _memo(device, dtype, M, N, K, grouped, False)


def _fused_impl(device: torch.device, M: int, N: int, K: int):
    """int8_linear's implementation: int8_mm's, except where the tuned winner of the bucket
    is the reference (torch._int_mm): its W8A8 epilogue would then run as separate PyTorch
    passes over the int32 product (H100, M = 64, N x K = 12288 x 4096: 158 us against the
    GEMM's 37), so the bucket's fastest kgen candidate runs instead, its epilogue fused."""
    impl = _impl(device, torch.int8, M, N, K, False)
    if impl is not None or device.type != "cuda" or _FORCED.get() is not MISSING:
        return impl
    return _memo(device, torch.int8, M, N, K, False, True)


def _memo(device, dtype, M, N, K, grouped, fused):
    """_choose's implementation, memoised per exact shape (_BY_SHAPE) and, where it is the
    tuned bucket's (dispatch.holds_for_bucket), per bucket (_IMPLS): the untuned preference
    reads the exact M (a tile's row waste, its grid's waves: plans.preference), so memoised
    per bucket the first M a process saw there would decide for every other."""
    exact = (device.index, dtype, M, N, K, grouped, fused)
    impl = _BY_SHAPE.get(exact, MISSING)
    if impl is not MISSING:
        return impl
    key = (device.index, dtype, (M - 1).bit_length(), N, K, grouped, fused)  # tune_bucket's classes
    impl = _IMPLS.get(key, MISSING)
    if impl is MISSING:
        from kgen.runtime.dispatch import holds_for_bucket

        impl, why = _choose(device, dtype, M, N, K, grouped, fused)
        if holds_for_bucket(why):
            _IMPLS[key] = impl
    if len(_BY_SHAPE) > 4096:  # ever-new shapes: keep the memo small
        _BY_SHAPE.clear()
    _BY_SHAPE[exact] = impl
    return impl


def _choose(device, dtype, M, N, K, grouped, fused=False):
    """(what the op runs, dispatch's why): dispatch's choice for the bucket; where it fell
    to spec order (nothing tuned), the family's shape preference (plans.preference) among
    the same candidates instead, or for W8A16 at large M and K the reference
    (plans.w8a16_prefers_reference). `fused`: never the reference; a tuned bucket's
    fastest other candidate."""
    from kgen.errors import KgenError
    from kgen.runtime import dispatch, tuning_rules, tuning_table

    name = str(dtype).removeprefix("torch.")
    shape = {"M": M, "N": N, "K": K, "group_size": 128 if grouped else 0}
    bucket = tune_bucket(**shape)
    kernel, why = dispatch.choose(FAMILY, device, name, bucket, shape)
    cap = torch.cuda.get_device_capability(device)
    sms = plans.sm_count(device)
    prefer = lambda v: plans.preference(v, M, N, sms, K)  # noqa: E731
    triton = sorted(dispatch.candidates(FAMILY, name, cap, backend="triton"), key=prefer)
    if fused and kernel is None:
        entry = tuning_table.lookup(tuning_table.key(FAMILY, tuning_table.device_key(device.index), name, bucket)) or {}
        runnable = {v.name: v for v in dispatch.runnable(FAMILY, name, device)}
        for winner in (n for n in (tuning_rules.ranking(entry) if entry.get("times_us") else ()) if n in runnable):
            kernel = _try_load(runnable[winner])
            if kernel is not None:
                why = "tuned, fastest but the reference (fused epilogue)"
                break
        else:
            why = "spec order"
    if why == "spec order" and dtype != torch.int8 and plans.w8a16_prefers_reference(M, N, K):
        kernel, why = None, "spec order, by shape: the reference"
    elif why == "spec order":
        kernel, why = None, "fallback"
        for v in sorted(dispatch.candidates(FAMILY, name, cap), key=prefer):
            try:
                kernel, why = dispatch.load(v), "spec order, by shape"
                break
            except KgenError as e:
                dispatch.log.warning("kgen: %s unavailable, trying the next variant: %s", v.qualname,
                                     str(e).splitlines()[0])
    dispatch.log_choice(FAMILY, device, name, bucket, kernel, why)
    if kernel is None or kernel.backend == "triton":
        return implementation(kernel), why
    companion = next((k for k in map(_try_load, triton) if k is not None), None)
    return (implementation(kernel, companion) if companion is not None else None), why


def _try_load(v):
    from kgen.errors import KgenError
    from kgen.runtime import dispatch

    try:
        return dispatch.load(v)
    except KgenError:
        return None


# --------------------------------------------------------------------------- tuning

# Buckets: M rounded up to a power of two, N and K exact (a model has a handful of weight
# shapes, and the best tile and split differ between them), grouped W8A16 scales apart.
TUNE_DIMS = ("M", "N", "K")
# Rows beyond the tuned ones (M > 4096) take the nearest tuned bucket's winner however many
# they are (tuning_table.nearest).
TUNE_FREE_DIMS = ("M",)
TUNE_SHAPES = tuple({"M": m, "N": n, "K": k}
                    for n, k in ((4096, 11008), (12288, 4096), (22016, 4096), (4096, 4096), (65536, 4096))
                    for m in (1, 16, 64, 256, 1024, 4096))


def tune_bucket(M: int, N: int, K: int, group_size: int = 0) -> str:
    return f"M<={1 << (M - 1).bit_length()}.N={N}.K={K}" + (".grouped" if group_size else "")


def tune_inputs(device, dtype: str, M: int, N: int, K: int, group_size: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=device, generator=g)
    if dtype == "int8":
        a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=device, generator=g)
        return {"a": a, "b": b, "out": torch.empty(M, N, dtype=torch.int32, device=device)}
    t = getattr(torch, dtype)
    x = torch.randn(M, K, device=device, generator=g).to(t)
    s = torch.rand(N, K // group_size if group_size else 1, device=device, generator=g) / 127
    return {"x": x, "b": b, "scale_b": s.squeeze(1) if not group_size else s, "group_size": group_size or None,
            "out": torch.empty(M, N, dtype=t, device=device)}


def tune_runner(kernel, inputs: dict):
    """int8: one int8_mm (the epilogue costs every variant alike); 16-bit: one w8a16_linear.
    None: the reference (torch._int_mm where it is allowed; the PyTorch W8A16 expression)."""
    if "a" in inputs:
        a, b, out = inputs["a"], inputs["b"], inputs["out"]
        if kernel is None:
            return lambda: reference.int8_mm(a, b)
        impl = implementation(kernel)
        return lambda: gemm(impl, MODE_MM, a, b, out)
    x, b, s, gs, out = inputs["x"], inputs["b"], inputs["scale_b"], inputs["group_size"], inputs["out"]
    if kernel is None:
        return lambda: reference.w8a16_pytorch(x, b, s, None, gs)
    impl = implementation(kernel)
    return lambda: gemm(impl, MODE_W8A16, x, b, out, scale_b=s, group_size=gs)


# --------------------------------------------------------------------------- torch.library


def _mm_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    checks.two_d("int8_mm", "a", a)
    M, N, K = checks.check_int8_mm(a, b)
    a, b = a.contiguous(), b.contiguous()
    impl = _impl(a.device, torch.int8, M, N, K, False) if M and N and K else None
    if impl is None:
        return reference.int8_mm(a, b)
    _remember((MODE_MM, a.shape, a.dtype, b.shape, b.dtype, a.device, b.device), impl, MODE_MM, M, N, K, torch.int32,
              None, None, None, a.device)
    return gemm(impl, MODE_MM, a, b, torch.empty(M, N, dtype=torch.int32, device=a.device))


def _mm_fake(a, b):
    checks.two_d("int8_mm", "a", a)
    M, N, _ = checks.check_int8_mm(a, b)
    return a.new_empty((M, N), dtype=torch.int32)


def _linear_impl(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    checks.two_d("int8_linear", "a", a)
    M, N, K = checks.check_int8_linear(a, b, scale_a, scale_b, bias, out_dtype)
    a, b = a.contiguous(), b.contiguous()
    scale_a, scale_b = scale_a.reshape(-1).contiguous(), scale_b.reshape(-1).contiguous()
    bias = bias.reshape(-1).contiguous() if bias is not None else None
    impl = _fused_impl(a.device, M, N, K) if M and N and K else None
    if impl is None:
        return reference.int8_linear(a, b, scale_a, scale_b, bias, out_dtype)
    _remember(_linear_key(a, b, scale_a, scale_b, bias, out_dtype), impl, MODE_LINEAR, M, N, K, out_dtype, None,
              scale_b, bias, a.device)
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    return gemm(impl, MODE_LINEAR, a, b, out, scale_a, scale_b, bias)


def _linear_setup(ctx, inputs, output):
    a, b, scale_a, scale_b, bias, out_dtype = inputs
    product = scale_a.requires_grad or scale_b.requires_grad  # (a and b: only for the scales' gradients)
    ctx.save_for_backward(a if product else None, b if product else None, scale_a, scale_b)
    ctx.has_bias = bias is not None
    ctx.bias_dtype, ctx.bias_shape = (bias.dtype, bias.shape) if bias is not None else (None, None)


def _linear_backward(ctx, grad):
    """d scale_a[m] = sum_n g[m, n] C[m, n] scale_b[n], d scale_b[n] = sum_m g[m, n] C[m, n]
    scale_a[m], d bias = column sums of g, with C = a @ b.T (int32, recomputed by int8_mm's
    impl, exact; in float32 for the products); float32 sums in each input's dtype and shape.
    a and b are int8: no gradient."""
    a, b, scale_a, scale_b = ctx.saved_tensors
    g = grad.float()
    gsa = gsb = gbias = None
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        gc = g * _mm_impl(a, b).float()
        if ctx.needs_input_grad[2]:
            gsa = (gc * scale_b.float().reshape(1, -1)).sum(1).to(scale_a.dtype).reshape(scale_a.shape)
        if ctx.needs_input_grad[3]:
            gsb = (gc * scale_a.float().reshape(-1, 1)).sum(0).to(scale_b.dtype).reshape(scale_b.shape)
    if ctx.has_bias and ctx.needs_input_grad[4]:
        gbias = g.sum(0).to(ctx.bias_dtype).reshape(ctx.bias_shape)
    return None, None, gsa, gsb, gbias, None


def _linear_fake(a, b, scale_a, scale_b, bias, out_dtype):
    checks.two_d("int8_linear", "a", a)
    M, N, _ = checks.check_int8_linear(a, b, scale_a, scale_b, bias, out_dtype)
    return a.new_empty((M, N), dtype=out_dtype)


def _w8a16_impl(x: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, bias: Optional[torch.Tensor],
                group_size: Optional[int]) -> torch.Tensor:
    checks.two_d("w8a16_linear", "x", x)
    M, N, K = checks.check_w8a16_linear(x, b, scale_b, bias, group_size)
    x, b = x.contiguous(), b.contiguous()
    scale_b = scale_b.contiguous() if group_size else scale_b.reshape(-1).contiguous()
    bias = bias.reshape(-1).contiguous() if bias is not None else None
    impl = _impl(x.device, x.dtype, M, N, K, group_size is not None) if M and N and K else None
    if impl is None:
        if x.is_cuda and M and N and K:
            return reference.w8a16_pytorch(x, b, scale_b, bias, group_size)
        return reference.w8a16_linear(x, b, scale_b, bias, group_size)
    _remember(_w8a16_key(x, b, scale_b, bias, group_size), impl, MODE_W8A16, M, N, K, x.dtype, group_size,
              scale_b, bias, x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    return gemm(impl, MODE_W8A16, x, b, out, scale_b=scale_b, bias=bias, group_size=group_size)


def _w8a16_fake(x, b, scale_b, bias, group_size):
    checks.two_d("w8a16_linear", "x", x)
    M, N, _ = checks.check_w8a16_linear(x, b, scale_b, bias, group_size)
    return x.new_empty((M, N))


def _w8a16_setup(ctx, inputs, output):
    x, b, scale_b, bias, group_size = inputs
    # x: scale_b's gradient needs it; saved too where x needs a gradient, so that a second
    # derivative reaches op.once_differentiable's error node (not a silent None)
    ctx.save_for_backward(b, scale_b, x if scale_b.requires_grad or x.requires_grad else None)
    ctx.group_size, ctx.x_dtype, ctx.has_bias = group_size, x.dtype, bias is not None
    ctx.bias_dtype, ctx.bias_shape = (bias.dtype, bias.shape) if bias is not None else (None, None)


def _w8a16_backward(ctx, grad):
    """d x = grad @ dequantized(b) (float32, rounded to x's dtype); d bias = column sums;
    d scale_b[n, g] = sum over group g's columns k of (grad.T @ x)[n, k] * b[n, k] (float32,
    in scale_b's dtype and shape; one group: per channel). The int8 weight takes no gradient."""
    b, scale_b, x = ctx.saved_tensors
    gx = gscale = gbias = None
    if ctx.needs_input_grad[0]:
        w = reference.dequantized(b, scale_b, ctx.group_size, torch.float32)
        gx = (grad.float() @ w).to(ctx.x_dtype)
    if ctx.needs_input_grad[2]:
        N, K = b.shape
        per = (grad.float().t() @ x.float()) * b.float()  # [N, K]: each weight's share of d scale
        gs = ctx.group_size or K
        gscale = (per.reshape(N, K // gs, gs).sum(-1) if K else torch.zeros(scale_b.shape, device=b.device)
                  ).to(scale_b.dtype).reshape(scale_b.shape)
    if ctx.has_bias and ctx.needs_input_grad[3]:
        gbias = grad.float().sum(0).to(ctx.bias_dtype).reshape(ctx.bias_shape)  # (a [1, N] bias: its shape)
    return gx, None, gscale, gbias, None


def _w8a16_composition(x, b, scale_b, bias, group_size):
    """w8a16_linear in PyTorch operations, differentiable (float32 products, as the CPU
    path): what torch.func transforms and forward-mode AD trace through (kgen.runtime.op.define)."""
    checks.two_d("w8a16_linear", "x", x)
    checks.check_w8a16_linear(x, b, scale_b, bias, group_size)
    return reference.w8a16_linear(x, b, scale_b, bias, group_size)


_mm_op = define("int8_mm", _mm_impl, fake=_mm_fake, composition=with_reference(_mm_impl, _FORCED))
_linear_op = define("int8_linear", _linear_impl, fake=_linear_fake, backward=_linear_backward,
                    setup_context=_linear_setup, composition=with_reference(_linear_impl, _FORCED))
_w8a16_op = define("w8a16_linear", _w8a16_impl, fake=_w8a16_fake, backward=_w8a16_backward,
                   setup_context=_w8a16_setup, composition=_w8a16_composition)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]) if t.dim() != 2 else t  # (not -1: K may be 0)


def _flat_shape(t: torch.Tensor, dims: int = 2) -> torch.Size:
    """The shape the impls see: a / x as [M, K] (`_flat`), a vector as [n] (dims=1)."""
    if t.dim() == dims:
        return t.shape
    if dims == 1:
        return torch.Size((t.numel(),))
    return torch.Size((t.numel() // t.shape[-1] if t.shape[-1] else 0, t.shape[-1]))


# Keys of the fast path: everything the checks and the launch plan read (shapes, dtypes,
# devices, bias and group size); a / x 2-D as the impls see it.
def _linear_key(a, b, scale_a, scale_b, bias, out_dtype):
    return (MODE_LINEAR, a.shape, a.dtype, b.shape, b.dtype, a.device, b.device, scale_a.shape, scale_b.shape,
            scale_a.dtype, scale_b.dtype, scale_a.device, scale_b.device,
            None if bias is None else (bias.shape, bias.dtype, bias.device), out_dtype)


def _w8a16_key(x, b, scale_b, bias, group_size):
    return (MODE_W8A16, x.shape, x.dtype, b.shape, b.dtype, x.device, b.device, scale_b.shape, scale_b.dtype,
            scale_b.device, None if bias is None else (bias.shape, bias.dtype, bias.device), group_size)


_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def _plain(*ts, bias=None) -> bool:
    """The fast path's precondition: eager, no `using` block nor TorchDispatchMode, plain tensors
    (bias: also None; anything else, None included, goes to the checks)."""
    return (not _compiling() and not _USING and not dispatch_modes() and all(type(t) is _Tensor for t in ts)
            and (bias is None or type(bias) is _Tensor))


def _fast_2d(key, a, *rest):
    """The fast path's output for a [..., K] seen as [M, K], or None (the general path)."""
    f = _FAST.get(key)
    if f is None:
        return None
    out = f(a, *rest)
    return out if out is None or a.dim() == 2 else out.view(*a.shape[:-1], out.shape[1])


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int32 a @ b.T: a int8 [..., K], b int8 [N, K] (nn.Linear's weight layout) ->
    int32 [..., N], equal to the int64 product (K <= 131071 so that it fits). Any M >= 1,
    unlike torch._int_mm (M > 16). Also torch.ops.kgen.int8_mm (2-D a)."""
    if _plain(a, b) and a.dim() >= 1:
        out = _fast_2d((MODE_MM, _flat_shape(a), a.dtype, b.shape, b.dtype, a.device, b.device), a, b, None, None, None)
        if out is not None:
            return out
    checks.check_int8_mm(a, b)
    return _mm_op(_flat(a), b).reshape(*a.shape[:-1], b.shape[0])


def int8_linear(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W8A8: (a @ b.T) * scale_a[:, None] * scale_b[None, :] + bias in float32, rounded once
    to out_dtype (bfloat16, float16 or float32), the dequantisation fused into the GEMM's
    epilogue. a int8 [..., K], b int8 [N, K], scale_a float32 (one per row of a), scale_b
    float32 [N], bias [N] (float32 or out_dtype). Differentiable for scale_a, scale_b and
    bias (a and b are integers). Also torch.ops.kgen.int8_linear (2-D a)."""
    if (_plain(a, b, scale_a, scale_b, bias=bias) and a.dim() >= 1
            and not ((scale_a.requires_grad or scale_b.requires_grad or (bias is not None and bias.requires_grad))
                     and _grad_enabled())):
        key = (MODE_LINEAR, _flat_shape(a), a.dtype, b.shape, b.dtype, a.device, b.device, _flat_shape(scale_a, 1),
               _flat_shape(scale_b, 1), scale_a.dtype, scale_b.dtype, scale_a.device, scale_b.device,
               None if bias is None else (_flat_shape(bias, 1), bias.dtype, bias.device), out_dtype)
        out = _fast_2d(key, a, b, scale_a, scale_b, bias)
        if out is not None:
            return out
    checks.check_int8_linear(a, b, scale_a, scale_b, bias, out_dtype)
    out = _linear_op(_flat(a), b, scale_a.reshape(-1), scale_b.reshape(-1), bias, out_dtype)
    return out.reshape(*a.shape[:-1], b.shape[0])


def w8a16_linear(x: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 group_size: Optional[int] = None) -> torch.Tensor:
    """Weight-only int8: x @ (b * scale_b).T + bias in x's dtype (bfloat16 or float16), b
    int8 [N, K] widened in registers (never materialised), float32 accumulation. scale_b:
    [N] per output channel, or [N, K / group_size] per group of K when group_size (a multiple
    of 16 dividing K) is given; float32 or 16-bit. Differentiable for x, scale_b and bias. Also
    torch.ops.kgen.w8a16_linear (2-D x). Under torch.autocast, x and bias are cast to its
    dtype, as F.linear's are."""
    if group_size is not None and type(group_size) is not int:
        group_size = checks.group_size_arg(group_size)
    if (_plain(x, b, scale_b, bias=bias) and x.dim() >= 1 and not _any_autocast()
            and not ((x.requires_grad or scale_b.requires_grad or (bias is not None and bias.requires_grad))
                     and _grad_enabled())):
        key = (MODE_W8A16, _flat_shape(x), x.dtype, b.shape, b.dtype, x.device, b.device,
               scale_b.shape if group_size else _flat_shape(scale_b, 1), scale_b.dtype, scale_b.device,
               None if bias is None else (_flat_shape(bias, 1), bias.dtype, bias.device), group_size)
        out = _fast_2d(key, x, b, None, scale_b, bias)
        if out is not None:
            return out
    x, bias = autocast(x, bias)
    checks.check_w8a16_linear(x, b, scale_b, bias, group_size)
    out = _w8a16_op(_flat(x), b, scale_b, bias, group_size)
    return out.reshape(*x.shape[:-1], b.shape[0])


OPS = {"int8_mm": int8_mm, "int8_linear": int8_linear, "w8a16_linear": w8a16_linear}
