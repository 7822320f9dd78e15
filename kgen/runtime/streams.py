"""The caller's current CUDA stream as an integer handle, for C launchers; and the current
device's context bound to the calling thread, for launches that need it first."""

from __future__ import annotations

import threading

import torch

# The private getter costs a fraction of `torch.cuda.current_stream(i).cuda_stream`, which
# builds a Stream object per call; launches read it on every call.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda i: torch.cuda.current_stream(i).cuda_stream)

# torch's current device, read without torch.cuda's lazy-init check
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_bound = threading.local()


def bind_context() -> None:
    """Make the current device's primary context current on this thread (once per thread
    and device). Triton's launcher encodes a host-side TMA descriptor (cuTensorMapEncode*,
    a driver call that needs a current context) before it makes a context current for the
    launch, and autograd's worker thread for device 0 starts with none: torch skips
    cudaSetDevice where the device already matches. So a backward whose first CUDA work was
    a Triton kernel with descriptor arguments failed with "invalid device context"
    (pytorch/pytorch#124565 is the same for plain launches). torch.cuda.set_device calls
    cudaSetDevice even for the current device, which binds its primary context."""
    index = current_device()
    if getattr(_bound, "index", None) != index:
        torch.cuda.set_device(index)
        _bound.index = index
