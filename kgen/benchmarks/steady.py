"""Steady-state GPU time per call: back-to-back calls captured in one CUDA graph, each
reading other inputs than the call before it, timed with events after a cache flush that
leaves L2 clean.

Why not only `triton.testing.do_bench`: it flushes L2 before every timed call by zeroing a
256 MiB buffer, which leaves L2 full of dirty lines; the timed call then pays for writing
them back. For a bandwidth-bound kernel of ~25 us that is +7 to +10 us (H100, N = K = 4096
float32 logmatmul: 33.2 us by do_bench, 26.6 us here; a 64 MiB read-only Triton kernel
34.6 against 24.3; BENCHMARKS.md, sixteenth session). The floor of such a kernel (bytes /
copy bandwidth) is measured the same way here, so that the two are compared alike.
"""

from __future__ import annotations

import torch

CALLS = 20  # calls per graph replay
REPLAYS = 15  # timed replays; the median is reported


def _flush(buf: torch.Tensor) -> None:
    buf.sum()  # a read: L2 is left holding clean lines


def steady_us(fns, calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Median microseconds per call of `fns[i % len(fns)]()` for i < calls, captured in one
    CUDA graph (on a side stream, after one eager call of each to warm up). Pass one
    function per input set, enough sets that their bytes exceed L2, so that no call finds
    its inputs in the cache."""
    dev = torch.device("cuda")
    for f in fns:
        f()
    torch.cuda.synchronize()
    flush = torch.empty(64 << 20, dtype=torch.float32, device=dev)  # 256 MiB
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fns[i % len(fns)]()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        _flush(flush)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def copy_floor_us(nbytes: int) -> tuple[float, float]:
    """(copy bandwidth in GB/s, microseconds to read `nbytes` once at it): device copies of
    `nbytes` alternating between two buffer pairs, timed as steady_us times them."""
    dev = torch.device("cuda")
    n = max(1, nbytes // 4)
    bufs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(4)]
    fns = [lambda: bufs[1].copy_(bufs[0]), lambda: bufs[3].copy_(bufs[2])]
    us = steady_us(fns)
    bw = 2 * n * 4 / us / 1e3
    return bw, n * 4 / bw / 1e3
