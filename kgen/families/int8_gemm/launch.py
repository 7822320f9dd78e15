"""int8_gemm's launches: `gemm` runs one call on an `Impl` (a Triton variant's module, or
a CUDA variant with the Triton module that takes the inputs it cannot), into an output the
caller allocated. Inputs are checked and contiguous; a / x is 2-D [M, K].

Triton: one GEMM launch writes the finished output; a split-K launch (small M, where the
unsplit grid would be slow: plans.splits) writes
`splits` partial planes (int32, or float32 for W8A16) to a workspace and the combine
kernel sums them in a fixed order and applies the epilogue. No atomics: deterministic.
CUDA (sm_80 mma.sync, int8 only): one launch, epilogue fused; it needs K % 16 == 0 and
16-byte aligned a and b (cp.async moves 16-byte pieces), else the Triton module runs.
CUDA wgmma (sm_90a, int8_mm and int8_linear, any M): TMA + WGMMA s8 tiles, with K splits
(plans.wgmma_splits) where the tiles do not fill the SMs and the unsplit grid is slow enough
to pay for the split's host cost: the gemv kernel's launcher arguments and partial planes.
It needs K % 16 == 0 and 16-byte aligned a and b (TMA).
CUDA gemv (M <= 16, all three ops): one launch, or with K splits (plans.gemv_splits) a
partial workspace [splits, M, N] and the combine kernel, both in one launcher call; it needs
K % 16 == 0, 16-byte aligned a / x and b, and group_size % 64 == 0 (a 64-k step within one
scale group), else the Triton module runs."""

from __future__ import annotations

import torch

from kgen.families.int8_gemm import plans
from kgen.families.int8_gemm.plans import MODE_LINEAR, MODE_MM, MODE_W8A16
from kgen.runtime import triton_launch
from kgen.runtime.op import prototype, stride_align
from kgen.runtime.streams import current_raw_stream

