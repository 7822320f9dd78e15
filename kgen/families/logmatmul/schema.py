"""logmatmul's knobs, the rules a variant must obey (instruction shapes, registers), the
template context, and what `kgen build` compiles ahead of time."""

from __future__ import annotations

from typing import Any, Mapping

from kgen.spec import DTYPES, Knob, Schema

# tl.dot's input precisions for float32 operands; "none" sums with float32 FMAs instead.
DOT_CHOICES = ("none", "ieee", "tf32x3", "tf32")
# float32 registers per thread a register tile may take (beside addresses, x, exps).
_REG_BUDGET = 128
# Rows of x (the batch) the CUDA kernel holds accumulators for (instantiations 1, 2, 4, ...
# up to its max_b): accumulators (rows x nodes) plus weights in flight (unroll x nodes x
# vec) within a register budget that ptxas met without a stack at 128 registers a thread
# (checked per instantiation with cuobjdump: e.g. 4 nodes, unroll 2 held 8 rows, not 16);
# 16-bit x unpacks beside them, so at most 32 accumulators.
CUDA_MAX_B = 16
# The largest B of a CUDA forward whose CTAs take tiles of rows (`rows`, or mma): B above a
# tile runs as CTAs side by side per node group, the later ones reading w from L2.
CUDA_TILED_MAX_B = 64
_CUDA_REGS = 96
# The widest K the CUDA forward takes: its FMA CTA addresses a node's row from the node group's
# first with an int (nodes x K < 2^31); wider calls run on the Triton kernels.
CUDA_MAX_K = 1 << 27
# Bytes of an element of each dtype a variant takes (x's; w is x's dtype or float32).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def cuda_whole_rows(K: int, w_bytes: int) -> bool:
    """Whether rows of K weights of `w_bytes` each are whole 16-byte vectors: the CUDA
    forward's loads take no other (a call that is not goes to the Triton companion)."""
    return K * w_bytes % 16 == 0


# The tensor-core form (mma = 1): a warp owns 16 nodes (an mma m-tile), a CTA 16 x (m-tiles)
# of them (`nodes`, a multiple of 16 whose m-tiles divide the warps: the rest split the K
# slice); its rows of x come in n-tiles of 8, so a CTA holds 8 or 16 rows (`rows`).
MMA_TILE = 16
MMA_ROWS = (8, 16)
# The FMA form's nodes per CTA at most (each lane loads all of them).
FMA_MAX_NODES = 8


def cuda_max_b(nodes: int, vec: int = 4, unroll: int = 1, dtype: str = "float32", mma: int = 0) -> int:
    """The largest B (a power of two) a CUDA variant's CTAs hold in registers: its sums
    (B x nodes) beside the weights in flight (unroll x nodes x vec); with mma, 16 (two
    n-tiles of 8 rows, each 8 accumulators a thread)."""
    if mma:
        return MMA_ROWS[-1]
    budget = _CUDA_REGS - 8 * (unroll - 1) - unroll * nodes * vec
    acc = min(budget, 32 if dtype != "float32" else 64)
    b = 1
    while 2 * b <= CUDA_MAX_B and 2 * b * nodes <= acc:
        b *= 2
    return b


def cuda_op_max_b(knobs: Mapping[str, Any], dtype: str) -> int:
    """The largest B a CUDA variant takes: what its CTAs hold in registers, or
    CUDA_TILED_MAX_B with row tiles (`rows`, mma)."""
    if knobs["rows"] or knobs.get("mma", 0):
        return CUDA_TILED_MAX_B
    return cuda_max_b(knobs["nodes"], knobs["vec"], knobs["unroll"], dtype)


def cuda_rows(knobs: Mapping[str, Any], dtype: str) -> int:
    """Rows of x per CTA: `rows`, or (0) as many as its registers hold."""
    return knobs["rows"] or cuda_max_b(knobs["nodes"], knobs["vec"], knobs["unroll"], dtype, knobs.get("mma", 0))


