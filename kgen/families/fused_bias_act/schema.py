"""fused_bias_act's knobs, the rules a variant must keep, its template context and what
`kgen build` compiles ahead of time."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from kgen.spec import DTYPES, Knob, Schema


ACTIVATIONS = ("none", "relu", "sigmoid", "gelu", "silu")
ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The CUDA grid of order "down" puts column blocks on grid.y, whose limit is 65535.
MAX_GRID_Y = 65535


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
    dtypes=tuple(TORCH_DTYPES.values()),
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
    const = {"ACT": ACT_CODE["gelu"], "HAS_Y": True, "BLOCK_COLS": mod.BLOCK_COLS}
    if mod.ORDER == "flat":  # n and cols in 32 bits, multiples of 16 (the typical call)
        sig.update({"n": "i32", "cols": "i32", "ACT": "constexpr", "HAS_Y": "constexpr",
                    "BLOCK_COLS": "constexpr", "WIDE": "constexpr", "EVEN": "constexpr"})
        return [(mod.fused_bias_act_kernel, sig, {**const, "WIDE": False, "EVEN": False}, {"num_warps": mod.NUM_WARPS},
                 ("n", "cols"))]
    sig.update({"rows": "i64", "cols": "i64", "ACT": "constexpr", "HAS_Y": "constexpr", "BLOCK_COLS": "constexpr",
                "ROWS": "constexpr", "CA": "constexpr"})
    return [(mod.fused_bias_act_kernel, sig, {**const, "ROWS": mod.ROWS, "CA": 16}, {"num_warps": mod.NUM_WARPS})]
