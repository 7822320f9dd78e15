"""How one call of linear_logp is laid out: the dot precision, where the target logit is
taken, TMA or pointer loads, the V splits, the grids and tile constants. Decisions only:
nothing here allocates a buffer or launches a kernel."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from kgen.runtime.streams import bind_context
from kgen.runtime.tf32_descriptors import rounding_descriptor

# Rows per program of the combine kernel: 4 * splits loads per row summing the CUDA
# partials; with the target gather-dot (the Triton forward), 2 * D elements per row, so
# fewer rows a program, to spread the N * D reads over more SMs, in TARGET_BLOCK_D-element
# steps along D.
COMBINE_BLOCK = 128
COMBINE_DOT_BLOCK = 16
TARGET_BLOCK_D = 256
# Tiles of row-major output walked GROUP rows at a time (L2 reuse of the shared panel).
GROUP = 8
# Hidden rows (bytes) a group of CUDA row blocks keeps in L2 while it sweeps V.
GROUP_BYTES = 16 << 20
LOG2E = 1.4426950408889634

# keep_logits: the logits kernels' (rows, columns, warps) -- each program of the forward's
# sweeps a slice of V, each of the dz kernel's one tile; the largest with neither spills nor
# a stack under Triton 3.9 for sm_90 (32 x 256 rows x columns: 255 registers and 112-320 B
# of stack; schema.triton_aot builds them) -- and the forward's programs an SM.
KEPT_FWD_BLOCK = (16, 256, 4)
KEPT_DZ_BLOCK = (16, 256, 4)
KEPT_FWD_PROGRAMS_PER_SM = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision (only float32 inputs read it). TF32 allowed: "tf32", as
    F.linear. TF32 off: "tf32x3" (each operand split into a TF32 high part and a TF32
    low part, three tensor-core products), which keeps float32's accuracy (products to
    ~2^-22 relative, under the 2^-24 * sqrt(D) rounding of the float32 sums themselves)
    at tensor-core speed. "ieee" is an FMA loop that Triton (3.6-3.9, sm_90) compiles with a
    6-23 KB per-thread stack and that ran 8x slower than torch.compile's float32 GEMM.
    Under "tf32" the float32 tiles that TMA loads (_tma: sm_90+, D % 4 == 0, aligned bases)
    are rounded to the nearest TF32 value on the way to shared memory, as cuBLAS rounds its
    operands, at no cost (_tile_sources, runtime.tf32_descriptors); the tensor cores
    themselves would truncate, which biased the logits by -7e-4 relative: logp errors
    against float64 of 2.9-3.4e-3 (mean +7e-4) where eager PyTorch's are 0.9-1.1e-3 (mean
    ~0), now eager's to the third digit (H200, BENCHMARKS.md forty-sixth and forty-seventh
    sessions). Pointer loads (sm_80, or D % 4 != 0) still truncate: rounding their tiles in
    registers made the forward 6x slower on an H200 (2.0 -> 12.2 ms at 2048 x 2047 x 32000)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "tf32x3"
    return "tf32"


def _target_in_tile(dtype: torch.dtype, precision: str) -> bool:
    """Whether the Triton forward keeps the target logit in its V sweep instead of the
    combine's float32 gather-dot. The gather-dot equals the tile's logit up to float32
    summation order when the tile dot multiplies exactly in float32: 16-bit operands (exact
    products) or float32 under "ieee". A TF32 dot rounds float32 operands to 10 mantissa
    bits (~1e-3 relative per product), which the gather-dot would not, and logp = z_t - lse
    would mix two roundings (logp > 0 for a dominant target); that case keeps the fold, and
    so does "tf32x3", whose products are close to but not exactly float32's."""
    return dtype == torch.float32 and precision in ("tf32", "tf32x3")


def fwd_grid(mod, N: int, splits: int) -> tuple[int]:
    return (_cdiv(N, mod.BLOCK_N) * splits,)


