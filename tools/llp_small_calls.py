"""Host cost of small linear_logp calls (issue 19): wall time per call in a loop of calls
synchronised once at the end, forward and forward + backward, for kgen's op (dispatch's
choice, each implementation forced) and the eager PyTorch expression, bf16.
Usage on a GPU machine (repo root): PYTHONPATH=$PWD python3 tools/llp_small_calls.py"""

import time

import torch
import torch.nn.functional as F

from kgen import ops
from kgen.families import linear_logp as llp
from kgen.families.linear_logp import op as llp_op


def eager(h, w, t):
    return torch.log_softmax(F.linear(h, w).float(), -1).gather(1, t[:, None]).squeeze(1)


def per_call_us(fn, calls=2000, rounds=5):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(best)[len(best) // 2]


def main():
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for N, D, V in ((8, 512, 1024), (64, 1024, 4096), (1, 4096, 32000)):
        h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(V, D, device="cuda") * D ** -0.5).to(torch.bfloat16)
        t = torch.randint(0, V, (N,), device="cuda")
        g = torch.randn(N, device="cuda")
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        choice = llp_op._module(h.device, h.dtype, (N, D, V))
        name = "reference" if choice is None else getattr(choice, "name", None) or getattr(choice, "__name__", "triton")
        print(f"\nN={N} D={D} V={V}: dispatch's forward choice: {name}", flush=True)

        def fb(fn):
            def run():
                hr.grad = wr.grad = None
                fn(hr, wr, t).backward(g)
            return run
        rows = [("eager expression", lambda: eager(h, w, t), fb(eager)),
                ("kgen op (dispatch)", lambda: ops.linear_logp(h, w, t), fb(ops.linear_logp))]
        for label, forced in (("kgen op, reference forced", None),
                              ("kgen op, Triton forced", llp_op.implementation(
                                  __import__("kgen.runtime.dispatch", fromlist=["x"]).select(
                                      "linear_logp", h.device, "bfloat16", backend="triton")))):
            def fwd(forced=forced):
                with llp.using(forced):
                    return ops.linear_logp(h, w, t)

            def fwdbwd(forced=forced):
                with llp.using(forced):
                    hr.grad = wr.grad = None
                    ops.linear_logp(hr, wr, t).backward(g)
            rows.append((label, fwd, fwdbwd))
        for label, f, b in rows:
            print(f"  {label:30s} fwd {per_call_us(f):7.1f} us/call   fwd+bwd {per_call_us(b, calls=500):7.1f} us/call",
                  flush=True)


if __name__ == "__main__":
    main()
