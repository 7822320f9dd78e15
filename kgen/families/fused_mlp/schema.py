"""fused_mlp's knobs, the rules a variant obeys (the CUDA cluster variants': cuda_plans), which
calls a variant can take (`variant_fits`), the template context (an exact variant's plan: which
layers stream into which, what stays in registers) and what `kgen build` compiles ahead of
time."""

from __future__ import annotations

from typing import Any, Mapping

from kgen.spec import Knob, Schema

ACTIVATIONS = ("none", "relu", "sigmoid", "gelu", "silu")
ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
MAX_LAYERS = 8
MAX_WIDTH = 4096
MIN_DOT = 16  # tl.dot's smallest M, N and K


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# An exact variant keeps a whole activation tile [BLOCK_M, width] in registers only up to
# `reg_max` padded columns, and one weight tile (a tl.dot's B operand, staged in shared
# memory) up to WEIGHT_TILE_BYTES. Measured (Triton 3.9 ahead of time for sm_90, 64 rows, 8
# warps): a 256-wide float32 accumulator fits (164-222 registers), but with float32 inputs
# and TF32 off ("tf32x3": each operand split in two) it took 255 registers, a 40-300 B stack
# and up to 256 KB of shared memory (more than sm_90's 227 KB): float32 variants carry a
# second kernel for that precision, with 128-column register tiles and 32-column chunks.
REG_MAX = 256
X3_REG_MAX, X3_BLOCK_K = 128, 32
WEIGHT_TILE_BYTES = 64 * 1024
# A layer reading memory whose input row tile is at most HOIST_BYTES a row in at most
# K_UNROLL_MAX chunks loads that tile once, before its column loop, and unrolls its K chunks:
# the column loop is then the innermost loop, which Triton pipelines (the next column
# chunk's weights load while this one's dots run; a nested K loop drains its pipeline at
# every column chunk). Wider inputs keep the K loop: unrolled with the input loaded in the
# loop, the pipelined float32 tiles took 528 KB of shared memory.
K_UNROLL_MAX = 8
HOIST_BYTES = 1024
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
ALIGN_MIN_BYTES = 64 * 1024  # weight_strides: the smallest weight padded to whole vectors


def padded(width: int) -> int:
    """A tile's extent for `width` columns: a power of two >= 16 (tl.dot's smallest)."""
    return max(MIN_DOT, _pow2_at_least(width))


def chunks(width: int, block: int) -> list[dict]:
    """`width` columns in `block`-wide chunks, the last one padded to a power of two >= 16
    (masked where it runs past `width`)."""
    out, start = [], 0
    while start < width:
        size = min(block, padded(width - start))
        out.append({"c": len(out), "start": start, "size": size, "masked": start + size > width})
        start += size
    return out


def weight_strides(widths: tuple[int, ...], itemsize: int, align: bool = True) -> tuple[int, ...]:
    """Each layer's weight row stride in the exact Triton kernels: with `align`, a weight of
    at least ALIGN_MIN_BYTES whose rows are not whole 16-byte vectors (K = 367 in bf16: 734
    bytes, every odd row 2 bytes off a 4-byte boundary) is read at K rounded up to whole
    vectors, from a zero-padded copy the op makes each call (launch._plan: pad_rows); every
    other weight at its own width. Unpadded, Triton loads such a weight 2 bytes at a time
    and its pipeliner leaves those loads synchronous; a small weight is not worth a copy's
    launch."""
    v = 16 // itemsize
    return tuple(_round(k, v) if align and k * n * itemsize >= ALIGN_MIN_BYTES else k
                 for k, n in zip(widths[:-1], widths[1:]))


# pad_rows_kernel (templates/fused_mlp/triton.py.j2): rows a program, warps
PAD_ROWS, PAD_WARPS = 16, 4


