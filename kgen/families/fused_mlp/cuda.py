"""fused_mlp's CUDA cluster variants as the op runs them (templates/fused_mlp/cuda.cu.j2, and
cuda_wgmma.cu.j2 and cuda_ring.cu.j2 with the same launcher arguments): one
launch of the inference forward for its exact widths, beside a Triton companion that serves
everything it does not take (the forward with `save` for the backward, inputs not contiguous
or not 16-byte aligned, other widths)."""

from __future__ import annotations

import torch

from kgen.families.fused_mlp.schema import ACT_CODE, _round, ring_weights
from kgen.runtime.op import prototype
from kgen.runtime.streams import current_raw_stream


MISALIGNED = -1  # the C launcher's answer for a pointer not 16-byte aligned (launch.cuh.j2): nothing ran


def row_stride(w: torch.Tensor):
    """The row stride (elements) at which the CUDA variants read weight `w` [N, K]: K where
    it is contiguous, its own where its rows are laid out further apart on 16-byte
    boundaries (row-padded: launch.row_padded; the padding never read), else None (the
    caller copies it contiguous)."""
    k = w.shape[1]
    if w.is_contiguous():
        return k
    s = w.stride(0)
    return s if w.stride(1) == 1 and s > k and not (s * w.element_size()) & 15 else None


