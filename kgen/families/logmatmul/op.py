"""logmatmul as ops: which implementation runs (dispatch, `using`), the tuning hooks, the
torch.library ops with fake impls and autograd, the public functions, golden numerics."""

from __future__ import annotations

import contextlib
import operator

import torch

from kgen.families.logmatmul import launch as _launch
from kgen.families.logmatmul.checks import check_block_sparse, check_dense, check_pattern_values
from kgen.families.logmatmul.backward_launch import backward, backward_direct, bsl_backward
from kgen.families.logmatmul.launch import CudaForward, block_rows, bsl_forward, forward, triton_direct
from kgen.families.logmatmul.plans import BWD_B
from kgen.families.logmatmul.reference import (block_sparse_reference, block_sparse_reference_backward,
                                                reference, reference_backward, reference_for_transforms)
from kgen.families.logmatmul.rules import tune_bucket
from kgen.runtime.op import MISSING, Override, check_dispatch_env, define, dispatch_modes, vmap_batched

FAMILY = "logmatmul"
_FORCED = Override()
_MODULES: dict = {}  # per shape bucket, where the choice is the bucket's (dispatch.holds_for_bucket)
_BY_SHAPE: dict = {}  # per exact shape, in front of _MODULES
_BWD_CUDA: dict = {}  # per (device index, x dtype, Triton module): what runs its backward (_backward_module)
# The eager fast path (`logmatmul`, and the op's forward, which a training step takes): per
# exact signature (x shape, w shape, dtypes, devices), the bound launcher (CudaForward.direct,
# triton_direct; None: none); and the `using` blocks open in any thread (the fast path steps
# aside while one is).
_FAST: dict = {}
_FAST_OF: dict = {}  # what each _FAST entry launches (the op's forward uses an entry only for that)
_USING = _FORCED.open
# The backward's counterpart (autograd always takes the op): per exact signature,
# CUDA_BACKWARD and forward implementation, backward_launch.backward_direct's bound launches
# (None: none).
_BWD_FAST: dict = {}


def implementation(kernel, companion=None):
    """What the op runs for a loaded variant: a Triton variant's module, or a CUDA variant
    wrapped with a Triton companion (default: dispatch's first Triton choice)."""
    if kernel is None or kernel.backend == "triton":
        return kernel.module if kernel is not None else None
    if companion is None:
        from kgen.runtime import dispatch

        companion = dispatch.triton_companion(FAMILY, kernel, "serve the backward")
    return CudaForward(kernel, companion.module)


# Run the ops with this implementation (`implementation(kernel)`, a Triton module, or None:
# the PyTorch reference) instead of dispatch's choice, in this thread.
using = _FORCED.using


def _module(device: torch.device, dtype: torch.dtype, B: int, N: int, K: int):
    forced = _FORCED.get()
    if forced is not MISSING:
        return forced
    if device.type != "cuda":
        check_dispatch_env()  # (a typo in KGEN_BACKEND / KGEN_AUTOTUNE fails here too)
        return None
    exact = (device.index, dtype, B, N, K)  # small calls repeat shapes: one lookup, no bucket arithmetic
    mod = _BY_SHAPE.get(exact, MISSING)
    if mod is not MISSING:
        return mod
    # (K's residue mod 8 too: a tuned winner of the bucket holds for an even K, or K in whole
    # 16-byte vectors, and may be vetoed at another, tuned_transfers)
    key = (device.index, dtype, (B - 1).bit_length(), (N - 1).bit_length(), (K - 1).bit_length(), K & 7)
    mod = _MODULES.get(key, MISSING)
    if mod is MISSING:
        from kgen.runtime.dispatch import holds_for_bucket

        mod, why = _choose(device, dtype, B, N, K)
        if holds_for_bucket(why):  # (130 x 300 x 545 and x 546 share a bucket; the rule tells them apart)
            _MODULES[key] = mod
    if len(_BY_SHAPE) > 4096:  # many shapes: keep the memo small
        _BY_SHAPE.clear()
    _BY_SHAPE[exact] = mod
    return mod


