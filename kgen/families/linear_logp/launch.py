"""linear_logp's forward launches: `forward`, on a Triton module or a `CudaForward`
(cuda_variant: a CUDA variant's kernels with their Triton companion); and what the backward's
launches (backward_launch) share with it: `_empty`, from which every buffer either returns or
reads back comes (tests poison it), `_gradients`, and the float32 few-rows path (`logits_path`).

Forward (O(N) extra memory, the N x V logits never exist):
  1. `linear_logp_fwd_kernel`, grid cdiv(N, BLOCK_N) * splits, split-major order, with
     splits >= SPLIT_V chosen per call to fill whole waves of SMs (triton_splits). Each
     program sweeps V tiles of its slice (tl.dot over D in BLOCK_D steps, float32
     accumulation; the tiles arrive by TMA tensor descriptors where _tma allows, else by
     masked pointer loads) with an online softmax in base 2 and writes float32 partials per row:
     running max, sum of exp, sum of exp * (z - max). Per logit the fold is one FMA,
     z = acc * scale + colterm[j] (colterm: bias * scale, or -1e30 past V), then max,
     exp2 and sums; no target compare.
  2. `linear_logp_combine_kernel`, grid cdiv(N, 16), merges the `splits` partials (32 a
     step) and takes the target logit as one float32 gather-dot (hidden[i] .
     weight[target[i]] + bias) * scale per non-ignored row (2 * D * elsize bytes a row). Exception: float32 inputs
     under TF32 keep the target logit in the fwd fold (a fourth partial, summed by the
     combine), so that it is rounded like the logits; see _target_in_tile.
  The CUDA forwards (tiled, or at N <= 16 the weight-streaming gemv kernel) write all four
  partials, target logit included; their own combine (combine.cuh.j2, the same contract,
  one warp a row) runs in the same launcher call, after them on the stream: one host call
  for the forward.
  Extra memory: 16 * splits * N bytes of partials, and 8 * N bytes (lse, E[z]) saved.

Backward: see backward_launch.
"""

from __future__ import annotations

from typing import Optional

import torch

from kgen.families.linear_logp.cuda_variant import CudaForward
from kgen.families.linear_logp.plans import (
    COMBINE_BLOCK, COMBINE_DOT_BLOCK, LOG2E, TARGET_BLOCK_D, _precision, _target_in_tile, _tile_sources, _tiles,
    combine_grid, fwd_grid, triton_splits)
from kgen.runtime import triton_launch

LN2 = 0.6931471805599453
# float32 at a few rows on the GPU: the logits by one cuBLAS GEMM (a GEMV at N = 1: the
# weight read once at bandwidth), then the `kept` module's kernels over them, forward and
# backward (the backward recomputes them so), rather than the Triton tiles, whose 64 rows
# a program multiply zeros at N << 64, and whose grid at a small vocabulary (V / 128
# column tiles) leaves SMs idle. Where N <= F32_LOGITS_MAX_ROWS[the dot precision] or
# the logits have at most F32_LOGITS_MAX_ELEMS[precision] elements, and in any case take
# at most F32_LOGITS_MAX_BYTES (temporary, freed by the end of each pass: the backward
# holds them and dz of the same size, within the 64 MiB promise). The bounds, from an H200
# (BENCHMARKS.md, forty-fourth and forty-fifth sessions), GPU time: TF32 off ("tf32x3",
# three tensor-core products a step) the logits path took 0.4-0.9x the tiles' forward and
# 0.46-0.95x forward + backward up to N = 32, mixed at 64 (V >= 16384: tiles); at
# N * V <= 2^19 it took 0.32-0.84x forward, 0.47-0.92x forward + backward (N = 48-128 at
# V = 4096-8192), and lost from 2^20 on at D <= 1024 (1.07-1.25x); TF32 on (one product)
# only N = 1 gained (0.83-0.91x), N >= 4 lost up to 1.6x at D = 1024. Both paths keep the
# same contract (lse2, ez2), so a forward and its backward may take either. A float32 gemv
# variant (CudaForward) that takes the call runs its own forward first (one launch; the tuning
# table's choice at N <= 16); its backward still takes this path.
F32_LOGITS_MAX_ROWS = {"tf32x3": 32, "tf32": 1}
F32_LOGITS_MAX_ELEMS = {"tf32x3": 1 << 19, "tf32": 0}
F32_LOGITS_MAX_BYTES = 16 << 20


