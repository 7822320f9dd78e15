"""linear_logp's tuning interface (kgen.runtime.tune): its buckets, the shapes `kgen tune`
measures by default, fresh inputs, one timed forward per candidate, and the order dispatch
tries for a shape nothing was tuned for (`untuned_order`)."""

from __future__ import annotations

from typing import Optional

import torch

from kgen.families.linear_logp.cuda_variant import CudaForward
from kgen.families.linear_logp.launch import forward
from kgen.families.linear_logp.plans import _precision
from kgen.families.linear_logp.reference import reference

# Buckets: N, D and V each rounded up to a power of two. Bias, entropy and temperature are
# not in the bucket: they add O(N + V) work that every variant does alike.
TUNE_DIMS = ("N", "D", "V")
# Rows beyond the tuned ones (N > 4096) take the nearest tuned bucket's winner however many
# they are: every variant tiles N alike (tuning_table.nearest).
TUNE_FREE_DIMS = ("N",)
TUNE_SHAPES = tuple({"N": n, "D": d, "V": v}
                    for d, v in ((2048, 151936), (4096, 128256), (1024, 32000), (3000, 50257))
                    for n in (1, 8, 16, 32, 64, 128, 512, 4096))
# The reference materialises float32 logits and their softmax: a candidate only where that
# stays within the op's extra-memory promise (backward_launch's docstring: < 64 MiB).
_REFERENCE_TUNE_BYTES = 64 << 20


def tune_bucket(N: int, D: int, V: int, precision: Optional[str] = None, **_) -> str:
    """N, D and V each rounded up to a power of two, and for float32 the dot precision
    (bucket_extras): with TF32 off a few rows run the logits path whatever the variant
    (launch.logits_path) and the tiles run "tf32x3", with it on the tiles run one TF32
    product: the variants' order differs (an n128 tile took 1.5-1.7x an n64 one at N <= 32
    with TF32 on, H200, BENCHMARKS.md forty-fourth session)."""
    sizes = ".".join(f"{k}<={1 << (n - 1).bit_length()}" for k, n in zip(TUNE_DIMS, (N, D, V)))
    return f"{sizes}.{precision}" if precision else sizes


def bucket_extras(dtype: str) -> dict:
    """float32's dot precision from torch.backends.cuda.matmul.allow_tf32 (plans._precision),
    a part of its bucket (`kgen tune --tf32`); nothing for the 16-bit dtypes."""
    return {"precision": _precision(torch.float32)} if dtype == "float32" else {}


def tune_inputs(device, dtype: str, N: int, D: int, V: int, precision: Optional[str] = None) -> dict:
    t = getattr(torch, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    return {"hidden": (torch.randn(N, D, device=device, generator=g) * 0.5).to(t),
            "weight": (torch.randn(V, D, device=device, generator=g) * D ** -0.5).to(t),
            "target": torch.randint(0, V, (N,), device=device, generator=g)}


def tune_runner(kernel, inputs: dict):
    """One forward (no bias, no entropy) of `kernel` (None: the reference); outputs are
    fresh allocations."""
    h, w, t = inputs["hidden"], inputs["weight"], inputs["target"]
    if kernel is None:
        if h.shape[0] * w.shape[0] * 8 > _REFERENCE_TUNE_BYTES:
            raise ValueError(f"the reference's logits would take over {_REFERENCE_TUNE_BYTES >> 20} MiB")
        return lambda: reference(h, w, t)
    from kgen.families.linear_logp.op import implementation  # (op imports this module)

    mod = implementation(kernel)
    if isinstance(mod, CudaForward) and not mod.takes(h, w, None):
        # it would run its Triton companion: not this variant's time
        raise ValueError(f"{kernel.name} does not take {tuple(h.shape)} hidden rows")
    return lambda: forward(mod, h, w, t, None, 1.0, -100, False)


# Where nothing is tuned near a call of few rows, spec order's first variant is a 128-row tile
# (sm_90a's m128 WGMMA kernel, float32's n128 Triton tile), which computes mostly padding
# there. In the shipped tables (tuned buckets, every candidate timed) the first gemv variant
# ran within 1.052x (H200; H100 1.033x) of the fastest at N <= 16 where the 128-row tile took
# 1.274x (1.110x), worst 1.47; at N 17-64 the 64 x 128 WGMMA tile 1.031x (1.029x) against
# 1.145x (1.066x), float32's n64 Triton tile 1.00-1.06x against 1.20-1.28x; above 64 rows the
# 128-row tiles win. Below GEMV_MIN_WEIGHTS weights (V x D) the 16-bit gemv kernel loses
# to the 64 x 128 WGMMA tile even with a CTA a 16-row group (schema.GEMV_GROUP): H200,
# GPU time over the tile's: 1 x 448 x 1707 1.17x, 16 x 632 x 2098 1.16x, 9 x 264 x 1513 1.27x;
# from 2M weights on it wins or ties (2.2M-16M: 0.77-1.01x, one miss: 16 x 1136 x 5561
# 1.11x). The float32 gemv won every tuned bucket of the H200 table at N <= 16, down to
# D = 512 x V = 1024, and beat the n64 Triton tile 1.3-2.2x at 8-41M weights
# (BENCHMARKS.md, fifty-fourth session).
SMALL_ROWS = 64
GEMV_MIN_WEIGHTS = 1 << 21


def _rows(variant) -> int:
    """Rows of hidden one program (CTA) of the variant covers."""
    return variant.params["block_m" if variant.backend == "cuda" else "block_n"]


def untuned_order(variants, shape: dict) -> list:
    """dispatch's hook where nothing is tuned for the shape: for N <= SMALL_ROWS, the gemv
    variants first (they take N <= their block_m: schema.variant_fits; 16-bit ones from
    GEMV_MIN_WEIGHTS weights), then within each backend the tiles of at most SMALL_ROWS rows,
    narrower vocabulary tiles first, then 16-bit gemv variants below GEMV_MIN_WEIGHTS, then
    the taller tiles; spec order otherwise (and among equals: the sort is stable)."""
    N, D, V = shape["N"], shape["D"], shape["V"]
    if N > SMALL_ROWS:
        return variants

    def rank(v):  # (gemv first?, not CUDA, taller than SMALL_ROWS, vocabulary tile)
        p = v.params
        gemv = p.get("kernel") == "gemv"
        if gemv and (v.dtype == "float32" or V * D >= GEMV_MIN_WEIGHTS):
            return (0, False, False, 0)
        # a 16-bit gemv short of weights: after its backend's 64-row tiles, before the taller ones
        cols = 0 if gemv else p["block_n" if v.backend == "cuda" else "block_v"]
        return (1, v.backend != "cuda", gemv or _rows(v) > SMALL_ROWS, cols)

    return sorted(variants, key=rank)
