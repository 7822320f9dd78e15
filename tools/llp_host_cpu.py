"""The host (Python) cost of small linear_logp calls, measured without a GPU (issue 19).

Every kernel the op would launch is stubbed: the implementation is a stand-in for what
dispatch picks on an H100 for bf16 (a CudaForward of an sm_90a variant whose C launcher
returns at once, with a Triton companion whose kernels return at once: `--triton` runs the
Triton module itself instead), and the backward's GEMMs (torch.mm / torch.addmm called by
the family's modules) count a launch and return. The tensors are CPU tensors; what remains
is what the op does on the host besides the launches themselves: Python, torch's
dispatcher and allocator (the CPU's: a 262 MB grad_weight at V = 32000 costs ~25 us to
allocate here, a few on a GPU's caching allocator), the autograd engine (on the calling
thread here, a device thread for CUDA tensors). The eager PyTorch expression is timed
beside it at a tiny shape (N=8, D=16, V=32: its CPU kernels cost ~nothing there), as the
host cost of its ~10 torch calls.

Prints µs per call (min over rounds of a loop) for: the forward without autograd
(inference), the forward recording autograd, and forward + backward; then, per call, the
aten ops (TorchDispatchMode) and the launches (C launcher calls + Triton launches + aten
ops that launch a kernel on a GPU) of each.

Usage (repo root): python tools/llp_host_cpu.py [--triton] [--bias] [--rounds R]
Rows: the eager expression, the op's general path (op.FAST off) and the op with its eager
fast path (op.FAST on), interleaved round by round in one process, min over R rounds (7).
Run against another checkout (PYTHONPATH) to time its op; where it has no fast path, both
kgen rows are its general path.
"""

from __future__ import annotations

import ctypes
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kgen import ops
from kgen.families.linear_logp import cuda_variant
from kgen.families.linear_logp import op as llp_op
from kgen.families.linear_logp.cuda_variant import CudaForward

LAUNCHES = {"n": 0}
# aten ops that launch a kernel on a GPU (the rest allocate, view or only read metadata)
_NO_KERNEL = ("empty", "view", "t.", "transpose", "as_strided", "slice", "detach", "alias", "expand",
              "unsqueeze", "squeeze", "reshape", "_unsafe_view", "select", "permute", "lift_fresh",
              "empty_like", "new_empty", "_to_copy.default?")


class _Kernel:
    """A Triton kernel stand-in: `k[grid](...)` counts a launch and returns."""

    def __getitem__(self, grid):
        return _launch


def _launch(*args, **kwargs):
    LAUNCHES["n"] += 1


def stub_triton():
    k = _Kernel()
    return SimpleNamespace(
        __name__="stub_triton", BLOCK_N=128, BLOCK_V=256, BLOCK_D=64, NUM_WARPS=8, NUM_STAGES=3, SPLIT_V=4,
        linear_logp_fwd_kernel=k, linear_logp_combine_kernel=k, linear_logp_bwd_dz_kernel=k,
        linear_logp_target_check_kernel=k)


def stub_cuda(triton_mod):
    """A CudaForward of a stand-in sm_90a variant (block 128 x 256, 2-CTA clusters,
    split_v 33) on a 132-SM GPU, whose C entry points count a call and return 0."""
    def raw(*args):
        LAUNCHES["n"] += 1
        return 0

    entry = ctypes.c_void_p(1)
    kernel = SimpleNamespace(
        params={"block_m": 128, "block_n": 256, "split_v": 33, "cluster": 2, "consumers": 2},
        name="stub_sm90a", lib=SimpleNamespace(kgen_launch_dz=entry),
        variant=SimpleNamespace(arch="sm_90a", dtype="bfloat16"),
        raw=raw, ptr=1, fail=None)
    impl = CudaForward(kernel, triton_mod)
    impl._resident[None] = 132  # CPU tensors: device index None
    return impl


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _stub_gemms():
    """torch.mm / torch.addmm in the family's modules: count a launch and return."""
    import types

    from kgen.families import linear_logp

    def gemm(*args, **kwargs):
        LAUNCHES["n"] += 1

    fake = types.ModuleType("torch")
    fake.__dict__.update(torch.__dict__)
    fake.mm = fake.addmm = gemm
    for name in ("launch", "fast"):
        mod = getattr(linear_logp, name, None)
        if mod is not None:
            mod.torch = fake


