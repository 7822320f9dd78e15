"""linear_logp over a torch.distributed process group, the vocabulary split across ranks
(a vocab-parallel LM head): `linear_logp(..., group=group)`.

Each rank holds a contiguous slice of the vocabulary, weight [V_r, D] (and bias [V_r]),
slices in group-rank order and of any lengths >= 1; hidden [N, D] and target [N] (global
ids) are the same on every rank. Every rank returns the logp (and entropy) the
single-device op gives on the whole weight.

The layout: the slices' lengths (with D, dtype, bias and device type, and each rank's
verdict on its own arguments) are exchanged once per (group, V_r, D, dtype, bias, device
type) and cached (`_layout`); offsets are their prefix sums. So a group's layout is fixed by
its first call: use a new group for other lengths. Each rank's V_r also travels in the
forward's all-gather, and a call whose lengths are not the cached layout's (every rank's own
length seen before, so no rank exchanged again) gives NaN outputs and gradients on every
rank, never a merge with stale offsets (checked mode: ValueError); where only some ranks'
keys are new, the ranks run different collectives, a mismatch the group's timeout finds.

Forward: the single-device forward runs on the local slice with a local target,
t - offset where the target falls in the slice and 0 elsewhere (every row valid, so the
kernels give the slice's log-sum-exp lse_r, its entropy H_r and a target logit for every
row), then ONE all-gather of the per-row partials [lse_r, z_t or 0, H_r] (2 or 3 float32 a
row, plus one flag) and the same merge on every rank:
    lse = M + log2 sum_r 2^(lse_r - M)          (base 2, M = max_r lse_r)
    logp = (sum_r z_t,r - lse) ln 2            (one rank's z_t is not 0)
    H = sum_r w_r (H_r - ln w_r),  w_r = 2^(lse_r - lse)
Why an all-gather rather than an all-reduce: a sum of exponentials needs a common scale,
and agreeing on it (an all-reduce MAX first) would be a second collective; the gathered
p x N x 3 floats (384 KiB at N = 16384, p = 2) cost the same latency as one all-reduce
of N floats, and every rank merges the same bytes in the same order, so all ranks return
bitwise the same outputs (an all-reduce promises that only per backend).

Backward: the single-device backward on the local slice, fed the global lse and E[z]
(the dz kernel recomputes p = 2^(z - lse), so the global ones make it the slice of the
global softmax) and a target that is t - offset in the slice, -2 outside it (no one-hot
term) and -1 (its ignore_index) on ignored rows; grad_weight and grad_bias stay local,
grad_hidden is summed over the group by one all-reduce, in its dtype (16-bit inputs: each
rank's partial is rounded to 16 bits once more than on one device), started as soon as
grad_hidden is queued so that it overlaps the grad_weight passes still to come.

keep_logits: the local slice's logits are kept (kept.forward_kept, N x V_r x 4 bytes a
rank) and the backward reads them (kept.backward_kept); the collectives are the same.

Targets out of [0, V) (global) give NaN rows, as on one device; a rank that sees one
writes NaN into its z_t partial, so every rank gets the NaN row even if only one rank's
target held it. check_targets: the flag of each rank travels in the all-gather, and every
rank raises ValueError when any rank's flag is set (its host waits for the gather then).

Both directions are torch.library ops (kgen::linear_logp_dist, kgen::linear_logp_dist_
backward) taking the group by name, with fake implementations, so torch.compile
(fullgraph) sees two opaque ops and no graph break; on NCCL the collectives inside them are
captured by CUDA graphs like any other (once the layout is cached: capture after a warm-up
call, as usual).

Errors: argument problems are found before any collective. Those that depend only on
replicated arguments come out the same on every rank; a rank whose own arguments (weight,
bias) fail does not raise alone: it joins the layout exchange with its message, and every
rank raises (the exchange runs whenever a rank has a problem or a new layout key; a rank
that goes wrong after the others cached their layout is a mismatch of collectives, found
by the group's timeout, as with any collective misuse). Under torch.compile argument
checks run at trace time, on each rank alone.
"""

from __future__ import annotations

import contextlib
import math
import struct
from typing import Optional

import torch
import torch.distributed as dist

from kgen.families.linear_logp.backward_launch import backward
from kgen.families.linear_logp.checks import check_flat, check_inputs
from kgen.families.linear_logp.kept import backward_kept, forward_kept, kept_logits
from kgen.families.linear_logp.launch import LN2, LOG2E, forward
from kgen.families.linear_logp.op import _FORCED, _module, keeps_logits, using
from kgen.families.linear_logp.reference import _finite_floor
from kgen.runtime.op import MISSING, define

