"""int8_gemm's knobs, the rules a variant must obey (instruction shapes, shared memory),
the template context, and what `kgen build` compiles ahead of time.

A variant's dtype is its A operand: `int8` variants serve int8_mm and int8_linear (int8 x
int8, int32 accumulation, the W8A8 epilogue in the same kernel); `bfloat16` / `float16`
variants serve w8a16_linear (16-bit x, int8 weight widened in registers, float32
accumulation). B is always int8 stored N x K.

CUDA variants are of three kernels (knob `kernel`): `mma` (the default, cuda_sm80.cu.j2: the
tiled cp.async + ldmatrix + mma.sync GEMM, int8 only), `wgmma` (cuda_sm90a.cu.j2, arch sm_90a,
int8 only: TMA + mbarrier ring, warp-specialised WGMMA s8 with K splits; block_m = 64 x the
consumer warpgroups = 64 x warps_m, warps_n = 1, block_k = 128 bytes a stage) and `gemv` (cuda_gemv.cu.j2: the
small-M streaming kernel for M <= 16, every dtype), which reads the shared knobs as:
block_m = the most rows of a / x it takes (16), block_n = weight rows per CTA (16-row groups
per warp x 16 x warps_n), block_k = k per step (64: 4 lanes x 16 bytes), stages = steps of
loads in flight per loop trip, warps_m = warps per row group on distinct K ranges of the same
rows (their sums added in warp order through shared memory at the end), ring = trips of
weight in flight per warp through a cp.async ring in shared memory (0: registers)."""

from __future__ import annotations

from typing import Any, Mapping

from kgen.spec import Knob, Schema

# Opt-in shared memory per block (bytes) by arch.
_SMEM_LIMIT = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_90a": 232448}


def _triton_smem(dtype: str, k: Mapping[str, Any]) -> int:
    a_size = 1 if dtype == "int8" else 2
    return k["num_stages"] * (k["block_m"] * a_size + k["block_n"]) * k["block_k"]


def cuda_smem(k: Mapping[str, Any]) -> int:
    """The sm_80 template's cp.async ring: `stages` x (block_m + block_n) rows of block_k bytes."""
    return k["stages"] * (k["block_m"] + k["block_n"]) * k["block_k"]


def gemv_row_groups(k: Mapping[str, Any]) -> int:
    """16-row groups per warp of a gemv variant."""
    return k["block_n"] // (16 * k["warps_n"])


def gemv_smem(k: Mapping[str, Any]) -> int:
    """Static shared memory of a gemv variant's 16-token instance: warps_m - 1 K-warps' sums of
    every row-group warp (16 x 16 values of 4 bytes a row group)."""
    return (k["warps_m"] - 1) * k["warps_n"] * gemv_row_groups(k) * 16 * 16 * 4


def gemv_ring_smem(k: Mapping[str, Any]) -> int:
    """Dynamic shared memory of a gemv variant: `ring` trips of every warp's 16-byte weight
    pieces (stages x row groups x 2 rows per lane)."""
    return k.get("ring", 0) * k["stages"] * gemv_row_groups(k) * 2 * 32 * 16 * k["warps_m"] * k["warps_n"]


def _check_gemv(arch: str | None, k: Mapping[str, Any]) -> list:
    problems = []
    if k["block_m"] != 16:
        problems.append(("block_m", f"block_m={k['block_m']}: the gemv kernel takes M <= 16 (two 8-token MMA "
                                    "column groups); larger M is the tiled kernels' work"))
    if k["block_k"] != 64:
        problems.append(("block_k", f"block_k={k['block_k']}: a gemv step is 64 k (4 lanes x 16 bytes of a row)"))
    rg = gemv_row_groups(k)
    if 32 * k["warps_m"] * k["warps_n"] > 512:
        problems.append(("warps_m", f"{k['warps_m']} x {k['warps_n']} warps: at most 16 per CTA"))
    elif gemv_smem(k) > 48 * 1024:
        problems.append(("warps_m", f"the K-warps' sums take {gemv_smem(k)} bytes of shared memory (at most 48 KB)"))
    if k["block_n"] % (16 * k["warps_n"]) or rg not in (1, 2, 4):
        problems.append(("block_n", f"block_n={k['block_n']} must be 16 x warps_n x (1, 2 or 4 row groups per "
                                    "warp)"))
    elif rg * k["stages"] > 8:
        problems.append(("stages", f"{k['stages']} steps x {rg} row groups: at most 8 in flight (registers)"))
    smem = gemv_smem(k) + gemv_ring_smem(k)
    if arch in _SMEM_LIMIT and smem > _SMEM_LIMIT[arch] - 1024:
        problems.append(("ring", f"a ring of {k['ring']} trips needs {smem} bytes of shared memory with the sums, "
                                 f"above {arch}'s {_SMEM_LIMIT[arch] - 1024}"))
    return problems


