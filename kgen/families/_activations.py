"""The activations kgen's families share (none, relu, sigmoid, gelu in its tanh form, silu)
and their derivatives, in PyTorch: the references and backwards of fused_bias_act and
fused_mlp. The kernels compute the same formulas in their templates."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def act(z: torch.Tensor, name: str) -> torch.Tensor:
    if name == "relu":
        return torch.relu(z)
    if name == "sigmoid":
        return torch.sigmoid(z)
    if name == "gelu":
        return F.gelu(z, approximate="tanh")
    if name == "silu":
        return F.silu(z)
    return z


def dact(z: torch.Tensor, name: str) -> torch.Tensor:
    """d act(z) / dz, in z's dtype (the backward passes float32)."""
    if name == "relu":  # torch's threshold_backward: 0 where z <= 0, else 1 (a NaN z passes the gradient)
        return (~(z <= 0)).to(z.dtype)
    if name == "sigmoid":
        s = torch.sigmoid(z)
        return s * (1 - s)
    if name == "gelu":
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        s = torch.sigmoid(2 * k * (z + c * z ** 3))
        return s + z * 2 * s * (1 - s) * k * (1 + 3 * c * z * z)
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    return torch.ones_like(z)
