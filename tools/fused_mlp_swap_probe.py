"""A probe for issue 22 (fused_mlp forward at B <= 4096), not part of kgen: a "swap-AB" Triton
form of the DLRM chains, timed against the shipped dispatch and eager nn.Sequential.

Why: the shipped 16-row Triton tiles (the B <= 2048 winners) run each program as a chain of
dependent M = 16 mma.sync steps; their time did not move with 2-6 pipeline stages or smaller
chunks (BENCHMARKS.md, seventy-sixth session). Here a layer is computed transposed,
h_next^T = act(W h^T + b): its output features sit on the MMA's M (64-256: WGMMA on sm_90) and
the program's BM rows on N. The chain is the one the exact variants run: layer 0 from x in
column chunks, each chunk absorbed into layer 1's accumulator [N1, BM], then whole layers on the
register tile (two or three of them). bf16 / fp16 round z and act(z) as eager does; float32
runs tl.dot's default precision (TF32 on the GPU; no operand rounding: timing only).

    TRITON_INTERPRET=1 python tools/fused_mlp_swap_probe.py --check   # float16 on the CPU
    python tools/fused_mlp_swap_probe.py                              # GPU: the timing table

Timing: GPU µs per call, a CUDA graph of 20 calls, the best of 5 replays."""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _act(z, code: tl.constexpr):
    if code == 1:
        z = tl.maximum(z, 0.0)
    elif code == 2:
        z = 1.0 / (1.0 + tl.exp(-z))
    return z


@triton.jit
def swap_mlp(x_ptr, out_ptr, w0, b0, w1, b1, w2, b2, w3, b3, B,
             K0: tl.constexpr, KC: tl.constexpr, NKC: tl.constexpr, N0: tl.constexpr, N1: tl.constexpr,
             N2: tl.constexpr, N2P: tl.constexpr, N3: tl.constexpr, N3P: tl.constexpr, LAST: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, DT: tl.constexpr):
    # K0 -> N0 (BN-row chunks of W0, each absorbed into layer 1) -> N1 -> N2 [-> N3]; hidden
    # layers ReLU, the last `LAST` (0 none, 1 relu, 2 sigmoid); x^T in NKC chunks of KC rows
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < B
    k = tl.arange(0, KC)
    x0 = tl.load(x_ptr + rows[None, :] * K0 + k[:, None], mask=rmask[None, :] & (k[:, None] < K0), other=0.0)
    if NKC > 1:
        x1 = tl.load(x_ptr + rows[None, :] * K0 + KC + k[:, None], mask=rmask[None, :] & (KC + k[:, None] < K0),
                     other=0.0)
    if NKC > 2:
        x2 = tl.load(x_ptr + rows[None, :] * K0 + 2 * KC + k[:, None],
                     mask=rmask[None, :] & (2 * KC + k[:, None] < K0), other=0.0)
    n1 = tl.arange(0, N1)
    acc1 = tl.zeros([N1, BM], dtype=tl.float32)
    for n0 in tl.range(0, N0, BN, num_stages=STAGES):
        nn = n0 + tl.arange(0, BN)
        wa = tl.load(w0 + nn[:, None] * K0 + k[None, :], mask=k[None, :] < K0, other=0.0)
        h = tl.dot(wa, x0)
        if NKC > 1:
            wb = tl.load(w0 + nn[:, None] * K0 + KC + k[None, :], mask=KC + k[None, :] < K0, other=0.0)
            h = tl.dot(wb, x1, h)
        if NKC > 2:
            wc = tl.load(w0 + nn[:, None] * K0 + 2 * KC + k[None, :], mask=2 * KC + k[None, :] < K0, other=0.0)
            h = tl.dot(wc, x2, h)
        h += tl.load(b0 + nn).to(tl.float32)[:, None]
        h = tl.maximum(h.to(DT).to(tl.float32), 0.0).to(DT)
        w1t = tl.load(w1 + n1[:, None] * N0 + nn[None, :])
        acc1 = tl.dot(w1t, h, acc1)
    acc1 += tl.load(b1 + n1).to(tl.float32)[:, None]
    h1 = tl.maximum(acc1.to(DT).to(tl.float32), 0.0).to(DT)
    n2 = tl.arange(0, N2P)
    w2t = tl.load(w2 + n2[:, None] * N1 + n1[None, :], mask=n2[:, None] < N2, other=0.0)
    acc2 = tl.dot(w2t, h1)
    acc2 += tl.load(b2 + n2, mask=n2 < N2, other=0.0).to(tl.float32)[:, None]
    if N3 == 0:
        z = _act(acc2.to(DT).to(tl.float32), LAST).to(DT)
        tl.store(out_ptr + rows[None, :] * N2 + n2[:, None], z, mask=rmask[None, :] & (n2[:, None] < N2))
    else:
        h2 = tl.maximum(acc2.to(DT).to(tl.float32), 0.0).to(DT)
        n3 = tl.arange(0, N3P)
        w3t = tl.load(w3 + n3[:, None] * N2 + n2[None, :], mask=(n3[:, None] < N3) & (n2[None, :] < N2), other=0.0)
        acc3 = tl.dot(w3t, h2)
        acc3 += tl.load(b3 + n3, mask=n3 < N3, other=0.0).to(tl.float32)[:, None]
        z = _act(acc3.to(DT).to(tl.float32), LAST).to(DT)
        tl.store(out_ptr + rows[None, :] * N3 + n3[:, None], z, mask=rmask[None, :] & (n3[:, None] < N3))


