"""linear_logp's backward launches: `backward` (with `backward_plan`, what a backward call
decides once per shape), on a Triton module or a `CudaForward` (cuda_variant), from the
forward's lse2 and ez2 (launch.forward). Every buffer comes from launch._empty.

Backward: recompute by V chunks, deterministic (no two adders of one element race). For
each chunk [v0, v1):
  dz kernel:  recompute logits, write dz (input dtype) to a workspace [N, chunk] (the
              first chunks: to grad_weight's unwritten rows, below) and float32 column
              sums per row tile (for grad_bias);
  dW:         grad_weight[v0:v1] = dz^T @ hidden, the whole N reduction in one GEMM, each
              output element written once in the output dtype;
  dH:         acc += dz @ weight[v0:v1] into float32 sums of grad_hidden; grad_hidden is
              written in its dtype after the last chunk.
  dW and dH are cuBLAS GEMMs through torch (dH with addmm's float32 out_dtype; float32 with
  TF32 on takes dW's hidden from a transposed copy in grad_weight's last rows, HT_COPY),
  float32 with TF32 off too: there cuBLAS's float32 GEMM (no tensor cores, ~50 TFLOP/s on an H200)
  ran 1.4-1.7x faster than Triton "tf32x3" kernels did at large sizes (BENCHMARKS.md,
  forty-fourth session): dz^T and weight[v0:v1] reach a GEMM with their reduction dimension
  strided, and TF32 tensor-core products read only K-contiguous operands from shared
  memory, so every tile went through registers to be transposed. Except dH there, with
  DH_TRITON on, where its grid fills the GPU and TMA applies (backward_plan's dh_cols):
  weight[v0:v1] is copied transposed (wt [D, chunk], in the workspace budget) and
  linear_logp_bwd_dh_kernel multiplies K-contiguous tiles, as the dz kernel does, adding to
  the sums with one atomic per element (its only adder in that launch). Why not one fused
  kernel with atomics: grad_weight would need a float32 [V, D] buffer (1.2-2 GiB at the
  target shapes) and grad_hidden one of N*D*4 bytes; atomics into the 16-bit outputs would
  not accumulate in float32. The price
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

from kgen.families.linear_logp import cuda_variant, launch, plans
from kgen.families.linear_logp.cuda_variant import CudaForward
from kgen.families.linear_logp.plans import (
    GROUP, LOG2E, AccumulatorPlan, Chunk, _cdiv, _precision, _tile_sources, _tiles, _tma, accumulator_plan,
    chunk_schedule, dh_grid, dh_sources, dz_grid, dz_stride, workspace_chunk)
from kgen.runtime import triton_launch
from kgen.runtime.op import sm_count

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
# Module switch: True lets float32's dH (TF32 off) run linear_logp_bwd_dh_kernel where its
# grid fills the GPU (backward_plan's dh_cols); False keeps it on cuBLAS. On an H200 the
# kernel (atomic-add epilogue, no stack) took the training step 35.21 -> 32.58 ms at
# 4096 x 2048 x 32000 and 68.77 -> 65.92 at 1024 x 4096 x 128256 (1.02x / 1.05x
# torch.compile's), gradients against float64 and the cuBLAS dH in the GPU tests
# (BENCHMARKS.md, forty-fifth session).
DH_TRITON = True
# Module switch: True lets float32 with TF32 on take dW from a transposed copy of hidden
# (backward_plan's ht_from): cuBLAS's TF32 GEMMs want the reduction dimension contiguous in
# their second operand, and grad_weight = dz^T @ hidden reads hidden along N. On an H200,
# per chunk (N x chunk x D): 267 -> 173 us at 4096 x 3584 x 2048, 513 -> 368 at 1024 x 14336
# x 4096, 529 -> 343 at 8192 x 1792 x 4096 (the forward-layout GEMM: 170 / 356 / 356;
# BENCHMARKS.md, forty-fifth session). The copy lives in grad_weight's last rows, not yet
# written: no memory; the chunks over those rows read hidden itself.
HT_COPY = True
_PLANS: dict = {}


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
    dh_cols: int  # float32, TF32 off: columns of the transposed weight copy for the Triton dH kernel (0: cuBLAS)
    ht_from: int  # float32, TF32 on: grad_weight row where hidden's transposed copy starts (V: none)
    ht_ld: int  # that copy's row stride: N rounded up to 16 bytes


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
           IN_PLACE, cuda_variant.CUDA_DZ, cuda_variant.CUDA_DZ_MAX_FLOP, DH_TRITON, HT_COPY, plans.TMA)
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
    # float32, TF32 off: dH by the Triton kernel over K-contiguous tiles where its grid has at
    # least a program per SM and TMA applies; the workspace then also holds weight chunks
    # transposed (D rows more a column)
    dh = (DH_TRITON and prec == "tf32x3" and _tma(hidden, weight) and N * D < 2 ** 31  # (int32 offsets)
          and dh_grid(mod, N, D)[0] >= sm_count(hidden.device, 0))
    chunk = workspace_chunk(N + D if dh else N, V, esize, granule, workspace_bytes - acc.separate_bytes)
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
    one_chunk = not dh and acc.home in ("output", "direct") and [tuple(c) for c in chunks] == [(0, V, None)]
    # float32, TF32 on, several chunks: hidden transposed ([D, ht_ld], D * ht_ld elements:
    # ht_ld rows of D) into grad_weight's last rows from ht_from (a granule edge), where
    # in-place chunks stop; the chunks below it take dW from the copy
    ht_ld = _cdiv(N, 4) * 4
    ht_from = (V - ht_ld) // granule * granule
    if HT_COPY and prec == "tf32" and acc.home == "output" and not one_chunk and ht_from >= granule:
        chunks = chunk_schedule(N, D, V, esize, granule, chunk, ht_from, bpart_rows, in_place=IN_PLACE)
    else:
        ht_from = V
    return BackwardPlan(impl, mod, cuda, acc, chunk, space, rows_view, tiles_n, tuple(chunks),
                        dict(PRECISION=prec, GROUP=GROUP, **_tiles(mod)), one_chunk, chunk if dh else 0,
                        ht_from, ht_ld)


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
    if launch.logits_path(hidden, weight):
        from kgen.families.linear_logp import kept  # (kept imports this module)

        return kept.backward_kept(mod, kept.kept_logits(hidden, weight), hidden, weight, target, bias, lse2, ez2,
                                  grad_logp, grad_entropy, temperature, ignore_index, on_grad_hidden=on_grad_hidden)
    grad_h, grad_w, grad_b = launch._gradients(hidden, weight, bias)
    if N == 0:
        return grad_h, grad_w, grad_b
    p = backward_plan(mod, hidden, weight, bias, workspace_bytes, accumulator_bytes)
    mod, cuda, plan, chunk, common = p.mod, p.cuda, p.acc, p.chunk, p.common
    with_entropy = grad_entropy is not None
    if p.one_chunk:
        # The small calls' path: the whole vocabulary's dz in the workspace, then the two
        # GEMMs into the outputs (what the general path below does for this plan, without
        # its views: a slice costs the host about what an allocation does).
        dz = launch._empty((N, chunk), dtype, dev)
        if cuda is not None and dz.data_ptr() % 16 == 0:
            cuda.dz(hidden, weight, target, lse2, ez2 if with_entropy else None, grad_logp,
                    grad_entropy, dz, 0, V, temperature, ignore_index)
        else:
            bpart = launch._empty((p.tiles_n, chunk), torch.float32, dev) if bias is not None else dz
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
        torch.mm(_cpu_rows(a), weight, out=grad_h)
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
        sums = launch._empty((min(plan.row_block, N), D), torch.float32, dev) if plan.separate_bytes else None
        pieces = [(0, N, sums)]
    else:
        own = plan.own_rows
        pieces = [(0, own, grad_h.view(-1)[:own * D * 4 // esize].view(torch.float32).view(own, D))] if own else []
        if plan.home == "separate":
            pieces.append((own, N, launch._empty((N - own, D), torch.float32, dev)))
        else:  # "tail"
            home = grad_w.view(-1)[alias_from * D:alias_from * D + (N - own) * D * 4 // esize]
            pieces.append((own, N, home.view(torch.float32).view(N - own, D)))

    # One workspace, [N, chunk] and, for row blocks, also viewed as [row_block, block_width].
    space = launch._empty(p.space, dtype, dev)
    dz = space if len(p.space) == 2 else space[:N * chunk].view(N, chunk)
    bpart = launch._empty((p.tiles_n, chunk), torch.float32, dev) if bias is not None else dz

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

    if p.ht_from < V:  # hidden transposed, in grad_weight's rows [ht_from, ...) (backward_plan)
        at = p.ht_from * D
        ht = grad_w.view(-1)[at:at + D * p.ht_ld].view(D, p.ht_ld)[:, :N]
        ht.copy_(hidden.T)
        h_dw = ht.T
    else:
        h_dw = hidden

    def dw_pass(v0, v1, dz=dz):
        # (no views where the chunk is all of dz's columns or of the vocabulary)
        a = dz if v1 - v0 == dz.shape[1] else dz[:, :v1 - v0]
        torch.mm(a.T, h_dw if v1 <= p.ht_from else hidden, out=grad_w if v1 - v0 == V else grad_w[v0:v1])

    wt = launch._empty((D, p.dh_cols), dtype, dev) if p.dh_cols else None

    def dh_pass(first, v0, v1, pieces, dz=dz, dz_row0=0):
        """acc (+)= dz @ weight[v0:v1] for each piece; dz's row r0 is dz_row0."""
        for r0, r1, acc in pieces:
            if wt is not None:  # (float32: acc is grad_h itself, one piece)
                _dh_triton(mod, dz[r0 - dz_row0:r1 - dz_row0], weight, v0, v1, acc, first, wt, common)
                continue
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


