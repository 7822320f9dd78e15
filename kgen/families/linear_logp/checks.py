"""linear_logp's argument checks (dtypes, shapes, devices, scalars) and the target range
check, queued on the device and waited for after the kernels."""

from __future__ import annotations

import math
from typing import Callable

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TARGET_DTYPES = (torch.int64, torch.int32)
# Targets per step of the one-program range check (linear_logp_target_check_kernel).
TARGET_CHECK_BLOCK = 1024


def check_inputs(hidden, weight, target, bias, temperature, ignore_index) -> None:
    """Dtypes, shapes, devices and scalars; raises TypeError/ValueError naming the argument.
    Never touches tensor values (safe on fake tensors); see check_target_range."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_logp: {name} must be a tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"linear_logp: bias must be a tensor or None, got {type(bias).__name__}")
    if hidden.dtype not in _DTYPES:
        raise TypeError(f"linear_logp: hidden has dtype {hidden.dtype}; supported: float32, bfloat16, float16")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"linear_logp: weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if bias is not None and bias.dtype != hidden.dtype:
        raise TypeError(f"linear_logp: bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}")
    if target.dtype not in _TARGET_DTYPES:
        raise TypeError(f"linear_logp: target has dtype {target.dtype}; expected torch.int64 (or int32)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"linear_logp: temperature must be a float, got {type(temperature).__name__}")
    if not 0 < temperature < math.inf:  # (comparisons, not math.isfinite: torch.compile traces them)
        raise ValueError(f"linear_logp: temperature must be finite and > 0, got {temperature}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, torch.SymInt)):  # (SymInt: compile)
        raise TypeError(f"linear_logp: ignore_index must be an int, got {type(ignore_index).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"linear_logp: weight must be 2-D [V, D], got shape {tuple(weight.shape)}")
    V, D = weight.shape
    if V == 0 or D == 0:
        raise ValueError(f"linear_logp: weight has shape {tuple(weight.shape)}; V and D must be >= 1")
    if hidden.dim() < 1 or hidden.shape[-1] != D:
        raise ValueError(f"linear_logp: hidden has shape {tuple(hidden.shape)}; its last dimension "
                         f"must be D = {D} (weight is [V, D] = {tuple(weight.shape)})")
    n = hidden.numel() // D
    if target.shape != hidden.shape[:-1] and not (target.dim() == 1 and target.shape[0] == n):
        raise ValueError(f"linear_logp: target has shape {tuple(target.shape)}; expected "
                         f"{tuple(hidden.shape[:-1])} (hidden's leading dims) or ({n},)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != V):
        raise ValueError(f"linear_logp: bias has shape {tuple(bias.shape)}; expected ({V},), V of weight")
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"linear_logp: {name} is on {t.device}, hidden on {hidden.device}; "
                             "all tensors must be on one device")


def check_flat(hidden, target, op: str = "linear_logp") -> None:
    """The registered ops (torch.ops.kgen.linear_logp and its backward) take 2-D hidden and 1-D
    target, as their fake impls say; kgen.ops.linear_logp flattens leading dims before them."""
    if hidden.dim() != 2 or target.dim() != 1:
        raise ValueError(f"torch.ops.kgen.{op}: hidden must be 2-D [N, D] and target 1-D [N], got "
                         f"{tuple(hidden.shape)} and {tuple(target.shape)} (kgen.ops.linear_logp takes leading "
                         "batch dims and flattens them)")


def check_target_range(target: torch.Tensor, V: int, ignore_index: int, kernels=None) -> Callable[[], None]:
    """Queues the check that target is in [0, V) or == ignore_index and returns the function
    that waits for it and raises ValueError if it failed. Call that function after queueing
    the kernels: the host then waits for the check alone (a flag copied to pinned memory and
    an event recorded right after it), with the kernels already queued behind it, so the
    GPU does not idle while the host waits and launches. `kernels`: a Triton module whose
    linear_logp_target_check_kernel does the check in one launch (else torch ops, ~7).
    Waiting before launching left the GPU idle for the host's whole launch path: 1.5-3 %
    of the op's time at (4096, 2048, 151936) on an H100 (BENCHMARKS.md). The kernels index
    memory with target only inside [0, V), so a bad value gives a wrong row, never a bad
    access, and the error is raised before any row is returned. Skipped during CUDA graph
    capture, where a host wait is illegal."""
    def out_of_range() -> torch.Tensor:  # (in int64, as the kernels and the reference compare)
        t = target.long()
        return ((t < 0) | (t >= V)) & (t != ignore_index)

    n = target.numel()
    if n == 0 or (target.is_cuda and torch.cuda.is_current_stream_capturing()):
        return lambda: None
    done = None
    if not target.is_cuda:
        flag = out_of_range().any()
    else:
        if kernels is not None:
            found = torch.empty(1, dtype=torch.int32, device=target.device)
            kernels.linear_logp_target_check_kernel[(1,)](target, found, n, V, ignore_index, BLOCK=TARGET_CHECK_BLOCK)
        else:
            found = out_of_range().any()
        flag = torch.empty(found.shape, dtype=found.dtype, pin_memory=True).copy_(found, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

    def finish() -> None:
        if done is not None:
            done.synchronize()
        if bool(flag):
            bad = out_of_range()
            first = int(target.reshape(-1)[bad.reshape(-1)][0])
            raise ValueError(f"linear_logp: target holds {first}, outside [0, {V}) and not "
                             f"ignore_index ({ignore_index})")

    return finish
