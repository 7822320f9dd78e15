"""fused_bias_act's kernel choice (tuning buckets), the op's implementation, the torch.library
ops with autograd and the public function."""

from __future__ import annotations

import math
from typing import Optional

import torch

from kgen.families.fused_bias_act.checks import _check, _overlaps
from kgen.families.fused_bias_act.launcher import bound, launch
from kgen.families.fused_bias_act.reference import _dact, _preact, reference
from kgen.families.fused_bias_act.schema import TORCH_DTYPES
from kgen.runtime.memo import CallMemo
from kgen.runtime.op import MISSING, Kernels, check_dispatch_env, define, dispatch_modes

# The eager fast path (`fused_bias_act`): per exact call signature (act, y or not, and the
# tensors' type, shape, strides, dtype, device and requires_grad: kgen.runtime.memo) the
# variant's bound launcher (launcher.bound), kept by the op's implementation after a call
# of plain, contiguous tensors none of which needs a gradient. A hit skips torch.library's
# dispatch, the checks and the kernel lookup (H200 host: the op took 15-19 us a call where
# its bare launch takes 4-6, BENCHMARKS.md thirty-sixth session). FAST_PATH off: every call
# takes the op.
_FAST = CallMemo(4096)
FAST_PATH = True
_PLAIN = torch.Tensor
_compiling = torch.compiler.is_compiling


def _kernel(device: torch.device, dtype: torch.dtype, rows: int = 1, cols: int = 1, has_y: bool = True):
    """The loaded variant for (device, dtype) and the shape's bucket, chosen (tuning table,
    else spec order) and built on the first call, then cached for the process (None: the
    reference runs)."""
    key = _key(device.index, dtype, rows, cols, has_y)
    kernel = _KERNELS.lookup(key)
    if kernel is MISSING:
        kernel = _KERNELS.choose(key, device, dtype, {"rows": rows, "cols": cols, "has_y": has_y})
    return kernel


def _key(dev: int, dtype, rows: int, cols: int, has_y: bool) -> tuple:
    """The per-call cache key: the same classes as tune_bucket, as cheap integers."""
    return dev, dtype, (rows - 1).bit_length(), (cols - 1).bit_length(), _row_class(cols), has_y


# --------------------------------------------------------------------------- tuning

# Buckets: rows and columns each rounded up to a power of two, how a row is aligned, and
# whether y is read (3 streams of memory instead of 2). Alignment, in 16-bit elements:
# `vec16` (cols % 8 == 0: whole 16-byte vectors, the CUDA kernels' vector path), `vec8`
# (cols % 4 == 0 otherwise: the CUDA row variants of 4-element vectors and the Triton row
# tiles load 8 bytes at a time, kgen.runtime.op.stride_align) and `tail` (the rest: those
# load one or two elements at a time, while the CUDA flat order reads whole vectors
# regardless). The winner differs between the last two: bf16 / fp16 777 x 20004 no y ran a
# CUDA flat variant at 23.7 / 24.1 us where a Triton row tile takes 20.2 / 18.4 (H200,
# BENCHMARKS.md thirty-seventh session), while at odd widths the row tiles lose; and a
# `vec8` winner must not serve cols % 4 == 2 (3000 x 2050 bf16: 17.2 against 9.9 us when
# it did). A `vec8` bucket nobody tuned takes the same sizes' `tail` entry
# (TUNE_CLASS_FALLBACK: what runs well at any width runs these at least as fast). act is not
# in the bucket: every variant computes it in registers while memory is the bound, so it
# does not change which variant wins.
TUNE_DIMS = ("rows", "cols")
# Rows beyond the tuned ones take the nearest tuned bucket's winner however many they are
# (every variant tiles rows alike); columns only from within two powers of two (tuning_table.nearest).
TUNE_FREE_DIMS = ("rows",)
TUNE_CLASS_FALLBACK = {"vec8": "tail"}  # tuning_table.stand_in: the entry an untuned vec8 bucket takes
TUNE_VARIATIONS = ({"has_y": True}, {"has_y": False})  # what `kgen tune --shapes` adds to each shape
# Default shapes for `kgen tune`: rows from 1 to 32768, 16-byte-vector and tail widths from
# ~1000 to ~800000, at most 2^27 elements; buckets between them take the nearest one's winner
# where it won by a margin (tuning_rules.transfers), else spec order. 5000 fills the cols <= 8192
# vec16 buckets, which spec order served at 6000 x 5000 (bf16 no y: 0.947 of the fastest,
# H100, BENCHMARKS.md twelfth session); the shipped tables have them from the next re-tune.
# Three quarters of a power of two (768, 1536, 3072, 24576, 49152) is a second shape in its
# bucket (tuning_rules.bucket_winner), where a tile sized for the bucket's top idles a quarter of
# its lanes: tuned at 1024 alone, 30000 x 768 fp16 ran at 0.90 of the fastest (H200,
# BENCHMARKS.md twenty-third session). 1004 and 12340 are the `vec8` widths.
TUNE_SHAPES = tuple({"rows": r, "cols": c, "has_y": y}
                    for r in (1, 8, 64, 512, 2048, 4096, 8192, 16384, 32768)
                    for c in (768, 1001, 1004, 1024, 1536, 3072, 4096, 5000, 12288, 12340, 12345, 24576, 49152, 65536,
                              786432)
                    if r * c <= 1 << 27
                    for y in (True, False))


