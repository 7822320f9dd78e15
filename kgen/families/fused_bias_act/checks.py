"""fused_bias_act's argument checks: cheap on every call, with a full explanation on failure."""

from __future__ import annotations

import torch

from kgen.families.fused_bias_act.schema import ACT_CODE, ACTIVATIONS, TORCH_DTYPES


def _check(x, bias, y, alpha, act, inplace: bool) -> None:
    """Everything that would make a launch wrong or unsafe raises here, before any launch.

    One combined test on the common path (it runs on every call, so it is kept cheap), and
    the detailed walk through `_explain` only to word the error.
    """
    try:
        dt, xs, xd = x.dtype, x.shape, x.device
        if (dt in TORCH_DTYPES and bias.dtype is dt and act in ACT_CODE and type(alpha) in (float, int)
                and len(xs) >= 1 and bias.shape == xs[-1:] and bias.device == xd
                and (y is None or (y.dtype is dt and y.shape == xs and y.device == xd))
                and (not inplace or x.is_contiguous())):
            return
    except (AttributeError, TypeError):
        pass
    _explain(x, bias, y, alpha, act, inplace)


def _explain(x, bias, y, alpha, act, inplace: bool) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(bias, torch.Tensor):
        raise TypeError("fused_bias_act: x and bias must be tensors")
    if x.dtype not in TORCH_DTYPES:
        raise TypeError(f"fused_bias_act: x has dtype {x.dtype}; supported: float32, bfloat16, float16")
    if bias.dtype != x.dtype:
        raise TypeError(f"fused_bias_act: bias dtype {bias.dtype} differs from x dtype {x.dtype}")
    if not isinstance(act, str) or act not in ACT_CODE:
        raise ValueError(f"fused_bias_act: unknown act {act!r}; expected one of {', '.join(ACTIVATIONS)}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise TypeError(f"fused_bias_act: alpha must be a float, got {type(alpha).__name__}")
    if x.dim() < 1:
        raise ValueError("fused_bias_act: x must have at least one dimension (its last is cols)")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"fused_bias_act: bias has shape {tuple(bias.shape)}; expected ({x.shape[-1]},), "
                         "the length of x's last dimension")
    if bias.device != x.device:
        raise ValueError(f"fused_bias_act: bias is on {bias.device}, x on {x.device}")
    if y is not None:
        if not isinstance(y, torch.Tensor):
            raise TypeError("fused_bias_act: y must be a tensor or None")
        if y.dtype != x.dtype:
            raise TypeError(f"fused_bias_act: y dtype {y.dtype} differs from x dtype {x.dtype}")
        if y.shape != x.shape:
            raise ValueError(f"fused_bias_act: y has shape {tuple(y.shape)}, x {tuple(x.shape)}; they must match")
        if y.device != x.device:
            raise ValueError(f"fused_bias_act: y is on {y.device}, x on {x.device}")
    if inplace and not x.is_contiguous():
        raise ValueError("fused_bias_act: in place needs a contiguous x; call x.contiguous() "
                         "or use the out-of-place form")
    raise TypeError(f"fused_bias_act: invalid arguments (x {type(x).__name__}, bias {type(bias).__name__}, "
                    f"y {type(y).__name__}, alpha {alpha!r}, act {act!r})")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when b shares memory with a without being exactly a (unsafe to read while a is
    written): their byte ranges in one storage intersect. Empty and meta tensors hold no
    memory (their storages' pointers are all 0); disjoint views of one buffer (x.chunk(2),
    split rows) do not overlap, as PyTorch's own in-place ops judge them."""
    if a.numel() == 0 or b.numel() == 0 or a.is_meta or b.is_meta:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if b.data_ptr() == a.data_ptr() and b.shape == a.shape and b.stride() == a.stride():
        return False

    def span(t):  # [first, last] byte the view reaches
        last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) * t.element_size()
        return t.data_ptr(), t.data_ptr() + last + t.element_size() - 1

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 <= b1 and b0 <= a1
