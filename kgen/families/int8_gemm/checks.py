"""int8_gemm's input checks: every input a launch could not take raises TypeError /
ValueError here, before any launch. Leading batch dims of a / x are allowed (flattened, as
in F.linear); layout (contiguity, alignment) is never an error: the op copies what is not
contiguous, and the launcher routes what the CUDA kernels cannot take to Triton."""

from __future__ import annotations

import operator

import torch

from kgen.families.int8_gemm.reference import MAX_K

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
X_DTYPES = (torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _tensor(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")


def _operands(op: str, aname: str, a, b) -> tuple[int, int, int]:
    """Common to the three ops: a [..., K], b int8 [N, K] on one device. Returns (M, N, K)."""
    _tensor(op, aname, a)
    _tensor(op, "b", b)
    if b.dtype != torch.int8:
        raise TypeError(f"{op}: b has dtype {b.dtype}; expected torch.int8 (the quantized weight, [N, K])")
    if a.dim() < 1:
        raise ValueError(f"{op}: {aname} must have at least one dimension (its last is K)")
    if b.dim() != 2:
        raise ValueError(f"{op}: b has shape {tuple(b.shape)}; expected 2-D [N, K] (nn.Linear's weight layout)")
    K = a.shape[-1]
    if b.shape[1] != K:
        raise ValueError(f"{op}: {aname} has K={K} (last dimension) but b is {tuple(b.shape)}; "
                         "b must be [N, K]")
    if a.device != b.device:
        raise ValueError(f"{op}: {aname} is on {a.device}, b on {b.device}")
    if K > MAX_K:
        raise ValueError(f"{op}: K={K} is above {MAX_K}, where an int8 x int8 sum can overflow int32")
    M = a.numel() // K if K else int(torch.Size(a.shape[:-1]).numel())
    return M, b.shape[0], K


def _vector(op: str, name: str, t, n: int, what: str, dtypes, device) -> None:
    _tensor(op, name, t)
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {' or '.join(map(str, dict.fromkeys(dtypes)))}")
    if t.numel() != n:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}; expected {n} values ({what})")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, the operands on {device}")


def two_d(op: str, name: str, a) -> None:
    """The registered ops (torch.ops.kgen.<op>) take a 2-D `name`; kgen.ops.<op> flattens
    leading dims before calling them."""
    if isinstance(a, torch.Tensor) and a.dim() != 2:
        raise ValueError(f"torch.ops.kgen.{op}: {name} has shape {tuple(a.shape)}; the registered op takes a "
                         f"2-D {name} [M, K] (kgen.ops.{op} takes [..., K])")


def group_size_arg(group_size):
    """w8a16_linear's group_size as a Python int (any integer type: numpy's too), or None;
    TypeError for anything else (bool, float, str)."""
    if group_size is None or type(group_size) is int:
        return group_size
    if not isinstance(group_size, bool):
        try:
            return operator.index(group_size)
        except TypeError:
            pass
    raise TypeError(f"w8a16_linear: group_size must be an int or None, got {type(group_size).__name__}")


def check_int8_mm(a, b) -> tuple[int, int, int]:
    _tensor("int8_mm", "a", a)
    if a.dtype != torch.int8:
        raise TypeError(f"int8_mm: a has dtype {a.dtype}; expected torch.int8")
    return _operands("int8_mm", "a", a, b)


def check_int8_linear(a, b, scale_a, scale_b, bias, out_dtype) -> tuple[int, int, int]:
    op = "int8_linear"
    _tensor(op, "a", a)
    if a.dtype != torch.int8:
        raise TypeError(f"{op}: a has dtype {a.dtype}; expected torch.int8")
    M, N, K = _operands(op, "a", a, b)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype {out_dtype} is not one of bfloat16, float16, float32")
    _vector(op, "scale_a", scale_a, M, "one float32 scale per row of a", (torch.float32,), a.device)
    _vector(op, "scale_b", scale_b, N, "one float32 scale per row of b", (torch.float32,), a.device)
    if bias is not None:
        _vector(op, "bias", bias, N, "one per output column", (torch.float32, out_dtype), a.device)
    return M, N, K


def check_w8a16_linear(x, b, scale_b, bias, group_size) -> tuple[int, int, int]:
    op = "w8a16_linear"
    _tensor(op, "x", x)
    if x.dtype not in X_DTYPES:
        raise TypeError(f"{op}: x has dtype {x.dtype}; expected torch.bfloat16 or torch.float16")
    M, N, K = _operands(op, "x", x, b)
    if group_size is None:
        _vector(op, "scale_b", scale_b, N, "one scale per row of b", SCALE_DTYPES, x.device)
    else:
        if isinstance(group_size, bool) or not isinstance(group_size, (int, torch.SymInt)):  # (SymInt: compile)
            raise TypeError(f"{op}: group_size must be an int or None, got {type(group_size).__name__}")
        if group_size <= 0 or group_size % 16 or K % group_size:
            raise ValueError(f"{op}: group_size={group_size} must be a positive multiple of 16 that divides "
                             f"K={K}")
        _tensor(op, "scale_b", scale_b)
        if scale_b.dtype not in SCALE_DTYPES:
            raise TypeError(f"{op}: scale_b has dtype {scale_b.dtype}; expected float32, bfloat16 or float16")
        if tuple(scale_b.shape) != (N, K // group_size):
            raise ValueError(f"{op}: scale_b has shape {tuple(scale_b.shape)}; with group_size={group_size} "
                             f"expected ({N}, {K // group_size}): one scale per row of b and group of K")
        if scale_b.device != x.device:
            raise ValueError(f"{op}: scale_b is on {scale_b.device}, x on {x.device}")
    if bias is not None:
        _vector(op, "bias", bias, N, "one per output column", (torch.float32, x.dtype), x.device)
    return M, N, K