def wgmma_smem(k: Mapping[str, Any]) -> int:
    """Dynamic shared memory of a wgmma variant: `stages` x (block_m + block_n) rows of one
    128-byte K panel, plus 1 KB to align the ring for the 128-byte swizzle."""
    return k["stages"] * (k["block_m"] + k["block_n"]) * k["block_k"] + 1024


# Words between the rows of a consumer warp's 16-row buffer in the staged (N odd) epilogue of
# cuda_sm90a.cu.j2 (40: the threads' 8-byte writes meet distinct bank pairs a half-warp).
STAGE_OUT_STRIDE = 40


def wgmma_static_smem(k: Mapping[str, Any]) -> int:
    """Static shared memory of a wgmma variant's int8_linear kernels (the larger): a full and
    an empty mbarrier a stage, two buffers of the tile's scale_b and bias (float32) and a full
    and an empty mbarrier for each, and each consumer warp's 16-row buffer of the staged
    epilogue (N odd)."""
    return 16 * k["stages"] + 2 * 2 * 4 * k["block_n"] + 2 * 16 + (k["block_m"] // 16) * 16 * STAGE_OUT_STRIDE * 4


# Shared memory of an sm_90 SM (228 KB), and what the system reserves for each CTA (1 KB).
_SM90_SMEM_PER_SM, _SMEM_RESERVED = 233472, 1024


def wgmma_ctas_per_sm(k: Mapping[str, Any]) -> int:
    """CTAs of a wgmma variant an SM: 2 where two CTAs' shared memory fits on the SM and the
    accumulators (block_n / 2 registers a consumer thread) plus ~40 others fit under the
    register cap that two CTAs put on every thread (ptxas compiles the whole kernel under
    the launch bound's cap; setmaxnreg moves registers only at run time)."""
    threads = 128 * (k["block_m"] // 64 + 1)
    cap = 65536 // (2 * threads)
    cta = wgmma_smem(k) + wgmma_static_smem(k) + _SMEM_RESERVED
    return 2 if 2 * cta <= _SM90_SMEM_PER_SM and cap >= k["block_n"] // 2 + 40 else 1


def _check_wgmma(arch: str | None, dtype: str, k: Mapping[str, Any]) -> list:
    problems = []
    if arch != "sm_90a":
        problems.append(("arch", f"the wgmma kernel is Hopper's (arch sm_90a), not {arch}"))
    if dtype != "int8":
        problems.append(("dtypes", f"the wgmma kernel is int8 x int8 (int8_mm, int8_linear), not {dtype}"))
    if k["block_m"] not in (64, 128):
        problems.append(("block_m", f"block_m={k['block_m']}: one or two consumer warpgroups of 64 rows (64 or 128)"))
    if k["block_n"] % 16 or not 16 <= k["block_n"] <= 256:
        problems.append(("block_n", f"block_n={k['block_n']}: an int8 wgmma's N is 16..256 in steps of 16"))
    if k["block_k"] != 128:
        problems.append(("block_k", f"block_k={k['block_k']}: a stage is one 128-byte swizzle panel of K (128)"))
    if k["warps_m"] != k["block_m"] // 64 or k["warps_n"] != 1:
        problems.append(("warps_m", f"warps_m x warps_n = {k['warps_m']} x {k['warps_n']}: the consumer warpgroups "
                                    f"are block_m / 64 x 1 = {k['block_m'] // 64} x 1"))
    if k.get("ring", 0):
        problems.append(("ring", "ring is a knob of the gemv kernel (kernel: gemv)"))
    smem = wgmma_smem(k) + wgmma_static_smem(k)
    if smem > _SMEM_LIMIT["sm_90a"]:
        problems.append(("stages", f"{k['stages']} stages need {smem} bytes of shared memory, above "
                                   f"{_SMEM_LIMIT['sm_90a']}"))
    return problems


def _check_variant(backend: str, arch: str | None, dtype: str, k: Mapping[str, Any]):
    problems = []
    if backend == "cuda" and k["kernel"] == "gemv":
        return _check_gemv(arch, k)
    if backend == "cuda" and k["kernel"] == "wgmma":
        return _check_wgmma(arch, dtype, k)
    if backend == "cuda" and arch == "sm_90a":
        problems.append(("arch", "sm_90a is the wgmma kernel's (kernel: wgmma)"))
    if backend == "triton":
        # tl.dot needs K >= 16 per step; int8 MMAs take K = 32 per instruction.
        if dtype == "int8" and k["block_k"] < 32:
            problems.append(("block_k", f"block_k={k['block_k']}: int8 tensor-core steps are 32 deep"))
        smem = _triton_smem(dtype, k)
        if smem > _SMEM_LIMIT["sm_90a"]:
            problems.append(("num_stages", f"{k['num_stages']} stages of ({k['block_m']} + {k['block_n']}) x "
                                           f"{k['block_k']} tiles need {smem} bytes of shared memory"))
        return problems
    if k.get("ring", 0):
        problems.append(("ring", "ring is a knob of the gemv kernel (kernel: gemv)"))
    if dtype != "int8":
        problems.append(("dtypes", f"the CUDA kernels are int8 x int8 (int8_mm, int8_linear), not {dtype}; "
                                   "w8a16_linear uses the Triton variants"))
    # mma.sync m16n8k32 with warps tiled warps_m x warps_n: each warp owns
    # block_m / warps_m rows (16-row A fragments) and block_n / warps_n columns (8-column B
    # fragments, loaded 16 at a time); each row of a tile is block_k bytes of whole 16-byte chunks.
    wm, wn = k["warps_m"], k["warps_n"]
    if k["block_m"] % (16 * wm):
        problems.append(("block_m", f"block_m={k['block_m']} must be a multiple of {16 * wm} "
                                    f"({wm} warps of 16-row MMA tiles)"))
    if k["block_n"] % (16 * wn):
        problems.append(("block_n", f"block_n={k['block_n']} must be a multiple of {16 * wn} "
                                    f"({wn} warps of 16-column ldmatrix pieces)"))
    if k["block_k"] not in (32, 64, 128):
        problems.append(("block_k", f"block_k={k['block_k']} must be 32, 64 or 128 bytes "
                                    "(whole 16-byte chunks, at most one 128-byte swizzle line)"))
    acc = (k["block_m"] // wm) * (k["block_n"] // wn) // 32
    if acc > 128:
        problems.append(("block_n", f"{acc} int32 accumulators per thread (at most 128)"))
    threads = 32 * wm * wn
    if (k["block_m"] + k["block_n"]) * k["block_k"] // 16 % threads:
        problems.append(("block_k", f"a stage's {(k['block_m'] + k['block_n']) * k['block_k'] // 16} 16-byte "
                                    f"chunks do not split evenly over {threads} threads"))
    if cuda_smem(k) > _SMEM_LIMIT[arch]:
        problems.append(("stages", f"{k['stages']} stages need {cuda_smem(k)} bytes of shared memory, above "
                                   f"{arch}'s {_SMEM_LIMIT[arch]}"))
    return problems


SCHEMA = Schema(
    dtypes=("int8", "bfloat16", "float16"),
    knobs={
        "cuda": (
            # which kernel (kgen/templates/int8_gemm/cuda.cu.j2); the default stays out of names
            Knob("kernel", "", kind=str, choices=("mma", "gemv", "wgmma"), default="mma"),
            Knob("block_m", "m", lo=16, hi=256, pow2=True),
            Knob("block_n", "n", lo=16, hi=256, pow2=True),
            Knob("block_k", "k", lo=32, hi=128, pow2=True),  # bytes of K per stage
            Knob("stages", "s", lo=2, hi=8),
            Knob("warps_m", "wm", lo=1, hi=8, pow2=True),
            Knob("warps_n", "wn", lo=1, hi=8, pow2=True),
            # gemv only: trips of weight each warp keeps in flight through a cp.async ring in
            # shared memory (0: a register double buffer); the default stays out of names
            Knob("ring", "r", lo=0, hi=8, default=0),
        ),
        "triton": (
            Knob("block_m", "m", lo=16, hi=256, pow2=True),
            Knob("block_n", "n", lo=16, hi=256, pow2=True),
            Knob("block_k", "k", lo=16, hi=512, pow2=True),
            # the most K splits one call may use (chosen per call to fill the SMs; 1: none)
            Knob("split_k", "sk", lo=1, hi=64, default=1),
            Knob("num_warps", "w", lo=1, hi=16, pow2=True),
            Knob("num_stages", "s", lo=1, hi=8),
        ),
    },
    check=_check_variant,
    archs=("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"),
)
_CUDA = "int8_gemm/cuda.cu.j2"  # includes cuda_sm80.cu.j2 or cuda_gemv.cu.j2 by the `kernel` knob
TEMPLATES = {"triton": "int8_gemm/triton.py.j2",
             "cuda": {"sm_80": _CUDA, "sm_86": _CUDA, "sm_89": _CUDA, "sm_90": _CUDA, "sm_90a": _CUDA}}
# Storage codes of the CUDA launchers: 0 int32, 1 bf16, 2 fp16, 3 float32.
_DTYPE_CODE = {"bfloat16": 1, "float16": 2}


def template_context(variant) -> dict:
    p = variant.params
    if variant.backend == "cuda" and p["kernel"] == "gemv":
        int8 = variant.dtype == "int8"
        return {"KERNEL": "gemv", "INT8": int8, "WARPS": p["warps_n"], "KW": p["warps_m"], "RING": p["ring"],
                "RG": gemv_row_groups(p),
                "UNROLL": p["stages"], "ROWS": p["block_n"],
                "XTYPE": "" if int8 else {"bfloat16": "__nv_bfloat16", "float16": "__half"}[variant.dtype],
                "OUT_CODE": 0 if int8 else _DTYPE_CODE[variant.dtype]}
    if variant.backend == "cuda" and p["kernel"] == "wgmma":
        return {"KERNEL": "wgmma", "BM": p["block_m"], "BN": p["block_n"], "BK": p["block_k"], "STAGES": p["stages"],
                "CONSUMERS": p["block_m"] // 64, "CTAS_PER_SM": wgmma_ctas_per_sm(p),
                "STAGE_OUT_STRIDE": STAGE_OUT_STRIDE}
    if variant.backend == "cuda":
        return {"KERNEL": "mma", "BM": p["block_m"], "BN": p["block_n"], "BK": p["block_k"], "STAGES": p["stages"],
                "WARPS_M": p["warps_m"], "WARPS_N": p["warps_n"],
                "WM": p["block_m"] // p["warps_m"], "WN": p["block_n"] // p["warps_n"],
                "THREADS": 32 * p["warps_m"] * p["warps_n"], "SMEM": cuda_smem(p)}
    return {"BLOCK_M": p["block_m"], "BLOCK_N": p["block_n"], "BLOCK_K": p["block_k"], "SPLIT_K": p["split_k"],
            "NUM_WARPS": p["num_warps"], "NUM_STAGES": p["num_stages"]}


def triton_aot(variant, mod) -> list:
    """What `kgen build` compiles ahead of time: the GEMM in its main mode (int8: the W8A8
    epilogue with bias into bf16; 16-bit: W8A16 per channel), K a multiple of BLOCK_K."""
    int8 = variant.dtype == "int8"
    t = {"int8": "i8", "bfloat16": "bf16", "float16": "fp16"}[variant.dtype]
    out = "bf16" if int8 else t
    sig = {"a_ptr": f"*{t}", "b_ptr": "*i8", "out_ptr": f"*{out}", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
           "bias_ptr": f"*{out}", "M": "i32", "N": "i32", "K": "i32", "k_split": "i32", "n_groups": "i32"}
    const = {"MODE": 1 if int8 else 2, "PARTIAL": False, "HAS_BIAS": True, "GROUP": 0, "EVEN_K": True,
             "BLOCK_M": mod.BLOCK_M, "BLOCK_N": mod.BLOCK_N, "BLOCK_K": mod.BLOCK_K, "GROUP_M": mod.GROUP_M, "KA": 16}
    sig.update({k: "constexpr" for k in const})
    # K a multiple of 16 (every model shape; k_split is a multiple of BLOCK_K): the JIT's
    # specialization at such calls, which the build's resource report should show
    return [(mod.int8_gemm_kernel, sig, const, {"num_warps": mod.NUM_WARPS, "num_stages": mod.NUM_STAGES},
             ("K", "k_split"))]
