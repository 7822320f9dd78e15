"""linear_logp's keep_logits launches (op.linear_logp(..., keep_logits=True), also with
`group=`): the forward keeps the float32 logits, the backward reads them instead of
recomputing them.

Forward (`forward_kept`): z = hidden @ weight.T in float32 by one cuBLAS GEMM (N*V*4 bytes,
kept until the backward), the partials of `launch.forward` from z by
linear_logp_logits_fwd_kernel (the tile kernel's online-softmax fold, reading instead of
multiplying), then the same combine. Backward (`backward_kept`): dz [N, V] from z in one
elementwise pass (linear_logp_bwd_dz_logits_kernel: the dz kernel's epilogue), then
grad_hidden = dz @ weight and grad_weight = dz^T @ hidden as one GEMM each: three GEMMs a
training step instead of four, no float32 sums; N*V*elsize bytes more while it runs. The
contracts (arguments, outputs, dtypes) are launch.forward's and backward_launch.backward's;
buffers come from launch._empty (tests poison it). Where it pays: op.KEEP_LOGITS_MIN_FLOP.
"""

from __future__ import annotations

import torch

from kgen.families.linear_logp import launch
from kgen.families.linear_logp.cuda_variant import CudaForward
from kgen.families.linear_logp.plans import (
    KEPT_DZ_BLOCK, KEPT_FWD_BLOCK, KEPT_FWD_PROGRAMS_PER_SM, LOG2E, _cdiv, _device_props)
from kgen.runtime import triton_launch


def kept_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight.T in float32 [N, V], no bias, no temperature: the logits keep_logits
    keeps for the backward. 16-bit inputs: one cuBLAS GEMM with float32 output (float32
    accumulation, as the tile dots); float32 as torch.mm takes it (TF32 where allowed, as
    F.linear); on the CPU (tests) float32 math."""
    if hidden.is_cuda and hidden.dtype != torch.float32:
        return torch.mm(hidden, weight.T, out_dtype=torch.float32)
    return torch.mm(hidden.float(), weight.float().T)


def forward_kept(mod, hidden, weight, target, bias, temperature: float, ignore_index: int, with_entropy: bool,
                 shape=None):
    """`forward`'s outputs and contract from materialised logits: (logp, entropy, lse2,
    ez2, z), z = kept_logits(hidden, weight) for backward_kept. `mod`: a Triton module or a
    CudaForward (its Triton companion's logits pass and combine run; the tiles are
    KEPT_FWD_BLOCK, not the module's). `shape`: logp's and entropy's, as forward's.
    Extra memory: N * V * 4 bytes (z) until the backward, and forward's partials."""
    mod = mod.triton if isinstance(mod, CudaForward) else mod
    N = hidden.shape[0]
    V = weight.shape[0]
    dev = hidden.device
    logp, entropy, lse2, ez2 = outs = launch._outputs(N, with_entropy, dev, shape)
    z = kept_logits(hidden, weight)
    if N == 0:
        return logp, entropy, lse2, ez2, z
    block_n, block_v, warps = KEPT_FWD_BLOCK
    tiles_n, tiles_v = _cdiv(N, block_n), _cdiv(V, block_v)
    # splits: enough programs to stream z at full bandwidth (3 off the GPU: the merge is tested)
    want = KEPT_FWD_PROGRAMS_PER_SM * _device_props(dev.index).multi_processor_count if dev.type == "cuda" else 3
    splits = max(1, min(tiles_v, _cdiv(want, tiles_n)))
    part = launch._empty((4, splits, N), torch.float32, dev)
    scale = LOG2E / temperature
    triton_launch.launch(
        mod.linear_logp_logits_fwd_kernel, (tiles_n * splits,),
        (z, bias if bias is not None else z, target, part, N, V, splits, scale),
        dict(HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, BLOCK_N=block_n, BLOCK_V=block_v, num_warps=warps))
    launch.combine(mod, part, splits, hidden, weight, target, bias, outs, scale, ignore_index, with_entropy, False)
    return logp, entropy, lse2, ez2, z


def backward_kept(mod, z, hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy,
                  temperature: float, ignore_index: int, *, on_grad_hidden=None):
    """`backward`'s outputs and contract from the logits forward_kept kept: dz [N, V] (input
    dtype) from z in one elementwise pass (the linear_logp_bwd_dz_logits_kernel of `mod`, a
    Triton module, or of a CudaForward's Triton companion), then
    grad_weight = dz^T @ hidden and grad_hidden = dz @ weight as one GEMM each (torch.mm:
    cuBLAS; float32 with TF32 off in full float32, as the recomputing path's). No
    recompute, no float32 sums. Extra memory: N * V * elsize (dz) + cdiv(N, KEPT_DZ_BLOCK[0])
    * V * 4 with a bias (its column sums), besides z itself."""
    mod = mod.triton if isinstance(mod, CudaForward) else mod
    N = hidden.shape[0]
    V = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    grad_h, grad_w, grad_b = launch._gradients(hidden, weight, bias)
    if N == 0:
        return grad_h, grad_w, grad_b
    block_n, block_v, warps = KEPT_DZ_BLOCK
    tiles_n = _cdiv(N, block_n)
    dz = launch._empty((N, V), dtype, dev)
    bpart = launch._empty((tiles_n, V), torch.float32, dev) if bias is not None else dz
    with_entropy = grad_entropy is not None
    g_logp = grad_logp if grad_logp is not None else lse2
    triton_launch.launch(
        mod.linear_logp_bwd_dz_logits_kernel, (tiles_n * _cdiv(V, block_v),),
        (z, bias if bias is not None else z, target, lse2, ez2 if with_entropy else lse2,
         g_logp, grad_entropy if with_entropy else g_logp, dz, bpart,
         N, V, LOG2E / temperature, 1.0 / temperature, ignore_index),
        dict(HAS_BIAS=bias is not None, WRITE_BPART=bias is not None, WITH_ENTROPY=with_entropy,
             HAS_GLOGP=grad_logp is not None, BLOCK_N=block_n, BLOCK_V=block_v, num_warps=warps))
    if bias is not None:
        grad_b.copy_(bpart.sum(0))
    torch.mm(dz, weight, out=grad_h)
    if on_grad_hidden is not None:  # (grad_hidden first: the group's all-reduce overlaps dW)
        on_grad_hidden(grad_h)
    torch.mm(dz.T, hidden, out=grad_w)
    return grad_h, grad_w, grad_b
