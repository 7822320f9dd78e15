"""linear_logp's knobs, the rules a variant must obey (instruction shapes, registers,
shared memory), the template context, and what `kgen build` compiles ahead of time."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from kgen.families.linear_logp.plans import GROUP, KEPT_DZ_BLOCK, KEPT_FWD_BLOCK, _precision, _target_in_tile
from kgen.spec import DTYPES, Knob, Schema

# Opt-in shared memory per block (bytes) by arch; the pipelined tiles must fit.
_SMEM_LIMIT = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_90a": 232448}
# Shared memory the CUDA kernels keep beside the tile ring: 1024 B of slack to align the
# ring for the 128-byte swizzle, and up to 1024 B of static data (mbarriers, merge
# scratch); the sm_90a kernel adds two bias tiles (4 * block_n bytes).
_CUDA_SMEM_EXTRA = 2048
# Vocabulary rows of one gemv group (cuda_gemv.cu.j2): a warp's mma.sync A operand, and the
# least a CTA of the gemv forward takes (cuda_variant.CudaForward.split_unit).
GEMV_GROUP = 16


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
    if k.get("kernel") == "gemv":  # per warp: its rows' final states (16 B) and sums of a shared group (64 B),
        warps = k["block_n"] // GEMV_GROUP  # and its ring of `ring` trips of 2 x stages x _gemv_pieces 16-byte pieces a lane
        return warps * (80 * k["block_m"] + k["ring"] * k["stages"] * _gemv_pieces(dtype, k) * 2 * 32 * 16)
    if arch == "sm_90a":  # a hidden ring, a weight ring of block_n / consumers rows per consumer, two bias tiles
        ring = (k["hidden_stages"] * k["block_m"] + k["stages"] * k["block_n"]) * k["block_k"] * size
        return ring + _CUDA_SMEM_EXTRA + 4 * k["block_n"]
    return k["stages"] * (k["block_m"] + k["block_n"]) * k["block_k"] * size + _CUDA_SMEM_EXTRA


# gemv: the most 32-bit registers the weight a warp keeps in flight may take per thread (two
# trips of stages x _gemv_pieces 16-byte pieces of 2 rows)
_GEMV_WEIGHT_REGS = 64


def _gemv_pieces(dtype: str, k: Mapping[str, Any]) -> int:
    """16-byte loads a lane makes of a weight row per step of block_k columns (a piece: 4 lanes'
    loads, 64 bytes of the row)."""
    return k["block_k"] * DTYPES[dtype][0] // 64


def _check_gemv(arch: str, dtype: str, k: Mapping[str, Any]):
    """The small-N kernel's rules (kgen/templates/linear_logp/cuda_gemv.cu.j2)."""
    problems = []
    if arch == "sm_90a":
        problems.append(("arch", "the gemv kernel uses no sm_90a instruction: build it for sm_80 / sm_90"))
    if k["block_m"] not in (8, 16):
        problems.append(("block_m", f"block_m={k['block_m']}: the gemv kernel takes N up to 8 or 16 rows (one or "
                                    "two 8-row MMA column groups; 32 needed a stack)"))
    if k["block_n"] % GEMV_GROUP:
        problems.append(("block_n", f"block_n={k['block_n']} must be a multiple of {GEMV_GROUP}: {GEMV_GROUP} "
                                    "vocabulary rows a warp"))
    if k["block_k"] * DTYPES[dtype][0] % 64:
        problems.append(("block_k", f"block_k={k['block_k']} {dtype} columns are not whole 64-byte pieces (4 lanes' "
                                    "16-byte loads)"))
    regs = (1 if k["ring"] else 2) * k["stages"] * max(_gemv_pieces(dtype, k), 1) * 8
    if regs > _GEMV_WEIGHT_REGS:
        problems.append(("stages", f"{k['stages']} steps of {k['block_k']} columns in flight take {regs} registers "
                                   f"a thread with the trip computing, above {_GEMV_WEIGHT_REGS}"))
    for name, want in (("consumers", 1), ("cluster", 1), ("hidden_stages", 0)):
        if k[name] != want:
            problems.append((name, f"{name}={k[name]}: the gemv kernel takes {want}"))
    smem = _cuda_smem(arch, dtype, k)
    if smem > _SMEM_LIMIT[arch]:
        problems.append(("ring", f"{k['ring']} trips of weight a warp need {smem} bytes of shared memory, above "
                                 f"{arch}'s {_SMEM_LIMIT[arch]}-byte limit"))
    return problems


def _check_cuda(arch: str, dtype: str, k: Mapping[str, Any]):
    """The instruction-shape and shared-memory rules of the CUDA templates."""
    problems = []
    if k["kernel"] == "gemv":  # (any dtype: float32 on TF32 mma.sync, 1 or 3 products)
        return problems + _check_gemv(arch, dtype, k)
    if dtype not in ("bfloat16", "float16"):
        problems.append(("dtypes", f"the tiled CUDA kernels take 16-bit operands (bfloat16, float16), not {dtype}; "
                                   "float32 inputs use the Triton variants or the gemv kernel"))
    bm, bn, bk, c = k["block_m"], k["block_n"], k["block_k"], k["consumers"]
    if k["ring"]:
        problems.append(("ring", "ring is a gemv knob: the tiled kernels have their own rings (stages)"))
    if k["stages"] < 2:
        problems.append(("stages", f"stages={k['stages']}: the tiled kernels' rings need at least 2"))
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
            # which kernel: the tiled GEMM with the softmax in its epilogue (sm_90a WGMMA or
            # mma.sync by arch), or the small-N streaming kernel (cuda_gemv.cu.j2); the default
            # stays out of names
            Knob("kernel", "", kind=str, choices=("tile", "gemv"), default="tile"),
            # rows of hidden per CTA (gemv: the most rows N it takes)
            Knob("block_m", "m", lo=8, hi=256, pow2=True),
            # vocabulary tile, the MMA's N (gemv: vocabulary rows per pass, 16 a warp)
            Knob("block_n", "n", lo=8, hi=256),
            Knob("block_k", "k", lo=32, hi=128, pow2=True),  # reduction step over D
            # shared-memory ring depth (sm_90a: of each consumer's weight ring; gemv: steps of
            # block_k a warp loads one trip ahead into registers)
            Knob("stages", "s", lo=1, hi=8),
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
            # gemv: trips of weight each warp keeps in flight through a cp.async ring in shared
            # memory (0: one trip ahead in registers); the default stays out of names
            Knob("ring", "r", lo=0, hi=8, default=0),
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
# cuda.cu.j2 includes cuda_gemv.cu.j2 (kernel: gemv), cuda_sm90a.cu.j2 or cuda_sm80.cu.j2
TEMPLATES = {"triton": "linear_logp/triton.py.j2", "cuda": "linear_logp/cuda.cu.j2"}