# The block-sparse forward of a CUDA variant (bsl.cuh.j2) is lmm_partials' FMA body over block
# rows: an FMA variant's own nodes, unroll and rows of x, at most BSL_UNROLLED_ROWS rows with
# more than one step of loads in flight (its block-row indexing holds a few registers more:
# 8 rows x 4 nodes at unroll 2 spilled 16 bytes on sm_90); the tensor-core form (16 nodes an
# m-tile) takes the first FMA variant's shape: 8 nodes, 1 step of loads in flight, 4 rows.
BSL_MMA_SHAPE = (8, 1, 4)
BSL_UNROLLED_ROWS = 4


def cuda_bsl_shape(knobs: Mapping[str, Any], dtype: str) -> tuple[int, int, int]:
    """(nodes, unroll, rows of x per CTA) of a CUDA variant's block-sparse kernel. It takes
    B <= CUDA_MAX_B: B above its rows runs as CTAs side by side per node group."""
    if knobs.get("mma", 0):
        return BSL_MMA_SHAPE
    rows = cuda_rows(knobs, dtype)
    return knobs["nodes"], knobs["unroll"], min(rows, BSL_UNROLLED_ROWS) if knobs["unroll"] > 1 else rows


def _check_triton(dtype: str, k: Mapping[str, Any]):
    problems = []
    threads = 32 * k["num_warps"]
    if k["dot"] != "none":
        for knob in ("block_b", "block_n", "block_k"):
            if k[knob] < 16:
                problems.append((knob, f"{knob}={k[knob]}: tl.dot needs tiles of at least 16 on each side"))
    elif k["block_b"] * k["block_n"] * k["block_k"] > _REG_BUDGET * threads:
        problems.append(("block_k", f"the FMA product tile block_b x block_n x block_k = {k['block_b']} x "
                                    f"{k['block_n']} x {k['block_k']} needs more than {_REG_BUDGET} float32 "
                                    f"registers per thread at num_warps={k['num_warps']}"))
    if k["bwd_b"] * k["bwd_n"] * k["bwd_k"] > _REG_BUDGET * 32 * k["bwd_warps"]:
        problems.append(("bwd_k", f"the backward tile bwd_b x bwd_n x bwd_k = {k['bwd_b']} x {k['bwd_n']} x "
                                  f"{k['bwd_k']} needs more than {_REG_BUDGET} float32 registers per thread "
                                  f"at bwd_warps={k['bwd_warps']}"))
    return problems


def _check_cuda(dtype: str, k: Mapping[str, Any]):
    size = DTYPES[dtype][0]
    problems = []
    if k["vec"] * size != 16:
        problems.append(("vec", f"vec={k['vec']} x {size}-byte {dtype} is {k['vec'] * size} bytes; the weight "
                                "loads are 16-byte vectors"))
    if k["mma"]:
        return problems + _check_mma(dtype, k)
    if k["mtiles"] != 1:
        problems.append(("mtiles", f"mtiles={k['mtiles']}: m-tiles are the tensor-core kernel's (mma=1)"))
    if k["nodes"] > FMA_MAX_NODES:
        problems.append(("nodes", f"nodes={k['nodes']}: at most {FMA_MAX_NODES} without mma (every lane loads "
                                  "each node's row)"))
        return problems
    fit = cuda_max_b(k["nodes"], k["vec"], k["unroll"], dtype)
    if k["rows"] and (k["rows"] & (k["rows"] - 1) or k["rows"] > fit):
        problems.append(("rows", f"rows={k['rows']}: a power of two of at most {fit}, the rows of x this "
                                 "variant's CTAs hold in registers"))
    return problems


