"""linear_logp with group=: the vocabulary split over the ranks of a torch.distributed group.

CPU (CI): 2 and 3 processes on gloo; every rank's logp, entropy and gradients against the
single-process op on the whole weight (the PyTorch reference path and, under the Triton
interpreter, the kernels' path), uneven slices (one of a single row), bias, temperature,
ignored rows, random upstream gradients, out-of-range targets, torch.compile, and
argument errors on one rank raising on every rank. GPU (`gpu` + `multigpu`, 2+ GPUs):
NCCL at bf16 with dispatch's kernels, CUDA graph replay and torch.compile.

Each world is one spawn running every case (process start-up dominates: ~3 s a process);
a hang fails the test through the group's timeout and the join deadline, not CI's."""

from __future__ import annotations

import datetime
import math
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kgen import ops

# Seconds: a collective that waits longer raises (gloo / NCCL timeout); the whole spawn.
COLLECTIVE_TIMEOUT = 30
DEADLINE = 240
# float32, dist vs one process: the same float32 math except the merge of the per-rank
# log-sum-exps (order and one exp2/log2 each: ~1e-7 relative of |logits| ~ 10) and the
# target logit's round trip through logp_r + lse_r; gradients carry the lse's rounding.
F32_TOL = dict(rtol=2e-5, atol=2e-5)
# bf16 on the GPU vs the one-GPU op: both round dz to bf16 before the gradient GEMMs;
# grad_hidden is rounded once per rank before the all-reduce (2^-9 relative each), judged
# against the largest element like GRAD_TOL in kgen.families.linear_logp.op.
BF16_GRAD_TOL = 3e-2


def make_inputs(N, V, D, dtype=torch.float32, bias=True, ignore=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) * (2.0 / math.sqrt(D))).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, V, (N,), generator=g)
    if ignore and N > 1:
        target[::3] = -100
    to = lambda x: x.to(device) if x is not None else None  # noqa: E731
    return to(hidden), to(weight), to(target), to(b)


def slices(lengths, rank):
    begin = sum(lengths[:rank])
    return slice(begin, begin + lengths[rank])


