"""How one int8_gemm call is laid out: the K splits, the K step for grouped scales, the
grids, and which variant a shape prefers when nothing is tuned. Decisions only: nothing
here allocates or launches."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kgen.families.int8_gemm.schema import wgmma_ctas_per_sm
from kgen.runtime.op import sm_count as _sm_count

MODE_MM, MODE_LINEAR, MODE_W8A16 = 0, 1, 2
# A split-K call aims for this many programs per SM: the small-M kernels stream b and are
# bound by memory, which needs several loads in flight per SM; 4-warp programs with a few
# stages of 64-row tiles take ~30-70 KB of shared memory, so 2-3 fit on an SM at once.
CTAS_PER_SM = 2
# Each split streams at least this many K steps (fewer: the partials cost more than they save).
MIN_STEPS_PER_SPLIT = 4
# Streaming multiprocessors assumed off a GPU (the interpreter), so that splits happen there too.
_CPU_SMS = 8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sm_count(device: torch.device) -> int:
    return _sm_count(device, _CPU_SMS)


def block_k(mod, group_size: int | None) -> int:
    """The module's BLOCK_K, halved until it divides group_size (a K block must lie within
    one scale group); checks guarantee group_size % 16 == 0, so it stays >= 16."""
    bk = mod.BLOCK_K
    while group_size and group_size % bk:
        bk //= 2
    return bk


# A split Triton call (partials, then the combine launch) costs the op ~8 us more host time
# than an unsplit one (H200: ~22-24 us against ~14-15 through the replayed launches), so it
# splits only where the unsplit grid is predicted slower than TRITON_SPLIT_MIN_US: FIXED_US plus
# the tiles an SM runs (programs sharing an SM share its throughput) x K x (TRITON_NS_PER_K +
# TRITON_NS_PER_K_AREA x the tile's area) ns (fitted on H200 W8A16 unsplit times: 16 x 64
# tiles ~3.1-4.9 ns a unit of K, 64 x 128 ~9-12). Measured on 84 random untuned W8A16 shapes
# M 17-128 whose plan split, the op with 1, 2 and the plan's splits forced: this 1.021x the
# best count (geomean; worst 1.38), the plan alone 1.182x (worst 2.10) (BENCHMARKS.md,
# forty-second session).
TRITON_SPLIT_MIN_US = 20.0
FIXED_US = 3.0  # a grid's fixed time (launch, first loads) in the unsplit predictions below
TRITON_NS_PER_K = 2.4
TRITON_NS_PER_K_AREA = 1.0e-3


def splits(mod, M: int, N: int, K: int, bk: int, sms: int) -> tuple[int, int]:
    """(splits, k_split): how many K ranges of k_split (a multiple of bk) elements the call
    uses: up to mod.SPLIT_K, as many as bring the grid to CTAS_PER_SM programs per SM,
    each at least MIN_STEPS_PER_SPLIT steps long; one where the unsplit grid is predicted
    quicker than a split call's host cost (TRITON_SPLIT_MIN_US)."""
    steps = cdiv(K, bk)
    s = 1
    if mod.SPLIT_K > 1:
        tiles = cdiv(M, mod.BLOCK_M) * cdiv(N, mod.BLOCK_N)
        s = max(1, min(mod.SPLIT_K, cdiv(CTAS_PER_SM * sms, tiles), steps // MIN_STEPS_PER_SPLIT))
        waves = cdiv(tiles, sms)
        per_k_ns = TRITON_NS_PER_K + TRITON_NS_PER_K_AREA * mod.BLOCK_M * mod.BLOCK_N
        if s > 1 and FIXED_US + waves * K * per_k_ns / 1000 <= TRITON_SPLIT_MIN_US:
            s = 1
    k_split = cdiv(steps, s) * bk
    return cdiv(K, k_split) if K else 1, k_split


def gemm_grid(mod, M: int, N: int, n_splits: int) -> tuple[int, int]:
    return cdiv(M, mod.BLOCK_M) * cdiv(N, mod.BLOCK_N), n_splits


def combine_grid(mod, M: int, N: int) -> tuple[int, int]:
    return cdiv(M, mod.COMBINE_M), cdiv(N, mod.COMBINE_N)


# The gemv kernel (small M): 64-k steps; a grid of at least GEMV_WARPS_PER_SM warps per SM
# (no or little shared memory: every warp keeps a trip of 16-byte loads in flight), counting
# a CTA's K-warps (warps_m: warps on distinct K ranges of the same rows); each warp's range at
# least GEMV_MIN_STEPS steps; the partial planes (written and read back) at most 1/8 of the
# weight. Splitting K over CTAs costs a second (combine) launch, so it is only for grids that
# cannot fill the SMs with warps otherwise.
GEMV_STEP = 64
GEMV_MAX_M = 16
GEMV_WARPS_PER_SM = 12
GEMV_MIN_STEPS = 4
GEMV_MAX_SPLITS = 64


def is_gemv(variant) -> bool:
    return variant.backend == "cuda" and variant.params.get("kernel") == "gemv"


def is_wgmma(variant) -> bool:
    return variant.backend == "cuda" and variant.params.get("kernel") == "wgmma"


# The Hopper WGMMA kernel (cuda_sm90a.cu.j2) at small M streams the weight: a call whose
# output tiles are few splits K so that about half as many CTAs as SMs stream it (each CTA's
# ring keeps ~100 KB of loads in flight: ~64 of them saturate the H100's and H200's memory),
# each split at least WGMMA_MIN_PANELS 128-byte K panels, and the int32 partials (M x N x 4
# bytes a split, written and read back) at most a quarter of the weight (K // (16 M) splits).
# Measured (BENCHMARKS.md, twenty-first session: every variant at 1..8 splits, M = 16..256,
# seven weight shapes, steady state on the H100): a split costs ~0.5-1 us (partials, combine)
# and a split count that overfills the SMs starts a second wave, so more CTAs than this lose;
# e.g. M = 64, 4096 x 4096, 64 x 64 tiles: 9.7 us unsplit, 11.4 with 4 splits, 13.3 with 5.
WGMMA_BK = 128
WGMMA_MIN_PANELS = 4
# ... but in the op a split call (a partial plane and the combine launch) costs ~7-8 us more
# host time than an unsplit one (H200: ~16-17 us against ~8.5-9), more than the split saves
# where the unsplit grid is quick. So a call splits only where its unsplit grid is predicted
# slower than SPLIT_MIN_US: FIXED_US plus wgmma_tile_cost (waves x tile area / the
# tile's efficiency) x K x WGMMA_US_PER_COST_K (fitted on 64 x 64 tiles in one wave: 0.0015 us
# a K step of 1, e.g. 142 x 558 x 15312, 27 tiles: 25.9 us measured, 26 predicted). Measured
# on 60 random untuned int8 shapes M 17-160 whose fill plan split K, the op with 1, 2, the
# plan's and twice the plan's splits forced: this plan 1.011x the best count (geomean; worst
# 1.17), the fill plan 1.442x (worst 2.03) (BENCHMARKS.md, forty-second session).
WGMMA_US_PER_COST_K = 1.83e-7
SPLIT_MIN_US = 16.0


def wgmma_fill_splits(params, M: int, N: int, K: int, sms: int) -> int:
    """K splits that make about sms / 2 CTAs of a wgmma call's tiles."""
    tiles = cdiv(M, params["block_m"]) * cdiv(N, params["block_n"])
    most = min(cdiv(K, WGMMA_BK) // WGMMA_MIN_PANELS, K // (16 * M), 65535)
    return max(1, min((sms // 2 + tiles // 2) // tiles, most))


def wgmma_splits(params, M: int, N: int, K: int, sms: int) -> int:
    """K splits of a wgmma call: wgmma_fill_splits where the unsplit grid is predicted slower
    than a split call's host cost (SPLIT_MIN_US), else 1."""
    fill = wgmma_fill_splits(params, M, N, K, sms)
    if fill == 1:
        return 1
    unsplit_us = FIXED_US + wgmma_tile_cost(params, M, N, sms) * K * WGMMA_US_PER_COST_K
    return fill if unsplit_us > SPLIT_MIN_US else 1


def gemv_fill_splits(rows_per_cta: int, M: int, N: int, K: int, sms: int, warps: int = 4, k_warps: int = 1) -> int:
    """K splits that fill the SMs with a gemv call's warps (CTAs of `warps` row warps x
    `k_warps` K-warps): enough warps for GEMV_WARPS_PER_SM an SM, each warp's range >=
    GEMV_MIN_STEPS steps, and the int32 / float32 partials (M x N x 4 bytes a split, twice)
    <= 1/8 of N x K."""
    steps = cdiv(K, GEMV_STEP)
    cta_warps = cdiv(N, rows_per_cta) * warps * k_warps
    s = min(cdiv(GEMV_WARPS_PER_SM * sms, cta_warps), steps // (GEMV_MIN_STEPS * k_warps), K // (64 * M),
            GEMV_MAX_SPLITS)
    return max(1, s)


# A K split costs the op a partial plane and a second launch: ~6 us more host time a call
# (H200, the op as a user calls it: ~14-15 us where the unsplit call took ~8-9), more than it
# saves on the GPU unless the unsplit grid is badly starved. So a gemv call splits (as
# gemv_fill_splits says) only where its unsplit grid is predicted to take longer than
# SPLIT_MIN_US: FIXED_US plus the weight's bytes over its warps streaming
# GEMV_WARP_BYTES_PER_US each (fitted on H200 16-bit calls, e.g. fp16 10 x 237 x 14896:
# 120 warps, predicted 14.8 us, measured 15.1; int8 warps stream ~2x faster, so the
# prediction errs towards splitting). Measured on 64 random shapes M <= 16 that split under
# gemv_fill_splits, the op's time with 1-8 splits forced: this plan within 1.001x the best
# count (geomean; worst 1.08), filling the SMs 1.38x (worst 2.15) (BENCHMARKS.md,
# forty-second session).
GEMV_WARP_BYTES_PER_US = 2500.0


def gemv_splits(rows_per_cta: int, M: int, N: int, K: int, sms: int, warps: int = 4, k_warps: int = 1) -> int:
    """K splits of a gemv call: gemv_fill_splits where the unsplit grid is predicted slower
    than a split call's host cost, else 1."""
    fill = gemv_fill_splits(rows_per_cta, M, N, K, sms, warps, k_warps)
    if fill == 1:
        return 1
    unsplit_us = FIXED_US + N * K / (cdiv(N, rows_per_cta) * warps * k_warps * GEMV_WARP_BYTES_PER_US)
    return fill if unsplit_us > SPLIT_MIN_US else 1


def gemv_splits_of(params, M: int, N: int, K: int, sms: int) -> int:
    """gemv_splits for a variant's knobs."""
    return gemv_splits(params["block_n"], M, N, K, sms, params["warps_n"], params["warps_m"])


# The Hopper WGMMA kernel's tile per M where nothing is tuned and N is not known (the
# shipped H100 and H200 tables' winners by M bucket: 64 x 64 at M <= 64, 64 x 128 or
# 128 x 128 up to 256, 128 x 256 beyond; smaller tiles give more CTAs where the output is
# small).
WGMMA_TILES = ((64, (64, 64)), (256, (64, 128)), (float("inf"), (128, 256)))
# With N and the SMs known: the tile of least predicted time, waves x tile area / the tile's
# efficiency (output per unit time of one CTA, relative to 128 x 256: measured on an H200 at
# 295 x 1189 x 2304, each tile's grid within one wave: 25.1 / 13.6 / 8.3 / 6.9 us for
# 128 x 256 / 128 x 128 / 64 x 128 / 64 x 64). It picks the fastest or within 3 % of it in
# 37 of the shipped tables' 40 int8 buckets at M >= 64 (worst 1.16; the M rule: 35, 1.26)
# and the fastest at 7 untuned shapes where the M rule took 1.3-3.6x the best
# (BENCHMARKS.md thirty-sixth session).
WGMMA_TILE_EFFICIENCY = {128 * 256: 1.0, 128 * 128: 0.92, 64 * 128: 0.76, 64 * 64: 0.5}


def wgmma_tile_cost(params, M: int, N: int, sms: int) -> float:
    """Predicted time of a wgmma variant's grid (arbitrary units, WGMMA_TILE_EFFICIENCY)."""
    bm, bn = params["block_m"], params["block_n"]
    # (waves of one CTA an SM: where two fit, each runs at about half speed beside the other)
    return cdiv(cdiv(M, bm) * cdiv(N, bn), sms) * bm * bn / WGMMA_TILE_EFFICIENCY.get(bm * bn, 0.76)


# Among the gemv variants (M <= 16, N and K known): the 8-K-warp CTAs (spec order's first)
# fill the SMs at small N without a K split, but every CTA pays a reduction of its K-warps'
# sums through shared memory, and at small K each K-warp streams a step or two: where N
# gives enough row warps, one K-warp a CTA (4 row warps) streams the weight faster. Such a
# variant runs at N >= GEMV_ROW_WARPS_N where its plan does not split K (gemv_splits: a split
# costs ~6 us of host time a call, more than the one-K-warp grid saved on the GPU at every
# split shape measured). H200, 153 random untuned shapes M <= 16, the op as a user calls it
# (BENCHMARKS.md forty-second session): 11 ran >= 10 % faster (fp16 7 x 29445 x 352 0.38x
# the time), none > 2 % slower. That rule asked for a grid that fills the SMs unsplit
# (gemv_fill_splits == 1, as every split then ran); since the plan splits only slow grids,
# it left unsplit one-K-warp grids that did not fill the SMs to the K-warp CTAs, whose
# K-warps each stream a step or two at small K: fp16 2 x 12805 x 560 12.3 us against 6.2.
# Every gemv variant at 45 random shapes (H200, `tools/int8_tiles.py --gemv`, BENCHMARKS.md
# fifty-ninth session), the rule's choice over the fastest (time as the tuner takes it):
# geomean 1.063 -> 1.037, worst 1.99 -> 1.23; its GPU time 1.113 -> 1.068.
GEMV_ROW_WARPS_N = 2048


def _gemv_rank(p, M: int, N: int | None, K: int | None, sms: int | None) -> int:
    """0: a one-K-warp variant where it is preferred; 1: the K-warp variants; 2: a one-K-warp
    variant elsewhere (and where N, K or the SMs are not known: spec order, rank 1)."""
    if N is None or K is None or not sms or p["warps_m"] > 1:
        return 1
    return 0 if N >= GEMV_ROW_WARPS_N and gemv_splits_of(p, M, N, K, sms) == 1 else 2


# Above M = 16 with N, K and the SMs known, the Triton and mma.sync tiles (split-K or not)
# by predicted GPU time: TILE_FIXED_US, plus TILE_SPLIT_US where the plan splits K (the
# combine launch, the partial planes), plus the grid's waves (programs as `splits` plans them
# over the SMs, rounded up) x its K range x the tile's ns a unit of K (TILE_NS_PER_K, per tile
# and 16-bit dtype; elsewhere TILE_NS_PER_K_BASE + TILE_NS_PER_K_EDGE x (block_m + block_n)).
# Fitted on H200 W8A16 GPU times, every Triton tile at 78 random shapes (M 17-1024, N 256-16k,
# K 256-16k; tools/int8_tiles.py --json, BENCHMARKS.md fifty-second session): fitted on the 48
# of M <= 128 it picks within 1.007x of the fastest on the 30 above (geomean; worst 1.09),
# fitted on those 30 within 1.016x on the 48 (worst 1.12); the earlier rules took 1.18x at
# M 17-128 (worst 2.12: fp16 42 x 291 x 992, the 64 x 128 tile 15.4 us against the 16-row
# split tile's 7.3). The 16-row tile converts b in registers for only 16 rows, so the dtype's
# conversion shows: fp16 1.5x bf16's time a unit of K.
TILE_FIXED_US = 5.0
TILE_SPLIT_US = 3.5
TILE_NS_PER_K = {
    (16, 64): {"bfloat16": 2.0, "float16": 3.0},
    (64, 128): {"bfloat16": 9.5, "float16": 11.25},
    (128, 128): {"bfloat16": 13.05, "float16": 15.05},
}
# (int8 tiles on Ampere, not fitted: the fifty-first session's H200 W8A16 fit above M = 128,
# with FIXED_US)
TILE_NS_PER_K_BASE = -1.0
TILE_NS_PER_K_EDGE = 0.0625


def tile_grid_us(params, M: int, N: int, K: int, sms: int, dtype: str | None = None) -> float:
    """Predicted GPU time of a Triton or mma.sync tile variant's grid at M x N x K (us), for
    `dtype`'s rates where fitted."""
    bm, bn, bk = params["block_m"], params["block_n"], params["block_k"]
    mod = SimpleNamespace(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=params.get("split_k", 1))
    n_splits, k_split = splits(mod, M, N, K, bk, sms)
    waves = cdiv(cdiv(M, bm) * cdiv(N, bn) * n_splits, sms)
    rate = TILE_NS_PER_K.get((bm, bn), {}).get(dtype)
    if rate is None:
        return FIXED_US + waves * min(k_split, K) * (TILE_NS_PER_K_BASE + TILE_NS_PER_K_EDGE * (bm + bn)) / 1000
    return TILE_FIXED_US + TILE_SPLIT_US * (n_splits > 1) + waves * min(k_split, K) * rate / 1000


def preference(variant, M: int, N: int | None = None, sms: int | None = None, K: int | None = None) -> tuple:
    """Sort key of a variant for a call with M rows (N columns, K depth, on `sms` SMs, where
    known) when the tuning table has nothing for its bucket (smaller first): at M <= 16 the
    CUDA gemv variants (weight rows streamed straight into mma.sync registers; among them
    one K-warp a CTA at large N, else the K-warp ones, _gemv_rank; spec order within a rank;
    last at larger M); above it the Hopper WGMMA kernel (int8 on sm_90a; every int8
    bucket above M = 16 in the shipped H100 and H200 tables went to it; at untuned shapes on
    an H200 the op ran 3-6.6x faster than with the Triton tile, BENCHMARKS.md twenty-second
    session), its tile by predicted time (wgmma_tile_cost; by M, WGMMA_TILES, where N is not
    known); then the grid of least predicted time (tile_grid_us) where N and K are known,
    above M = 128 or where the tile's rates are fitted for the variant's dtype (W8A16's
    Triton tiles); else at M <= 32 the split-K streaming variants (b read once, spread over
    all SMs), then the row tile that wastes least of M (a 128-row tile at M = 64 computes
    half zeros); above M = 128 the largest unsplit tiles whose grid fills the SMs, else the
    split-K ones (W8A16 at 133 x 2811 x 7984, H200: the unsplit
    128 x 128 tile's 44 CTAs took 113 us of GPU, the 64 x 128 tile with 4 splits 48,
    BENCHMARKS.md thirty-sixth session; the shipped tables' M <= 256 winners agree in 9 of
    10 16-bit buckets). Ties keep spec order (sorted is stable). Above M = 128 Triton comes
    before the CUDA mma.sync kernel (Ampere's order; on Hopper the WGMMA kernel is first);
    the tuning table decides per bucket where another wins."""
    p = variant.params
    split = p.get("split_k", 1)
    if is_gemv(variant):  # first where it takes M, last elsewhere
        return (-1, _gemv_rank(p, M, N, K, sms)) if M <= GEMV_MAX_M else (float("inf"),)
    if is_wgmma(variant):
        if N is not None and sms:  # (a 128-row tile at M <= 64 computes half zeros or more)
            return (0, M <= 64 < p["block_m"], wgmma_tile_cost(p, M, N, sms), -p["block_m"] * p["block_n"])
        tile = next(t for m, t in WGMMA_TILES if M <= m)
        return (0, (p["block_m"], p["block_n"]) != tile, abs(p["block_m"] - tile[0]), abs(p["block_n"] - tile[1]))
    dtype = getattr(variant, "dtype", None)
    fitted = dtype in TILE_NS_PER_K.get((p["block_m"], p["block_n"]), {})
    if N is not None and K is not None and sms and (M > 128 or fitted):
        return (1, tile_grid_us(p, M, N, K, sms, dtype), -p["block_m"], variant.backend == "cuda")
    if M <= 32:
        return (1, split == 1, p["block_m"])
    if M <= 128:
        return (1, abs(p["block_m"] - 64), split != 1)
    starved = split == 1 and N is not None and bool(sms) and cdiv(M, p["block_m"]) * cdiv(N, p["block_n"]) < sms
    return (1, starved, split != 1, -p["block_m"], variant.backend == "cuda")


# 16-bit W8A16 calls above W8A16_REFERENCE_M rows and K above W8A16_REFERENCE_K in a
# bucket the table does not hold run the reference (the weight dequantised once, then
# cuBLAS's GEMM) where N and K are multiples of 8 (rows of whole 16-byte vectors): it won
# every such tuned bucket of the shipped H100 and H200 tables (20 of 20, K = 4096 and 11008:
# the Triton tile took 1.07-1.79x its time), where the in-register dequantisation no longer
# hides behind the weight's read. At smaller K the reference's passes over the M x N output
# (float32 product, then scale and cast) cost more than the GEMM saves (H200, 4096 x 4096:
# Triton 73 / 108 / 196 us against 126 / 149 / 199 at K = 464 / 1024 / 2048, bf16), and with
# other N or K cuBLAS takes slower kernels (fp16 4493 x 5269 x 5856: 2502 us against the
# Triton tile's 999). BENCHMARKS.md thirty-sixth session.
W8A16_REFERENCE_M = 1024
W8A16_REFERENCE_K = 2048


def w8a16_prefers_reference(M: int, N: int, K: int) -> bool:
    """Whether an untuned W8A16 call runs the reference (see W8A16_REFERENCE_M above)."""
    return M > W8A16_REFERENCE_M and K > W8A16_REFERENCE_K and N % 8 == 0 and K % 8 == 0