def _check_mma(dtype: str, k: Mapping[str, Any]):
    problems = []
    if dtype != "float32":
        problems.append(("mma", f"mma=1 takes float32 x and w only (tf32 splits of float32 operands), not "
                                f"{dtype}: use mma=0 for 16-bit inputs"))
    nodes, warps, mt = k["nodes"], k["warps"], k["mtiles"]
    per_warp = MMA_TILE * mt  # nodes a warp owns
    if nodes % per_warp or nodes > per_warp * warps or (warps * per_warp) % nodes:
        problems.append(("nodes", f"nodes={nodes}: with mma=1 and mtiles={mt}, a multiple of {per_warp} (a warp's "
                                  f"{mt} m-tile(s) of {MMA_TILE}) whose warps across it divide warps={warps} "
                                  f"({per_warp}, {2 * per_warp}, ... up to {per_warp * warps})"))
    if k["rows"] not in (0, *MMA_ROWS):
        problems.append(("rows", f"rows={k['rows']}: with mma=1, 0, 8 or 16 (n-tiles of 8 rows of x)"))
    return problems


def _check_variant(backend: str, arch: str | None, dtype: str, k: Mapping[str, Any]):
    return _check_cuda(dtype, k) if backend == "cuda" else _check_triton(dtype, k)


SCHEMA = Schema(
    dtypes=("float32", "bfloat16", "float16"),
    knobs={
        "cuda": (
            Knob("warps", "w", lo=1, hi=16, pow2=True),  # warps per CTA, splitting the CTA's K slice
            # nodes (rows of w) per CTA: each lane loads all of them (at most 8); with mma, 16 per
            # m-tile of a warp
            Knob("nodes", "n", lo=1, hi=256),
            Knob("vec", "v", lo=4, hi=8, pow2=True),  # elements per 16-byte weight load
            Knob("unroll", "u", lo=1, hi=4, default=1),  # steps of weight loads issued before any is used
            Knob("waves", "q", lo=1, hi=32, default=4),  # CTAs per SM the K split aims for
            # rows of x per CTA at most (0: as many as registers hold); above it, B <= CUDA_TILED_MAX_B runs
            # as CTAs side by side per node group, each a tile of rows
            Knob("rows", "b", lo=0, hi=16, default=0),
            # 1: the tensor-core kernel (lmm_mma: mma.sync tf32 in 3 passes, float32 only)
            # instead of float32 FMAs (lmm_partials)
            Knob("mma", "m", lo=0, hi=1, default=0),
            # with mma: m-tiles of 16 nodes per warp (they share the warp's exps of x; 2 at
            # unroll 2 fills 128 registers on sm_90 and spills on sm_80 at 16 rows)
            Knob("mtiles", "t", lo=1, hi=2, default=1),
        ),
        "triton": (
            Knob("block_b", "b", lo=1, hi=128, pow2=True),  # rows of x per program (FMA: at most)
            Knob("block_n", "n", lo=4, hi=256, pow2=True),  # rows of w per program
            Knob("block_k", "k", lo=16, hi=512, pow2=True),  # reduction step
            Knob("dot", "d", kind=str, choices=DOT_CHOICES, default="none"),
            Knob("num_warps", "w", lo=1, hi=16, pow2=True),
            Knob("num_stages", "s", lo=1, hi=8, default=2),
            Knob("waves", "q", lo=1, hi=32, default=4),  # programs per SM the K split aims for
            # backward: the largest B the one-pass kernel holds in registers (beyond: GEMMs);
            # block-sparse backward: rows of x per step
            # (on an H200 at N = K = 4096: 96 us against 123 us at B = 4; 222 against 105 at B = 8)
            Knob("bwd_b", "bb", lo=1, hi=16, pow2=True, default=4),
            Knob("bwd_n", "bn", lo=4, hi=256, pow2=True, default=8),  # backward: w tile rows
            Knob("bwd_k", "bk", lo=8, hi=256, pow2=True, default=128),  # backward: w tile columns
            Knob("bwd_warps", "bw", lo=1, hi=16, pow2=True, default=4),
        ),
    },
    check=_check_variant,
    archs=("sm_80", "sm_86", "sm_89", "sm_90"),
)
TEMPLATES = {"triton": "logmatmul/triton.py.j2", "cuda": "logmatmul/cuda.cu.j2"}


