"""fused_mlp's fused backward kernels (plain Triton; the host side, which picks their block
sizes, lays out their buffers and launches them, is fused_backward.py's `Plan`): every
gradient of the MLP from the upstream gradient and the pre-activations z the forward saved.

1. `fused_mlp_bwd_dz_kernel`, grid cdiv(B, BLOCK_M): each program owns BLOCK_M rows and walks
   the layers down, L-1 to the lowest one a gradient needs: dz_{L-1} = grad * act'(z_{L-1}),
   then per layer g_i = dz_{i+1} @ W_{i+1} (float32 accumulation, rounded to the dtype as
   torch.mm's output is) and dz_i = g_i * act'(z_i) (float32, rounded once), and last, when x
   needs one, grad_x = dz_0 @ W_0. Each dz_i row tile goes to a scratch [B, w(i+1)] in HBM
   (the weight gradients need it) and the next layer reads it back after a barrier: the
   program's own rows, just written, so from L1/L2, as the generic forward's scratch. A
   layer's GEMM loops over BLOCK_N-wide chunks of its output, each a loop over BLOCK_K-wide
   chunks of its input; widths are constexprs padded to powers of two >= 16 with masks.
2. `fused_mlp_bwd_dw_kernel`, grid (tiles, S): a grouped GEMM over the layers. A program
   owns one (layer i, TILE_N x TILE_K tile of dW_i) and one of S fixed row ranges and loops
   over it in order: dW_i[tile] += dz_i[rows, n]^T @ h_{i-1}[rows, k], h_{i-1} = act(z_{i-1})
   recomputed on the fly (rounded as the forward rounded it; h_{-1} = x). The bias gradient,
   dz_i's column sums in float32, comes from programs of its own in the same grid, one per
   TILE_N columns. No atomics: each result has one writer and a fixed order of summation,
   so results are bitwise reproducible.
3. `fused_mlp_bwd_sum_kernel`: where the dW pass is split over B (S > 1, see
   fused_backward.split), each row range writes float32 partials to a workspace [S, E] and
   this kernel adds them up in order of s (deterministic) and rounds once.

Plain Triton, not a template: nothing here depends on a variant (the widths are constexprs
that Triton specialises on), so there is nothing to render into generated/. The kernels are
decorated at import: a process that interprets Triton sets TRITON_INTERPRET before importing
kgen (tests/conftest.py does). The activations repeat the forward's formulas
(kgen/templates/common/triton_activations.py.j2, which a Python module cannot include),
float32 in and out; `code` is a runtime value (one compile serves every activation). So does
`_tf32_round`, the templates' tf32_round (kgen/templates/common/triton_tf32.py.j2): with TF32 on,
`_dot` rounds both float32 operands to the nearest TF32 value, as cuBLAS rounds them, where the
tensor cores would truncate them; a weight tile the dz chain reads from the rounded copy
fused_mlp_bwd_tf32_kernel wrote is not rounded again (`_dot`'s ROUND_B), as the forward reads
its own rounded copies. A product of a one-wide layer (input or output width <=
schema.TF32_FULL_MAX) is computed to float32's accuracy instead ("tf32x3", from the weight
itself, not a rounded copy), as cuBLAS computes such a product (its gemv) and the forward
computes such a layer: a 1 x 1 dW, a sum over the batch that can cancel, was off by up to
190x the float32 tolerance in TF32 (B = 2, widths 1-443-1-1-90; BENCHMARKS.md, fifty-sixth
session).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kgen.families.fused_mlp.schema import ACT_CODE, TF32_FULL_MAX

_RELU = tl.constexpr(ACT_CODE["relu"])
_SIGMOID = tl.constexpr(ACT_CODE["sigmoid"])
_GELU = tl.constexpr(ACT_CODE["gelu"])
_SILU = tl.constexpr(ACT_CODE["silu"])
_FULL_MAX = tl.constexpr(TF32_FULL_MAX)


@triton.jit
def _tf32_round(x):
    """float32 -> the nearest TF32 value, ties away from zero (cvt.rna.tf32.f32, as cuBLAS):
    half a TF32 ulp added to the magnitude's bits, the 13 low mantissa bits cleared; NaN kept."""
    r = ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
    return tl.where(x == x, r, x)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, ROUND_B: tl.constexpr, FULL: tl.constexpr):
    """tl.dot(a, b, acc, input_precision=PRECISION), float32 operands rounded by _tf32_round
    first where PRECISION is "tf32" -- a always, b where ROUND_B (not a weight tile read
    from the copy fused_mlp_bwd_tf32_kernel rounded); 16-bit operands and "tf32x3" as they are.
    FULL (a one-wide layer's product), float32 operands: "tf32x3" whatever PRECISION."""
    if FULL:
        if a.dtype == tl.float32:
            acc = tl.dot(a, b, acc, input_precision="tf32x3")
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    else:
        if PRECISION == "tf32":
            if a.dtype == tl.float32:
                a = _tf32_round(a)
            if ROUND_B and b.dtype == tl.float32:
                b = _tf32_round(b)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _act(z, code):
    if code == _RELU:
        z = tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)  # a NaN stays NaN, as torch.relu
    elif code == _SIGMOID:
        z = _sigmoid(z)
    elif code == _GELU:
        z = z * _sigmoid(2.0 * 0.7978845608028654 * (z + 0.044715 * z * z * z))
    elif code == _SILU:
        z = z * _sigmoid(z)
    return z


