"""Issue 22: fused_mlp's TMA ring variants (templates/fused_mlp/cuda_ring.cu.j2) against what
FusedMLP runs today (pad_weights: its weights row-padded, dispatch's choice), the shipped
WGMMA / mma.sync cluster variants and eager in a CUDA graph, same inputs, same run. Each
cell: GPU us per call (a CUDA graph of 20 calls, best of 5 replays); every ring output
checked against float64 (error as a ratio of the family's tolerance) and against the module's
output (=: bit-identical). Run on an sm_90 GPU with the repository on PYTHONPATH:

    python tools/fused_mlp_ring_bench.py [--rows 128,512,2048] [--dtype bfloat16] [--mlp top bottom]
"""

from __future__ import annotations

import argparse

import torch

from fused_mlp_swap_probe import _graph_us
from kgen.families import fused_mlp as fm
from kgen.families.fused_mlp import launch
from kgen.nn import FusedMLP
from kgen.runtime import dispatch
from kgen.runtime.op import error_ratio, poisoned
from kgen.spec import load

MLPS = {"top": ((367, 512, 256, 1), "relu", "sigmoid"), "bottom": ((13, 512, 256, 64, 16), "relu", "relu")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128,512,1024,2048,4096,16384")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mlp", nargs="+", choices=tuple(MLPS), default=list(MLPS))
    args = ap.parse_args()
    dev, t = torch.device("cuda"), getattr(torch, args.dtype)
    spec = load("kgen/specs/fused_mlp.yaml")
    tol = spec.numerics[args.dtype]
    for name in args.mlp:
        widths, act, last = MLPS[name]
        cuda = [v for v in spec.variants if v.backend == "cuda" and v.dtype == args.dtype
                and tuple(v.params["widths"]) == widths]
        impls = {v.name: fm.implementation(dispatch.load(v), widths) for v in cuda}
        print(f"== {name} {'-'.join(map(str, widths))} {args.dtype}; columns: module (dispatch), eager graph, "
              + ", ".join(v.name.split("_", 2)[2].rsplit("_", 1)[0] + ("" if v.arch == "sm_90" else f" {v.arch}")
                          for v in cuda), flush=True)
        for B in map(int, args.rows.split(",")):
            x, ws, bs = fm.make_inputs(dev, t, B, widths, seed=B)
            mod = FusedMLP(widths, activation=act, last_activation=last, dtype=t, device=dev, pad_weights=True)
            with torch.no_grad():
                for i in range(len(ws)):
                    mod.weights[i].copy_(ws[i])
                    mod.biases[i].copy_(bs[i])
                want = mod(x)
                padded = [w for w in mod.weights]
                ref = fm.reference(x, ws, bs, act, last)
                cells = [f"B {B:6d}", f"module {_graph_us(lambda: mod(x)):7.2f}",
                         f"eager {_graph_us(lambda: fm.eager(x, ws, bs, act, last)[0]):7.2f}"]
                for n, impl in impls.items():
                    if not impl.takes(x, padded, bs):
                        cells.append(f"{n}: refused")
                        continue
                    got = poisoned((B, widths[-1]), t, dev)
                    launch.forward(impl, x, padded, bs, act, last, out=got)
                    r = error_ratio(got, ref, tol)
                    run = fm.op.runner(impl, x, padded, bs, act, last)
                    mark = "=" if torch.equal(got, want) else ""
                    bad = "" if r <= 1 else f" ERR {r:.2f}"
                    cells.append(f"{_graph_us(run):7.2f}{mark}{bad}")
            print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
