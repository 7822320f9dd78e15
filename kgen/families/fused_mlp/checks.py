"""fused_mlp's argument checks: every input a launch could not take raises TypeError or
ValueError here, before any launch."""

from __future__ import annotations

import torch

from kgen.families.fused_mlp.schema import ACT_CODE, ACTIVATIONS, MAX_LAYERS, MAX_WIDTH

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_inputs(x, weights, biases, activation, last_activation) -> tuple[int, ...]:
    """Validate and return the widths (w0, ..., wL). `biases`: one entry per layer, a
    tensor or None."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fused_mlp: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"fused_mlp: x has dtype {x.dtype}; supported: float32, bfloat16, float16")
    if x.dim() < 1:
        raise ValueError("fused_mlp: x must have at least one dimension (its last is the input width)")
    if not isinstance(weights, (list, tuple)) or not all(isinstance(w, torch.Tensor) for w in weights):
        raise TypeError("fused_mlp: weights must be a list of tensors")
    if not isinstance(biases, (list, tuple)) or not all(b is None or isinstance(b, torch.Tensor) for b in biases):
        raise TypeError("fused_mlp: biases must be a list of tensors or None")
    L = len(weights)
    if not 1 <= L <= MAX_LAYERS:
        raise ValueError(f"fused_mlp: {L} layers; 1 to {MAX_LAYERS} are supported")
    if len(biases) != L:
        raise ValueError(f"fused_mlp: {len(biases)} biases for {L} weights; give one per layer (None for none)")
    for name, a in (("activation", activation), ("last_activation", last_activation)):
        if not isinstance(a, str) or a not in ACT_CODE:
            raise ValueError(f"fused_mlp: unknown {name} {a!r}; expected one of {', '.join(ACTIVATIONS)}")
    for name, t in (("x", x), *((f"weights[{i}]", w) for i, w in enumerate(weights)),
                    *((f"biases[{i}]", b) for i, b in enumerate(biases) if b is not None)):
        if t.layout != torch.strided:  # (sparse: the kernels read strided memory; eager failed deep inside)
            raise TypeError(f"fused_mlp: {name} has layout {t.layout}; dense (torch.strided) tensors are supported")
    widths = [x.shape[-1]]
    dt, dev = x.dtype, x.device
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or w.shape[1] != widths[-1]:
            raise ValueError(f"fused_mlp: weights[{i}] has shape {tuple(w.shape)}; expected [out, {widths[-1]}] "
                             "(nn.Linear's layout, in = the previous width)")
        if w.dtype != dt:
            raise TypeError(f"fused_mlp: weights[{i}] dtype {w.dtype} differs from x dtype {dt}")
        if w.device != dev:
            raise ValueError(f"fused_mlp: weights[{i}] is on {w.device}, x on {dev}")
        if b is not None:
            if b.shape != w.shape[:1]:
                raise ValueError(f"fused_mlp: biases[{i}] has shape {tuple(b.shape)}; expected ({w.shape[0]},)")
            if b.dtype != dt:
                raise TypeError(f"fused_mlp: biases[{i}] dtype {b.dtype} differs from x dtype {dt}")
            if b.device != dev:
                raise ValueError(f"fused_mlp: biases[{i}] is on {b.device}, x on {dev}")
        widths.append(w.shape[0])
    for w in widths:
        if not 1 <= w <= MAX_WIDTH:
            raise ValueError(f"fused_mlp: width {w} outside 1..{MAX_WIDTH} (widths {widths})")
    return tuple(widths)
