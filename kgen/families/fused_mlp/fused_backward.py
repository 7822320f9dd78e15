"""fused_mlp's fused backward, host side: every gradient of the MLP in two Triton launches
(three at large B), from the upstream gradient and the pre-activations z the forward saved.
The kernels, and what each computes, are in fused_backward_kernels.py: the dz chain
(`fused_mlp_bwd_dz_kernel`, walking the layers down per block of rows, grad_x last), the
weight and bias gradients (`fused_mlp_bwd_dw_kernel`, a grouped GEMM over the layers' dW
tiles, optionally split over B into S row ranges, see `split`), and where S > 1 the ordered
sum of the ranges' float32 partials (`fused_mlp_bwd_sum_kernel`). No atomics: results are
bitwise reproducible.

Numerics are backward_lean's: float32 accumulation, outputs in the dtype; the weight and
bias gradients are views of one flat buffer in the dtype (16-element-aligned slots, one
allocation, kept alive by any of them): grad_w [w(i+1), w(i)], grad_b the float32 column sum
of dz rounded once, as dz.sum(0). float32 dots take launch.precision's choice, as the
forward: TF32 where torch.backends.cuda.matmul.allow_tf32 is set, else "tf32x3" (float32's
accuracy on tensor cores; "ieee" is an FMA loop that Triton compiles with a stack). With TF32,
operands are rounded to the nearest TF32 value as cuBLAS rounds them (the tensor cores would
truncate): the weights the dz chain reads once a call, into TF32-rounded copies in the scratch
(`Plan.copies`, one fused_mlp_bwd_tf32_kernel launch first), every other operand in the kernels.

Which launches and buffers a call gets (block sizes, split, layout) is decided once per
call signature and `needs` (`Plan`, kept by train.Entry), with two options the tuner may
choose per bucket (tuning.tune_choices): another dz-chain tile (CHAIN_OPTIONS) and `pad`
(x and the large weights whose rows are not whole 16-byte vectors read from zero-padded
copies that `fused_mlp_bwd_pad_kernel` launches write into the scratch first: the DLRM top
MLP's 367-wide x and W0 otherwise cost the dW and chain kernels 2-byte loads outside Triton's
pipeline, 144 of the dW kernel's global loads in sm_90 PTX against 16). Launches after the
first replay the recorded binaries through kgen.runtime.triton_launch (pointers as integers,
none of Triton's per-launch Python). KGEN_FUSED_MLP_FUSED_BWD=0 (or ENABLED = False) leaves
the training fast path on reference.backward_lean.
"""

from __future__ import annotations

import os
import warnings

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from kgen.families.fused_mlp import launch as fwd_launch
from kgen.families.fused_mlp.fused_backward_kernels import (  # Plan.launches reads them here (tests patch them)
    fused_mlp_bwd_dw_kernel,
    fused_mlp_bwd_dz_kernel,
    fused_mlp_bwd_pad_kernel,
    fused_mlp_bwd_sum_kernel,
    fused_mlp_bwd_tf32_kernel,
)
from kgen.families.fused_mlp.schema import ACT_CODE, MAX_LAYERS, TF32_FULL_MAX, padded, weight_strides
from kgen.runtime import triton_launch
from kgen.runtime.op import sm_count

ENABLED = os.environ.get("KGEN_FUSED_MLP_FUSED_BWD", "1") != "0"
DEVICES = ("cuda",)  # where the training fast path takes it (tests add "cpu": the interpreter)

