"""int8_gemm's math in PyTorch: the op's path for CPU tensors (and a tuning candidate on
CUDA: torch._int_mm where it is allowed, the PyTorch W8A16 expression), and the tests'
oracle (`compute=torch.float64`).

An int8 x int8 product sums K terms of at most 2^14 in magnitude: exact in int64 (CPU) and
in float64 (below 2^53), and it fits int32 for K <= MAX_K (checks refuse larger K)."""

from __future__ import annotations

from typing import Optional

import torch

MAX_K = (2**31 - 1) // (128 * 128)  # 131071: K x (-128 x -128) still fits int32


def int_mm_allowed(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch._int_mm takes a [M, K] @ b[N, K].T on CUDA: M > 16 and K, N multiples
    of 8 (its documented requirements), both contiguous."""
    M, K = a.shape
    return a.is_cuda and M > 16 and K % 8 == 0 and b.shape[0] % 8 == 0 and a.is_contiguous() and b.is_contiguous()


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int32 a [M, K] @ b [N, K].T."""
    if a.shape[1] == 0:
        return torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32, device=a.device)
    if int_mm_allowed(a, b):
        return torch._int_mm(a, b.t())
    if a.is_cuda:  # float64 is exact here (|sum| < 2^31 < 2^53); CUDA has no integer matmul
        return (a.double() @ b.double().t()).to(torch.int32)
    return (a.long() @ b.long().t()).to(torch.int32)


def int8_linear(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, compute=torch.float32):
    """(a @ b.T) * scale_a[:, None] * scale_b[None, :] + bias, in `compute` precision, rounded
    once to out_dtype (compute=float64: the oracle, returned in float64)."""
    c = int8_mm(a, b).to(compute)
    c = c * scale_a.reshape(-1, 1).to(compute) * scale_b.reshape(1, -1).to(compute)
    if bias is not None:
        c = c + bias.to(compute)
    return c if compute == torch.float64 else c.to(out_dtype)


def dequantized(b: torch.Tensor, scale_b: torch.Tensor, group_size: Optional[int], dtype) -> torch.Tensor:
    """b [N, K] int8 times its per-channel [N] or per-group [N, K / group_size] scales."""
    if group_size is None:
        return b.to(dtype) * scale_b.reshape(-1, 1).to(dtype)
    return b.to(dtype) * scale_b.to(dtype).repeat_interleave(group_size, dim=1)


def w8a16_linear(x, b, scale_b, bias=None, group_size=None, compute=torch.float32):
    """x [M, K] @ dequantized(b).T + bias in `compute` precision (float64: the oracle,
    returned in float64), else rounded to x's dtype."""
    if group_size is None:  # scale after the product, as the kernels do
        c = (x.to(compute) @ b.to(compute).t()) * scale_b.reshape(1, -1).to(compute)
    else:  # each group's product, then its scale (as the kernels): a dequantised weight
        # overflows or makes 0 * inf = NaN where the kernels' sum is finite
        xc, bc, sc = x.to(compute), b.to(compute), scale_b.to(compute)
        c = xc.new_zeros(x.shape[0], b.shape[0])
        for g in range(b.shape[1] // group_size):
            k = slice(g * group_size, (g + 1) * group_size)
            c = c + (xc[:, k] @ bc[:, k].t()) * sc[:, g].reshape(1, -1)
    if bias is not None:
        c = c + bias.to(compute)
    return c if compute == torch.float64 else c.to(x.dtype)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (16-bit operands) as float32: cuBLAS's float32 result on CUDA (torch.mm's
    out_dtype), products of the widened operands elsewhere (exact: 16-bit products fit
    float32)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def w8a16_pytorch(x, b, scale_b, bias=None, group_size=None):
    """W8A16 by library GEMMs (the op's CUDA reference and a tuning candidate): the weight
    widened to x's dtype (int8 is exact in 16 bits), GEMMs with float32 results, the scales
    and bias in float32, one rounding to x's dtype, as the kernels round. Per channel one
    GEMM; per group one GEMM a group, each scaled and summed in float32. (Rounding the
    product, or the dequantised weight, to x's dtype first puts outputs near zero far
    outside the tolerance: 88-156x bf16's on an H200, BENCHMARKS.md twenty-second session.)"""
    wx = b.to(x.dtype)
    if group_size is None:
        c = _mm_f32(x, wx.t()) * scale_b.reshape(1, -1).float()
    else:
        c = None
        for g in range(b.shape[1] // group_size):
            k = slice(g * group_size, (g + 1) * group_size)
            part = _mm_f32(x[:, k], wx[:, k].t()) * scale_b[:, g].reshape(1, -1).float()
            c = part if c is None else c.add_(part)
    if bias is not None:
        c = c + bias.float()
    return c.to(x.dtype)
