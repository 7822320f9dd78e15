"""Vocab-parallel linear_logp on the GPUs of one host (issue 23), bf16, no bias.

    torchrun --nproc-per-node 2 tools/bench_llp_dist.py [--shapes N,D,V ...] [--iters 10]

Per shape: kgen on one GPU (the whole weight, rank 0 alone), kgen over the group (V split
in near-equal slices, in rank order), each also with keep_logits=True (the logits kept for
the backward: its "fwd" column is the forward without a gradient, which keeps nothing), a
Megatron-style vocab-parallel log_softmax + gather in eager PyTorch (each rank materialises its N x V/p logits in float32; three all-reduces
of N floats forward, one of grad_hidden backward), forward and forward + backward (the
gradients of hidden and weight), each rank's peak memory above its inputs, and the two
collectives kgen makes, timed alone at the same sizes. Times: median of CUDA-event times
per iteration, the slowest rank's.

With verl's kernel files in .peers/verl (issue 23: copied there for the device run, never
committed; see .peers/verl/README), also verl's `linear_cross_entropy` on the same group
and inputs, and its logp's and entropy's largest difference from kgen's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kgen import ops

SHAPES = ((8192, 4096, 128256), (16384, 4096, 151936))
PEERS = Path(__file__).resolve().parents[1] / ".peers"


def timed(fn, iters: int, group) -> float:
    """Median ms per call on this rank, then the max over the group."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    t = torch.tensor([statistics.median(times)], device="cuda")
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