# Tiles, by element size (float32's dots, "tf32x3" with TF32 off, split each operand in two:
# smaller tiles), then by B: (B up to, ...). The 16-bit rows were measured per kernel on an
# H100 (Triton 3.6; BENCHMARKS.md fifteenth session, DLRM top and bottom at B = 128 to 65536);
# the float32 rows are first guesses. Under Triton 3.9 the fastest large-B dW tile keeps a
# small stack (128 x 128 with 4 warps: 8 B) and was still the fastest measured (top, B = 65536:
# dW 452 -> 273 us).
# dz chain: rows per program (small B: more programs for the serial walk; large B: fewer
# re-reads of the weights, which every program streams from L2), output chunk, warps; and
# the input chunk (the dots' K). Triton 3.6 miscompiles the chain on sm_90 at some widths --
# silently wrong grad_x (e.g. 7-28-3-6-33, 10-13-35-32-21-5) or an illegal shared-memory read
# by the dot (compute-sanitizer: "Invalid __shared__ read of size 2048 bytes", 7-28-3-33,
# 30-43-153) -- at 128 x 64 with 4 or 8 warps, 128 x 128 with 8 (16 of 36 random widths) and
# 64 x 128 with 4 (30-43-153, 3-58-31-297-177-112); the same kernel is right under the
# interpreter (H200, BENCHMARKS.md forty-ninth and fiftieth sessions). Every failure is a WGMMA
# tile (>= 64 rows; 16 and 32 rows run mma.sync) with a dot of 16 or 32 columns or K (a layer
# of <= 32 padded width). With every chunk at least WGMMA_MIN_CHUNK wide (zero-masked past the
# layer) each of those 5 tiles passed at those 5 widths and the DLRM ones, so WGMMA tiles take
# that floor (its cost: the DLRM bottom's backward at B = 65536 287 -> 299 us at 64 x 128 x 8,
# the top's none). 128 rows stay out all the same (MAX_CHAIN_ROWS: fewer widths checked, and
# they were no faster than 64 x 128 x 4 for the DLRM MLPs).
# Above B = 4096, 64 x 128 with 4 warps (one warpgroup over the whole chunk): H200, bf16, every
# gradient, GPU us at B = 16384 / 40000 / 65536, top 180.6 / 395.0 / 589.0 (with pad 139.7 /
# 295.7 / 419.6; 128 x 128 x 8 with pad: 435 at 65536) against 8 warps' 205.7 / 455.6 / 701.3
# (151.3 / 313.4 / 482.9), bottom 97.6 / 200.4 / 288.7 against 92.4 / 198.3 / 285.7 (8 warps:
# tuner option "w8"; these without the floor); 64 x 64 and 64 x 256, 4 or 8 warps, and 32 rows
# were slower for both (BENCHMARKS.md, fiftieth session).
# float32 keeps 32 rows above B = 512: with TF32 on, Triton 3.6's pipeliner fails to compile
# the DLRM top MLP's chain at 64 rows (8 or 4 warps; "PassManager::run failed"), and 32 rows
# with 4 warps measured fastest with TF32 off at B = 16384 and 65536 (H100: top 897 / 3385 us
# against 1174 / 4453 at 64 x 64 x 8; nineteenth session, build/s19/bwd32.py).
MAX_CHAIN_ROWS = 64
CHAIN = {2: ((512, 16, 128, 4), (4096, 32, 128, 4), (None, 64, 128, 4)),
         4: ((512, 16, 64, 4), (None, 32, 64, 4))}
CHAIN_BLOCK_K = {2: 64, 4: 32}
WGMMA_ROWS, WGMMA_MIN_CHUNK = 64, 64  # chain tiles of >= WGMMA_ROWS rows: chunks >= WGMMA_MIN_CHUNK (above)
# Chain tiles the tuner may choose per bucket instead of CHAIN's row (tuning.tune_choices,
# 16-bit only): "m32", 32 x 128 with 4 warps (B <= 4096's row) at any B: twice the programs of
# the large-B row; "w8", the large-B row with 8 warps (two warpgroups, 64 columns each: a few %
# faster for the DLRM bottom MLP above). "m32" replaces "c128", 128 x 128 with 8 warps, which
# took the top MLP's chain 105.9 -> 81.7 us at B = 16384 and cost the bottom's 29.9 -> 35.1
# (H200, thirtieth session) and is miscompiled at other widths (above).
CHAIN_OPTIONS = {"m32": (32, 128, 4), "w8": (64, 128, 8)}
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
PAD_BLOCK_R = 16  # rows a program of the pad copies (Plan with `pad`)
TF32_BLOCK_R, TF32_BLOCK_K = 8, 128  # a program's rows and column step of the TF32 copies (Plan.copies)
ALIGN = 16  # elements: every buffer slice starts 16-byte aligned

