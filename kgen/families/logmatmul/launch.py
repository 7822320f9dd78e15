"""logmatmul's kernel launches: the dense forward (Triton, or a CUDA variant's small-batch
kernel with its Triton companion), the fused backward, and the block-sparse forward and
backward. Inputs arrive checked and contiguous; every buffer comes from `_empty` (tests
poison it with NaN so an element a kernel never writes shows up).

Forward: see the Triton template's header. The CUDA small-batch kernel (B <= 16, 16-byte
aligned rows) writes its own (m, s) partials and merges them in a second launch of the
same library, on the caller's stream.

Backward: see the Triton template's header (per-row factors, then one pass over w that
reads it and writes dw; dx's chunk partials summed in order: no atomics, bit-identical run
to run).
"""

from __future__ import annotations

import torch

from kgen.families.logmatmul.plans import (
    REDUCE_BLOCK, STATS_BLOCK, block_b, bsl_tiles, bwd_chunks, bwd_rows, cdiv, k_split, pow2_at_least, sm_count)
from kgen.families.logmatmul.schema import cuda_max_b
from kgen.runtime.streams import current_raw_stream

_empty = torch.empty  # tests patch this to poison every buffer
MISSING = object()
class CudaForward:
    """A CUDA variant's forward with the Triton module that serves its backward and the
    inputs it cannot take (B above its max_b, rows not whole 16-byte vectors, unaligned
    bases)."""

    def __init__(self, kernel, triton_module):
        self.kernel, self.triton = kernel, triton_module
        self.name = kernel.name
        self.vec, self.nodes, self.warps = kernel.params["vec"], kernel.params["nodes"], kernel.params["warps"]
        self.waves = kernel.params["waves"]
        self.dtype = getattr(torch, kernel.variant.dtype)
        self.max_b = cuda_max_b(self.nodes, self.vec, kernel.params["unroll"], kernel.variant.dtype)
        self.DOT = "cuda"
        self._plans: dict = {}  # (B, N, K, w is float32, device) -> (splits, k_slice)

    def takes(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        B, K = x.shape
        key = (B, w.shape[0], K, x.dtype, w.dtype, x.device.index)
        plan = self._plans.get(key, MISSING)
        if plan is MISSING:
            plan = self._plan(key)
        return plan is not None and not (x.data_ptr() | w.data_ptr()) & 15

    def _plan(self, key, splits=None):
        """(splits, k_slice) for key = (B, N, K, x dtype, w dtype, device index), or None
        where the kernel does not take the shape or dtypes."""
        B, N, K, xt, wt, index = key
        w32 = wt is torch.float32
        plan = None
        if 1 <= B <= self.max_b and (K * (4 if w32 else 2)) % 16 == 0 and xt == self.dtype and (w32 or wt == xt):
            # a CTA's K slice is a whole number of threads x 16 bytes of w
            step = self.warps * 32 * (4 if w32 else 8)
            plan = k_split(1, N, K, 1, self.nodes, step, self.waves, sm_count(torch.device("cuda", index)), splits)
        if splits is None:
            if len(self._plans) > 4096:  # many shapes: keep the memo small, as op._BY_SHAPE does
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def run(self, x, w, out, B: int, N: int, K: int, splits=None) -> bool:
        """Launch into out and return True, or return False for inputs the kernel does not
        take (then the Triton companion runs). The plan is cached per shape: the host cost
        of small calls is mostly Python."""
        index = x.device.index
        key = (B, N, K, x.dtype, w.dtype, index)
        plan = self._plans.get(key, MISSING) if splits is None else MISSING
        if plan is MISSING:
            plan = self._plan(key, splits)
        xp, wp = x.data_ptr(), w.data_ptr()
        if plan is None or (xp | wp) & 15:
            return False
        splits, k_slice = plan
        if splits == 1:
            part_m = part_s = out  # unused
        else:
            part_m = _empty((splits, B), dtype=torch.float32, device=x.device)
            part_s = _empty((splits, B, N), dtype=torch.float32, device=x.device)
        k = self.kernel
        rc = k.raw(k.ptr, index, xp, wp, w.dtype is torch.float32, part_m.data_ptr(), part_s.data_ptr(),
                   out.data_ptr(), B, N, K, splits, k_slice, current_raw_stream(index))
        if rc:
            k.fail(rc)
        return True


def forward(mod, x: torch.Tensor, w: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """out [B, N] float32 of checked, contiguous x [B, K] and w [N, K]; `splits` forces the
    number of K splits (tests of split invariance)."""
    B, K = x.shape
    N = w.shape[0]
    out = _empty((B, N), dtype=torch.float32, device=x.device)
    if B == 0 or N == 0:
        return out
    if K == 0:
        return out.fill_(float("-inf"))
    if type(mod) is CudaForward:
        if mod.run(x, w, out, B, N, K, splits):
            return out
        mod = mod.triton
    bb = block_b(mod, B)
    splits, k_slice = k_split(B, N, K, bb, mod.BLOCK_N, mod.BLOCK_K, mod.WAVES, sm_count(x.device), splits)
    n_tiles = cdiv(N, mod.BLOCK_N)
    grid = (n_tiles * cdiv(B, bb) * splits,)
    direct = splits == 1
    part_m = out if direct else _empty((splits, B), dtype=torch.float32, device=x.device)
    part_s = out if direct else _empty((splits, B, N), dtype=torch.float32, device=x.device)
    pre = mod.DOT != "none"  # tl.dot forms: exp(x - m) once, then a plain tl.dot tile loop
    m = None
    if pre:
        e = _empty((B, K), dtype=torch.float32, device=x.device)
        m = _empty((B,), dtype=torch.float32, device=x.device)
        mod.logmatmul_exp_kernel[(B,)](x, e, m, K, BLOCK=REDUCE_BLOCK)
        x = e
    mod.logmatmul_fwd_kernel[grid](x, w, part_m, part_s, out, B, N, K, k_slice, n_tiles,
                                   DIRECT=direct, DOT=mod.DOT, BLOCK_B=bb, BLOCK_N=mod.BLOCK_N,
                                   BLOCK_K=mod.BLOCK_K, PRE=pre, m_ptr=m, num_warps=mod.NUM_WARPS,
                                   num_stages=mod.NUM_STAGES)
    if not direct:
        mod.logmatmul_combine_kernel[(cdiv(B * N, REDUCE_BLOCK),)](part_m, part_s, out, B, N, splits,
                                                                  BLOCK=REDUCE_BLOCK)
    return out


def backward(mod, x, w, out, grad, gemm: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw in w's dtype) from the saved out [B, N] and the upstream
    gradient [B, N] (float32), all contiguous: the passes of the Triton template's header.
    `gemm` forces the GEMM form on or off (default: B > the variant's bwd_b)."""
    if isinstance(mod, CudaForward):
        mod = mod.triton
    B, K = x.shape
    N = w.shape[0]
    dev = x.device
    if B == 0 or N == 0 or K == 0:
        return (torch.zeros((B, K), dtype=x.dtype, device=dev), torch.zeros((N, K), dtype=w.dtype, device=dev))
    f32 = torch.float32
    stats = _empty((B, 2), dtype=f32, device=dev)
    mod.logmatmul_bwd_stats_kernel[(B,)](x, out, stats, N, K, BLOCK=STATS_BLOCK, num_warps=8)
    if gemm if gemm is not None else B > mod.BWD_B:
        e = _empty((B, K), dtype=f32, device=dev)
        c = _empty((B, N), dtype=f32, device=dev)
        mod.logmatmul_bwd_factors_kernel[(B, cdiv(max(N, K), REDUCE_BLOCK))](x, out, grad, stats, e, c, N, K,
                                                                            BLOCK=REDUCE_BLOCK)
        # two GEMMs on the scaled factors (float32 unless the caller allowed TF32 matmuls)
        dx = torch.where(e > 0, e * (c @ w.to(f32)), 0.0).to(x.dtype)
        return dx, (c.T @ e).to(w.dtype)
    chunks, n_chunk = bwd_chunks(mod, N, K, sm_count(dev))
    dw = _empty((N, K), dtype=w.dtype, device=dev)
    dx = _empty((B, K), dtype=x.dtype, device=dev)
    direct = chunks == 1
    dxp = dx if direct else _empty((chunks, B, K), dtype=f32, device=dev)
    mod.logmatmul_bwd_kernel[(cdiv(K, mod.BWD_K), chunks)](x, w, out, grad, stats, dw, dxp, B, N, K, n_chunk,
                                                           BB=pow2_at_least(B), BN=mod.BWD_N, BK=mod.BWD_K,
                                                           DIRECT=direct, num_warps=mod.BWD_WARPS)
    if not direct:
        mod.logmatmul_dx_kernel[(cdiv(B * K, REDUCE_BLOCK),)](dxp, x, stats, dx, B, K, chunks, BLOCK=REDUCE_BLOCK)
    return dx, dw


# --------------------------------------------------------------------------- block-sparse


def bsl_forward(mod, x, blocks, row_ptr, col_idx, block_size: int) -> torch.Tensor:
    if isinstance(mod, CudaForward):
        mod = mod.triton
    B, K = x.shape
    N = (row_ptr.shape[0] - 1) * block_size
    out = _empty((B, N), dtype=torch.float32, device=x.device)
    if B == 0 or N == 0:
        return out
    bn, bk = bsl_tiles(mod, block_size)
    bb = block_b(mod, B)
    n_tiles = N // bn
    mod.bsl_fwd_kernel[(n_tiles * cdiv(B, bb),)](x, blocks, row_ptr, col_idx, out, B, N, K, n_tiles,
                                                BS=block_size, DOT=mod.DOT, BLOCK_B=bb, BLOCK_N=bn, BLOCK_K=bk,
                                                num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)
    return out


def block_rows(row_ptr: torch.Tensor, nnz: int) -> torch.Tensor:
    """The block row of each of the nnz blocks (no host wait: the output size is known)."""
    counts = (row_ptr[1:] - row_ptr[:-1]).long()
    rows = torch.arange(counts.shape[0], device=row_ptr.device)
    return torch.repeat_interleave(rows, counts, output_size=nnz)


def column_order(col_idx: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, col_ptr): the blocks sorted stably by column block, and where each column
    block's run starts (no host wait)."""
    order = torch.sort(col_idx.long(), stable=True)
    col_ptr = torch.searchsorted(order.values, torch.arange(columns + 1, device=col_idx.device))
    return order.indices, col_ptr


def bsl_backward(mod, x, blocks, row_ptr, col_idx, block_size: int, out, grad):
    """(dx in x's dtype, dblocks in blocks' dtype)."""
    if isinstance(mod, CudaForward):
        mod = mod.triton
    B, K = x.shape
    bs = block_size
    nnz = blocks.shape[0]
    N = (row_ptr.shape[0] - 1) * bs
    dev = x.device
    dx = _empty((B, K), dtype=x.dtype, device=dev)
    dblocks = _empty(blocks.shape, dtype=blocks.dtype, device=dev)
    if B == 0 or nnz == 0 or K == 0:
        return dx.zero_(), dblocks.zero_()
    bn, bk = min(mod.BWD_N, bs), min(mod.BWD_K, bs)
    nn = bs // bn
    dxp = _empty((nnz * nn, B, bs), dtype=torch.float32, device=dev)
    rows = block_rows(row_ptr, nnz)
    mod.bsl_bwd_kernel[(nnz * nn * (bs // bk),)](x, blocks, rows, col_idx, out, grad, dblocks, dxp, B, N, K,
                                                BS=bs, BB=bwd_rows(mod, B), BN=bn, BK=bk, num_warps=mod.BWD_WARPS)
    perm, col_ptr = column_order(col_idx, K // bs)
    mod.bsl_dx_reduce_kernel[(K // bs, cdiv(B * bs, REDUCE_BLOCK))](dxp, perm, col_ptr, dx, B, K, BS=bs, NN=nn,
                                                                     BLOCK=REDUCE_BLOCK)
    return dx, dblocks