@triton.jit
def _times_dact(g, z, code):
    """g * act'(z) (reference.dact's formulas; relu: 0 where z <= 0, else g, as threshold_backward)."""
    if code == _RELU:
        g = tl.where(z <= 0.0, 0.0, g)
    elif code == _SIGMOID:
        s = _sigmoid(z)
        g = g * (s * (1.0 - s))
    elif code == _GELU:
        k = 0.7978845608028654
        s = _sigmoid(2.0 * k * (z + 0.044715 * z * z * z))
        g = g * (s + z * 2.0 * s * (1.0 - s) * k * (1.0 + 3.0 * 0.044715 * z * z))
    elif code == _SILU:
        s = _sigmoid(z)
        g = g * (s * (1.0 + z * (1.0 - s)))
    return g


@triton.jit
def _pick(i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    """Layer i's pointer (i a constexpr: resolved when the kernel compiles)."""
    p = p0
    if i == 1:
        p = p1
    elif i == 2:
        p = p2
    elif i == 3:
        p = p3
    elif i == 4:
        p = p4
    elif i == 5:
        p = p5
    elif i == 6:
        p = p6
    elif i == 7:
        p = p7
    return p


@triton.jit
def _dz_last(g_ptr, z_ptr, dz_ptr, rows, rmask, code, N: tl.constexpr, CN: tl.constexpr):
    """dz = g * act'(z) for the last layer's N columns, CN at a time."""
    for n0 in tl.range(0, N, CN):
        nc = n0 + tl.arange(0, CN)
        m = rmask[:, None] & (nc[None, :] < N)
        at = rows[:, None] * N + nc[None, :]
        g = tl.load(g_ptr + at, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + at, mask=m, other=0.0).to(tl.float32)
        tl.store(dz_ptr + at, _times_dact(g, z, code).to(dz_ptr.dtype.element_ty), mask=m)


@triton.jit
def _chain_gemm(src_ptr, w_ptr, z_ptr, dst_ptr, rows, rmask, code,
                N: tl.constexpr, K: tl.constexpr, WK: tl.constexpr, CN: tl.constexpr, CK: tl.constexpr,
                HAS_Z: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """dst[rows, :K] = (src[rows, :N] @ w[:N, :K]) rounded to the dtype, then (HAS_Z) times
    act'(z[rows, :K]) in float32 and rounded again: a layer's dz from the one above. w's rows
    are WK apart (WK > K: a zero-padded copy whose rows are whole 16-byte vectors, read to WK
    so that the mask does not split a vector)."""
    DTYPE = dst_ptr.dtype.element_ty
    for k0 in tl.range(0, K, CK):
        kc = k0 + tl.arange(0, CK)
        kmask = kc < K
        acc = tl.zeros([BLOCK_M, CK], dtype=tl.float32)
        for n0 in tl.range(0, N, CN):
            nc = n0 + tl.arange(0, CN)
            nmask = nc < N
            a = tl.load(src_ptr + rows[:, None] * N + nc[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
            w = tl.load(w_ptr + nc[:, None] * WK + kc[None, :], mask=nmask[:, None] & (kc < WK)[None, :], other=0.0)
            # (w: a rounded copy under TF32, but a one-wide layer's: the weight itself)
            acc = _dot(a, w, acc, PRECISION, False, (N <= _FULL_MAX) | (K <= _FULL_MAX))
        g = acc.to(DTYPE)
        m = rmask[:, None] & kmask[None, :]
        at = rows[:, None] * K + kc[None, :]
        if HAS_Z:
            z = tl.load(z_ptr + at, mask=m, other=0.0).to(tl.float32)
            g = _times_dact(g.to(tl.float32), z, code).to(DTYPE)
        tl.store(dst_ptr + at, g, mask=m)


@triton.jit(do_not_specialize=["B", "act", "last_act"])
def fused_mlp_bwd_dz_kernel(grad_ptr, gx_ptr,
                            w0, w1, w2, w3, w4, w5, w6, w7,
                            z0, z1, z2, z3, z4, z5, z6, z7,
                            d0, d1, d2, d3, d4, d5, d6, d7,
                            B, act, last_act,
                            DS: tl.constexpr, PS: tl.constexpr, WS: tl.constexpr, NUM_LAYERS: tl.constexpr,
                            LOWEST: tl.constexpr, NEED_X: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # DS: the widths (w0, ..., wL), PS: each padded to a power of two >= 16 (>= 64 for WGMMA
    # tiles: fused_backward.WGMMA_MIN_CHUNK), the chunks' bound; WS: each weight's
    # row stride (its input width, or more for a zero-padded copy); w<i>, z<i>, d<i>: layer
    # i's weight, saved z and dz scratch (slots past NUM_LAYERS unused). With last_act none
    # the host passes grad itself as the last layer's dz (nothing to write).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    if last_act != 0:
        _dz_last(grad_ptr, _pick(NUM_LAYERS - 1, z0, z1, z2, z3, z4, z5, z6, z7),
                 _pick(NUM_LAYERS - 1, d0, d1, d2, d3, d4, d5, d6, d7), rows, rmask, last_act,
                 DS[NUM_LAYERS], min(BLOCK_N, PS[NUM_LAYERS]))
        # this program's dz rows, written by all its threads, are read back by the next layer
        tl.debug_barrier()
    for j in tl.static_range(1, NUM_LAYERS):
        # layer i = NUM_LAYERS - 1 - j: its dz from layer i + 1's
        if NUM_LAYERS - 1 - j >= LOWEST:
            _chain_gemm(_pick(NUM_LAYERS - j, d0, d1, d2, d3, d4, d5, d6, d7),
                        _pick(NUM_LAYERS - j, w0, w1, w2, w3, w4, w5, w6, w7),
                        _pick(NUM_LAYERS - 1 - j, z0, z1, z2, z3, z4, z5, z6, z7),
                        _pick(NUM_LAYERS - 1 - j, d0, d1, d2, d3, d4, d5, d6, d7), rows, rmask, act,
                        DS[NUM_LAYERS - j + 1], DS[NUM_LAYERS - j], WS[NUM_LAYERS - j],
                        min(BLOCK_K, PS[NUM_LAYERS - j + 1]), min(BLOCK_N, PS[NUM_LAYERS - j]), True, BLOCK_M,
                        PRECISION)
            tl.debug_barrier()
    if NEED_X:
        _chain_gemm(d0, w0, d0, gx_ptr, rows, rmask, act, DS[1], DS[0], WS[0], min(BLOCK_K, PS[1]),
                    min(BLOCK_N, PS[0]), False, BLOCK_M, PRECISION)


@triton.jit
def _dw_tile(t, src_ptr, d_ptr, out_ptr, r0, r1, code,
             N: tl.constexpr, K: tl.constexpr, SK: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr,
             KT: tl.constexpr, H_ACT: tl.constexpr, OFF_W: tl.constexpr, BLOCK_B: tl.constexpr,
             STAGES: tl.constexpr, PRECISION: tl.constexpr):
    """Tile t of one layer's dW [N, K]: (t // KT, t % KT) in its grid of TN x TK tiles,
    dz[r0:r1, n]^T @ h[r0:r1, k] in float32, rows in order; h = src (H_ACT: act(src) in
    float32, rounded to the dtype as the forward's h) with rows SK apart (SK > K: x's
    zero-padded copy, whose zero columns are read, not split off by the mask)."""
    nt = t // KT
    kt = t % KT
    n = nt * TN + tl.arange(0, TN)
    nmask = n < N
    k = kt * TK + tl.arange(0, TK)
    lmask = k < SK
    acc = tl.zeros([TN, TK], dtype=tl.float32)
    for r in tl.range(r0, r1, BLOCK_B, num_stages=STAGES):
        rr = (r + tl.arange(0, BLOCK_B)).to(tl.int64)
        rm = rr < r1
        a = tl.load(d_ptr + rr[:, None] * N + n[None, :], mask=rm[:, None] & nmask[None, :], other=0.0)
        h = tl.load(src_ptr + rr[:, None] * SK + k[None, :], mask=rm[:, None] & lmask[None, :], other=0.0)
        if H_ACT:
            h = _act(h.to(tl.float32), code).to(d_ptr.dtype.element_ty)
        acc = _dot(tl.trans(a), h, acc, PRECISION, True, (N <= _FULL_MAX) | (K <= _FULL_MAX))
    tl.store(out_ptr + OFF_W + n[:, None] * K + k[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=nmask[:, None] & (k < K)[None, :])


@triton.jit
def _db_tile(t, d_ptr, out_ptr, r0, r1, N: tl.constexpr, TN: tl.constexpr, OFF_B: tl.constexpr,
             BLOCK_B: tl.constexpr):
    """Columns t*TN.. of one layer's bias gradient: dz[r0:r1, n]'s column sums in float32,
    BLOCK_B rows a step in order. A program of its own, not a second body of a dW tile's
    loop: there Triton 3.6's software pipeliner let the sums read dz tiles that the next
    stage's copies were overwriting (non-reproducible db_0 and dW_0 once x's rows were
    whole 16-byte vectors, 128-wide tiles, 3 stages; BENCHMARKS.md, thirty-first session)."""
    n = t * TN + tl.arange(0, TN)
    nmask = n < N
    acc = tl.zeros([TN], dtype=tl.float32)
    for r in tl.range(r0, r1, BLOCK_B):
        rr = (r + tl.arange(0, BLOCK_B)).to(tl.int64)
        a = tl.load(d_ptr + rr[:, None] * N + n[None, :], mask=(rr < r1)[:, None] & nmask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32), axis=0)
    tl.store(out_ptr + OFF_B + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit(do_not_specialize=["B", "rows_per_split", "act"])
def fused_mlp_bwd_dw_kernel(x_ptr, out_ptr,
                            z0, z1, z2, z3, z4, z5, z6, z7,
                            d0, d1, d2, d3, d4, d5, d6, d7,
                            B, rows_per_split, act,
                            DS: tl.constexpr, XS: tl.constexpr, NUM_LAYERS: tl.constexpr, TS: tl.constexpr,
                            WT: tl.constexpr, TT: tl.constexpr, KT: tl.constexpr, OW: tl.constexpr,
                            OB: tl.constexpr, E: tl.constexpr, BLOCK_B: tl.constexpr, STAGES: tl.constexpr,
                            PRECISION: tl.constexpr):
    # XS: x's row stride (w0, or more for a zero-padded copy).
    # Per layer i (tuples, constexprs): programs TS[i] .. TS[i + 1] - 1 (none: no gradient of
    # it needed), the first WT[i] of them dW_i's tiles (TT[i] = (TN, TK), KT[i] tiles along
    # K), the rest its bias gradient's TN-column tiles; OW[i] / OB[i] where grad_w / grad_b
    # go in the flat output. Row range s = program_id(1) of rows_per_split rows; its results
    # go to out + s * E (E = 0: no split).
    pid = tl.program_id(0)
    s = tl.program_id(1)
    r0 = s * rows_per_split
    r1 = tl.minimum(r0 + rows_per_split, B)
    out = out_ptr + s.to(tl.int64) * E
    for i in tl.static_range(NUM_LAYERS):
        if TS[i + 1] > TS[i]:
            if (pid >= TS[i]) & (pid < TS[i + 1]):
                t = pid - TS[i]
                d_i = _pick(i, d0, d1, d2, d3, d4, d5, d6, d7)
                if WT[i] > 0:
                    if t < WT[i]:
                        if i == 0:
                            _dw_tile(t, x_ptr, d_i, out, r0, r1, act, DS[1], DS[0], XS, TT[i][0], TT[i][1],
                                     KT[i], False, OW[i], BLOCK_B, STAGES, PRECISION)
                        else:
                            _dw_tile(t, _pick(i - 1, z0, z1, z2, z3, z4, z5, z6, z7), d_i, out, r0, r1, act,
                                     DS[i + 1], DS[i], DS[i], TT[i][0], TT[i][1], KT[i], True, OW[i], BLOCK_B,
                                     STAGES, PRECISION)
                if OB[i] >= 0:
                    if t >= WT[i]:
                        _db_tile(t - WT[i], d_i, out, r0, r1, DS[i + 1], TT[i][0], OB[i], BLOCK_B)


@triton.jit(do_not_specialize=["S", "E"])
def fused_mlp_bwd_sum_kernel(ws_ptr, out_ptr, S, E, BLOCK: tl.constexpr):
    """out[e] = sum over s in order of ws[s, e], rounded once to out's dtype."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = e < E
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(ws_ptr + s * E + e, mask=m, other=0.0)
    tl.store(out_ptr + e, acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["R"])
def fused_mlp_bwd_pad_kernel(src_ptr, dst_ptr, R, K: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                             BLOCK_R: tl.constexpr):
    """dst [R, S] = src [R, K] with zero columns K..S-1 (S: K rounded up to whole 16-byte
    vectors; SP: S's power of two): the copy of x or a weight whose rows the backward then
    loads 16 bytes at a time (Plan with `pad`)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.arange(0, SP)
    v = tl.load(src_ptr + r[:, None] * K + c[None, :], mask=(r[:, None] < R) & (c[None, :] < K), other=0.0)
    tl.store(dst_ptr + r[:, None] * S + c[None, :], v, mask=(r[:, None] < R) & (c[None, :] < S))


@triton.jit
def fused_mlp_bwd_tf32_kernel(s0, s1, s2, s3, s4, s5, s6, s7, d0, d1, d2, d3, d4, d5, d6, d7,
                              NS: tl.constexpr, KS: tl.constexpr, SS: tl.constexpr, NUM: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 with TF32 on (Plan.copies): copy c of NUM, d<c> [NS[c], SS[c]] = s<c> [NS[c], KS[c]]
    rounded by _tf32_round, zero columns KS[c]..SS[c]-1: the weights the dz chain reads, each
    rounded once a call rather than a tile at a time in every program. Grid: (row blocks of
    the tallest, NUM)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    j = tl.program_id(1)
    for c in tl.static_range(NUM):
        if j == c:
            src = _pick(c, s0, s1, s2, s3, s4, s5, s6, s7)
            dst = _pick(c, d0, d1, d2, d3, d4, d5, d6, d7)
            for k0 in tl.range(0, SS[c], BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                v = tl.load(src + r[:, None] * KS[c] + k[None, :], mask=(r[:, None] < NS[c]) & (k[None, :] < KS[c]),
                            other=0.0)
                tl.store(dst + r[:, None] * SS[c] + k[None, :], _tf32_round(v),
                         mask=(r[:, None] < NS[c]) & (k[None, :] < SS[c]))
