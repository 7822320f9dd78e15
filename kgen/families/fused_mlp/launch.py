"""How fused_mlp's Triton kernels run.

Forward (one launch, grid = cdiv(B, BLOCK_M) programs): each program owns BLOCK_M rows of
x and runs every layer on them (templates/fused_mlp/triton.py.j2). An exact variant reads a
large weight whose rows are not whole 16-byte vectors (DLRM top's 367-wide W0) at a rounded-up
stride (WEIGHT_STRIDES), from a zero-padded copy that a pad_rows_kernel launch before the
forward writes into the call's scratch (`_scratch`). Float32 with TF32 on, every variant
reads every weight from a TF32-rounded copy (cuBLAS's rounding; the tensor cores would
truncate), all written by one tf32_weights_kernel launch before the forward into the same
scratch, and the kernel rounds its activation operands itself. An exact variant keeps its
activations on chip as its plan says (schema.plan: a wide hidden layer streamed chunk by
chunk into the next layer's accumulator), with a B x width scratch pair only for layers too
wide for that (SCRATCH_WIDTH; 0 for the DLRM MLPs but in float32's TF32-off kernel, which
`forward` picks by precision); a generic one writes each hidden layer's z row tile to a
scratch of B x width elements in x's dtype (two buffers, alternating by layer; the program
reads back only its own rows after a barrier, so the tile stays in L1/L2) and applies the
activation when the next layer loads it. A scratch region is only ever written at one row
width (`hidden_regions`; the exact kernels' rows SCRATCH_WIDTH apart), so that each
program's rows are its own at every layer: a buffer written again by a narrower layer put a
program's rows onto other programs' wider rows, which they could still be reading (wrong
rows at random, 3-5e-2 in float32, where a grid's programs all ran at once). With `save`, every layer's z that the
backward needs goes to its own [B, width] buffer instead (the generic kernel's scratch is
then those buffers).

Backward: the op's runs the forward again with `save` (`saved`; the eager composition saves
z on the reference path), then the training fast path's backward (train.gradients: the fused
backward, fused_backward.py, or reference.backward_lean) on those zs; `backward` (with
KGEN_FUSED_MLP_FAST_TRAIN=0, tests) reference.backward's per-layer GEMMs through PyTorch
(deterministic). The eager training fast path (train.py) launches the forward with `save`
once through `direct(..., save=True)` and runs train.gradients on its zs.
"""

from __future__ import annotations

import torch

