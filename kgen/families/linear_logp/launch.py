"""linear_logp's kernel launches: `forward` and `backward` (with `backward_plan`, what a
backward call decides once per shape), on a Triton module or a `CudaForward`
(cuda_variant: a CUDA variant's kernels with their Triton companion). Every buffer they
return or read back comes from `_empty`.

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

Backward: recompute by V chunks, no atomics (deterministic). For each chunk [v0, v1):
  dz kernel:  recompute logits, write dz (input dtype) to a workspace [N, chunk] (the
              first chunks: to grad_weight's unwritten rows, below) and float32 column
              sums per row tile (for grad_bias);
  dW:         grad_weight[v0:v1] = dz^T @ hidden, the whole N reduction in one GEMM, each
              output element written once in the output dtype;
  dH:         acc += dz @ weight[v0:v1] into float32 sums of grad_hidden; grad_hidden is
              written in its dtype after the last chunk.
  dW and dH are cuBLAS GEMMs through torch (dH with addmm's float32 out_dtype), float32
  with TF32 off too: there cuBLAS's float32 GEMM (no tensor cores, ~50 TFLOP/s on an H200)
  ran 1.4-1.7x faster than Triton "tf32x3" kernels did at large sizes (BENCHMARKS.md,
  forty-fourth session): dz^T and weight[v0:v1] reach a GEMM with their reduction dimension
  strided, and TF32 tensor-core products read only K-contiguous operands from shared
  memory, so every tile went through registers to be transposed. Why not one fused kernel with atomics: grad_weight would
  need a float32 [V, D] buffer (1.2-2 GiB at the target shapes) and grad_hidden one of
  N*D*4 bytes; atomics into the 16-bit outputs would not accumulate in float32. The price
  of separate passes is that dz makes one round trip through the workspace (N*V*elsize
  written once, read twice; a chunk of up to 56 MiB mostly stays in a 50 MiB L2) and the
  float32 sums are read and written once per chunk (8*N*D bytes: dH runs at ~1.2x a
  same-sized GEMM at 2560 columns, 8192 x 4096).
  The float32 sums (plans.accumulator_plan): none when the whole vocabulary is one chunk
  (grad_hidden = dz @ weight, one GEMM in its dtype); grad_hidden itself when it is float32; a
  separate buffer when N*D*4 <= accumulator_bytes; otherwise the first N*elsize/4 rows'
  sums in grad_hidden's own buffer (converted in place at the end, CONVERT_BYTES at a
  time) and the other rows' in a separate buffer if they fit the budget, or else in the
  last ~2N rows of the still-unwritten grad_weight, whose dz (but for the last chunk's,
  still in the workspace) is recomputed after grad_hidden is done (N/V of one logits GEMM
  at most: 3.6% at 8192 x 128256 with 3584-column chunks); if even that does not fit
  (V < ~N) grad_hidden is made by blocks of accumulator_bytes / (4D) rows, each recomputing
  its logits chunk by chunk, before grad_weight's pass over all rows (one more logits GEMM).
  The chunks (plans.chunk_schedule): grad_weight is written from row 0 up, so while chunk
  [v0, v1) runs its rows from v1 to the tail's sums (or V) are free. The first chunks keep
  their dz and bias sums there rather than in the workspace, as wide as the room allows:
  ~(alias_from - v0) * D / (N + D) columns, shrinking by N / (N + D) a chunk until no wider
  than the workspace, then workspace chunks. Fewer chunks, fewer passes over the float32
  sums: bf16 8192 x 4096 x 128256, 12 chunks instead of 37 (3.2 GB of sums traffic instead
  of 9.9); 4096 x 2048 x 151936, 9 instead of 30. But such a chunk's dz (hundreds of MiB)
  no longer stays in L2 for its two GEMMs: up to 2*N*V*elsize bytes more read (3.8 GB at
  8192 x 128256, against 6.7 GB of sums traffic saved). Measured on an H100 (BENCHMARKS.md,
  thirteenth session), forward + backward over the forward GEMM: 4096 x 2048 x 151936 4.17
  (was 4.47), 2048 x 8192 x 128256 3.80 (4.50), 8192 x 4096 x 128256 4.05-4.27 over three
  runs (4.21), 16384 x 4096 x 32000 5.1-5.6 (5.50: its tail home leaves little room). Not
  for row blocks: their grad_weight pass keeps no sums.
  The dz kernel: the Triton one, or on sm_90a variants without a bias where the call is
  host-bound (cuda_variant.CUDA_DZ) the CUDA variant's own (CudaForward.dz: its WGMMA mainloop with a dz
  epilogue, one C call instead of a Triton launch and its TMA descriptors).
  Extra memory: N*chunk*elsize (workspace, chunk = the budget / (N*elsize) rounded to the
  tile; the budget, WORKSPACE_BYTES by default, also pays for a separate accumulator) +
  cdiv(N, BLOCK_N)*chunk*4 (bias sums) + 8N (row coefficients) + CONVERT_BYTES at the end:
  < 64 MiB at every shape; chunks in grad_weight's rows cost none.
  With keep_logits the forward keeps the logits and the backward reads them instead: see
  the module `kept`.
  All of the above but the buffers and the launches is decided by backward_plan, once per
  (implementation, N, D, V, dtype, device, bias, alignment, precision, budgets, switches):
  a repeated small call runs its allocations, views and launches only.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

import torch

from kgen.families.linear_logp import cuda_variant
from kgen.families.linear_logp.cuda_variant import CudaForward
from kgen.families.linear_logp.plans import (
    COMBINE_BLOCK, COMBINE_DOT_BLOCK, GROUP, LOG2E, TARGET_BLOCK_D, AccumulatorPlan, Chunk, _cdiv, _precision,
    _target_in_tile, _tile_sources, _tiles, accumulator_plan, chunk_schedule, combine_grid,
    dz_grid, dz_stride, fwd_grid, triton_splits, workspace_chunk)
from kgen.runtime import triton_launch

LN2 = 0.6931471805599453
# Backward budgets (bytes): the dz chunk workspace (by default together with a separate
# accumulator, if any), and the largest float32 grad_hidden accumulator allocated
# separately before borrowing grad_hidden's and grad_weight's own memory instead.
WORKSPACE_BYTES = 56 << 20
ACCUMULATOR_BYTES = 16 << 20
# The copy through which sums kept in grad_hidden's own buffer become its values.
CONVERT_BYTES = 4 << 20
# Module switch: False keeps every backward chunk's dz in the workspace (no wide early
# chunks in grad_weight's unwritten rows, plans.chunk_schedule; tests run both paths).
IN_PLACE = True
# Module switch: False (KGEN_LINEAR_LOGP_PLAN_CACHE=0) makes backward_plan anew on every
# call instead of taking it from _PLANS (tools/llp_small_calls.py measures both).
PLAN_CACHE = os.environ.get("KGEN_LINEAR_LOGP_PLAN_CACHE", "1") != "0"
PLANS_MAX = 256  # plans kept; the cache starts over when full
_PLANS: dict = {}
# float32 at a few rows on the GPU: the logits by one cuBLAS GEMM (a GEMV at N = 1: the
# weight read once at bandwidth), then the `kept` module's kernels over them, forward and
# backward (the backward recomputes them so), rather than the Triton tiles, whose 64 rows
# a program multiply zeros at N << 64. Where N <= F32_LOGITS_MAX_ROWS[the dot precision]
# and the logits take at most F32_LOGITS_MAX_BYTES (temporary, freed by the end of each
# pass: the backward holds them and dz of the same size, within the 64 MiB promise). The bounds, from an H200 (BENCHMARKS.md, forty-fourth session): TF32 off ("tf32x3",
# three tensor-core products a step) the logits path took 0.4-0.9x the tiles' GPU time
# forward and 0.46-0.95x forward + backward up to N = 32, mixed at 64; TF32 on (one
# product) only N = 1 gained (0.83-0.91x), N >= 4 lost up to 1.6x at D = 1024. Both paths
# keep the same contract (lse2, ez2), so a forward and its backward may take either.
F32_LOGITS_MAX_ROWS = {"tf32x3": 32, "tf32": 1}
F32_LOGITS_MAX_BYTES = 16 << 20


def logits_path(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether forward and backward take the float32 few-rows path (F32_LOGITS_MAX_ROWS)."""
    N = hidden.shape[0]
    return (hidden.dtype == torch.float32 and hidden.is_cuda and N <= F32_LOGITS_MAX_ROWS[_precision(torch.float32)]
            and N * weight.shape[0] * 4 <= F32_LOGITS_MAX_BYTES)


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
    if logits_path(hidden, weight):
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
    logp, entropy, lse2, ez2 = outs
    N, D = hidden.shape
    block = COMBINE_DOT_BLOCK if target_dot else COMBINE_BLOCK
    triton_launch.launch(
        mod.linear_logp_combine_kernel, combine_grid(N, block),
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


def _chunks(begin: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(v, min(v + size, end)) for v in range(begin, end, size)]


class BackwardPlan(NamedTuple):
    """What a backward call does, decided from its shapes, dtype, bias or not, pointer
    alignment, budgets and the module switches alone (see backward_plan)."""
    impl: Any  # what backward was given (held: its id is in the plan's key)
    mod: Any  # the Triton module: its dz kernel (unless `cuda`), its tiles
    cuda: Optional[CudaForward]  # the CUDA dz kernel's variant, where it applies
    acc: AccumulatorPlan
    chunk: int  # the workspace's columns
    space: tuple  # the workspace's shape: [N, chunk], or flat where row blocks view it too
    rows_view: tuple[int, int]  # "rows": (rows, columns) of a block's dz; else (0, 0)
    tiles_n: int  # row tiles of the Triton dz kernel (rows of the bias sums)
    chunks: tuple[Chunk, ...]
    common: dict  # the Triton dz kernel's tile and precision constants
    one_chunk: bool  # one workspace chunk of all of V, no float32 sums: backward's short path


def backward_plan(mod, hidden, weight, bias, workspace_bytes: Optional[int] = None,
                  accumulator_bytes: Optional[int] = None) -> BackwardPlan:
    """The plan of a backward call, cached per key (PLAN_CACHE): everything it depends on
    is in the key -- the implementation, (N, D, V), dtype, device, bias or not, whether
    hidden and weight start on 16 bytes (the CUDA dz kernel's condition), the precision
    (float32: TF32 allowed or not), the budgets and the switches IN_PLACE, CUDA_DZ and
    CUDA_DZ_MAX_FLOP. A small call then pays a dictionary look-up instead of the plans
    (tens of us of Python a call)."""
    workspace_bytes = WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    accumulator_bytes = ACCUMULATOR_BYTES if accumulator_bytes is None else accumulator_bytes
    N, D = hidden.shape
    dtype = hidden.dtype
    prec = _precision(dtype)
    if not PLAN_CACHE:
        return _make_plan(mod, hidden, weight, bias, prec, workspace_bytes, accumulator_bytes)
    key = (id(mod), N, D, weight.shape[0], dtype, hidden.device, bias is None,
           (hidden.data_ptr() | weight.data_ptr()) % 16 == 0, prec, workspace_bytes, accumulator_bytes,
           IN_PLACE, cuda_variant.CUDA_DZ, cuda_variant.CUDA_DZ_MAX_FLOP)
    plan = _PLANS.get(key)
    if plan is None or plan.impl is not mod:
        if len(_PLANS) >= PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = _make_plan(mod, hidden, weight, bias, prec, workspace_bytes, accumulator_bytes)
    return plan


def _make_plan(impl, hidden, weight, bias, prec: str, workspace_bytes: int, accumulator_bytes: int
               ) -> BackwardPlan:
    mod, cuda = impl, None
    if isinstance(mod, CudaForward):
        cuda = mod if mod.takes_dz(hidden, weight, bias) else None
        mod = mod.triton
    N, D = hidden.shape
    V = weight.shape[0]
    dtype = hidden.dtype
    esize = dtype.itemsize
    granule = max(mod.BLOCK_V, mod.BLOCK_D)
    acc = accumulator_plan(N, D, V, dtype, granule, accumulator_bytes, workspace_bytes)
    chunk = workspace_chunk(N, V, esize, granule, workspace_bytes - acc.separate_bytes)
    # (Row-block rows padded to 16 bytes: cuBLAS's fast kernels want aligned leading dimensions.)
    rows_view = (min(acc.row_block, N), _cdiv(acc.block_width, 8) * 8) if acc.home == "rows" else (0, 0)
    space = (max(N * chunk, rows_view[0] * rows_view[1]),) if acc.home == "rows" else (N, chunk)
    # The vocabulary chunks (plans.chunk_schedule): the first ones wider than the workspace,
    # with their dz and bias sums in grad_weight's rows not yet written. Not for row blocks:
    # their grad_weight pass keeps no float32 sums, which is what wider chunks save.
    # ("direct" has one chunk: the workspace holds all of V, no chunk is wider.)
    tiles_n = _cdiv(N, mod.BLOCK_N)
    bpart_rows = _cdiv(tiles_n * 4, esize) if bias is not None else 0  # float32 sums, in dz rows
    chunks = chunk_schedule(N, D, V, esize, granule, chunk, acc.alias_from, bpart_rows,
                            in_place=IN_PLACE and acc.home != "rows")
    one_chunk = acc.home in ("output", "direct") and [tuple(c) for c in chunks] == [(0, V, None)]
    return BackwardPlan(impl, mod, cuda, acc, chunk, space, rows_view, tiles_n, tuple(chunks),
                        dict(PRECISION=prec, GROUP=GROUP, **_tiles(mod)), one_chunk)


def backward(mod, hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy,
             temperature: float, ignore_index: int, *, workspace_bytes: Optional[int] = None,
             accumulator_bytes: Optional[int] = None, on_grad_hidden=None):
    """Gradients (hidden [N, D], weight [V, D], bias [V] or None) in the input dtype, from
    the forward's lse2/ez2 and the upstream gradients (grad_entropy None when the entropy
    was not requested; grad_logp None means zeros). Budgets default to WORKSPACE_BYTES and
    ACCUMULATOR_BYTES; chunking and the accumulator's home: see the module docstring, and
    backward_plan for what is decided once per shape.
    `on_grad_hidden(grad_h)` is called once grad_hidden's kernels are queued, before the
    grad_weight passes that follow them (the vocab-parallel op starts its all-reduce
    there)."""
    N, D = hidden.shape
    V = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    if logits_path(hidden, weight):
        from kgen.families.linear_logp import kept  # (kept imports this module)

        return kept.backward_kept(mod, kept.kept_logits(hidden, weight), hidden, weight, target, bias, lse2, ez2,
                                  grad_logp, grad_entropy, temperature, ignore_index, on_grad_hidden=on_grad_hidden)
    grad_h, grad_w, grad_b = _gradients(hidden, weight, bias)
    if N == 0:
        return grad_h, grad_w, grad_b
    p = backward_plan(mod, hidden, weight, bias, workspace_bytes, accumulator_bytes)
    mod, cuda, plan, chunk, common = p.mod, p.cuda, p.acc, p.chunk, p.common
    with_entropy = grad_entropy is not None
    if p.one_chunk:
        # The small calls' path: the whole vocabulary's dz in the workspace, then the two
        # GEMMs into the outputs (what the general path below does for this plan, without
        # its views: a slice costs the host about what an allocation does).
        dz = _empty((N, chunk), dtype, dev)
        if cuda is not None and dz.data_ptr() % 16 == 0:
            cuda.dz(hidden, weight, target, lse2, ez2 if with_entropy else None, grad_logp,
                    grad_entropy, dz, 0, V, temperature, ignore_index)
        else:
            bpart = _empty((p.tiles_n, chunk), torch.float32, dev) if bias is not None else dz
            h_src, w_src, tma = _tile_sources(mod, hidden, weight)
            g_logp = grad_logp if grad_logp is not None else lse2
            triton_launch.launch(
                mod.linear_logp_bwd_dz_kernel, dz_grid(mod, N, V),
                (h_src, w_src, bias if bias is not None else weight, target, lse2, ez2 if with_entropy else lse2,
                 g_logp, grad_entropy if with_entropy else g_logp, dz, bpart,
                 N, V, D, 0, V, chunk, LOG2E / temperature, 1.0 / temperature, ignore_index),
                dict(HAS_BIAS=bias is not None, WRITE_BPART=bias is not None, WITH_ENTROPY=with_entropy,
                     HAS_GLOGP=grad_logp is not None, TMA=tma, **common))
            if bias is not None:
                grad_b.copy_((bpart if chunk == V else bpart[:, :V]).sum(0))
        a = dz if chunk == V else dz[:, :V]
        torch.mm(a.T, hidden, out=grad_w)
        torch.mm(a, weight, out=grad_h)
        if on_grad_hidden is not None:
            on_grad_hidden(grad_h)
        return grad_h, grad_w, grad_b
    alias_from, esize = plan.alias_from, hidden.element_size()

    # the dz kernel reads the upstream gradients itself (no launches to prepare them)
    g_logp = grad_logp if grad_logp is not None else lse2
    g_ent = grad_entropy if with_entropy else g_logp

    # The float32 grad_hidden accumulator as pieces (r0, r1, acc) for rows [r0, r1): see
    # plans.accumulator_plan. The workspace budget also pays for a separate one.
    if plan.home in ("output", "direct"):
        pieces = [(0, N, grad_h)]
    elif plan.home == "rows":
        pieces = [(0, N, _empty((min(plan.row_block, N), D), torch.float32, dev) if plan.separate_bytes else None)]
    else:
        own = plan.own_rows
        pieces = [(0, own, grad_h.view(-1)[:own * D * 4 // esize].view(torch.float32).view(own, D))] if own else []
        if plan.home == "separate":
            pieces.append((own, N, _empty((N - own, D), torch.float32, dev)))
        else:  # "tail"
            home = grad_w.view(-1)[alias_from * D:alias_from * D + (N - own) * D * 4 // esize]
            pieces.append((own, N, home.view(torch.float32).view(N - own, D)))

    # One workspace, [N, chunk] and, for row blocks, also viewed as [row_block, block_width].
    space = _empty(p.space, dtype, dev)
    dz = space if len(p.space) == 2 else space[:N * chunk].view(N, chunk)
    bpart = _empty((p.tiles_n, chunk), torch.float32, dev) if bias is not None else dz

    # (the Triton dz kernel's tile sources: TMA descriptors cost host time the CUDA one saves)
    h_src, w_src, tma = _tile_sources(mod, hidden, weight) if cuda is None else (hidden, weight, False)

    row_inputs = (target, lse2, ez2 if with_entropy else lse2, g_logp, g_ent)

    def dz_pass(v0, v1, write_bpart, rows=None, dz=dz, bpart=bpart):
        if cuda is not None and dz.data_ptr() % 16 == 0 and dz.stride(0) % 2 == 0:
            # one C call (no bias here, so no column sums for grad_bias)
            if rows is None:
                h, t, lse, ez, gl, ge = hidden, target, lse2, ez2, grad_logp, grad_entropy
            else:
                h, t, lse, ez, gl, ge = (x[rows[0]:rows[1]] if x is not None else None
                                         for x in (hidden, target, lse2, ez2, grad_logp, grad_entropy))
            cuda.dz(h, weight, t, lse, ez if with_entropy else None, gl, ge if with_entropy else None, dz,
                    v0, v1, temperature, ignore_index)
            return
        if rows is None:
            n, h, per_row = N, h_src, row_inputs
        else:
            r0, r1 = rows
            n, h = r1 - r0, _tile_sources(mod, hidden[r0:r1], weight)[0]
            per_row = tuple(x[r0:r1] for x in row_inputs)
        triton_launch.launch(
            mod.linear_logp_bwd_dz_kernel, dz_grid(mod, n, v1 - v0),
            (h, w_src, bias if bias is not None else weight, *per_row, dz, bpart,
             n, V, D, v0, v1, dz.stride(0), LOG2E / temperature, 1.0 / temperature, ignore_index),
            dict(HAS_BIAS=bias is not None, WRITE_BPART=write_bpart, WITH_ENTROPY=with_entropy,
                 HAS_GLOGP=grad_logp is not None, TMA=tma, **common))
        if write_bpart:
            grad_b[v0:v1] = bpart[:, :v1 - v0].sum(0)

    def dw_pass(v0, v1, dz=dz):
        # (no views where the chunk is all of dz's columns or of the vocabulary)
        a = dz if v1 - v0 == dz.shape[1] else dz[:, :v1 - v0]
        torch.mm(a.T, hidden, out=grad_w if v1 - v0 == V else grad_w[v0:v1])

    def dh_pass(first, v0, v1, pieces, dz=dz, dz_row0=0):
        """acc (+)= dz @ weight[v0:v1] for each piece; dz's row r0 is dz_row0."""
        for r0, r1, acc in pieces:
            a = dz if (r0 - dz_row0, r1 - dz_row0, v1 - v0) == (0, *dz.shape) else \
                dz[r0 - dz_row0:r1 - dz_row0, :v1 - v0]
            _accumulate(acc, a, weight if v1 - v0 == V else weight[v0:v1], first)

    def finish(pieces):
        """grad_hidden from the float32 sums (pieces in row order)."""
        for r0, r1, acc in pieces:
            if acc.dtype == dtype:
                continue  # grad_hidden itself
            if acc.data_ptr() == grad_h.data_ptr():
                # The sums of rows [0, r1) fill grad_hidden's own buffer: convert them in
                # blocks of at most CONVERT_BYTES, each through a copy, in row order: the
                # outputs of rows [b0, b1) end at byte b1 * D * esize, below the sums still
                # unread (from b1 * D * 4 on).
                step = max(1, CONVERT_BYTES // (D * esize))
                for b0 in range(r0, r1, step):
                    grad_h[b0:min(r1, b0 + step)] = acc[b0:min(r1, b0 + step)].to(dtype)
            else:
                grad_h[r0:r1] = acc

    tiles_n, chunks = p.tiles_n, p.chunks

    def views(c):
        """(dz, bpart) of chunk c: the workspace's, or its region of grad_weight's flat
        storage: dz [N, stride], then the bias sums [tiles_n, stride] in float32 (16-byte
        aligned: the region starts so and N * stride elements are whole 16-byte units)."""
        if c.at is None:
            return dz, bpart
        stride = dz_stride(c.v1 - c.v0)
        flat = grad_w.view(-1)
        c_dz = flat[c.at:c.at + N * stride].view(N, stride)
        if bias is None:
            return c_dz, c_dz
        b0 = c.at + N * stride
        return c_dz, flat[b0:b0 + tiles_n * stride * 4 // esize].view(torch.float32).view(tiles_n, stride)

    if plan.home == "rows":
        # grad_hidden's float32 sums over V would need N*D*4 bytes and grad_weight is too
        # short to lend them (V < ~N): grad_hidden block by block of rows, each block
        # recomputing its logits (the whole vocabulary at once, or chunk by chunk into a
        # block's float32 sums), then grad_weight and grad_bias over all rows.
        R, width = p.rows_view
        block_dz = space[:R * width].view(R, width)
        acc = pieces[0][2]
        for r0 in range(0, N, R):
            r1 = min(N, r0 + R)
            # no sums kept: the block's grad_hidden is one GEMM into its rows
            block = [(r0, r1, acc[:r1 - r0] if acc is not None else grad_h[r0:r1])]
            for i, (v0, v1) in enumerate(_chunks(0, V, plan.block_width)):
                dz_pass(v0, v1, False, (r0, r1), dz=block_dz)
                dh_pass(i == 0, v0, v1, block, dz=block_dz, dz_row0=r0)
            finish(block)
        if on_grad_hidden is not None:
            on_grad_hidden(grad_h)
        for v0, v1, _ in chunks:  # workspace chunks only
            dz_pass(v0, v1, bias is not None)
            dw_pass(v0, v1)
        return grad_h, grad_w, grad_b

    for i, c in enumerate(chunks):
        c_dz, c_bpart = views(c)  # (the bias sums' row stride is dz's: the kernel writes both with it)
        dz_pass(c.v0, c.v1, bias is not None, dz=c_dz, bpart=c_bpart)
        if c.v1 <= alias_from:
            dw_pass(c.v0, c.v1, c_dz)  # rows [v0, v1): below the chunk's own dz region
        dh_pass(i == 0, c.v0, c.v1, pieces, dz=c_dz)
    finish(pieces)
    if on_grad_hidden is not None:
        on_grad_hidden(grad_h)
    if alias_from < V:
        # grad_hidden is final: grad_weight's tail is free. The tail's chunks are workspace
        # ones (in-place chunks end before alias_from); the last one's dz is still in the
        # workspace, the others are recomputed.
        tail = [c for c in chunks if c.v0 >= alias_from]
        dw_pass(tail[-1].v0, tail[-1].v1)
        for v0, v1, _ in tail[:-1]:
            dz_pass(v0, v1, False)
            dw_pass(v0, v1)
    return grad_h, grad_w, grad_b


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc = (acc if not first) + a @ b, with float32 sums for 16-bit a and b (cuBLAS's
    out_dtype path on CUDA; on the CPU, where tests run the backward, in float32 math)."""
    if acc.dtype == a.dtype:  # grad_hidden itself: float32, or one chunk ("direct")
        if first:
            torch.mm(a, b, out=acc)
        else:
            torch.addmm(acc, a, b, out=acc)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, beta=0 if first else 1, out_dtype=torch.float32, out=acc)
    elif first:
        torch.mm(a.float(), b.float(), out=acc)
    else:
        acc.addmm_(a.float(), b.float())
