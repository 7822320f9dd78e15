"""logmatmul's math in PyTorch: the CPU path (float32) and the tests' oracle (float64).

out[b, n] = log sum_k w[n, k] * exp(x[b, k]), computed with each x row shifted by its own
maximum (a -inf maximum, an all -inf row, shifts by 0). An output is -inf when no term
survives (an all -inf row, a zero weight row, or weights only where x is -inf).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _shift(x: torch.Tensor) -> torch.Tensor:
    """Each row's maximum, 0 where it is -inf (then every exp is 0 and no NaN appears)."""
    m = x.amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_zeros(x.shape[:-1] + (1,))
    return torch.where(torch.isfinite(m), m, torch.zeros((), dtype=x.dtype, device=x.device)).detach()


def reference(x: torch.Tensor, w: torch.Tensor, compute=torch.float32) -> torch.Tensor:
    """out [B, N] in `compute` precision; differentiable through torch.autograd with the
    op's rule that an output of -inf contributes nothing to either gradient (the log and
    its division are taken only where the sum is positive)."""
    x, w = x.to(compute), w.to(compute)
    m = _shift(x)
    s = torch.exp(x - m) @ w.T
    dead = s <= 0
    one = torch.ones((), dtype=compute, device=x.device)
    out = torch.log(torch.where(dead, one, s)) + m
    return torch.where(dead, torch.full((), NEG_INF, dtype=compute, device=x.device), out)


def reference_backward(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, grad: torch.Tensor,
                       compute=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) written out, as the kernels compute them (the CPU path's backward: autograd
    does not run inside a custom op's implementation):
      dx[b, k] = sum_n g[b, n] w[n, k] exp(x[b, k] - out[b, n])
      dw[n, k] = sum_b g[b, n] exp(x[b, k] - out[b, n])
    with terms of an output that is -inf left out. Materialises [B, N, K]: use on small
    sizes only (the op's CPU path runs it in blocks of rows)."""
    xc, wc, oc, gc = x.to(compute), w.to(compute), out.to(compute), grad.to(compute)
    dx = torch.zeros(xc.shape, dtype=compute, device=xc.device)
    dw = torch.zeros(wc.shape, dtype=compute, device=xc.device)
    live = torch.isfinite(oc)
    gc = torch.where(live, gc, torch.zeros((), dtype=compute))
    oc = torch.where(live, oc, torch.zeros((), dtype=compute))
    for b in range(xc.shape[0]):
        e = torch.exp(xc[b][None, :] - oc[b][:, None])  # [N, K]
        # clamped to the largest finite value: a zero weight (or a zero upstream gradient)
        # times an exp that overflowed is 0, not NaN
        e = torch.where(live[b][:, None], torch.clamp(e, max=torch.finfo(compute).max),
                        torch.zeros((), dtype=compute))
        ge = gc[b][:, None] * e
        dw += ge
        dx[b] = (wc * ge).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)