def logits_path(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether forward and backward take the float32 few-rows path (F32_LOGITS_MAX_ROWS,
    F32_LOGITS_MAX_ELEMS)."""
    if hidden.dtype != torch.float32 or not hidden.is_cuda:
        return False
    N, V = hidden.shape[0], weight.shape[0]
    prec = _precision(torch.float32)
    return (N <= F32_LOGITS_MAX_ROWS[prec] or N * V <= F32_LOGITS_MAX_ELEMS[prec]) and N * V * 4 <= F32_LOGITS_MAX_BYTES


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer a launch returns or reads back comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def forward(mod, hidden, weight, target, bias, temperature: float, ignore_index: int,
            with_entropy: bool, *, splits: Optional[int] = None, shape: Optional[tuple] = None):
    """Launch the forward on checked, contiguous hidden [N, D], weight [V, D], target [N],
    bias [V] or None. Returns (logp [N], entropy [N] or [0], lse2 [N], ez2 [N] or [0]),
    all float32; lse2 and ez2 are the base-2 log-sum-exp and mean logit the backward needs.
    `splits` overrides the per-call choice of splits (tests of split invariance); `shape`
    (N elements) is logp's and entropy's shape instead of [N] (the fast path's leading dims)."""
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    f32 = torch.float32
    if logits_path(hidden, weight) and not (isinstance(mod, CudaForward) and mod.takes(hidden, weight, bias)):
        from kgen.families.linear_logp import kept  # (kept imports this module)

        return kept.forward_kept(mod, hidden, weight, target, bias, temperature, ignore_index, with_entropy,
                                 shape=shape)[:4]
    logp, entropy, lse2, ez2 = _outputs(N, with_entropy, dev, shape)
    if N == 0:
        return logp, entropy, lse2, ez2
    scale = LOG2E / temperature
    if isinstance(mod, CudaForward):
        if not mod.takes(hidden, weight, bias):
            return forward(mod.triton, hidden, weight, target, bias, temperature, ignore_index, with_entropy,
                           shape=shape)
        splits = splits or mod.splits(N, V, dev)
        mod.partials(hidden, weight, target, bias, temperature, with_entropy, splits,  # partials, combine
                     (logp, entropy, lse2, ez2), ignore_index, _empty((4, splits, N), f32, dev))
        return logp, entropy, lse2, ez2
    splits = splits or triton_splits(mod, N, V, dev)
    prec = _precision(hidden.dtype)
    target_dot = not _target_in_tile(hidden.dtype, prec)
    part = _empty((4, splits, N), f32, dev)  # plane 2 unwritten when target_dot
    h_src, w_src, tma = _tile_sources(mod, hidden, weight)
    triton_launch.launch(
        mod.linear_logp_fwd_kernel, fwd_grid(mod, N, splits),
        (h_src, w_src, bias if bias is not None else weight, target, part, N, V, D, splits, scale),
        dict(HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, TARGET_IN_TILE=not target_dot,
             PRECISION=prec, TMA=tma, **_tiles(mod)))
    combine(mod, part, splits, hidden, weight, target, bias, (logp, entropy, lse2, ez2), scale, ignore_index,
            with_entropy, target_dot)
    return logp, entropy, lse2, ez2


def _outputs(N: int, with_entropy: bool, dev, shape: Optional[tuple] = None):
    """The forward's (logp, entropy or [0], lse2, ez2 or [0]), unwritten, float32; logp and
    entropy shaped `shape` (N elements) when given."""
    f32 = torch.float32
    out = (N,) if shape is None else shape
    return (_empty(out, f32, dev), _empty(out if with_entropy else (0,), f32, dev),
            _empty((N,), f32, dev), _empty((N if with_entropy else 0,), f32, dev))


def combine(mod, part, splits: int, hidden, weight, target, bias, outs, scale: float, ignore_index: int,
            with_entropy: bool, target_dot: bool) -> None:
    """`mod`'s linear_logp_combine_kernel: the `splits` partials part [4, splits, N] into
    outs = (logp, entropy, lse2, ez2); target_dot: the target logit by a gather-dot
    (partials plane 2 unwritten), else summed from plane 2."""
    triton_launch.launch(*combine_launch(mod, part, splits, hidden, weight, target, bias, outs, scale, ignore_index,
                                         with_entropy, target_dot))


def combine_launch(mod, part, splits: int, hidden, weight, target, bias, outs, scale: float, ignore_index: int,
                   with_entropy: bool, target_dot: bool) -> tuple:
    """combine's launch as (kernel, grid, args, options); scale is the 15th argument."""
    logp, entropy, lse2, ez2 = outs
    N, D = hidden.shape
    block = COMBINE_DOT_BLOCK if target_dot else COMBINE_BLOCK
    return (mod.linear_logp_combine_kernel, combine_grid(N, block),
            (part, target, hidden, weight, bias if bias is not None else weight,
             logp, entropy if with_entropy else logp, lse2, ez2 if with_entropy else lse2,
             N, weight.shape[0], D, splits, ignore_index, scale),
            dict(WITH_ENTROPY=with_entropy, TARGET_DOT=target_dot, HAS_BIAS=bias is not None,
                 BLOCK=block, BLOCK_D=TARGET_BLOCK_D))


def _gradients(hidden, weight, bias):
    """(grad_hidden, grad_weight, grad_bias or None), unwritten, in the inputs' dtype; with
    no rows (N = 0) the weight's and bias's are zeros (sums over no rows) and returned so."""
    N, D = hidden.shape
    V = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    grad_h = _empty((N, D), dtype, dev)
    grad_w = _empty((V, D), dtype, dev)
    grad_b = _empty((V,), dtype, dev) if bias is not None else None
    if N == 0:
        grad_w.zero_()
        if grad_b is not None:
            grad_b.zero_()
    return grad_h, grad_w, grad_b
