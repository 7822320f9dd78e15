"""logmatmul's backward launches. Inputs arrive checked and contiguous; every buffer comes
from `launch._empty` (tests poison it).

Dense: a CUDA variant's library backward where it applies (`launch.CudaForward.backward`,
CUDA_BACKWARD), else its Triton companion's passes (the Triton template's header): per-row
factors, then one pass over w that reads it and writes dw, dx's chunk partials summed in
order (no atomics: bit-identical run to run); past the module's BWD_B, the GEMM form (two
GEMMs on the factors, its dx epilogue the partials-sum launch with c' w as its one part).
`backward_direct` binds all of it to one call signature for the op: plan fixed, buffers
from prototypes, Triton launches replayed.

Block-sparse: per nonzero block's tile (exp(x - out) per element), then dx's partials
summed per column block in order.
"""

from __future__ import annotations

import torch

from kgen.families.logmatmul import launch as _launch
from kgen.families.logmatmul.launch import Allocs, CudaForward, block_rows
from kgen.families.logmatmul.plans import REDUCE_BLOCK, STATS_BLOCK, bwd_chunks, bwd_rows, cdiv, pow2_at_least, sm_count
from kgen.runtime import triton_launch
from kgen.runtime.op import stride_align


def backward(mod, x, w, out, grad, gemm: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw in w's dtype) from the saved out [B, N] and the upstream
    gradient [B, N] (float32), all contiguous: the passes of the Triton template's header.
    `gemm` forces the GEMM form on or off (default: B > the variant's bwd_b). With
    launch.CUDA_BACKWARD a CUDA variant runs its library's backward where that applies (`gemm` unset)."""
    if isinstance(mod, CudaForward):
        got = mod.backward(x, w, out, grad) if gemm is None and _launch.CUDA_BACKWARD else None
        if got is not None:
            return got
        mod = mod.triton
    B, K = x.shape
    N = w.shape[0]
    dev = x.device
    if B == 0 or N == 0 or K == 0:
        return (torch.zeros((B, K), dtype=x.dtype, device=dev), torch.zeros((N, K), dtype=w.dtype, device=dev))
    plan = _bwd_plan(mod, B, N, K, dev, gemm)
    f32 = torch.float32
    stats = _launch._empty((B, 2), dtype=f32, device=dev)
    if plan[0]:  # the GEMM form
        e, c = _launch._empty((B, K), dtype=f32, device=dev), _launch._empty((B, N), dtype=f32, device=dev)
        for step in _gemm_factors(mod, x, out, grad, stats, e, c):
            triton_launch.launch(*step)
        cw = c @ (w if w.dtype is f32 else w.to(f32))
        dx = _launch._empty((B, K), dtype=x.dtype, device=dev)
        triton_launch.launch(*_dx_step(mod, cw, x, stats, dx, 1))
        return dx, _gemm_dw(c, e, w.dtype)
    chunks = plan[1]
    dw = _launch._empty((N, K), dtype=w.dtype, device=dev)
    dx = _launch._empty((B, K), dtype=x.dtype, device=dev)
    dxp = _launch._empty((chunks, B, K), dtype=f32, device=dev) if chunks > 1 else None
    for step in _fused_steps(mod, x, w, out, grad, stats, dw, dx, dxp, plan):
        triton_launch.launch(*step)
    return dx, dw


def _bwd_plan(mod, B: int, N: int, K: int, device, gemm: bool | None = None) -> tuple[bool, int, int]:
    """(the GEMM form, chunks of N, rows per chunk) of the Triton module's backward: the GEMM
    form past the module's BWD_B (or as forced), else the one-pass kernel over bwd_chunks."""
    if B > mod.BWD_B if gemm is None else gemm:
        return True, 1, N
    return (False, *bwd_chunks(mod, N, K, sm_count(device)))


def _gemm_factors(mod, x, out, grad, stats, e, c) -> list[tuple]:
    """The GEMM form's first launches, (kernel, grid, args, options): each row's (m, S),
    then the factors e' [B, K] and c' [B, N] (the Triton template's header)."""
    B, K = x.shape
    N = out.shape[1]
    return [(mod.logmatmul_bwd_stats_kernel, (B,), (x, out, stats, N, K), dict(BLOCK=STATS_BLOCK, num_warps=8)),
            (mod.logmatmul_bwd_factors_kernel, (B, cdiv(max(N, K), REDUCE_BLOCK)), (x, out, grad, stats, e, c, N, K),
             dict(BLOCK=REDUCE_BLOCK))]


def _gemm_dw(c, e, w_dtype) -> torch.Tensor:
    """dw = c'^T e' (float32 unless the caller allowed TF32 matmuls), in w's dtype."""
    dw = c.T @ e
    return dw if w_dtype is torch.float32 else dw.to(w_dtype)


def _dx_step(mod, dxp, x, stats, dx, parts: int) -> tuple:
    """dx = e' x (the sum of dxp's `parts` partials [parts, B, K], in order); 0 where x is
    -inf, or where e' is 0 and the sum is not NaN (no inf x 0); a NaN sum stays NaN (the
    template's _dx_rule). The GEMM form passes c' w as its one part."""
    B, K = x.shape
    return (mod.logmatmul_dx_kernel, (cdiv(B * K, REDUCE_BLOCK),), (dxp, x, stats, dx, B, K, parts),
            dict(BLOCK=REDUCE_BLOCK))


def _fused_steps(mod, x, w, out, grad, stats, dw, dx, dxp, plan) -> list[tuple]:
    """The one-pass backward's launches: the rows' (m, S), the pass over w (dx directly with
    one chunk, else each chunk's partials into dxp), then the partials' sum."""
    B, K = x.shape
    N = w.shape[0]
    _, chunks, n_chunk = plan
    direct = dxp is None
    todo = [(mod.logmatmul_bwd_stats_kernel, (B,), (x, out, stats, N, K), dict(BLOCK=STATS_BLOCK, num_warps=8)),
            (mod.logmatmul_bwd_kernel, (cdiv(K, mod.BWD_K), chunks),
             (x, w, out, grad, stats, dw, dx if direct else dxp, B, N, K, n_chunk),
             dict(BB=pow2_at_least(B), BN=mod.BWD_N, BK=mod.BWD_K, DIRECT=direct, KA=stride_align(K),
                  num_warps=mod.BWD_WARPS))]
    if not direct:
        todo.append(_dx_step(mod, dxp, x, stats, dx, chunks))
    return todo


class _Recorded:
    """A group of launches replayed with its slots' new addresses (triton_launch.replay)
    after a run through triton_launch.launch has recorded it. Until one has (replay declines
    a call whose slots are not 16-byte aligned, as triton_direct's first call may be), each
    run tries to, as triton_direct does."""

    __slots__ = ("rep",)

    def __init__(self):
        self.rep = None  # the Replay, once recorded

    def run(self, steps, slots) -> None:
        """`steps()` -> the group's launches (built only where the replay does not run)."""
        rep = self.rep
        if rep is not None and rep([t.data_ptr() for t in slots]):
            return
        todo = steps()
        for step in todo:
            triton_launch.launch(*step)
        if rep is None:
            self.rep = triton_launch.replay(todo, slots)


def backward_direct(mod, B: int, N: int, K: int, x_dtype, w_dtype, device: torch.device):
    """The op's backward fast path at one exact call signature (`device`: the tensors', with
    its index): `f(x, w, out, grad)` -> (dx, dw) for contiguous inputs, or None where the call
    must take `backward` (w not 16-byte aligned for a CUDA library's backward); None instead
    of `f` for an empty shape.
    A CUDA variant's library backward where it takes the signature (CudaForward.backward_direct), else
    its Triton companion's: the plan fixed once, buffers from prototypes, the Triton launches
    replayed after the first call (triton_launch.replay) as the forward's fast path does,
    so that a training step's backward costs the host a few launches (the general path's
    keyed launches and a GEMM form's elementwise torch ops took ~45-300 us of host time a
    backward on an H200 host against 8-50 us of GPU time at small shapes: BENCHMARKS.md,
    sixty-third session)."""
    if min(B, N, K) < 1:
        return None
    if isinstance(mod, CudaForward):
        lib = mod.backward_direct(B, N, K, x_dtype, w_dtype, device) if _launch.CUDA_BACKWARD else None
        if lib is not None:
            return lib
        mod = mod.triton
    f32 = torch.float32
    plan = _bwd_plan(mod, B, N, K, device)
    if plan[0]:  # the GEMM form: its factors and dx epilogue replayed, the two GEMMs by torch
        alloc = Allocs(device, ((B, 2), f32), ((B, K), f32), ((B, N), f32))
        alloc_dx = Allocs(device, ((B, K), x_dtype))
        first, last = _Recorded(), _Recorded()

        def gemm_form(x, w, out, grad):
            stats, e, c = alloc()
            first.run(lambda: _gemm_factors(mod, x, out, grad, stats, e, c), (x, out, grad, stats, e, c))
            cw = c @ (w if w.dtype is f32 else w.to(f32))
            (dx,) = alloc_dx()
            last.run(lambda: [_dx_step(mod, cw, x, stats, dx, 1)], (cw, x, stats, dx))
            return dx, _gemm_dw(c, e, w_dtype)

        return gemm_form
    chunks = plan[1]
    alloc = Allocs(device, ((B, 2), f32), ((N, K), w_dtype), ((B, K), x_dtype),
                   ((chunks, B, K), f32) if chunks > 1 else None)
    steps = _Recorded()

    def fused(x, w, out, grad):
        stats, dw, dx, dxp = alloc()
        slots = (x, w, out, grad, stats, dw, dx) if dxp is None else (x, w, out, grad, stats, dw, dx, dxp)
        steps.run(lambda: _fused_steps(mod, x, w, out, grad, stats, dw, dx, dxp, plan), slots)
        return dx, dw

    return fused


# --------------------------------------------------------------------------- block-sparse


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
    dx = _launch._empty((B, K), dtype=x.dtype, device=dev)
    dblocks = _launch._empty(blocks.shape, dtype=blocks.dtype, device=dev)
    if B == 0 or nnz == 0 or K == 0:
        return dx.zero_(), dblocks.zero_()
    bn, bk = min(mod.BWD_N, bs), min(mod.BWD_K, bs)
    nn = bs // bn
    dxp = _launch._empty((nnz * nn, B, bs), dtype=torch.float32, device=dev)
    rows = block_rows(row_ptr, nnz)
    triton_launch.launch(mod.bsl_bwd_kernel, (nnz * nn * (bs // bk),),
                         (x, blocks, rows, col_idx, out, grad, dblocks, dxp, B, N, K),
                         dict(BS=bs, BB=bwd_rows(mod, B), BN=bn, BK=bk, num_warps=mod.BWD_WARPS))
    perm, col_ptr = column_order(col_idx, K // bs)
    triton_launch.launch(mod.bsl_dx_reduce_kernel, (K // bs, cdiv(B * bs, REDUCE_BLOCK)),
                         (dxp, perm, col_ptr, x, dx, B, K),
                         dict(BS=bs, NN=nn, BLOCK=REDUCE_BLOCK))
    return dx, dblocks
