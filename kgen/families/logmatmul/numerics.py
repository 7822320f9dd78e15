"""Golden numerics for `kgen verify` and the tests: one variant's forward and both
gradients against float64 on awkward sizes, with -inf entries, an all -inf row and a zero
weight row, through the op (poisoned buffers come from the tests)."""

from __future__ import annotations

import torch

from kgen.families.logmatmul.op import implementation, logmatmul, using
from kgen.families.logmatmul.reference import reference

# Gradients vs float64, judged against the largest gradient element (a sum over N or B of
# exp terms): float32 outputs ~1e-6 of scale seen, so 2e-5; 16-bit outputs round each
# element once (2^-9 bf16, 2^-12 fp16 relative, with margin).
GRAD_TOL = {"float32": 2e-5, "float16": 1e-3, "bfloat16": 8e-3}


def make_inputs(B: int, N: int, K: int, dtype: torch.dtype, device, w_dtype=torch.float32, seed: int = 0,
                holes: bool = True):
    """x ~ 2 N(0,1) with -inf entries (every 7th), its row 1 all -inf, w uniform in [0, 1)
    with every 5th element 0 and row 2 all zero (when B, N allow)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, K, generator=g, dtype=torch.float64) * 2
    w = torch.rand(N, K, generator=g, dtype=torch.float64)
    if holes:
        x.view(-1)[::7] = float("-inf")
        w.view(-1)[::5] = 0
        if B > 1:
            x[1] = float("-inf")
        if N > 2:
            w[2] = 0
    return x.to(dtype).to(device), w.to(w_dtype).to(device)


def golden_cases(device):
    sizes = [(1, 1, 1), (1, 37, 100), (3, 130, 257), (16, 67, 600)]
    if device.type == "cuda":
        sizes += [(5, 1000, 4099), (1, 4096, 4096), (33, 513, 777)]
    return sizes


def check_case(mod, B, N, K, dtype: torch.dtype, w_dtype, device, tol, seed=0):
    """[(name, worst error / tolerance)] for out, dx, dw of one implementation."""
    x, w = make_inputs(B, N, K, dtype, device, w_dtype, seed)
    g = torch.randn(B, N, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(device)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with using(mod):
        out = logmatmul(xl, wl)
    out.backward(g.float())
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = reference(xr, wr, compute=torch.float64)
    ref.backward(g)
    dname = str(dtype).removeprefix("torch.")
    results = []
    out, ref = out.detach(), ref.detach()
    both_inf = torch.isinf(ref) & (out.double() == ref)
    err = (out.double() - ref).abs() / (tol.atol + tol.rtol * ref.detach().abs())
    err = err.masked_fill(both_inf, 0.0)
    results.append(("out", _worst(err)))
    for name, got, want, gdt in (("dx", xl.grad, xr.grad, dname),
                                 ("dw", wl.grad, wr.grad, str(w_dtype).removeprefix("torch."))):
        bound = GRAD_TOL[gdt] * max(1.0, float(want.abs().max())) if want.numel() else 1.0
        results.append((name, _worst((got.double() - want.detach()).abs() / bound)))
    return [(f"B={B} N={N} K={K} w={w_dtype} {n}", r) for n, r in results]


def _worst(err: torch.Tensor) -> float:
    if not err.numel():
        return 0.0
    if torch.isnan(err).any():
        return float("inf")
    return float(err.max())


def golden(kernel, device, dtype: str, tol) -> list[tuple[str, float]]:
    mod = implementation(kernel)
    t = getattr(torch, dtype)
    results = []
    for B, N, K in golden_cases(device):
        for w_dtype in {torch.float32, t}:
            results += check_case(mod, B, N, K, t, w_dtype, device, tol, seed=B + N + K)
    return results
