"""linear_logp's backward, stage by stage (issue 19): per dz chunk, the dz kernels (Triton,
and the CUDA one where it applies) and the backward's cuBLAS GEMMs, with GEMMs of the same
sizes (dW: dz^T @ hidden into the output dtype;
dH: acc += dz @ weight into float32 through addmm's out_dtype), plus the whole op forward
and forward + backward against the forward GEMM. Also checks addmm(out_dtype=float32)'s
accumulation against float64 on this GPU.
Usage on a GPU machine (repo root): PYTHONPATH=$PWD python3 tools/llp_bwd_stages.py [--shapes N,D,V ...]"""

import argparse

import torch
from triton.testing import do_bench

from kgen import ops
from kgen.families.linear_logp import backward_launch, cuda_variant, launch, op
from kgen.families.linear_logp.plans import GROUP, _precision, _tile_sources, _tiles, dz_grid


def bench(fn):
    return do_bench(fn, warmup=25, rep=200)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["4096,2048,151936", "8192,4096,128256", "16384,4096,32000",
                                                   "2048,8192,128256"])
    p.add_argument("--tiles", action="store_true",
                   help="instead: the dz kernel of every bf16 Triton variant, and the backward alone "
                        "under several workspace / accumulator budgets")
    args = p.parse_args()
    if args.tiles:
        return tiles(args.shapes)
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    dev = torch.device("cuda")
    # addmm with a float32 out_dtype accumulating bf16 products in place
    a = torch.randn(1000, 700, device=dev, dtype=torch.bfloat16)
    b = torch.randn(700, 900, device=dev, dtype=torch.bfloat16)
    c = torch.randn(1000, 900, device=dev)
    want = c.double() + a.double() @ b.double()
    torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    print("addmm out_dtype fp32 in place: max err", (c.double() - want).abs().max().item(), flush=True)

    for shape in args.shapes:
        N, D, V = map(int, shape.split(","))
        dt = torch.bfloat16
        h = (torch.randn(N, D, device=dev) * 0.5).to(dt)
        w = (torch.randn(V, D, device=dev) * D ** -0.5).to(dt)
        t = torch.randint(0, V, (N,), device=dev)
        g = torch.randn(N, device=dev)
        gemm = bench(lambda: h @ w.T)
        fwd = bench(lambda: ops.linear_logp(h, w, t))
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()

        def step():
            hr.grad = wr.grad = None
            ops.linear_logp(hr, wr, t).backward(g)
        fb = bench(step)
        default, cuda_variant.CUDA_DZ = cuda_variant.CUDA_DZ, "always"  # the CUDA dz kernel at any size
        fb_cuda = bench(step)
        print(f"\n(N, D, V) = ({N}, {D}, {V}) bf16: GEMM {gemm:.3f} ms; kgen fwd {fwd:.3f} ({fwd / gemm:.2f}x), "
              f"fwd+bwd {fb:.3f} ({fb / gemm:.2f}x), bwd ~{fb - fwd:.3f} ({(fb - fwd) / gemm:.2f}x); "
              f"with the CUDA dz kernel: fwd+bwd {fb_cuda:.3f} ({fb_cuda / gemm:.2f}x)", flush=True)

        cuda = mod = op._module(dev, dt)
        if isinstance(mod, launch.CudaForward):
            mod = mod.triton
        esize = 2
        granule = max(mod.BLOCK_V, mod.BLOCK_D)
        chunk = backward_launch.WORKSPACE_BYTES // (N * esize) // granule * granule
        chunk = min(chunk, V // granule * granule)
        lse2 = torch.zeros(N, device=dev)
        ca = torch.randn(N, device=dev) * 1e-3
        dz = torch.empty(N, chunk, device=dev, dtype=dt)
        gw = torch.empty(V, D, device=dev, dtype=dt)
        acc = torch.zeros(N, D, device=dev)
        gh = torch.empty(N, D, device=dev, dtype=dt)
        common = dict(PRECISION=_precision(dt), GROUP=GROUP, **_tiles(mod))
        hs, ws, tma = _tile_sources(mod, h, w)
        v0, v1 = 0, chunk
        f = 2.0 * N * chunk * D

        def dz_k():
            mod.linear_logp_bwd_dz_kernel[dz_grid(mod, N, chunk)](
                hs, ws, w, t, lse2, lse2, ca, ca, dz, dz, N, V, D, v0, v1, chunk, 1.4426950408889634, 1.0, -100,
                HAS_BIAS=False, WRITE_BPART=False, WITH_ENTROPY=False, HAS_GLOGP=True, TMA=tma, **common)

        def dz_cuda():
            cuda.dz(h, w, t, lse2, None, ca, None, dz, v0, v1, 1.0, -100)

        wc = w[v0:v1]
        rows = [("dz (Triton, recompute + epilogue)", bench(dz_k)),
                ("cuBLAS h @ w_chunk.T (bf16 out)", bench(lambda: torch.mm(h, wc.T))),
                *([("dz (CUDA sm_90a, recompute + epilogue)", bench(dz_cuda))]
                  if isinstance(cuda, launch.CudaForward) and cuda.takes_dz(h, w, None) else []),
                ("cuBLAS h @ w_chunk.T (fp32 out)", bench(lambda: torch.mm(h, wc.T, out_dtype=torch.float32))),
                ("dW cuBLAS mm(dz.T, h, out=gw)", bench(lambda: torch.mm(dz.T, h, out=gw[v0:v1]))),
                ("dH cuBLAS addmm fp32 acc", bench(lambda: torch.addmm(acc, dz, wc, out_dtype=torch.float32, out=acc))),
                ("dH cuBLAS mm bf16 out (no acc)", bench(lambda: torch.mm(dz, wc, out=gh)))]
        print(f"chunk {chunk} columns ({V / chunk:.1f} chunks); per chunk, {f / 1e9:.1f} GFLOP each:")
        for name, ms in rows:
            print(f"  {name:40s} {ms * 1e3:8.1f} us  {f / ms / 1e9:6.0f} TFLOP/s  x{ms / rows[1][1]:.2f} of the bf16 GEMM",
                  flush=True)
        cuda_variant.CUDA_DZ = default
        del h, w, hr, wr, dz, gw, acc, gh
        torch.cuda.empty_cache()


def tiles(shapes):
    """Per shape: the dz kernel's time per chunk with each bf16 Triton variant's tiles, and
    backward_launch.backward alone (after one forward) under several budgets."""
    from kgen import spec as spec_mod
    from kgen.runtime import dispatch

    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    dev = torch.device("cuda")
    variants = [v for v in spec_mod.load("kgen/specs/linear_logp.yaml").variants
                if v.backend == "triton" and v.dtype == "bfloat16"]
    for shape in shapes:
        N, D, V = map(int, shape.split(","))
        dt = torch.bfloat16
        h = (torch.randn(N, D, device=dev) * 0.5).to(dt)
        w = (torch.randn(V, D, device=dev) * D ** -0.5).to(dt)
        t = torch.randint(0, V, (N,), device=dev)
        g = torch.randn(N, device=dev)
        gemm = bench(lambda: h @ w.T)
        print(f"\n(N, D, V) = ({N}, {D}, {V}) bf16: forward GEMM {gemm:.3f} ms", flush=True)
        chunk = backward_launch.WORKSPACE_BYTES // (N * 2) // 256 * 256
        lse2 = torch.zeros(N, device=dev)
        ca = torch.randn(N, device=dev) * 1e-3
        dz = torch.empty(N, chunk, device=dev, dtype=dt)
        ref = bench(lambda: torch.mm(h, w[:chunk].T))
        for v in variants:
            mod = dispatch.load(v).module
            hs, ws, tma = _tile_sources(mod, h, w)
            common = dict(PRECISION=_precision(dt), GROUP=GROUP, **_tiles(mod))

            def dz_k():
                mod.linear_logp_bwd_dz_kernel[dz_grid(mod, N, chunk)](
                    hs, ws, w, t, lse2, lse2, ca, ca, dz, dz, N, V, D, 0, chunk, chunk, 1.4426950408889634, 1.0,
                    -100, HAS_BIAS=False, WRITE_BPART=False, WITH_ENTROPY=False, HAS_GLOGP=True, TMA=tma, **common)
            ms = bench(dz_k)
            print(f"  dz {v.name:40s} {ms * 1e3:8.1f} us per {chunk}-column chunk, x{ms / ref:.2f} of the GEMM",
                  flush=True)
        del dz
        mod = op._module(dev, dt)
        logp, ent, lse2, ez2 = launch.forward(mod, h, w, t, None, 1.0, -100, False)
        for ws_mib, acc_mib in ((56, 16), (56, 32), (40, 16), (56, 0), (72, 16)):
            def bwd():
                return backward_launch.backward(mod, h, w, t, None, lse2, ez2, g, None, 1.0, -100)
            backward_launch.WORKSPACE_BYTES, backward_launch.ACCUMULATOR_BYTES = ws_mib << 20, acc_mib << 20
            bwd()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = bwd()
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - before - sum(x.numel() * x.element_size()
                                                                      for x in out if x is not None)) >> 20
            del out
            ms = bench(bwd)
            print(f"  backward, budgets workspace {ws_mib} MiB (incl. separate sums) / sums {acc_mib} MiB: "
                  f"{ms:.3f} ms = {ms / gemm:.2f}x the GEMM, {extra} MiB extra", flush=True)
        backward_launch.WORKSPACE_BYTES, backward_launch.ACCUMULATOR_BYTES = 56 << 20, 16 << 20
        del h, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
