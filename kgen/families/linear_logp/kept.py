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
from kgen.runtime.streams import bind_context


def kept_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight.T in float32 [N, V], no bias, no temperature: the logits keep_logits
    keeps for the backward. 16-bit inputs: one cuBLAS GEMM with float32 output (float32
    accumulation, as the tile dots); float32 as torch.mm takes it (TF32 where allowed, as
    F.linear); on the CPU (tests) float32 math."""
    if hidden.is_cuda:
        bind_context()  # (autograd's worker thread may have no context: torch warns before cuBLAS)
        if hidden.dtype != torch.float32:
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
    splits = _splits(N, V, dev)
    part = launch._empty((4, splits, N), torch.float32, dev)
    for kernel, grid, args, kw in _forward_launches(mod, hidden, weight, target, bias, z, part, outs, splits,
                                                    LOG2E / temperature, ignore_index, with_entropy):
        triton_launch.launch(kernel, grid, args, kw)
    return logp, entropy, lse2, ez2, z


def _splits(N: int, V: int, dev: torch.device) -> int:
    """V splits of linear_logp_logits_fwd_kernel: enough programs to stream z at full
    bandwidth (3 off the GPU: the merge is tested)."""
    tiles_n, tiles_v = _cdiv(N, KEPT_FWD_BLOCK[0]), _cdiv(V, KEPT_FWD_BLOCK[1])
    want = KEPT_FWD_PROGRAMS_PER_SM * _device_props(dev.index).multi_processor_count if dev.type == "cuda" else 3
    return max(1, min(tiles_v, _cdiv(want, tiles_n)))


# Where the temperature's scale is among each forward launch's arguments (FewRows's replay
# moves it per call): linear_logp_logits_fwd_kernel's 8th, linear_logp_combine_kernel's 15th.
_SCALE_ARGS = ((0, 7), (1, 14))


def _forward_launches(mod, hidden, weight, target, bias, z, part, outs, splits: int, scale: float,
                      ignore_index: int, with_entropy: bool) -> list[tuple]:
    """forward_kept's two launches from the logits z, (kernel, grid, args, options): the
    partials of each V slice, then launch.combine's (target logit from plane 2)."""
    N, V = z.shape
    block_n, block_v, warps = KEPT_FWD_BLOCK
    logp, entropy, lse2, ez2 = outs
    return [
        (mod.linear_logp_logits_fwd_kernel, (_cdiv(N, block_n) * splits,),
         (z, bias if bias is not None else z, target, part, N, V, splits, scale),
         dict(HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, BLOCK_N=block_n, BLOCK_V=block_v,
              num_warps=warps)),
        launch.combine_launch(mod, part, splits, hidden, weight, target, bias, outs, scale, ignore_index,
                              with_entropy, False)]


class FewRows:
    """forward_kept for one call signature of the float32 few-rows path (launch.logits_path)
    in the eager fast path (fast.ForwardLaunch): the splits decided once; per call three
    buffers (logp, entropy if asked, and one float32 [lse2 | ez2 | partials], each part from
    a 16-byte boundary), the logits GEMM, and the two Triton launches replayed
    (triton_launch.replay: the C trampoline, no per-launch specialisation key) with the
    call's addresses and temperature -- one replay per ignore_index (an int Triton
    specialises on, == 1 say), at most REPLAYS of them. The first call of each, or where a
    replay declines (hooks set, the device changed, an input not 16-byte aligned, aliased
    inputs), launches through triton_launch as forward_kept does: the same kernels with the
    same arguments, so the same bits. The logits are not kept (the backward recomputes
    them, as after launch.forward)."""

    REPLAYS = 8
    __slots__ = ("mod", "N", "splits", "with_entropy", "ez_at", "part_at", "part_len", "replays", "dz_replays")

    def __init__(self, mod, hidden, weight, with_entropy: bool):
        self.mod = mod.triton if isinstance(mod, CudaForward) else mod
        N, V = hidden.shape[0], weight.shape[0]
        self.N, self.with_entropy = N, with_entropy
        self.splits = _splits(N, V, hidden.device)
        rows = _cdiv(N, 4) * 4  # floats of lse2 (or ez2) rounded to 16 bytes
        self.ez_at = rows if with_entropy else 0
        self.part_at = 2 * rows if with_entropy else rows
        self.part_len = 4 * self.splits * N
        self.replays: dict = {}  # ignore_index -> triton_launch.Replay, or None where it declined
        self.dz_replays: dict = {}  # backward_kept's, for `backward`

    def run(self, hidden, weight, target, bias, temperature: float, ignore_index: int, shape=None):
        """(logp, entropy or None, buf): buf the [lse2 | ez2 | partials] buffer `rows` reads."""
        dev, f32, N = hidden.device, torch.float32, self.N
        out = (N,) if shape is None else shape
        logp = launch._empty(out, f32, dev)
        entropy = launch._empty(out, f32, dev) if self.with_entropy else None
        buf = launch._empty((self.part_at + self.part_len,), f32, dev)
        z = kept_logits(hidden, weight)
        scale = LOG2E / temperature
        r = self.replays.get(ignore_index)
        if r is not None:
            vals = [hidden.data_ptr(), weight.data_ptr(), target.data_ptr(), z.data_ptr(), buf.data_ptr(),
                    logp.data_ptr()]
            if entropy is not None:
                vals.append(entropy.data_ptr())
            if bias is not None:
                vals.append(bias.data_ptr())
            vals += (scale, scale)
            if r(vals):
                return logp, entropy, buf
        lse2, ez2 = self.rows(buf)
        part = buf[self.part_at:].view(4, self.splits, N)
        todo = _forward_launches(self.mod, hidden, weight, target, bias, z, part,
                                 (logp, entropy if entropy is not None else logp, lse2, ez2), self.splits, scale,
                                 ignore_index, self.with_entropy)
        for kernel, grid, args, kw in todo:
            triton_launch.launch(kernel, grid, args, kw)
        if ignore_index not in self.replays and len(self.replays) < self.REPLAYS:
            slots = (hidden, weight, target, z, buf, logp) + ((entropy,) if entropy is not None else ()) + (
                (bias,) if bias is not None else ())
            self.replays[ignore_index] = triton_launch.replay(todo, slots, _SCALE_ARGS)
        return logp, entropy, buf

    def backward(self, mod, hidden, weight, target, bias, buf, grad_logp, grad_entropy, temperature: float,
                 ignore_index: int):
        """The gradients of a forward `run` made (its buf), as backward_launch.backward gives
        them on this path: the logits recomputed, then backward_kept with its dz launch
        replayed."""
        lse2, ez2 = self.rows(buf)
        return backward_kept(mod, kept_logits(hidden, weight), hidden, weight, target, bias, lse2, ez2, grad_logp,
                             grad_entropy, temperature, ignore_index, replays=self.dz_replays, rows_buf=buf)

    def rows(self, buf) -> tuple:
        """(lse2 [N], ez2 [N] or lse2 without entropy) of run's buf."""
        N = self.N
        lse2 = buf[:N]
        return lse2, buf[self.ez_at:self.ez_at + N] if self.with_entropy else lse2


