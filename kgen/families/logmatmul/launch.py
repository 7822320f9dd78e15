"""logmatmul's kernel launches: the dense forward (Triton, or a CUDA variant's small-batch
kernel with its Triton companion), the fused backward, and the block-sparse forward and
backward. Inputs arrive checked and contiguous; every buffer comes from `_empty` (tests
poison it with NaN so an element a kernel never writes shows up).

Forward: see the Triton template's header. The CUDA small-batch kernel (B <= 16, 16-byte
aligned rows) writes its own (m, s) partials and merges them in a second launch of the
same library, on the caller's stream.

Backward (one pass over w for both flows): logmatmul_bwd_kernel writes dw tile by tile
and each n tile's share of dx into a float32 [n tiles, B, K] buffer, which
logmatmul_dx_reduce_kernel sums in order (no atomics: bit-identical run to run).
"""

from __future__ import annotations

import torch

from kgen.families.logmatmul.plans import (
    REDUCE_BLOCK, block_b, bsl_tiles, bwd_rows, cdiv, k_split, sm_count)
from kgen.families.logmatmul.schema import cuda_max_b
from kgen.runtime.streams import current_raw_stream

_empty = torch.empty  # tests patch this to poison every buffer
# CUDA forward: B x node groups up to which each CTA takes its own row maximum.
FUSED_MAX_ROWS = 512


class CudaForward:
    """A CUDA variant's forward with the Triton module that serves its backward and the
    inputs it cannot take (B > 16, rows not whole 16-byte vectors, unaligned bases)."""

    def __init__(self, kernel, triton_module):
        self.kernel, self.triton = kernel, triton_module
        self.name = kernel.name
        self.vec, self.nodes, self.warps = kernel.params["vec"], kernel.params["nodes"], kernel.params["warps"]
        self.waves = kernel.params["waves"]
        self.dtype = getattr(torch, kernel.variant.dtype)
        self.max_b = cuda_max_b(self.nodes)
        self.DOT = "cuda"

    def takes(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        B, K = x.shape
        wbytes = w.element_size()
        return (1 <= B <= self.max_b and (K * wbytes) % 16 == 0 and w.data_ptr() % 16 == 0
                and x.dtype == self.dtype and w.dtype in (torch.float32, x.dtype))

    def forward(self, x, w, out, splits=None):
        B, K = x.shape
        N = w.shape[0]
        dev = x.device
        # a CTA's K slice is a whole number of warps x 32 lanes x vec elements
        step = self.warps * 32 * (16 // w.element_size())
        splits, k_slice = k_split(1, N, K, 1, self.nodes, step, self.waves, sm_count(dev), splits)
        # each CTA takes its slice's row maximum itself when re-reading x per node group is
        # cheap (one launch fewer: the host cost of small calls), else one launch does
        fused = B * cdiv(N, self.nodes) <= FUSED_MAX_ROWS
        direct = splits == 1
        part_m = out if fused and direct else _empty((splits, B), dtype=torch.float32, device=dev)
        part_s = out if direct else _empty((splits, B, N), dtype=torch.float32, device=dev)
        k = self.kernel
        rc = k.raw(k.ptr, dev.index, x.data_ptr(), w.data_ptr(), w.dtype is torch.float32,
                   part_m.data_ptr(), part_s.data_ptr(), out.data_ptr(), B, N, K, splits, k_slice, fused,
                   current_raw_stream(dev.index))
        if rc:
            k.fail(rc)
        return out


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
    if isinstance(mod, CudaForward):
        if mod.takes(x, w):
            return mod.forward(x, w, out, splits)
        mod = mod.triton
    bb = block_b(mod, B)
    splits, k_slice = k_split(B, N, K, bb, mod.BLOCK_N, mod.BLOCK_K, mod.WAVES, sm_count(x.device), splits)
    n_tiles = cdiv(N, mod.BLOCK_N)
    grid = (n_tiles * cdiv(B, bb) * splits,)
    direct = splits == 1
    part_m = out if direct else _empty((splits, B), dtype=torch.float32, device=x.device)
    part_s = out if direct else _empty((splits, B, N), dtype=torch.float32, device=x.device)
    mod.logmatmul_fwd_kernel[grid](x, w, part_m, part_s, out, B, N, K, k_slice, n_tiles,
                                   DIRECT=direct, DOT=mod.DOT, BLOCK_B=bb, BLOCK_N=mod.BLOCK_N,
                                   BLOCK_K=mod.BLOCK_K, num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)
    if not direct:
        mod.logmatmul_combine_kernel[(cdiv(B * N, REDUCE_BLOCK),)](part_m, part_s, out, B, N, splits,
                                                                  BLOCK=REDUCE_BLOCK)
    return out


def backward(mod, x, w, out, grad) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw in w's dtype) from the saved out [B, N] and the upstream
    gradient [B, N] (float32), all contiguous."""
    if isinstance(mod, CudaForward):
        mod = mod.triton
    B, K = x.shape
    N = w.shape[0]
    dev = x.device
    dx = _empty((B, K), dtype=x.dtype, device=dev)
    dw = _empty((N, K), dtype=w.dtype, device=dev)
    if B == 0 or N == 0 or K == 0:
        return dx.zero_(), dw.zero_()
    n_tiles, k_tiles = cdiv(N, mod.BWD_N), cdiv(K, mod.BWD_K)
    dxp = _empty((n_tiles, B, K), dtype=torch.float32, device=dev)
    mod.logmatmul_bwd_kernel[(n_tiles * k_tiles,)](x, w, out, grad, dw, dxp, B, N, K, k_tiles,
                                                   BB=bwd_rows(mod, B), BN=mod.BWD_N, BK=mod.BWD_K,
                                                   num_warps=mod.BWD_WARPS)
    mod.logmatmul_dx_reduce_kernel[(cdiv(B * K, REDUCE_BLOCK),)](dxp, dx, B * K, n_tiles, BLOCK=REDUCE_BLOCK)
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