from kgen.families.fused_mlp.cuda import CudaMLP, row_stride
from kgen.families.fused_mlp.reference import backward as torch_backward
from kgen.families.fused_mlp.schema import ACT_CODE, MAX_LAYERS, pad_launch, tf32_weights_launch
from kgen.runtime import triton_launch
from kgen.runtime.op import prototype


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 uses TF32 only where torch.matmul would; with TF32
    off, "tf32x3" (three TF32 products per step, float32's accuracy at tensor-core speed), not
    "ieee", an FMA loop Triton compiles with a local-memory stack (as linear_logp's plans)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "tf32x3"
    return "tf32"


def grid(B: int, mod) -> tuple[int]:
    return (-(-B // mod.BLOCK_M),)


def forward(mod, x, weights, biases, activation: str, last_activation: str, save: bool = False, out=None):
    """Run one variant's forward (`mod`: its rendered module) on checked, contiguous 2-D x
    [B, w0] and weights (a row-padded one read in place where the kernel can: `in_place`,
    cuda.row_stride; any other layout copied contiguous; the TMA ring launcher copies the dense weights whose rows
    are not whole 16-byte vectors row-padded, CudaMLP.scratch); returns (out [B, wL], zs), zs what
    the backward needs when `save` (None where it needs none), else []: each layer's
    pre-activation z, but a ReLU layer's output relu(z), as reference.eager keeps them.
    `out`: a given [B, wL] output buffer (golden passes a poisoned one). The launch goes
    through kgen.runtime.triton_launch (Triton's own launch the first time per specialisation)."""
    if type(mod) is CudaMLP:  # the CUDA cluster variant: inference calls it takes, else its companion
        weights = [w if row_stride(w) is not None else w.contiguous() for w in weights]
        if not save and mod.takes(x, weights, biases, pitch=False):
            return mod.run(x, weights, biases, activation, last_activation, out), []
        mod = mod.triton
    weights = readable(mod, x, weights)
    out, zs, launches, *_ = _plan(mod, x, weights, biases, activation, last_activation, save, out)
    for launch in launches:
        triton_launch.launch(*launch)
    return out, zs


def in_place(mod, x, w, i: int) -> bool:
    """Whether the kernel of `mod` reads weight `i` as the caller holds it, row-padded: an
    exact variant reading it at a wider row stride than its width (WEIGHT_STRIDES), `w` laid
    out at that stride (rows whole 16-byte vectors apart: `row_padded`), 16-byte aligned, and
    no TF32-rounded copy made of it (float32 with TF32 on copies every weight). The kernel's
    masks stop at the width: the padding is never read, whatever it holds. A caller keeping
    such a weight so saves the pad launch a call (~3 us of GPU time at the DLRM top MLP's
    small batches, H100: BENCHMARKS.md, seventy-eighth session); the CUDA variants read it
    in place too (cuda.row_stride)."""
    s = mod.WEIGHT_STRIDES[i] if mod.EXACT else 0
    return (s != w.shape[1] and w.stride() == (s, 1) and not w.data_ptr() & 15
            and not (x.dtype == torch.float32 and precision(x.dtype) == "tf32"))


def row_padded(w: torch.Tensor, stride: int) -> torch.Tensor:
    """`w` [n, k] as a view of zeroed [n, stride] storage (itself where `stride` is its width
    or its rows already are that far apart): a weight the exact kernels read at a wider row
    stride (schema.weight_strides) laid out so that they read it in place (`in_place`)."""
    if stride == w.shape[1] or w.stride() == (stride, 1):
        return w
    store = torch.zeros(w.shape[0], stride, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        store[:, :w.shape[1]].copy_(w)
    return store[:, :w.shape[1]]


def readable(mod, x, weights) -> list:
    """`weights` as `_plan` takes them: each contiguous, or row-padded where the kernel reads
    it in place (`in_place`); any other layout copied to a contiguous one."""
    return [w if w.is_contiguous() or in_place(mod, x, w, i) else w.contiguous() for i, w in enumerate(weights)]


def _plan(mod, x, weights, biases, activation, last_activation, save, out):
    """(out, zs, [(kernel, grid, args, kw)] ([] for B = 0), the scratch or None): what
    `forward` launches, in order, with its buffers allocated (the scratch: the one
    allocation whose views the launches take, if any: the hidden layers' rows, and the
    zero-padded copies of the weights the kernel reads at a wider stride (WEIGHT_STRIDES),
    each made by a pad_rows launch before the forward's). Float32 with TF32 on: a copy of
    every weight, TF32-rounded (and padded where the stride asks), all made by one
    tf32_weights launch before the forward's (its tiles of them then carry cuBLAS's rounding,
    not the tensor cores' truncation; the kernel rounds its activation operands itself)."""
    B, L = x.shape[0], len(weights)
    widths = [x.shape[1]] + [w.shape[0] for w in weights]
    if out is None:
        out = torch.empty((B, widths[-1]), dtype=x.dtype, device=x.device)
    keep_last = save and last_activation != "none"
    if save:
        zs = [torch.empty((B, widths[i + 1]), dtype=x.dtype, device=x.device) if i < L - 1 or keep_last else None
              for i in range(L)]
    else:
        zs = []
    if B == 0:
        return out, zs, [], None, None
    args = [x, out]
    prec = precision(x.dtype)
    tf32 = x.dtype == torch.float32 and prec == "tf32"
    name = "fused_mlp_fwd_kernel"
    if prec == "tf32x3" and hasattr(mod, "fused_mlp_fwd_kernel_x3"):  # float32, TF32 off
        name = "fused_mlp_fwd_kernel_x3"
    split = getattr(mod, "SPLITS", {}).get(name, 1)
    tiles = -(-B // mod.BLOCK_M)
    partial = tiles * split * mod.BLOCK_M * mod.PARTIAL_WIDTH[name] * 4 // x.element_size() if split > 1 else 0
    if mod.EXACT:
        zbuf = zs if save else [None] * L
        scratch, weights, launches = _scratch(mod, x, weights, 2 * mod.SCRATCH_WIDTH, mod.WEIGHT_STRIDES, tf32,
                                              partial)
        if mod.SCRATCH_WIDTH:  # layers too wide for registers that feed a layer as wide
            rows = B * mod.SCRATCH_WIDTH
            args += [scratch[:rows], scratch[rows: 2 * rows]]
        else:
            args += [x, x]
    else:
        # hidden layers' z (without `save`) in regions of the scratch, each only ever at one width
        regions, rows = hidden_regions(widths) if not save else ([], 0)
        scratch, weights, launches = _scratch(mod, x, weights, rows, widths[:-1], tf32)
        zbuf = zs if save else [None] * L
        for i, (at, w) in enumerate(regions):
            zbuf[i] = scratch[B * at: B * (at + w)]
    bias_mask = 0
    n_slots = L if mod.EXACT else MAX_LAYERS
    for i in range(n_slots):
        if i < L:
            b, z = biases[i], zbuf[i]
            args += [weights[i], b if b is not None else x, z if z is not None else x]
            bias_mask |= (b is not None) << i
        else:
            args += [x, x, x]
    # runtime flags (not constexprs: one compile per variant serves every choice)
    args += [B, bias_mask, ACT_CODE[activation], ACT_CODE[last_activation], int(save) | (int(keep_last) << 1)]
    kw = dict(PRECISION=prec, BLOCK_M=mod.BLOCK_M, num_warps=mod.NUM_WARPS)
    if mod.EXACT:  # its loops' pipeline depth (Triton's default, 3, puts the 13-512-256-64-16
        # float32 variant's weight tiles past the 227 KB of shared memory)
        kw["num_stages"] = mod.NUM_STAGES
    else:
        kw.update({f"D{i}": (widths[i] if i <= L else 1) for i in range(MAX_LAYERS + 1)})
        kw.update(NUM_LAYERS=L, BLOCK_K=mod.BLOCK_K, NUM_STAGES=mod.NUM_STAGES)
    counters = None
    if split > 1:  # the partials after the hidden rows, as float32; the row tiles' counters
        at = _up(2 * mod.SCRATCH_WIDTH * B)
        counters = split_counters(x.device, tiles)
        args[-5:-5] = [scratch[at: at + partial].view(torch.float32), counters]
    launches.append((getattr(mod, name), (tiles, split) if split > 1 else grid(B, mod), args, kw))
    return out, zs, launches, scratch, counters


def _up(n: int) -> int:
    """n elements rounded up to 64: a scratch region's start, 16-byte aligned in any dtype."""
    return -(-n // 64) * 64


def _scratch(mod, x, weights, rows: int, strides, tf32: bool, partial: int = 0):
    """(the scratch or None, the weights as the kernel reads them, the launches that make
    them): one allocation with `rows` x B hidden elements first, then `partial` elements (a
    split kernel's float32 partials, launch._plan), and after them, each 16-byte aligned, a
    copy of every weight the kernel reads from one -- with `tf32` all of them,
    TF32-rounded at their `strides`, written by one tf32_weights launch; else those an exact
    kernel reads at a wider stride than their width, zero-padded, one pad_rows launch each."""
    copies = [(i, w.shape[0], s) for i, (w, s) in enumerate(zip(weights, strides))
              if tf32 or (w.shape[1] != s and w.stride(0) != s)]  # (a row-padded one read in place: readable)
    at = [_up(_up(rows * x.shape[0]) + partial)]
    for _, n, s in copies:
        at.append(at[-1] + _up(n * s))
    scratch = torch.empty(at[-1], dtype=x.dtype, device=x.device) if at[-1] else None
    src, weights, launches = weights, list(weights), []
    for (i, n, s), a in zip(copies, at):
        weights[i] = scratch[a: a + n * s]
    if tf32:
        widths = (src[0].shape[1], *(w.shape[0] for w in src))
        grid_, constexprs, opts = tf32_weights_launch(widths, mod.EXACT)
        args = [t for pair in zip(src, weights) for t in pair]
        if not mod.EXACT:  # (the generic kernel's unused layer slots)
            args += [x, x] * (MAX_LAYERS - len(src))
        launches.append((mod.tf32_weights_kernel, grid_, args, {**constexprs, **opts}))
    else:
        for i, n, s in copies:
            grid_, constexprs, opts = pad_launch(n, src[i].shape[1], s)
            launches.append((mod.pad_rows_kernel, grid_, [src[i], weights[i]], {**constexprs, **opts}))
    return scratch, weights, launches


# Each CUDA stream's row-tile counters for the split kernels, keyed (device index, stream):
# zero between launches (the program that finishes a row tile sets its counter back to 0), so a
# call needs no memset. One buffer a stream: launches on one stream run in order, never two
# at once on the same counters; those of different streams have different buffers.
_COUNTERS: dict[tuple, torch.Tensor] = {}
# (the C calls themselves: torch.cuda.current_stream builds a Stream object, a few us of a
# fast call's host time on an H100 host)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda i: torch.cuda.current_stream(i).cuda_stream)


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """`tiles` int32 counters at zero for a split forward on the current stream: the stream's
    own (grown when too few; the old buffer is freed stream-ordered, after the launches that
    use it), or during CUDA graph capture a new zeroed buffer of the graph's (its memset is a
    node of the graph: every replay starts from zero, whatever runs beside it)."""
    if device.type != "cuda" or _capturing():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    key = (device.index, _raw_stream(device.index))
    c = _COUNTERS.get(key)
    if c is None or c.numel() < tiles:
        c = _COUNTERS[key] = torch.zeros(max(tiles, 1024, 2 * (c.numel() if c is not None else 0)),
                                         dtype=torch.int32, device=device)
    return c


def hidden_regions(widths) -> tuple[list[tuple[int, int]], int]:
    """Where the generic kernel's hidden layers keep their z: ([(start, width)] per hidden
    layer, in units of B elements; the scratch's size in the same units). Layer i takes a
    region of its own width that layer i - 1 (its input) did not write, or a new one: equal
    widths alternate between two regions, and no region is written at two widths (its rows
    would then overlap other programs' rows). Never more than the sum of the hidden widths."""
    regions, slots, rows = [], [], 0  # slots: [width, start, the last layer that wrote it]
    for i, w in enumerate(widths[1:-1]):
        slot = next((s for s in slots if s[0] == w and s[2] != i - 1), None)
        if slot is None:
            slot = [w, rows, i]
            slots.append(slot)
            rows += w
        slot[2] = i
        regions.append((slot[1], w))
    return regions, rows


def direct(mod, x, weights, biases, activation: str, last_activation: str, save: bool = False):
    """The eager fast paths' launcher for one exact call signature of a forward (x [..., w0]
    of `x`'s shape, dtype and device, the weights' and biases' shapes, the activations, the
    TF32 setting): `f(x, weights, biases)` -> out [..., wL] (with `save`: (out, zs), zs as
    `forward(save=True)` returns them, 2-D), or None where this call must take the general
    path (an input not 16-byte aligned, or the replay declines: hooks, another device, ...).
    `f` takes only calls whose tensors have the strides of this one's (the fast paths' memo
    compares them: kgen.runtime.memo). None where the signature has no fast form: B = 0, `x` or
    the biases given here not contiguous, an input not 16-byte aligned or aliased (a later
    call makes it), or no binary yet (`forward` launched it first, with the same `save`). A
    weight the kernel cannot read in its layout is copied contiguous each call, as `forward`
    copies it (the TMA ring's: row-padded by its C launcher, into CudaMLP.scratch).
    What it launches is what `forward` launches (triton_launch.replay of `_plan`'s launches:
    the weight pads, if any, then the forward): the same kernels, grids and arguments, only
    the output, z and scratch buffers new."""
    if type(mod) is CudaMLP:
        if not save:
            return mod.direct(x, weights, biases, activation, last_activation)
        mod = mod.triton
    widths = (x.shape[-1], *(w.shape[0] for w in weights))
    B = x.numel() // widths[0] if widths[0] else 0
    present = [b for b in biases if b is not None]
    if B == 0 or any(not t.is_contiguous() for t in (x, *present)):
        return None
    if x.device.index != triton_launch.current_device():
        return None  # Triton launches on the current device (the caller checked x is a CUDA tensor)
    # weights the kernels cannot read as given (e.g. a row-padded one under TF32, which copies
    # every weight rounded: its copy kernel reads them dense): copied contiguous each call, as
    # `forward` does (one copy launch; without this such a call took the general path, ~100 us of
    # host time: float32 FusedMLP(pad_weights=True) with TF32 on, H100, eightieth session)
    copy_at = [i for i, w in enumerate(weights) if not (w.is_contiguous() or in_place(mod, x, w, i))]
    if copy_at:
        weights = [w.contiguous() if i in copy_at else w for i, w in enumerate(weights)]
    x2 = x.reshape(B, widths[0])
    out, zs, launches, scratch, counters = _plan(mod, x2, weights, biases, activation, last_activation, save, None)
    z_on = [z is not None for z in zs]
    rep = triton_launch.replay(launches, (x2, out, *weights, *present, *(z for z in zs if z is not None),
                                           *((scratch,) if scratch is not None else ()),
                                           *((counters,) if counters is not None else ())))
    if rep is None:
        return None
    shape, dtype, device = (*x.shape[:-1], widths[-1]), x.dtype, x.device
    proto = prototype(shape, dtype, device)  # outputs: empty_like of it
    z_protos = [prototype(z.shape, z.dtype, z.device) if z is not None else None for z in zs]
    s_numel = scratch.numel() if scratch is not None else 0
    tiles = -(-B // mod.BLOCK_M) if counters is not None else 0  # (a split kernel's row tiles)
    empty_like, empty, data_ptr, go = torch.empty_like, torch.empty, torch.Tensor.data_ptr, rep.go
    present_at = [i for i, b in enumerate(biases) if b is not None]
    every = len(present_at) == len(biases)

    # (each pointer read once, by a C-level map, handed to the replay as arguments: this closure
    # is most of a fast call's Python)
    def launch(x, weights, biases):  # (the caller's memo matched this call's strides: these ones)
        if copy_at:  # (freed after the launch, stream-ordered)
            weights = [w.contiguous() if i in copy_at else w for i, w in enumerate(weights)]
        out = empty_like(proto)
        bs = biases if every else [biases[i] for i in present_at]
        zs, more = None, ()
        if save:
            zs = [empty_like(p) if on else None for p, on in zip(z_protos, z_on)]
            more = [z for z in zs if z is not None]
        if s_numel:  # (held until launched: freed after, stream-ordered, as the general path's)
            more = [*more, empty(s_numel, dtype=dtype, device=device)]
        if tiles:  # a split kernel: the current stream's counters
            more = [*more, split_counters(device, tiles)]
        if not go(x.data_ptr(), out.data_ptr(), *map(data_ptr, weights), *map(data_ptr, bs), *map(data_ptr, more)):
            return None
        return (out, zs) if save else out

    return launch


def backward(mod, grad, x, weights, biases, activation: str, last_activation: str, need_x: bool = True):
    """(grad_x or None, [grad_w], [grad_b or None]) for 2-D contiguous x and grad: the
    forward again with `save` (mod None: the eager composition), then reference.backward."""
    zs = saved(mod, x, weights, biases, activation, last_activation)
    return torch_backward(grad, x, weights, biases, zs, activation, last_activation, need_x)


def saved(mod, x, weights, biases, activation: str, last_activation: str) -> list:
    """The zs a forward with `save` keeps (mod None: the eager composition's), 2-D contiguous x."""
    if mod is None:
        return _eager_save(x, weights, biases, activation, last_activation)[1]
    return forward(mod, x, weights, biases, activation, last_activation, save=True)[1]


def _eager_save(x, weights, biases, activation, last_activation):
    from kgen.families.fused_mlp.reference import eager

    return eager(x, weights, biases, activation, last_activation, save=True)