def max_rows(params: Mapping[str, Any]) -> int | None:
    """The most rows of hidden a variant's own forward takes: block_m for the gemv kernel
    (one CTA covers all rows), None (any) for the others."""
    return params["block_m"] if params.get("kernel") == "gemv" else None


def variant_fits(variant, shape: Mapping[str, Any]) -> bool:
    """Whether `variant` can run a forward of `shape` ({"N", "D", "V"}) itself (`max_rows`):
    dispatch takes the bucket's runner-up instead of letting the variant hand the call to
    its Triton companion."""
    m = max_rows(variant.params)
    return m is None or shape["N"] <= m


def template_context(variant) -> dict:
    p = variant.params
    if variant.backend == "cuda" and p["kernel"] == "gemv":
        return {"dtype": variant.dtype, "KERNEL": "gemv", "MAX_N": p["block_m"], "WARPS": p["block_n"] // GEMV_GROUP,
                "STEP": p["block_k"], "UNROLL": p["stages"], "RING": p["ring"]}
    if variant.backend == "cuda":
        return {"dtype": variant.dtype, "KERNEL": "sm90a" if variant.arch == "sm_90a" else "sm80",
                "BM": p["block_m"], "BN": p["block_n"], "BK": p["block_k"],
                "STAGES": p["stages"], "CONSUMERS": p["consumers"], "SPLIT_V": p["split_v"],
                "CLUSTER": p["cluster"], "HSTAGES": p["hidden_stages"], "BNC": p["block_n"] // p["consumers"]}
    return {"BLOCK_N": p["block_n"], "BLOCK_V": p["block_v"], "BLOCK_D": p["block_d"],
            "NUM_WARPS": p["num_warps"], "NUM_STAGES": p["num_stages"], "SPLIT_V": p["split_v"]}


def triton_aot(variant, mod) -> list:
    """What `kgen build` compiles ahead of time: the forward kernel (bias, entropy) in the
    variant's dtype: the one whose speed matters most, enough to report its resources;
    keep_logits' two kernels; and float32's dH kernel."""
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
    opts = {"num_warps": mod.NUM_WARPS, "num_stages": mod.NUM_STAGES}
    out = [(mod.linear_logp_fwd_kernel, sig, const, opts), *_kept_aot(mod, t)]
    if variant.dtype == "float32":  # the backward's dH kernel, TF32 off (backward_launch._dh_triton)
        dh = {"dz_src": f"tensordesc<fp32[{mod.BLOCK_N}, {mod.BLOCK_D}]>",
              "wt_src": f"tensordesc<fp32[{mod.BLOCK_V}, {mod.BLOCK_D}]>", "acc_ptr": "*fp32",
              "N": "i32", "D": "i32", "width": "i32"}
        const = {"ACCUMULATE": True, "PRECISION": "tf32x3", "GROUP": GROUP,
                 "BLOCK_N": mod.BLOCK_N, "BLOCK_V": mod.BLOCK_V, "BLOCK_D": mod.BLOCK_D}
        out.append((mod.linear_logp_bwd_dh_kernel, {**dh, **dict.fromkeys(const, "constexpr")}, const, opts))
    return out


def _kept_aot(mod, t: str) -> list:
    """keep_logits' two kernels (kept.forward_kept / backward_kept: their own tiles, every
    option on), so that a build reports their resources too."""
    rows = {"b_ptr": f"*{t}", "t_ptr": "*i64"}
    fwd = {"z_ptr": "*fp32", **rows, "part_ptr": "*fp32", "N": "i32", "V": "i32", "splits": "i32", "scale": "fp32"}
    dz = {"z_ptr": "*fp32", **rows, **{k: "*fp32" for k in ("lse_ptr", "ez_ptr", "glogp_ptr", "gent_ptr")},
          "dz_ptr": f"*{t}", "bpart_ptr": "*fp32", "N": "i32", "V": "i32", "scale": "fp32", "inv_t": "fp32",
          "ignore_index": "i64"}
    out = []
    for fn, sig, flags, (block_n, block_v, warps) in (
            (mod.linear_logp_logits_fwd_kernel, fwd, ("HAS_BIAS", "WITH_ENTROPY"), KEPT_FWD_BLOCK),
            (mod.linear_logp_bwd_dz_logits_kernel, dz, ("HAS_BIAS", "WRITE_BPART", "WITH_ENTROPY", "HAS_GLOGP"),
             KEPT_DZ_BLOCK)):
        const = {**dict.fromkeys(flags, True), "BLOCK_N": block_n, "BLOCK_V": block_v}
        out.append((fn, {**sig, **dict.fromkeys(const, "constexpr")}, const, {"num_warps": warps}))
    return out
