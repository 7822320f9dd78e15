"""logmatmul's kernel choice beside the tuning table: the shape buckets it keys on, the rule
for shapes nothing was tuned for (`untuned_order`, `_by_batch`: which form serves a batch,
weights, outputs and K), and the vetoes on a tuned winner that would fail at a shape of its
bucket (`tuned_transfers`, `nearby_transfers`). Each threshold cites the measurement it was
fitted on (BENCHMARKS.md). Pure arithmetic on the shape and the variants' knobs: dispatch
calls it once per shape (the op memoises the result)."""

from __future__ import annotations

from kgen.families.logmatmul.schema import CUDA_TILED_MAX_B, DTYPE_BYTES, cuda_op_max_b, cuda_whole_rows

# Buckets: B, N and K each rounded up to a power of two (B decides the tiling: the
# small-batch forms up to 16, tl.dot tiles beyond).
TUNE_DIMS = ("B", "N", "K")
# Rows beyond the tuned ones (B > 256) take the nearest tuned bucket's winner however many
# they are (tuning_table.nearest).
TUNE_FREE_DIMS = ("B",)


def tune_bucket(B: int, N: int, K: int) -> str:
    return ".".join(f"{k}<={1 << (n - 1).bit_length()}" for k, n in zip(TUNE_DIMS, (B, N, K)))


# Weights (N x K) below which a call is small: its time is launches and host, and the
# small-batch form (one launch, no exp pre-pass) beats the tl.dot tiles. Up to B = 64:
# N = K = 1024 (the H100 and H200 tables: the small-batch Triton form won B <= 64 at 512^2
# and 1024^2, a tl.dot tile at 4096^2); above B = 64, 512^2 (a tl.dot tile won 1024^2).
SMALL_WEIGHTS = ((64, 1 << 22), (float("inf"), 1 << 20))
# ... and B x N (outputs) and B x N x K (work) up to which the small-batch form runs them above
# B = 16. It is one launch with a light host side (~9.5 us a call on an H200 host), as is
# the 16-row tl.dot tile (plans.pre_pass), its rival there, which is faster on the GPU from
# B x N ~ 20000 (up to 2.6x at 64 x 1200 x 16). Timed as the tuner times candidates (the
# larger of host and GPU time a call, timing.cuda_timer), the small-batch form lost beyond
# B x N ~ 32000 (331 x 367 x 39: 22.8 us against 9.7; 185 x 521 x 75: 19.2 against 10.6) and
# won or tied below it. H200, float32 and bf16, 180 random shapes, B = 17 to 400, N = 64 to
# 4096, K = 8 to 2048 (BENCHMARKS.md fortieth session; up to 128K outputs while the 16-row
# tile was two launches, thirty-ninth).
SMALL_OUTPUTS, SMALL_WORK = 32 * 1024, 1 << 26


def untuned_order(variants, shape: dict) -> list:
    """dispatch's hook where nothing is tuned for the shape: spec order, with `_by_batch`'s
    variant first where it names one."""
    first = _by_batch(variants, shape["B"], shape["N"], shape["K"])
    return variants if first is None else [first, *(v for v in variants if v is not first)]


