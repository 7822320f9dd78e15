"""logmatmul's forward launches: the dense forward (Triton, or a CUDA variant's small-batch
kernel with its Triton companion) and the block-sparse forward; `backward_launch` runs the
backward. Inputs arrive checked and contiguous; every buffer comes from `_empty` (tests
poison it with NaN so an element a kernel never writes shows up).

Forward: see the Triton template's header. The CUDA small-batch kernel (B <= 16, 16-byte
aligned rows) writes its own (m, s) partials and merges them in a second launch of the
same library, on the caller's stream. A variant with mma = 1 runs the tensor-core form of
that kernel (mma.sync tf32 in 3 passes; float32 x and w only) behind the same launcher: its
CTAs hold 16 nodes per warp's m-tile and its K slices step by plans.cuda_k_step.

A CUDA variant's library also holds its own backward for float32 w and B <= 16
(CudaForward.backward: two launches in one host call, each CTA taking its own shifts, so
no statistics launch; backward.cuh.j2), which `backward_launch.backward` runs where it
applies, by default (CUDA_BACKWARD).

Block-sparse forward: a CUDA variant's library runs its own (CudaForward.bsl: the dense
kernel's CTA over block rows, bsl.cuh.j2) where it takes the call; else the Triton kernel.
"""

from __future__ import annotations

import os

import torch

from kgen.families.logmatmul.plans import (
    BWD_B, REDUCE_BLOCK, block_b, bsl_cuda_splits, bsl_tiles, bwd_cuda_chunks, cdiv, cuda_k_step, cuda_splits, k_split,
    pre_pass, sm_count)
from kgen.families.logmatmul.schema import (
    CUDA_MAX_B, CUDA_MAX_K, cuda_bsl_shape, cuda_op_max_b, cuda_rows, cuda_whole_rows)
from kgen.runtime import triton_launch
from kgen.runtime.op import prototype, stride_align
from kgen.runtime.streams import current_raw_stream

_empty = torch.empty  # tests patch this to poison every buffer
# Whether `backward` runs a CUDA variant's own backward (CudaForward.backward) where it
# applies: on by default since it passed its GPU test (test_gpu_cuda_backward) and measured
# 1.1-4.7x faster per forward + backward step than the Triton companion's backward at
# B = 1..8, N = K = 4096 (H100, tools/logmatmul_fb.py, BENCHMARKS.md);
# KGEN_LOGMATMUL_CUDA_BACKWARD=0 turns it off.
CUDA_BACKWARD = os.environ.get("KGEN_LOGMATMUL_CUDA_BACKWARD", "1") != "0"
_TORCH_EMPTY = torch.empty
MISSING = object()