# ---------------------------------------------------------------------------- layout

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ERRORS = {0: None, 1: TypeError, 2: ValueError}
_HEADER = struct.Struct("<6q")  # V_r, D, dtype code, has bias, error kind, message length
_MESSAGE_BYTES = 464
# (group name, V_r, D, dtype, has bias, device type) -> (offset, V_total, lengths)
_LAYOUTS: dict = {}


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # all_gather_single is torch >= 2.12's name; all_gather_into_tensor, the older one,
    # warns there.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _comm_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")


def _layout(group_name: str, hidden, weight, bias, problem: Optional[Exception] = None):
    """(offset, V_total, lengths) of this rank's slice; exchanged across the group the first
    time per key, or whenever `problem` (this rank's argument error) is given, in which
    case every rank raises. Raises on every rank alike if the ranks disagree on D, dtype or
    bias."""
    key = None
    if problem is None:
        key = (group_name, weight.shape[0], weight.shape[1], weight.dtype, bias is not None, hidden.device.type)
        found = _LAYOUTS.get(key)
        if found is not None:
            return found
    group = _group(group_name)
    size, me = group.size(), group.rank()
    kind, text = 0, b""
    if problem is not None:
        kind = 1 if isinstance(problem, TypeError) else 2
        text = str(problem).encode()[:_MESSAGE_BYTES]
        head = (0, 0, -1, 0, kind, len(text))
    else:
        head = (weight.shape[0], weight.shape[1], _DTYPE_CODES[weight.dtype], bias is not None, 0, 0)
    msg = bytearray(_HEADER.size + _MESSAGE_BYTES)
    _HEADER.pack_into(msg, 0, *head)
    msg[_HEADER.size:_HEADER.size + len(text)] = text
    dev = _comm_device(hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu"))
    mine = torch.frombuffer(msg, dtype=torch.uint8).to(dev)
    every = torch.empty(size * len(msg), dtype=torch.uint8, device=dev)
    _all_gather(every, mine, group)
    blob = bytes(every.cpu().numpy())
    heads, texts = [], []
    for r in range(size):
        at = r * len(msg)
        h = _HEADER.unpack_from(blob, at)
        heads.append(h)
        texts.append(blob[at + _HEADER.size:at + _HEADER.size + h[5]].decode(errors="replace"))
    where = f"linear_logp(group={group_name!r}, rank {me} of {size})"
    failed = [r for r in range(size) if heads[r][4]]
    if failed:
        r = failed[0]
        raise _ERRORS[heads[r][4]](
            f"{where}: rank {r} rejected its arguments: {texts[r]}"
            + (f" (ranks {failed} failed)" if len(failed) > 1 else ""))
    for i, what in ((1, "D (weight.shape[1])"), (2, "dtype"), (3, "bias (given or None)")):
        values = [h[i] for h in heads]
        if len(set(values)) > 1:
            if i == 2:
                names = {c: str(d).removeprefix("torch.") for d, c in _DTYPE_CODES.items()}
                values = [names[v] for v in values]
            elif i == 3:
                values = [bool(v) for v in values]
            raise ValueError(f"{where}: the ranks' weight slices disagree on {what}: {values} in rank order")
    lengths = tuple(h[0] for h in heads)
    found = (sum(lengths[:me]), sum(lengths), lengths)
    _LAYOUTS[key] = found
    return found


# ---------------------------------------------------------------------------- forward


def _reference_partials(hidden, weight, target, bias, temperature: float, with_entropy: bool):
    """(logp_r, entropy_r or None, lse2_r) of the slice in float32 with its logits
    materialised: the CPU path (and where dispatch picks the PyTorch reference)."""
    z = hidden.float() @ weight.float().T
    if bias is not None:
        z = z + bias.float()
    z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, target.long()[:, None]).squeeze(1) - lse
    ent = lse - (torch.softmax(z, dim=-1) * _finite_floor(z)).sum(-1) if with_entropy else None
    return logp, ent, lse * LOG2E


def _rows(target, ignore_index: int, offset: int, V_local: int, V_total: int):
    """(valid, owned, bad) per row: not ignored; target in this rank's slice; target
    outside [0, V_total) (a NaN row)."""
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= V_total))
    owned = valid & (target >= offset) & (target < offset + V_local)
    return valid, owned, bad


