"""linear_logp's knobs, the rules a variant must obey (instruction shapes, registers,
shared memory), the template context, and what `kgen build` compiles ahead of time."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from kgen.families.linear_logp.plans import _precision, _target_in_tile
from kgen.spec import DTYPES, Knob, Schema

# Opt-in shared memory per block (bytes) by arch; the pipelined tiles must fit.
_SMEM_LIMIT = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_90a": 232448}
# Shared memory the CUDA kernels keep beside the tile ring: 1024 B of slack to align the
# ring for the 128-byte swizzle, and up to 1024 B of static data (mbarriers, merge
# scratch); the sm_90a kernel adds two bias tiles (4 * block_n bytes).
_CUDA_SMEM_EXTRA = 2048


def _check_triton(dtype: str, k: Mapping[str, Any]):
    problems = []
    smem = k["num_stages"] * (k["block_n"] + k["block_v"]) * k["block_d"] * DTYPES[dtype][0]
    if smem > _SMEM_LIMIT["sm_90a"]:
        problems.append(("num_stages", f"{k['num_stages']} stages of ({k['block_n']} + {k['block_v']}) x "
                                       f"{k['block_d']} {dtype} tiles need {smem} bytes of shared memory, "
                                       f"above the {_SMEM_LIMIT['sm_90a']}-byte limit"))
    if k["block_d"] * DTYPES[dtype][0] > 128:
        problems.append(("block_d", f"{k['block_d']} {dtype} columns are {k['block_d'] * DTYPES[dtype][0]} bytes: "
                                    "a TMA box row must fit the 128-byte swizzle span"))
    return problems


def _cuda_smem(arch: str, dtype: str, k: Mapping[str, Any]) -> int:
    size = DTYPES[dtype][0]
    if arch == "sm_90a":  # a hidden ring, a weight ring of block_n / consumers rows per consumer, two bias tiles
        ring = (k["hidden_stages"] * k["block_m"] + k["stages"] * k["block_n"]) * k["block_k"] * size
        return ring + _CUDA_SMEM_EXTRA + 4 * k["block_n"]
    return k["stages"] * (k["block_m"] + k["block_n"]) * k["block_k"] * size + _CUDA_SMEM_EXTRA


def _check_cuda(arch: str, dtype: str, k: Mapping[str, Any]):
    """The instruction-shape and shared-memory rules of the two CUDA templates."""
    problems = []
    if dtype not in ("bfloat16", "float16"):
        problems.append(("dtypes", f"the CUDA kernels take 16-bit operands (bfloat16, float16), not {dtype}; "
                                   "float32 inputs use the Triton variants"))
    bm, bn, bk, c = k["block_m"], k["block_n"], k["block_k"], k["consumers"]
    if arch == "sm_90a":
        # WGMMA: M = 64, N a multiple of 8 up to 256, K = 16. Each consumer warpgroup owns all
        # block_m rows (block_m / 64 chains) and block_n / consumers columns; the 128-byte
        # swizzle span is 64 16-bit elements, which fixes BK (one TMA box per operand).
        bnc = bn // c
        if bm % 64:
            problems.append(("block_m", f"block_m={bm} must be a multiple of 64 (WGMMA M = 64 rows per chain)"))
        if bn % c or bnc % 8 or bnc > 256:
            problems.append(("block_n", f"block_n={bn} must split into {c} consumer share(s) of a multiple of 8 "
                                        "up to 256 columns (WGMMA N)"))
        elif bnc % (8 * k["cluster"]):
            problems.append(("cluster", f"block_n / consumers = {bnc} must split into {k['cluster']} multicast "
                                        "shares of whole 8-row swizzle atoms (a multiple of 8 x cluster)"))
        acc, layout = (bm // 64) * bnc // 2, f"{bm // 64} wgmma chain(s) of 64 x {bnc} per consumer"
        if bk != 64:
            problems.append(("block_k", f"block_k={bk} must be 64: one 128-byte swizzle span of 16-bit elements"))
        h = k["hidden_stages"]
        if h < 2:
            problems.append(("hidden_stages", f"hidden_stages={h}: the sm_90a kernel needs a hidden ring of at "
                                              "least 2 stages (with more than 3, its consumers run "
                                              "hidden_stages - 3 panels apart)"))
        if c > 1 and bm * 16 > k["stages"] * bnc * bk * 2:
            problems.append(("stages", f"consumer 0 hands its {bm} row states ({bm * 16} bytes) over in its weight "
                                       f"ring, which holds {k['stages'] * bnc * bk * 2}"))
    else:
        # mma.sync m16n8k16 with warps tiled 2 (M) x 2*consumers (N): each warp owns
        # block_m/2 rows and block_n/(2*consumers) columns, in 16 x 16 ldmatrix pieces.
        wn = 2 * c
        if k["hidden_stages"]:
            problems.append(("hidden_stages", "hidden_stages is an sm_90a knob: the mma.sync template has one "
                                              "ring of `stages`"))
        if k["cluster"] != 1:
            problems.append(("cluster", f"cluster={k['cluster']}: thread-block clusters (TMA multicast) are "
                                        "sm_90a only; the mma.sync template runs one CTA per cluster"))
        if bm % 32:
            problems.append(("block_m", f"block_m={bm} must be a multiple of 32 (2 warps of 16-row MMA tiles)"))
        if bn % (16 * wn):
            problems.append(("block_n", f"block_n={bn} must be a multiple of {16 * wn} "
                                        f"({wn} warps across N, 16 columns per ldmatrix)"))
        if bk % 32:
            problems.append(("block_k", f"block_k={bk} must be a multiple of 32 (two k16 MMA steps per 64-byte row chunk)"))
        acc, layout = (bm // 2) * (bn // wn) // 32, f"over {2 * wn} warps"
    if acc > 128:
        problems.append(("block_n", f"block_m={bm} x block_n={bn} ({layout}) needs {acc} float32 accumulators "
                                    "per thread (at most 128 fit beside the fold's registers)"))
    smem = _cuda_smem(arch, dtype, k)
    if smem > _SMEM_LIMIT[arch]:
        rings = (f"{k['hidden_stages']} hidden stages of {bm} x {bk} and {k['stages']} weight stages of {bn} x {bk}"
                 if arch == "sm_90a" else f"{k['stages']} stages of ({bm} + {bn}) x {bk}")
        problems.append(("stages", f"{rings} {dtype} tiles need {smem} bytes of shared memory, above {arch}'s "
                                   f"{_SMEM_LIMIT[arch]}-byte limit"))
    return problems


def _check_variant(backend: str, arch: str | None, dtype: str, k: Mapping[str, Any]):
    return _check_cuda(arch, dtype, k) if backend == "cuda" else _check_triton(dtype, k)


SCHEMA = Schema(
    dtypes=("bfloat16", "float16", "float32"),
    knobs={
        "cuda": (
            Knob("block_m", "m", lo=32, hi=256, pow2=True),  # rows of hidden per CTA
            Knob("block_n", "n", lo=8, hi=256),  # vocabulary tile (the MMA's N)
            Knob("block_k", "k", lo=32, hi=128, pow2=True),  # reduction step over D
            # shared-memory ring depth (sm_90a: of each consumer's weight ring)
            Knob("stages", "s", lo=2, hi=8),
            # sm_90a: consumer warpgroups beside one TMA producer warpgroup;
            # sm_80: warpgroups (4 warps) that all load and compute
            Knob("consumers", "c", lo=1, hi=2),
            # programs sharing one row block's V range at large N (raised at launch when
            # cdiv(N, block_m) * split_v would leave SMs idle)
            Knob("split_v", "sv", lo=1, hi=1024),
            # sm_90a: CTAs per cluster sharing each weight panel by TMA multicast
            Knob("cluster", "x", lo=1, hi=2, default=1),
            # sm_90a: stages of the hidden ring the consumers share (they lag one another by
            # hidden_stages - 3 panels); 0 for the mma.sync template, which has one ring
            Knob("hidden_stages", "h", lo=0, hi=16, default=0),
        ),
        "triton": (
            Knob("block_n", "n", lo=16, hi=256, pow2=True),  # rows of hidden per program
            Knob("block_v", "v", lo=16, hi=256, pow2=True),  # vocabulary tile
            Knob("block_d", "d", lo=16, hi=256, pow2=True),  # reduction step over D
            Knob("num_warps", "w", lo=1, hi=16, pow2=True),
            Knob("num_stages", "s", lo=1, hi=8),
            Knob("split_v", "sv", lo=1, hi=256),  # programs sharing one row block's V range
        ),
    },
    check=_check_variant,
)
_SM80_TEMPLATE = "linear_logp/cuda_sm80.cu.j2"
TEMPLATES = {
    "triton": "linear_logp/triton.py.j2",
    "cuda": {"sm_90a": "linear_logp/cuda_sm90a.cu.j2", "sm_80": _SM80_TEMPLATE, "sm_86": _SM80_TEMPLATE,
             "sm_89": _SM80_TEMPLATE, "sm_90": _SM80_TEMPLATE},
}


def template_context(variant) -> dict:
    p = variant.params
    if variant.backend == "cuda":
        return {"dtype": variant.dtype, "BM": p["block_m"], "BN": p["block_n"], "BK": p["block_k"],
                "STAGES": p["stages"], "CONSUMERS": p["consumers"], "SPLIT_V": p["split_v"],
                "CLUSTER": p["cluster"], "HSTAGES": p["hidden_stages"], "BNC": p["block_n"] // p["consumers"]}
    return {"BLOCK_N": p["block_n"], "BLOCK_V": p["block_v"], "BLOCK_D": p["block_d"],
            "NUM_WARPS": p["num_warps"], "NUM_STAGES": p["num_stages"], "SPLIT_V": p["split_v"]}


def triton_aot(variant, mod) -> list:
    """What `kgen build` compiles ahead of time: the forward kernel (bias, entropy) in the
    variant's dtype: the one whose speed matters most, enough to report its resources."""
    t = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[variant.dtype]
    tma = True  # every dtype loads its tiles through TMA (_tma) on sm_90+
    h_src, w_src = ((f"tensordesc<{t}[{mod.BLOCK_N}, {mod.BLOCK_D}]>", f"tensordesc<{t}[{mod.BLOCK_V}, {mod.BLOCK_D}]>")
                    if tma else (f"*{t}", f"*{t}"))
    sig = {"h_src": h_src, "w_src": w_src, "b_ptr": f"*{t}", "t_ptr": "*i64", "part_ptr": "*fp32",
           "N": "i32", "V": "i32", "D": "i32", "splits": "i32", "scale": "fp32"}
    prec = _precision(getattr(torch, variant.dtype))
    const = {"HAS_BIAS": True, "WITH_ENTROPY": True, "PRECISION": prec, "TMA": tma,
             "TARGET_IN_TILE": _target_in_tile(getattr(torch, variant.dtype), prec),
             "BLOCK_N": mod.BLOCK_N, "BLOCK_V": mod.BLOCK_V, "BLOCK_D": mod.BLOCK_D}
    sig.update({k: "constexpr" for k in const})
    return [(mod.linear_logp_fwd_kernel, sig, const,
             {"num_warps": mod.NUM_WARPS, "num_stages": mod.NUM_STAGES})]