def _choose(device, dtype, B, N, K):
    """(what the op runs for the shape, dispatch's why)."""
    from kgen.runtime import dispatch

    name = str(dtype).removeprefix("torch.")
    dims = {"B": B, "N": N, "K": K}
    kernel, why = dispatch.choose_logged(FAMILY, device, name, tune_bucket(**dims), dims)
    if kernel is not None and kernel.backend == "cuda":
        companion = dispatch.select(FAMILY, device, name, backend="triton")
        return (CudaForward(kernel, companion.module) if companion is not None else None), why
    return implementation(kernel), why


# --------------------------------------------------------------------------- tuning

TUNE_SHAPES = tuple({"B": b, "N": n, "K": k} for n, k in ((4096, 4096), (1024, 1024), (512, 512))
                    for b in (1, 2, 4, 8, 16, 64, 256))
_REFERENCE_TUNE_BYTES = 256 << 20


def tune_inputs(device, dtype: str, B: int, N: int, K: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    return {"x": (torch.randn(B, K, device=device, generator=g) * 2).to(getattr(torch, dtype)),
            "w": torch.rand(N, K, device=device, generator=g)}


def tune_runner(kernel, inputs: dict):
    """One forward of `kernel` (None: the reference) into a fresh output: nothing a caller
    holds is written."""
    x, w = inputs["x"], inputs["w"]
    if kernel is None:
        if x.shape[0] * w.numel() * 4 > _REFERENCE_TUNE_BYTES:
            raise ValueError("the reference's [B, K] x [K, N] product would take too much memory")
        return lambda: reference(x, w)
    return runner(implementation(kernel), x, w)


def runner(mod, x: torch.Tensor, w: torch.Tensor):
    """() -> out: one forward of the implementation `mod` on contiguous x and w as the op
    runs it when called again with their signature: its eager fast path (bound launches)
    where it has one, else `forward`. The tuner and the benchmark time this."""
    B, K = x.shape
    N = w.shape[0]
    fast = (mod.direct(B, N, K, x.dtype, w.dtype, x.device) if type(mod) is CudaForward
            else triton_direct(mod, B, N, K, x.device))
    if fast is None:
        return lambda: forward(mod, x, w)
    return lambda: fast(x, w)


# --------------------------------------------------------------------------- dense op


def _fwd_impl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    check_dense(x, w)
    B, K = x.shape
    mod = _module(x.device, x.dtype, B or 1, w.shape[0] or 1, K or 1)
    if mod is None:
        return reference(x, w).contiguous()
    if not x.is_contiguous():
        x = x.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    if _FORCED.get() is MISSING:
        # the signature's bound launcher (the public function's fast path next time, and this
        # call's too: a training step's forward, which takes the op for autograd, replays
        # its launches as well)
        key = (x.shape, w.shape, x.dtype, w.dtype, x.device, w.device)
        launch = _FAST.get(key, MISSING) if _FAST_OF.get(key) is mod else MISSING
        if launch is MISSING and len(_FAST) < 4096:
            launch = _FAST[key] = (mod.direct(B, w.shape[0], K, x.dtype, w.dtype, x.device) if type(mod) is CudaForward
                                   else triton_direct(mod, B, w.shape[0], K, x.device))
            _FAST_OF[key] = mod
        if launch is not MISSING and launch is not None:
            out = launch(x, w)
            if out is not None:
                return out
    return forward(mod, x, w)


def _fwd_fake(x, w):
    check_dense(x, w)
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


def _bwd_impl(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, grad: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    mod = _module(x.device, x.dtype, max(x.shape[0], 1), max(w.shape[0], 1), max(x.shape[1], 1))
    grad = grad.to(torch.float32).contiguous()
    if mod is None:
        return reference_backward(x, w, out, grad)
    if _FORCED.get() is MISSING and x.is_contiguous() and w.is_contiguous() and out.is_contiguous():
        # per exact signature, the backward's bound launches (backward_launch.backward_direct)
        key = (x.shape, w.shape, x.dtype, w.dtype, x.device, w.device, _launch.CUDA_BACKWARD, mod)
        launch = _BWD_FAST.get(key, MISSING)
        if launch is MISSING:
            if len(_BWD_FAST) >= 4096:
                _BWD_FAST.clear()
            B, K = x.shape
            launch = _BWD_FAST[key] = backward_direct(_backward_module(mod, x, w), B, w.shape[0], K, x.dtype,
                                                      w.dtype, x.device)
        if launch is not None:
            got = launch(x, w, out, grad)
            if got is not None:
                return got
    return backward(_backward_module(mod, x, w), x.contiguous(), w.contiguous(), out.contiguous(), grad)


def _backward_module(mod, x: torch.Tensor, w: torch.Tensor):
    """What runs the backward of a call whose forward dispatch gave `mod`: `mod` itself, but
    for a Triton module at 1 <= B <= BWD_B with float32 w on CUDA, a CUDA variant of x's dtype
    wrapped around it (the first that loads, spec order), whose library backward is one pass
    over w where the Triton module's is the GEMM form past its bwd_b: H200, N = K = 4096, bf16 x
    and float32 w, B = 16: a training step of 110.4 us against 183.6 (BENCHMARKS.md, sixtieth
    session). Calls the library backward cannot take (K % 4, unaligned w) fall back to `mod`
    in backward_launch.backward. A `using` block runs what it names, forward and backward."""
    if (isinstance(mod, CudaForward) or not _launch.CUDA_BACKWARD or w.dtype is not torch.float32
            or not 1 <= x.shape[0] <= BWD_B or x.device.type != "cuda" or _FORCED.get() is not MISSING):
        return mod
    key = (x.device.index, x.dtype, mod)
    got = _BWD_CUDA.get(key, MISSING)
    if got is MISSING:
        from kgen.runtime import dispatch

        kernel = dispatch.select(FAMILY, x.device, str(x.dtype).removeprefix("torch."), backend="cuda")
        got = _BWD_CUDA[key] = CudaForward(kernel, mod) if kernel is not None else mod
    return got


def _bwd_fake(x, w, out, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output):
    x, w = inputs
    ctx.save_for_backward(x, w, output)
    ctx.forced = _FORCED.get()


def _backward(ctx, grad):
    x, w, out = ctx.saved_tensors
    with using(ctx.forced) if ctx.forced is not MISSING else contextlib.nullcontext():
        dx, dw = _bwd_op(x, w, out, grad)
    return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None)


_bwd_op = define("logmatmul_backward", _bwd_impl, fake=_bwd_fake)


def _composition(x, w):
    """The op under torch.func transforms and forward-mode AD (kgen.runtime.op.define)."""
    check_dense(x, w)
    return reference_for_transforms(x, w)


_op = define("logmatmul", _fwd_impl, fake=_fwd_fake, backward=_backward, setup_context=_setup,
             composition=_composition)


_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def logmatmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[b, n] = log sum_k w[n, k] exp(x[b, k]), float32 [B, N].

    x [B, K] log-values (float32, bfloat16 or float16; -inf allowed), w [N, K] non-negative
    weights (float32 or x's dtype). Each row of x is shifted by its maximum (per K slice,
    merged exactly), so nothing overflows; an all -inf row or a zero weight row gives -inf,
    never NaN. A node whose weighted inputs all lie more than ~87 below its row's maximum
    is summed from float32 subnormals, with fewer significant bits the further below (its
    output ~1e-5 off at ~95, ~2e-2 at ~100), and underflows to -inf beyond ~104 (the price
    of one shift per row instead of one per output).
    A NaN in a row of x or a row of w makes that row's (that node's) outputs NaN, as PyTorch's
    expression does (never a plausible -inf); +inf in x is outside the domain and gives NaN
    too (the expression gives +inf). Negative weights are outside the domain too and are not
    checked (that would read all of w again on every call); every path computes the formula
    for them as written: the node's value where its sum is positive (with the accuracy its
    cancellation leaves), NaN where the sum is negative, -inf where it is exactly 0 -- as
    log(exp(x - m) @ w.T) + m gives (logsumexp(x + log(w)) would be NaN for any negative weight).
    Differentiable in x and w: dx[b,k] = sum_n g w[n,k] exp(x[b,k] - out[b,n]),
    dw[n,k] = sum_b g exp(x[b,k] - out[b,n]); outputs of -inf contribute nothing, and an
    entry of x that is -inf gets dx = 0; NaN outputs give NaN gradients. On CUDA the
    variant the tuning table names for (B, N, K) runs on the current stream; CPU tensors
    use the float32 reference. Also torch.ops.kgen.logmatmul."""
    # Eager fast path (host cost of small calls): plain tensors, no gradient, no `using`
    # block, a signature seen before whose variant is Triton, or CUDA and one launch: the checks passed
    # then (they read only shapes, dtypes and devices, all in the key). Autocast changes
    # nothing here (the kernel computes in float32 from the inputs as given, as the op does
    # under autocast).
    if (not _compiling() and type(x) is _Tensor and type(w) is _Tensor and not _USING and not dispatch_modes()
            and not ((x.requires_grad or w.requires_grad) and _grad_enabled())):
        launch = _FAST.get((x.shape, w.shape, x.dtype, w.dtype, x.device, w.device))
        if launch is not None:
            out = launch(x, w)
            if out is not None:
                return out
    return _op(x, w)


# --------------------------------------------------------------------------- block-sparse


def dense_from_blocks(blocks, row_ptr, col_idx, block_size: int, K: int) -> torch.Tensor:
    """The [N, K] weight a block-CSR pattern stands for (zeros outside its blocks)."""
    bs, nnz = block_size, blocks.shape[0]
    R, C = row_ptr.shape[0] - 1, K // bs
    w4 = blocks.new_zeros((R, C, bs, bs))
    w4[block_rows(row_ptr, nnz), col_idx.long()] = blocks
    return w4.permute(0, 2, 1, 3).reshape(R * bs, K)


def _bsl_impl(x: torch.Tensor, blocks: torch.Tensor, row_ptr: torch.Tensor, col_idx: torch.Tensor,
              block_size: int) -> torch.Tensor:
    check_block_sparse(x, blocks, row_ptr, col_idx, block_size)
    N = (row_ptr.shape[0] - 1) * block_size
    mod = _module(x.device, x.dtype, max(x.shape[0], 1), max(N, 1), max(x.shape[1], 1))
    if mod is None:
        if x.device.type == "cpu":  # block row by block row, as the kernels (reads the pattern's values)
            check_pattern_values(row_ptr, col_idx, x.shape[1], block_size)
            return block_sparse_reference(x, blocks, row_ptr, col_idx, block_size)
        return reference(x, dense_from_blocks(blocks, row_ptr, col_idx, block_size, x.shape[1])).contiguous()
    return bsl_forward(mod, x.contiguous(), blocks.contiguous(), row_ptr.contiguous(), col_idx.contiguous(),
                       block_size)


def _bsl_fake(x, blocks, row_ptr, col_idx, block_size):
    check_block_sparse(x, blocks, row_ptr, col_idx, block_size)
    return x.new_empty((x.shape[0], (row_ptr.shape[0] - 1) * block_size), dtype=torch.float32)


def _bsl_bwd_impl(x: torch.Tensor, blocks: torch.Tensor, row_ptr: torch.Tensor, col_idx: torch.Tensor,
                  block_size: int, out: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N = (row_ptr.shape[0] - 1) * block_size
    mod = _module(x.device, x.dtype, max(x.shape[0], 1), max(N, 1), max(x.shape[1], 1))
    grad = grad.to(torch.float32).contiguous()
    if mod is None and x.device.type == "cpu":
        return block_sparse_reference_backward(x, blocks, row_ptr, col_idx, block_size, out, grad)
    if mod is None:
        w = dense_from_blocks(blocks, row_ptr, col_idx, block_size, x.shape[1])
        dx, dw = reference_backward(x, w, out, grad)
        R, bs = row_ptr.shape[0] - 1, block_size
        dw4 = dw.reshape(R, bs, -1, bs).permute(0, 2, 1, 3)
        return dx, dw4[block_rows(row_ptr, blocks.shape[0]), col_idx.long()].contiguous()
    return bsl_backward(mod, x.contiguous(), blocks.contiguous(), row_ptr.contiguous(), col_idx.contiguous(),
                        block_size, out.contiguous(), grad)


def _bsl_bwd_fake(x, blocks, row_ptr, col_idx, block_size, out, grad):
    return torch.empty_like(x), torch.empty_like(blocks)


def _bsl_setup(ctx, inputs, output):
    x, blocks, row_ptr, col_idx, block_size = inputs
    ctx.save_for_backward(x, blocks, row_ptr, col_idx, output)
    ctx.block_size = block_size
    ctx.forced = _FORCED.get()


def _bsl_backward(ctx, grad):
    x, blocks, row_ptr, col_idx, out = ctx.saved_tensors
    with using(ctx.forced) if ctx.forced is not MISSING else contextlib.nullcontext():
        dx, db = _bsl_bwd_op(x, blocks, row_ptr, col_idx, ctx.block_size, out, grad)
    return (dx if ctx.needs_input_grad[0] else None), (db if ctx.needs_input_grad[1] else None), None, None, None


_bsl_bwd_op = define("block_sparse_logmatmul_backward", _bsl_bwd_impl, fake=_bsl_bwd_fake)


def _bsl_composition(x, blocks, row_ptr, col_idx, block_size):
    """The op under torch.func transforms and forward-mode AD (kgen.runtime.op.define): block
    row by block row as the kernels (a NaN reaches only its own block rows), on any device.
    The pattern is read on the host, so it cannot be batched."""
    check_block_sparse(x, blocks, row_ptr, col_idx, block_size)
    if vmap_batched(row_ptr) or vmap_batched(col_idx):
        raise ValueError("block_sparse_logmatmul: row_ptr and col_idx cannot be batched under torch.func.vmap "
                         "(the pattern is read on the host); vmap over x or blocks")
    check_pattern_values(row_ptr, col_idx, x.shape[1], block_size)
    return block_sparse_reference(x, blocks, row_ptr, col_idx, block_size, dense=reference_for_transforms)


_bsl_op = define("block_sparse_logmatmul", _bsl_impl, fake=_bsl_fake, backward=_bsl_backward,
                 setup_context=_bsl_setup, composition=_bsl_composition)


def block_sparse_logmatmul(x: torch.Tensor, blocks: torch.Tensor, row_ptr: torch.Tensor, col_idx: torch.Tensor,
                           block_size: int) -> torch.Tensor:
    """logmatmul with w [N, K] stored as block_size x block_size blocks in block-CSR order:
    blocks [nnz, bs, bs], row_ptr [N/bs + 1] (nondecreasing, from 0 to nnz), col_idx [nnz]
    (child block indices in [0, K/bs), no repeats within a block row). The index values are
    checked on the CPU path, which reads them anyway (a ValueError naming the first bad
    one), not on CUDA (that would wait on the device); the kernels read only blocks row_ptr
    names. Differentiable in x and blocks. Also torch.ops.kgen.block_sparse_logmatmul."""
    if type(block_size) is not int and not isinstance(block_size, bool) and hasattr(block_size, "__index__"):
        try:  # (numpy's or a 0-d integer tensor; never a float's truncation)
            block_size = operator.index(block_size)
        except TypeError:
            raise TypeError("block_sparse_logmatmul: block_size must be an int, got "
                            f"{type(block_size).__name__} {block_size!r}") from None
    return _bsl_op(x, blocks, row_ptr, col_idx, block_size)


OPS = {"logmatmul": logmatmul, "block_sparse_logmatmul": block_sparse_logmatmul}
