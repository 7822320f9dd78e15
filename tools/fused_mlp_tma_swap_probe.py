"""A probe for issue 22, not part of kgen: tools/fused_mlp_tma_swap_probe.cu (a TMA-multicast,
swap-AB WGMMA kernel of the DLRM top MLP) built with nvcc for each configuration given, checked
against float64 and the shipped module (FusedMLP(pad_weights=True): same inputs, output poisoned
first) and timed beside it: GPU us per call, a CUDA graph of 20 calls, best of 5 replays.

    python tools/fused_mlp_tma_swap_probe.py "CL=4 SUB=2 STAGES=11" "CL=2 SUB=2 STAGES=10 ROWS=32" \\
        --rows 128,512,1024,2048,4096

Needs an sm_90 GPU, nvcc and the repository on PYTHONPATH."""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch

from fused_mlp_swap_probe import _graph_us
from kgen.families.fused_mlp import launch, tuning
from kgen.nn import FusedMLP

WIDTHS = (367, 512, 256, 1)
SOURCE = Path(__file__).with_suffix(".cu")


def build(config: str, out_dir: Path) -> ctypes.CDLL:
    """The probe kernel with `config`'s macros ("CL=4 SUB=2 ...") as a shared library."""
    flags = [f"-D{kv}" for kv in config.split()]
    so = out_dir / ("probe_" + "_".join(config.replace("=", "").split()) + ".so")
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC",
                    "-shared", *flags, "-o", str(so), str(SOURCE)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.proto_prepare.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.proto_launch.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int,
                                                                                         ctypes.c_void_p]
    return lib


def reference(x, ws, bs):
    r = x.double()
    for i in range(3):
        r = r @ ws[i].double().t() + bs[i].double()
        r = torch.relu(r) if i < 2 else torch.sigmoid(r)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--rows", default="128,512,1024,2048,4096")
    args = ap.parse_args()
    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {c: build(c, Path(tmp)) for c in args.configs}
        for B in map(int, args.rows.split(",")):
            x, ws, bs = tuning.make_inputs(dev, torch.bfloat16, B, WIDTHS, seed=B)
            wp = launch.row_padded(ws[0], 368)
            ref = reference(x, ws, bs)
            mod = FusedMLP(WIDTHS, activation="relu", last_activation="sigmoid", dtype=torch.bfloat16, device=dev,
                           pad_weights=True)
            with torch.no_grad():
                for i in range(3):
                    mod.weights[i].copy_(ws[i])
                    mod.biases[i].copy_(bs[i])
                got = mod(x)
                cells = [f"B {B:5d}", f"module {_graph_us(lambda: mod(x)):6.2f} us"]
            for config, lib in libs.items():
                if lib.proto_prepare(wp.data_ptr(), 368, ws[1].data_ptr()):
                    cells.append(f"[{config}] refused")
                    continue
                out = torch.full((B, 1), float("nan"), dtype=torch.bfloat16, device=dev)

                def go(lib=lib, out=out):
                    return lib.proto_launch(x.data_ptr(), x.stride(0), bs[0].data_ptr(), bs[1].data_ptr(),
                                            ws[2].data_ptr(), bs[2].data_ptr(), out.data_ptr(), B,
                                            torch.cuda.current_stream().cuda_stream)

                assert go() == 0
                torch.cuda.synchronize()
                err = (out.double() - ref).abs().max().item()
                same = torch.equal(out, got)
                cells.append(f"[{config}] {_graph_us(go):6.2f} us err {err:.1e}{' =module' if same else ''}")
            print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
