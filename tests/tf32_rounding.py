"""float32 -> TF32 rounding in integer arithmetic, for the tests' references."""

import torch


def tf32_rounded(t: torch.Tensor, ties: str) -> torch.Tensor:
    """float32 t rounded to the nearest TF32 value (10 mantissa bits), ties "even" (the TMA
    unit's TFLOAT32 loads) or "away" (cvt.rna, templates/common/triton_tf32.py.j2); NaN and
    the infinities as they are."""
    bits = t.float().view(torch.int32).long() & 0xFFFFFFFF
    half = (0xFFF + ((bits >> 13) & 1)) if ties == "even" else 0x1000
    r = ((bits + half) & 0xFFFFE000).to(torch.int64)
    r = torch.where(r >= 1 << 31, r - (1 << 32), r).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(t), r, t)
