"""fused_mlp's knobs, the rules a variant obeys, which calls a variant can take
(`variant_fits`), the template context (the unrolled layer/chunk plan of an exact variant)
and what `kgen build` compiles ahead of time."""

from __future__ import annotations

from typing import Any, Mapping

from kgen.spec import Knob, Schema

ACTIVATIONS = ("none", "relu", "sigmoid", "gelu", "silu")
ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
MAX_LAYERS = 8
MAX_WIDTH = 4096
MIN_DOT = 16  # tl.dot's smallest M, N and K


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chunks(width: int, block: int) -> list[dict]:
    """How an exact variant splits `width` columns: `block`-wide chunks, the last one padded
    to a power of two >= 16 (masked where it runs past `width`)."""
    out, start = [], 0
    while start < width:
        rest = width - start
        size = block if rest >= block else max(MIN_DOT, _pow2_at_least(rest))
        out.append({"i": len(out), "start": start, "size": size, "masked": start + size > width})
        start += size
    return out


def _check_variant(backend: str, arch: str | None, dtype: str, k: Mapping[str, Any]):
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
            Knob("num_warps", "w", lo=1, hi=16, pow2=True),
            Knob("num_stages", "s", lo=1, hi=6, default=2),  # generic: the K loop's pipeline depth
        ),
    },
    check=_check_variant,
)
TEMPLATES = {"triton": "fused_mlp/triton.py.j2"}


def template_context(variant) -> dict:
    p = variant.params
    widths = tuple(p["widths"])
    layers = []
    for i in range(len(widths) - 1):
        layers.append({"i": i, "K": widths[i], "N": widths[i + 1], "last": i == len(widths) - 2,
                       "k_chunks": chunks(widths[i], p["block_k"]), "n_chunks": chunks(widths[i + 1], p["block_k"])})
    return {"dtype": variant.dtype, "activations": ACTIVATIONS, "exact": bool(widths), "widths": widths,
            "layers": layers, "max_width": p["max_width"], "max_layers": MAX_LAYERS,
            "block_m": p["block_m"], "block_k": p["block_k"], "num_warps": p["num_warps"],
            "num_stages": p["num_stages"]}


def variant_fits(variant, shape: Mapping[str, Any]) -> bool:
    """Whether `variant` can run a call of `shape` ({"widths": "w0-w1-..." or a tuple, ...})."""
    return fits(variant.params, widths_of(shape["widths"]))


def fits(params: Mapping[str, Any], widths: tuple[int, ...]) -> bool:
    if params["widths"]:
        return tuple(params["widths"]) == widths
    return len(widths) - 1 <= MAX_LAYERS and max(widths) <= params["max_width"]


def widths_of(w) -> tuple[int, ...]:
    return tuple(int(x) for x in w.split("-")) if isinstance(w, str) else tuple(w)


def triton_aot(variant, mod) -> list:
    """What `kgen build` compiles ahead of time: the inference forward (relu, biases), for
    an exact variant at its widths, for a generic one at the DLRM bottom MLP's widths (when
    they fit its bound)."""
    t = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[variant.dtype]
    widths = tuple(variant.params["widths"]) or tuple(w for w in (13, 512, 256, 64, 16))
    widths = tuple(min(w, variant.params["max_width"] or w) for w in widths)
    L = len(widths) - 1
    n_slots = L if variant.params["widths"] else MAX_LAYERS
    sig = {"x_ptr": f"*{t}", "out_ptr": f"*{t}"}
    for i in range(n_slots):
        sig.update({f"w{i}_ptr": f"*{t}", f"b{i}_ptr": f"*{t}", f"z{i}_ptr": f"*{t}"})
    sig["B"] = "i32"
    const = {}
    if not variant.params["widths"]:
        const.update({f"D{i}": (widths[i] if i <= L else 1) for i in range(MAX_LAYERS + 1)})
    const.update({f"HAS_B{i}": i < L for i in range(n_slots)})
    const.update({"ACT": ACT_CODE["relu"], "LAST_ACT": ACT_CODE["none"], "SAVE": False, "SAVE_LAST": False,
                  "PRECISION": "tf32", "BLOCK_M": mod.BLOCK_M})
    if not variant.params["widths"]:
        const.update({"NUM_LAYERS": L, "BLOCK_K": mod.BLOCK_K, "NUM_STAGES": mod.NUM_STAGES})
    sig.update({k: "constexpr" for k in const})
    return [(mod.fused_mlp_fwd_kernel, sig, const, {"num_warps": mod.NUM_WARPS})]
