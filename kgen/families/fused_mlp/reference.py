"""fused_mlp's math in PyTorch: the activations and their derivatives, the eager
composition (the op's fallback and a tuning candidate), the float64 oracle the tests use,
and the backward through per-layer GEMMs that every path shares."""

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
    if name == "relu":
        return (z > 0).to(z.dtype)
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


def layer_act(i: int, n_layers: int, activation: str, last_activation: str) -> str:
    return last_activation if i == n_layers - 1 else activation


def eager(x, weights, biases, activation: str, last_activation: str, save: bool = False):
    """The eager composition in x's dtype: F.linear (float32 accumulation, one rounding)
    then the activation (float32 inside, one rounding), layer by layer. Returns (out, zs)
    with zs the pre-activations the backward needs when `save` (else [])."""
    h, zs, L = x, [], len(weights)
    for i, (w, b) in enumerate(zip(weights, biases)):
        z = F.linear(h, w, b)
        a = layer_act(i, L, activation, last_activation)
        if save:
            zs.append(z)
        h = act(z, a) if a != "none" else z
    return h, zs


def reference(x, weights, biases, activation: str = "relu", last_activation: str = "none",
              compute=torch.float64) -> torch.Tensor:
    """The oracle: every layer in `compute` precision with no rounding between layers."""
    h, L = x.to(compute), len(weights)
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = F.linear(h, w.to(compute), None if b is None else b.to(compute))
        h = act(h, layer_act(i, L, activation, last_activation))
    return h


def backward(grad, x, weights, biases, zs, activation: str, last_activation: str, need_x: bool = True):
    """(grad_x or None, [grad_w], [grad_b or None]) from the saved pre-activations `zs`
    (zs[i] for every layer but the last, and the last's when last_activation is not none;
    rounded to x's dtype as the forward rounded them). 2-D x and grad. Each layer: dz =
    grad * act'(z) in float32, rounded to the dtype; grad_w = dz.T @ h (torch.mm, float32
    accumulation); grad_b = the float32 column sum of dz; grad_h = dz @ W. h, the layer's
    input, is recomputed as act(z) of the layer before, rounded as the forward rounded it.
    Deterministic: no atomics (cuBLAS GEMMs and a reduction)."""
    L = len(weights)
    gws, gbs = [None] * L, [None] * L
    g = grad
    for i in range(L - 1, -1, -1):
        a = layer_act(i, L, activation, last_activation)
        dz = g if a == "none" else (g.float() * dact(zs[i].float(), a)).to(grad.dtype)
        if i > 0:
            h = act(zs[i - 1], activation) if activation != "none" else zs[i - 1]
        else:
            h = x
        gws[i] = dz.t().mm(h)
        if biases[i] is not None:
            gbs[i] = dz.sum(0, dtype=torch.float32).to(dz.dtype)
        if i > 0 or need_x:
            g = dz.mm(weights[i])
    return (g if need_x else None), gws, gbs