def interleaved_us(rows, calls=300, rounds=7):
    """{label: µs per call}, min over `rounds` rounds, each timing every row in turn
    (`rows`: (label, fn, setup) with setup() run before the row's loop)."""
    best = {label: float("inf") for label, _, _ in rows}
    for _ in range(rounds):
        for label, fn, setup in rows:
            setup()
            for _ in range(20):
                fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[label] = min(best[label], (time.perf_counter() - t0) / calls * 1e6)
    return best


def counts(fn):
    fn()  # a warm-up call (the fast path is taken from the second call of a signature on)
    LAUNCHES["n"] = 0
    with Count() as c:
        fn()
    kernels = [o for o in c.ops if not any(o.startswith("aten." + p) for p in _NO_KERNEL)]
    return len(c.ops), LAUNCHES["n"] + len(kernels), kernels


def eager(h, w, t):
    return torch.log_softmax(F.linear(h, w).float(), -1).gather(1, t[:, None]).squeeze(1)


def main(argv):
    torch.set_num_threads(1)  # (steadier timings of the tiny eager expression)
    impl = stub_triton() if "--triton" in argv else stub_cuda(stub_triton())
    llp_op._module = lambda device, dtype, shape=None: impl  # noqa: E731  (every call: the stub)
    cuda_variant.current_raw_stream = lambda index: 0
    _stub_gemms()
    bias = "--bias" in argv
    fast_on = getattr(llp_op, "FAST", False)
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 7
    print(f"torch {torch.__version__}; implementation: {'Triton' if '--triton' in argv else 'CUDA (sm_90a)'} "
          f"stand-in; bias: {bias}; fast path: {fast_on}")

    def path(on):
        def setup():
            llp_op.FAST = on and fast_on
        return setup
    dev, dt = torch.device("cpu"), torch.bfloat16
    for N, D, V in ((8, 512, 1024), (64, 1024, 4096), (1, 4096, 32000)):
        h, w = torch.empty(N, D, device=dev, dtype=dt), torch.empty(V, D, device=dev, dtype=dt)
        b = torch.empty(V, device=dev, dtype=dt) if bias else None
        t = torch.zeros(N, device=dev, dtype=torch.int64)
        g = torch.ones(N, device=dev)
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        br = b.clone().requires_grad_() if bias else None
        e = [torch.randn(8, 16, dtype=dt), torch.randn(32, 16, dtype=dt), torch.randint(0, 32, (8,))]
        er = [x.clone().requires_grad_() for x in e[:2]]

        def kgen_fb():
            hr.grad = wr.grad = None
            if br is not None:
                br.grad = None
            ops.linear_logp(hr, wr, t, br).backward(g)

        def eager_fb():
            er[0].grad = er[1].grad = None
            eager(*er, e[2]).backward(g[:1].expand(8))
        kinds = {"fwd": ((lambda: eager(*e)), lambda: ops.linear_logp(h, w, t, b)),
                 "fwd (grad)": ((lambda: eager(*er, e[2])), lambda: ops.linear_logp(hr, wr, t, br)),
                 "fwd+bwd": (eager_fb, kgen_fb)}
        print(f"\nN={N} D={D} V={V}: us per call (min of interleaved rounds); aten ops / launches per call")
        for kind, (ef, kf) in kinds.items():
            rows = [("eager 8x16x32", ef, path(False)), ("kgen general", kf, path(False)),
                    ("kgen fast", kf, path(True))]
            us = interleaved_us(rows, calls=300 if kind == "fwd+bwd" else 1000, rounds=rounds)
            line = []
            for label, fn, setup in rows:
                setup()
                n_ops, n_launch, _ = counts(fn)
                line.append(f"{label} {us[label]:6.1f} ({n_ops}/{n_launch})")
            print(f"  {kind:10s} " + "   ".join(line), flush=True)
        llp_op.FAST = fast_on


if __name__ == "__main__":
    main(sys.argv[1:])
