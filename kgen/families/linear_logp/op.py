"""linear_logp as an op: which implementation runs (dispatch, `using`), the tuning hooks,
the ops (kgen.runtime.op.define: torch.library registration with fake and autograd, and
the eager path), the public `linear_logp`, and the golden numerics `kgen verify` runs."""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from kgen.families.linear_logp import fast
from kgen.families.linear_logp.backward_launch import backward
from kgen.families.linear_logp.checks import check_flat, check_inputs, check_target_range
from kgen.families.linear_logp.cuda_variant import CudaForward
from kgen.families.linear_logp.kept import backward_kept, forward_kept, kept_logits
from kgen.families.linear_logp.launch import forward
from kgen.families.linear_logp.plans import _precision
from kgen.families.linear_logp.reference import reference, reference_backward
from kgen.families.linear_logp.tuning import TUNE_DIMS, bucket_extras, tune_bucket
from kgen.runtime.op import (MISSING, Override, _any_autocast, autocast, check_dispatch_env, define, dispatch_modes,
                             vmap_batched, with_reference)

# --------------------------------------------------------------------------- kernel choice


_FORCED = Override()
_MODULES: dict = {}


def implementation(kernel, companion=None):
    """What the op runs for a loaded variant: a Triton variant's module, or a CUDA variant
    wrapped with its Triton companion (`companion`: a loaded Triton variant; default:
    dispatch's first Triton choice for the device and dtype)."""
    if kernel is None or kernel.backend == "triton":
        return kernel.module if kernel is not None else None
    if companion is None:
        from kgen.runtime import dispatch

        companion = dispatch.triton_companion("linear_logp", kernel, "run the backward")
    return CudaForward(kernel, companion.module)


# Run the op with this implementation (`implementation(kernel)`, a Triton variant's
# `.module`, or None: the PyTorch reference) instead of dispatch's choice, in this thread
# (its backward too). For tests and benchmarks.
using = _FORCED.using


def _module(device: torch.device, dtype: torch.dtype, shape: Optional[tuple[int, int, int]] = None):
    """The implementation for (device, dtype) and, given the (N, D, V) of a forward, its
    shape bucket (the tuning table's winner there, else spec order); without a shape, spec
    order (the backward: its Triton kernels are not tuned). None means the PyTorch
    reference (CPU tensors, no variant could be built, or the reference won the tuning)."""
    forced = _FORCED.get()
    if forced is not MISSING:
        return forced
    if device.type != "cuda":
        check_dispatch_env()  # (a typo in KGEN_BACKEND / KGEN_AUTOTUNE fails here too)
        return None
    if shape is None:
        key = (device.index, dtype)
    else:  # tune_bucket's classes as plain integers (a generator here cost every call)
        N, D, V = shape
        key = (device.index, dtype, (N - 1).bit_length(), (D - 1).bit_length(), (V - 1).bit_length(),
               _precision(dtype) if dtype == torch.float32 else None)
    mod = _MODULES.get(key, MISSING)
    if mod is MISSING:
        mod = _MODULES[key] = _choose(device, dtype, shape)
    return mod


def _choose(device: torch.device, dtype: torch.dtype, shape):
    from kgen.runtime import dispatch

    name = str(dtype).removeprefix("torch.")
    if shape is None:
        kernel = dispatch.select("linear_logp", device, name)
        dispatch.log_choice("linear_logp", device, name, "backward", kernel, "spec order")
    else:
        dims = dict(zip(TUNE_DIMS, shape))
        kernel, _ = dispatch.choose_logged("linear_logp", device, name, tune_bucket(**dims, **bucket_extras(name)),
                                           dims)
    companion = None
    if kernel is not None and kernel.backend == "cuda":
        companion = dispatch.select("linear_logp", device, name, backend="triton")
        if companion is None:  # nothing to combine with: the reference serves
            kernel = None
    return implementation(kernel, companion) if kernel is not None else None


# --------------------------------------------------------------------------- torch.library


