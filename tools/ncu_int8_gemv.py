"""One int8_gemm call of one variant at one shape, for a profiler to look at (the kernel runs
three times: warm-up, then two calls; profile the last with ncu's --launch-skip).

    python tools/ncu_int8_gemv.py VARIANT M N K
"""

from __future__ import annotations

import sys

import torch

from kgen import spec
from kgen.families import int8_gemm as ig
from kgen.runtime import dispatch


def main(argv=None) -> int:
    name, M, N, K = (argv or sys.argv[1:])[:4]
    M, N, K = int(M), int(N), int(K)
    S = spec.load("kgen/specs/int8_gemm.yaml")
    v = S.variant(name)
    impl = ig.implementation(dispatch.load(v))
    dev = torch.device("cuda")
    b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=dev)
    for _ in range(3):
        if v.dtype == "int8":
            a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=dev)
            ig.gemm(impl, ig.MODE_MM, a, b, torch.empty(M, N, dtype=torch.int32, device=dev))
        else:
            x = torch.randn(M, K, device=dev).to(getattr(torch, v.dtype))
            s = torch.rand(N, device=dev) / 1000
            ig.gemm(impl, ig.MODE_W8A16, x, b, torch.empty(M, N, dtype=x.dtype, device=dev), scale_b=s)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
