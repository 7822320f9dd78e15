"""fused_bias_act's math in PyTorch: the CPU path, the backward and the float64 oracle."""

from __future__ import annotations

import torch

from kgen.families._activations import act as _act, dact as _dact


def _preact(x, bias, y, alpha, dtype):
    z = x.to(dtype) + bias.to(dtype)
    if y is not None:
        z = z + alpha * y.to(dtype)
    return z


def reference(x, bias, y=None, alpha: float = 1.0, act: str = "none", compute=torch.float32):
    """The math in `compute` precision (float32: the CPU path; float64: the test oracle)."""
    return _act(_preact(x, bias, y, alpha, compute), act)
