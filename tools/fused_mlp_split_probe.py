"""A probe for issue 22 (fused_mlp forward at B <= 4096), not part of kgen: the DLRM chains with
layer 0's output columns split over S programs a row tile, timed against the shipped dispatch.

Why: a program of the shipped exact Triton variants reads every weight (638 KB of the top MLP in
bf16) for its BLOCK_M rows, and its time follows the bytes it reads, ~30 GB/s a program, not its
MMA count nor its pipeline depth (BENCHMARKS.md, seventy-sixth and seventy-seventh sessions). Here
program (r, s) computes layer 0's columns s*N0/S .. (s+1)*N0/S for row tile r and absorbs them into
a partial layer-1 accumulator [BM, N1] (float32), so it reads 1/S of W0 and W1. It writes the
partial to a scratch and counts itself in on the row tile's counter (an int32 atomic, acq_rel);
the program that arrives last sums the S partials in the order s = 0..S-1 (the sum does not depend
on which program finishes: bitwise the same run to run), resets the counter for the next launch,
and runs the rest of the chain (layer 1's epilogue, layers 2 and 3) on the register tile.
Prediction (per-program bytes model): top bf16 B = 2048 from 21 us to ~12 at BM = 32, S = 2;
B = 512 from 15 to ~8 at BM = 16, S = 4.

    TRITON_INTERPRET=1 python tools/fused_mlp_split_probe.py --check   # float16 on the CPU
    python tools/fused_mlp_split_probe.py                              # GPU: the timing table

Timing: GPU us per call, a CUDA graph of 20 calls, the best of 5 replays; W0 read from a copy
whose rows are padded to 8 elements (made once, outside the timing; the shipped kernel pads per
call)."""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

# (the swap probe beside this file: the chain's activation, its rounding reference, the timing)
from fused_mlp_swap_probe import DTS, MLPS, _act, _graph_us, _p2, check_inputs, reference


