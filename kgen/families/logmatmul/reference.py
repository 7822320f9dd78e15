"""logmatmul's math in PyTorch: the CPU path (float32) and the tests' oracle (float64).

out[b, n] = log sum_k w[n, k] * exp(x[b, k]), computed with each x row shifted by its own
maximum (a -inf maximum, an all -inf row, shifts by 0). An output is -inf when no term
survives (an all -inf row, a zero weight row, or weights only where x is -inf), NaN where the
sum is negative (negative weights: log of a negative number, as the kernels and the
expression log(exp(x - m) @ w.T) + m give) or NaN.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _shift(x: torch.Tensor) -> torch.Tensor:
    """Each row's maximum, 0 where it is -inf (then every exp is 0 and no NaN appears). A
    +inf or NaN maximum stays: the row's outputs are NaN, as the kernels give them."""
    m = x.amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_zeros(x.shape[:-1] + (1,))
    return torch.where(m == NEG_INF, torch.zeros((), dtype=x.dtype, device=x.device), m).detach()


def reference(x: torch.Tensor, w: torch.Tensor, compute=torch.float32) -> torch.Tensor:
    """out [B, N] in `compute` precision; differentiable through torch.autograd with the
    op's rule that an output of -inf contributes nothing to either gradient (the log and
    its division are taken only where the sum is positive)."""
    x, w = x.to(compute), w.to(compute)
    m = _shift(x)
    s = torch.exp(x - m) @ w.T
    dead = s == 0  # a negative sum is left to log: NaN
    one = torch.ones((), dtype=compute, device=x.device)
    out = torch.log(torch.where(dead, one, s)) + m
    return torch.where(dead, torch.full((), NEG_INF, dtype=compute, device=x.device), out)


def reference_for_transforms(x: torch.Tensor, w: torch.Tensor, compute=torch.float32) -> torch.Tensor:
    """reference(x, w) as torch.func transforms and forward-mode AD differentiate it: the
    float32 terms -- an exp that float32 flushes to 0 is 0 here too --, summed and logged in
    float64, returned in `compute`. In float32, a node whose terms all lie ~87-104 below the
    row maximum has a subnormal sum s, and autograd's 1/s overflows: its gradient came out inf
    and NaN (x = [0, -95, -100], w = [0, 1, 1]: [nan, inf, inf] against the op's [1, 0.993, 0.007])."""
    x32 = x.float()
    m = _shift(x32)
    d = x32 - m
    alive = torch.exp(d.detach()) != 0  # (a NaN stays alive: NaN in, NaN out)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    e = torch.where(alive, torch.exp(d.double()), zero)
    s = e @ w.double().T
    dead = s == 0
    out = torch.log(torch.where(dead, torch.ones_like(zero), s)) + m.double()
    return torch.where(dead, torch.full_like(zero, NEG_INF), out).to(compute)


def reference_backward(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, grad: torch.Tensor,
                       compute=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) written out, as the kernels compute them (the CPU path's backward: autograd
    does not run inside a custom op's implementation):
      dx[b, k] = sum_n g[b, n] w[n, k] exp(x[b, k] - out[b, n])
      dw[n, k] = sum_b g[b, n] exp(x[b, k] - out[b, n])
    with terms of an output that is -inf left out, and no term at an entry of x that is -inf
    (its dx is 0); an output that is NaN makes NaN every term it meets, as in the kernels --
    dw's at x = -inf too (exp(-inf - NaN), as autograd of the expression gives; the kernels'
    g 2^(m - out) is NaN before it meets e' = 0).
    Materialises [B, N, K]: use on small sizes only (the op's CPU path runs it in blocks of
    rows)."""
    xc, wc, oc, gc = x.to(compute), w.to(compute), out.to(compute), grad.to(compute)
    dx = torch.zeros(xc.shape, dtype=compute, device=xc.device)
    dw = torch.zeros(wc.shape, dtype=compute, device=xc.device)
    live = oc != NEG_INF
    gc = torch.where(live, gc, torch.zeros((), dtype=compute))
    oc = torch.where(live, oc, torch.zeros((), dtype=compute))
    for b in range(xc.shape[0]):
        e = torch.exp(xc[b][None, :] - oc[b][:, None])  # [N, K]
        # clamped to the largest finite value: a zero weight (or a zero upstream gradient)
        # times an exp that overflowed is 0, not NaN
        e = torch.where(live[b][:, None] & (xc[b] != NEG_INF)[None, :], torch.clamp(e, max=torch.finfo(compute).max),
                        torch.zeros((), dtype=compute))
        ge = gc[b][:, None] * e
        dw += torch.where(torch.isnan(oc[b])[:, None], float("nan"), ge)
        dx[b] = torch.where(xc[b] != NEG_INF, (wc * ge).sum(0), torch.zeros((), dtype=compute))  # not NaN x 0
    return dx.to(x.dtype), dw.to(w.dtype)


def _block_row(blocks, ptr: list, cols: list, r: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the K indices of block row r's child blocks, its weights [bs, their count x bs])."""
    lo, hi = ptr[r], ptr[r + 1]
    idx = torch.cat([torch.arange(c * bs, (c + 1) * bs, device=blocks.device) for c in cols[lo:hi]])
    return idx, blocks[lo:hi].permute(1, 0, 2).reshape(bs, -1)


def block_sparse_reference(x: torch.Tensor, blocks: torch.Tensor, row_ptr: torch.Tensor, col_idx: torch.Tensor,
                           block_size: int, compute=torch.float32, dense=reference) -> torch.Tensor:
    """out [B, N] of block-CSR weights (block_sparse_logmatmul's layout), block row by block
    row as the kernels compute it: each its own terms only, shifted by the largest x of its
    own child blocks, so a NaN in x reaches only the block rows whose children hold it, and
    an empty block row is -inf. Reads row_ptr's and col_idx's values: the CPU path, and on
    any device the op's composition (`dense=reference_for_transforms`)."""
    bs, ptr, cols = block_size, row_ptr.tolist(), col_idx.tolist()
    empty = torch.full((x.shape[0], bs), NEG_INF, dtype=compute, device=x.device)
    # (block rows joined, not written into a buffer: torch.func.vmap over x cannot write a
    # batched row into an unbatched buffer)
    def block_row(r):
        if not ptr[r] < ptr[r + 1]:
            return empty
        idx, w = _block_row(blocks, ptr, cols, r, bs)
        return dense(x[:, idx], w, compute)

    parts = [block_row(r) for r in range(len(ptr) - 1)]
    return torch.cat(parts, dim=1) if parts else empty[:, :0]


def block_sparse_reference_backward(x, blocks, row_ptr, col_idx, block_size: int, out, grad,
                                    compute=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dblocks) of block_sparse_reference's out for upstream `grad`: reference_backward
    per block row, dx summed over the block rows in `compute` precision."""
    bs, ptr, cols = block_size, row_ptr.tolist(), col_idx.tolist()
    dx = torch.zeros(x.shape, dtype=compute)
    db = torch.zeros(blocks.shape, dtype=compute)
    for r in range(len(ptr) - 1):
        lo, hi = ptr[r], ptr[r + 1]
        if lo == hi:
            continue
        idx, w = _block_row(blocks, ptr, cols, r, bs)
        cut = slice(r * bs, (r + 1) * bs)
        dx_r, dw_r = reference_backward(x[:, idx].to(compute), w.to(compute), out[:, cut], grad[:, cut], compute)
        dx[:, idx] += dx_r
        db[lo:hi] = dw_r.reshape(bs, hi - lo, bs).permute(1, 0, 2)
    return dx.to(x.dtype), db.to(blocks.dtype)