def _forward_impl(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                  temperature: float, ignore_index: int, with_entropy: bool, check_targets: bool,
                  keep_logits: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward op's implementation: 2-D hidden, 1-D target. Returns (logp [N], entropy
    [N] or [0], lse2 [N], ez2 [N] or [0], logits [N, V] or [0]); lse2, ez2 and the logits
    are what the backward needs (unused on the reference path; the logits float32
    hidden @ weight.T with keep_logits on a kernel path, else [0]). `check_targets`: raise
    ValueError for a target outside [0, V) (a host wait); otherwise such rows come out NaN."""
    check_inputs(hidden, weight, target, bias, temperature, ignore_index)
    check_flat(hidden, target)
    mod = _module(hidden.device, hidden.dtype, (hidden.shape[0], hidden.shape[1], weight.shape[0]))
    target = target.contiguous()
    checked = (check_target_range(target, weight.shape[0], ignore_index,
                                  mod.triton if isinstance(mod, CudaForward) else mod)
               if check_targets else _unchecked)
    if mod is not None:
        args = (hidden.contiguous(), weight.contiguous(), target, bias.contiguous() if bias is not None else None,
                temperature, ignore_index, with_entropy)
        if keep_logits:
            out = forward_kept(mod, *args)
        else:
            out = (*forward(mod, *args), hidden.new_empty(0, dtype=torch.float32))
        checked()
        return out
    checked()  # before the reference (it never indexes outside the logits either)
    logp, entropy = reference(hidden, weight, target, bias, temperature=temperature, ignore_index=ignore_index)
    N, n_ent = hidden.shape[0], hidden.shape[0] if with_entropy else 0
    f32 = torch.float32
    # (with keep_logits the logits all the same, as the fake says; the reference's backward
    # does not read them, and linear_logp asks for them only where a kernel runs)
    return (logp, entropy if with_entropy else entropy.new_empty(0),
            torch.zeros(N, dtype=f32, device=hidden.device), torch.zeros(n_ent, dtype=f32, device=hidden.device),
            kept_logits(hidden, weight) if keep_logits else logp.new_empty(0))


def _unchecked() -> None:
    pass


def _op_fake(hidden, weight, target, bias, temperature, ignore_index, with_entropy, check_targets,
             keep_logits=False):
    check_inputs(hidden, weight, target, bias, temperature, ignore_index)
    check_flat(hidden, target)
    N, n_ent = hidden.shape[0], hidden.shape[0] if with_entropy else 0
    new = lambda *n: hidden.new_empty(n, dtype=torch.float32)  # noqa: E731
    return new(N), new(n_ent), new(N), new(n_ent), new(N, weight.shape[0]) if keep_logits else new(0)


def _backward_impl(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                   lse2: torch.Tensor, ez2: torch.Tensor, grad_logp: torch.Tensor,
                   grad_entropy: Optional[torch.Tensor], temperature: float, ignore_index: int,
                   logits: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias or [0]) by recomputation, or from the forward's
    kept logits where given; see backward_launch's docstring. Where the forward ran the PyTorch
    reference (the tuning table's winner for its shape bucket), so does the backward: that
    forward leaves lse2 and ez2 zero, which a kernel backward would take for the row
    statistics (gradients off by orders of magnitude, float32 at N = 5, V >= 100000 on an
    H200 before this)."""
    check_flat(hidden, target, "linear_logp_backward")
    N, D = hidden.shape
    ran_reference = N > 0 and _module(hidden.device, hidden.dtype, (N, D, weight.shape[0])) is None
    mod = None if ran_reference else _module(hidden.device, hidden.dtype)
    if mod is not None:
        args = (hidden.contiguous(), weight.contiguous(), target.contiguous(),
                bias.contiguous() if bias is not None else None, lse2, ez2, grad_logp.contiguous(),
                None if grad_entropy is None else grad_entropy.contiguous(), temperature, ignore_index)
        if logits is not None and logits.numel():
            gh, gw, gb = backward_kept(mod, logits, *args)
        else:
            gh, gw, gb = backward(mod, *args)
        return gh, gw, gb if gb is not None else hidden.new_empty(0)
    return reference_backward(hidden, weight, target, bias, grad_logp, grad_entropy, temperature, ignore_index)


