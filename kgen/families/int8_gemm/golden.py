"""int8_gemm's golden numerics (`kgen verify`, the tests): one loaded variant against the
exact int64 product (int8_mm: equality) and float64 (int8_linear, w8a16_linear) on awkward
sizes, with poisoned outputs and workspaces, unsplit and split along K."""

from __future__ import annotations

import torch

from kgen.families.int8_gemm import launch, reference
from kgen.families.int8_gemm.launch import gemm
from kgen.families.int8_gemm.plans import MODE_LINEAR, MODE_MM, MODE_W8A16
from kgen.runtime.op import error_ratio, poisoned

# (M, N, K): M across the small-M and tiled regimes, N never a multiple of a tile, K a
# multiple of 16 (the CUDA kernel's unit) and not (the Triton kernels' masked tail).
CPU_SHAPES = ((1, 37, 64), (3, 70, 48), (17, 33, 100), (64, 130, 96))
GPU_SHAPES = CPU_SHAPES + ((1, 4096, 4096), (16, 1000, 11008), (100, 3000, 1040), (1024, 4100, 512))

# The float32 accumulation over K (cuBLAS's 16-bit GEMMs and the kernels' alike, in any order)
# is bounded by K units of roundoff of the sum of |terms| (Higham's gamma_K, u = 2^-24), which
# the spec's rtol / atol (the one rounding of the output) do not cover at large K: tensor cores
# truncate as they add each k-block's products into the accumulator, an error that grows with
# K, not as its square root. H100, 500 x 2000 x 8192 with outputs ~ 30: fp16 every kernel and
# cuBLAS at 5.4x the rtol / atol alone, cuBLAS's float32 SGEMM at 0.6x (BENCHMARKS.md,
# twenty-third session). At K = 8192 the term is ~1e-3 of the sum of |terms|, a few % of a
# typical output: the goldens' small K (<= 100) hold the kernels to the spec's rtol / atol.
UNIT_ROUNDOFF = 2.0 ** -24  # float32's u: half an ulp of 1.0


def w8a16_error_ratio(out, x, b, scale_b, bias, group_size, tol) -> float:
    """max |out - want| / (atol + rtol |want| + K UNIT_ROUNDOFF sum_k |x w|) against the
    float64 W8A16 product; inf where out holds a NaN (an element never written)."""
    if bool(torch.isnan(out).any()):
        return float("inf")
    want = reference.w8a16_linear(x, b, scale_b, bias, group_size, compute=torch.float64)
    terms = x.double().abs() @ reference.dequantized(b, scale_b, group_size, torch.float64).abs().t()
    bound = tol.atol + tol.rtol * want.abs() + x.shape[1] * UNIT_ROUNDOFF * terms
    return float(((out.double() - want).abs() / bound).max()) if out.numel() else 0.0


def _exact(got: torch.Tensor, want: torch.Tensor) -> float:
    return 0.0 if torch.equal(got.long(), want) else float("inf")


def golden(kernel, device, dtype: str, tol, shapes=None, split_options=(None, 3)) -> list[tuple[str, float]]:
    from kgen.families.int8_gemm.op import implementation

    impl = implementation(kernel)
    shapes = shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    results = []
    g = torch.Generator(device=device).manual_seed(0)
    for M, N, K in shapes:
        b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=device, generator=g)
        for n_splits in split_options:
            tag = f"{M}x{N}x{K}" + (f" splits={n_splits}" if n_splits else "")
            if dtype == "int8":
                a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=device, generator=g)
                want = a.cpu().long() @ b.cpu().long().t()
                out = gemm(impl, MODE_MM, a, b, poisoned((M, N), torch.int32, device), n_splits=n_splits)
                results.append((f"int8_mm {tag}", _exact(out.cpu(), want)))
                sa = torch.rand(M, device=device, generator=g) / 64
                sb = torch.rand(N, device=device, generator=g) / 64
                bias = torch.randn(N, device=device, generator=g)
                ref = reference.int8_linear(a, b, sa, sb, bias, compute=torch.float64)
                out = gemm(impl, MODE_LINEAR, a, b, poisoned((M, N), torch.bfloat16, device), sa, sb,
                           bias, n_splits=n_splits)
                results.append((f"int8_linear bf16 {tag}", error_ratio(out, ref, tol)))
            else:
                t = getattr(torch, dtype)
                x = torch.randn(M, K, device=device, generator=g).to(t)
                for group in (None, 16) if K % 16 == 0 else (None,):
                    cols = K // group if group else 1
                    s = (torch.rand(N, cols, device=device, generator=g) + 0.5) / (127 * K ** 0.5)
                    s = s.squeeze(1) if group is None else s
                    bias = torch.randn(N, device=device, generator=g).to(t)
                    out = gemm(impl, MODE_W8A16, x, b, poisoned((M, N), t, device), scale_b=s, bias=bias,
                               group_size=group, n_splits=n_splits)
                    results.append((f"w8a16 {dtype} group={group} {tag}",
                                    w8a16_error_ratio(out, x, b, s, bias, group, tol)))
    return results


__all__ = ["golden", "launch", "w8a16_error_ratio"]
