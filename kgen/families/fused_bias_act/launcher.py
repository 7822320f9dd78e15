"""How one loaded fused_bias_act variant runs: the CUDA library's raw entry point, or the
Triton kernel (replayed once its launch has been seen)."""

from __future__ import annotations

import torch

from kgen.families.fused_bias_act.schema import ACT_CODE, MAX_GRID_Y
from kgen.runtime import triton_launch
from kgen.runtime.op import stride_align
from kgen.runtime.streams import current_raw_stream as _raw_stream


def launch(kernel, x, bias, y, alpha: float, act: str, out) -> None:
    """Run one loaded variant (`kgen.runtime.loader.Kernel`) on checked, contiguous tensors."""
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if rows == 0:
        return
    has_y = y is not None
    if kernel.backend == "cuda":
        # the tail path (one element per thread) has the widest grid: cols / threads blocks
        threads = kernel.params["threads"]
        if kernel.params["order"] == "flat":
            # the kernel finds columns in 32 bits and through a double reciprocal (exact below 2^52)
            n = rows * cols
            if -(-n // (threads * kernel.params["unroll"])) > 2**31 - 1 or cols > 2**31 - 2**16 or n >= 2**52:
                raise ValueError(f"fused_bias_act: {rows} x {cols} exceeds the CUDA grid of variant {kernel.name}")
        elif kernel.params["order"] == "across":
            if -(-rows // kernel.params["rows"]) * -(-cols // threads) > 2**31 - 1:
                raise ValueError(f"fused_bias_act: {rows} x {cols} exceeds the CUDA grid of variant {kernel.name}")
        elif cols > MAX_GRID_Y * threads:
            raise ValueError(f"fused_bias_act: {cols} columns exceed the CUDA grid of variant "
                             f"{kernel.name} (at most {MAX_GRID_Y * kernel.params['threads']})")
        dev = x.get_device()
        rc = kernel.raw(kernel.ptr, dev, ACT_CODE[act], has_y, x.data_ptr(), y.data_ptr() if has_y else 0,
                        bias.data_ptr(), out.data_ptr(), rows, cols, _raw_stream(dev), float(alpha), 1.0 / cols)
        if rc:
            kernel.fail(rc)
    else:
        _triton(kernel, x, bias, y, alpha, act, out, rows, cols)


def bound(kernel, dev: int, rows: int, cols: int, has_y: bool, act: str):
    """`launch` with everything a call signature fixes bound once, for the op's eager fast
    path: `f(x, bias, y, alpha)` -> out = a new tensor like x, for contiguous inputs of the
    signature whose general call `launch` took without error (rows > 0)."""
    empty_like = torch.empty_like
    if kernel.backend != "cuda":
        def f(x, bias, y, alpha):
            out = empty_like(x)
            _triton(kernel, x, bias, y, alpha, act, out, rows, cols)
            return out

        return f
    raw, ptr, fail, code, inv = kernel.raw, kernel.ptr, kernel.fail, ACT_CODE[act], 1.0 / cols

    def f(x, bias, y, alpha):
        out = empty_like(x)
        rc = raw(ptr, dev, code, has_y, x.data_ptr(), y.data_ptr() if has_y else 0, bias.data_ptr(), out.data_ptr(),
                 rows, cols, _raw_stream(dev), alpha, inv)
        if rc:
            fail(rc)
        return out

    return f


# Replayed Triton launches (triton_launch.replay) per (variant module, device, rows, cols,
# y or not, act): a repeated call passes its addresses and alpha, skipping the per-launch
# specialisation key (~20 us a launch on a slow H100 host, BENCHMARKS.md fourteenth
# session). The module is kept in the value, so its id is not reused.
_BOUND: dict = {}
_BOUND_ENTRIES = 4096


def _triton(kernel, x, bias, y, alpha: float, act: str, out, rows: int, cols: int) -> None:
    mod = kernel.module
    has_y = y is not None
    key = (id(mod), x.get_device(), rows, cols, has_y, act)
    bound = _BOUND.get(key)
    if bound is not None:
        ptrs = [x.data_ptr(), y.data_ptr(), bias.data_ptr(), out.data_ptr(), alpha] if has_y else \
            [x.data_ptr(), bias.data_ptr(), out.data_ptr(), alpha]
        if bound[1](ptrs):
            return
    if mod.ORDER == "flat":
        n = rows * cols
        wide = n + mod.BLOCK_COLS > 2**31 - 1  # the last program's offsets in 32 bits
        if triton_cdiv(n, mod.BLOCK_COLS) > 2**31 - 1:
            raise ValueError(f"fused_bias_act: {rows} x {cols} exceeds the grid of variant {kernel.name}")
        grid = (triton_cdiv(n, mod.BLOCK_COLS),)
        args = (x, y if has_y else x, bias, out, alpha, n, cols)
        kw = dict(ACT=ACT_CODE[act], HAS_Y=has_y, BLOCK_COLS=mod.BLOCK_COLS, WIDE=wide,
                  EVEN=n % mod.BLOCK_COLS == 0, num_warps=mod.NUM_WARPS)
    else:
        grid = (triton_cdiv(rows, mod.ROWS), triton_cdiv(cols, mod.BLOCK_COLS))
        if grid[1] > MAX_GRID_Y:
            raise ValueError(f"fused_bias_act: {cols} columns exceed the grid of variant {kernel.name}")
        args = (x, y if has_y else x, bias, out, alpha, rows, cols)
        kw = dict(ACT=ACT_CODE[act], HAS_Y=has_y, BLOCK_COLS=mod.BLOCK_COLS, ROWS=mod.ROWS, CA=stride_align(cols),
                  num_warps=mod.NUM_WARPS)
    # (kgen.runtime.triton_launch: Triton's own launch the first time per specialisation,
    # its compiled launcher directly after that)
    launch = (mod.fused_bias_act_kernel, grid, args, kw)
    triton_launch.launch(*launch)
    if bound is None:  # alpha (argument 4) varies; None where the call cannot be replayed
        rep = triton_launch.replay([launch], (x, y, bias, out) if has_y else (x, bias, out), scalars=((0, 4),))
        if rep is not None:
            if len(_BOUND) >= _BOUND_ENTRIES:
                _BOUND.clear()
            _BOUND[key] = (mod, rep)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