# Rows a tl.dot program takes where K is odd: the exponentials' and w's rows are then not
# whole vectors of any size (the kernels' KA = 1) and the tiles load one element at a time;
# the 16-row tile ran 1.7-2.1x faster than the 64-row one at every such shape measured (H200,
# bf16 and float32, 276 x 350 x 1805 and others: BENCHMARKS.md thirty-sixth session) and was
# the fastest candidate at 71 x 2317 x 2005, 186 x 3469 x 1227 and 212 x 2361 x 1507
# (thirty-ninth). Where K % 4 == 2 the tiles load pairs (KA = 2) and the rows rule wins:
# 16 rows there ran 1.31-1.58x the fastest (a 64- or 128-row tile) at K = 450 to 1870.
ODD_K_ROWS = 16
# ... and at odd K from ODD_K_SMALL_K on, the small-batch form (whose loads along K are
# scalar whatever K) up to ODD_K_OUTPUTS outputs (B x N; float32, then 16-bit x) whatever the
# weights' size: there the 16-row tile, loading one element at a time, ran up to 1.7x its time
# (H200, float32 115 x 312 x 657: 25.7 us against 15.1; 130 x 300 x 545: 23.4 against 14.2).
# Rule time / fastest candidate (the tuner's metric) at 205 random odd-K shapes (B 17-400,
# N 256-4096, K 91-2897) not fitted on: geomean 1.035 -> 1.018, 18 -> 8 shapes over 1.2x;
# 16-bit x loses beyond ~32K outputs (bf16 265 x 160 x 1493: 1.73x), float32 beyond ~96K
# (60 x 2000 x 1001: 2.1x). BENCHMARKS.md forty-first session.
ODD_K_SMALL_K = 512
ODD_K_OUTPUTS = (96 * 1024, 32 * 1024)
# The batch from which the 128-row tl.dot tile (float32's) is the rule's: below it the
# 64-row tile wastes less of its last tile. H200 float32 at B = 130, N = 300 to 12000, K =
# 60 and 120: 8.8-21.9 us of GPU time against the 128-row tile's 13.8-30.3, every case
# (BENCHMARKS.md thirty-seventh session); at B = 256 to 400 too (geomean over 120 random
# shapes 1.032-1.042 the fastest with the 64-row tile there, 1.036-1.054 with the 128-row one;
# fortieth). The tables' B <= 256 buckets at N = K = 4096 also chose the 64-row tile, at 1024^2
# the 128-row one.
WIDE_TILE_ROWS = 512
# Work (B x N x K) below which the 16-row tile is the rule's at K > NARROW_K: there the wide
# tiles run their exps in the tile loop (no exp launch, plans.pre_pass) and the 16-row
# tile's four times as many programs finish first (H200, 143 x 976 x 316 bf16: 11.8 us
# against the 64-row tile's 22.3; 66 x 1286 x 176 float32: 8.8 against 14.8). At K <=
# NARROW_K a 16-row program has too little to do: 386 x 3152 x 16 ran 14.6 us against 9.3
# (BENCHMARKS.md fortieth session).
NARROW_TILE_WORK, NARROW_K = 1 << 26, 16
# The 16-row tile where the 64- or 128-row one's grid (cdiv(B, rows) x cdiv(N, 64) programs) is
# short of a wave: under FEW_PROGRAMS[0] programs at K <= FEW_PROGRAMS_K, under FEW_PROGRAMS[1]
# at a wider K (the 16-row tile re-reads w once per 16 rows, which a wide K pays for). H200
# float32, B = 40 to 200, N = 300 to 12000, K = 120 and 1024 (BENCHMARKS.md thirty-eighth
# session): the 16-row tile 7.1-10.2 us against the 64-row one's 10.1-10.9 at K = 120 under 128
# programs, and the 64-row one 2-16 % ahead from 32 programs on at K = 1024; at 370 x 188 x 22
# (9 programs of 128 rows) 6.6 us against 12.5 (thirty-ninth).
FEW_PROGRAMS, FEW_PROGRAMS_K = (128, 32), 128


# A nearby bucket's tuned winner (tuning_table.nearest) serves B > 16 only along rows beyond the
# tuned ones (B > TUNED_ROWS, the same N and K classes); elsewhere `_by_batch` does. H200,
# float32 and bf16, B = 100 to 200, N = 300 to 2500, K = 545 and 1024 (BENCHMARKS.md
# thirty-ninth session): the nearby N <= 1024, K <= 1024, B <= 256 winner (a 64- or 128-row
# tile) ran over 1.05x the fastest candidate's GPU time in 17 of 19 cases (up to 4.3x,
# geomean 1.64), the rule's choice in 5 (geomean 1.11).
TUNED_ROWS = 256