def pad_launch(n: int, k: int, stride: int) -> tuple[tuple[int], dict, dict]:
    """(grid, constexprs, options) of the pad_rows_kernel launch that copies an [n, k]
    weight into an [n, stride] zero-padded one: what the op launches (launch._plan) and
    what `kgen build` compiles ahead of time (triton_aot), from one place."""
    return (-(-n // PAD_ROWS),), {"N": n, "K": k, "KS": stride, "KP": _pow2_at_least(stride),
                                  "BLOCK_N": PAD_ROWS}, {"num_warps": PAD_WARPS}


# Float32 with TF32 on: a layer with an input or output width <= TF32_FULL_MAX (a one-wide
# layer: DLRM top's last) is computed to float32's accuracy, in the forward and in the fused
# backward's products (its weight copies not rounded); the others in TF32 with cuBLAS's operand
# rounding. That is what torch.matmul does: cuBLAS runs a one-wide layer through a full-float32
# kernel at every B, and narrow ones in TF32 but at a few (B, width) cells its heuristics pick
# otherwise (H200, torch 2.11, F.linear against TF32 off, B 90-32768, the other width 64 or
# 512: K or N = 1 float32 in 28 of 28 cells; 2-6 in 17 of 140, all at B >= 8192; 8-12 in 0
# of 56; 16-32 in 3 of 56, at B = 2048; BENCHMARKS.md, fifty-sixth session). Following those
# cells would mean following cuBLAS's heuristics, and computing every narrow layer in float32
# gives kgen other roundings than eager's where cuBLAS uses TF32: its ReLU masks then flip
# elsewhere than eager's (B = 90, 24 seeds: a gradient 35x to 1e6x eager's error in 3).
TF32_FULL_MAX = 1

# tf32_weights_kernel (templates/fused_mlp/triton.py.j2): rows and columns a program's step, warps
TF32_ROWS, TF32_COLS, TF32_WARPS = 8, 128, 4


def tf32_weights_launch(widths: tuple[int, ...], exact: bool) -> tuple[tuple[int, int], dict, dict]:
    """(grid, constexprs, options) of the tf32_weights_kernel launch that writes every
    weight's TF32-rounded copy before a float32 forward with TF32 on (the forward's tensor-core
    tiles of a weight then are cuBLAS's rounding of it, not the hardware's truncation): what
    the op launches (launch._plan) and what `kgen build` compiles ahead of time (triton_aot).
    An exact variant's copies are at its widths, a generic one's at the call's (constexprs)."""
    L = len(widths) - 1
    c = {"BLOCK_N": TF32_ROWS, "BLOCK_K": TF32_COLS}
    if not exact:
        c.update({f"D{i}": (widths[i] if i <= L else 1) for i in range(MAX_LAYERS + 1)}, NUM_LAYERS=L)
    return (-(-max(widths[1:]) // TF32_ROWS), L), c, {"num_warps": TF32_WARPS}


def plan(widths: tuple[int, ...], block_k: int, itemsize: int, reg_max: int = REG_MAX,
         align: bool = True, block_n: int = 0) -> list[dict]:
    """How an exact variant runs its layers: a list of steps, each running one layer (or two,
    when the second is absorbed), its column loops left to Triton (tl.range), not unrolled.

    The activation going into a layer is either in memory (x, or a scratch row tile: the
    layer loops over K chunks) or a whole register tile (padded width <= reg_max). A layer is
    - "whole": register input, and its whole output fits a register tile: one tl.dot;
    - "chunked": a loop over `bn`-column chunks of its output; each chunk then goes to the
      output (last layer), into the next layer's accumulator (`absorb`: that layer's output
      fits a register tile, so the wide hidden layer never exists whole, as attention's
      P @ V), or to a scratch row tile the next layer reads back (anything wider).

    A step's weight W_i is read at row stride `ws` (weight_strides); a weight tile's K mask
    runs to K, where a K chunk runs past it (`wk_masked`; per unrolled chunk `wmasked`; an
    absorbed W_j: `jws`, `jk_masked`), so the padding columns are never read and may hold
    anything: the op's zero-padded copy, or a caller's row-padded weight read in place
    (launch.in_place). The activations' masks are at K too."""
    L, P = len(widths) - 1, [padded(w) for w in widths]
    WS = weight_strides(widths, itemsize, align)
    steps, src, i = [], "x", 0
    while i < L:
        K, N = widths[i], widths[i + 1]
        base = {"i": i, "K": K, "N": N, "kp": P[i], "np": P[i + 1], "src": src, "last": i == L - 1,
                "ws": WS[i]}
        if src == "reg" and P[i + 1] <= reg_max and P[i] * P[i + 1] * itemsize <= WEIGHT_TILE_BYTES:
            steps.append(dict(base, kind="whole", n_masked=N != P[i + 1], wk_masked=P[i] > K))
            i += 1
            continue
        bn, bk = min(block_n or block_k, P[i + 1]), min(block_k, P[i])
        kc = [dict(c, wmasked=c["start"] + c["size"] > K) for c in chunks(K, bk)]
        # a memory input's K chunks unrolled and loaded once, or a K loop (a register input: one dot)
        unroll = src != "reg" and len(kc) <= K_UNROLL_MAX and P[i] * itemsize <= HOIST_BYTES
        k_end = P[i] if src == "reg" else _round(K, bk)  # where the K loop's last chunk ends
        step = dict(base, kind="chunked", bn=bn, bk=bk, n_masked=N % bn != 0, k_masked=K % bk != 0,
                    wk_masked=k_end > K, k_chunks=kc, unroll=unroll,
                    sink="out" if i == L - 1 else "scratch")
        if i < L - 1 and P[i + 2] <= reg_max and bn * P[i + 2] * itemsize <= WEIGHT_TILE_BYTES:
            step.update(sink="absorb", j=i + 1, jN=widths[i + 2], jp=P[i + 2], j_last=i + 1 == L - 1,
                        j_masked=widths[i + 2] != P[i + 2], jws=WS[i + 1], jk_masked=_round(N, bn) > N)
        if src == "reg" and P[i] * bn * itemsize > WEIGHT_TILE_BYTES:
            raise ValueError(f"layer {i} ({K} -> {N}): a {P[i]} x {bn} weight tile is too large; "
                             "use a smaller block_n (or block_k)")
        steps.append(step)
        if step["sink"] == "absorb":
            src, i = "reg", i + 2
        else:
            src, i = "scratch", i + 1
    # scratch buffers alternate (a layer reads one and writes the other)
    n = 0
    for s in steps:
        if s["src"] == "scratch":
            s["read"] = (n - 1) % 2
        if s.get("sink") == "scratch":
            s["write"] = n % 2
            n += 1
    return steps


def kernels(widths: tuple[int, ...], block_k: int, dtype: str, align: bool = True, block_n: int = 0,
            split: int = 1) -> list[dict]:
    """An exact variant's kernels: the one every call uses, and for float32 the one calls
    with TF32 off use ("tf32x3", see REG_MAX). Each with its `split` (`splits`: `split`
    where its plan can take it, else 1) and, split, layer 0's column chunks (`chunks`)."""
    out = [{"name": "fused_mlp_fwd_kernel", "steps": plan(widths, block_k, ITEMSIZE[dtype], align=align,
                                                          block_n=block_n)}]
    if dtype == "float32":
        x3 = min(block_k, X3_BLOCK_K)
        out.append({"name": "fused_mlp_fwd_kernel_x3",
                    "steps": plan(widths, x3, ITEMSIZE[dtype], X3_REG_MAX, align, min(block_n or x3, x3))})
    for k in out:
        k["scratch"] = max([s["N"] for s in k["steps"] if s.get("sink") == "scratch"], default=0)
        k["split"] = splits(k["steps"], split)
        k["chunks"] = chunk_count(k["steps"][0]) if k["split"] > 1 else 1
        k["partial"] = k["steps"][0]["jp"] if k["split"] > 1 else 0  # the partial's width
    return out


def splits(steps: list[dict], split: int) -> int:
    """How many programs share a row tile in a kernel of `steps` with the `split` knob: split
    where layer 0 is streamed from x into layer 1's register accumulator ("chunked", sink
    "absorb": the programs split layer 0's column chunks, each holding a partial of layer 1)
    in at least `split` chunks, else 1."""
    s = steps[0]
    if split > 1 and s["kind"] == "chunked" and s["src"] == "x" and s["sink"] == "absorb" and chunk_count(s) >= split:
        return split
    return 1


def chunk_count(step: dict) -> int:
    """How many column chunks of `bn` a chunked step's N columns make."""
    return -(-step["N"] // step["bn"])


def _round(n: int, m: int) -> int:
    return -(-n // m) * m


def _check_variant(backend: str, arch: str | None, dtype: str, k: Mapping[str, Any]):
    if backend == "cuda":
        from kgen.families.fused_mlp import cuda_plans  # (it imports this module's limits)

        if k["split_n"] and not k["stages"]:
            return [("split_n", "split_n is the TMA ring variant's (stages > 0)")]
        if k["stages"]:
            if arch != "sm_90a":
                return [("stages", "the TMA ring (stages) is the sm_90a WGMMA variant's; leave it out for sm_90")]
            return cuda_plans.check_ring(dtype, k)
        return cuda_plans.check_wgmma(dtype, k) if arch == "sm_90a" else cuda_plans.check_mma_sync(dtype, k)
    problems = []
    widths, mw = k["widths"], k["max_width"]
    if widths:
        if not 2 <= len(widths) <= MAX_LAYERS + 1:
            problems.append(("widths", f"{len(widths)} widths make {len(widths) - 1} layers; "
                                       f"1 to {MAX_LAYERS} layers are supported"))
        if mw:
            problems.append(("max_width", "max_width bounds a generic variant; an exact one (widths) has none"))
    elif not mw:
        problems.append(("max_width", "a generic variant (no widths) needs max_width, its bound on every width"))
    if widths and k["split"] > 1 and 2 <= len(widths) <= MAX_LAYERS + 1:
        try:
            steps = plan(widths, k["block_k"], ITEMSIZE[dtype], align=bool(k["align"]), block_n=k["block_n"])
        except ValueError:  # (the plan's own error, raised where the variant renders)
            steps = None
        if steps and splits(steps, k["split"]) == 1:
            s = steps[0]
            why = (f"{chunk_count(s)} column chunk(s) of {s['bn']}" if s["sink"] == "absorb" else
                   f"its plan does not stream layer 0 into layer 1's accumulator ({s['kind']}, to {s.get('sink')})")
            problems.append(("split", f"split {k['split']} needs layer 0 ({widths[0]} -> {widths[1]}) streamed "
                                      f"into layer 1 in at least {k['split']} column chunks; it has {why}"))
    if not widths:
        for knob, default in (("block_n", 0), ("align", 1), ("split", 1)):
            if k[knob] != default:
                problems.append((knob, "applies to exact variants (widths) only: a generic one reads every weight "
                                       "in place, block_k columns a step"))
    return problems


SCHEMA = Schema(
    dtypes=("bfloat16", "float16", "float32"),
    knobs={
        "triton": (
            # exact widths [w0, ..., wL] (the name shows them as w0xw1x...); () = generic
            Knob("widths", "", kind=tuple, lo=1, hi=MAX_WIDTH, default=()),
            # generic variants: the largest width they take (0 for exact ones)
            Knob("max_width", "mw", lo=0, hi=MAX_WIDTH, default=0),
            Knob("block_m", "m", lo=16, hi=256, pow2=True),  # rows per program
            Knob("block_k", "k", lo=16, hi=256, pow2=True),  # column chunk (the dots' N and K)
            # exact variants: a chunked layer's output columns a step (0: block_k); fewer
            # columns, smaller weight tiles a pipeline stage
            Knob("block_n", "n", choices=(0, 16, 32, 64, 128, 256), default=0),
            Knob("num_warps", "w", lo=1, hi=16, pow2=True),
            Knob("num_stages", "s", lo=1, hi=6, default=2),  # the loops' pipeline depth
            # exact variants: read each weight at a 16-byte row stride (1: the op passes a
            # zero-padded copy of a weight whose rows are not whole vectors; 0: in place)
            Knob("align", "a", lo=0, hi=1, default=1),
            # exact variants: programs per row tile, each running 1/split of layer 0's columns
            # (streamed into layer 1) on a float32 partial of layer 1 that the last of them
            # sums in a fixed order (templates/fused_mlp/triton.py.j2; launch._plan, launch.split_counters)
            Knob("split", "sp", lo=1, hi=16, default=1),
        ),
        "cuda": (
            Knob("widths", "", kind=tuple, lo=1, hi=MAX_WIDTH),  # exact widths, required
            Knob("cluster", "c", lo=1, hi=16, pow2=True),  # CTAs per cluster (above 8: non-portable)
            Knob("block_m", "m", lo=16, hi=128, pow2=True),  # rows per cluster tile
            Knob("warps", "w", lo=4, hi=16, pow2=True),
            # sm_90a: slots of the TMA ring (templates/fused_mlp/cuda_ring.cu.j2: block_m rows a
            # CTA, the weights streamed and multicast over the cluster); 0: the exchange kernel
            Knob("stages", "st", lo=0, hi=32, default=0),
            # the ring (stages > 0): 1 = the cluster's CTAs share a row tile and split every
            # layer's features (each streams its own tiles' weights, sends its activations to the
            # others by bulk copies); 0 = a row tile a CTA, the weights multicast over the cluster
            Knob("split_n", "sn", lo=0, hi=1, default=0),
        ),
    },
    check=_check_variant,
    # thread-block clusters and distributed shared memory; sm_90a: the WGMMA variant
    archs=("sm_90", "sm_90a"),
)
TEMPLATES = {"triton": "fused_mlp/triton.py.j2",
             "cuda": {"sm_90": "fused_mlp/cuda.cu.j2", "sm_90a": "fused_mlp/cuda_sm90a.cu.j2"}}


def template_context(variant) -> dict:
    p = variant.params
    from kgen.families.fused_mlp.cuda_plans import RING_ROWS, cuda_plan, ring_plan, wgmma_plan  # (it imports this module)

    if variant.backend == "cuda" and variant.arch == "sm_90a" and p["stages"]:
        return {"dtype": variant.dtype, "activations": ACTIVATIONS, "widths": tuple(p["widths"]), "ring": True,
                "CLUSTER": p["cluster"], "ROWS": p["block_m"], "STAGES": p["stages"], "slot_rows": RING_ROWS,
                "SPLIT": bool(p["split_n"]),
                **ring_plan(tuple(p["widths"]), p["cluster"], p["block_m"], p["stages"], bool(p["split_n"]))}
    if variant.backend == "cuda" and variant.arch == "sm_90a":
        return {"dtype": variant.dtype, "activations": ACTIVATIONS, "widths": tuple(p["widths"]), "ring": False,
                "CLUSTER": p["cluster"], "BLOCK_M": p["block_m"],
                **wgmma_plan(tuple(p["widths"]), p["cluster"], p["block_m"], ITEMSIZE[variant.dtype])}
    if variant.backend == "cuda":
        return {"dtype": variant.dtype, "activations": ACTIVATIONS, "widths": tuple(p["widths"]),
                "CLUSTER": p["cluster"], "BLOCK_M": p["block_m"], "WARPS": p["warps"],
                **cuda_plan(tuple(p["widths"]), p["cluster"], p["block_m"], p["warps"], ITEMSIZE[variant.dtype])}
    widths = tuple(p["widths"])
    align = bool(p["align"])
    ks = kernels(widths, p["block_k"], variant.dtype, align, p["block_n"], p["split"]) if widths else []
    return {"dtype": variant.dtype, "activations": ACTIVATIONS, "exact": bool(widths), "widths": widths,
            "weight_strides": weight_strides(widths, ITEMSIZE[variant.dtype], align) if widths else (),
            "kernels": ks, "scratch_width": max([k["scratch"] for k in ks], default=0),
            "max_width": p["max_width"], "max_layers": MAX_LAYERS,
            "block_m": p["block_m"], "block_k": p["block_k"], "num_warps": p["num_warps"],
            "num_stages": p["num_stages"], "full_max": TF32_FULL_MAX,
            # an exact variant's layers computed in float32's accuracy with TF32 on (the generic
            # kernel decides from its constexpr widths)
            "full_layers": [variant.dtype == "float32" and min(k, n) <= TF32_FULL_MAX
                            for k, n in zip(widths, widths[1:])]}


def variant_fits(variant, shape: Mapping[str, Any]) -> bool:
    """Whether `variant` can run a call of `shape` ({"widths": "w0-w1-..." or a tuple, ...;
    "layout": "padded" for row-padded weights}): its widths. (The TMA ring kernel reads dense
    weights whose rows are not whole 16-byte vectors through a row-padded copy made each call,
    cuda.CudaMLP.scratch: it is timed, and chosen, with that copy; not a one-row weight
    of such a width, whose pitch is its width however it is laid out: there its Triton
    companion would run in its name, timed and chosen as if it were the ring.)"""
    widths = widths_of(shape["widths"])
    if not fits(variant.params, widths):
        return False
    return not variant.params.get("stages") or not any(
        widths[i + 1] == 1 and widths[i] * ITEMSIZE[variant.dtype] % 16 for i in range(ring_weights(widths)))


def ring_weights(widths: tuple[int, ...]) -> int:
    """How many weights the TMA ring kernel reads through tensor maps: every one but a one-wide
    last layer's after another (a dot in registers, cuda_plans.ring_plan)."""
    L = len(widths) - 1
    return L - 1 if L >= 2 and widths[-1] == 1 else L


def ring_reads(widths: tuple[int, ...], dtype: str, layout: str | None) -> bool:
    """Whether the TMA ring kernel reads a call's weights in place: rows of whole 16-byte
    vectors, as given (`layout` "padded": tuning.layout_of) or by their widths (else it reads
    copies, cuda.CudaMLP.scratch)."""
    return layout == "padded" or all(k * ITEMSIZE[dtype] % 16 == 0 for k in widths[:ring_weights(widths)])


def fits(params: Mapping[str, Any], widths: tuple[int, ...]) -> bool:
    if params["widths"]:
        return tuple(params["widths"]) == widths
    return len(widths) - 1 <= MAX_LAYERS and max(widths) <= params["max_width"]


def widths_of(w) -> tuple[int, ...]:
    return tuple(int(x) for x in w.split("-")) if isinstance(w, str) else tuple(w)


def triton_aot(variant, mod) -> list:
    """What `kgen build` compiles ahead of time: the kernels a variant's calls use (the
    activations, biases and `save` are runtime arguments), for an exact variant at its
    widths (float32: its TF32 kernel and its "tf32x3" one), for a generic one at the DLRM
    bottom MLP's widths (when they fit its bound; float32: "tf32x3", what a call gets with
    TF32 off, PyTorch's default, the heavier of the two); and the copies launched before
    (float32: the TF32 weights; exact: the weight pads)."""
    t = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[variant.dtype]
    exact = bool(variant.params["widths"])
    widths = tuple(variant.params["widths"]) or (13, 512, 256, 64, 16)
    widths = tuple(min(w, variant.params["max_width"] or w) for w in widths)
    L = len(widths) - 1
    n_slots = L if exact else MAX_LAYERS
    sig = {"x_ptr": f"*{t}", "out_ptr": f"*{t}"}
    if exact:
        sig.update({"s0_ptr": f"*{t}", "s1_ptr": f"*{t}"})
    for i in range(n_slots):
        sig.update({f"w{i}_ptr": f"*{t}", f"b{i}_ptr": f"*{t}", f"z{i}_ptr": f"*{t}"})
    sig.update({"B": "i32", "bias_mask": "i32", "act": "i32", "last_act": "i32", "save": "i32"})
    const = {"BLOCK_M": mod.BLOCK_M}
    if exact:
        opts = {"num_warps": mod.NUM_WARPS, "num_stages": mod.NUM_STAGES}
        fns = [(mod.fused_mlp_fwd_kernel, "tf32")]
        if variant.dtype == "float32":
            fns.append((mod.fused_mlp_fwd_kernel_x3, "tf32x3"))
    else:
        const.update({f"D{i}": (widths[i] if i <= L else 1) for i in range(MAX_LAYERS + 1)})
        const.update(NUM_LAYERS=L, BLOCK_K=mod.BLOCK_K, NUM_STAGES=mod.NUM_STAGES)
        opts = {"num_warps": mod.NUM_WARPS}
        fns = [(mod.fused_mlp_fwd_kernel, "tf32x3" if variant.dtype == "float32" else "tf32")]
    out = []
    for fn, prec in fns:
        c = dict(const, PRECISION=prec)
        s = dict(sig)
        if exact and mod.SPLITS[fn.__name__] > 1:  # a split kernel's partials and counters (launch._plan)
            s = {**{k: v for k, v in sig.items() if v.startswith("*")},
                 "part_ptr": "*fp32", "count_ptr": "*i32",
                 **{k: v for k, v in sig.items() if not v.startswith("*")}}
        out.append((fn, dict(s, **{k: "constexpr" for k in c}), c, opts))
    if variant.dtype == "float32":  # TF32 on: every weight's rounded copy, launched first (launch._plan)
        _, c, tf32_opts = tf32_weights_launch(widths, exact)
        tf32_sig = {f"{p}{i}_ptr": f"*{t}" for i in range(n_slots) for p in ("w", "d")}
        out.append((mod.tf32_weights_kernel, {**tf32_sig, **{name: "constexpr" for name in c}}, c, tf32_opts))
    if exact:  # the weight pads a call launches first (launch._plan)
        for width, n, stride in zip(widths, widths[1:], mod.WEIGHT_STRIDES):
            if stride != width:
                _, c, pad_opts = pad_launch(n, width, stride)
                pad_sig = {"src_ptr": f"*{t}", "dst_ptr": f"*{t}", **{name: "constexpr" for name in c}}
                out.append((mod.pad_rows_kernel, pad_sig, c, pad_opts))
    return out
