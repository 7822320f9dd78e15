"""Compile fused_mlp's fused backward ahead of time for sm_90 (no GPU needed) and print each
kernel's registers, shared memory and local memory (spills, stack), as the launches of a
fused_backward.Plan would run them: DLRM's top (367-512-256-1) and bottom (13-512-256-64-16)
MLPs, B in {128, 2048, 16384, 65536} (each picks its own tiles), bfloat16 and float32 with
TF32 off ("tf32x3") and on. The numbers behind fused_backward's tile tables.

    python tools/fused_mlp_bwd_aot.py [--mlp top] [--dtype bfloat16] [--B 65536] [--tf32]
                                      [--option fused_m32_pad] [--json]

--option: one of the fused options the tuner chooses among (fused_mlp.tuning.BACKWARDS but
"lean"; default "fused": the shipped chain tiles, no padded copies).

Run in a process that does not interpret Triton (TRITON_INTERPRET unset); PYTHONPATH = the
repo root. --json prints one JSON object per kernel (tests/test_fused_mlp_backward.py reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

MLPS = {"top": ((367, 512, 256, 1), ("relu", "sigmoid")), "bottom": ((13, 512, 256, 64, 16), ("relu", "relu"))}
TRITON_TYPE = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
OPTIONS = ("num_warps", "num_stages")


def compile_plan(widths, acts, dtype, B, sms=132, option="fused") -> list[dict]:
    """Every launch of the plan for (widths, dtype, B, the tuned option), all gradients,
    compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kgen import config
    from kgen.families.fused_mlp import fused_backward as fb
    from kgen.families.fused_mlp import tuning
    from kgen.runtime import build, toolchain

    config.pin_triton_defaults()
    fb.sm_count = lambda device, off_gpu: sms  # the split as on an H100 (132 SMs)
    L = len(widths) - 1
    plan = fb.plan(widths, dtype, torch.device("cuda", 0), B, (True,) * L, acts, (True,) * (1 + 2 * L),
                   *tuning.fused_option(option))
    # CPU tensors stand in for the arguments (only dtypes and shapes are read)
    x = torch.empty(B, widths[0], dtype=dtype)
    ws = [torch.empty(widths[i + 1], widths[i], dtype=dtype) for i in range(L)]
    zs = [torch.empty(B, widths[i + 1], dtype=dtype) if i < L - 1 or acts[1] != "none" else None for i in range(L)]
    bufs = (torch.empty(plan.dz_numel, dtype=dtype), torch.empty(plan.E, dtype=dtype),
            torch.empty(plan.S * plan.E) if plan.S > 1 else None, torch.empty(B, widths[0], dtype=dtype))
    rows, tmp = [], Path(tempfile.mkdtemp())
    for fn, grid, args, kw in plan.launches(torch.empty(B, widths[-1], dtype=dtype), x, ws, zs, *bufs):
        sig = {n: TRITON_TYPE[a.dtype] if isinstance(a, torch.Tensor) else "i32" for n, a in zip(fn.arg_names, args)}
        const = {k: v for k, v in kw.items() if k not in OPTIONS}
        sig.update({k: "constexpr" for k in const})
        opts = {k: v for k, v in kw.items() if k in OPTIONS}
        c = triton.compile(ASTSource(fn, sig, const, build._divisibility(fn, sig)), target=GPUTarget("cuda", 90, 32),
                           options=opts)
        (tmp / "k.cubin").write_bytes(c.asm["cubin"])
        (usage,) = toolchain.resource_usage(tmp / "k.cubin").values()
        rows.append({"kernel": fn.__name__, "option": option, "grid": list(grid), "S": plan.S,
                     "precision": kw.get("PRECISION"), **usage, "shared": int(c.metadata.shared)})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mlp", choices=list(MLPS), action="append")
    ap.add_argument("--dtype", action="append")
    ap.add_argument("--B", type=int, action="append")
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--option", default="fused")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter cannot compile ahead of time")
    from kgen.families.fused_mlp.tuning import FUSED_OPTIONS

    if a.option not in FUSED_OPTIONS:
        raise SystemExit(f"--option {a.option!r}: one of {', '.join(FUSED_OPTIONS)}")
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    if not a.json:
        print("| MLP | dtype | B | kernel | grid | S | registers | shared B | local B | stack B |")
        print("|---|---|---:|---|---|---:|---:|---:|---:|---:|")
    for mlp in a.mlp or list(MLPS):
        widths, acts = MLPS[mlp]
        for dname in a.dtype or ["bfloat16", "float32"]:
            for B in a.B or [128, 2048, 16384, 65536]:
                for r in compile_plan(widths, acts, getattr(torch, dname), B, option=a.option):
                    r = {"mlp": mlp, "dtype": dname, "B": B, **r}
                    if a.json:
                        print(json.dumps(r), flush=True)
                    else:
                        print(f"| {mlp} | {dname}{' tf32' if a.tf32 and dname == 'float32' else ''} | {B} | "
                              f"{r['kernel']} | {r['grid']} | {r['S']} | {r['registers']} | {r['shared']} | "
                              f"{r['local']} | {r['stack']} |", flush=True)


if __name__ == "__main__":
    main()