def _wide_dot_tile(variant) -> bool:
    """Whether `variant` is a tl.dot tile of more than ODD_K_ROWS rows: at an odd K its loads
    go one element at a time (ODD_K_ROWS)."""
    return variant is not None and variant.params.get("dot", "none") != "none" and variant.params["block_b"] > ODD_K_ROWS


def nearby_transfers(shape: dict, bucket: str, variant) -> bool:
    """dispatch's veto on a nearby bucket's winner (above): False where `_by_batch` serves the
    shape instead, also wherever the winner is a tl.dot tile of more than ODD_K_ROWS rows
    and K is odd."""
    B, N, K = shape["B"], shape["N"], shape["K"]
    if B <= 16:
        return True  # the small batches: a nearby bucket's measured winner serves them
    if _wide_dot_tile(variant) and K % 2:
        return False
    return B > TUNED_ROWS and tune_bucket(B, N, K).split(".")[1:] == bucket.split(".")[1:]


def tuned_transfers(shape: dict, probes: list, variant) -> bool:
    """dispatch's veto on the call's own tuned bucket's winner: False where it is a tl.dot
    tile of more than ODD_K_ROWS rows, K is odd and no probe of the bucket was (its loads
    would go one element at a time where they were measured as vectors: H200 float32
    138 x 535 x 779, the B <= 256, N, K <= 1024 bucket's 128-row winner, tuned at 256 x 1024 x
    1024, ran 77.9 us of GPU time against the 16-row tile's 26.0; BENCHMARKS.md fifty-ninth
    session). `_by_batch` then serves the call, as at an odd K nothing was tuned for. Also
    False where the winner is a CUDA form and K is not whole 16-byte vectors of x's dtype
    (`_cuda_takes_k`): the form would hand the call to its Triton companion, the small-batch
    form, whatever the batch (50 x 3000 x 3001 in the B <= 64, N, K <= 4096 bucket, whose
    float32 winner is the tensor-core form, would run the small-batch form over 150K outputs
    instead of the 16-row tl.dot tile)."""
    if variant is not None and variant.backend == "cuda" and not _cuda_takes_k(variant, shape["K"]):
        return False
    return not _wide_dot_tile(variant) or not shape["K"] % 2 or any(p["K"] % 2 for p in probes)


def _cuda_takes_k(variant, K: int) -> bool:
    """Whether a CUDA form surely takes rows of K weights (schema.cuda_whole_rows): w is x's
    dtype or float32, so rows whole in x's dtype are whole in either."""
    return cuda_whole_rows(K, DTYPE_BYTES.get(variant.dtype, 1))