_ROW_CLASSES = ("tail", "vec8", "vec16")


def nearby_transfers(shape: dict, bucket: str, variant) -> bool:
    """dispatch's veto on a nearby bucket's winner (tuning_table.nearest: columns from up to two powers
    of two away): not a Triton row tile (order "down") whose block of columns is more than
    twice the widest of the call's bucket (the choice is cached per bucket), which idles most
    of its lanes: fp16 10778 x 164 ran the cols <= 1024 bucket's `triton_c1024_r4_w4` at 12.1
    us of GPU time where the fastest candidate took 4.1 (H200, BENCHMARKS.md thirty-ninth
    session). The flat order and the CUDA variants cover any width alike."""
    return not (variant is not None and variant.backend == "triton" and variant.params.get("order") == "down"
                and variant.params["block_cols"] > 2 << (shape["cols"] - 1).bit_length())


def _row_class(cols: int) -> int:
    """The index in _ROW_CLASSES: 2 (cols % 8 == 0), 1 (cols % 4 == 0), 0 (else)."""
    return 2 if cols % 8 == 0 else int(cols % 4 == 0)


def tune_bucket(rows: int, cols: int, has_y: bool = True) -> str:
    r, c = (rows - 1).bit_length(), (cols - 1).bit_length()
    return f"rows<={1 << r}.cols<={1 << c}.{_ROW_CLASSES[_row_class(cols)]}.{'y' if has_y else 'no-y'}"


_KERNELS = Kernels("fused_bias_act", tune_bucket)


def tune_inputs(device, dtype: str, rows: int, cols: int, has_y: bool = True) -> dict:
    t = next(k for k, n in TORCH_DTYPES.items() if n == dtype)
    x = torch.randn(rows, cols, device=device, dtype=t)
    return {"x": x, "bias": torch.randn(cols, device=device, dtype=t),
            "y": torch.randn_like(x) if has_y else None, "out": torch.empty_like(x)}


def tune_runner(kernel, inputs: dict):
    """One gelu launch of `kernel` (None: the reference) into the scratch output."""
    x, bias, y, out = inputs["x"], inputs["bias"], inputs["y"], inputs["out"]
    if kernel is None:
        return lambda: out.copy_(reference(x, bias, y, 0.5, "gelu"))
    return lambda: launch(kernel, x, bias, y, 0.5, "gelu", out)


def _forward(x, bias, y, alpha: float, act: str, inplace: bool):
    """The op's implementation (eager fast path and the registered op alike). It runs on
    every call, so it reads each tensor attribute once and calls as little as it can."""
    _check(x, bias, y, alpha, act, inplace)
    given = (x, bias) if y is None else (x, bias, y)  # the caller's tensors (before any copy below)
    if inplace:
        if _overlaps(x, bias) or (y is not None and _overlaps(x, y)):
            raise ValueError("fused_bias_act: in place, bias and y must not partially overlap x")
        if x.is_inference() and not torch.is_inference_mode_enabled():  # as torch's own in-place ops
            raise RuntimeError("fused_bias_act: in place into an inference tensor outside InferenceMode is not "
                               "allowed (as for torch's in-place ops); clone it first")
        out = x
    else:
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty_like(x)
    if not bias.is_contiguous():
        bias = bias.contiguous()
    if y is not None and not y.is_contiguous():
        y = y.contiguous()
    dev = x.get_device()  # -1 for CPU tensors
    kernel = None
    if dev >= 0:
        cols = x.shape[-1]
        rows = x.numel() // cols if cols else 0
        kernel = _KERNELS.lookup(_key(dev, x.dtype, rows, cols, y is not None))
        if kernel is MISSING:
            kernel = _kernel(x.device, x.dtype, rows, cols, y is not None)
    if kernel is None:  # CPU tensors, or no GPU variant could be built: the reference
        if dev < 0:
            check_dispatch_env()
        return out.copy_(reference(x, bias, y, alpha, act)) if x.numel() else out
    launch(kernel, x, bias, y, alpha, act, out)
    if inplace:
        # the kernel wrote x behind autograd's back: bump its version as torch's in-place ops do,
        # so a graph that saved x refuses to backward through the stale value
        torch.autograd.graph.increment_version(x)
    if FAST_PATH and not inplace and rows and _keepable(given):
        call = ((act, y is None), given)
        if not _FAST.has(call):
            _FAST.put(call, bound(kernel, dev, rows, cols, y is not None, act))
    return out


def _keepable(tensors) -> bool:
    """Whether a call of these tensors may be kept for the fast path: plain, contiguous, none
    needing a gradient (the memo then matches only calls with the same metadata)."""
    return all(type(t) is _PLAIN and t.is_contiguous() and not t.requires_grad for t in tensors)


