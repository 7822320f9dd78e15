"""How one call of logmatmul is laid out: the rows of x per program, the K split that
fills the SMs, the grids. Decisions only: nothing here allocates or launches."""

from __future__ import annotations

import torch

from kgen.runtime.op import sm_count as _sm_count

# Elements per program of the combine and dx-reduce kernels.
REDUCE_BLOCK = 1024
# Elements per step of the backward's per-row statistics (one program per row: K = 4096
# in one step, not a chain of dependent loads).
STATS_BLOCK = 4096
# Fewest reduction steps per K split the launch heuristic makes.
MIN_SPLIT_STEPS = 4
# SMs assumed off the GPU (the interpreter): small, so that tests see several K splits.
_CPU_SMS = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def sm_count(device: torch.device) -> int:
    return _sm_count(device, _CPU_SMS)


# Whether a tl.dot forward first writes e = exp(x - m) with a separate launch
# (logmatmul_exp_kernel), so that its tile loop is a plain tl.dot with no exp and no maximum
# per n tile, or takes its rows' maximum and exps inside the tile loop as the FMA form does
# (one launch). The exp launch pays on the GPU wherever the exps, repeated per n tile, would
# cost (1.5-2x at N = K = 4096) but adds a launch and the e and m pieces, ~8-10 us a call on an
# H200 host; below PRE_PASS_WORK (B x N x K) the one-launch form was faster by the tuner's
# metric (max of host and GPU time a call) and above it slower: 64-row tile, H200 float32 and
# bf16, 302 x 1418 x 220: 17.0 us against 28.6, 223 x 794 x 636 (113M): 25.7 against 35.0;
# 372 x 523 x 1298 (252M): 40.5 against 33.3, 170 x 2856 x 614: 46.6 against 33.1; the
# 16-row tile alike (16 x 4096 x 4096 bf16, 268M: 53.3 us in one launch against 45.4). The FMA
# form is always one launch (BENCHMARKS.md fortieth session).
PRE_PASS_WORK = 3 << 26


def pre_pass(mod, B: int, N: int, K: int) -> bool:
    """Whether the variant's forward at B x N x K runs logmatmul_exp_kernel first (PRE)."""
    return mod.DOT != "none" and B * N * K >= PRE_PASS_WORK


def block_b(mod, B: int) -> int:
    """Rows of x per forward program: the variant's block_b for tl.dot (its M, at least 16);
    for the FMA form the smallest power of two holding B, at most block_b, so that B = 1
    does no padded work. The tiles over N and K never change with B."""
    if mod.DOT != "none":
        return mod.BLOCK_B
    return min(mod.BLOCK_B, pow2_at_least(B))