DTS = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MLPS = (("top", (367, 512, 256, 1), "sigmoid", 2), ("bottom", (13, 512, 256, 64, 16), "relu", 1))


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def run(x, ws, bs, last, BM=16, BN=64, KC=128, warps=4, stages=2, out=None):
    """The chain on x [B, w0] (weights [w(i+1), w(i)], biases [w(i+1)], 3 or 4 layers)."""
    widths = [x.shape[1]] + [w.shape[0] for w in ws]
    K0 = widths[0]
    KC = min(KC, _p2(K0))
    nkc = -(-K0 // KC)
    assert nkc <= 3 and len(ws) in (3, 4), "the probe takes w0 <= 3 * KC and 3 or 4 layers"
    N3 = widths[4] if len(ws) == 4 else 0
    if out is None:
        out = torch.empty(x.shape[0], widths[-1], device=x.device, dtype=x.dtype)
    w3, b3 = (ws[3], bs[3]) if N3 else (ws[2], bs[2])
    swap_mlp[(triton.cdiv(x.shape[0], BM),)](
        x, out, ws[0], bs[0], ws[1], bs[1], ws[2], bs[2], w3, b3, x.shape[0], K0=K0, KC=KC, NKC=nkc, N0=widths[1],
        N1=widths[2], N2=widths[3], N2P=_p2(widths[3]), N3=N3, N3P=_p2(N3) if N3 else 16, LAST=last, BM=BM, BN=BN,
        STAGES=stages, DT=DTS[x.dtype], num_warps=warps)
    return out


def reference(x, ws, bs, last):
    """Eager's roundings: z = F.linear in float32 rounded to x's dtype, act(z) rounded again."""
    h = x
    for i, (w, b) in enumerate(zip(ws, bs)):
        z = torch.nn.functional.linear(h.float(), w.float(), b.float()).to(x.dtype).float()
        a = last if i == len(ws) - 1 else 1
        h = (torch.relu(z) if a == 1 else torch.sigmoid(z) if a == 2 else z).to(x.dtype)
    return h


def check_inputs(widths):
    """(weights, biases, x) in float16 for `--check` (the interpreter on this CPU): 37 rows, not a
    multiple of any row tile."""
    torch.manual_seed(0)
    ws = [(torch.randn(widths[i + 1], widths[i]) / widths[i] ** 0.5).half() for i in range(len(widths) - 1)]
    bs = [(torch.randn(widths[i + 1]) * 0.1).half() for i in range(len(widths) - 1)]
    return ws, bs, torch.randn(37, widths[0]).half()


def check() -> None:
    for name, widths, _, code in MLPS:
        ws, bs, x = check_inputs(widths)
        err = float((run(x, ws, bs, code).float() - reference(x, ws, bs, code).float()).abs().max())
        print(f"{name} {'-'.join(map(str, widths))} float16: max |swap - eager| = {err:.3g}")


def _graph_us(fn, n: int = 20) -> float:
    from kgen.benchmarks.fused_mlp import _graphed

    replay = _graphed(lambda: [fn() for _ in range(n)])
    replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1e3 / n)
    return best


# (BM rows, BN chunk, KC, warps, stages)
CONFIGS = {torch.bfloat16: [(16, 64, 128, 4, 2), (16, 64, 128, 4, 3), (32, 64, 128, 4, 2), (32, 64, 128, 4, 3),
                            (64, 64, 128, 4, 2), (16, 128, 128, 4, 2), (32, 128, 128, 4, 2), (64, 128, 128, 8, 2),
                            (128, 64, 128, 8, 2)],
           # float32: 32-column chunks keep the staged weights under 227 KB of shared memory
           torch.float32: [(16, 32, 128, 4, 2), (32, 32, 128, 4, 2), (64, 32, 128, 4, 2), (16, 32, 64, 4, 2),
                           (64, 32, 64, 8, 2), (16, 16, 128, 4, 3)]}


def bench() -> None:
    from kgen.benchmarks.fused_mlp import _sequential
    from kgen.nn import FusedMLP

    torch.backends.cuda.matmul.allow_tf32 = True
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for dt, cfgs in CONFIGS.items():
        for name, widths, last, code in MLPS:
            torch.manual_seed(0)
            seq = _sequential(widths, "relu", last, dt)
            fused = FusedMLP.from_sequential(seq)
            ws, bs = [w.detach() for w in fused.weights], [b.detach() for b in fused.biases]
            for B in (128, 512, 2048, 4096):
                x = torch.randn(B, widths[0], device="cuda", dtype=dt)
                with torch.no_grad():
                    want = fused(x)
                    res = [("kgen dispatch", _graph_us(lambda: fused(x)), 0.0),
                           ("eager nn.Sequential", _graph_us(lambda: seq(x)), 0.0)]
                    for c in cfgs:
                        try:
                            out = torch.full_like(want, float("nan"))
                            run(x, ws, bs, code, *c, out=out)
                            err = float((out.float() - want.float()).abs().max())
                            res.append((f"swap m{c[0]} n{c[1]} k{c[2]} w{c[3]} s{c[4]}",
                                        _graph_us(lambda: run(x, ws, bs, code, *c, out=out)), err))
                        except Exception as e:  # noqa: BLE001 - a tile that does not fit: say so, go on
                            print(f"  {c}: {type(e).__name__} {str(e)[:120]}")
                print(f"== {name} {dt} B={B}")
                for n, us, err in sorted(res, key=lambda r: r[1]):
                    print(f"  {us:8.2f} us  max |out - kgen| {err:.3g}  {n}")


if __name__ == "__main__":
    check() if "--check" in sys.argv else bench()
