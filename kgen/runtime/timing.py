"""The tuner's timer: one call of a function as a stream of back-to-back calls runs it, the
larger of its GPU time and its host (launch) time (`cuda_timer`), carrying the GPU part
(`Timing`) that breaks ties between host-bound candidates (kgen.runtime.tuning_rules.pick)."""

from __future__ import annotations

import functools
import math
from typing import Callable

MIN_MEASURE_US = 1000.0  # each candidate is timed over at least this much GPU time


@functools.cache
def _sleep_cycles_per_us(index: int) -> float:
    """How many `torch.cuda._sleep` cycles make one microsecond on this device (measured
    once: the spin kernel counts SM clock cycles, and clocks differ between GPUs)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up (clocks ramp)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end) * 1000, 1.0)


class Timing(float):
    """A time in microseconds (what the tuner compares: the larger of GPU and host time)
    that also carries its GPU part, `gpu`, which breaks ties between host-bound candidates
    (see pick). Timers that return a plain float (fakes in tests) have no GPU part."""

    gpu: float

    def __new__(cls, us: float, gpu: float):
        t = super().__new__(cls, us)
        t.gpu = gpu
        return t


def gpu_part(t: float) -> float | None:
    return getattr(t, "gpu", None)


def cuda_timer(fn: Callable[[], None], min_us: float = MIN_MEASURE_US) -> Timing:
    """One call of `fn` in microseconds as a stream of back-to-back calls runs it: the
    larger of its GPU time and its host (launch) time, each the median of several samples
    (a `Timing`, whose `gpu` is the GPU time alone).

    The GPU time is measured with every sample's calls queued behind a spin kernel
    (`torch.cuda._sleep`) long enough to cover their launches, so CUDA events see kernels
    back to back and not the host's gaps. The host time is the wall time of enqueueing
    back-to-back calls on an idle GPU, as a host-bound loop runs them (not behind the spin:
    launches queued behind a spinning GPU took 1.3-1.6x longer on an H100 host than the same
    loop's with the GPU running them, which made multi-launch candidates such as an eager
    composition look up to 40 % slower than they run; BENCHMARKS.md, twenty-second
    session). Timing back-to-back calls alone mixes the two: where a Triton launch's ~15-25
    us host cost is near the kernel's GPU time it swung timings 30-60 % between processes
    (H100, BENCHMARKS.md), enough to flip choices. A GPU sample spans ~100 us of GPU time
    (event resolution); samples cover `min_us` (>= 7)."""
    import time

    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    host_est = (time.perf_counter() - t0) / 3 * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    one = max(start.elapsed_time(end) * 1000 / 3, 1e-3)
    per_sample = max(1, math.ceil(100 / one))
    samples = max(7, min(200, math.ceil(min_us / (one * per_sample))))
    cycles_per_us = _sleep_cycles_per_us(torch.cuda.current_device())
    gpu, host = [], []
    # Batches of GPU samples, each queued behind one spin long enough for its launches (2x
    # the host estimate + 200 us); a batch whose spin ended before its launches did is
    # retried with a longer spin, so that no gap between launches reaches the events.
    batch = max(1, min(samples, math.ceil(20_000 / (per_sample * max(host_est, one)))))
    slack = 2.0
    while len(gpu) < samples:
        n = min(batch, samples - len(gpu))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        spin_done = torch.cuda.Event()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(cycles_per_us * (slack * host_est * per_sample * n + 200)))
        spin_done.record()
        for s, e in events:
            s.record()
            for _ in range(per_sample):
                fn()
            e.record()
        if spin_done.query():  # the GPU caught up with the launches: retry, spinning longer
            torch.cuda.synchronize()
            if slack > 64:
                raise RuntimeError("cuda_timer: the GPU keeps catching up with the host's launches")
            slack *= 2
            continue
        events[-1][1].synchronize()
        gpu += [s.elapsed_time(e) * 1000 / per_sample for s, e in events]
    # Host samples: `calls` back-to-back calls from an idle GPU, the wall time until the last
    # one returns (no sync: a launch-bound loop's own rate; a GPU-bound one's host time is
    # below its GPU time and does not count). A sample spans ~300 us of the call's larger
    # time, the samples min_us / 2 (>= 5): a GPU-bound call is not run much longer here.
    per_call = max(host_est, one, 1.0)
    calls = max(2, min(64, math.ceil(300 / per_call)))
    for _ in range(max(5, min(200, math.ceil(min_us / 2 / (calls * per_call))))):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    gpu.sort()
    host.sort()
    g = gpu[len(gpu) // 2]
    return Timing(max(g, host[len(host) // 2]), g)
