"""linear_logp's tuning interface (kgen.runtime.tune): its buckets, the shapes `kgen tune`
measures by default, fresh inputs and one timed forward per candidate."""

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
# they are: every variant tiles N alike (tune.nearest).
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
