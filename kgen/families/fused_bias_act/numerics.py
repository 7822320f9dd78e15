"""fused_bias_act's golden numerics for `kgen verify` and the tests."""

from __future__ import annotations

import math

import torch

from kgen.families.fused_bias_act.launcher import launch
from kgen.families.fused_bias_act.reference import reference
from kgen.families.fused_bias_act.schema import ACTIVATIONS, TORCH_DTYPES


# (rows, cols, storage offset in elements): sizes that are not multiples of any tile, a
# width that takes the 16-byte path (4104 = 8 * 513), one misaligned by one element, and
# 64 x 96 = 3 x 2048 elements (the Triton flat kernels' unmasked path, EVEN).
GOLDEN_SHAPES = ((1, 1, 0), (7, 33, 0), (5, 1000, 0), (33, 4104, 0), (3, 4104, 1), (64, 96, 0))


def golden(kernel, device, dtype: str, tol) -> list[tuple[str, float]]:
    """Run one loaded variant over GOLDEN_SHAPES x activations x (with/without y, in place)
    on fresh random inputs with a poisoned output; return (case, worst error / tolerance)."""
    tdtype = next(t for t, n in TORCH_DTYPES.items() if n == dtype)
    results = []
    for rows, cols, offset in GOLDEN_SHAPES:
        for act in ACTIVATIONS:
            for has_y, inplace in ((True, False), (False, False), (True, True)):
                def rand(*shape):
                    flat = torch.randn(offset + math.prod(shape), device=device) * 2
                    return flat[offset:].view(shape).to(tdtype)

                x, bias = rand(rows, cols), rand(cols)
                y = rand(rows, cols) if has_y else None
                alpha = 0.75
                ref = reference(x, bias, y, alpha, act, compute=torch.float64)
                if inplace:
                    out = x.clone()
                    launch(kernel, out, bias, y, alpha, act, out)
                else:
                    out = torch.full_like(x, float("nan"))  # poison: every element must be written
                    launch(kernel, x, bias, y, alpha, act, out)
                err = (out.double() - ref).abs() / (tol.atol + tol.rtol * ref.abs())
                worst = float(err.max()) if not torch.isnan(err).any() else float("inf")
                label = f"{rows}x{cols}{'+1' if offset else ''} {act}{' y' if has_y else ''}{' inplace' if inplace else ''}"
                results.append((label, worst))
    return results