def wave_splits(rows: int, minimum: int, tiles: int, resident: int) -> int:
    """V splits for a grid of `rows` row blocks x splits, `resident` of which run at once:
    at least `minimum`, raised to the fewest that fill whole waves (rows * splits a
    multiple of resident) or make 16 waves or more, so that no SM idles through a partial
    last wave; at most one V tile (of `tiles`) per split. E.g. on a 132-SM H100 at
    N = 8192 with 128-row blocks: 4 splits give 256 programs, 1.94 waves; 33 give 2112,
    16 waves. At N = 1: 132 splits."""
    per_wave = resident // math.gcd(rows, resident)  # splits per whole wave
    whole = _cdiv(minimum, per_wave) * per_wave
    many = max(minimum, _cdiv(16 * resident, rows))
    return max(1, min(whole, many, tiles))


@functools.cache
def _device_props(index: int):
    """torch.cuda.get_device_properties, once per device (SM count, capability): read on
    every launch."""
    return torch.cuda.get_device_properties(index)


# Module switch: False makes the Triton kernels load logit tiles with pointers even where
# TMA applies (tests run both paths).
TMA = True


def _tma(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton forward and dz kernels load their logit tiles through TMA tensor
    descriptors: rows that are whole 16-byte units from 16-byte aligned bases (TMA's rules),
    on an sm_90+ GPU or in the interpreter. Measured on an H100 at (8192, 4096, 128256)
    bf16: forward 13.3 ms against 17.0 ms with pointer loads (BENCHMARKS.md). float32
    variants take 32-column boxes (128 bytes, the swizzle span; the spec's check): with
    pointer loads Triton 3.9 compiled their tiles with a 7-15 KB per-thread stack."""
    if not TMA or (hidden.shape[1] * hidden.element_size()) % 16:
        return False
    if hidden.data_ptr() % 16 or weight.data_ptr() % 16:
        return False
    dev = hidden.device
    if dev.type != "cuda":
        return True  # TRITON_INTERPRET: the interpreter emulates descriptor loads
    return _device_props(dev.index).major >= 9


def _tile_sources(mod, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[Any, Any, bool]:
    """(h_src, w_src, TMA) for _logit_tile: descriptors with the variant's boxes, or the
    tensors themselves (pointer loads). Float32 under "tf32" (_precision): descriptors whose
    loads round the tiles to the nearest TF32 value (runtime.tf32_descriptors), as cuBLAS
    rounds its operands (where this Triton cannot, plain ones: the tensor cores truncate)."""
    if not _tma(hidden, weight):
        return hidden, weight, False
    if hidden.is_cuda:
        bind_context()  # (the launch encodes the descriptors: autograd's thread may have no context yet)
    hb, wb = [mod.BLOCK_N, mod.BLOCK_D], [mod.BLOCK_V, mod.BLOCK_D]
    if hidden.dtype == torch.float32 and _precision(torch.float32) == "tf32":
        h, w = rounding_descriptor(hidden, hb), rounding_descriptor(weight, wb)
        if h is not None:
            return h, w, True
    return TensorDescriptor.from_tensor(hidden, hb), TensorDescriptor.from_tensor(weight, wb), True


def dh_grid(mod, N: int, D: int) -> tuple[int]:
    return (_cdiv(N, mod.BLOCK_N) * _cdiv(D, mod.BLOCK_V),)


def dh_sources(mod, dz: torch.Tensor, width: int, wt: torch.Tensor) -> tuple[Any, Any]:
    """Tensor descriptors of dz [rows, width] (its row stride kept) and wt [D, width] (wt's
    row stride kept) for linear_logp_bwd_dh_kernel."""
    if dz.is_cuda:
        bind_context()
    return (TensorDescriptor(dz, [dz.shape[0], width], [dz.stride(0), 1], [mod.BLOCK_N, mod.BLOCK_D]),
            TensorDescriptor(wt, [wt.shape[0], width], [wt.stride(0), 1], [mod.BLOCK_V, mod.BLOCK_D]))


def triton_splits(mod, N: int, V: int, device: torch.device) -> int:
    """V splits of the Triton forward for this call: wave_splits with one resident program
    per SM and the variant's SPLIT_V as the minimum. Off the GPU (the interpreter): SPLIT_V,
    as the spec says (tests use it to make slices empty)."""
    if device.type != "cuda":
        return mod.SPLIT_V
    sms = _device_props(device.index).multi_processor_count
    return wave_splits(_cdiv(N, mod.BLOCK_N), mod.SPLIT_V, _cdiv(V, mod.BLOCK_V), sms)


def combine_grid(N: int, block: int = COMBINE_BLOCK) -> tuple[int]:
    return (_cdiv(N, block),)


def dz_grid(mod, N: int, width: int) -> tuple[int]:
    return (_cdiv(N, mod.BLOCK_N) * _cdiv(width, mod.BLOCK_V),)


def _tiles(mod) -> dict:
    return dict(BLOCK_N=mod.BLOCK_N, BLOCK_V=mod.BLOCK_V, BLOCK_D=mod.BLOCK_D,
                num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)


class AccumulatorPlan(NamedTuple):
    """Where the backward keeps grad_hidden's float32 sums over V (see accumulator_plan)."""
    home: str  # "output", "direct", "separate", "tail" or "rows"
    own_rows: int  # rows [0, own_rows) summed in grad_hidden's own buffer ("separate", "tail")
    alias_from: int  # "tail": grad_weight rows [alias_from, V) hold the other rows' sums; else V
    row_block: int  # "rows": rows per block; else 0
    block_width: int  # "rows": vocabulary columns per dz chunk of a row block (V: no sums kept)
    separate_bytes: int  # the separate float32 buffer's size (0 if none)


# "rows" with the whole vocabulary in one chunk: at least this many rows a block (a GEMM
# with fewer rows than this runs well below cuBLAS's rate).
MIN_ROW_BLOCK = 128


def accumulator_plan(N: int, D: int, V: int, dtype: torch.dtype, granule: int, budget: int,
                     workspace: int = 0) -> AccumulatorPlan:
    """The backward sums grad_hidden = dz @ weight over V chunks in float32 (N*D*4 bytes):
    - "output": grad_hidden itself is float32;
    - "direct": no sums: the whole vocabulary's dz fits the workspace (`workspace` bytes),
      so grad_hidden is one GEMM over V, written in its dtype;
    - "separate": a buffer of its own when N*D*4 <= budget (own_rows 0); else the first
      own_rows = N*esize/4 rows are summed in grad_hidden's own (still unwritten) buffer and
      converted in place at the end, and the other rows in a separate buffer if they fit
      the budget;
    - "tail": else in grad_weight's last rows, from alias_from (a chunk edge) on, if V has
      that many (V >~ N): their grad_weight waits until grad_hidden is done and their dz
      is recomputed then (except the last chunk's, still in the workspace): about
      N*esize/(2V) of one logits GEMM more;
    - "rows": else, grad_hidden by blocks of `row_block` rows, each recomputing its logits,
      before grad_weight over all rows (one logits GEMM more). A block holds dz for the
      whole vocabulary if the workspace (`workspace` bytes) has room for MIN_ROW_BLOCK
      such rows: no sums kept, each block's grad_hidden is one GEMM; else blocks of a
      budget's worth of rows with float32 sums, by chunks of block_width columns."""
    esize = dtype.itemsize
    if dtype == torch.float32:
        return AccumulatorPlan("output", 0, V, 0, 0, 0)
    if N * _cdiv(V, granule) * granule * esize <= workspace:
        return AccumulatorPlan("direct", 0, V, 0, 0, 0)
    if N * D * 4 <= budget:
        return AccumulatorPlan("separate", 0, V, 0, 0, N * D * 4)
    own = N * esize // 4
    rest = N - own
    if rest * D * 4 <= budget:
        return AccumulatorPlan("separate", own, V, 0, 0, rest * D * 4)
    tail = _cdiv(rest * 4, esize)  # grad_weight rows that hold the other rows' sums
    if tail <= V - granule:
        return AccumulatorPlan("tail", own, (V - tail) // granule * granule, 0, 0, 0)
    full = workspace // (V * esize)
    if full >= MIN_ROW_BLOCK:
        return AccumulatorPlan("rows", 0, V, full // 64 * 64, V, 0)
    row_block = max(granule, budget // (D * 4) // granule * granule)
    width = max(granule, (workspace - min(row_block, N) * D * 4) // (row_block * esize) // granule * granule)
    return AccumulatorPlan("rows", 0, V, row_block, min(width, _cdiv(V, granule) * granule), min(row_block, N) * D * 4)


def workspace_chunk(N: int, V: int, esize: int, granule: int, budget: int) -> int:
    """Columns of the backward's dz workspace: as many granules of N-row dz as `budget`
    bytes hold, at least one, at most V's."""
    chunk = max(budget, 0) // (N * esize) // granule * granule
    return min(max(chunk, granule), _cdiv(V, granule) * granule)


class Chunk(NamedTuple):
    """One vocabulary chunk of the backward (see chunk_schedule)."""
    v0: int
    v1: int
    at: Optional[int]  # dz's first element in grad_weight's flat storage; None: the workspace


def dz_stride(width: int) -> int:
    """Row stride of a chunk's dz: whole 16-byte units (cuBLAS's fast kernels want aligned
    leading dimensions)."""
    return _cdiv(width, 8) * 8


def chunk_schedule(N: int, D: int, V: int, esize: int, granule: int, chunk: int, free_until: int,
                   extra_rows: int = 0, in_place: bool = True) -> list[Chunk]:
    """The backward's vocabulary chunks, in order, covering [0, V) with an edge at
    free_until (the "tail" home's alias_from; V otherwise).

    grad_weight is written chunk by chunk from row 0 up, so while chunk [v0, v1) runs, its
    rows [v1, free_until) are neither written yet nor hold sums: free memory that is no
    extra. A chunk keeps its dz there ("in place": N + extra_rows rows of dz_stride(width)
    elements from the first 16-byte aligned element of row v1 on; extra_rows for the bias
    sums) when that is wider than the workspace's `chunk` columns: fewer chunks, and each
    chunk reads and writes grad_hidden's float32 sums once (8*N*D bytes). Greedy, which
    reaches furthest: each chunk is the widest multiple of `granule` that fits; the free
    rows left shrink by about N/(N+D) a chunk, and once the widest fit is no wider than
    `chunk` the rest goes through the workspace as before. The last chunk before
    free_until never fits in place (no rows after it), so the schedule always ends with
    workspace chunks. in_place False: workspace chunks only."""
    align = max(1, 16 // esize)  # elements per 16 bytes
    rows = N + extra_rows
    end = free_until * D
    schedule, v0 = [], 0

    def fits(v1: int) -> bool:
        return _cdiv(v1 * D, align) * align + rows * dz_stride(v1 - v0) <= end

    while in_place:
        # about (free_until - v0) * D / (D + rows) columns, then down to what fits
        width = (free_until - v0) * D // (D + rows) // granule * granule
        while width > chunk and not fits(v0 + width):
            width -= granule
        if width <= chunk:
            break
        schedule.append(Chunk(v0, v0 + width, _cdiv((v0 + width) * D, align) * align))
        v0 += width
    for begin, stop in ((v0, free_until), (free_until, V)):
        schedule += [Chunk(v, min(v + chunk, stop), None) for v in range(begin, stop, chunk)]
    return schedule
