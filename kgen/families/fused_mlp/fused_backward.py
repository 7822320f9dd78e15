"""fused_mlp's fused backward: every gradient of the MLP in two Triton launches (three at
large B), from the upstream gradient and the pre-activations z the forward saved.

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
   dz_i's column sums in float32, comes from the programs of tile column 0 (a second loop
   body with the sums in it, so the other programs pay nothing). No atomics: each result has
   one writer and a fixed order of summation, so results are bitwise reproducible.
3. Where the tiles are too few to fill the GPU at large B (S > 1, see `split`), each row
   range writes float32 partials to a workspace [S, E] and `fused_mlp_bwd_sum_kernel` adds
   them up in order of s (deterministic) and rounds once.

Numerics are backward_lean's: float32 accumulation, outputs in the dtype; the weight and
bias gradients are views of one flat buffer in the dtype (16-element-aligned slots, one
allocation, kept alive by any of them): grad_w [w(i+1), w(i)], grad_b the float32 column sum
of dz rounded once, as dz.sum(0). float32 dots take launch.precision's choice, as the
forward: TF32 where torch.backends.cuda.matmul.allow_tf32 is set, else "tf32x3" (float32's
accuracy on tensor cores; "ieee" is an FMA loop that Triton compiles with a stack).

Which launches and buffers a call gets (block sizes, split, layout) is decided once per
call signature and `needs` (`Plan`, kept by train.Entry); launches after the first replay the
recorded binaries through kgen.runtime.triton_launch (pointers as integers, none of
Triton's per-launch Python). KGEN_FUSED_MLP_FUSED_BWD=0 (or ENABLED = False) leaves the
training fast path on reference.backward_lean.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from kgen.families.fused_mlp import launch as fwd_launch
from kgen.families.fused_mlp.schema import ACT_CODE, MAX_LAYERS, padded
from kgen.runtime import triton_launch
from kgen.runtime.op import sm_count

ENABLED = os.environ.get("KGEN_FUSED_MLP_FUSED_BWD", "1") != "0"
DEVICES = ("cuda",)  # where the training fast path takes it (tests add "cpu": the interpreter)

# Tiles, by element size (float32's dots, "tf32x3" with TF32 off, split each operand in two:
# smaller tiles), then by B: (B up to, ...). The 16-bit rows were measured per kernel on an
# H100 (Triton 3.6; BENCHMARKS.md fifteenth session, DLRM top and bottom at B = 128 to 65536);
# the float32 rows are first guesses. Under Triton 3.9 the fastest large-B tiles keep a small
# stack (dW 128 x 128 with 4 warps: 8 B; the chain's 128 x 64 with 4 warps: 400 B) and were
# still the fastest measured (top, B = 65536: chain 406 -> 320 us, dW 452 -> 273 us).
# dz chain: rows per program (small B: more programs for the serial walk; large B: fewer
# re-reads of the weights, which every program streams from L2), output chunk, warps; and
# the input chunk (the dots' K).
CHAIN = {2: ((512, 16, 128, 4), (4096, 32, 128, 4), (32768, 64, 128, 8), (None, 128, 64, 4)),
         4: ((512, 16, 64, 4), (4096, 32, 64, 4), (None, 64, 64, 8))}
CHAIN_BLOCK_K = {2: 64, 4: 32}
# dW: the tile of dW_i (TILE_N = TILE_K; small B: more programs), warps; rows per step (the
# dots' K) and pipeline stages.
DW_TILES = {2: ((4096, 64, 4), (None, 128, 4)), 4: ((4096, 64, 4), (None, 128, 8))}
DW_BLOCK_B = {2: 64, 4: 32}
DW_STAGES = 3
# split over B: only where a row range keeps SPLIT_MIN_ROWS rows, aiming at SPLIT_WAVES
# programs per SM (the sum pass then reads S x E float32 partials once: DLRM top at
# B = 65536, 22 tiles, S = 24 on 132 SMs: 31 MB, 26 us, against 452 us for the dW pass at
# S = 12 and 2 waves, 273 us at S = 24).
SPLIT_MIN_ROWS, SPLIT_WAVES = 256, 4
SUM_BLOCK = 1024
ALIGN = 16  # elements: every buffer slice starts 16-byte aligned

_RELU = tl.constexpr(ACT_CODE["relu"])
_SIGMOID = tl.constexpr(ACT_CODE["sigmoid"])
_GELU = tl.constexpr(ACT_CODE["gelu"])
_SILU = tl.constexpr(ACT_CODE["silu"])
_empty = torch.empty  # every buffer the kernels write (tests poison them through this)


# --------------------------------------------------------------------------- kernels
# Plain Triton, not a template: nothing here depends on a variant (the widths are constexprs
# that Triton specialises on), so there is nothing to render into generated/. The kernels are
# decorated at import: a process that interprets Triton sets TRITON_INTERPRET before importing
# kgen (tests/conftest.py does). The activations repeat the forward's formulas
# (kgen/templates/common/triton_activations.py.j2, which a Python module cannot include),
# float32 in and out; `code` is a runtime value (one compile serves every activation).


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _act(z, code):
    if code == _RELU:
        z = tl.maximum(z, 0.0)
    elif code == _SIGMOID:
        z = _sigmoid(z)
    elif code == _GELU:
        z = z * _sigmoid(2.0 * 0.7978845608028654 * (z + 0.044715 * z * z * z))
    elif code == _SILU:
        z = z * _sigmoid(z)
    return z


@triton.jit
def _times_dact(g, z, code):
    """g * act'(z) (reference.dact's formulas; relu: g where z > 0, as threshold_backward)."""
    if code == _RELU:
        g = tl.where(z > 0.0, g, 0.0)
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
                N: tl.constexpr, K: tl.constexpr, CN: tl.constexpr, CK: tl.constexpr, HAS_Z: tl.constexpr,
                BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """dst[rows, :K] = (src[rows, :N] @ w[:N, :K]) rounded to the dtype, then (HAS_Z) times
    act'(z[rows, :K]) in float32 and rounded again: a layer's dz from the one above."""
    DTYPE = dst_ptr.dtype.element_ty
    for k0 in tl.range(0, K, CK):
        kc = k0 + tl.arange(0, CK)
        kmask = kc < K
        acc = tl.zeros([BLOCK_M, CK], dtype=tl.float32)
        for n0 in tl.range(0, N, CN):
            nc = n0 + tl.arange(0, CN)
            nmask = nc < N
            a = tl.load(src_ptr + rows[:, None] * N + nc[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
            w = tl.load(w_ptr + nc[:, None] * K + kc[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
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
                            DS: tl.constexpr, PS: tl.constexpr, NUM_LAYERS: tl.constexpr, LOWEST: tl.constexpr,
                            NEED_X: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # DS: the widths (w0, ..., wL), PS: each padded to a power of two >= 16; w<i>, z<i>, d<i>:
    # layer i's weight, saved z and dz scratch (slots past NUM_LAYERS unused). With
    # last_act none the host passes grad itself as the last layer's dz (nothing to write).
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
                        DS[NUM_LAYERS - j + 1], DS[NUM_LAYERS - j], min(BLOCK_K, PS[NUM_LAYERS - j + 1]),
                        min(BLOCK_N, PS[NUM_LAYERS - j]), True, BLOCK_M, PRECISION)
            tl.debug_barrier()
    if NEED_X:
        _chain_gemm(d0, w0, d0, gx_ptr, rows, rmask, act, DS[1], DS[0], min(BLOCK_K, PS[1]), min(BLOCK_N, PS[0]),
                    False, BLOCK_M, PRECISION)


@triton.jit
def _dw_rows(src_ptr, d_ptr, r0, r1, n, nmask, k, kmask, code,
             N: tl.constexpr, K: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr, H_ACT: tl.constexpr,
             DO_W: tl.constexpr, DO_B: tl.constexpr, BLOCK_B: tl.constexpr, STAGES: tl.constexpr,
             PRECISION: tl.constexpr):
    """(dz[r0:r1, n]^T @ h[r0:r1, k], dz[r0:r1, n]'s column sums) in float32, rows in order;
    h = src (H_ACT: act(src) in float32, rounded to the dtype as the forward's h)."""
    acc = tl.zeros([TN, TK], dtype=tl.float32)
    bacc = tl.zeros([TN], dtype=tl.float32)
    for r in tl.range(r0, r1, BLOCK_B, num_stages=STAGES):
        rr = (r + tl.arange(0, BLOCK_B)).to(tl.int64)
        rm = rr < r1
        a = tl.load(d_ptr + rr[:, None] * N + n[None, :], mask=rm[:, None] & nmask[None, :], other=0.0)
        if DO_B:
            bacc += tl.sum(a.to(tl.float32), axis=0)
        if DO_W:
            h = tl.load(src_ptr + rr[:, None] * K + k[None, :], mask=rm[:, None] & kmask[None, :], other=0.0)
            if H_ACT:
                h = _act(h.to(tl.float32), code).to(d_ptr.dtype.element_ty)
            acc = tl.dot(tl.trans(a), h, acc, input_precision=PRECISION)
    return acc, bacc


@triton.jit
def _dw_tile(t, src_ptr, d_ptr, out_ptr, r0, r1, code,
             N: tl.constexpr, K: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr, KT: tl.constexpr,
             H_ACT: tl.constexpr, DO_W: tl.constexpr, DO_B: tl.constexpr, OFF_W: tl.constexpr, OFF_B: tl.constexpr,
             BLOCK_B: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr):
    """Tile t of one layer: (t // KT, t % KT) in its grid of TN x TK tiles of dW [N, K]."""
    nt = t // KT
    kt = t % KT
    n = nt * TN + tl.arange(0, TN)
    nmask = n < N
    k = kt * TK + tl.arange(0, TK)
    kmask = k < K
    if DO_B:
        if kt == 0:  # the column sums ride on the first column of tiles only
            acc, bacc = _dw_rows(src_ptr, d_ptr, r0, r1, n, nmask, k, kmask, code, N, K, TN, TK, H_ACT, DO_W, True,
                                 BLOCK_B, STAGES, PRECISION)
            tl.store(out_ptr + OFF_B + n, bacc.to(out_ptr.dtype.element_ty), mask=nmask)
        else:
            acc, bacc = _dw_rows(src_ptr, d_ptr, r0, r1, n, nmask, k, kmask, code, N, K, TN, TK, H_ACT, DO_W, False,
                                 BLOCK_B, STAGES, PRECISION)
    else:
        acc, bacc = _dw_rows(src_ptr, d_ptr, r0, r1, n, nmask, k, kmask, code, N, K, TN, TK, H_ACT, DO_W, False,
                             BLOCK_B, STAGES, PRECISION)
    if DO_W:
        tl.store(out_ptr + OFF_W + n[:, None] * K + k[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=nmask[:, None] & kmask[None, :])


@triton.jit(do_not_specialize=["B", "rows_per_split", "act"])
def fused_mlp_bwd_dw_kernel(x_ptr, out_ptr,
                            z0, z1, z2, z3, z4, z5, z6, z7,
                            d0, d1, d2, d3, d4, d5, d6, d7,
                            B, rows_per_split, act,
                            DS: tl.constexpr, NUM_LAYERS: tl.constexpr, TS: tl.constexpr, TT: tl.constexpr,
                            KT: tl.constexpr, OW: tl.constexpr, OB: tl.constexpr, E: tl.constexpr,
                            BLOCK_B: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr):
    # Per layer i (tuples, constexprs): TS[i] its first program, TS[i + 1] - TS[i] its tiles
    # (none: no gradient of it needed), TT[i] its tile (TN, TK), KT[i] tiles along K, OW[i] /
    # OB[i] where grad_w / grad_b go in the flat output (-1: not needed). Row range s =
    # program_id(1) of rows_per_split rows; its results go to out + s * E (E = 0: no split).
    pid = tl.program_id(0)
    s = tl.program_id(1)
    r0 = s * rows_per_split
    r1 = tl.minimum(r0 + rows_per_split, B)
    out = out_ptr + s.to(tl.int64) * E
    for i in tl.static_range(NUM_LAYERS):
        if TS[i + 1] > TS[i]:
            if (pid >= TS[i]) & (pid < TS[i + 1]):
                if i == 0:
                    _dw_tile(pid - TS[i], x_ptr, d0, out, r0, r1, act, DS[1], DS[0], TT[i][0], TT[i][1], KT[i],
                             False, OW[i] >= 0, OB[i] >= 0, OW[i], OB[i], BLOCK_B, STAGES, PRECISION)
                else:
                    _dw_tile(pid - TS[i], _pick(i - 1, z0, z1, z2, z3, z4, z5, z6, z7),
                             _pick(i, d0, d1, d2, d3, d4, d5, d6, d7), out, r0, r1, act, DS[i + 1], DS[i],
                             TT[i][0], TT[i][1], KT[i], True, OW[i] >= 0, OB[i] >= 0, OW[i], OB[i], BLOCK_B, STAGES,
                             PRECISION)


@triton.jit(do_not_specialize=["S", "E"])
def fused_mlp_bwd_sum_kernel(ws_ptr, out_ptr, S, E, BLOCK: tl.constexpr):
    """out[e] = sum over s in order of ws[s, e], rounded once to out's dtype."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = e < E
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(ws_ptr + s * E + e, mask=m, other=0.0)
    tl.store(out_ptr + e, acc.to(out_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------- host side


def _up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def _by_b(table, B):
    for row in table:
        if row[0] is None or B <= row[0]:
            return row[1:]


def split(n_tiles: int, B: int, block_b: int, sms: int, E: int) -> tuple[int, int]:
    """(S, rows per range): the dW programs' split over B, S = 1 unless the tiles alone are
    fewer than SPLIT_WAVES per SM and every range keeps SPLIT_MIN_ROWS rows (and the S x E
    workspace stays within int32 offsets)."""
    S = min(B // SPLIT_MIN_ROWS, -(-SPLIT_WAVES * sms // max(n_tiles, 1)), (2 ** 31 - 1) // E)
    if S <= 1:
        return 1, _up(B, block_b)
    rows = _up(-(-B // S), block_b)
    return -(-B // rows), rows


class Plan:
    """One call signature's fused backward for one `needs`: block sizes, the split, the
    flat layout of the parameter gradients, the launches' constant arguments, and (after
    the first call) their replay. Built by `plan`; called as
    plan(grad, x, weights, zs) -> (grad_x or None, [grad_w or None], [grad_b or None])."""

    def __init__(self, widths, dtype, device, B, has_bias, acts, needs, precision):
        L = len(widths) - 1
        self.widths, self.dtype, self.device, self.B, self.L = widths, dtype, device, B, L
        need_x, need_w, need_b = needs[0], needs[1:1 + L], needs[1 + L:]
        need_b = [bool(n and on) for n, on in zip(need_b, has_bias)]
        self.need_x = need_x
        lowest = 0 if need_x else min(i for i in range(L) if need_w[i] or need_b[i])
        self.last_none = acts[1] == "none"
        act, last = ACT_CODE[acts[0]], ACT_CODE[acts[1]]
        item = dtype.itemsize
        # dz scratch: layers lowest..L-1 (the last one's is grad itself where last_act is none)
        self.dz_at, at = {}, 0
        for i in range(lowest, L - (1 if self.last_none else 0)):
            self.dz_at[i] = at
            at = _up(at + B * widths[i + 1])
        self.dz_numel = max(at, ALIGN)
        # flat output: grad_w then grad_b of each needed layer, 16-element aligned
        self.w_at, self.b_at, at = [-1] * L, [-1] * L, 0
        for i in range(L):
            if need_w[i]:
                self.w_at[i], at = at, _up(at + widths[i] * widths[i + 1])
            if need_b[i]:
                self.b_at[i], at = at, _up(at + widths[i + 1])
        self.E = max(at, ALIGN)
        # dz chain
        block_m, block_n, warps = _by_b(CHAIN[item], B)
        ds, ps = tuple(widths), tuple(padded(w) for w in widths)
        self.chain_grid = (-(-B // block_m),)
        self.chain_kw = dict(DS=ds, PS=ps, NUM_LAYERS=L, LOWEST=lowest, NEED_X=bool(need_x), BLOCK_M=block_m,
                             BLOCK_N=block_n, BLOCK_K=CHAIN_BLOCK_K[item], PRECISION=precision, num_warps=warps)
        self.chain_ints = [B, act, last]
        # dW / db: the tiles of every layer with a gradient needed, in layer order
        tile, warps = _by_b(DW_TILES[item], B)
        block_b = DW_BLOCK_B[item]
        starts, tt, kts, n = [0], [], [], 0
        for i in range(L):
            tn, tk = min(tile, padded(widths[i + 1])), min(tile, padded(widths[i]))
            kt = -(-widths[i] // tk) if need_w[i] else 1
            if need_w[i] or need_b[i]:
                n += -(-widths[i + 1] // tn) * kt
            starts.append(n)
            tt.append((tn, tk))
            kts.append(kt)
        self.S, rows = split(n, B, block_b, sm_count(device, 4), self.E)
        self.dw_grid = (n, self.S)
        self.dw_kw = dict(DS=ds, NUM_LAYERS=L, TS=tuple(starts), TT=tuple(tt), KT=tuple(kts), OW=tuple(self.w_at),
                          OB=tuple(self.b_at), E=self.E if self.S > 1 else 0, BLOCK_B=block_b, STAGES=DW_STAGES,
                          PRECISION=precision, num_warps=warps)
        self.dw_ints = [B, rows, act]
        self.sum_grid = (-(-self.E // SUM_BLOCK),)
        self.sum_kw = dict(BLOCK=SUM_BLOCK, num_warps=4)
        self.sum_ints = [self.S, self.E]
        self.replay = None  # triton_launch's replay of the launches, after the first call
        self.state = "new"  # "ok" once launched; "failed": its kernels did not build here
        self.need_w, self.need_b, self.lowest = need_w, need_b, lowest

    def __call__(self, grad, x, weights, zs):
        """(grad_x or None, [grad_w or None], [grad_b or None]), or None where the kernels
        did not build on this machine (the first call warns; the caller falls back)."""
        if self.state == "failed":
            return None
        B, dt, dev = self.B, self.dtype, self.device
        gx = _empty((B, self.widths[0]), dtype=dt, device=dev) if self.need_x else None
        scratch = _empty(self.dz_numel, dtype=dt, device=dev)
        flat = _empty(self.E, dtype=dt, device=dev)
        ws = _empty(self.S * self.E, dtype=torch.float32, device=dev) if self.S > 1 else None
        # the tensors whose addresses change from call to call (the launches take views of them)
        slots = [grad, x, *weights, *(z for z in zs if z is not None), scratch, flat]
        slots += [t for t in (ws, gx) if t is not None]
        r = self.replay
        if r is None or not r([t.data_ptr() for t in slots]):
            launches = self.launches(grad, x, weights, zs, scratch, flat, ws, gx)
            try:
                for launch in launches:
                    triton_launch.launch(*launch)
            except (CompilationError, OutOfResources) as e:
                if self.state == "ok":
                    raise
                self.state = "failed"
                warnings.warn(f"fused_mlp: the fused backward did not build for widths {self.widths} "
                              f"({type(e).__name__}: {e}); reference.backward_lean serves them", stacklevel=2)
                return None
            self.state = "ok"
            if r is None:  # later calls replay the binaries (None where Triton's own path must run)
                self.replay = triton_launch.replay(launches, slots)
        return gx, *self.views(flat)

    def launches(self, grad, x, weights, zs, scratch, flat, ws, gx) -> list:
        """[(kernel, grid, args, kw)]: the two or three launches on these buffers."""
        B, L = self.B, self.L
        filler = grad  # unused pointer slots
        d, z, w = [filler] * MAX_LAYERS, [filler] * MAX_LAYERS, [filler] * MAX_LAYERS
        for i, at in self.dz_at.items():
            d[i] = scratch[at:at + B * self.widths[i + 1]]
        if self.last_none:
            d[L - 1] = grad
        for i in range(L):
            if zs[i] is not None:
                z[i] = zs[i]
            w[i] = weights[i]
        out = [(fused_mlp_bwd_dz_kernel, self.chain_grid, [grad, gx if gx is not None else filler, *w, *z, *d,
                                                            *self.chain_ints], self.chain_kw)]
        if self.dw_grid[0]:  # (none: only grad_x asked for)
            out.append((fused_mlp_bwd_dw_kernel, self.dw_grid, [x, ws if ws is not None else flat, *z, *d,
                                                                *self.dw_ints], self.dw_kw))
        if ws is not None:
            out.append((fused_mlp_bwd_sum_kernel, self.sum_grid, [ws, flat, *self.sum_ints], self.sum_kw))
        return out

    def views(self, flat):
        """([grad_w or None], [grad_b or None]): views of the flat output (as_strided: one
        torch call each, a third of a slice and a view's host time)."""
        gws, gbs = [None] * self.L, [None] * self.L
        for i in range(self.L):
            K, N = self.widths[i], self.widths[i + 1]
            if self.w_at[i] >= 0:
                gws[i] = _strided(flat, (N, K), (K, 1), self.w_at[i])
            if self.b_at[i] >= 0:
                gbs[i] = _strided(flat, (N,), (1,), self.b_at[i])
        return gws, gbs


_strided = torch.as_strided


def plan(widths, dtype, device, B, has_bias, acts, needs) -> Plan | None:
    """The fused backward for this signature and `needs` (x, weight per layer, bias per
    layer), or None where it does not apply: nothing needed, B = 0, more layers than the
    kernels' slots."""
    L = len(widths) - 1
    wanted = any(needs[:1 + L]) or any(n and on for n, on in zip(needs[1 + L:], has_bias))
    if B <= 0 or not 1 <= L <= MAX_LAYERS or not wanted:
        return None
    return Plan(tuple(widths), dtype, device, B, tuple(has_bias), acts, tuple(needs), fwd_launch.precision(dtype))


def backward(grad, x, weights, has_bias, zs, activation: str, last_activation: str, needs):
    """reference.backward_lean's gradients through the fused kernels (2-D contiguous grad
    and x, contiguous weights, the zs the forward saved): a Plan built for this call. The
    training fast path keeps its plans (train.py); this is for tests and benchmarks."""
    widths = (x.shape[1], *(w.shape[0] for w in weights))
    p = plan(widths, x.dtype, x.device, x.shape[0], has_bias, (activation, last_activation), needs)
    if p is None:
        raise ValueError("fused_mlp backward: nothing to compute (B = 0 or no gradient needed)")
    return p(grad, x, weights, zs)
