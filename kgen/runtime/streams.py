"""The caller's current CUDA stream as an integer handle, for C launchers."""

from __future__ import annotations

import torch

# The private getter costs a fraction of `torch.cuda.current_stream(i).cuda_stream`, which
# builds a Stream object per call; launches read it on every call.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda i: torch.cuda.current_stream(i).cuda_stream)