class MegatronStyle(torch.autograd.Function):
    """log_softmax(h @ w_r.T)[t] over the group as Megatron's vocab-parallel cross entropy
    computes it: float32 logits of the slice, all-reduce MAX of the row maxima, all-reduce
    SUM of the target logits and of the sums of exp; backward from the saved softmax."""

    @staticmethod
    def forward(ctx, h, w, t, offset: int, group):
        logits = (h @ w.T).float()
        m = logits.amax(-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        logits -= m[:, None]
        owned = (t >= offset) & (t < offset + w.shape[0])
        local = torch.where(owned, t - offset, 0)
        zt = torch.where(owned, logits.gather(1, local[:, None]).squeeze(1), 0.0)
        dist.all_reduce(zt, group=group)
        p = logits.exp_()
        s = p.sum(-1)
        dist.all_reduce(s, group=group)
        p /= s[:, None]
        ctx.save_for_backward(p, h, w, local, owned)
        ctx.group = group
        return zt - s.log()

    @staticmethod
    def backward(ctx, g):
        p, h, w, local, owned = ctx.saved_tensors
        grad = p.mul_(-g[:, None])
        rows = owned.nonzero().squeeze(1)
        grad[rows, local[rows]] += g[rows]
        grad = grad.to(h.dtype)
        gh = grad @ w
        dist.all_reduce(gh, group=ctx.group)
        return gh, grad.T @ h, None, None, None


def load_verl():
    """verl's linear_cross_entropy from .peers/verl, or a line saying why not."""
    if not (PEERS / "verl").is_dir():
        return None, f"verl: skipped, no {PEERS / 'verl'}"
    sys.path.insert(0, str(PEERS / "verl"))
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    except Exception as e:  # a peer that does not import must not stop the other rows
        return None, f"verl: skipped, its import failed: {type(e).__name__}: {e}"
    return linear_cross_entropy, None


class AllReduceGrad(torch.autograd.Function):
    """Identity forward, gradient summed over the group backward: Megatron's
    copy_to_tensor_model_parallel_region, which verl's kernel leaves to its caller (its
    d_hidden is this rank's part), as kgen and MegatronStyle do inside theirs."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def verl_logp(lce, h, w, t, group):
    """logp of verl's kernel (it computes the entropy too, always). Its vocab slices must be
    equal: it places rank r's slice at r * V_local."""
    logp, _ = lce(AllReduceGrad.apply(h, group), w, t, 1.0, "none", group)
    if logp.requires_grad:
        logp.register_hook(torch.Tensor.contiguous)  # verl asserts it; sum()'s gradient is expanded
    return logp


@torch.no_grad()
def verl_vs_kgen(lce, h, w, t, group) -> list[float]:
    """Largest |difference| of logp and of entropy, verl's against kgen's, over the group."""
    logp, entropy = ops.linear_logp(h, w, t, return_entropy=True, group=group)
    v_logp, v_entropy = lce(h, w, t, 1.0, "none", group)
    diff = torch.stack([(v_logp - logp).abs().max(), (v_entropy - entropy).abs().max()])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    return diff.tolist()


def verl_row(lce, h, w, t, group, world, both) -> str:
    """Checks verl's kernel against kgen's, then times it through both(); returns the line to
    print. An error (the same on every rank: it raises before its first collective) becomes
    that line, not the end of the run."""
    try:
        d_logp, d_entropy = verl_vs_kgen(lce, h, w, t, group)
        both(f"verl linear_cross_entropy, {world} GPUs", lambda *x: verl_logp(lce, *(x or (h, w)), t, group),
             (h, w), group)
    except Exception as e:
        return f"verl: failed: {type(e).__name__}: {str(e)[:300]}"
    return (f"verl (computes the entropy too) vs kgen: max |logp difference| {d_logp:.3g}, "
            f"max |entropy difference| {d_entropy:.3g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# {torch.cuda.get_device_name()} x {world}, torch {torch.__version__}, bf16, no bias; "
        f"ms: median of {args.iters}, slowest rank; MiB: peak above inputs, largest rank")
    lce, why_not = load_verl()
    if why_not:
        say(why_not)
    for shape in args.shapes:
        N, D, V = map(int, shape.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.randn(N, D, device="cuda", generator=g) * 0.5).bfloat16()
        w_full = (torch.randn(V, D, device="cuda", generator=g) * D ** -0.5).bfloat16()
        t = torch.randint(0, V, (N,), device="cuda", generator=g)
        lengths = [V // world + (1 if r < V % world else 0) for r in range(world)]
        offset = sum(lengths[:rank])
        w = w_full[offset:offset + lengths[rank]].clone()
        rows = []

        def both(name, fwd, leaves, grp):
            with torch.no_grad():
                f_ms = timed(fwd, args.iters, grp)
                f_mem = peak_mib(fwd)

            def fb():
                leaf = [x.detach().requires_grad_() for x in leaves]
                torch.autograd.grad(fwd(*leaf).sum(), leaf)

            b_ms = timed(fb, args.iters, grp)
            b_mem = peak_mib(fb)
            mem = torch.tensor([f_mem, b_mem], device="cuda")
            if grp is not None:
                dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=grp)
            rows.append((name, f_ms, b_ms, *mem.tolist()))

        # One GPU: rank 0 alone, the whole weight (the others wait).
        if rank == 0:
            both("kgen, 1 GPU (whole V)", lambda *x: ops.linear_logp(*(x or (h, w_full)), t), (h, w_full), None)
            both("kgen, 1 GPU, keep_logits", lambda *x: ops.linear_logp(*(x or (h, w_full)), t, keep_logits=True),
                 (h, w_full), None)
        dist.barrier()
        del w_full
        torch.cuda.empty_cache()

        both(f"kgen, {world} GPUs (group=)", lambda *x: ops.linear_logp(*(x or (h, w)), t, group=group), (h, w),
             group)
        both(f"kgen, {world} GPUs, keep_logits",
             lambda *x: ops.linear_logp(*(x or (h, w)), t, group=group, keep_logits=True), (h, w), group)
        both(f"Megatron-style eager, {world} GPUs",
             lambda *x: MegatronStyle.apply(*(x or (h, w)), t, offset, group), (h, w), group)
        verl_line = None
        if lce is not None and len(set(lengths)) > 1:
            verl_line = f"verl: skipped, its slices must be equal and V={V} splits as {lengths}"
        elif lce is not None:
            verl_line = verl_row(lce, h, w, t, group, world, both)

        # kgen's collectives alone: the forward's all-gather of 2N + 1 floats (3N + 1 with
        # entropy), the backward's all-reduce of N x D bf16.
        part = torch.zeros(2 * N + 1, device="cuda")
        every = torch.empty(world * part.numel(), device="cuda")
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        ag = timed(lambda: gather(every, part, group=group), args.iters, group)
        gh = torch.zeros(N, D, dtype=torch.bfloat16, device="cuda")
        ar = timed(lambda: dist.all_reduce(gh, group=group), args.iters, group)

        base_f, base_b = rows[0][1], rows[0][2]
        say(f"\n## N={N} D={D} V={V} (slices {lengths})")
        say(f"{'':36s} {'fwd ms':>8s} {'x 1GPU':>7s} {'fwd+bwd ms':>11s} {'x 1GPU':>7s} "
            f"{'fwd MiB':>8s} {'f+b MiB':>8s}")
        for name, f_ms, b_ms, f_mem, b_mem in rows:
            say(f"{name:36s} {f_ms:8.2f} {f_ms / base_f:7.2f} {b_ms:11.2f} {b_ms / base_b:7.2f} "
                f"{f_mem:8.0f} {b_mem:8.0f}")
        if verl_line:
            say(verl_line)
        say(f"communication alone: forward all-gather of {world} x {(2 * N + 1) * 4 / 1024:.0f} KiB {ag:.3f} ms; "
            f"backward all-reduce of {N * D * 2 / 2**20:.0f} MiB bf16 {ar:.3f} ms")
        del h, w, t, part, every, gh
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