# --------------------------------------------------------------------------- torch.library


def _op_impl(x: torch.Tensor, bias: torch.Tensor, y: Optional[torch.Tensor], alpha: float, act: str) -> torch.Tensor:
    return _forward(x, bias, y, alpha, act, False)


def _op_fake(x, bias, y, alpha, act):
    _check(x, bias, y, alpha, act, False)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _op_inplace_impl(x: torch.Tensor, bias: torch.Tensor, y: Optional[torch.Tensor], alpha: float, act: str) -> None:
    _forward(x, bias, y, alpha, act, True)


def _op_inplace_fake(x, bias, y, alpha, act):
    _check(x, bias, y, alpha, act, True)


def _setup_context(ctx, inputs, output):
    x, bias, y, alpha, act = inputs
    ctx.save_for_backward(x, bias, y)
    ctx.alpha, ctx.act = alpha, act


def _backward(ctx, grad):
    x, bias, y = ctx.saved_tensors
    # Recompute z in float32 (the saved inputs are all we keep) and form dz = g * act'(z).
    z = _preact(x, bias, y, ctx.alpha, torch.float32)
    dz = grad.to(torch.float32) * _dact(z, ctx.act)
    grad_x = dz.to(x.dtype) if ctx.needs_input_grad[0] else None
    grad_bias = dz.reshape(math.prod(x.shape[:-1]), x.shape[-1]).sum(0).to(bias.dtype) if ctx.needs_input_grad[1] else None
    grad_y = (ctx.alpha * dz).to(y.dtype) if y is not None and ctx.needs_input_grad[2] else None
    return grad_x, grad_bias, grad_y, None, None


def _composition(x, bias, y, alpha, act):
    """The op in PyTorch operations (the CPU path's math), which torch.func transforms and
    forward-mode AD trace through (kgen.runtime.op.define)."""
    _check(x, bias, y, alpha, act, False)
    return reference(x, bias, y, alpha, act).to(x.dtype)


def _composition_inplace(x, bias, y, alpha, act):
    _check(x, bias, y, alpha, act, True)
    x.copy_(reference(x, bias, y, alpha, act))


# torch.ops.kgen.fused_bias_act (differentiable) and torch.ops.kgen.fused_bias_act_ (in place)
_op = define("fused_bias_act", _op_impl, fake=_op_fake, backward=_backward, setup_context=_setup_context,
             composition=_composition)
_op_inplace = define("fused_bias_act_", _op_inplace_impl, fake=_op_inplace_fake, mutates_args=("x",),
                     composition=_composition_inplace)


def _as_float(alpha) -> float:
    """Any real scalar (int, numpy float, 0-d CPU tensor) as a Python float; not bool or str,
    nor a tensor that requires a gradient (alpha is a constant of the op: its gradient would
    be dropped)."""
    import numbers

    if isinstance(alpha, torch.Tensor) and alpha.dim() == 0 and not alpha.is_cuda:
        if alpha.requires_grad:
            raise TypeError("fused_bias_act: alpha is a constant, not differentiable; it requires a gradient "
                            "(pass float(alpha), or compute act(x + alpha * y + bias) with torch ops)")
        alpha = alpha.item()
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"fused_bias_act: alpha must be a float, got {type(alpha).__name__}")
    return float(alpha)


def fused_bias_act(x: torch.Tensor, bias: torch.Tensor, y: Optional[torch.Tensor] = None, *,
                   alpha: float = 1.0, act: str = "none", inplace: bool = False) -> torch.Tensor:
    """out = act(x + alpha * y + bias), bias broadcast along x's last dimension.

    alpha is a constant of the op: a Python number (in eager mode also a 0-d CPU tensor that
    needs no gradient, read once; under torch.compile pass a float).
    act is one of none, relu, sigmoid, gelu (tanh form), silu; arithmetic runs in float32
    and the result has x's dtype. `inplace=True` writes into x and returns it (not
    differentiable: raises if a gradient is needed). Differentiable for x, y and bias.
    On CUDA tensors the best kernel variant for the device and dtype runs on the current
    stream; CPU tensors use the float32 PyTorch reference. Also `torch.ops.kgen.fused_bias_act`.
    """
    if type(alpha) is not float:
        alpha = _as_float(alpha)
    if not inplace and _FAST.size and not _compiling() and not dispatch_modes():
        try:
            f = _FAST.get(((act, y is None), (x, bias) if y is None else (x, bias, y)))
        except TypeError:  # an unhashable act: the op says what is wrong
            f = None
        if f is not None:
            return f(x, bias, y, alpha)
    if inplace:
        if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (x, bias, y)):
            raise ValueError("fused_bias_act: inplace=True is not differentiable; use the "
                             "out-of-place form when a gradient is needed")
        _op_inplace(x, bias, y, alpha, act)
        return x
    return _op(x, bias, y, alpha, act)


OPS = {"fused_bias_act": fused_bias_act}