# Output / bias dtype codes the CUDA launcher reads.
_OUT_CODE = {torch.int32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every workspace a launch reads back comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


_EMPTY = _empty
_data_ptr = torch.Tensor.data_ptr


class Impl:
    """What a call runs: `triton`, a rendered Triton module (always set), and `cuda`, a
    loaded CUDA variant (or None; `gemv` says it is the small-M kernel)."""

    def __init__(self, triton_mod, cuda=None):
        self.triton, self.cuda = triton_mod, cuda
        self.name = cuda.name if cuda is not None else getattr(triton_mod, "VARIANT", "triton")
        self.gemv = cuda is not None and plans.is_gemv(cuda.variant)
        self.wgmma = cuda is not None and plans.is_wgmma(cuda.variant)
        # gemv and wgmma take the same launcher arguments (K splits, partial planes)
        self.split = self.gemv or self.wgmma

    def splits(self, M: int, N: int, K: int, device, forced: int | None = None) -> int:
        """K splits of a gemv / wgmma call: the plan (or `forced`, tests), within the
        kernel's K steps."""
        step = plans.GEMV_STEP if self.gemv else plans.WGMMA_BK
        if forced is None:
            sms = plans.sm_count(device)
            forced = (plans.gemv_splits_of(self.cuda.params, M, N, K, sms) if self.gemv
                      else plans.wgmma_splits(self.cuda.params, M, N, K, sms))
        return max(1, min(forced, plans.cdiv(K, step)))

    def cuda_takes(self, a, b, mode: int = MODE_MM, group_size: int | None = None) -> bool:
        if self.cuda is None or a.shape[1] % 16 or a.data_ptr() % 16 or b.data_ptr() % 16:
            return False
        if self.gemv:
            return a.shape[0] <= plans.GEMV_MAX_M and (group_size or 0) % plans.GEMV_STEP == 0
        return mode != MODE_W8A16


def direct(impl: Impl, mode: int, M: int, N: int, K: int, out_dtype, group_size: int | None,
           scale_b_dtype, bias_dtype, device: torch.device):
    """A launcher for one exact call signature, for the op's eager fast path:
    `f(a, b, scale_a, scale_b, bias)` -> out [M, N] (a contiguous [..., K] with M rows), or
    None for a call the general path must take (an input not contiguous; for the CUDA
    kernels a / b not 16-byte aligned). The launch plan (K splits, grid), the arguments
    that do not change and the stream getter are bound once: `cuda_direct` where `gemm`
    runs this signature on a CUDA kernel, else `triton_direct`. None for an empty call or
    no implementation (the reference)."""
    if min(M, N, K) < 1 or impl is None:
        return None
    if impl.cuda is not None and K % 16 == 0 and (
            (M <= plans.GEMV_MAX_M and (group_size or 0) % plans.GEMV_STEP == 0) if impl.gemv else mode != MODE_W8A16):
        return cuda_direct(impl, mode, M, N, K, out_dtype, group_size, scale_b_dtype, bias_dtype, device)
    return triton_direct(impl.triton, mode, M, N, K, out_dtype, group_size, device)


def _contiguous(*ts) -> bool:
    for t in ts:
        if t is not None and not t.is_contiguous():
            return False
    return True


def cuda_direct(impl: Impl, mode: int, M: int, N: int, K: int, out_dtype, group_size: int | None,
                scale_b_dtype, bias_dtype, device: torch.device):
    """`direct` for a signature a CUDA kernel of `impl` runs (checked by `direct`)."""
    n_splits = impl.splits(M, N, K, device) if impl.split else 1
    kernel, index = impl.cuda, device.index if device.index is not None else -1  # as Tensor.get_device()
    raw, ptr, fail, stream, empty_like = kernel.raw, kernel.ptr, kernel.fail, current_raw_stream, torch.empty_like
    proto = prototype((M, N), out_dtype, device)  # outputs: empty_like of it
    out_code = _OUT_CODE[out_dtype]
    sb_code = _OUT_CODE[scale_b_dtype] if scale_b_dtype is not None else 0
    bias_code = _OUT_CODE[bias_dtype] if bias_dtype is not None else 0
    has_bias, gs = bias_dtype is not None, group_size or 0
    part_dtype = torch.float32 if mode == MODE_W8A16 else torch.int32

    def launch(a, b, scale_a, scale_b, bias):
        ap, bp = a.data_ptr(), b.data_ptr()
        if (ap | bp) & 15 or not _contiguous(a, b, scale_a, scale_b, bias):
            return None
        out = empty_like(proto)
        sa = scale_a.data_ptr() if scale_a is not None else 0
        sb = scale_b.data_ptr() if scale_b is not None else 0
        bi = bias.data_ptr() if has_bias else 0
        if impl.split:
            part = _empty((n_splits, M, N), part_dtype, device) if n_splits > 1 else None
            rc = raw(ptr, index, mode, has_bias, ap, bp, out.data_ptr(), part.data_ptr() if part is not None else 0,
                     sa, sb, bi, M, N, K, n_splits, gs, out_code, sb_code, bias_code, stream(index))
        else:
            rc = raw(ptr, index, mode, has_bias, ap, bp, out.data_ptr(), sa, sb, bi, M, N, K, out_code, bias_code,
                     stream(index))
        if rc:
            fail(rc)
        return out

    return launch


def triton_direct(mod, mode: int, M: int, N: int, K: int, out_dtype, group_size: int | None,
                  device: torch.device):
    """`direct` for a signature the Triton module runs. The first call launches through
    triton_launch (Triton's own path the first time per specialisation) and records the
    launches (triton_launch.replay); later calls allocate the output (and a split's partial
    planes) and replay them with the new addresses, skipping the per-launch specialisation
    key and the op's dispatch (a split W8A16 call took ~190 us of host time through the op
    for 51 us of GPU time, H200, BENCHMARKS.md thirty-sixth session). Where the replay
    declines (an address not 16-byte aligned, hooks set, a knob or the device changed),
    triton_launch's launch runs, as in `gemm`."""
    n_splits, k_split = _triton_plan(mod, M, N, K, group_size, device)
    part_dtype = torch.float32 if mode == MODE_W8A16 else torch.int32
    out_proto = prototype((M, N), out_dtype, device)
    part_proto = prototype((n_splits, M, N), part_dtype, device) if n_splits > 1 else None
    empty_like = torch.empty_like
    rec: list = []  # the replay, once recorded

    def launch(a, b, scale_a, scale_b, bias):
        if not _contiguous(a, b, scale_a, scale_b, bias):
            return None
        if rec and _empty is _EMPTY:  # (tests patch _empty to poison buffers: they take the else)
            out = empty_like(out_proto)
            part = empty_like(part_proto) if part_proto is not None else None
        else:
            out = _empty((M, N), out_dtype, device)
            part = _empty((n_splits, M, N), part_dtype, device) if n_splits > 1 else None
        present = [t for t in (scale_a, scale_b, bias) if t is not None]
        if rec and rec[0].go(a.data_ptr(), b.data_ptr(), out.data_ptr(), *map(_data_ptr, present),
                             *((part.data_ptr(),) if part is not None else ())):
            return out
        if a.dim() != 2:  # (leading batch dims: the launches take a as [M, K])
            a = a.view(M, K)
        todo = _triton_launches(mod, mode, a, b, out, scale_a, scale_b, bias, group_size, n_splits, k_split, part)
        for kernel, grid, args, kw in todo:
            triton_launch.launch(kernel, grid, args, kw)
        if not rec:
            r = triton_launch.replay(todo, (a, b, out, *present) + ((part,) if part is not None else ()))
            if r is not None:
                rec.append(r)
        return out

    return launch


def gemm(impl: Impl, mode: int, a, b, out, scale_a=None, scale_b=None, bias=None,
         group_size: int | None = None, n_splits: int | None = None) -> torch.Tensor:
    """out [M, N] = the op of `mode` on a [M, K], b [N, K]; `n_splits` forces the number of
    K splits of a Triton launch (tests)."""
    M, K = a.shape
    N = b.shape[0]
    if M == 0 or N == 0:
        return out
    if impl.cuda_takes(a, b, mode, group_size):
        if impl.split:
            _split(impl, mode, a, b, out, scale_a, scale_b, bias, group_size, n_splits)
        else:
            _cuda(impl.cuda, mode, a, b, out, scale_a, scale_b, bias)
    else:
        _triton(impl.triton, mode, a, b, out, scale_a, scale_b, bias, group_size, n_splits)
    return out


def _cuda(kernel, mode, a, b, out, scale_a, scale_b, bias) -> None:
    dev = a.get_device()
    rc = kernel.raw(kernel.ptr, dev, mode, bias is not None, a.data_ptr(), b.data_ptr(), out.data_ptr(),
                    scale_a.data_ptr() if scale_a is not None else 0, scale_b.data_ptr() if scale_b is not None else 0,
                    bias.data_ptr() if bias is not None else 0, a.shape[0], b.shape[0], a.shape[1],
                    _OUT_CODE[out.dtype], _OUT_CODE[bias.dtype] if bias is not None else 0, current_raw_stream(dev))
    if rc:
        kernel.fail(rc)


def _split(impl, mode, a, b, out, scale_a, scale_b, bias, group_size, n_splits) -> None:
    """A gemv or wgmma launch (their launcher arguments are the same), K split by the plan or
    `n_splits` (tests), within the kernel's K steps."""
    M, K = a.shape
    N = b.shape[0]
    kernel = impl.cuda
    n_splits = impl.splits(M, N, K, a.device, n_splits)
    part = None
    if n_splits > 1:
        part = _empty((n_splits, M, N), torch.float32 if mode == MODE_W8A16 else torch.int32, a.device)
    dev = a.get_device()
    rc = kernel.raw(kernel.ptr, dev, mode, bias is not None, a.data_ptr(), b.data_ptr(), out.data_ptr(),
                    part.data_ptr() if part is not None else 0, scale_a.data_ptr() if scale_a is not None else 0,
                    scale_b.data_ptr() if scale_b is not None else 0, bias.data_ptr() if bias is not None else 0,
                    M, N, K, n_splits, group_size or 0, _OUT_CODE[out.dtype],
                    _OUT_CODE[scale_b.dtype] if scale_b is not None else 0,
                    _OUT_CODE[bias.dtype] if bias is not None else 0, current_raw_stream(dev))
    if rc:
        kernel.fail(rc)


def _triton_plan(mod, M: int, N: int, K: int, group_size, device, n_splits: int | None = None) -> tuple[int, int]:
    """(splits, k_split) of a Triton call: the plan, or `n_splits` forced (tests)."""
    bk = plans.block_k(mod, group_size)
    if n_splits is None:
        return plans.splits(mod, M, N, K, bk, plans.sm_count(device))
    k_split = plans.cdiv(plans.cdiv(K, bk), n_splits) * bk
    return plans.cdiv(K, k_split), k_split


def _triton(mod, mode, a, b, out, scale_a, scale_b, bias, group_size, n_splits) -> None:
    M, K = a.shape
    N = b.shape[0]
    n_splits, k_split = _triton_plan(mod, M, N, K, group_size, a.device, n_splits)
    part = None
    if n_splits > 1:
        part = _empty((n_splits, M, N), torch.float32 if mode == MODE_W8A16 else torch.int32, a.device)
    for kernel, grid, args, kw in _triton_launches(mod, mode, a, b, out, scale_a, scale_b, bias, group_size,
                                                   n_splits, k_split, part):
        triton_launch.launch(kernel, grid, args, kw)


def _triton_launches(mod, mode, a, b, out, scale_a, scale_b, bias, group_size, n_splits, k_split, part) -> list:
    """The (kernel, grid, args, kw) launches of a Triton call: the GEMM writing `out`, or
    with n_splits > 1 the GEMM writing the partial planes `part` and the combine."""
    M, K = a.shape
    N = b.shape[0]
    bk = plans.block_k(mod, group_size)
    group = group_size or 0
    dummy = b
    sa = scale_a if scale_a is not None else dummy
    sb = scale_b if scale_b is not None else dummy
    bi = bias if bias is not None else dummy
    consts = dict(MODE=mode, HAS_BIAS=bias is not None, GROUP=group)
    tiles = dict(EVEN_K=K % bk == 0, BLOCK_M=mod.BLOCK_M, BLOCK_N=mod.BLOCK_N, BLOCK_K=bk, GROUP_M=mod.GROUP_M,
                 KA=stride_align(K), num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)
    n_groups = K // group if group else 1
    grid = plans.gemm_grid(mod, M, N, n_splits)
    if n_splits == 1:
        return [(mod.int8_gemm_kernel, grid, (a, b, out, sa, sb, bi, M, N, K, k_split, n_groups),
                 dict(PARTIAL=False, **consts, **tiles))]
    return [(mod.int8_gemm_kernel, grid, (a, b, part, sa, sb, bi, M, N, K, k_split, n_groups),
             dict(PARTIAL=True, **consts, **tiles)),
            (mod.int8_gemm_combine_kernel, plans.combine_grid(mod, M, N), (part, out, sa, sb, bi, M, N, n_splits),
             dict(consts, COMBINE_M=mod.COMBINE_M, COMBINE_N=mod.COMBINE_N))]


__all__ = ["Impl", "direct", "cuda_direct", "triton_direct", "gemm", "MODE_MM", "MODE_LINEAR", "MODE_W8A16"]