def run(hidden, weight, target, bias, group=None, entropy=True, temperature=0.7, seed=1, wrap=None, **kw):
    """Forward and backward with random upstream gradients (the same on every rank):
    (logp, entropy, grad_hidden, grad_weight, grad_bias)."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None

    def f(h, w, t, b):
        return ops.linear_logp(h, w, t, b, temperature=temperature, return_entropy=True if entropy else False,
                               group=group, **kw)

    out = (wrap(f) if wrap else f)(h, w, target, b)
    logp, ent = out if entropy else (out, None)
    g = torch.Generator().manual_seed(seed)
    g_logp = torch.randn(logp.shape, generator=g).to(logp.device)
    g_ent = torch.randn(logp.shape, generator=g).to(logp.device)
    loss = (logp * g_logp).nansum() + ((ent * g_ent).nansum() if entropy else 0)
    loss.backward()
    return logp, ent, h.grad, w.grad, (b.grad if b is not None else None)


def compare(got, want, rank, lengths, what, tol=F32_TOL, grad_tol=None):
    sl = slices(lengths, rank)
    names = ("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias")
    want = list(want)
    want[3] = want[3][sl] if want[3] is not None else None
    want[4] = want[4][sl] if want[4] is not None else None
    for name, a, e in zip(names, got, want):
        msg = f"{what}: {name} on rank {rank}"
        if e is None:
            assert a is None, msg
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, msg
        if name.startswith("grad") and grad_tol is not None:
            scale = max(1.0, e.double().abs().max().item())
            torch.testing.assert_close(a.double(), e.double(), rtol=grad_tol, atol=grad_tol * scale, msg=msg)
        else:
            torch.testing.assert_close(a.double(), e.double(), equal_nan=True, msg=msg, **tol)


def same_on_every_rank(x, group, what):
    """Outputs must be bitwise identical across ranks."""
    every = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(every, x.contiguous(), group=group)
    for r, y in enumerate(every):
        assert torch.equal(torch.nan_to_num(y, 7.0), torch.nan_to_num(x, 7.0)), f"{what}: rank {r} differs"


def expect_error(fn, error, match):
    with pytest.raises(error, match=match):
        fn()


# ----------------------------------------------------------------------------- CPU cases


def masked_vocab(bias, target, lengths):
    """(bias with the last slice and every 5th column of the first set to -inf, target moved
    to live columns where not ignored)."""
    b = bias.clone()
    b[sum(lengths[:-1]):] = -math.inf
    b[:lengths[0]:5] = -math.inf
    live = torch.isfinite(b).nonzero().squeeze(1)
    t = torch.where(target == -100, target, live[torch.arange(len(target)) % len(live)])
    return b, t


def cpu_cases(rank, world):
    group = dist.group.WORLD
    lengths = {2: (40, 61), 3: (30, 1, 70)}[world]  # V = 101 and 101; uneven, one of 1 row
    V, D = sum(lengths), 24
    hidden, weight, target, bias = make_inputs(37, V, D)
    sl = slices(lengths, rank)
    for kw in (dict(), dict(temperature=1.0, entropy=False), dict(temperature=1.3)):
        for b in (bias, None):
            want = run(hidden, weight, target, b, **kw)
            got = run(hidden, weight[sl], target, b[sl] if b is not None else None, group=group, **kw)
            compare(got, want, rank, lengths, f"reference path {kw} bias={b is not None}")
            for x in got[:2]:
                if x is not None:
                    same_on_every_rank(x, group, "outputs")

    # leading dims, int32 target, check_targets on valid targets
    h3, t3 = hidden[:36].reshape(3, 12, D), target[:36].int().reshape(3, 12)
    want = run(h3, weight, t3, bias)
    got = run(h3, weight[sl], t3, bias[sl], group=group, check_targets=True)
    compare(got, want, rank, lengths, "leading dims")
    assert got[0].shape == (3, 12)

    # targets out of range: NaN rows (logp, entropy), gradients as on one process
    bad = target.clone()
    bad[1], bad[2] = V, -5
    want, got = run(hidden, weight, bad, bias), run(hidden, weight[sl], bad, bias[sl], group=group)
    assert torch.isnan(got[0][1]) and torch.isnan(got[1][2]) and not torch.isnan(got[0][0])
    compare(got, want, rank, lengths, "out-of-range targets")

    # a vocabulary padded with -inf bias: the last rank's slice all masked, a few of rank 0's
    # too, targets on live columns (a slice holding none of a row adds nothing)
    masked_bias, live_t = masked_vocab(bias, target, lengths)
    want = run(hidden, weight, live_t, masked_bias)
    got = run(hidden, weight[sl], live_t, masked_bias[sl], group=group)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()
    compare(got, want, rank, lengths, "masked vocabulary")

    # a bad target on one rank alone: NaN on every rank's row
    mine = target.clone()
    if rank == world - 1:
        mine[4] = V + 3
    logp = ops.linear_logp(hidden, weight[sl], mine, bias[sl], group=group)
    assert torch.isnan(logp[4]) and int(torch.isnan(logp).sum()) == 1
    # ... and with check_targets, ValueError on every rank
    expect_error(lambda: ops.linear_logp(hidden, weight[sl], mine, bias[sl], group=group, check_targets=True),
                 ValueError, rf"outside \[0, {V}\)")

    # Triton kernels (interpreter) on the local slice: the GPU path's logic
    kernel_cases(rank, world, group)

    # argument errors on one rank: every rank raises (each case on a fresh group, whose
    # layout is not cached yet)
    def fresh():
        return dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))

    last = rank == world - 1
    g1 = fresh()
    w_bad = weight[sl].double() if last else weight[sl]
    expect_error(lambda: ops.linear_logp(hidden, w_bad, target, bias[sl], group=g1), TypeError,
                 rf"rank {world - 1} rejected its arguments: .*weight dtype torch.float64")
    # the group still works afterwards
    compare(run(hidden, weight[sl], target, bias[sl], group=g1), run(hidden, weight, target, bias), rank, lengths,
            "after an error")
    g2 = fresh()
    w_bad = weight[sl, :D - 1] if last else weight[sl]
    expect_error(lambda: ops.linear_logp(hidden, w_bad, target, bias[sl] if not last else None, group=g2),
                 ValueError, f"rank {world - 1} rejected its arguments: .*last dimension")
    g3 = fresh()
    expect_error(lambda: ops.linear_logp(hidden, weight[sl], target, bias[sl] if not last else None, group=g3),
                 ValueError, r"disagree on bias")
    expect_error(lambda: ops.linear_logp(hidden, weight[sl], target, group="world"), TypeError, "ProcessGroup")

    # a group's layout is fixed by its first call: slices of other lengths, each rank's own
    # length seen before (no rank exchanges again), give NaN on every rank rather than a merge
    # with stale offsets; checked mode says why
    g4 = fresh()
    for lengths4 in ((10, 13, 5), (12, 12, 6), (10, 12, 6)):
        lengths4 = lengths4[:world]
        V4 = sum(lengths4)
        w4 = torch.randn(V4, D, generator=torch.Generator().manual_seed(V4))
        t4 = torch.arange(6) * 3 % V4
        s4 = slices(lengths4, rank)
        got4 = ops.linear_logp(hidden[:6], w4[s4], t4, group=g4)
        if lengths4[:2] != (10, 12):
            torch.testing.assert_close(got4, ops.linear_logp(hidden[:6], w4, t4), **F32_TOL)
    assert torch.isnan(got4).all()
    expect_error(lambda: ops.linear_logp(hidden[:6], w4[s4], t4, group=g4, check_targets=True), ValueError,
                 r"slice lengths \[10, 12.*are not the layout \[1[02], 1[23]")

    if world == 2:  # torch.compile, once: a few seconds of tracing
        from torch import _dynamo

        _dynamo.reset()
        wrap = lambda f: torch.compile(f, fullgraph=True, backend="aot_eager")  # noqa: E731
        got = run(hidden, weight[sl], target, bias[sl], group=group, wrap=wrap)
        compare(got, run(hidden, weight, target, bias), rank, lengths, "torch.compile")


def kernel_cases(rank, world, group):
    """The kernels' path (forward partials with local targets, backward with the global
    lse) under the Triton interpreter: float32 and bf16, against the single-process op
    with the same variant."""
    from kgen.families import linear_logp as llp
    from kgen.runtime import dispatch
    from kgen import spec

    text = ("family: linear_logp\nvariants:\n  - {backend: triton, block_n: 16, block_v: 32, block_d: 16, "
            "num_warps: 4, num_stages: 2, split_v: 2}\n")
    variants = {v.dtype: v for v in spec.parse(text, "tests/linear_logp_dist.yaml").variants}
    lengths = {2: (45, 70), 3: (40, 3, 72)}[world]
    sl = slices(lengths, rank)
    llp.op.KEEP_LOGITS_MIN_FLOP = 0  # (this process's own: tiny shapes kept all the same)
    kept_calls = _count_forward_kept()
    cases = ((torch.float32, None), (torch.bfloat16, BF16_GRAD_TOL))
    for dtype, grad_tol in cases if world == 2 else cases[:1]:  # bf16 once: the interpreter is slow
        mod = dispatch.load(variants[str(dtype).removeprefix("torch.")]).module
        hidden, weight, target, bias = make_inputs(19, sum(lengths), 16, dtype=dtype, seed=5)
        with llp.using(mod):
            want = run(hidden, weight, target, bias)
            got = run(hidden, weight[sl], target, bias[sl], group=group)
            kept = run(hidden, weight[sl], target, bias[sl], group=group, keep_logits=True)
        compare(got, want, rank, lengths, f"kernels {dtype}", grad_tol=grad_tol)
        if dtype is torch.float32:  # the kernels' masked columns: a rank's whole slice masked
            masked_bias, live_t = masked_vocab(bias, target, lengths)
            with llp.using(mod):
                want_m = run(hidden, weight, live_t, masked_bias)
                got_m = run(hidden, weight[sl], live_t, masked_bias[sl], group=group)
            assert all(torch.isfinite(x).all() for x in got_m[:3])
            compare(got_m, want_m, rank, lengths, "kernels, masked vocabulary")
        compare(kept, want, rank, lengths, f"kernels {dtype}, keep_logits", grad_tol=grad_tol)
        assert kept_calls, "keep_logits kept nothing"
        kept_calls.clear()


def _count_forward_kept() -> list:
    """A list that gets an item per call of the group op's forward_kept (this process)."""
    from kgen.families.linear_logp import dist as llp_dist

    calls, real = [], llp_dist.forward_kept
    llp_dist.forward_kept = lambda *a: calls.append(1) or real(*a)
    return calls