# The batches (float32: the tensor-core CUDA form, mma = 1, takes float32 x and w only) and
# the weights (N x K) from which the tensor-core form goes first where nothing is tuned: its
# FMA rivals issue B FMAs a weight and fall behind the weights' stream. The H100 and H200
# tables: at B = 16 it won 4096^2 by 1.55-1.81x over spec order's FMA form and lost 1024^2
# by 1.08-1.14x and 512^2 by 1.9x; at B = 8 it won 4096^2 by 1.03-1.13x and lost 1024^2 by
# 1.36-1.41x. Untuned shapes on an H200 (GPU us, the FMA form's against it): 8 x 777 x 12004
# 22.5 against 15.6, 12 x 777 x 12004 31.0 against 18.2, 16 x 300 x 20000 21.9 against 17.6;
# 16 x 777 x 12004 ran 57.4 on the 16-row tl.dot tile before, 18.9 now (BENCHMARKS.md,
# sixtieth session). B = 17..64 runs as row tiles of 16 side by side (the later ones reading
# w from L2): H200, against the tl.dot tiles the rule took before, 17 / 32 / 64 x 777 x 12004
# 24.7 / 25.6 / 40.8 us against 65.9 / 66.5 / 88.1, 17 / 64 x 4096 x 4096 32.3 / 59.7 against
# 58.4 / 61.4, 24 x 6000 x 800 14.5 against 23.4 (BENCHMARKS.md, sixty-first session).
MMA_BATCH, MMA_WEIGHTS = (8, 64), 1 << 22
# B = 17..CUDA_TILED_MAX_B where nothing above applies: the CUDA FMA forms run the rows as
# row tiles of 4 or 8 side by side, each reading w (the later ones from L2), so they win
# while the outputs and the work are few (FMA_OUTPUTS, FMA_WORK), where every tl.dot tile
# pays its exp pre-pass or wastes rows; beyond, their CTAs (row tiles x node groups) and
# re-reads of w outgrow the GPU. The tensor-core form's extra launches (a row-max pre-pass,
# and over a long K a split's scratch and combine) cost it 4-12 us a call more than its GPU
# time at small weights (17 x 512^2: 10.9 us a call, 6.5 of GPU time; 17 x 1500 x 2000: 18.9
# and 10.1), which it repays from MMA_OUTPUTS outputs (B x N) at a short K (MMA_SHORT_K, no
# split), over MMA_MIN_WEIGHTS weights, or beyond FMA_OUTPUTS. H200, time a call (the larger
# of host and GPU), fitted on 108 shapes at B = 17-64 (44 chosen, 64 random: N = 64-4096, K =
# 16-4096, float32 and bf16) and checked on 64 other random ones (BENCHMARKS.md sixty-second
# session): the chosen candidate's time over the fastest's, geomean 1.46 before (tl.dot tiles
# or the small-batch Triton form), 1.04 now, 45 shapes past 1.15x before, 4 now. Float32: 17 /
# 24 x 1500 x 2000 ran 13.8 / 16.8 us on the first FMA form against 18.9 / 12.4 on the
# tensor-core form, 64 x 512^2 10.5 against 12.7, 53 x 2391 x 32 21.5 against 10.8, 64 x 2000
# x 300 23.0 against 7.4; bf16 x (no tensor-core form): 20 x 2000^2 19.1 against a tl.dot
# tile's 27.4, 40 x 3000 x 1000 (120M multiply-adds) 35.5 against 27.1, 40 x 3616 x 240 (145K
# outputs) 25.8 against 10.7.
MMA_OUTPUTS, MMA_SHORT_K, MMA_MIN_WEIGHTS = 32 * 1024, 256, 1 << 19
FMA_OUTPUTS, FMA_WORK = 64 * 1024, 3 << 25
# ... and the same outputs rules from B = MANY_OUTPUTS_B to 16, where the spec-order FMA form
# runs one row tile a node group: its time grows with B x N (CTAs of 4 rows x 4-8 nodes) at
# any K. H200, 28 random shapes B = 4-16, N = 3000-20000, K = 16-1200 (BENCHMARKS.md
# sixty-second session): float32 15 x 4120 x 368 ran 12.6 us on the FMA form against 6.6 on
# the tensor-core form, 11 x 10077 x 16 20.5 against 6.6, 5 x 14845 x 1096 38.9 against 24.4
# (5 x 5422 x 856, 27K outputs: 12.1 against 17.4); bf16 11 x 16481 x 192 34.2 against the
# 16-row tl.dot tile's 13.7, 9 x 13781 x 16 26.4 against 15.1 (15 x 3623 x 616, 54K outputs:
# 15.8 against 23.1). Below B = 5 nothing was measured (the tensor-core form's pre-pass and
# split cost most there, kgen/specs/logmatmul.yaml).
MANY_OUTPUTS_B = 5


