"""fused_bias_act's math in PyTorch: the CPU path, the backward and the float64 oracle."""

from __future__ import annotations

import math

import torch


def _act(z: torch.Tensor, act: str) -> torch.Tensor:
    if act == "relu":
        return torch.relu(z)
    if act == "sigmoid":
        return torch.sigmoid(z)
    if act == "gelu":
        return torch.nn.functional.gelu(z, approximate="tanh")
    if act == "silu":
        return torch.nn.functional.silu(z)
    return z


def _dact(z: torch.Tensor, act: str) -> torch.Tensor:
    """d act(z) / dz."""
    if act == "relu":
        return (z > 0).to(z.dtype)
    if act == "sigmoid":
        s = torch.sigmoid(z)
        return s * (1 - s)
    if act == "gelu":
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        s = torch.sigmoid(2 * k * (z + c * z**3))
        return s + z * 2 * s * (1 - s) * k * (1 + 3 * c * z * z)
    if act == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    return torch.ones_like(z)


def _preact(x, bias, y, alpha, dtype):
    z = x.to(dtype) + bias.to(dtype)
    if y is not None:
        z = z + alpha * y.to(dtype)
    return z


def reference(x, bias, y=None, alpha: float = 1.0, act: str = "none", compute=torch.float32):
    """The math in `compute` precision (float32: the CPU path; float64: the test oracle)."""
    return _act(_preact(x, bias, y, alpha, compute), act)