def _forward_impl(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                  temperature: float, ignore_index: int, with_entropy: bool, check_targets: bool, group_name: str,
                  keep_logits: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vocab-parallel forward: 2-D hidden, 1-D global target, this rank's weight slice.
    Returns (logp [N], entropy [N] or [0], lse2 [N], ez2 [N] or [0]) of the whole
    vocabulary, the last two (base 2) for the backward, and the slice's kept logits
    [N, V_r] (keep_logits on a kernel path) or [0]; see the module docstring."""
    check_inputs(hidden, weight, target, bias, temperature, ignore_index)
    check_flat(hidden, target, "linear_logp_dist")
    offset, V_total, lengths = _layout(group_name, hidden, weight, bias)
    group = _group(group_name)
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    target = target.contiguous()
    valid, owned, bad = _rows(target, ignore_index, offset, V, V_total)
    local_t = torch.where(owned, target - offset, 0)
    mod = _module(dev, hidden.dtype, (N, D, V)) if N else None
    kept = hidden.new_empty(0, dtype=torch.float32)
    if mod is not None:
        args = (hidden.contiguous(), weight.contiguous(), local_t, bias.contiguous() if bias is not None else None,
                temperature, -1, with_entropy)
        if keep_logits:
            logp_r, ent_r, lse2_r, _, kept = forward_kept(mod, *args)
        else:
            logp_r, ent_r, lse2_r, _ = forward(mod, *args)
    else:
        logp_r, ent_r, lse2_r = _reference_partials(hidden, weight, local_t, bias, temperature, with_entropy)
        if keep_logits:  # as the fake says (the reference's backward does not read them)
            kept = kept_logits(hidden, weight)

    planes = 3 if with_entropy else 2
    # [lse2_r | z_t | H_r | this rank's V_r as two float32 (exact) | check flag]
    part = torch.empty(planes * N + 3, dtype=torch.float32, device=dev)
    part[-3:-1] = _length_pair(V, dev)
    part[:N] = lse2_r
    # lse2_r = -inf: every column of the slice is masked for that row (a -inf bias); it holds
    # none of the row's mass, and a target in it has logit -inf
    empty = lse2_r == float("-inf")
    zt = torch.where(owned, torch.where(empty, float("-inf"), logp_r * LOG2E + lse2_r), 0.0)
    part[N:2 * N] = torch.where(bad, float("nan"), zt)
    if with_entropy:
        part[2 * N:3 * N] = ent_r
    check = check_targets and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if check:
        part[-1:] = bad.any()
    else:
        part[-1:] = 0.0
    size = group.size()
    every = torch.empty(size * part.numel(), dtype=torch.float32, device=_comm_device(dev))
    _all_gather(every, part if part.device == every.device else part.to(every.device), group)
    every = every.to(dev).view(size, -1)
    # The cached layout is this group's: a call whose slices have other lengths (each rank's
    # own seen before, so no rank exchanged) would merge with stale offsets. Found on the
    # device: every output NaN (lse2 too, so the gradients), no host wait; checked mode raises.
    stale = (every[:, -3:-1] != _expected_lengths(lengths, dev)).any()
    if check and bool(stale):
        raise ValueError(f"linear_logp(group={group_name!r}, rank {group.rank()}): the ranks' slice lengths "
                         f"{_gathered_lengths(every)} are not the layout {list(lengths)} this group's first call "
                         "fixed; use a new group for a new layout")
    if check and bool(every[:, -1].any()):
        _raise_bad_target(target, every[:, -1], ignore_index, V_total, group_name, group.rank())

    lse_r = every[:, :N]
    m = lse_r.amax(0)
    w = torch.exp2(lse_r - m)
    s = w.sum(0)
    lse2 = m + torch.log2(s)
    zt = every[:, N:2 * N].sum(0)
    logp = torch.where(valid, (zt - lse2) * LN2, 0.0)
    # The single device's lse2 (combine): NaN on a bad target's row, -inf where every rank's
    # slice is masked (m = -inf there makes lse2 NaN, and logp with it), 0 on such a row when
    # it is ignored (its gradients are 0: p = 2^(-1e30 - 0) = 0)
    empty = m == float("-inf")
    lse2 = torch.where(empty, torch.where(valid, float("-inf"), 0.0),
                       torch.where(valid & torch.isnan(zt), float("nan"), lse2))
    logp, lse2 = torch.where(stale, float("nan"), logp), torch.where(stale, float("nan"), lse2)
    if not with_entropy:
        return logp, logp.new_empty(0), lse2, logp.new_empty(0), kept
    share = w / s
    # a rank whose slice is masked for the row adds nothing (share 0, its entropy NaN)
    term = torch.where(lse_r == float("-inf"), 0.0, share * (every[:, 2 * N:3 * N] - (lse_r - lse2) * LN2))
    ent = term.sum(0)
    ez2 = lse2 - ent * LOG2E
    ent = torch.where(valid & torch.isnan(zt), float("nan"), torch.where(valid, ent, 0.0))
    ent = torch.where(stale, float("nan"), ent)
    return logp, ent, lse2, ez2, kept


# Slice lengths travel in the forward's float32 gather as (V // 2^24, V % 2^24): both exact.
_HALF = 1 << 24
# (lengths, device) -> [size, 2] float32 on the device, made once: a per-call host-to-device
# copy of a Python list would wait for the stream
_EXPECTED: dict = {}


def _length_pair(V: int, dev) -> torch.Tensor:
    key = ("V", V, dev)
    found = _EXPECTED.get(key)
    if found is None:
        found = _EXPECTED[key] = torch.tensor([V // _HALF, V % _HALF], dtype=torch.float32, device=dev)
    return found


def _expected_lengths(lengths: tuple, dev) -> torch.Tensor:
    key = (lengths, dev)
    found = _EXPECTED.get(key)
    if found is None:
        found = _EXPECTED[key] = torch.tensor([[v // _HALF, v % _HALF] for v in lengths], dtype=torch.float32,
                                              device=dev)
    return found


def _gathered_lengths(every: torch.Tensor) -> list:
    return [int(hi) * _HALF + int(lo) for hi, lo in every[:, -3:-1].tolist()]


def _raise_bad_target(target, flags, ignore_index: int, V_total: int, group_name: str, me: int):
    ranks = [r for r, f in enumerate(flags.tolist()) if f]
    bad = ((target < 0) | (target >= V_total)) & (target != ignore_index)
    where = f"linear_logp(group={group_name!r}, rank {me})"
    if me in ranks:
        first = int(target[bad][0])
        raise ValueError(f"{where}: target holds {first}, outside [0, {V_total}) and not ignore_index "
                         f"({ignore_index}); ranks with such targets: {ranks}")
    raise ValueError(f"{where}: the target on rank(s) {ranks} holds a value outside [0, {V_total}) that is not "
                     f"ignore_index ({ignore_index}) (this rank's target has none: is target the same on every rank?)")


def _forward_fake(hidden, weight, target, bias, temperature, ignore_index, with_entropy, check_targets, group_name,
                  keep_logits=False):
    check_inputs(hidden, weight, target, bias, temperature, ignore_index)
    check_flat(hidden, target, "linear_logp_dist")
    N, n_ent = hidden.shape[0], hidden.shape[0] if with_entropy else 0
    new = lambda *n: hidden.new_empty(n, dtype=torch.float32)  # noqa: E731
    return new(N), new(n_ent), new(N), new(n_ent), new(N, weight.shape[0]) if keep_logits else new(0)


# ---------------------------------------------------------------------------- backward


def _reference_backward(hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy, temperature: float):
    """The slice's gradients with its logits materialised (float32), from the global lse2 /
    ez2; `target`: local ids, -1 on ignored rows, -2 where the target is elsewhere."""
    f32 = torch.float32
    h, w = hidden.to(f32), weight.to(f32)
    z = h @ w.T
    if bias is not None:
        z = z + bias.to(f32)
    z2 = _finite_floor(z * (LOG2E / temperature))  # a masked column: p = 0 and 0 * finite
    p = torch.exp2(z2 - lse2[:, None])
    valid = target != -1
    zero = torch.zeros((), dtype=f32)
    ca = torch.where(valid, grad_logp.to(f32) / temperature, zero)
    coef = ca[:, None]
    if grad_entropy is not None:
        cb = torch.where(valid, grad_entropy.to(f32) * (LN2 / temperature), zero)
        coef = coef + cb[:, None] * (z2 - ez2[:, None])
    dz = torch.where(valid[:, None], -p * coef, zero)  # an ignored row: 0 even where its logits are NaN
    rows = (target >= 0).nonzero().squeeze(1)
    dz[rows, target[rows].long()] += ca[rows]
    gb = dz.sum(0).to(bias.dtype) if bias is not None else hidden.new_empty(0)
    return (dz @ w).to(hidden.dtype), (dz.T @ h).to(weight.dtype), gb


def _backward_impl(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                   lse2: torch.Tensor, ez2: torch.Tensor, grad_logp: torch.Tensor,
                   grad_entropy: Optional[torch.Tensor], temperature: float, ignore_index: int, group_name: str,
                   logits: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden summed over the group, grad_weight and grad_bias (or [0]) of this
    rank's slice); see the module docstring."""
    offset, V_total, _ = _layout(group_name, hidden, weight, bias)
    V = weight.shape[0]
    valid, owned, _ = _rows(target, ignore_index, offset, V, V_total)
    local_t = torch.where(owned, target - offset, torch.where(valid, -2, -1))
    group = _group(group_name)
    mod = _module(hidden.device, hidden.dtype)
    work = []
    if mod is not None:
        # The all-reduce starts as soon as grad_hidden is queued and runs beside the
        # grad_weight passes still to come (the rows whose memory held grad_hidden's float32
        # accumulator: 2N rows for 16-bit inputs at large N). Not during graph capture: there
        # the synchronous form, captured in order.
        capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()

        def start(gh):
            if not capturing:
                work.append(dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=group, async_op=True))

        args = (hidden.contiguous(), weight.contiguous(), local_t, bias.contiguous() if bias is not None else None,
                lse2, ez2, grad_logp.contiguous(), None if grad_entropy is None else grad_entropy.contiguous(),
                temperature, -1)
        if logits is not None and logits.numel():  # the forward kept the slice's logits
            gh, gw, gb = backward_kept(mod, logits, *args, on_grad_hidden=start)
        else:
            gh, gw, gb = backward(mod, *args, on_grad_hidden=start)
        gb = gb if gb is not None else hidden.new_empty(0)
    else:
        gh, gw, gb = _reference_backward(hidden, weight, local_t, bias, lse2, ez2, grad_logp, grad_entropy,
                                         temperature)
    if work:
        work[0].wait()  # on CUDA: the current stream waits, not the host
    else:
        dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=group)
    return gh, gw, gb