def _dh_triton(mod, dz, weight, v0: int, v1: int, acc, first: bool, wt, common: dict) -> None:
    """acc (+)= dz[:, :v1 - v0] @ weight[v0:v1] by linear_logp_bwd_dh_kernel, in pieces of
    wt's columns: each piece's weight rows copied transposed into wt first (a chunk in
    grad_weight's rows may be wider than the workspace's)."""
    n, D = acc.shape
    cols = wt.shape[1]
    for p0 in range(v0, v1, cols):
        width = min(v1, p0 + cols) - p0
        wt[:, :width].copy_(weight[p0:p0 + width].T)
        dz_src, wt_src = dh_sources(mod, dz[:, p0 - v0:], width, wt)
        triton_launch.launch(mod.linear_logp_bwd_dh_kernel, dh_grid(mod, n, D), (dz_src, wt_src, acc, n, D, width),
                             dict(ACCUMULATE=not (first and p0 == v0), **common))


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc = (acc if not first) + a @ b, with float32 sums for 16-bit a and b (cuBLAS's
    out_dtype path on CUDA; on the CPU, where tests run the backward, in float32 math)."""
    if acc.dtype == a.dtype:  # grad_hidden itself: float32, or one chunk ("direct")
        a = _cpu_rows(a)
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


def _cpu_rows(a: torch.Tensor) -> torch.Tensor:
    """a itself on a GPU; on the CPU, where the tests run the backward, a row-strided view
    copied to contiguous rows: torch 2.13's CPU bfloat16 GEMM (oneDNN on AMX) reads a
    row-strided first operand past its last column, into the padding of dz's rows (poisoned
    with NaN by the tests, uninitialised otherwise: NaN or inf in grad_hidden)."""
    return a if a.is_cuda or a.stride(0) == a.shape[1] else a.contiguous()
