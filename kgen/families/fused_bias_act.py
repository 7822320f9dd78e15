"""fused_bias_act: out = act(x + alpha * y + bias[col]) over a row-major [rows, cols] tensor.

The family's knobs, its reference math, input checks, grid sizes, autograd and public op.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from kgen.runtime import triton_launch
from kgen.runtime.op import MISSING, Kernels, define
from kgen.runtime.streams import current_raw_stream as _raw_stream
from kgen.spec import DTYPES, Knob, Schema

ACTIVATIONS = ("none", "relu", "sigmoid", "gelu", "silu")
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The CUDA grid of order "down" puts column blocks on grid.y, whose limit is 65535.
_MAX_GRID_Y = 65535


def _check_variant(backend: str, arch: str | None, dtype: str, k: Mapping[str, Any]):
    problems = []
    if backend == "cuda":
        size = DTYPES[dtype][0]
        if k["order"] == "flat" and k["rows"] != 1:
            problems.append(("rows", "order flat has no row blocks: use unroll for more work per thread"))
        if k["order"] != "flat" and k["unroll"] != 1:
            problems.append(("unroll", f"unroll applies to order flat only (order is {k['order']}; use rows)"))
        if k["vec"] * size > 16 or 16 % (k["vec"] * size):
            problems.append(("vec", f"vec={k['vec']} x {size}-byte {dtype} = {k['vec'] * size} bytes "
                                    "does not divide a 16-byte access"))
    else:
        if k["order"] == "flat" and k["rows"] != 1:
            problems.append(("rows", "order flat has no row blocks: block_cols is the elements per program"))
        if k["block_cols"] < 32 * k["num_warps"]:
            problems.append(("block_cols", f"block_cols={k['block_cols']} leaves warps idle with "
                                           f"num_warps={k['num_warps']} (need >= {32 * k['num_warps']})"))
    return problems


SCHEMA = Schema(
    dtypes=tuple(_TORCH_DTYPES.values()),
    knobs={
        "cuda": (
            Knob("threads", "t", lo=32, hi=1024, pow2=True),
            Knob("vec", "v", lo=1, hi=16, pow2=True),
            Knob("rows", "r", lo=1, hi=16),
            # grid order: "down" (row blocks fastest), "across" (column blocks fastest, 1-D) or
            # "flat" (the tensor as one flat run of elements; any cols takes 16-byte vectors)
            Knob("order", "o", kind=str, choices=("down", "across", "flat"), default="down"),
            # order "flat": vectors per thread, all loaded before any is stored
            Knob("unroll", "u", lo=1, hi=8, default=1),
        ),
        "triton": (
            Knob("block_cols", "c", lo=16, hi=16384, pow2=True),
            Knob("rows", "r", lo=1, hi=16),
            Knob("num_warps", "w", lo=1, hi=32, pow2=True),
            # "down": a 2-D grid of row and column blocks; "flat": the tensor as one run of
            # elements, block_cols of them a program (as Inductor's pointwise kernels)
            Knob("order", "o", kind=str, choices=("down", "flat"), default="down"),
        ),
    },
    check=_check_variant,
)
TEMPLATES = {"cuda": "fused_bias_act/cuda.cu.j2", "triton": "fused_bias_act/triton.py.j2"}


def template_context(variant) -> dict:
    return {"dtype": variant.dtype, "activations": ACTIVATIONS, **variant.params}


def triton_aot(variant, mod) -> list[tuple[Any, dict, dict]]:
    """What `kgen build` compiles ahead of time for a Triton variant: one representative
    specialisation (gelu, with y), enough to check the code and report its resources."""
    t = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[variant.dtype]
    sig = {"x_ptr": f"*{t}", "y_ptr": f"*{t}", "bias_ptr": f"*{t}", "out_ptr": f"*{t}", "alpha": "fp32"}
    const = {"ACT": _ACT_CODE["gelu"], "HAS_Y": True, "BLOCK_COLS": mod.BLOCK_COLS}
    if mod.ORDER == "flat":  # n and cols in 32 bits, multiples of 16 (the typical call)
        sig.update({"n": "i32", "cols": "i32", "ACT": "constexpr", "HAS_Y": "constexpr",
                    "BLOCK_COLS": "constexpr", "WIDE": "constexpr", "EVEN": "constexpr"})
        return [(mod.fused_bias_act_kernel, sig, {**const, "WIDE": False, "EVEN": False}, {"num_warps": mod.NUM_WARPS},
                 ("n", "cols"))]
    sig.update({"rows": "i64", "cols": "i64", "ACT": "constexpr", "HAS_Y": "constexpr", "BLOCK_COLS": "constexpr",
                "ROWS": "constexpr"})
    return [(mod.fused_bias_act_kernel, sig, {**const, "ROWS": mod.ROWS}, {"num_warps": mod.NUM_WARPS})]


# --------------------------------------------------------------------------- reference math


def _act(z: torch.Tensor, act: str) -> torch.Tensor:
    if act == "relu":
        return torch.relu(z)
    if act == "sigmoid":
        return torch.sigmoid(z)
    if act == "gelu":
        return torch.nn.functional.gelu(z, approximate="tanh")
    if act == "silu":
        return torch.nn.functional.silu(z)
    return z


def _dact(z: torch.Tensor, act: str) -> torch.Tensor:
    """d act(z) / dz."""
    if act == "relu":
        return (z > 0).to(z.dtype)
    if act == "sigmoid":
        s = torch.sigmoid(z)
        return s * (1 - s)
    if act == "gelu":
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        s = torch.sigmoid(2 * k * (z + c * z**3))
        return s + z * 2 * s * (1 - s) * k * (1 + 3 * c * z * z)
    if act == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    return torch.ones_like(z)


def _preact(x, bias, y, alpha, dtype):
    z = x.to(dtype) + bias.to(dtype)
    if y is not None:
        z = z + alpha * y.to(dtype)
    return z


def reference(x, bias, y=None, alpha: float = 1.0, act: str = "none", compute=torch.float32):
    """The math in `compute` precision (float32: the CPU path; float64: the test oracle)."""
    return _act(_preact(x, bias, y, alpha, compute), act)


# --------------------------------------------------------------------------- input checks


def _check(x, bias, y, alpha, act, inplace: bool) -> None:
    """Everything that would make a launch wrong or unsafe raises here, before any launch.

    One combined test on the common path (it runs on every call, so it is kept cheap), and
    the detailed walk through `_explain` only to word the error.
    """
    try:
        dt, xs, xd = x.dtype, x.shape, x.device
        if (dt in _TORCH_DTYPES and bias.dtype is dt and act in _ACT_CODE and type(alpha) in (float, int)
                and len(xs) >= 1 and bias.shape == xs[-1:] and bias.device == xd
                and (y is None or (y.dtype is dt and y.shape == xs and y.device == xd))
                and (not inplace or x.is_contiguous())):
            return
    except (AttributeError, TypeError):
        pass
    _explain(x, bias, y, alpha, act, inplace)


def _explain(x, bias, y, alpha, act, inplace: bool) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(bias, torch.Tensor):
        raise TypeError("fused_bias_act: x and bias must be tensors")
    if x.dtype not in _TORCH_DTYPES:
        raise TypeError(f"fused_bias_act: x has dtype {x.dtype}; supported: float32, bfloat16, float16")
    if bias.dtype != x.dtype:
        raise TypeError(f"fused_bias_act: bias dtype {bias.dtype} differs from x dtype {x.dtype}")
    if act not in _ACT_CODE:
        raise ValueError(f"fused_bias_act: unknown act {act!r}; expected one of {', '.join(ACTIVATIONS)}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise TypeError(f"fused_bias_act: alpha must be a float, got {type(alpha).__name__}")
    if x.dim() < 1:
        raise ValueError("fused_bias_act: x must have at least one dimension (its last is cols)")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"fused_bias_act: bias has shape {tuple(bias.shape)}; expected ({x.shape[-1]},), "
                         "the length of x's last dimension")
    if bias.device != x.device:
        raise ValueError(f"fused_bias_act: bias is on {bias.device}, x on {x.device}")
    if y is not None:
        if not isinstance(y, torch.Tensor):
            raise TypeError("fused_bias_act: y must be a tensor or None")
        if y.dtype != x.dtype:
            raise TypeError(f"fused_bias_act: y dtype {y.dtype} differs from x dtype {x.dtype}")
        if y.shape != x.shape:
            raise ValueError(f"fused_bias_act: y has shape {tuple(y.shape)}, x {tuple(x.shape)}; they must match")
        if y.device != x.device:
            raise ValueError(f"fused_bias_act: y is on {y.device}, x on {x.device}")
    if inplace and not x.is_contiguous():
        raise ValueError("fused_bias_act: in place needs a contiguous x; call x.contiguous() "
                         "or use the out-of-place form")
    raise TypeError(f"fused_bias_act: invalid arguments (x {type(x).__name__}, bias {type(bias).__name__}, "
                    f"y {type(y).__name__}, alpha {alpha!r}, act {act!r})")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when b shares memory with a without being exactly a (unsafe to read while a is written)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return not (b.data_ptr() == a.data_ptr() and b.shape == a.shape and b.stride() == a.stride())


# --------------------------------------------------------------------------- launch


def _kernel(device: torch.device, dtype: torch.dtype, rows: int = 1, cols: int = 1, has_y: bool = True):
    """The loaded variant for (device, dtype) and the shape's bucket, chosen (tuning table,
    else spec order) and built on the first call, then cached for the process (None: the
    reference runs)."""
    key = _key(device.index, dtype, rows, cols, has_y)
    kernel = _KERNELS.lookup(key)
    if kernel is MISSING:
        kernel = _KERNELS.choose(key, device, dtype, {"rows": rows, "cols": cols, "has_y": has_y})
    return kernel


def _key(dev: int, dtype, rows: int, cols: int, has_y: bool) -> tuple:
    """The per-call cache key: the same classes as tune_bucket, as cheap integers."""
    return dev, dtype, (rows - 1).bit_length(), (cols - 1).bit_length(), cols % 8 == 0, has_y


# --------------------------------------------------------------------------- tuning

# Buckets: rows and columns each rounded up to a power of two, whether a row holds whole
# 16-byte vectors of 16-bit elements (cols % 8 == 0; the CUDA kernels' vector path), and
# whether y is read (3 streams of memory instead of 2). act is not in the bucket: every
# variant computes it in registers while memory is the bound, so it does not change which
# variant wins.
TUNE_DIMS = ("rows", "cols")
TUNE_VARIATIONS = ({"has_y": True}, {"has_y": False})  # what `kgen tune --shapes` adds to each shape
# Default shapes for `kgen tune`: rows from 1 to 32768, 16-byte-vector and tail widths from
# ~1000 to ~800000, at most 2^27 elements; buckets between them take the nearest one's winner
# where it won by a margin (tune.transfers), else spec order. 5000 fills the cols <= 8192
# vec16 buckets, which spec order served at 6000 x 5000 (bf16 no y: 0.947 of the fastest,
# H100, BENCHMARKS.md twelfth session); the shipped tables have them from the next re-tune.
TUNE_SHAPES = tuple({"rows": r, "cols": c, "has_y": y}
                    for r in (1, 8, 64, 512, 2048, 4096, 8192, 16384, 32768)
                    for c in (1001, 1024, 4096, 5000, 12288, 12345, 65536, 786432) if r * c <= 1 << 27
                    for y in (True, False))


def tune_bucket(rows: int, cols: int, has_y: bool = True) -> str:
    r, c = (rows - 1).bit_length(), (cols - 1).bit_length()
    return f"rows<={1 << r}.cols<={1 << c}.{'vec16' if cols % 8 == 0 else 'tail'}.{'y' if has_y else 'no-y'}"


_KERNELS = Kernels("fused_bias_act", tune_bucket)


def tune_inputs(device, dtype: str, rows: int, cols: int, has_y: bool = True) -> dict:
    t = next(k for k, n in _TORCH_DTYPES.items() if n == dtype)
    x = torch.randn(rows, cols, device=device, dtype=t)
    return {"x": x, "bias": torch.randn(cols, device=device, dtype=t),
            "y": torch.randn_like(x) if has_y else None, "out": torch.empty_like(x)}


def tune_runner(kernel, inputs: dict):
    """One gelu launch of `kernel` (None: the reference) into the scratch output."""
    x, bias, y, out = inputs["x"], inputs["bias"], inputs["y"], inputs["out"]
    if kernel is None:
        return lambda: out.copy_(reference(x, bias, y, 0.5, "gelu"))
    return lambda: launch(kernel, x, bias, y, 0.5, "gelu", out)


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
        elif cols > _MAX_GRID_Y * threads:
            raise ValueError(f"fused_bias_act: {cols} columns exceed the CUDA grid of variant "
                             f"{kernel.name} (at most {_MAX_GRID_Y * kernel.params['threads']})")
        dev = x.get_device()
        rc = kernel.raw(kernel.ptr, dev, _ACT_CODE[act], has_y, x.data_ptr(), y.data_ptr() if has_y else 0,
                        bias.data_ptr(), out.data_ptr(), rows, cols, _raw_stream(dev), float(alpha), 1.0 / cols)
        if rc:
            kernel.fail(rc)
    else:
        _triton(kernel, x, bias, y, alpha, act, out, rows, cols)


# Bound Triton launches (triton_launch.bind) per (variant module, rows, cols, y or not, act)
# for calls whose four pointers are 16-byte aligned: a repeated call passes its pointers and
# alpha, skipping the per-launch specialisation key (~20 us a launch on a slow H100 host,
# BENCHMARKS.md fourteenth session). The module is kept in the value, so its id is not reused.
_BOUND: dict = {}
_BOUND_ENTRIES = 4096


def _triton(kernel, x, bias, y, alpha: float, act: str, out, rows: int, cols: int) -> None:
    mod = kernel.module
    has_y = y is not None
    ptrs = [x.data_ptr(), y.data_ptr() if has_y else x.data_ptr(), bias.data_ptr(), out.data_ptr()]
    key = (id(mod), rows, cols, has_y, act) if not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15 else None
    bound = _BOUND.get(key) if key is not None else None
    if bound is not None and bound[1](bound[2], [*ptrs, float(alpha)], bound[3]):
        return
    if mod.ORDER == "flat":
        n = rows * cols
        wide = n + mod.BLOCK_COLS > 2**31 - 1  # the last program's offsets in 32 bits
        if triton_cdiv(n, mod.BLOCK_COLS) > 2**31 - 1:
            raise ValueError(f"fused_bias_act: {rows} x {cols} exceeds the grid of variant {kernel.name}")
        grid = (triton_cdiv(n, mod.BLOCK_COLS),)
        args = (x, y if has_y else x, bias, out, alpha, n, cols)
        kw = dict(ACT=_ACT_CODE[act], HAS_Y=has_y, BLOCK_COLS=mod.BLOCK_COLS, WIDE=wide,
                  EVEN=n % mod.BLOCK_COLS == 0, num_warps=mod.NUM_WARPS)
    else:
        grid = (triton_cdiv(rows, mod.ROWS), triton_cdiv(cols, mod.BLOCK_COLS))
        if grid[1] > _MAX_GRID_Y:
            raise ValueError(f"fused_bias_act: {cols} columns exceed the grid of variant {kernel.name}")
        args = (x, y if has_y else x, bias, out, alpha, rows, cols)
        kw = dict(ACT=_ACT_CODE[act], HAS_Y=has_y, BLOCK_COLS=mod.BLOCK_COLS, ROWS=mod.ROWS,
                  num_warps=mod.NUM_WARPS)
    # (kgen.runtime.triton_launch: Triton's own launch the first time per specialisation,
    # its compiled launcher directly after that)
    triton_launch.launch(mod.fused_bias_act_kernel, grid, args, kw)
    if key is not None and bound is None:
        go = triton_launch.bind(mod.fused_bias_act_kernel, args, kw, 5)  # the pointers and alpha vary
        if go is not None:
            if len(_BOUND) >= _BOUND_ENTRIES:
                _BOUND.clear()
            _BOUND[key] = (mod, go, grid[0], grid[1] if len(grid) > 1 else 1)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _forward(x, bias, y, alpha: float, act: str, inplace: bool):
    """The op's implementation (eager fast path and the registered op alike). It runs on
    every call, so it reads each tensor attribute once and calls as little as it can."""
    _check(x, bias, y, alpha, act, inplace)
    if inplace:
        if _overlaps(x, bias) or (y is not None and _overlaps(x, y)):
            raise ValueError("fused_bias_act: in place, bias and y must not partially overlap x")
        out = x
    else:
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty_like(x)
    if not bias.is_contiguous():
        bias = bias.contiguous()
    if y is not None and not y.is_contiguous():
        y = y.contiguous()
    dev = x.get_device()  # -1 for CPU tensors
    kernel = None
    if dev >= 0:
        cols = x.shape[-1]
        rows = x.numel() // cols if cols else 0
        kernel = _KERNELS.lookup(_key(dev, x.dtype, rows, cols, y is not None))
        if kernel is MISSING:
            kernel = _kernel(x.device, x.dtype, rows, cols, y is not None)
    if kernel is None:  # CPU tensors, or no GPU variant could be built: the reference
        return out.copy_(reference(x, bias, y, alpha, act)) if x.numel() else out
    launch(kernel, x, bias, y, alpha, act, out)
    return out


# --------------------------------------------------------------------------- torch.library


def _op_impl(x: torch.Tensor, bias: torch.Tensor, y: Optional[torch.Tensor], alpha: float, act: str) -> torch.Tensor:
    return _forward(x, bias, y, alpha, act, False)


def _op_fake(x, bias, y, alpha, act):
    _check(x, bias, y, alpha, act, False)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _op_inplace_impl(x: torch.Tensor, bias: torch.Tensor, y: Optional[torch.Tensor], alpha: float, act: str) -> None:
    _forward(x, bias, y, alpha, act, True)


def _op_inplace_fake(x, bias, y, alpha, act):
    _check(x, bias, y, alpha, act, True)


def _setup_context(ctx, inputs, output):
    x, bias, y, alpha, act = inputs
    ctx.save_for_backward(x, bias, y)
    ctx.alpha, ctx.act = alpha, act


def _backward(ctx, grad):
    x, bias, y = ctx.saved_tensors
    # Recompute z in float32 (the saved inputs are all we keep) and form dz = g * act'(z).
    z = _preact(x, bias, y, ctx.alpha, torch.float32)
    dz = grad.to(torch.float32) * _dact(z, ctx.act)
    grad_x = dz.to(x.dtype) if ctx.needs_input_grad[0] else None
    grad_bias = dz.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype) if ctx.needs_input_grad[1] else None
    grad_y = (ctx.alpha * dz).to(y.dtype) if y is not None and ctx.needs_input_grad[2] else None
    return grad_x, grad_bias, grad_y, None, None


# torch.ops.kgen.fused_bias_act (differentiable) and torch.ops.kgen.fused_bias_act_ (in place)
_op = define("fused_bias_act", _op_impl, fake=_op_fake, backward=_backward, setup_context=_setup_context)
_op_inplace = define("fused_bias_act_", _op_inplace_impl, fake=_op_inplace_fake, mutates_args=("x",))


def _as_float(alpha) -> float:
    """Any real scalar (int, numpy float, 0-d CPU tensor) as a Python float; not bool or str."""
    import numbers

    if isinstance(alpha, torch.Tensor) and alpha.dim() == 0 and not alpha.is_cuda:
        alpha = alpha.item()
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"fused_bias_act: alpha must be a float, got {type(alpha).__name__}")
    return float(alpha)


def fused_bias_act(x: torch.Tensor, bias: torch.Tensor, y: Optional[torch.Tensor] = None, *,
                   alpha: float = 1.0, act: str = "none", inplace: bool = False) -> torch.Tensor:
    """out = act(x + alpha * y + bias), bias broadcast along x's last dimension.

    act is one of none, relu, sigmoid, gelu (tanh form), silu; arithmetic runs in float32
    and the result has x's dtype. `inplace=True` writes into x and returns it (not
    differentiable: raises if a gradient is needed). Differentiable for x, y and bias.
    On CUDA tensors the best kernel variant for the device and dtype runs on the current
    stream; CPU tensors use the float32 PyTorch reference. Also `torch.ops.kgen.fused_bias_act`.
    """
    if type(alpha) is not float:
        alpha = _as_float(alpha)
    if inplace:
        if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (x, bias, y)):
            raise ValueError("fused_bias_act: inplace=True is not differentiable; use the "
                             "out-of-place form when a gradient is needed")
        _op_inplace(x, bias, y, alpha, act)
        return x
    return _op(x, bias, y, alpha, act)


OPS = {"fused_bias_act": fused_bias_act}


# --------------------------------------------------------------------------- golden numerics

# (rows, cols, storage offset in elements): sizes that are not multiples of any tile, a
# width that takes the 16-byte path (4104 = 8 * 513), one misaligned by one element, and
# 64 x 96 = 3 x 2048 elements (the Triton flat kernels' unmasked path, EVEN).
GOLDEN_SHAPES = ((1, 1, 0), (7, 33, 0), (5, 1000, 0), (33, 4104, 0), (3, 4104, 1), (64, 96, 0))


def golden(kernel, device, dtype: str, tol) -> list[tuple[str, float]]:
    """Run one loaded variant over GOLDEN_SHAPES x activations x (with/without y, in place)
    on fresh random inputs with a poisoned output; return (case, worst error / tolerance)."""
    tdtype = next(t for t, n in _TORCH_DTYPES.items() if n == dtype)
    results = []
    for rows, cols, offset in GOLDEN_SHAPES:
        for act in ACTIVATIONS:
            for has_y, inplace in ((True, False), (False, False), (True, True)):
                def rand(*shape):
                    flat = torch.randn(offset + math.prod(shape), device=device) * 2
                    return flat[offset:].view(shape).to(tdtype)

                x, bias = rand(rows, cols), rand(cols)
                y = rand(rows, cols) if has_y else None
                alpha = 0.75
                ref = reference(x, bias, y, alpha, act, compute=torch.float64)
                if inplace:
                    out = x.clone()
                    launch(kernel, out, bias, y, alpha, act, out)
                else:
                    out = torch.full_like(x, float("nan"))  # poison: every element must be written
                    launch(kernel, x, bias, y, alpha, act, out)
                err = (out.double() - ref).abs() / (tol.atol + tol.rtol * ref.abs())
                worst = float(err.max()) if not torch.isnan(err).any() else float("inf")
                label = f"{rows}x{cols}{'+1' if offset else ''} {act}{' y' if has_y else ''}{' inplace' if inplace else ''}"
                results.append((label, worst))
    return results
