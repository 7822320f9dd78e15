"""What the public op adds over the raw linear_logp forward at the benchmark shapes (bf16, no
bias): each path timed against cuBLAS `hidden @ weight.T` in the same interleaved set as
tools/llp_cuda_check.py (4 calls per sample, the first call's host path on the clock), and
in do_bench pairs as the bench times them. Paths: `ops.linear_logp` as shipped (target
range check queued before the forward, waited for after it); the same with the wait moved
before the forward is queued (the previous order, for comparison); with no range check;
`llp.forward` on dispatch's implementation; and the CUDA partials kernel alone.

Usage (device machine, repo root): python3 tools/llp_op_overhead.py
"""

from __future__ import annotations

import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kgen import ops  # noqa: E402
from kgen.benchmarks.linear_logp import SHAPES, _paired  # noqa: E402
from kgen.families import linear_logp as llp  # noqa: E402
from kgen.families.linear_logp import op as llp_op  # noqa: E402
from llp_cuda_check import interleaved  # noqa: E402


SHIPPED_CHECK = llp.check_target_range


def with_check(check):
    """ops.linear_logp with the op module's check_target_range replaced by `check` for the call."""
    def run(h, w, t):
        llp_op.check_target_range = check
        try:
            return ops.linear_logp(h, w, t, check_targets=True)
        finally:
            llp_op.check_target_range = SHIPPED_CHECK
    return run


def wait_first(*args):
    """The range check waited for at once, before the op queues the forward."""
    SHIPPED_CHECK(*args)()
    return lambda: None


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    before, unchecked = with_check(wait_first), with_check(lambda *a: (lambda: None))
    for N, D, V in SHAPES:
        torch.manual_seed(0)
        h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(V, D, device="cuda") * (2.0 / math.sqrt(D))).to(torch.bfloat16)
        t = torch.randint(0, V, (N,), device="cuda")
        impl = llp._module(h.device, h.dtype)
        fns = {"cuBLAS h @ w.T": lambda: h @ w.T,
               "op (default: no range check)": lambda: ops.linear_logp(h, w, t),
               "op, checked: wait after queueing": lambda: ops.linear_logp(h, w, t, check_targets=True),
               "op, checked: wait before queueing": lambda: before(h, w, t),
               "op, no range check (patched)": lambda: unchecked(h, w, t),
               "llp.forward": lambda: llp.forward(impl, h, w, t, None, 1.0, -100, False)}
        if isinstance(impl, llp.CudaForward):
            splits = impl.splits(N, V, h.device)
            fns["partials kernel alone"] = lambda: impl.partials(h, w, t, None, 1.0, False, splits)
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        print(f"== {N}x{D}x{V}, {impl.name}", flush=True)
        ms, ratio = interleaved(fns, "cuBLAS h @ w.T")
        for k in fns:
            bench_ms, bench_ratio = _paired(fns[k], fns["cuBLAS h @ w.T"], False)
            print(f"{k:36s} interleaved {ms[k]:7.3f} ms  x GEMM {ratio[k]:.3f}   "
                  f"do_bench pairs {bench_ms:7.3f} ms  x GEMM {bench_ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
