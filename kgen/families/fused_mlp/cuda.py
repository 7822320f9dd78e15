"""fused_mlp's CUDA cluster variants as the op runs them (templates/fused_mlp/cuda.cu.j2, and
cuda_wgmma.cu.j2 with the same launcher arguments): one
launch of the inference forward for its exact widths, beside a Triton companion that serves
everything it does not take (the forward with `save` for the backward, inputs not contiguous
or not 16-byte aligned, other widths)."""

from __future__ import annotations

import torch

from kgen.families.fused_mlp.schema import ACT_CODE
from kgen.runtime.op import prototype
from kgen.runtime.streams import current_raw_stream


class CudaMLP:
    """A loaded CUDA variant (`kernel`) with its Triton companion's module (`triton`)."""

    def __init__(self, kernel, triton_module):
        self.kernel, self.triton = kernel, triton_module
        self.name = kernel.name
        self.widths = tuple(kernel.params["widths"])
        self.dtype = getattr(torch, kernel.variant.dtype)

    def takes(self, x: torch.Tensor, weights, biases) -> bool:
        """Whether the kernel runs this call: x [B, w0] of its dtype and widths, B >= 1,
        x, the weights and biases contiguous and 16-byte aligned (its vector loads)."""
        if x.dtype != self.dtype or x.shape[0] < 1 or (x.shape[1], *(w.shape[0] for w in weights)) != self.widths:
            return False
        ptrs = 0
        for t in (x, *weights, *(b for b in biases if b is not None)):
            if t.dtype != self.dtype or not t.is_contiguous():
                return False
            ptrs |= t.data_ptr()
        return not ptrs & 15

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

    def _args(self, x, out, weights, biases, activation, last_activation):
        args, mask = [x.device.index, x.data_ptr(), out.data_ptr()], 0
        for i, (w, b) in enumerate(zip(weights, biases)):
            args += [w.data_ptr(), b.data_ptr() if b is not None else 0]
            mask |= (b is not None) << i
        return args + [x.shape[0], mask, ACT_CODE[activation], ACT_CODE[last_activation],
                       current_raw_stream(x.device.index)]

    def run(self, x, weights, biases, activation: str, last_activation: str, out=None) -> torch.Tensor:
        """The forward into `out` (or a new [B, wL] tensor); the caller checked `takes`."""
        if out is None:
            out = torch.empty((x.shape[0], self.widths[-1]), dtype=x.dtype, device=x.device)
        k = self.kernel
        rc = k.raw(k.ptr, *self._args(x, out, weights, biases, activation, last_activation))
        if rc:
            k.fail(rc)
        return out

    def direct(self, x, weights, biases, activation: str, last_activation: str):
        """The eager fast path's launcher for this call's signature (see launch.direct): `f(x,
        weights, biases)` -> out [..., wL], or None (then the general path runs) where an input
        is not 16-byte aligned; it takes only calls with this one's strides (the fast paths'
        memo compares them). None where this signature has no fast form."""
        B = x.numel() // self.widths[0] if self.widths[0] else 0
        x2 = x.reshape(B, self.widths[0]) if B else x
        if B == 0 or not self.takes(x2, weights, biases):
            return None
        k, index = self.kernel, x.device.index
        raw, ptr, fail = k.raw, k.ptr, k.fail
        has_bias = tuple(b is not None for b in biases)
        mask = sum(1 << i for i, h in enumerate(has_bias) if h)
        tail = (B, mask, ACT_CODE[activation], ACT_CODE[last_activation])
        proto = prototype((*x.shape[:-1], self.widths[-1]), x.dtype, x.device)
        empty_like = torch.empty_like

        def launch(x, weights, biases):  # (the caller's memo matched this call's strides: contiguous)
            ptrs, args = x.data_ptr(), []
            for w, b in zip(weights, biases):
                wp, bp = w.data_ptr(), (b.data_ptr() if b is not None else 0)
                ptrs |= wp | bp
                args += (wp, bp)
            if ptrs & 15:
                return None
            out = empty_like(proto)
            rc = raw(ptr, index, x.data_ptr(), out.data_ptr(), *args, *tail, current_raw_stream(index))
            if rc:
                fail(rc)
            return out

        return launch