def _bwd_op_fake(hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy, temperature, ignore_index,
                 logits=None):
    check_flat(hidden, target, "linear_logp_backward")
    return (torch.empty_like(hidden), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, temperature, ignore_index, with_entropy = inputs[:7]
    _, _, lse2, ez2, logits = output
    ctx.save_for_backward(hidden, weight, target, bias, lse2, ez2, logits)
    ctx.temperature, ctx.ignore_index, ctx.with_entropy = temperature, ignore_index, with_entropy
    ctx.pad = (None,) * (len(inputs) - 4)  # the gradients of the non-tensor inputs (keep_logits optional)
    ctx.has_bias = bias is not None
    ctx.forced = _FORCED.get()  # `using(mod)` holds for the backward too
    # No zero tensors made for outputs without a gradient (lse2, ez2, an unused entropy):
    # they arrive as None (host time: three allocations and fills a call).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse2, _grad_ez2, _grad_logits):
    hidden, weight, target, bias, lse2, ez2, logits = ctx.saved_tensors
    if grad_logp is None:  # only the entropy has a gradient
        grad_logp = torch.zeros_like(lse2)
    args = (hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy if ctx.with_entropy else None,
            ctx.temperature, ctx.ignore_index) + ((logits,) if logits.numel() else ())
    if ctx.forced is MISSING:  # (no context manager: host time of every small call)
        gh, gw, gb = _bwd_op(*args)
    else:
        with using(ctx.forced):
            gh, gw, gb = _bwd_op(*args)
    return gh, gw, None, gb if ctx.has_bias else None, *ctx.pad


# torch.ops.kgen.linear_logp(_backward): 2-D hidden, 1-D target, five outputs (logp,
# entropy or [0], lse2, ez2 or [0], the kept logits or [0]). Each call below goes straight
# to the implementation in eager mode and through the registered op under torch.compile
# (kgen.runtime.op.define), so the backward, called from either, takes the same path as its
# forward.
_bwd_op = define("linear_logp_backward", _backward_impl, fake=_bwd_op_fake)


def _composition(hidden, weight, target, bias, temperature, ignore_index, with_entropy, check_targets,
                 keep_logits=False):
    """The op under torch.func transforms and forward-mode AD (kgen.runtime.op.define): its
    reference. Checked mode reads target's values on the host, which a batched target under
    vmap does not have: there it is skipped, as during CUDA graph capture (bad rows NaN)."""
    if check_targets and vmap_batched(target):
        check_targets = False
    return _reference_forward(hidden, weight, target, bias, temperature, ignore_index, with_entropy, check_targets,
                              keep_logits)


_reference_forward = with_reference(_forward_impl, _FORCED)
_op = define("linear_logp", _forward_impl, fake=_op_fake, backward=_backward, setup_context=_setup_context,
             composition=_composition)


# --------------------------------------------------------------------------- the eager fast path

# Per exact call signature (_signature) that the general path served with a kernel, a
# fast.Entry, at most FAST_ENTRIES of them (the table starts over when full). FAST off
# (KGEN_LINEAR_LOGP_FAST=0, or the switch set here): every call takes the general path.
# STATS["fast"] counts the calls the fast path served (tests, benchmarks).
_FAST: dict = {}
FAST_ENTRIES = 4096
FAST = os.environ.get("KGEN_LINEAR_LOGP_FAST", "1") != "0"
STATS = {"fast": 0}
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_step = fast.Step.apply


def _signature(hidden, weight, target, bias, return_entropy) -> tuple:
    """What a fast-path entry is kept under: everything check_inputs, the kernel choice and
    the forward's decisions read but temperature and ignore_index (checked per call by
    _fast, passed to the kernels as they come): each tensor's type, shape, dtype, device and
    contiguity, bias or not, entropy or not, and whether hidden, weight and bias all start
    on 16 bytes (the CUDA kernels' and TMA's condition). A call with the same signature
    passes the same checks and runs the same kernels with the same arguments but for its
    pointers and scalars."""
    key = (type(hidden), hidden.shape, hidden.dtype, hidden.device, hidden.is_contiguous(),
           type(weight), weight.shape, weight.dtype, weight.device, weight.is_contiguous(),
           type(target), target.shape, target.dtype, target.device, target.is_contiguous(),
           bool(return_entropy),
           not (hidden.data_ptr() | weight.data_ptr() | (bias.data_ptr() if bias is not None else 0)) & 15)
    if bias is not None:
        key += (type(bias), bias.shape, bias.dtype, bias.device, bias.is_contiguous())
    return key


def _backward_module(device: torch.device, dtype: torch.dtype):
    """The backward's implementation, as the general path's backward takes it."""
    return _module(device, dtype)


def _remember(hidden, weight, target, bias, return_entropy) -> None:
    """After the general path served a call (checks passed, outside `using` blocks, tracing
    and autocast): the fast-path entry of its signature, where the call ran a kernel on
    plain, contiguous tensors of N >= 1 rows."""
    for t in (hidden, weight, target, bias):
        if t is not None and (type(t) not in _PLAIN or not t.is_contiguous()):
            return
    V, D = weight.shape
    N = hidden.numel() // D
    if N == 0:
        return
    mod = _module(hidden.device, hidden.dtype, (N, D, V))
    if mod is None:  # the reference: nothing to save on a CPU path
        return
    key = _signature(hidden, weight, target, bias, return_entropy)
    entry = _FAST.get(key)
    if entry is not None and entry.mod is mod:
        return
    if len(_FAST) >= FAST_ENTRIES:  # many signatures: keep the table small
        _FAST.clear()
    _FAST[key] = fast.Entry(mod, hidden, weight, bias, bool(return_entropy), _backward_module)


def _fast(hidden, weight, target, bias, temperature, ignore_index, return_entropy, check_targets):
    """The eager fast path for this call (see linear_logp), or None: the general path serves
    it (a new signature, checked mode, a scalar the checks would refuse, anything else)."""
    tt = type(temperature)
    if not ((tt is float or tt is int) and 0 < temperature < math.inf and type(ignore_index) is int):
        return None
    if check_targets if check_targets is not None else _env_checked():
        return None  # checked mode: the general path's host wait and error
    try:
        entry = _FAST.get(_signature(hidden, weight, target, bias, return_entropy))
    except (AttributeError, TypeError, RuntimeError):  # not tensors (the general path says what is wrong)
        return None
    # (the kernel choice made anew if dispatch's cache was cleared or `_module` replaced)
    if entry is None or entry.mod is not _module(hidden.device, hidden.dtype, entry.dims):
        return None
    STATS["fast"] += 1
    if _grad_enabled() and (hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _step(entry, hidden, weight, target, bias, float(temperature), ignore_index)
    return entry.forward(hidden, weight, target, bias, float(temperature), ignore_index)


# keep_logits pays where a call is GPU-bound; below this many logit FLOPs (2 * N * D * V,
# V the local slice's with `group`) a call is host-bound (four Triton launches and a GEMM
# more, no eager fast path) and it is ignored. H200, bf16, forward + backward in a loop,
# keep_logits / default: 1.73x at 8 x 512 x 1024, 1.07x at 1024 x 2048 x 32000 (1.3e11),
# 0.86x at 4096 x 2048 x 32000 (5.4e11), 0.82x at 4096 x 4096 x 128256 (BENCHMARKS.md,
# thirty-third session).
KEEP_LOGITS_MIN_FLOP = 2.5e11


def keeps_logits(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a keep_logits call (gradient to come) keeps them: a kernel runs (the
    reference materialises the logits anyway) and the call is large enough to pay
    (KEEP_LOGITS_MIN_FLOP). On checked arguments."""
    V, D = weight.shape
    N = hidden.numel() // max(D, 1)
    return 2.0 * N * D * V >= KEEP_LOGITS_MIN_FLOP and _module(hidden.device, hidden.dtype, (N, D, V)) is not None


def _env_checked() -> bool:
    return os.environ.get("KGEN_CHECK_TARGETS", "0") not in ("", "0")


def checked_mode(check_targets: Optional[bool]) -> bool:
    """The argument, else KGEN_CHECK_TARGETS (off by default: see linear_logp)."""
    if check_targets is not None:
        return bool(check_targets)
    return _env_checked()


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: Optional[torch.Tensor] = None, *, temperature: float = 1.0,
                ignore_index: int = -100, return_entropy: bool = False,
                check_targets: Optional[bool] = None, group=None, keep_logits: bool = False):
    """logp = log_softmax((hidden @ weight.T + bias) / temperature)[target] per row, float32,
    shaped like hidden.shape[:-1]; with return_entropy, (logp, entropy) where entropy is
    that of the tempered softmax. Rows with target == ignore_index give 0 for both and no
    gradient. Differentiable for hidden, weight and bias under any upstream gradients.

    The N x V logits are not materialised on CUDA (extra memory in the docstring of
    kgen.families.linear_logp.backward_launch, < 64 MiB at N=8192, V=128256) except where the
    tuning table found the PyTorch reference fastest, which it may only where those logits
    take under 64 MiB, and float32 calls of a few rows (launch.logits_path: at most 16 MiB
    of logits, freed by the end of each pass); CPU tensors use the float32 PyTorch
    reference. In eager mode the implementation is called directly (an autograd.Function
    when a gradient is needed), under torch.compile the registered op.
    Dtypes, shapes and devices are checked before any launch. Target values are not, by
    default: a target outside [0, V) that is not ignore_index gives that row a NaN logp (and
    entropy), never a read outside weight and never a plausible number. Checking them needs
    the device's answer on the host, a wait per call that would stop a training loop's CPU
    from running ahead of the GPU (and is illegal during CUDA graph capture), so it is
    opt-in: `check_targets=True` or KGEN_CHECK_TARGETS=1 raises ValueError naming the first
    bad value (one device reduction queued before the kernels, waited for after them;
    skipped during graph capture). Under torch.autocast, hidden, weight and bias are cast to
    its dtype, as F.linear's are (bf16 activations with an fp32 master weight: the weight's
    gradient arrives in float32). Also registered as torch.ops.kgen.linear_logp (2-D
    hidden, 1-D target, five outputs).

    `group`: a torch.distributed process group over which the vocabulary is split. Then
    weight (and bias) are this rank's contiguous slice, slices in group-rank order, of any
    lengths; hidden and target (global ids) are the same on every rank; every rank returns
    what the op gives on the whole weight, hidden's gradient summed over the group and
    weight's and bias's of the local slice. Forward: one all-gather of O(N) floats;
    backward: one all-reduce of grad_hidden. See kgen.families.linear_logp.dist.

    `keep_logits=True` trades memory for a faster training step: where a gradient will be
    asked for, the forward keeps the float32 logits hidden @ weight.T (N * V * 4 bytes, held
    until the backward) from one cuBLAS GEMM and takes logp from them, and the backward
    reads them instead of recomputing them: an elementwise pass writes dz (N * V * elsize
    bytes more while it runs), then one GEMM each for grad_weight and grad_hidden -- three
    GEMMs a step instead of four. The results are those of the default path up to the
    GEMMs' summation order. Without a gradient to come (no_grad, no input requiring one) it
    is ignored, as it is below KEEP_LOGITS_MIN_FLOP logit FLOPs (2 * N * D * V), where a call
    is host-bound and the default is faster. With `group`, the local slice's logits (N * V_r * 4 bytes a rank).

    Eager calls take a fast path (kgen.families.linear_logp.fast) once the general path
    served their signature with a kernel (shapes, dtypes, devices, contiguity, 16-byte
    alignment, bias and entropy or not; any temperature and ignore_index): the same kernels
    with the same arguments, without the checks, the kernel choice, the torch.library
    wrapper and the per-call decisions, and a backward that calls the cached backward plan
    directly. It steps aside under torch.compile tracing, torch.autocast, `using` blocks,
    checked mode, `group` and keep_logits, for tensor subclasses, and everywhere with
    KGEN_LINEAR_LOGP_FAST=0.
    """
    # (tracing first: torch.compile then reads none of the fast path's state, so no guards on it)
    if (not _compiling() and FAST and _FAST and group is None and not keep_logits and not _FORCED.open
            and not _any_autocast() and not dispatch_modes()):
        out = _fast(hidden, weight, target, bias, temperature, ignore_index, return_entropy, check_targets)
        if out is not None:
            return out
    hidden, weight, bias = autocast(hidden, weight, bias)  # under torch.autocast, as F.linear
    # (only where a gradient will be asked for and, below, a kernel runs: the reference
    # materialises the logits anyway)
    keep = bool(keep_logits) and _grad_enabled() and any(
        x is not None and x.requires_grad for x in (hidden, weight, bias))
    if group is not None:
        from kgen.families.linear_logp.dist import linear_logp_group

        return linear_logp_group(hidden, weight, target, bias, temperature, ignore_index, return_entropy,
                                 checked_mode(check_targets), group, keep)
    check_inputs(hidden, weight, target, bias, temperature, ignore_index)
    keep = keep and keeps_logits(hidden, weight)
    flat = hidden.dim() == 2 and target.dim() == 1  # the common case: no reshapes (host time)
    n = math.prod(hidden.shape[:-1])  # (not -1: ambiguous under vmap over an empty batch)
    args = (hidden if flat else hidden.reshape(n, weight.shape[1]), weight, target if flat else target.reshape(n),
            bias, float(temperature), int(ignore_index), bool(return_entropy), checked_mode(check_targets), keep)
    logp, entropy = _op(*args)[:2]
    if not _compiling() and FAST and not keep_logits and not _FORCED.open and not _any_autocast() and not dispatch_modes():
        _remember(hidden, weight, target, bias, return_entropy)
    if not flat:
        logp, entropy = logp.reshape(hidden.shape[:-1]), entropy.reshape(hidden.shape[:-1]) if return_entropy else entropy
    return (logp, entropy) if return_entropy else logp


OPS = {"linear_logp": linear_logp}


# --------------------------------------------------------------------------- golden numerics

# Gradients vs float64, judged against the largest gradient element: 16-bit inputs round
# dz to 16 bits before the two gradient GEMMs and round the outputs (2^-9 bf16, 2^-12
# fp16 per element, summed over V or N): observed up to 1.3e-2 of scale for bf16, 8e-4 fp16.
GRAD_TOL = {"float32": 2e-5, "float16": 5e-3, "bfloat16": 3e-2}


def golden(kernel, device, dtype: str, tol) -> list[tuple[str, float]]:
    """Forward (logp, entropy) and gradients of one loaded variant against float64 on fresh
    random inputs of awkward sizes, with bias, ignored rows, temperature 0.7 and random
    upstream gradients; returns (case, worst error / tolerance) per output."""
    tdtype = getattr(torch, dtype)
    sizes = [(1, 50, 16), (7, 257, 40), (33, 1000, 72)]
    if device.type == "cuda":
        sizes += [(300, 5003, 264), (1, 50257, 2048)]
    results = []
    impl = implementation(kernel)
    for N, V, D in sizes:
        h = torch.randn(N, D, device=device).to(tdtype)
        w = (torch.randn(V, D, device=device) * (2.0 / math.sqrt(D))).to(tdtype)
        b = (torch.randn(V, device=device) * 0.5).to(tdtype)
        t = torch.randint(0, V, (N,), device=device)
        t[::3] = -100 if N > 1 else t[::3]
        g_logp, g_ent = torch.randn(N, device=device), torch.randn(N, device=device)
        outs = []
        for mod, compute in ((impl, None), (None, torch.float64)):
            leaves = [x.clone().requires_grad_() for x in (h, w, b)]
            if compute is None:
                with using(mod):
                    logp, ent = linear_logp(*leaves[:2], t, leaves[2], temperature=0.7, return_entropy=True)
            else:
                logp, ent = reference(*leaves[:2], t, leaves[2], temperature=0.7, compute=compute)
            ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
            outs.append([logp, ent] + [x.grad for x in leaves])
        for name, got, want in zip(("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"), *outs):
            want = want.detach().double()
            if name.startswith("grad"):
                bound = GRAD_TOL[dtype] * max(1.0, float(want.abs().max()))
            else:
                bound = tol.atol + tol.rtol * want.abs()
            err = (got.detach().double() - want).abs() / bound
            worst = float(err.max()) if err.numel() and not torch.isnan(err).any() else (
                0.0 if not err.numel() else float("inf"))
            results.append((f"N={N} V={V} D={D} {name}", worst))
    return results