def _by_batch(variants, B: int, N: int, K: int):
    """Where nothing is tuned, B >= 16 runs a tl.dot variant whose rows per program match
    the batch (16 up to B = 32, 64 below WIDE_TILE_ROWS, else 128 -- 16 where those programs
    would be few, FEW_PROGRAMS, or the work small, NARROW_TILE_WORK --, ODD_K_ROWS where K is
    odd; the largest there is up to that),
    instead of spec order's small-batch form: on an H100 at N = K = 4096 (BENCHMARKS.md) 54
    us against 84-91 us at B = 16, and 89 us against 287 us at B = 64. Small weights
    (SMALL_WEIGHTS) take spec order at B = 16 (the CUDA kernel: it won B <= 16 at every
    tuned size) and the small-batch Triton form above it where the outputs are few too
    (SMALL_OUTPUTS, SMALL_WORK; an H200 at 31 x 23 x 545: 6.4 us of GPU time against the
    16-row tl.dot tile's 17.6; BENCHMARKS.md, twenty-second session), as do odd K's moderate
    outputs (ODD_K_OUTPUTS). 8-64 rows of float32 over large weights take the tensor-core
    CUDA form (MMA_BATCH, MMA_WEIGHTS), 17-64 rows a CUDA FMA form over few outputs and
    little work (FMA_OUTPUTS, FMA_WORK), else float32's tensor-core one from MMA_OUTPUTS;
    5-16 rows that tensor-core form or the 16-row tl.dot tile over many outputs
    (MANY_OUTPUTS_B). None: spec order."""
    # (a CUDA form without row tiles, e.g. a user's `rows: 0`, takes only the rows its registers hold)
    cuda = [v for v in variants
            if v.backend == "cuda" and _cuda_takes_k(v, K) and B <= cuda_op_max_b(v.params, v.dtype)]
    mma = next((v for v in cuda if v.params.get("mma", 0)), None)
    if mma is not None and MMA_BATCH[0] <= B <= MMA_BATCH[1] and N * K >= MMA_WEIGHTS:
        return mma
    many = B * N >= MMA_OUTPUTS and (K <= MMA_SHORT_K or N * K >= MMA_MIN_WEIGHTS or B * N > FMA_OUTPUTS)
    if 16 < B <= CUDA_TILED_MAX_B:
        if mma is not None and (many or B * N * K > FMA_WORK):
            return mma
        fma = next((v for v in cuda if not v.params.get("mma", 0)), None)
        if fma is not None and B * N <= FMA_OUTPUTS and B * N * K <= FMA_WORK:
            return fma
    elif MANY_OUTPUTS_B <= B <= 16:
        if mma is not None and many:
            return mma
        if B * N > FMA_OUTPUTS:  # the 16-row tl.dot tile
            tiles = [v for v in variants
                     if v.backend == "triton" and v.params["dot"] != "none" and v.params["block_b"] <= 16]
            return max(tiles, key=lambda v: v.params["block_b"], default=None)
    if B < 16:
        return None
    small = N * K < next(w for b, w in SMALL_WEIGHTS if B <= b)
    if small and B <= 16:
        return None
    odd_outputs = ODD_K_OUTPUTS[any(v.dtype != "float32" for v in variants)]
    if (small and B * N <= SMALL_OUTPUTS and B * N * K <= SMALL_WORK
            or B > 16 and K % 2 and K >= ODD_K_SMALL_K and B * N <= odd_outputs):
        return next((v for v in variants if v.backend == "triton" and v.params["dot"] == "none"), None)
    rows = ODD_K_ROWS if K % 2 else 16 if B <= 32 else 64 if B < WIDE_TILE_ROWS else 128
    if rows > 16 and (-(-B // rows) * -(-N // 64) < FEW_PROGRAMS[K > FEW_PROGRAMS_K]
                      or K > NARROW_K and B * N * K < NARROW_TILE_WORK):
        rows = 16
    dots = [v for v in variants if v.backend == "triton" and v.params["dot"] != "none" and v.params["block_b"] <= rows]
    return max(dots, key=lambda v: v.params["block_b"], default=None)  # (the first of the largest: spec order)
