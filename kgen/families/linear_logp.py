"""linear_logp: logp[i] = log_softmax((hidden[i] @ weight.T + bias) / T)[target[i]].

The family's reference math, input checks, grid sizes, launch functions and autograd. The
Triton kernels live in kgen/templates/linear_logp/triton.py.j2; `mod` below is that
template rendered and imported (module constants BLOCK_N, BLOCK_V, BLOCK_D, NUM_WARPS,
NUM_STAGES, SPLIT_V plus the kernels), or a `CudaForward`: a CUDA variant's forward-partials
kernel (cuda_sm90a.cu.j2: TMA + mbarrier + warp-specialised WGMMA; cuda_sm80.cu.j2:
cp.async + ldmatrix + mma.sync, also built for sm_90) paired with a Triton module that
supplies the combine and the backward. Dispatch takes the forward the tuning table names for
the device, dtype and (N, D, V) bucket, else the CUDA variants whose arch runs on the device
first; inputs they cannot take (D % 8 != 0, pointers off 16-byte alignment) run the Triton
forward of the same pair. The backward's Triton kernels are always spec order's.

Outputs are float32: logp [N], and optionally the entropy [N] of the tempered softmax.
Rows whose target is ignore_index get logp = 0 and entropy = 0, and no gradient.

Forward (O(N) extra memory, the N x V logits never exist):
  1. `linear_logp_fwd_kernel`, grid cdiv(N, BLOCK_N) * splits, split-major order, with
     splits >= SPLIT_V chosen per call to fill whole waves of SMs (triton_splits). Each
     program sweeps V tiles of its slice (tl.dot over D in BLOCK_D steps, float32
     accumulation; the tiles arrive by TMA tensor descriptors where _tma allows, else by
     masked pointer loads) with an online softmax in base 2 and writes float32 partials per row:
     running max, sum of exp, sum of exp * (z - max). Per logit the fold is one FMA,
     z = acc * scale + colterm[j] (colterm: bias * scale, or -1e30 past V), then max,
     exp2 and sums; no target compare.
  2. `linear_logp_combine_kernel`, grid cdiv(N, 16), merges the `splits` partials and takes
     the target logit as one float32 gather-dot (hidden[i] . weight[target[i]] + bias) *
     scale per non-ignored row (2 * D * elsize bytes a row). Exception: float32 inputs
     under TF32 keep the target logit in the fwd fold (a fourth partial, summed by the
     combine), so that it is rounded like the logits; see _target_in_tile.
  The CUDA forwards write all four partials, target logit included; their combine sums
  them (grid cdiv(N, 128)).
  Extra memory: 16 * splits * N bytes of partials, and 8 * N bytes (lse, E[z]) saved.

Backward: recompute by V chunks, no atomics (deterministic). For each chunk [v0, v1):
  dz kernel:  recompute logits, write dz (input dtype) to a workspace [N, chunk] and
              float32 column sums per row tile (for grad_bias);
  dW kernel:  grad_weight[v0:v1] = dz^T @ hidden, the whole N reduction in registers,
              each output tile written once in the output dtype;
  dH kernel:  acc += dz @ weight[v0:v1] into a float32 [N, D] accumulator; the last chunk
              writes grad_hidden in its dtype.
  Why not one fused kernel with atomics: grad_weight would need a float32 [V, D] buffer
  (1.2-2 GiB at the target shapes) and grad_hidden one of N*D*4 bytes; atomics into the
  16-bit outputs would not accumulate in float32. The price of separate passes is that dz
  makes one round trip through the workspace (N*V*elsize written once, read twice: about
  6 GB at 8192 x 128256 bf16) and the float32 accumulator is re-read once per chunk; all
  three kernels stay compute bound at chunk >= ~1000 columns.
  The float32 accumulator: grad_hidden itself when it is float32; a separate buffer when
  N*D*4 <= accumulator_bytes; otherwise it borrows the last ceil(4N/elsize) rows of the
  still-unwritten grad_weight, whose dz is recomputed once more after grad_hidden is done
  (2N/V of one logits GEMM: 5% at 4096 x 151936, 13% at 8192 x 128256); if even that does
  not fit (V < 4N) it falls back to a separate N*D*4-byte buffer, over budget.
  Extra memory: N*chunk*elsize (workspace, chunk = workspace_bytes / (N*elsize) rounded to
  the tile) + cdiv(N, BLOCK_N)*chunk*4 (bias sums) + 8N (row coefficients) [+ N*D*4 when
  the accumulator is a separate buffer]. Defaults: < 64 MiB at the target shapes.

Inputs are made contiguous (a copy when they are not: weight should arrive contiguous);
no pointer alignment is required: 16-bit operands with D % 8 == 0 and 16-byte aligned
bases load their logit tiles by TMA on sm_90+ (the forward and dz kernels), anything else by
pointer loads (Triton specialises on 16-byte alignment by itself).
Float32 inputs use TF32 tensor cores only when torch.backends.cuda.matmul.allow_tf32 is
set, as torch.matmul does. Float16 inputs keep dz in float16 (as eager PyTorch does), so
probabilities below ~6e-8 flush to zero there.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Any, Callable, Mapping, Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from kgen.runtime.streams import current_raw_stream
from kgen.spec import DTYPES, Knob, Schema

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TARGET_DTYPES = (torch.int64, torch.int32)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Rows per program of the combine kernel: 4 * splits loads per row summing the CUDA
# partials; with the target gather-dot (the Triton forward), 2 * D elements per row, so
# fewer rows a program, to spread the N * D reads over more SMs, in TARGET_BLOCK_D-element
# steps along D.
COMBINE_BLOCK = 128
COMBINE_DOT_BLOCK = 16
TARGET_BLOCK_D = 256
# Targets per step of the one-program range check (linear_logp_target_check_kernel).
TARGET_CHECK_BLOCK = 1024
# Tiles of row-major output walked GROUP rows at a time (L2 reuse of the shared panel).
GROUP = 8
# Hidden rows (bytes) a group of CUDA row blocks keeps in L2 while it sweeps V.
GROUP_BYTES = 16 << 20
# Backward budgets (bytes): the dz chunk workspace, and the largest float32 grad_hidden
# accumulator allocated separately before borrowing grad_weight's tail instead.
WORKSPACE_BYTES = 40 << 20
ACCUMULATOR_BYTES = 16 << 20


# Opt-in shared memory per block (bytes) by arch; the pipelined tiles must fit.
_SMEM_LIMIT = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_90a": 232448}
# Shared memory the CUDA kernels keep beside the tile ring: 1024 B of slack to align the
# ring for the 128-byte swizzle, and up to 1024 B of static data (mbarriers, merge
# scratch); the sm_90a kernel adds two bias tiles (4 * block_n bytes).
_CUDA_SMEM_EXTRA = 2048


def _check_triton(dtype: str, k: Mapping[str, Any]):
    smem = k["num_stages"] * (k["block_n"] + k["block_v"]) * k["block_d"] * DTYPES[dtype][0]
    if smem > _SMEM_LIMIT["sm_90a"]:
        return [("num_stages", f"{k['num_stages']} stages of ({k['block_n']} + {k['block_v']}) x "
                               f"{k['block_d']} {dtype} tiles need {smem} bytes of shared memory, "
                               f"above the {_SMEM_LIMIT['sm_90a']}-byte limit")]
    return []


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
    tma = variant.dtype != "float32"  # 16-bit operands load through TMA (_tma) on sm_90+
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


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer a launch returns or reads back comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- reference math


def reference(hidden, weight, target, bias=None, *, temperature: float = 1.0,
              ignore_index: int = -100, compute=torch.float32):
    """(logp, entropy) in `compute` precision (float32: the CPU path; float64: the test
    oracle), shaped like hidden.shape[:-1]. Materialises the N x V logits; differentiable
    through torch autograd."""
    shape = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1]).to(compute)
    logits = h @ weight.to(compute).T
    if bias is not None:
        logits = logits + bias.to(compute)
    logits = logits / temperature
    t = target.reshape(-1).long()
    valid = t != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1) - lse
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    zero = logp.new_zeros(())
    return torch.where(valid, logp, zero).reshape(shape), torch.where(valid, entropy, zero).reshape(shape)


def reference_backward(hidden, weight, target, bias, grad_logp, grad_entropy, temperature: float,
                       ignore_index: int):
    """(grad_hidden, grad_weight, grad_bias or [0]) in float32 with the logits materialised:
    dz = g_logp (onehot - p) - g_ent p (z - E[z]) on valid rows, then / temperature. (The
    CPU path; written out because autograd does not run inside a custom op's kernel.)"""
    f32 = torch.float32
    h, w = hidden.to(f32), weight.to(f32)
    z = h @ w.T
    if bias is not None:
        z = z + bias.to(f32)
    z = z / temperature
    p = torch.softmax(z, dim=-1)
    valid = target != ignore_index
    dz = -p * grad_logp.to(f32)[:, None]
    rows = valid.nonzero().squeeze(1)
    dz[rows, target[rows].long()] += grad_logp.to(f32)[rows]
    if grad_entropy is not None:
        ez = (p * z).sum(-1, keepdim=True)
        dz -= grad_entropy.to(f32)[:, None] * p * (z - ez)
    dz = torch.where(valid[:, None], dz, torch.zeros((), dtype=f32)) / temperature
    gb = dz.sum(0).to(bias.dtype) if bias is not None else hidden.new_empty(0)
    return (dz @ w).to(hidden.dtype), (dz.T @ h).to(weight.dtype), gb


# --------------------------------------------------------------------------- input checks


def check_inputs(hidden, weight, target, bias, temperature, ignore_index) -> None:
    """Dtypes, shapes, devices and scalars; raises TypeError/ValueError naming the argument.
    Never touches tensor values (safe on fake tensors); see check_target_range."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_logp: {name} must be a tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"linear_logp: bias must be a tensor or None, got {type(bias).__name__}")
    if hidden.dtype not in _DTYPES:
        raise TypeError(f"linear_logp: hidden has dtype {hidden.dtype}; supported: float32, bfloat16, float16")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"linear_logp: weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if bias is not None and bias.dtype != hidden.dtype:
        raise TypeError(f"linear_logp: bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}")
    if target.dtype not in _TARGET_DTYPES:
        raise TypeError(f"linear_logp: target has dtype {target.dtype}; expected torch.int64 (or int32)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"linear_logp: temperature must be a float, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"linear_logp: temperature must be finite and > 0, got {temperature}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"linear_logp: ignore_index must be an int, got {type(ignore_index).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"linear_logp: weight must be 2-D [V, D], got shape {tuple(weight.shape)}")
    V, D = weight.shape
    if V == 0 or D == 0:
        raise ValueError(f"linear_logp: weight has shape {tuple(weight.shape)}; V and D must be >= 1")
    if hidden.dim() < 1 or hidden.shape[-1] != D:
        raise ValueError(f"linear_logp: hidden has shape {tuple(hidden.shape)}; its last dimension "
                         f"must be D = {D} (weight is [V, D] = {tuple(weight.shape)})")
    n = hidden.numel() // D
    if target.shape != hidden.shape[:-1] and not (target.dim() == 1 and target.shape[0] == n):
        raise ValueError(f"linear_logp: target has shape {tuple(target.shape)}; expected "
                         f"{tuple(hidden.shape[:-1])} (hidden's leading dims) or ({n},)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != V):
        raise ValueError(f"linear_logp: bias has shape {tuple(bias.shape)}; expected ({V},), V of weight")
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"linear_logp: {name} is on {t.device}, hidden on {hidden.device}; "
                             "all tensors must be on one device")


def check_target_range(target: torch.Tensor, V: int, ignore_index: int, kernels=None) -> Callable[[], None]:
    """Queues the check that target is in [0, V) or == ignore_index and returns the function
    that waits for it and raises ValueError if it failed. Call that function after queueing
    the kernels: the host then waits for the check alone (a flag copied to pinned memory and
    an event recorded right after it), with the kernels already queued behind it, so the
    GPU does not idle while the host waits and launches. `kernels`: a Triton module whose
    linear_logp_target_check_kernel does the check in one launch (else torch ops, ~7).
    Waiting before launching left the GPU idle for the host's whole launch path: 1.5-3 %
    of the op's time at (4096, 2048, 151936) on an H100 (BENCHMARKS.md). The kernels index
    memory with target only inside [0, V), so a bad value gives a wrong row, never a bad
    access, and the error is raised before any row is returned. Skipped during CUDA graph
    capture, where a host wait is illegal."""
    def out_of_range() -> torch.Tensor:
        return ((target < 0) | (target >= V)) & (target != ignore_index)

    n = target.numel()
    if n == 0 or (target.is_cuda and torch.cuda.is_current_stream_capturing()):
        return lambda: None
    done = None
    if not target.is_cuda:
        flag = out_of_range().any()
    else:
        if kernels is not None:
            found = torch.empty(1, dtype=torch.int32, device=target.device)
            kernels.linear_logp_target_check_kernel[(1,)](target, found, n, V, ignore_index, BLOCK=TARGET_CHECK_BLOCK)
        else:
            found = out_of_range().any()
        flag = torch.empty(found.shape, dtype=found.dtype, pin_memory=True).copy_(found, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

    def finish() -> None:
        if done is not None:
            done.synchronize()
        if bool(flag):
            bad = out_of_range()
            first = int(target.reshape(-1)[bad.reshape(-1)][0])
            raise ValueError(f"linear_logp: target holds {first}, outside [0, {V}) and not "
                             f"ignore_index ({ignore_index})")

    return finish


# --------------------------------------------------------------------------- grids and launch


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # what tl.dot uses by default; only float32 inputs read it


def _target_in_tile(dtype: torch.dtype, precision: str) -> bool:
    """Whether the Triton forward keeps the target logit in its V sweep instead of the
    combine's float32 gather-dot. The gather-dot equals the tile's logit up to float32
    summation order when the tile dot multiplies exactly in float32: 16-bit operands (exact
    products) or float32 under "ieee". A TF32 dot rounds float32 operands to 10 mantissa
    bits (~1e-3 relative per product), which the gather-dot would not, and logp = z_t - lse
    would mix two roundings (logp > 0 for a dominant target); that case keeps the fold."""
    return dtype == torch.float32 and precision == "tf32"


def fwd_grid(mod, N: int, splits: int) -> tuple[int]:
    return (_cdiv(N, mod.BLOCK_N) * splits,)


def wave_splits(rows: int, minimum: int, tiles: int, resident: int) -> int:
    """V splits for a grid of `rows` row blocks x splits, `resident` of which run at once:
    at least `minimum`, raised to the fewest that fill whole waves (rows * splits a
    multiple of resident) or make 16 waves or more, so that no SM idles through a partial
    last wave; at most one V tile (of `tiles`) per split. E.g. on a 132-SM H100 at
    N = 8192 with 128-row blocks: 4 splits give 256 programs, 1.94 waves; 33 give 2112,
    16 waves. At N = 1: 132 splits."""
    per_wave = resident // math.gcd(rows, resident)  # splits per whole wave
    whole = _cdiv(minimum, per_wave) * per_wave
    many = max(minimum, _cdiv(16 * resident, rows))
    return max(1, min(whole, many, tiles))


@functools.cache
def _device_props(index: int):
    """torch.cuda.get_device_properties, once per device (SM count, capability): read on
    every launch."""
    return torch.cuda.get_device_properties(index)


# Module switch: False makes the Triton kernels load logit tiles with pointers even where
# TMA applies (tests run both paths).
TMA = True


def _tma(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton forward and dz kernels load their logit tiles through TMA tensor
    descriptors: 16-bit operands whose rows are whole 16-byte units from 16-byte aligned
    bases (TMA's rules), on an sm_90+ GPU or in the interpreter. Measured on an H100 at
    (8192, 4096, 128256) bf16: forward 13.3 ms against 17.0 ms with pointer loads
    (BENCHMARKS.md). float32 keeps pointer loads: its 64-column boxes are 256 bytes wide,
    past the 128-byte swizzle span."""
    if not TMA or hidden.element_size() != 2 or (hidden.shape[1] * 2) % 16:
        return False
    if hidden.data_ptr() % 16 or weight.data_ptr() % 16:
        return False
    dev = hidden.device
    if dev.type != "cuda":
        return True  # TRITON_INTERPRET: the interpreter emulates descriptor loads
    return _device_props(dev.index).major >= 9


def _tile_sources(mod, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[Any, Any, bool]:
    """(h_src, w_src, TMA) for _logit_tile: descriptors with the variant's boxes, or the
    tensors themselves (pointer loads)."""
    if not _tma(hidden, weight):
        return hidden, weight, False
    return (TensorDescriptor.from_tensor(hidden, [mod.BLOCK_N, mod.BLOCK_D]),
            TensorDescriptor.from_tensor(weight, [mod.BLOCK_V, mod.BLOCK_D]), True)


def triton_splits(mod, N: int, V: int, device: torch.device) -> int:
    """V splits of the Triton forward for this call: wave_splits with one resident program
    per SM and the variant's SPLIT_V as the minimum. Off the GPU (the interpreter): SPLIT_V,
    as the spec says (tests use it to make slices empty)."""
    if device.type != "cuda":
        return mod.SPLIT_V
    sms = _device_props(device.index).multi_processor_count
    return wave_splits(_cdiv(N, mod.BLOCK_N), mod.SPLIT_V, _cdiv(V, mod.BLOCK_V), sms)


def combine_grid(N: int, block: int = COMBINE_BLOCK) -> tuple[int]:
    return (_cdiv(N, block),)


def dz_grid(mod, N: int, width: int) -> tuple[int]:
    return (_cdiv(N, mod.BLOCK_N) * _cdiv(width, mod.BLOCK_V),)


def dw_grid(mod, width: int, D: int) -> tuple[int]:
    return (_cdiv(width, mod.BLOCK_V) * _cdiv(D, mod.BLOCK_N),)


def dh_grid(mod, N: int, D: int) -> tuple[int]:
    return (_cdiv(N, mod.BLOCK_N) * _cdiv(D, mod.BLOCK_V),)


def _tiles(mod) -> dict:
    return dict(BLOCK_N=mod.BLOCK_N, BLOCK_V=mod.BLOCK_V, BLOCK_D=mod.BLOCK_D,
                num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)


class CudaForward:
    """A CUDA variant (sm_90a WGMMA or sm_80 mma.sync): its kernel writes the forward
    partials; the Triton module `triton` supplies the combine, the backward, and the whole
    forward for inputs the CUDA kernel cannot take (`takes`): D not a multiple of 8 or a
    pointer not 16-byte aligned (TMA and cp.async move 16-byte pieces).

    The number of splits is chosen per call by wave_splits, with the spec's split_v as the
    minimum, over row groups (the `cluster` row blocks one cluster takes) and the clusters
    the SMs hold at once."""

    def __init__(self, kernel, triton_mod):
        self.kernel, self.triton = kernel, triton_mod
        p = kernel.params
        self.block_m, self.block_n, self.split_v = p["block_m"], p["block_n"], p["split_v"]
        self.rows = self.block_m * p.get("cluster", 1)  # rows of hidden per cluster
        self.name = kernel.name
        self._resident: dict[int, int] = {}

    def takes(self, hidden, weight, bias) -> bool:
        if hidden.dtype not in (torch.bfloat16, torch.float16) or hidden.shape[1] % 8:
            return False
        # TMA (sm_90a) reads the bias too; the sm_80 kernel reads it element by element.
        tensors = (hidden, weight, bias) if self.kernel.variant.arch == "sm_90a" else (hidden, weight)
        return all(t.data_ptr() % 16 == 0 for t in tensors if t is not None)

    def splits(self, N: int, V: int, device: torch.device) -> int:
        if device.index not in self._resident:
            props = _device_props(device.index)
            self._resident[device.index] = self._ctas_per_sm(props) * props.multi_processor_count
        clusters = self._resident[device.index] * self.block_m // self.rows
        return wave_splits(_cdiv(N, self.rows), self.split_v, _cdiv(V, self.block_n), clusters)

    def _ctas_per_sm(self, props) -> int:
        """CTAs of this kernel one SM holds at once, by shared memory and registers."""
        v = self.kernel.variant
        if v.arch == "sm_90a":
            return 1  # __launch_bounds__(threads, 1) and ~225 KB of rings
        smem = _cuda_smem(v.arch, v.dtype, v.params)
        per_sm_smem = getattr(props, "shared_memory_per_multiprocessor", smem)
        resources = self.kernel.entry.manifest.get("resources", {})
        regs = max((r["registers"] for r in resources.values()), default=255)
        threads = 128 * v.params["consumers"]
        return max(1, min(per_sm_smem // smem, 65536 // (threads * max(regs, 1))))

    def group(self, N: int, D: int) -> int:
        """Row groups (a cluster's row blocks) per group of the CUDA grid order: as many as
        keep the group's hidden rows within GROUP_BYTES of L2 (see the sm_90a template's
        work-order comment)."""
        return max(1, min(_cdiv(N, self.rows), GROUP_BYTES // (self.rows * D * 2)))

    def partials(self, hidden, weight, target, bias, temperature: float, with_entropy: bool, splits: int):
        N, D = hidden.shape
        V = weight.shape[0]
        dev = hidden.device
        part = _empty((4, splits, N), torch.float32, dev)
        target = target if target.dtype == torch.int64 else target.long()
        k = self.kernel
        rc = k.raw(k.ptr, dev.index, hidden.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else 0,
                   target.data_ptr(), part.data_ptr(), N, V, D, splits, self.group(N, D), with_entropy,
                   current_raw_stream(dev.index), LOG2E / temperature)
        if rc:
            k.fail(rc)
        return part


def forward(mod, hidden, weight, target, bias, temperature: float, ignore_index: int,
            with_entropy: bool, *, splits: Optional[int] = None):
    """Launch the forward on checked, contiguous hidden [N, D], weight [V, D], target [N],
    bias [V] or None. Returns (logp [N], entropy [N] or [0], lse2 [N], ez2 [N] or [0]),
    all float32; lse2 and ez2 are the base-2 log-sum-exp and mean logit the backward needs.
    `splits` overrides the per-call choice of splits (tests of split invariance)."""
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    f32 = torch.float32
    n_ent = N if with_entropy else 0
    logp, entropy = _empty((N,), f32, dev), _empty((n_ent,), f32, dev)
    lse2, ez2 = _empty((N,), f32, dev), _empty((n_ent,), f32, dev)
    if N == 0:
        return logp, entropy, lse2, ez2
    scale = LOG2E / temperature
    if isinstance(mod, CudaForward):
        if not mod.takes(hidden, weight, bias):
            return forward(mod.triton, hidden, weight, target, bias, temperature, ignore_index, with_entropy)
        splits = splits or mod.splits(N, V, dev)
        part = mod.partials(hidden, weight, target, bias, temperature, with_entropy, splits)
        combine = mod.triton.linear_logp_combine_kernel
        target_dot = False  # the CUDA kernels write the target logit partials
    else:
        splits = splits or triton_splits(mod, N, V, dev)
        prec = _precision(hidden.dtype)
        target_dot = not _target_in_tile(hidden.dtype, prec)
        part = _empty((4, splits, N), f32, dev)  # plane 2 unwritten when target_dot
        h_src, w_src, tma = _tile_sources(mod, hidden, weight)
        mod.linear_logp_fwd_kernel[fwd_grid(mod, N, splits)](
            h_src, w_src, bias if bias is not None else weight, target, part,
            N, V, D, splits, scale,
            HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, TARGET_IN_TILE=not target_dot,
            PRECISION=prec, TMA=tma, **_tiles(mod))
        combine = mod.linear_logp_combine_kernel
    block = COMBINE_DOT_BLOCK if target_dot else COMBINE_BLOCK
    combine[combine_grid(N, block)](
        part, target, hidden, weight, bias if bias is not None else weight,
        logp, entropy if with_entropy else logp, lse2, ez2 if with_entropy else lse2,
        N, V, D, splits, ignore_index, scale,
        WITH_ENTROPY=with_entropy, TARGET_DOT=target_dot, HAS_BIAS=bias is not None,
        BLOCK=block, BLOCK_D=TARGET_BLOCK_D)
    return logp, entropy, lse2, ez2


def _chunks(begin: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(v, min(v + size, end)) for v in range(begin, end, size)]


def backward(mod, hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy,
             temperature: float, ignore_index: int, *, workspace_bytes: Optional[int] = None,
             accumulator_bytes: Optional[int] = None):
    """Gradients (hidden [N, D], weight [V, D], bias [V] or None) in the input dtype, from
    the forward's lse2/ez2 and the upstream gradients (grad_entropy None when the entropy
    was not requested; grad_logp None means zeros). Budgets default to WORKSPACE_BYTES and
    ACCUMULATOR_BYTES; chunking and the accumulator's home: see the module docstring."""
    if isinstance(mod, CudaForward):
        mod = mod.triton
    workspace_bytes = WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    accumulator_bytes = ACCUMULATOR_BYTES if accumulator_bytes is None else accumulator_bytes
    N, D = hidden.shape
    V = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    grad_h = _empty((N, D), dtype, dev)
    grad_w = _empty((V, D), dtype, dev)
    grad_b = _empty((V,), dtype, dev) if bias is not None else None
    if N == 0:
        grad_w.zero_()
        if grad_b is not None:
            grad_b.zero_()
        return grad_h, grad_w, grad_b

    with_entropy = grad_entropy is not None
    valid = target != ignore_index
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    ca = torch.where(valid, grad_logp.float() / temperature, zero) if grad_logp is not None else \
        torch.zeros((N,), dtype=torch.float32, device=dev)
    cb = torch.where(valid, grad_entropy.float() * (LN2 / temperature), zero) if with_entropy else ca

    esize = hidden.element_size()
    granule = max(mod.BLOCK_V, mod.BLOCK_D)
    chunk = workspace_bytes // (N * esize) // granule * granule
    chunk = min(max(chunk, granule), _cdiv(V, granule) * granule)

    # The float32 grad_hidden accumulator and `alias_from`, the first vocab row whose
    # grad_weight waits until the accumulator is done with the memory it borrows.
    alias_from = V
    if dtype == torch.float32:
        acc = grad_h
    elif N * D * 4 <= accumulator_bytes:
        acc = _empty((N, D), torch.float32, dev)
    else:
        start = (V - _cdiv(4 * N, esize)) // granule * granule
        if 2 * start >= V:
            alias_from = start
            acc = grad_w.view(-1)[start * D:start * D + N * D * 4 // esize].view(torch.float32).view(N, D)
        else:
            acc = _empty((N, D), torch.float32, dev)

    dz = _empty((N, chunk), dtype, dev)
    bpart = _empty((_cdiv(N, mod.BLOCK_N), chunk), torch.float32, dev) if bias is not None else dz
    prec = _precision(dtype)
    common = dict(PRECISION=prec, GROUP=GROUP, **_tiles(mod))

    h_src, w_src, tma = _tile_sources(mod, hidden, weight)

    def dz_pass(v0, v1, write_bpart):
        mod.linear_logp_bwd_dz_kernel[dz_grid(mod, N, v1 - v0)](
            h_src, w_src, bias if bias is not None else weight, target, lse2,
            ez2 if with_entropy else lse2, ca, cb, dz, bpart,
            N, V, D, v0, v1, chunk, LOG2E / temperature,
            HAS_BIAS=bias is not None, WRITE_BPART=write_bpart, WITH_ENTROPY=with_entropy, TMA=tma, **common)
        if write_bpart:
            grad_b[v0:v1] = bpart[:, :v1 - v0].sum(0)

    def dw_pass(v0, v1):
        mod.linear_logp_bwd_dw_kernel[dw_grid(mod, v1 - v0, D)](
            dz, hidden, grad_w, N, D, v0, v1, chunk, **common)

    chunks = _chunks(0, alias_from, chunk) + _chunks(alias_from, V, chunk)
    for i, (v0, v1) in enumerate(chunks):
        dz_pass(v0, v1, bias is not None)
        if v1 <= alias_from:
            dw_pass(v0, v1)
        mod.linear_logp_bwd_dh_kernel[dh_grid(mod, N, D)](
            dz, weight, acc, grad_h, N, D, v0, v1, chunk,
            ACCUMULATE=i > 0, FINAL=i == len(chunks) - 1, **common)
    for v0, v1 in _chunks(alias_from, V, chunk):  # grad_hidden is final: the tail is free
        dz_pass(v0, v1, False)
        dw_pass(v0, v1)
    return grad_h, grad_w, grad_b


# --------------------------------------------------------------------------- kernel choice


_FORCED = threading.local()
_MODULES: dict = {}


def implementation(kernel, companion=None):
    """What the op runs for a loaded variant: a Triton variant's module, or a CUDA variant
    wrapped with its Triton companion (`companion`: a loaded Triton variant; default:
    dispatch's first Triton choice for the device and dtype)."""
    if kernel is None or kernel.backend == "triton":
        return kernel.module if kernel is not None else None
    if companion is None:
        from kgen.runtime import dispatch

        companion = dispatch.select("linear_logp", torch.device("cuda", torch.cuda.current_device()),
                                    kernel.variant.dtype, backend="triton")
        if companion is None:
            raise RuntimeError(f"linear_logp: no Triton variant for {kernel.variant.dtype} could be built "
                               f"to combine the partials of {kernel.name}")
    return CudaForward(kernel, companion.module)


@contextlib.contextmanager
def using(mod):
    """Run the op with this implementation (`implementation(kernel)`, a Triton variant's
    `.module`, or None: the PyTorch reference) instead of dispatch's choice, in this
    thread. For tests and benchmarks."""
    saved = getattr(_FORCED, "mod", _FORCED)
    _FORCED.mod = mod
    try:
        yield
    finally:
        if saved is _FORCED:
            del _FORCED.mod
        else:
            _FORCED.mod = saved


def _module(device: torch.device, dtype: torch.dtype, shape: Optional[tuple[int, int, int]] = None):
    """The implementation for (device, dtype) and, given the (N, D, V) of a forward, its
    shape bucket (the tuning table's winner there, else spec order); without a shape, spec
    order (the backward: its Triton kernels are not tuned). None means the PyTorch
    reference (CPU tensors, no variant could be built, or the reference won the tuning)."""
    forced = getattr(_FORCED, "mod", _FORCED)
    if forced is not _FORCED:
        return forced
    if device.type != "cuda":
        return None
    key = (device.index, dtype) if shape is None else (device.index, dtype, *(
        (n - 1).bit_length() for n in shape))
    mod = _MODULES.get(key, _FORCED)
    if mod is _FORCED:
        mod = _MODULES[key] = _choose(device, dtype, shape)
    return mod


def _choose(device: torch.device, dtype: torch.dtype, shape):
    from kgen.runtime import dispatch

    name = str(dtype).removeprefix("torch.")
    if shape is None:
        kernel = dispatch.select("linear_logp", device, name)
    else:
        dims = dict(zip(TUNE_DIMS, shape))
        kernel, _ = dispatch.choose("linear_logp", device, name, tune_bucket(**dims), dims)
    companion = None
    if kernel is not None and kernel.backend == "cuda":
        companion = dispatch.select("linear_logp", device, name, backend="triton")
        if companion is None:  # nothing to combine with: the reference serves
            kernel = None
    return implementation(kernel, companion) if kernel is not None else None


# --------------------------------------------------------------------------- tuning

# Buckets: N, D and V each rounded up to a power of two. Bias, entropy and temperature are
# not in the bucket: they add O(N + V) work that every variant does alike.
TUNE_DIMS = ("N", "D", "V")
TUNE_SHAPES = tuple({"N": n, "D": d, "V": v}
                    for d, v in ((2048, 151936), (4096, 128256), (1024, 32000), (3000, 50257))
                    for n in (1, 8, 64, 512, 4096))
# The reference materialises float32 logits and their softmax: a candidate only where that
# stays within the op's extra-memory promise (module doc: < 64 MiB).
_REFERENCE_TUNE_BYTES = 64 << 20


def tune_bucket(N: int, D: int, V: int) -> str:
    return ".".join(f"{k}<={1 << (n - 1).bit_length()}" for k, n in zip(TUNE_DIMS, (N, D, V)))


def tune_inputs(device, dtype: str, N: int, D: int, V: int) -> dict:
    t = getattr(torch, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    return {"hidden": (torch.randn(N, D, device=device, generator=g) * 0.5).to(t),
            "weight": (torch.randn(V, D, device=device, generator=g) * D ** -0.5).to(t),
            "target": torch.randint(0, V, (N,), device=device, generator=g)}


def tune_runner(kernel, inputs: dict):
    """One forward (no bias, no entropy) of `kernel` (None: the reference); outputs are
    fresh allocations."""
    h, w, t = inputs["hidden"], inputs["weight"], inputs["target"]
    if kernel is None:
        if h.shape[0] * w.shape[0] * 8 > _REFERENCE_TUNE_BYTES:
            raise ValueError(f"the reference's logits would take over {_REFERENCE_TUNE_BYTES >> 20} MiB")
        return lambda: reference(h, w, t)
    mod = implementation(kernel)
    return lambda: forward(mod, h, w, t, None, 1.0, -100, False)


# --------------------------------------------------------------------------- torch.library


def _forward_impl(hidden, weight, target, bias, temperature: float, ignore_index: int, with_entropy: bool):
    """The forward op's implementation: 2-D hidden, 1-D target. Returns (logp [N], entropy
    [N] or [0], lse2 [N], ez2 [N] or [0]); the last two are what the backward needs (unused
    on the reference path)."""
    check_inputs(hidden, weight, target, bias, temperature, ignore_index)
    mod = _module(hidden.device, hidden.dtype, (hidden.shape[0], hidden.shape[1], weight.shape[0]))
    target = target.contiguous()
    checked = check_target_range(target, weight.shape[0], ignore_index,
                                 mod.triton if isinstance(mod, CudaForward) else mod)
    if mod is not None:
        out = forward(mod, hidden.contiguous(), weight.contiguous(), target,
                      bias.contiguous() if bias is not None else None, temperature, ignore_index, with_entropy)
        checked()
        return out
    checked()  # before the reference, which indexes with target
    logp, entropy = reference(hidden, weight, target, bias, temperature=temperature, ignore_index=ignore_index)
    N, n_ent = hidden.shape[0], hidden.shape[0] if with_entropy else 0
    f32 = torch.float32
    return (logp, entropy if with_entropy else entropy.new_empty(0),
            torch.zeros(N, dtype=f32, device=hidden.device), torch.zeros(n_ent, dtype=f32, device=hidden.device))


@torch.library.custom_op("kgen::linear_logp", mutates_args=())
def _op(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
        temperature: float, ignore_index: int, with_entropy: bool
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """2-D hidden, 1-D target; see _forward_impl."""
    return _forward_impl(hidden, weight, target, bias, temperature, ignore_index, with_entropy)


@_op.register_fake
def _op_fake(hidden, weight, target, bias, temperature, ignore_index, with_entropy):
    check_inputs(hidden, weight, target, bias, temperature, ignore_index)
    N, n_ent = hidden.shape[0], hidden.shape[0] if with_entropy else 0
    new = lambda n: hidden.new_empty((n,), dtype=torch.float32)  # noqa: E731
    return new(N), new(n_ent), new(N), new(n_ent)


def _backward_impl(hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy,
                   temperature: float, ignore_index: int):
    """(grad_hidden, grad_weight, grad_bias or [0]) by recomputation; see the module doc."""
    mod = _module(hidden.device, hidden.dtype)
    if mod is not None:
        gh, gw, gb = backward(mod, hidden.contiguous(), weight.contiguous(), target.contiguous(),
                              bias.contiguous() if bias is not None else None, lse2, ez2,
                              grad_logp.contiguous(), None if grad_entropy is None else grad_entropy.contiguous(),
                              temperature, ignore_index)
        return gh, gw, gb if gb is not None else hidden.new_empty(0)
    return reference_backward(hidden, weight, target, bias, grad_logp, grad_entropy, temperature, ignore_index)


@torch.library.custom_op("kgen::linear_logp_backward", mutates_args=())
def _bwd_op(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
            lse2: torch.Tensor, ez2: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
            temperature: float, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy, temperature,
                          ignore_index)


@_bwd_op.register_fake
def _bwd_op_fake(hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy, temperature, ignore_index):
    return (torch.empty_like(hidden), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, temperature, ignore_index, with_entropy = inputs
    _, _, lse2, ez2 = output
    ctx.save_for_backward(hidden, weight, target, bias, lse2, ez2)
    ctx.temperature, ctx.ignore_index, ctx.with_entropy = temperature, ignore_index, with_entropy
    ctx.has_bias = bias is not None
    ctx.forced = getattr(_FORCED, "mod", _FORCED)  # `using(mod)` holds for the backward too


def _backward(ctx, grad_logp, grad_entropy, _grad_lse2, _grad_ez2, backward_op=None):
    hidden, weight, target, bias, lse2, ez2 = ctx.saved_tensors
    backward_op = backward_op or torch.ops.kgen.linear_logp_backward
    with using(ctx.forced) if ctx.forced is not _FORCED else contextlib.nullcontext():
        gh, gw, gb = backward_op(hidden, weight, target, bias, lse2, ez2, grad_logp,
                                 grad_entropy if ctx.with_entropy else None, ctx.temperature, ctx.ignore_index)
    return gh, gw, None, gb if ctx.has_bias else None, None, None, None


class _Eager(torch.autograd.Function):
    """The op in eager mode with autograd: the same implementation and backward as the
    registered op, called directly. Calling a torch.library op the first time imports
    torch._dynamo (its kernels are wrapped in `_disable_dynamo`): seconds of start-up a
    process that never compiles should not pay. Under torch.compile the registered op runs."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, temperature, ignore_index, with_entropy):
        out = _forward_impl(hidden, weight, target, bias, temperature, ignore_index, with_entropy)
        _setup_context(ctx, (hidden, weight, target, bias, temperature, ignore_index, with_entropy), out)
        ctx.mark_non_differentiable(out[2], out[3])
        return out

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_lse2, grad_ez2):
        return _backward(ctx, grad_logp, grad_entropy, grad_lse2, grad_ez2, backward_op=_backward_impl)


_op.register_autograd(_backward, setup_context=_setup_context)


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: Optional[torch.Tensor] = None, *, temperature: float = 1.0,
                ignore_index: int = -100, return_entropy: bool = False):
    """logp = log_softmax((hidden @ weight.T + bias) / temperature)[target] per row, float32,
    shaped like hidden.shape[:-1]; with return_entropy, (logp, entropy) where entropy is
    that of the tempered softmax. Rows with target == ignore_index give 0 for both and no
    gradient. Differentiable for hidden, weight and bias under any upstream gradients.

    The N x V logits are not materialised on CUDA (extra memory in the module docstring,
    < 64 MiB at N=8192, V=128256) except where the tuning table found the PyTorch reference
    fastest, which it may only where those logits take under 64 MiB; CPU tensors use the
    float32 PyTorch reference. In eager mode the implementation is called directly (an
    autograd.Function when a gradient is needed), under torch.compile the registered op. Dtypes, shapes and devices are checked before any launch; target's range by
    one device reduction queued before the kernels and waited for after them (one host wait
    per call, skipped during CUDA graph capture): a target outside [0, V) that is not
    ignore_index raises ValueError. Also registered as
    torch.ops.kgen.linear_logp (2-D hidden, 1-D target, four outputs).
    """
    check_inputs(hidden, weight, target, bias, temperature, ignore_index)
    D = weight.shape[1]
    shape = hidden.shape[:-1]
    args = (hidden.reshape(-1, D), weight, target.reshape(-1), bias, float(temperature), int(ignore_index),
            bool(return_entropy))
    if torch.compiler.is_compiling():
        logp, entropy, _, _ = torch.ops.kgen.linear_logp(*args)
    elif torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                      or (bias is not None and bias.requires_grad)):
        logp, entropy, _, _ = _Eager.apply(*args)
    else:
        logp, entropy, _, _ = _forward_impl(*args)
    logp = logp.reshape(shape)
    return (logp, entropy.reshape(shape)) if return_entropy else logp


OPS = {"linear_logp": linear_logp}


# --------------------------------------------------------------------------- golden numerics

# Gradients vs float64, judged against the largest gradient element: 16-bit inputs round
# dz to 16 bits before the two gradient GEMMs and round the outputs (2^-9 bf16, 2^-12
# fp16 per element, summed over V or N): observed up to 1.3e-2 of scale for bf16, 8e-4 fp16.
GRAD_TOL = {"float32": 2e-5, "float16": 5e-3, "bfloat16": 3e-2}


def golden(kernel, device, dtype: str, tol) -> list[tuple[str, float]]:
    """Forward (logp, entropy) and gradients of one loaded variant against float64 on fresh
    random inputs of awkward sizes, with bias, ignored rows, temperature 0.7 and random
    upstream gradients; returns (case, worst error / tolerance) per output."""
    tdtype = getattr(torch, dtype)
    sizes = [(1, 50, 16), (7, 257, 40), (33, 1000, 72)]
    if device.type == "cuda":
        sizes += [(300, 5003, 264), (1, 50257, 2048)]
    results = []
    impl = implementation(kernel)
    for N, V, D in sizes:
        h = torch.randn(N, D, device=device).to(tdtype)
        w = (torch.randn(V, D, device=device) * (2.0 / math.sqrt(D))).to(tdtype)
        b = (torch.randn(V, device=device) * 0.5).to(tdtype)
        t = torch.randint(0, V, (N,), device=device)
        t[::3] = -100 if N > 1 else t[::3]
        g_logp, g_ent = torch.randn(N, device=device), torch.randn(N, device=device)
        outs = []
        for mod, compute in ((impl, None), (None, torch.float64)):
            leaves = [x.clone().requires_grad_() for x in (h, w, b)]
            if compute is None:
                with using(mod):
                    logp, ent = linear_logp(*leaves[:2], t, leaves[2], temperature=0.7, return_entropy=True)
            else:
                logp, ent = reference(*leaves[:2], t, leaves[2], temperature=0.7, compute=compute)
            ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
            outs.append([logp, ent] + [x.grad for x in leaves])
        for name, got, want in zip(("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"), *outs):
            want = want.detach().double()
            if name.startswith("grad"):
                bound = GRAD_TOL[dtype] * max(1.0, float(want.abs().max()))
            else:
                bound = tol.atol + tol.rtol * want.abs()
            err = (got.detach().double() - want).abs() / bound
            worst = float(err.max()) if err.numel() and not torch.isnan(err).any() else (
                0.0 if not err.numel() else float("inf"))
            results.append((f"N={N} V={V} D={D} {name}", worst))
    return results
