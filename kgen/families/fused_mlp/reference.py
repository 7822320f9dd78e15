"""fused_mlp's math in PyTorch: the activations and their derivatives (from
kgen.families._activations, shared with fused_bias_act), the eager composition (the op's
fallback and a tuning candidate), the float64 oracle the tests use,
and the backward through per-layer GEMMs: `backward` (the general path's, op by op as
stated; with KGEN_FUSED_MLP_FAST_TRAIN=0) and `backward_lean` (the same math in fewer torch
calls: train.gradients' where the fused backward does not serve)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kgen.families._activations import act, dact


def layer_act(i: int, n_layers: int, activation: str, last_activation: str) -> str:
    return last_activation if i == n_layers - 1 else activation


def eager(x, weights, biases, activation: str, last_activation: str, save: bool = False):
    """The eager composition in x's dtype: F.linear (float32 accumulation, one rounding)
    then the activation (float32 inside, one rounding), layer by layer. Returns (out, zs)
    with zs what the backward needs when `save` (else []): each layer's pre-activation z,
    but a ReLU layer's output relu(z) (as eager autograd keeps it), which every backward
    here takes in z's place (relu(relu(z)) = relu(z), and relu(z) <= 0 exactly where z <= 0)
    and backward_lean (`outputs`) uses as the next layer's input without recomputing it."""
    h, zs, L = x, [], len(weights)
    for i, (w, b) in enumerate(zip(weights, biases)):
        z = F.linear(h, w, b)
        a = layer_act(i, L, activation, last_activation)
        h = act(z, a) if a != "none" else z
        if save:
            zs.append(h if a == "relu" else z)
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


_aten = torch.ops.aten
_threshold_backward = _aten.threshold_backward.default
_gelu_backward = _aten.gelu_backward.default
_silu_backward = _aten.silu_backward.default
_sigmoid_backward = _aten.sigmoid_backward.default


def dz_lean(g: torch.Tensor, z: torch.Tensor, name: str) -> torch.Tensor:
    """grad * act'(z) in g's dtype in one or few torch calls: PyTorch's own activation
    backward kernels take 16-bit g and z, compute in float32 and round once, as `backward`
    does op by op (relu: 0 where z <= 0, else g, exactly; sigmoid: from sigmoid(z) in float32,
    not from the rounded output eager autograd uses)."""
    if name == "relu":
        return _threshold_backward(g, z, 0)
    if name == "gelu":
        return _gelu_backward(g, z, approximate="tanh")
    if name == "silu":
        return _silu_backward(g, z)
    if name == "sigmoid":
        d = _sigmoid_backward(g, torch.sigmoid(z.float()))  # float32: g promoted
        return d if d.dtype == g.dtype else d.to(g.dtype)
    return g


def backward_lean(grad, x, weights, has_bias, zs, activation: str, last_activation: str, needs,
                  outputs: bool = False):
    """`backward`'s gradients with fewer torch calls (per layer: the activation's backward,
    its input h = act(z) of the layer before, dz.T @ h, dz's column sum, dz @ W; 4 to 5
    calls for ReLU) and only those asked for: `needs` = (x, weight per layer, bias per
    layer) booleans. Returns (grad_x or None, [grad_w or None], [grad_b or None]); 2-D x and
    grad. The bias gradient is dz.sum(0): PyTorch sums 16-bit tensors in float32 and rounds
    once, as `backward`'s explicit float32 sum. `outputs`: a hidden ReLU layer's entry is its
    output relu(z), as `eager(save=True)` and a kernel's forward with `save` keep it, so h
    is that entry itself (without: relu(z) is recomputed, one pass over B x width a layer)."""
    L = len(weights)
    need_x, need_w, need_b = needs[0], needs[1:1 + L], needs[1 + L:]
    lowest = 0 if need_x else min((i for i in range(L) if need_w[i] or (has_bias[i] and need_b[i])), default=L)
    gws, gbs = [None] * L, [None] * L
    g = grad
    for i in range(L - 1, lowest - 1, -1):
        a = last_activation if i == L - 1 else activation
        dz = dz_lean(g, zs[i], a) if a != "none" else g
        if need_w[i]:
            if i == 0:
                h = x
            elif activation == "none" or (outputs and activation == "relu"):
                h = zs[i - 1]
            else:
                h = act(zs[i - 1], activation)
            gws[i] = torch.mm(dz.t(), h)
        if has_bias[i] and need_b[i]:
            gbs[i] = dz.sum(0)
        if i > lowest or (i == 0 and need_x):
            g = torch.mm(dz, weights[i])
    return (g if need_x else None), gws, gbs