def backward_kept(mod, z, hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy,
                  temperature: float, ignore_index: int, *, on_grad_hidden=None, replays=None, rows_buf=None):
    """`backward`'s outputs and contract from the logits forward_kept kept: dz [N, V] (input
    dtype) from z in one elementwise pass (the linear_logp_bwd_dz_logits_kernel of `mod`, a
    Triton module, or of a CudaForward's Triton companion), then
    grad_weight = dz^T @ hidden and grad_hidden = dz @ weight as one GEMM each (torch.mm:
    cuBLAS; float32 with TF32 off in full float32, as the recomputing path's). No
    recompute, no float32 sums. Extra memory: N * V * elsize (dz) + cdiv(N, KEPT_DZ_BLOCK[0])
    * V * 4 with a bias (its column sums), besides z itself.
    `replays` (FewRows.backward): a dict in which the dz launch is recorded and from which it
    is replayed (triton_launch.replay), one per (module, ignore_index, entropy, grad_logp,
    bias); lse2 and ez2 then views of `rows_buf`, FewRows.run's buffer."""
    mod = mod.triton if isinstance(mod, CudaForward) else mod
    N = hidden.shape[0]
    V = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    grad_h, grad_w, grad_b = launch._gradients(hidden, weight, bias)
    if N == 0:
        return grad_h, grad_w, grad_b
    tiles_n = _cdiv(N, KEPT_DZ_BLOCK[0])
    dz = launch._empty((N, V), dtype, dev)
    bpart = launch._empty((tiles_n, V), torch.float32, dev) if bias is not None else None
    with_entropy = grad_entropy is not None
    scale, inv_t = LOG2E / temperature, 1.0 / temperature
    if replays is not None:
        key = (mod, ignore_index, with_entropy, grad_logp is not None, bias is not None)
        slots = tuple(x for x in (z, target, rows_buf, grad_logp, grad_entropy, dz, bpart, bias) if x is not None)
        r = replays.get(key)
        done = r is not None and r([x.data_ptr() for x in slots] + [scale, inv_t])
    else:
        done = False
    if not done:
        todo = [_dz_launch(mod, z, target, bias, lse2, ez2, grad_logp, grad_entropy, dz, bpart, scale, inv_t,
                           ignore_index)]
        triton_launch.launch(*todo[0])
        if replays is not None and key not in replays and len(replays) < FewRows.REPLAYS:
            replays[key] = triton_launch.replay(todo, slots, _DZ_SCALE_ARGS)
    if bias is not None:
        grad_b.copy_(bpart.sum(0))
    torch.mm(dz, weight, out=grad_h)
    if on_grad_hidden is not None:  # (grad_hidden first: the group's all-reduce overlaps dW)
        on_grad_hidden(grad_h)
    torch.mm(dz.T, hidden, out=grad_w)
    return grad_h, grad_w, grad_b


# Where the temperature's two scalars are among linear_logp_bwd_dz_logits_kernel's arguments.
_DZ_SCALE_ARGS = ((0, 11), (0, 12))


def _dz_launch(mod, z, target, bias, lse2, ez2, grad_logp, grad_entropy, dz, bpart, scale: float, inv_t: float,
               ignore_index: int) -> tuple:
    """backward_kept's dz launch, (kernel, grid, args, options); bpart None without a bias."""
    N, V = z.shape
    block_n, block_v, warps = KEPT_DZ_BLOCK
    with_entropy = grad_entropy is not None
    g_logp = grad_logp if grad_logp is not None else lse2
    return (mod.linear_logp_bwd_dz_logits_kernel, (_cdiv(N, block_n) * _cdiv(V, block_v),),
            (z, bias if bias is not None else z, target, lse2, ez2 if with_entropy else lse2,
             g_logp, grad_entropy if with_entropy else g_logp, dz, bpart if bpart is not None else dz,
             N, V, scale, inv_t, ignore_index),
            dict(HAS_BIAS=bias is not None, WRITE_BPART=bias is not None, WITH_ENTROPY=with_entropy,
                 HAS_GLOGP=grad_logp is not None, BLOCK_N=block_n, BLOCK_V=block_v, num_warps=warps))
