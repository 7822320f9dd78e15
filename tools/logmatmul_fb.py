"""logmatmul forward + backward through autograd (issue 17), B = 1, 2, 4, 8, N = K = 4096,
float32 w: the op with its backward on the Triton companion (the default) against the CUDA
variant's own backward (launch.CUDA_BACKWARD, KGEN_LOGMATMUL_CUDA_BACKWARD=1), in the same
process, interleaved: do_bench medians (GPU time with L2 flushed between steps), host µs per
step (a loop of steps, synchronised once), and the two backwards' gradients compared.
Usage on a GPU machine (repo root): PYTHONPATH=$PWD python3 tools/logmatmul_fb.py"""
import json
import time

import torch
import triton

from kgen import ops
from kgen.families.logmatmul import launch

N = K = 4096


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    w0 = torch.rand(N, K, device=dev)
    for B in (1, 2, 4, 8):
        x = (torch.randn(B, K, device=dev) * 2).requires_grad_()
        w = w0.clone().requires_grad_()
        g = torch.randn(B, N, device=dev)

        def step():
            x.grad = w.grad = None
            ops.logmatmul(x, w).backward(g)

        row, grads = {"B": B}, {}
        for rnd in range(2):
            for cuda in (False, True):
                launch.CUDA_BACKWARD = cuda
                name = "cuda backward" if cuda else "triton backward"
                step()
                grads[name] = (x.grad.clone(), w.grad.clone())
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(30):
                    step()
                torch.cuda.synchronize()
                loop = (time.perf_counter() - t0) / 30 * 1e6
                bench = 1e3 * triton.testing.do_bench(step, warmup=5, rep=30, return_mode="median")
                row[f"{name} loop us"] = round(min(loop, row.get(f"{name} loop us", 1e9)), 1)
                row[f"{name} do_bench us"] = round(min(bench, row.get(f"{name} do_bench us", 1e9)), 1)
        (dx0, dw0), (dx1, dw1) = grads["triton backward"], grads["cuda backward"]
        row["max |dx diff| / max |dx|"] = float((dx0 - dx1).abs().max() / dx0.abs().max())
        row["max |dw diff| / max |dw|"] = float((dw0 - dw1).abs().max() / dw0.abs().max())
        print(json.dumps(row), flush=True)
    launch.CUDA_BACKWARD = False


if __name__ == "__main__":
    main()