def template_context(variant) -> dict:
    p = variant.params
    if variant.backend == "cuda":
        rows = cuda_rows(p, variant.dtype)
        # row instances: the smallest holding the tile serves (powers of two; mma: n-tiles of 8)
        first = MMA_ROWS[0] if p["mma"] else 1
        return {"dtype": variant.dtype, "WARPS": p["warps"], "NODES": p["nodes"], "UNROLL": p["unroll"],
                "ROWS": rows, "MAX_B": cuda_op_max_b(p, variant.dtype), "MMA": p["mma"], "MTILES": p["mtiles"],
                "CUDA_MAX_K": CUDA_MAX_K,
                "batch_instances": [b for b in (1 << i for i in range(rows.bit_length())) if b >= first],
                **_bsl_context(p, variant.dtype)}
    return {"BLOCK_B": p["block_b"], "BLOCK_N": p["block_n"], "BLOCK_K": p["block_k"], "DOT": p["dot"],
            "NUM_WARPS": p["num_warps"], "NUM_STAGES": p["num_stages"], "WAVES": p["waves"],
            "BWD_B": p["bwd_b"], "BWD_N": p["bwd_n"], "BWD_K": p["bwd_k"], "BWD_WARPS": p["bwd_warps"]}


def _bsl_context(p, dtype: str) -> dict:
    nodes, unroll, rows = cuda_bsl_shape(p, dtype)
    return {"BSL_NODES": nodes, "BSL_UNROLL": unroll, "BSL_ROWS": rows, "BSL_MAX_B": CUDA_MAX_B,
            "bsl_instances": [1 << i for i in range(rows.bit_length())]}


def triton_aot(variant, mod) -> list:
    """What `kgen build` compiles ahead of time: the forward (partials form, each form a call
    can take) and the fused backward in the variant's dtype, with float32 weights."""
    t = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[variant.dtype]
    fwds = []
    # the forward in each form a call can take (plans.pre_pass): tl.dot tiles at large work
    # read exp(x - m) as float32 from the exp launch, below it take their exps themselves
    for pre in (False, True) if mod.DOT != "none" else (False,):
        const = {"DIRECT": False, "DOT": mod.DOT, "BLOCK_B": mod.BLOCK_B, "BLOCK_N": mod.BLOCK_N,
                 "BLOCK_K": mod.BLOCK_K, "PRE": pre, "KA": 16}
        sig = {"x_ptr": "*fp32" if pre else f"*{t}", "w_ptr": "*fp32", "part_m_ptr": "*fp32",  # argument order
               "part_s_ptr": "*fp32", "out_ptr": "*fp32", "B": "i32", "N": "i32", "K": "i32", "k_slice": "i32",
               "n_tiles": "i32", **dict.fromkeys(list(const)[:-1], "constexpr"), "m_ptr": "*fp32", "KA": "constexpr"}
        fwds.append((mod.logmatmul_fwd_kernel, sig, const,
                     {"num_warps": mod.NUM_WARPS, "num_stages": mod.NUM_STAGES}, ("K", "k_slice")))
    bwd_sig = {"x_ptr": f"*{t}", "w_ptr": "*fp32", "out_ptr": "*fp32", "g_ptr": "*fp32", "stats_ptr": "*fp32",
               "dw_ptr": "*fp32", "dxp_ptr": "*fp32", "B": "i32", "N": "i32", "K": "i32", "n_chunk": "i32"}
    bwd_const = {"BB": mod.BWD_B, "BN": mod.BWD_N, "BK": mod.BWD_K, "DIRECT": False, "KA": 16}
    bwd_sig.update({k: "constexpr" for k in bwd_const})
    # K and the K slice multiples of 16 (the issue's and most models' widths): what the JIT
    # specializes at such calls, and so what the build's resource report should show
    return [*fwds,
            (mod.logmatmul_bwd_kernel, bwd_sig, bwd_const, {"num_warps": mod.BWD_WARPS}, ("K",))]