def _backward_fake(hidden, weight, target, bias, lse2, ez2, grad_logp, grad_entropy, temperature, ignore_index,
                   group_name, logits=None):
    return (torch.empty_like(hidden), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, temperature, ignore_index, with_entropy, _check, group_name = inputs[:9]
    _, _, lse2, ez2, logits = output
    ctx.save_for_backward(hidden, weight, target, bias, lse2, ez2, logits)
    ctx.pad = (None,) * (len(inputs) - 4)  # the gradients of the non-tensor inputs (keep_logits optional)
    ctx.temperature, ctx.ignore_index, ctx.with_entropy = temperature, ignore_index, with_entropy
    ctx.has_bias, ctx.group_name = bias is not None, group_name
    ctx.forced = _FORCED.get()  # `using(mod)` holds for the backward too
    # No zero tensors for outputs without a gradient (lse2, ez2, an unused entropy, and the
    # kept logits: N x V_r float32): they arrive as None.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse2, _grad_ez2, _grad_logits):
    hidden, weight, target, bias, lse2, ez2, logits = ctx.saved_tensors
    if grad_logp is None:  # only the entropy has a gradient
        grad_logp = torch.zeros_like(lse2)
    with using(ctx.forced) if ctx.forced is not MISSING else contextlib.nullcontext():
        gh, gw, gb = _bwd_op(hidden, weight, target, bias, lse2, ez2, grad_logp,
                             grad_entropy if ctx.with_entropy else None, ctx.temperature, ctx.ignore_index,
                             ctx.group_name, logits if logits.numel() else None)
    return gh, gw, None, gb if ctx.has_bias else None, *ctx.pad


_bwd_op = define("linear_logp_dist_backward", _backward_impl, fake=_backward_fake)
_op = define("linear_logp_dist", _forward_impl, fake=_forward_fake, backward=_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------- entry


def linear_logp_group(hidden, weight, target, bias, temperature, ignore_index, return_entropy: bool,
                      check_targets: bool, group, keep_logits: bool = False):
    """linear_logp(..., group=group): see the module docstring and kgen.ops.linear_logp."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"linear_logp: group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    if torch.compiler.is_compiling():
        check_inputs(hidden, weight, target, bias, temperature, ignore_index)
    else:
        try:
            check_inputs(hidden, weight, target, bias, temperature, ignore_index)
        except (TypeError, ValueError) as problem:  # every rank raises, not this one alone
            _layout(group.group_name, hidden, weight, bias, problem)
            raise  # unreachable: _layout raised
    D = weight.shape[1]
    shape = hidden.shape[:-1]
    # (linear_logp asked for the logits only where a gradient will be; here: where they pay)
    keep_logits = keep_logits and keeps_logits(hidden, weight)
    logp, entropy = _op(hidden.reshape(math.prod(shape), D), weight, target.reshape(math.prod(shape)), bias, float(temperature),
                        int(ignore_index), bool(return_entropy), bool(check_targets), group.group_name,
                        bool(keep_logits))[:2]
    logp = logp.reshape(shape)
    return (logp, entropy.reshape(shape)) if return_entropy else logp