@triton.jit
def split_mlp(x_ptr, out_ptr, w0, b0, w1, b1, w2, b2, w3, b3, part_ptr, count_ptr, B,
              K0: tl.constexpr, K0S: tl.constexpr, KC: tl.constexpr, NKC: tl.constexpr, N0: tl.constexpr,
              N1: tl.constexpr, N2: tl.constexpr, N2P: tl.constexpr, N3: tl.constexpr, N3P: tl.constexpr,
              LAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, S: tl.constexpr, STAGES: tl.constexpr,
              DT: tl.constexpr):
    # K0 -> N0 (this program's N0 / S columns, BN at a time, each absorbed into layer 1) -> N1 ->
    # N2 [-> N3]; hidden layers ReLU, the last `LAST` (0 none, 1 relu, 2 sigmoid)
    tile = tl.program_id(0)
    s = tl.program_id(1)
    rows = tile.to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < B
    # x's row tile in NKC chunks of KC columns, loaded once (as the shipped exact kernels)
    k = tl.arange(0, KC)
    x0 = tl.load(x_ptr + rows[:, None] * K0 + k[None, :], mask=rmask[:, None] & (k[None, :] < K0), other=0.0)
    if NKC > 1:
        x1 = tl.load(x_ptr + rows[:, None] * K0 + KC + k[None, :], mask=rmask[:, None] & (KC + k[None, :] < K0),
                     other=0.0)
    if NKC > 2:
        x2 = tl.load(x_ptr + rows[:, None] * K0 + 2 * KC + k[None, :],
                     mask=rmask[:, None] & (2 * KC + k[None, :] < K0), other=0.0)
    if NKC > 3:
        x3 = tl.load(x_ptr + rows[:, None] * K0 + 3 * KC + k[None, :],
                     mask=rmask[:, None] & (3 * KC + k[None, :] < K0), other=0.0)
    if NKC > 4:
        x4 = tl.load(x_ptr + rows[:, None] * K0 + 4 * KC + k[None, :],
                     mask=rmask[:, None] & (4 * KC + k[None, :] < K0), other=0.0)
    if NKC > 5:
        x5 = tl.load(x_ptr + rows[:, None] * K0 + 5 * KC + k[None, :],
                     mask=rmask[:, None] & (5 * KC + k[None, :] < K0), other=0.0)
    n1 = tl.arange(0, N1)
    acc1 = tl.zeros([BM, N1], dtype=tl.float32)
    lo = 0 if S == 1 else s * (N0 // S)
    for n0 in tl.range(lo, lo + N0 // S, BN, num_stages=STAGES):
        nn = n0 + tl.arange(0, BN)
        # W0's rows are K0S apart, zero past K0: only a chunk running past K0S is masked
        wp = w0 + nn[None, :] * K0S + k[:, None]
        h = tl.dot(x0, tl.load(wp, mask=k[:, None] < K0S, other=0.0) if KC > K0S else tl.load(wp))
        if NKC > 1:
            h = tl.dot(x1, tl.load(wp + KC, mask=KC + k[:, None] < K0S, other=0.0) if 2 * KC > K0S else
                       tl.load(wp + KC), h)
        if NKC > 2:
            h = tl.dot(x2, tl.load(wp + 2 * KC, mask=2 * KC + k[:, None] < K0S, other=0.0) if 3 * KC > K0S else
                       tl.load(wp + 2 * KC), h)
        if NKC > 3:
            h = tl.dot(x3, tl.load(wp + 3 * KC, mask=3 * KC + k[:, None] < K0S, other=0.0) if 4 * KC > K0S else
                       tl.load(wp + 3 * KC), h)
        if NKC > 4:
            h = tl.dot(x4, tl.load(wp + 4 * KC, mask=4 * KC + k[:, None] < K0S, other=0.0) if 5 * KC > K0S else
                       tl.load(wp + 4 * KC), h)
        if NKC > 5:
            h = tl.dot(x5, tl.load(wp + 5 * KC, mask=5 * KC + k[:, None] < K0S, other=0.0) if 6 * KC > K0S else
                       tl.load(wp + 5 * KC), h)
        h += tl.load(b0 + nn).to(tl.float32)[None, :]
        h = tl.maximum(h.to(DT).to(tl.float32), 0.0).to(DT)
        w1t = tl.load(w1 + n1[None, :] * N0 + nn[:, None])
        acc1 = tl.dot(h, w1t, acc1)
    if S > 1:
        # this program's partial to the scratch [tiles, S, BM, N1]; the last of the tile's S
        # programs to arrive sums them (s = 0..S-1) and goes on; the others are done
        base = part_ptr + tile.to(tl.int64) * (S * BM * N1) + tl.arange(0, BM)[:, None] * N1 + n1[None, :]
        tl.store(base + s * (BM * N1), acc1)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == S - 1:
            acc1 = tl.load(base, cache_modifier=".cg")
            for j in tl.range(1, S):  # (a loop, not unrolled: one partial's registers at a time)
                acc1 += tl.load(base + j * (BM * N1), cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # (ready for the next launch)
            _finish(acc1, rows, rmask, n1, out_ptr, b1, w2, b2, w3, b3, N1, N2, N2P, N3, N3P, LAST, DT)
    else:
        _finish(acc1, rows, rmask, n1, out_ptr, b1, w2, b2, w3, b3, N1, N2, N2P, N3, N3P, LAST, DT)


@triton.jit
def _finish(acc1, rows, rmask, n1, out_ptr, b1, w2, b2, w3, b3, N1: tl.constexpr, N2: tl.constexpr,
            N2P: tl.constexpr, N3: tl.constexpr, N3P: tl.constexpr, LAST: tl.constexpr, DT: tl.constexpr):
    acc1 += tl.load(b1 + n1).to(tl.float32)[None, :]
    h1 = tl.maximum(acc1.to(DT).to(tl.float32), 0.0).to(DT)
    n2 = tl.arange(0, N2P)
    w2t = tl.load(w2 + n2[None, :] * N1 + n1[:, None], mask=n2[None, :] < N2, other=0.0)
    acc2 = tl.dot(h1, w2t)
    acc2 += tl.load(b2 + n2, mask=n2 < N2, other=0.0).to(tl.float32)[None, :]
    if N3 == 0:
        z = _act(acc2.to(DT).to(tl.float32), LAST).to(DT)
        tl.store(out_ptr + rows[:, None] * N2 + n2[None, :], z, mask=rmask[:, None] & (n2[None, :] < N2))
    else:
        h2 = tl.maximum(acc2.to(DT).to(tl.float32), 0.0).to(DT)
        n3 = tl.arange(0, N3P)
        w3t = tl.load(w3 + n3[None, :] * N2 + n2[:, None], mask=(n3[None, :] < N3) & (n2[:, None] < N2), other=0.0)
        acc3 = tl.dot(h2, w3t)
        acc3 += tl.load(b3 + n3, mask=n3 < N3, other=0.0).to(tl.float32)[None, :]
        z = _act(acc3.to(DT).to(tl.float32), LAST).to(DT)
        tl.store(out_ptr + rows[:, None] * N3 + n3[None, :], z, mask=rmask[:, None] & (n3[None, :] < N3))


class Chain:
    """One MLP's weights as the kernel reads them (W0 with rows padded to 8 elements), with the
    partial sums' scratch and the row tiles' counters (zero; the finishing program resets its
    own) for up to `max_b` rows."""

    def __init__(self, ws, bs, last, max_b, BM=16, BN=64, S=1, warps=4, stages=2, KC=64):
        self.widths = [ws[0].shape[1]] + [w.shape[0] for w in ws]
        assert len(ws) in (3, 4) and self.widths[1] % (S * BN) == 0, "3 or 4 layers, N0 a multiple of S * BN"
        K0 = self.widths[0]
        self.K0S = -(-K0 // 8) * 8
        w0 = torch.zeros(ws[0].shape[0], self.K0S, dtype=ws[0].dtype, device=ws[0].device)
        w0[:, :K0] = ws[0]
        self.ws, self.bs, self.last = [w0, *ws[1:]], bs, last
        self.KC = min(KC, _p2(K0))
        self.nkc = -(-K0 // self.KC)
        assert self.nkc <= 6, "the probe takes w0 <= 6 * KC"
        self.BM, self.BN, self.S, self.warps, self.stages = BM, BN, S, warps, stages
        tiles = -(-max_b // BM)
        dev = ws[0].device
        self.part = torch.empty(tiles * S * BM * self.widths[2] if S > 1 else 1, dtype=torch.float32, device=dev)
        self.count = torch.zeros(tiles, dtype=torch.int32, device=dev)

    def __call__(self, x, out=None):
        w, (ws, bs) = self.widths, (self.ws, self.bs)
        N3 = w[4] if len(ws) == 4 else 0
        if out is None:
            out = torch.empty(x.shape[0], w[-1], device=x.device, dtype=x.dtype)
        w3, b3 = (ws[3], bs[3]) if N3 else (ws[2], bs[2])
        split_mlp[(triton.cdiv(x.shape[0], self.BM), self.S)](
            x, out, ws[0], bs[0], ws[1], bs[1], ws[2], bs[2], w3, b3, self.part, self.count, x.shape[0],
            K0=w[0], K0S=self.K0S, KC=self.KC, NKC=self.nkc, N0=w[1], N1=w[2], N2=w[3], N2P=_p2(w[3]), N3=N3,
            N3P=_p2(N3) if N3 else 16, LAST=self.last, BM=self.BM, BN=self.BN, S=self.S, STAGES=self.stages,
            DT=DTS[x.dtype], num_warps=self.warps)
        return out


def check() -> None:
    for name, widths, _, code in MLPS:
        ws, bs, x = check_inputs(widths)
        want = reference(x, ws, bs, code).float()
        for S in (1, 2, 4):
            chain = Chain(ws, bs, code, 37, S=S)
            outs = [chain(x).float() for _ in range(2)]  # twice: the counters reset themselves
            err = float((outs[1] - want).abs().max())
            print(f"{name} {'-'.join(map(str, widths))} float16 S={S}: max |split - eager| = {err:.3g}, "
                  f"second launch identical: {torch.equal(outs[0], outs[1])}, counters zero: "
                  f"{int(chain.count.abs().sum()) == 0}")


# (BM rows, BN chunk, S splits, warps, stages)
CONFIGS = [(16, 64, 1, 4, 2), (16, 64, 2, 4, 2), (16, 64, 4, 4, 2), (16, 64, 8, 4, 2), (32, 64, 1, 4, 2),
           (32, 64, 2, 4, 2), (32, 64, 4, 4, 2), (64, 64, 4, 4, 2), (64, 64, 8, 8, 2)]


def bench() -> None:
    from kgen.benchmarks.fused_mlp import _sequential
    from kgen.nn import FusedMLP

    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    dt = torch.bfloat16
    for name, widths, last, code in MLPS:
        torch.manual_seed(0)
        seq = _sequential(widths, "relu", last, dt)
        fused = FusedMLP.from_sequential(seq)
        ws, bs = [w.detach() for w in fused.weights], [b.detach() for b in fused.biases]
        for B in (2048, 512, 128, 4096):  # (the bar's B first: the device's time is short)
            x = torch.randn(B, widths[0], device="cuda", dtype=dt)
            with torch.no_grad():
                want = fused(x)
                ref = reference(x, ws, bs, code)
                res = [("kgen dispatch", _graph_us(lambda: fused(x)), float((want.float() - ref.float()).abs().max()), True),
                       ("eager nn.Sequential", _graph_us(lambda: seq(x)), 0.0, True)]
                for c in CONFIGS:
                    try:
                        chain = Chain(ws, bs, code, B, *c)
                        out = torch.full_like(want, float("nan"))
                        chain(x, out)
                        again = chain(x)
                        err = float((out.float() - ref.float()).abs().max())
                        res.append((f"split m{c[0]} n{c[1]} S{c[2]} w{c[3]} s{c[4]} ({-(-B // c[0]) * c[2]} programs)",
                                    _graph_us(lambda: chain(x, out)), err, torch.equal(out, again)))
                    except Exception as e:  # noqa: BLE001 - a tile that does not fit: say so, go on
                        print(f"  {c}: {type(e).__name__} {str(e)[:120]}")
            print(f"== {name} {dt} B={B}")
            for n, us, err, same in sorted(res, key=lambda r: r[1]):
                print(f"  {us:8.2f} us  max |out - eager roundings| {err:.3g}{'' if same else '  NOT REPRODUCIBLE'}  {n}")


if __name__ == "__main__":
    check() if "--check" in sys.argv else bench()