_empty = torch.empty  # every buffer the kernels write (tests poison them through this)


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

    def __init__(self, widths, dtype, device, B, has_bias, acts, needs, precision, chain=None, pad=False):
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
        # `pad`: x (read by dW_0) and each weight of >= ALIGN_MIN_BYTES that the chain reads, where
        # their rows are not whole 16-byte vectors, read from zero-padded copies in the scratch
        # (as the forward's exact variants read such a weight: schema.weight_strides); Triton
        # loads unaligned rows 2 bytes at a time, outside its software pipeline
        v = 16 // item
        chain_reads = [i >= lowest + 1 or (i == 0 and need_x) for i in range(L)]
        strides = weight_strides(widths, item, align=pad)
        self.ws = tuple(st if read else k for st, read, k in zip(strides, chain_reads, widths))
        self.xs = _up(widths[0], v) if pad and need_w[0] and widths[0] % v else widths[0]
        self.pads = []  # (what: "x" or a layer index, rows, K, stride, scratch offset); [] without pad
        if self.xs != widths[0]:
            self.pads.append(("x", B, widths[0], self.xs, at))
            at = _up(at + B * self.xs)
        # float32 with TF32 on: every weight the chain reads from a TF32-rounded copy (zero-padded
        # to its stride too), all written by one fused_mlp_bwd_tf32_kernel launch first; but a
        # one-wide layer's (its products in float32's accuracy: fused_backward_kernels._dot)
        self.copies = []  # (layer, rows, K, stride, scratch offset)
        tf32 = precision == "tf32" and dtype == torch.float32
        for i, (st, k) in enumerate(zip(self.ws, widths)):
            if tf32 and chain_reads[i] and min(k, widths[i + 1]) > TF32_FULL_MAX:
                self.copies.append((i, widths[i + 1], k, st, at))
                at = _up(at + widths[i + 1] * st)
            elif st != k:
                self.pads.append((i, widths[i + 1], k, st, at))
                at = _up(at + widths[i + 1] * st)
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
        block_m, block_n, warps = chain or _by_b(CHAIN[item], B)
        if block_m > MAX_CHAIN_ROWS:  # (a caller's tile: see CHAIN)
            raise ValueError(f"fused_mlp backward: a dz-chain tile of {block_m} rows; at most {MAX_CHAIN_ROWS}")
        ds, ps = tuple(widths), tuple(padded(w) for w in widths)
        chain_ps = tuple(max(WGMMA_MIN_CHUNK, p) for p in ps) if block_m >= WGMMA_ROWS else ps
        self.chain_grid = (-(-B // block_m),)
        self.chain_kw = dict(DS=ds, PS=chain_ps, WS=self.ws, NUM_LAYERS=L, LOWEST=lowest, NEED_X=bool(need_x),
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=CHAIN_BLOCK_K[item], PRECISION=precision,
                             num_warps=warps)
        self.chain_ints = [B, act, last]
        # dW / db: per layer in order, the tiles of dW_i (if needed), then its bias
        # gradient's tiles of TN columns (if needed)
        tile, warps = _by_b(DW_TILES[item], B)
        block_b = DW_BLOCK_B[item]
        starts, wts, tt, kts, n = [0], [], [], [], 0
        for i in range(L):
            tn, tk = min(tile, padded(widths[i + 1])), min(tile, padded(widths[i]))
            nt, kt = -(-widths[i + 1] // tn), -(-widths[i] // tk)
            wts.append(nt * kt if need_w[i] else 0)
            n += wts[-1] + (nt if need_b[i] else 0)
            starts.append(n)
            tt.append((tn, tk))
            kts.append(kt)
        # (the split counts the dW tiles: a bias tile's sums are a small part of one's work)
        self.S, rows = split(sum(wts) or n, B, block_b, sm_count(device, 4), self.E)
        self.dw_grid = (n, self.S)
        self.dw_kw = dict(DS=ds, XS=self.xs, NUM_LAYERS=L, TS=tuple(starts), WT=tuple(wts), TT=tuple(tt),
                          KT=tuple(kts), OW=tuple(self.w_at), OB=tuple(self.b_at), E=self.E if self.S > 1 else 0,
                          BLOCK_B=block_b, STAGES=DW_STAGES, PRECISION=precision, num_warps=warps)
        self.dw_ints = [B, rows, act]
        self.sum_grid = (-(-self.E // SUM_BLOCK),)
        self.sum_kw = dict(BLOCK=SUM_BLOCK, num_warps=4)
        self.sum_ints = [self.S, self.E]
        self.replay = None  # triton_launch's replay of the launches, after the first call
        self.layout = None  # which weights that replay read in place (row-padded, `reads_in_place`)
        self.state = "new"  # "ok" once launched; "failed": its kernels did not build here
        self.need_w, self.need_b, self.lowest = need_w, need_b, lowest

    def reads_in_place(self, i: int, w) -> bool:
        """Whether the chain reads weight `i` as given: a weight it reads from a zero-padded
        copy (`pads`) already laid out at that row stride (launch.row_padded; the padding
        never read), 16-byte aligned. Every other weight is read contiguous."""
        st = self.ws[i]
        return st != w.shape[1] and any(e[0] == i for e in self.pads) and w.stride() == (st, 1) \
            and not w.data_ptr() & 15

    def __call__(self, grad, x, weights, zs):
        """(grad_x or None, [grad_w or None], [grad_b or None]), or None where the kernels
        did not build on this machine (the first call warns; the caller falls back)."""
        if self.state == "failed":
            return None
        # each weight contiguous, but one the chain reads in place row-padded (`reads_in_place`)
        weights = [w if w.is_contiguous() or self.reads_in_place(i, w) else w.contiguous()
                   for i, w in enumerate(weights)]
        B, dt, dev = self.B, self.dtype, self.device
        gx = _empty((B, self.widths[0]), dtype=dt, device=dev) if self.need_x else None
        scratch = _empty(self.dz_numel, dtype=dt, device=dev)
        flat = _empty(self.E, dtype=dt, device=dev)
        ws = _empty(self.S * self.E, dtype=torch.float32, device=dev) if self.S > 1 else None
        # the tensors whose addresses change from call to call (the launches take views of them)
        slots = [grad, x, *weights, *(z for z in zs if z is not None), scratch, flat]
        slots += [t for t in (ws, gx) if t is not None]
        # (the weights read in place are the ones left non-contiguous: a replay runs only on the
        # layout it was recorded with)
        layout = tuple(i for i, w in enumerate(weights) if not w.is_contiguous())
        r = self.replay if layout == self.layout or self.replay is None else False  # (False: another layout)
        if not r or not r([t.data_ptr() for t in slots]):
            launches = self.launches(grad, x, weights, zs, scratch, flat, ws, gx)
            try:
                for launch in launches:
                    triton_launch.launch(*launch)
            except (CompilationError, OutOfResources, RuntimeError) as e:
                if self.state == "ok" or (type(e) is RuntimeError and not _build_failure(e)):
                    raise
                self.state = "failed"
                warnings.warn(f"fused_mlp: the fused backward did not build for widths {self.widths} "
                              f"({type(e).__name__}: {e}); reference.backward_lean serves them", stacklevel=2)
                return None
            self.state = "ok"
            if r is None:  # later calls replay the binaries (None where Triton's own path must run)
                self.replay, self.layout = triton_launch.replay(launches, slots), layout
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
        out, xp = [], x
        for what, rows, k, st, at in self.pads:  # the zero-padded copies first
            src = x if what == "x" else weights[what]
            if what != "x" and src.stride() == (st, 1):  # row-padded already (`reads_in_place`)
                w[what] = src
                continue
            dst = scratch[at:at + rows * st]
            if what == "x":
                xp = dst
            else:
                w[what] = dst
            out.append((fused_mlp_bwd_pad_kernel, (-(-rows // PAD_BLOCK_R),), [src, dst, rows],
                        dict(K=k, S=st, SP=padded(st), BLOCK_R=PAD_BLOCK_R, num_warps=4)))
        if self.copies:  # float32, TF32 on: the chain's weights rounded
            srcs, dsts = [filler] * MAX_LAYERS, [filler] * MAX_LAYERS
            for c, (i, rows, k, st, at) in enumerate(self.copies):
                srcs[c], dsts[c] = weights[i], scratch[at:at + rows * st]
                w[i] = dsts[c]
            ns, ks, ss = (tuple(e[j] for e in self.copies) for j in (1, 2, 3))
            out.append((fused_mlp_bwd_tf32_kernel, (-(-max(ns) // TF32_BLOCK_R), len(self.copies)), [*srcs, *dsts],
                        dict(NS=ns, KS=ks, SS=ss, NUM=len(self.copies), BLOCK_R=TF32_BLOCK_R, BLOCK_K=TF32_BLOCK_K,
                             num_warps=4)))
        out += [(fused_mlp_bwd_dz_kernel, self.chain_grid, [grad, gx if gx is not None else filler, *w, *z, *d,
                                                            *self.chain_ints], self.chain_kw)]
        if self.dw_grid[0]:  # (none: only grad_x asked for)
            out.append((fused_mlp_bwd_dw_kernel, self.dw_grid, [xp, ws if ws is not None else flat, *z, *d,
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


def _build_failure(e: RuntimeError) -> bool:
    """Whether a RuntimeError from a first launch is Triton failing to compile the kernel (an
    MLIR pass pipeline that fails, as Triton 3.6's pipeliner did for the float32 chain at 64
    rows: "PassManager::run failed"), not an error of the launch itself."""
    return "PassManager::run failed" in str(e)


def plan(widths, dtype, device, B, has_bias, acts, needs, chain=None, pad=False) -> Plan | None:
    """The fused backward for this signature and `needs` (x, weight per layer, bias per
    layer), or None where it does not apply: nothing needed, B = 0, more layers than the
    kernels' slots. `chain`: the dz chain's (rows, output chunk, warps) instead of CHAIN's
    row for B (a tuned option: CHAIN_OPTIONS); `pad`: x and the large weights whose rows are
    not whole 16-byte vectors read from zero-padded copies (a tuned option; the plan's `pads`
    lists them, none where every row is whole vectors already)."""
    L = len(widths) - 1
    wanted = any(needs[:1 + L]) or any(n and on for n, on in zip(needs[1 + L:], has_bias))
    if B <= 0 or not 1 <= L <= MAX_LAYERS or not wanted:
        return None
    return Plan(tuple(widths), dtype, device, B, tuple(has_bias), acts, tuple(needs), fwd_launch.precision(dtype),
                chain, pad)



def backward(grad, x, weights, has_bias, zs, activation: str, last_activation: str, needs):
    """reference.backward_lean's gradients through the fused kernels (2-D contiguous grad
    and x, weights (Plan.__call__ copies those it does not read in place), the zs the
    forward saved): a Plan built for this call. The
    training fast path keeps its plans (train.py); this is for tests and benchmarks."""
    widths = (x.shape[1], *(w.shape[0] for w in weights))
    p = plan(widths, x.dtype, x.device, x.shape[0], has_bias, (activation, last_activation), needs)
    if p is None:
        raise ValueError("fused_mlp backward: nothing to compute (B = 0 or no gradient needed)")
    return p(grad, x, weights, zs)
