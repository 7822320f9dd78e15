"""linear_logp's math in PyTorch, with the N x V logits materialised: the CPU path and the
tests' float64 oracle."""

from __future__ import annotations

import math
import torch


def reference(hidden, weight, target, bias=None, *, temperature: float = 1.0,
              ignore_index: int = -100, compute=torch.float32):
    """(logp, entropy) in `compute` precision (float32: the CPU path; float64: the test
    oracle), shaped like hidden.shape[:-1]. Materialises the N x V logits; differentiable
    through torch autograd. As the kernels: a -inf logit (a masked column) holds no mass and
    adds 0 to the entropy (a target on it: logp -inf); a row whose logits are all -inf, or
    one with a +inf logit, has NaN logp and entropy; so has a target outside [0, V)."""
    shape = hidden.shape[:-1]
    # (sizes, not -1: under vmap over an empty batch -1 is ambiguous)
    h = hidden.reshape(math.prod(shape), hidden.shape[-1]).to(compute)
    logits = h @ weight.to(compute).T
    if bias is not None:
        logits = logits + bias.to(compute)
    logits = logits / temperature
    t = target.reshape(math.prod(target.shape)).long()
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= logits.shape[1]))  # NaN rows, as the kernels give
    # An ignored row's logits are left out before any reduction, so that its NaN or inf
    # (a padded position's hidden state) gives no gradient under autograd either: 0 x NaN.
    logits = torch.where(valid[:, None], logits, logits.new_zeros(()))
    # Shifted by the row's maximum (where finite; detached: it cancels) before the
    # differences: logp = z_t - lse and entropy = lse - E[z] then subtract numbers of the
    # logits' spread, not of their size (a common offset of 1e4 cost 4.7e-4 in logp and
    # 9.8e-4 in entropy unshifted; PyTorch's log_softmax 3e-7)
    logits = _shifted(logits)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(1, torch.where(valid & ~bad, t, 0)[:, None]).squeeze(1) - lse
    entropy = lse - (torch.softmax(logits, dim=-1) * _finite_floor(logits)).sum(-1)
    zero = logp.new_zeros(())
    bad = bad | (valid & (lse == float("inf")))  # the kernels' z - max is inf - inf there
    # NaN on a bad row by a product, not a select: its gradients are NaN too under autograd
    # (as the kernels give them), not the 0 a select would give, which reads as an ignored row
    poison = torch.where(bad, logp.new_full((), float("nan")), logp.new_ones(()))
    valid, poison = valid.reshape(shape), poison.reshape(shape)

    def rows(x):  # (shaped before the product: a new tensor, not a view, which in place edits take)
        return torch.where(valid, x.reshape(shape), zero) * poison

    return rows(logp), rows(entropy)


def _shifted(z):
    """Logits [rows, V] less each row's maximum where it is finite (detached: every quantity
    taken from them is shift-invariant, so gradients are unchanged); a row holding +inf,
    NaN or only -inf is left as it is, to give the NaN it gives unshifted."""
    if not z.shape[1]:
        return z
    m = z.detach().amax(dim=-1, keepdim=True)
    return z - torch.where(torch.isfinite(m), m, m.new_zeros(()))


def _finite_floor(z):
    """z with everything below -1e30 (a -inf: a masked column) raised to -1e30, the kernels'
    MASKED_LOGIT (NaN stays NaN): p * z and p * c * (z - E[z]) are then 0 there, not 0 * -inf
    (the dtype's lowest finite value would overflow to -inf once scaled)."""
    return z.clamp_min(-1.0e30)


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
    z = _shifted(z)  # (z - E[z] then loses no digits to an offset)
    p = torch.softmax(z, dim=-1)
    target = target.long()  # (compared in int64, as the forward: an int32 target and a wide ignore_index)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < w.shape[0])
    dz = -p * grad_logp.to(f32)[:, None]
    rows = (valid & in_range).nonzero().squeeze(1)
    dz[rows, target[rows].long()] += grad_logp.to(f32)[rows]
    if grad_entropy is not None:
        zf = _finite_floor(z)
        ez = (p * zf).sum(-1, keepdim=True)
        dz -= grad_entropy.to(f32)[:, None] * p * (zf - ez)
    # a target outside [0, V): the row's gradients are NaN, as its logp is (the kernels' lse2)
    dz = torch.where((valid & ~in_range)[:, None], float("nan"), dz)
    dz = torch.where(valid[:, None], dz, torch.zeros((), dtype=f32)) / temperature
    gb = dz.sum(0).to(bias.dtype) if bias is not None else hidden.new_empty(0)
    return (dz @ w).to(hidden.dtype), (dz.T @ h).to(weight.dtype), gb


def reference_dz(hidden, weight, target, lse2, ez2, g_logp, g_ent, temperature: float, ignore_index: int,
                 v0: int, v1: int, compute=torch.float32):
    """The dz kernels' contract (Triton linear_logp_bwd_dz_kernel, CUDA CudaForward.dz) in
    `compute` precision, no bias: for vocabulary columns [v0, v1), from the forward's own
    base-2 row statistics lse2 and ez2, dz = ca * (onehot - p) - cb * p * (z - ez2) with
    z = logit * log2(e) / T, p = exp2(z - lse2), ca = g_logp / T and cb = g_ent * ln2 / T
    (g_logp None: zeros; g_ent and ez2 None: no entropy term); an ignored row's dz is 0, also
    where its logits are NaN."""
    z = (hidden.to(compute) @ weight[v0:v1].to(compute).T) * (1.4426950408889634 / temperature)
    p = torch.exp2(z - lse2.to(compute)[:, None])
    valid = target != ignore_index
    zero = torch.zeros((), dtype=compute, device=hidden.device)
    if g_logp is None:
        ca = zero.expand(len(target))
    else:
        ca = torch.where(valid, g_logp.to(compute) / temperature, zero)
    coef = ca[:, None]
    if g_ent is not None:
        cb = torch.where(valid, g_ent.to(compute) * (0.6931471805599453 / temperature), zero)
        coef = coef + cb[:, None] * (z - ez2.to(compute)[:, None])
    hit = target[:, None] == torch.arange(v0, v1, device=target.device)[None, :]
    return torch.where(valid[:, None], torch.where(hit, ca[:, None], zero) - p * coef, zero)
