"""Why can kgen.ops.w8a16_linear / int8_mm take longer than the variant dispatch chose,
called directly (issue 16: 1 x 12288 x 4096 w8a16 138.9 us through the op, 37.2 us direct)?
For each case: the implementation dispatch picks, then (1) the kernels one op call and one
direct call launch, with their GPU durations (torch.profiler), (2) host us per call of each
(loops of calls, synchronised once; interleaved rounds, minimum), (3) do_bench medians with
L2 flushed, as tools/bench_int8_gemv.py takes them. Run on the device: python3 tools/int8_dispatch_check.py"""
import json
import sys

import torch
import triton

from kgen import ops
from kgen.benchmarks.fused_bias_act import interleaved_min
from kgen.families import int8_gemm as ig
from kgen.families.int8_gemm import op as ig_op

CASES = [(1, 12288, 4096), (16, 4096, 4096), (1, 4096, 4096), (1, 65536, 4096)]


def kernels_of(fn) -> list:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name[:70], round(e.device_time_total, 2)) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> int:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for M, N, K in CASES:
        b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=dev)
        sb = (torch.rand(N, device=dev) + 0.5) / (127 * K ** 0.5)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=dev)
        for name in ("w8a16", "int8_mm"):
            if name == "w8a16":
                impl = ig_op._impl(dev, x.dtype, M, N, K, False)
                out = torch.empty(M, N, dtype=x.dtype, device=dev)
                op = lambda: ops.w8a16_linear(x, b, sb)  # noqa: E731
                direct = lambda: ig.gemm(impl, ig.MODE_W8A16, x, b, out, scale_b=sb)  # noqa: E731
                same = lambda: torch.equal(op(), direct())  # noqa: E731
            else:
                impl = ig_op._impl(dev, torch.int8, M, N, K, False)
                out = torch.empty(M, N, dtype=torch.int32, device=dev)
                op = lambda: ops.int8_mm(a, b)  # noqa: E731
                direct = lambda: ig.gemm(impl, ig.MODE_MM, a, b, out)  # noqa: E731
                same = lambda: torch.equal(op(), direct())  # noqa: E731
            host = interleaved_min([("op", op), ("direct", direct), ("torch.add", lambda: torch.add(sb, sb))], 200, 5)
            bench = {k: 1e3 * triton.testing.do_bench(f, warmup=5, rep=25, return_mode="median")
                     for k, f in (("op", op), ("direct", direct))}
            row = {"case": f"{name} {M}x{N}x{K}", "impl": getattr(impl, "name", None), "same output": same(),
                   "loop us/call": {k: round(v, 2) for k, v in host.items()},
                   "do_bench us": {k: round(v, 2) for k, v in bench.items()},
                   "op kernels": kernels_of(op), "direct kernels": kernels_of(direct)}
            print(json.dumps(row), flush=True)
        del b, x, a
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