def _worker(rank, world, store_path, cases):
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if cases == "cpu":
        from kgen.runtime import interpret

        interpret.enable()
        backend, device = "gloo", None
    else:
        torch.cuda.set_device(rank)
        backend, device = "nccl", torch.device("cuda", rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT), device_id=device)
    try:
        (cpu_cases if cases == "cpu" else gpu_cases)(rank, world)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def spawn(world, tmp_path, cases):
    ctx = mp.start_processes(_worker, args=(world, str(tmp_path / "store"), cases), nprocs=world, join=False,
                             start_method="spawn")
    import time

    end = time.monotonic() + DEADLINE
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > end:
                pytest.fail(f"{world} processes still running after {DEADLINE} s: a hang")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_matches_one_process(world, tmp_path):
    spawn(world, tmp_path, "cpu")


# ----------------------------------------------------------------------------- GPU cases


def gpu_cases(rank, world):
    group = dist.group.WORLD
    dev = torch.device("cuda", rank)
    V, D = 50257 + world, 1024  # not a multiple of the tiles; uneven slices
    lengths = [V // world + (1 if r < V % world else 0) for r in range(world)]
    lengths[0] += 77
    lengths[-1] -= 77
    sl = slices(lengths, rank)
    hidden, weight, target, bias = make_inputs(1031, V, D, dtype=torch.bfloat16, seed=3, device=dev)
    want = run(hidden, weight, target, bias)
    got = run(hidden, weight[sl], target, bias[sl], group=group)
    # Forward: the slices' partials merge in another order than the one-GPU splits': float32
    # rounding of lse (~1e-7 relative of |logits|).
    fwd_tol = dict(rtol=2e-5, atol=5e-5)
    compare(got, want, rank, lengths, "nccl bf16", tol=fwd_tol, grad_tol=BF16_GRAD_TOL)
    same_on_every_rank(got[0], group, "logp")
    from kgen.families import linear_logp as llp

    llp.op.KEEP_LOGITS_MIN_FLOP = 0  # (this process's own)
    kept_calls = _count_forward_kept()
    kept = run(hidden, weight[sl], target, bias[sl], group=group, keep_logits=True)
    compare(kept, want, rank, lengths, "nccl bf16, keep_logits", tol=fwd_tol, grad_tol=BF16_GRAD_TOL)
    assert kept_calls, "keep_logits kept nothing"

    # CUDA graph replay: warm up (caches the layout, builds the kernels), capture, replay
    # on new values.
    h = hidden.clone()
    t = target.clone()
    w, b = weight[sl].contiguous(), bias[sl].contiguous()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            ops.linear_logp(h, w, t, b, return_entropy=True, group=group)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_logp, out_ent = ops.linear_logp(h, w, t, b, return_entropy=True, group=group)
    h2, _, t2, _ = make_inputs(1031, V, D, dtype=torch.bfloat16, seed=9, device=dev)
    h.copy_(h2)
    t.copy_(t2)
    graph.replay()
    ref_logp, ref_ent = ops.linear_logp(h2, weight, t2, bias, return_entropy=True)
    torch.testing.assert_close(out_logp, ref_logp, equal_nan=True, **fwd_tol)
    torch.testing.assert_close(out_ent, ref_ent, equal_nan=True, **fwd_tol)

    # torch.compile(fullgraph=True)
    wrap = lambda f: torch.compile(f, fullgraph=True)  # noqa: E731
    got = run(hidden, weight[sl], target, bias[sl], group=group, wrap=wrap)
    compare(got, want, rank, lengths, "nccl bf16 compiled", tol=fwd_tol, grad_tol=BF16_GRAD_TOL)
    got = run(hidden, weight[sl], target, bias[sl], group=group, wrap=wrap, keep_logits=True)
    compare(got, want, rank, lengths, "nccl bf16 compiled, keep_logits", tol=fwd_tol, grad_tol=BF16_GRAD_TOL)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_bf16_graphs_and_compile(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(2, tmp_path, "gpu")