def k_split(B: int, N: int, K: int, bb: int, block_n: int, block_k: int, waves: int, sms: int,
            splits: int | None = None) -> tuple[int, int]:
    """(splits, k_slice): the fewest K splits that give about `waves` programs per SM,
    each at least MIN_SPLIT_STEPS block_k steps (a small problem stays one launch) and a
    whole number of them (`splits` forces a count). At B = 1, N = K = 4096, block_n = 16
    on a 132-SM H100 with waves = 4: 256 n tiles x 3 splits = 768 programs."""
    tiles = cdiv(B, bb) * cdiv(N, block_n)
    steps = cdiv(K, block_k)
    if splits is None:
        splits = min(cdiv(waves * sms, tiles), max(1, steps // MIN_SPLIT_STEPS))
    splits = max(1, min(splits, steps))
    k_slice = cdiv(steps, splits) * block_k
    return cdiv(K, k_slice), k_slice


def cuda_k_step(params, w32: bool) -> int:
    """The unit of a CUDA variant's K slice (k_split's block_k). The FMA form (lmm_partials):
    its threads x one 16-byte vector of w each. The tensor-core form (mma = 1, lmm_mma): one
    loop step of a warp, `unroll` chunks of 16 k, times the warps splitting the slice of the
    same nodes (warps / (nodes / (16 mtiles))); at 4 warps, 64 nodes, unroll 4: 64 k."""
    if params.get("mma", 0):
        return 16 * params["unroll"] * (params["warps"] * 16 * params.get("mtiles", 1) // params["nodes"])
    return params["warps"] * 32 * (4 if w32 else 8)


def bwd_chunks(mod, N: int, K: int, sms: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of the backward's N: about `WAVES` programs per SM over
    (k tiles x chunks), each chunk at least 4 BWD_N rows (a multiple of BWD_N). At N = K =
    4096, BWD_K = 128 on a 132-SM H100 with WAVES = 4: 32 k tiles x 17 chunks of 248 rows."""
    k_tiles = cdiv(K, mod.BWD_K)
    want = max(1, min(cdiv(mod.WAVES * sms, k_tiles), N // (4 * mod.BWD_N)))
    rows = cdiv(cdiv(N, want), mod.BWD_N) * mod.BWD_N
    return cdiv(N, rows), rows


# The CUDA backward (cuda.cu.j2's kgen_backward): rows of x it takes, CTAs per SM aimed for,
# the shared memory of a chunk's c' (B rounded up to a power of two x rows).
BWD_B = 16
BWD_CUDA_WAVES = 4
BWD_CUDA_SMEM = 46 * 1024


def bwd_cuda_cols(B: int) -> int:
    """Columns of w a CTA of the CUDA backward takes: 128 threads x 4 up to 8 rows of x,
    x 2 at 9-16 (backward.cuh.j2's bwd_cols)."""
    return 128 * (4 if B <= 8 else 2)


def bwd_cuda_chunks(B: int, N: int, K: int, sms: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of N for the CUDA backward: about BWD_CUDA_WAVES CTAs per SM
    over (column tiles x chunks), at least 8 rows a chunk, pow2(B) x rows floats of c' within
    its shared memory. At N = K = 4096 on a 132-SM H100: 8 column tiles x 66 chunks of 63
    rows (B <= 8)."""
    tiles = cdiv(K, bwd_cuda_cols(B))
    chunks = max(1, min(cdiv(BWD_CUDA_WAVES * sms, tiles), cdiv(N, 8)))
    chunks = max(chunks, cdiv(N, BWD_CUDA_SMEM // (4 * pow2_at_least(B))))
    rows = cdiv(N, chunks)
    return cdiv(N, rows), rows


def bwd_rows(mod, B: int) -> int:
    """Rows of x per step of the backward: at most BWD_B, no padding for small B."""
    return min(mod.BWD_B, pow2_at_least(B))


def bsl_tiles(mod, block_size: int) -> tuple[int, int]:
    """(block_n, block_k) of the block-sparse forward: the variant's, within one block."""
    return min(mod.BLOCK_N, block_size), min(mod.BLOCK_K, block_size)


def cuda_splits(tiles: int, k_len: int, step: int, waves: int, sms: int) -> int:
    """K splits of a CUDA forward with `tiles` CTAs a split over a K of k_len: about `waves`
    CTAs per SM, to the nearest whole number of splits (one wave of tiles that nearly fills
    the GPU takes no split: on an H100 at N = K = 4096, 8 nodes and B <= 8, 512 CTAs in one
    launch took 33-41 us against 36-46 us for 2 splits), each split at least MIN_SPLIT_STEPS
    `step`s long."""
    return min(max(1, (waves * sms + tiles // 2) // tiles), max(1, cdiv(k_len, step) // MIN_SPLIT_STEPS))


def bsl_cuda_splits(B: int, R: int, nnz: int, bs: int, nodes: int, rows: int, step: int, waves: int, sms: int,
                    splits: int | None = None) -> int:
    """K splits of a CUDA variant's block-sparse forward (bsl.cuh.j2) for B rows of x and R
    block rows holding nnz blocks of bs x bs. Its CTAs are (node groups of `nodes`) x (tiles
    of at most `rows` rows of x) x splits; split s of a block row takes the s-th of `splits`
    equal parts of the row's nnz_r x bs virtual K, in whole `step`s (threads x 16 bytes of w),
    sized by the kernel from row_ptr: the host knows only nnz (reading row_ptr would wait on
    the device), so as the dense plan (CudaForward._plan) it aims for about `waves` CTAs per
    SM with at least MIN_SPLIT_STEPS steps a part for the average row (cuda_splits).
    `splits` forces a count (tests; 1 to 65535: parts past a row's end are
    empty). At N = K = 4096, 8 of 32 128-blocks a row, 8 nodes, B <= 4, 132 SMs: 512 CTAs,
    virtual K 1024 = 2 steps of 512: one split."""
    if splits is None:
        tiles = max(1, cdiv(R * bs, nodes) * cdiv(B, min(B, rows)))
        avg = cdiv(nnz * bs, max(R, 1))  # a block row's virtual K on average
        splits = cuda_splits(tiles, avg, step, waves, sms)
    return max(1, min(splits, 65535))