def _pitch(w: torch.Tensor) -> int:
    """Weight `w`'s width rounded up to whole 16-byte vectors: its row stride in the ring
    launcher's row-padded copy (`CudaMLP.scratch`)."""
    return _round(w.shape[1], 16 // w.element_size())


class CudaMLP:
    """A loaded CUDA variant (`kernel`) with its Triton companion's module (`triton`)."""

    def __init__(self, kernel, triton_module):
        self.kernel, self.triton = kernel, triton_module
        self.name = kernel.name
        self.widths = tuple(kernel.params["widths"])
        self.dtype = getattr(torch, kernel.variant.dtype)
        # the TMA ring kernel (cuda_ring.cu.j2) reads its first `tma` weights through tensor
        # maps (all but a one-wide last layer's, a dot): rows on 16-byte boundaries
        self.tma = ring_weights(self.widths) if kernel.params.get("stages") else 0

    def takes(self, x: torch.Tensor, weights, biases, pitch: bool = True) -> bool:
        """Whether the kernel runs this call: x [B, w0] of its dtype and widths, B >= 1,
        x and the biases contiguous, each weight contiguous or row-padded (`row_stride`), all
        16-byte aligned (its vector loads); for the TMA ring kernel the row stride of every
        weight it reads through a tensor map whole 16-byte vectors too (a weight of width 367
        row-padded to 368, not contiguous), unless `pitch` is False: then its launcher copies the
        others row-padded (`scratch`; not a one-row weight: its pitch is its width)."""
        if x.dtype != self.dtype or x.shape[0] < 1 or (x.shape[1], *(w.shape[0] for w in weights)) != self.widths:
            return False
        ptrs = 0
        for t in (x, *(b for b in biases if b is not None)):
            if t.dtype != self.dtype or not t.is_contiguous():
                return False
            ptrs |= t.data_ptr()
        for i, w in enumerate(weights):
            ld = row_stride(w)
            if w.dtype != self.dtype or ld is None:
                return False
            if i < self.tma and (ld * w.element_size()) & 15 and (pitch or w.shape[0] == 1):
                return False  # (one row: contiguous however laid out, its pitch its width)
            ptrs |= w.data_ptr()
        return not ptrs & 15

    def unpitched(self, weights) -> list:
        """Which weights the TMA ring kernel reads through a tensor map whose rows are not
        whole 16-byte vectors apart (dense, of a width such as 367 in bf16): its launcher
        copies them row-padded (`scratch`). None of them for the other kernels."""
        return [i for i in range(self.tma) if (row_stride(weights[i]) * weights[i].element_size()) & 15]

    def scratch_size(self, weights, copy) -> int:
        """Elements of the scratch the ring launcher copies weights `copy` (`unpitched`) into,
        row-padded back to back (cuda_ring.cu.j2, plan_pads)."""
        return sum(weights[i].shape[0] * _pitch(weights[i]) for i in copy)

    def scratch(self, weights):
        """The TMA ring launcher's last argument: a fresh buffer (on the current stream, freed
        after the call as any temporary) into which it copies the weights `unpitched` names
        row-padded before the kernel reads them (pad_rows, one launch a weight: the
        tensor map stops at the width, the padding is never read), or None where there are
        none. The DLRM top MLP's dense 367-wide W0 (376 KB in bf16) takes one such copy a call:
        0.4-1.3 us of GPU time and ~6 us of host time over the same variant on padded weights
        (H100), where the ring saves 3-11 us of GPU time at B = 512-4096 over the variants that
        read W0 dense (BENCHMARKS.md, eighty-fourth session); the tuner weighs both.
        FusedMLP(pad_weights=True) keeps W0 so and saves the copy."""
        copy = self.unpitched(weights)
        if not copy:
            return None
        w = weights[copy[0]]
        return torch.empty(self.scratch_size(weights, copy), dtype=w.dtype, device=w.device)

    def max_clusters(self, device_index: int) -> int:
        """How many clusters of the kernel `device_index` holds at once: the persistent grid's
        most (a call with more row tiles walks several per cluster). Not a hot path: ctypes."""
        import ctypes

        fn = self.kernel.lib.kgen_max_clusters
        fn.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_double)]
        fn.restype = ctypes.c_int
        n = fn((ctypes.c_longlong * 1)(device_index), (ctypes.c_double * 1)())
        if n < 1:
            self.kernel.fail(-n)
        return n

    def _args(self, x, out, weights, biases, activation, last_activation, scratch):
        mask = sum(1 << i for i, b in enumerate(biases) if b is not None)
        tail = [scratch.data_ptr() if scratch is not None else 0] if self.tma else []
        return [x.device.index, current_raw_stream(x.device.index), x.shape[0], mask, ACT_CODE[activation],
                ACT_CODE[last_activation], *map(row_stride, weights), x.data_ptr(), out.data_ptr(),
                *(w.data_ptr() for w in weights), *(b.data_ptr() for b in biases if b is not None), *tail]

    def run(self, x, weights, biases, activation: str, last_activation: str, out=None) -> torch.Tensor:
        """The forward into `out` (or a new [B, wL] tensor); the caller checked `takes` (with
        `pitch=False`: the ring launcher copies what its tensor maps cannot read, `scratch`)."""
        if out is None:
            out = torch.empty((x.shape[0], self.widths[-1]), dtype=x.dtype, device=x.device)
        k = self.kernel
        scratch = self.scratch(weights)
        rc = k.raw(k.ptr, *self._args(x, out, weights, biases, activation, last_activation, scratch))
        if rc == MISALIGNED:
            raise ValueError(f"{self.name}: an input or the output is not 16-byte aligned")
        if rc:
            k.fail(rc)
        return out

    def direct(self, x, weights, biases, activation: str, last_activation: str):
        """The eager fast path's launcher for this call's signature (see launch.direct): `f(x,
        weights, biases)` -> out [..., wL], or None (then the general path runs) where an input
        is not 16-byte aligned (the C launcher checks, launching nothing); it takes only calls
        with this one's strides and bias pattern (the fast paths' memo compares them). None
        where this signature has no fast form."""
        B = x.numel() // self.widths[0] if self.widths[0] else 0
        x2 = x.reshape(B, self.widths[0]) if B else x
        if B == 0 or not self.takes(x2, weights, biases, pitch=False):
            return None
        k, index = self.kernel, x.device.index
        raw, ptr, fail = k.raw, k.ptr, k.fail
        present = [i for i, b in enumerate(biases) if b is not None]
        mask = sum(1 << i for i in present)
        copy = self.unpitched(weights)  # (copied row-padded each call by the launcher, into scratch)
        head = (B, mask, ACT_CODE[activation], ACT_CODE[last_activation], *map(row_stride, weights))
        proto = prototype((*x.shape[:-1], self.widths[-1]), x.dtype, x.device)
        empty, empty_like, data_ptr = torch.empty, torch.empty_like, torch.Tensor.data_ptr
        size, kind = self.scratch_size(weights, copy), dict(dtype=x.dtype, device=x.device)
        tail = (0,) if self.tma else ()

        every = len(present) == len(biases)

        # (each pointer read once, by a C-level map: this closure is most of a fast call's Python;
        # the alignment check is the C launcher's)
        def launch(x, weights, biases):
            out = empty_like(proto)
            scratch = empty(size, **kind) if size else None  # (alive until the copy is enqueued)
            rc = raw(ptr, index, current_raw_stream(index), *head, x.data_ptr(), out.data_ptr(),
                     *map(data_ptr, weights), *map(data_ptr, biases if every else [biases[i] for i in present]),
                     *((scratch.data_ptr(),) if size else tail))
            if rc:
                return None if rc == MISALIGNED else fail(rc)
            return out

        return launch