def _library_entry(kernel, symbol: str):
    """(raw, fnptr) calling a launcher of a CUDA variant's library other than kgen_launch
    through the trampoline like the forward's (ctypes where this Python has none), or None
    where the library has no such symbol."""
    lib = getattr(kernel, "lib", None)
    fn = getattr(lib, symbol, None) if lib is not None else None
    if fn is None:
        return None
    import ctypes

    from kgen.runtime import loader

    tramp = loader.trampoline()
    return (tramp.call, ctypes.cast(fn, ctypes.c_void_p).value) if tramp is not None else (loader._ctypes_raw(fn), 0)


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
        self.max_b = cuda_op_max_b(kernel.params, kernel.variant.dtype)
        # rows of x per CTA: B above it runs as cdiv(B, rows) CTAs per node group
        self.rows = cuda_rows(kernel.params, kernel.variant.dtype)
        # the tensor-core kernel (lmm_mma): float32 x and w only, NODES = 16 x its m-tiles
        self.mma = kernel.params.get("mma", 0)
        self.DOT = "cuda"
        self._plans: dict = {}  # (B, N, K, w is float32, device) -> (splits, k_slice)
        # the library's backward launcher (kgen_backward: float32 w, B <= BWD_B) and its
        # block-sparse forward (kgen_bsl_launch), whose CTAs' nodes and rows of x are its own
        self._bwd = _library_entry(kernel, "kgen_backward")
        self._bsl = _library_entry(kernel, "kgen_bsl_launch")
        self.bsl_nodes, _, self.bsl_rows = cuda_bsl_shape(kernel.params, kernel.variant.dtype)

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
        plan, forced = None, splits
        if (1 <= B <= self.max_b and K <= CUDA_MAX_K and cuda_whole_rows(K, 4 if w32 else 2) and xt == self.dtype
                and (w32 or wt == xt) and (w32 or not self.mma)):
            # a CTA's K slice is a whole number of steps (threads x 16 bytes of w; mma: a warp's
            # loop step of chunks of 16 k)
            step = cuda_k_step(self.kernel.params, w32)
            tiles = cdiv(N, self.nodes) * cdiv(B, min(B, self.rows))
            if splits is None:
                splits = cuda_splits(tiles, K, step, self.waves, sm_count(torch.device("cuda", index)))
            plan = k_split(1, N, K, 1, self.nodes, step, self.waves, 1, splits)
        if forced is None:
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

    def direct(self, B: int, N: int, K: int, x_dtype, w_dtype, device: torch.device):
        """A launcher for one exact call signature: `f(x, w)` -> out, or None where x or w
        is not contiguous or not 16-byte aligned (then the general path runs). A K split's
        partials take one scratch tensor a call (part_m, then part_s from the next 16-byte
        boundary): the tensor-core form splits K at most shapes, and through the general
        path its calls cost ~30 us of host time a call on an H200 host against ~24 us of GPU
        time at N = K = 4096 (BENCHMARKS.md fortieth session). A signature the kernel does
        not take (K not whole 16-byte rows, B above its rows) gets the Triton companion's
        launcher instead: the general path would run the companion anyway, at ~4x the host
        cost of a direct call on an H200 host (BENCHMARKS.md, twenty-second session). The
        op's fast path keeps it per signature: the plan, the kernel's arguments that do not
        change and the stream getter are bound once."""
        if min(B, N, K) < 1:
            return None
        index = device.index
        key = (B, N, K, x_dtype, w_dtype, index)
        plan = self._plans.get(key, MISSING)
        if plan is MISSING:
            plan = self._plan(key)
        if plan is None:  # the kernel does not take the signature: its Triton companion's fast path
            return triton_direct(self.triton, B, N, K, device)
        splits, k_slice = plan
        raw, ptr, fail, w32 = self.kernel.raw, self.kernel.ptr, self.kernel.fail, w_dtype is torch.float32
        shape, f32, stream, empty_like = (B, N), torch.float32, current_raw_stream, torch.empty_like
        proto = prototype(shape, f32, device)  # outputs: empty_like of it
        s_at = -(-splits * B // 4) * 4  # part_s's offset in the scratch, in floats
        scratch = (s_at + splits * B * N,) if splits > 1 else None
        s_proto = prototype(scratch, f32, device) if scratch else None

        def launch(x, w):
            xp, wp = x.data_ptr(), w.data_ptr()
            if (xp | wp) & 15 or not (x.is_contiguous() and w.is_contiguous()):
                return None
            if _empty is _TORCH_EMPTY:
                out = empty_like(proto)
                part = empty_like(s_proto) if scratch else out
            else:  # (tests patch _empty to poison buffers)
                out = _empty(shape, dtype=f32, device=device)
                part = _empty(scratch, dtype=f32, device=device) if scratch else out
            o, pm = out.data_ptr(), part.data_ptr()
            rc = raw(ptr, index, xp, wp, w32, pm, pm + 4 * s_at if scratch else o, o, B, N, K, splits, k_slice,
                     stream(index))
            if rc:
                fail(rc)
            return out

        return launch

    def backward(self, x, w, out, grad):
        """(dx, dw) by the library's backward (one host call, two launches), or None where
        it does not apply (then the Triton companion's backward runs): float32 w, x in the
        variant's dtype, 1 <= B <= BWD_B, whole 16-byte rows of w at a 16-byte aligned base."""
        if w.data_ptr() & 15:  # (before binding: the bound launcher would decline it too)
            return None
        B, K = x.shape
        f = self.backward_direct(B, w.shape[0], K, x.dtype, w.dtype, x.device)
        return f(x, w, out, grad) if f is not None else None

    def backward_direct(self, B: int, N: int, K: int, x_dtype, w_dtype, device: torch.device):
        """The library's backward bound to one exact call signature: `f(x, w, out, grad)` ->
        (dx, dw), or None where w's base is not 16-byte aligned; None instead of `f` where
        the backward does not take the signature (see `backward`). The chunks of N and the
        entry point are fixed once; a call allocates dw, dx and, with several chunks, dx's
        partials."""
        if (self._bwd is None or w_dtype is not torch.float32 or x_dtype is not self.dtype or not 1 <= B <= BWD_B
                or N < 1 or K < 1 or K % 4):
            return None
        chunks, n_chunk = bwd_cuda_chunks(B, N, K, sm_count(device))
        raw, ptr, fail, index = *self._bwd, self.kernel.fail, device.index
        alloc = Allocs(device, ((N, K), torch.float32), ((B, K), x_dtype),
                       ((chunks, B, K), torch.float32) if chunks > 1 else None)

        def launch(x, w, out, grad):
            wp = w.data_ptr()
            if wp & 15:
                return None
            dw, dx, dxp = alloc()
            rc = raw(ptr, index, x.data_ptr(), wp, out.data_ptr(), grad.data_ptr(), dw.data_ptr(),
                     (dxp if dxp is not None else dx).data_ptr(), dx.data_ptr(), B, N, K, chunks, n_chunk,
                     current_raw_stream(index))
            if rc:
                fail(rc)
            return dx, dw

        return launch

    def bsl(self, x, blocks, row_ptr, col_idx, block_size: int, out, splits: int | None = None) -> bool:
        """The block-sparse forward by the library's kgen_bsl_launch into out (its K splits'
        partials and their merge in one host call), True; or False where it does not apply
        (then the Triton companion runs): 1 <= B <= CUDA_MAX_B, x in the variant's dtype,
        blocks float32 (or x's dtype but for the tensor-core form), x and blocks at 16-byte
        aligned bases, a node group within a block row. `splits` forces the K split count."""
        B, K = x.shape
        N = out.shape[1]
        w32 = blocks.dtype is torch.float32
        if (self._bsl is None or not 1 <= B <= CUDA_MAX_B or x.dtype is not self.dtype
                or not (w32 or (blocks.dtype is x.dtype and not self.mma)) or block_size % self.bsl_nodes
                or (x.data_ptr() | blocks.data_ptr()) & 15):
            return False
        dev = x.device
        step = self.warps * 32 * (4 if w32 else 8)  # a CTA's threads x 16 bytes of w
        splits = bsl_cuda_splits(B, N // block_size, blocks.shape[0], block_size, self.bsl_nodes, self.bsl_rows, step,
                                 self.waves, sm_count(dev), splits)
        if splits == 1:
            part_m = part_s = out  # unused
        else:
            part_m, part_s = _empty((2, splits, B, N), dtype=torch.float32, device=dev)
        i64 = torch.int64
        raw, ptr = self._bsl
        rc = raw(ptr, dev.index, x.data_ptr(), blocks.data_ptr(), w32, row_ptr.data_ptr(), row_ptr.dtype is i64,
                 col_idx.data_ptr(), col_idx.dtype is i64, part_m.data_ptr(), part_s.data_ptr(), out.data_ptr(), B, N,
                 K, block_size, splits, current_raw_stream(dev.index))
        if rc:
            self.kernel.fail(rc)
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
    plan = _triton_plan(mod, B, N, K, x.device, splits)
    _, _, *bufs = _triton_buffers(plan, B, N, K, x.device, out)
    for kernel, grid, args, kw in _triton_launches(mod, x, w, out, *bufs, plan):
        triton_launch.launch(kernel, grid, args, kw)
    return out


def _triton_plan(mod, B: int, N: int, K: int, device, splits=None) -> tuple:
    """(rows of x per program, K splits, k_slice, n tiles, whether exp(x - m) runs first)."""
    bb = block_b(mod, B)
    splits, k_slice = k_split(B, N, K, bb, mod.BLOCK_N, mod.BLOCK_K, mod.WAVES, sm_count(device), splits)
    return bb, splits, k_slice, cdiv(N, mod.BLOCK_N), pre_pass(mod, B, N, K)


def _scratch_layout(plan, B: int, N: int, K: int) -> tuple[list[int], list[int]]:
    """(offsets, sizes) in float32 elements of the forward's scratch pieces: the K-split
    partials (where there are several splits), then e and m (with the exp pass); each piece
    128-byte aligned. The scratch's length is offsets[-1] ([0] and no sizes: none)."""
    splits, pre = plan[1], plan[4]
    sizes = ((splits * B, splits * B * N) if splits > 1 else ()) + ((B * K, B) if pre else ())
    at = [0]
    for n in sizes:
        at.append(at[-1] + -(-n // 32) * 32)
    return at, list(sizes)


def _triton_buffers(plan, B: int, N: int, K: int, device, out=None, scratch=None) -> tuple:
    """(out, scratch, part_m, part_s, e, m): the forward's output and its scratch, one
    allocation (None where there is none) whose 128-byte aligned pieces are the K-split
    partials (out itself where there is one split) and, with the exp pass, e and m (None
    without it). `out` / `scratch`: buffers already allocated for them."""
    splits, pre = plan[1], plan[4]
    f32 = torch.float32
    out = _empty((B, N), dtype=f32, device=device) if out is None else out
    at, sizes = _scratch_layout(plan, B, N, K)
    if not sizes:
        return out, None, out, out, None, None
    scratch = _empty((at[-1],), dtype=f32, device=device) if scratch is None else scratch
    piece = [scratch[at[i]:at[i] + n] for i, n in enumerate(sizes)]
    if splits > 1:
        part_m, part_s = piece[0].view(splits, B), piece[1].view(splits, B, N)
        piece = piece[2:]
    else:
        part_m = part_s = out
    e, m = (piece[0].view(B, K), piece[1]) if pre else (None, None)
    return out, scratch, part_m, part_s, e, m


def _triton_launches(mod, x, w, out, part_m, part_s, e, m, plan) -> list[tuple]:
    """The Triton forward's launches in order, (kernel, grid, args, options): every kernel
    parameter positional (constexprs too, in the kernel's order), so that a bound launch
    (`triton_direct`) can replay them from a list."""
    bb, splits, k_slice, n_tiles, pre = plan
    B, K = x.shape
    N = w.shape[0]
    ka = stride_align(K)  # the kernels' KA
    todo = []
    if pre:  # tl.dot tiles at large work: exp(x - m) once, then a plain tl.dot tile loop
        todo.append((mod.logmatmul_exp_kernel, (B,), (x, e, m, K, REDUCE_BLOCK, ka), {}))
    todo.append((mod.logmatmul_fwd_kernel, (n_tiles * cdiv(B, bb) * splits,),
                 (e if pre else x, w, part_m, part_s, out, B, N, K, k_slice, n_tiles,
                  splits == 1, mod.DOT, bb, mod.BLOCK_N, mod.BLOCK_K, pre, m, ka),
                 dict(num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)))
    if splits > 1:
        todo.append((mod.logmatmul_combine_kernel, (cdiv(B * N, REDUCE_BLOCK),),
                     (part_m, part_s, out, B, N, splits, REDUCE_BLOCK), {}))
    return todo


def triton_direct(mod, B: int, N: int, K: int, device: torch.device):
    """The op's fast path for a Triton variant at one exact call signature: `f(x, w)` ->
    out, or None for inputs the op would copy first (not contiguous). The first call runs
    `forward`'s launches through triton_launch and records them (triton_launch.replay);
    later calls allocate the output and the scratch (two allocations) and replay them with
    the new addresses, skipping the per-launch specialisation key (~20 us a launch on a slow
    H100 host, BENCHMARKS.md fourteenth session). Where the replay declines (hooks set, a
    knob or the device changed, x or w not 16-byte aligned), triton_launch's launch runs,
    as in `forward`."""
    if min(B, N, K) < 1:
        return None
    plan = _triton_plan(mod, B, N, K, device)
    rec: list = []  # the replay, once recorded
    f32 = torch.float32
    # a replayed call allocates only out and the scratch (as empty_like of prototypes): the
    # pieces' views are for the recorded launches' first call (the pieces are offsets into
    # the scratch there; the tensor-core forms' three launches took ~45-65 us of host time
    # with the views made every call, H200, BENCHMARKS.md thirty-fifth session)
    at, _ = _scratch_layout(plan, B, N, K)
    out_proto = prototype((B, N), f32, device)
    scratch_proto = prototype((at[-1],), f32, device) if at[-1] else None
    empty_like = torch.empty_like

    def launch(x, w):
        if not (x.is_contiguous() and w.is_contiguous()):
            return None
        if rec and _empty is _TORCH_EMPTY:  # (tests patch _empty to poison buffers: they take the else)
            out = empty_like(out_proto)
            scratch = empty_like(scratch_proto) if scratch_proto is not None else None
        else:
            out = _empty((B, N), dtype=f32, device=device)
            scratch = _empty((at[-1],), dtype=f32, device=device) if at[-1] else None
        if rec:
            if (rec[0].go(x.data_ptr(), w.data_ptr(), out.data_ptr()) if scratch is None
                    else rec[0].go(x.data_ptr(), w.data_ptr(), out.data_ptr(), scratch.data_ptr())):
                return out
        out, scratch, *bufs = _triton_buffers(plan, B, N, K, device, out, scratch)
        todo = _triton_launches(mod, x, w, out, *bufs, plan)
        for kernel, grid, args, kw in todo:
            triton_launch.launch(kernel, grid, args, kw)
        if not rec:
            r = triton_launch.replay(todo, (x, w, out) if scratch is None else (x, w, out, scratch))
            if r is not None:
                rec.append(r)
        return out

    return launch


class Allocs:
    """New tensors of fixed (shape, dtype)s on one device, as one call: `torch.empty_like`
    of prototypes (op.prototype), or `_empty` where tests have patched it (poisoned
    buffers). A None entry gives None."""

    __slots__ = ("specs", "protos", "device")

    def __init__(self, device, *specs):
        self.specs, self.device = specs, device
        self.protos = tuple(prototype(*s, device) if s is not None else None for s in specs)

    def __call__(self) -> list:
        if _empty is _TORCH_EMPTY:
            return [torch.empty_like(p) if p is not None else None for p in self.protos]
        return [_empty(s[0], dtype=s[1], device=self.device) if s is not None else None for s in self.specs]


# --------------------------------------------------------------------------- block-sparse


def bsl_forward(mod, x, blocks, row_ptr, col_idx, block_size: int, splits: int | None = None) -> torch.Tensor:
    """out [B, N] float32 of checked, contiguous inputs: a CUDA variant's own kernel where it
    takes them (CudaForward.bsl; `splits` forces its K splits), else the Triton kernel."""
    B, K = x.shape
    N = (row_ptr.shape[0] - 1) * block_size
    out = _empty((B, N), dtype=torch.float32, device=x.device)
    if B == 0 or N == 0:
        return out
    if isinstance(mod, CudaForward):
        if mod.bsl(x, blocks, row_ptr, col_idx, block_size, out, splits):
            return out
        mod = mod.triton
    bn, bk = bsl_tiles(mod, block_size)
    bb = block_b(mod, B)
    n_tiles = N // bn
    triton_launch.launch(mod.bsl_fwd_kernel, (n_tiles * cdiv(B, bb),),
                         (x, blocks, row_ptr, col_idx, out, B, N, K, n_tiles),
                         dict(BS=block_size, DOT=mod.DOT, BLOCK_B=bb, BLOCK_N=bn, BLOCK_K=bk,
                              num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES))
    return out


def block_rows(row_ptr: torch.Tensor, nnz: int) -> torch.Tensor:
    """The block row of each of the nnz blocks (no host wait: the output size is known)."""
    counts = (row_ptr[1:] - row_ptr[:-1]).long()
    rows = torch.arange(counts.shape[0], device=row_ptr.device)
    return torch.repeat_interleave(rows, counts, output_size=nnz)
