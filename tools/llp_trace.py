"""Where a tile's cycles go in the sm_90a linear_logp kernel: each sm_90a variant is built
with -DKGEN_TRACE (consumer warpgroups stamp the SM clock at the start of each tile, when
its MMAs are done and when its fold is) and, for comparison, with the fold left out too.
Prints per build and shape the median over the first wave's CTAs of steady-state tiles
(2..12): MMA cycles, fold cycles, tile period, how far consumer 1 starts a tile after
consumer 0, and how many cycles of consumer 0's fold consumer 1 spends folding too. Writes
$OUT/llp-trace.json (with CTA 0's raw stamps).

Usage (device machine, repo root): python3 tools/llp_trace.py [--spec S] [--variants A,B]
    [--flags=EXTRA_NVCC_FLAGS] [--no-ablate]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from kgen import spec as spec_mod  # noqa: E402
from kgen.families import linear_logp as llp  # noqa: E402
from tools.llp_cuda_check import SHAPES, ablation_build, median as med  # noqa: E402

TILES, CTAS = 16, 264  # the template's TRACE_TILES, TRACE_CTAS


def trace(impl, N, D, V):
    """Launch the partials kernel (its own choice of splits and group) three times on a
    buffer with room for the stamps after the partials; the stamps of the last launch."""
    torch.manual_seed(0)
    h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, D, device="cuda") * (2.0 / math.sqrt(D))).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    p = impl.kernel.variant.params
    consumers, stamps = p["consumers"], CTAS * p["consumers"] * TILES * 3
    bufs = []

    def with_stamps(shape, dtype, device):  # partials' own buffer, followed by the int64 stamps
        n = math.prod(shape)
        bufs.append(torch.zeros(n + 2 * stamps, dtype=dtype, device=device))
        return bufs[-1][:n].view(shape)

    real, llp._empty = llp._empty, with_stamps
    try:
        splits = impl.splits(N, V, h.device)
        for _ in range(3):
            impl.partials(h, w, t, None, 1.0, False, splits)
    finally:
        llp._empty = real
    torch.cuda.synchronize()
    tr = bufs[-1][4 * splits * N:].view(torch.int64).view(CTAS, consumers, TILES, 3).cpu().tolist()
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    steady = range(2, min(TILES - 1, -(-V // p["block_n"]) // splits) - 1)
    mma = [tr[c][q][i][1] - tr[c][q][i][0] for c in range(sms) for q in range(consumers) for i in steady]
    fold = [tr[c][q][i][2] - tr[c][q][i][1] for c in range(sms) for q in range(consumers) for i in steady
            if tr[c][q][i][2]]
    period = [tr[c][0][i + 1][0] - tr[c][0][i][0] for c in range(sms) for i in steady]
    offset = [tr[c][1][i][0] - tr[c][0][i][0] for c in range(sms) for i in steady] if consumers > 1 else [0]
    # Cycles of consumer 0's fold during which consumer 1 folds too (its tile i - 1 or i).
    both = [max(0, min(tr[c][0][i][2], tr[c][1][j][2]) - max(tr[c][0][i][1], tr[c][1][j][1]))
            for c in range(sms) for i in steady for j in (i - 1, i)] if consumers > 1 else [0]
    both = [a + b for a, b in zip(both[::2], both[1::2])]
    return {"MMA cycles": med(mma), "fold cycles": med(fold) if fold else 0, "tile period": med(period),
            "consumer 1 - consumer 0 start": med(offset), "folds overlapping": med(both),
            "CTA 0 stamps": [[[x - tr[0][0][0][0] for x in tile] for tile in q] for q in tr[0]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="kgen/specs/linear_logp.yaml")
    ap.add_argument("--variants", default="")
    ap.add_argument("--flags", default="", help="extra nvcc flags for every build (e.g. -DKGEN_LAG=0)")
    ap.add_argument("--no-ablate", action="store_true", help="only the build with the fold")
    args = ap.parse_args()
    wanted = set(filter(None, args.variants.split(",")))
    out = {}
    for v in spec_mod.load(args.spec).variants:
        if v.backend != "cuda" or v.arch != "sm_90a" or v.dtype != "bfloat16" or (wanted and v.name not in wanted):
            continue
        builds = (("with fold", "-DKGEN_TRACE"), ("no fold", "-DKGEN_TRACE -DKGEN_ABLATE_FOLD"))
        for label, flags in builds[:1] if args.no_ablate else builds:
            impl = llp.CudaForward(ablation_build(v, f"{flags} {args.flags}"), None)  # partials only: no Triton companion
            for N, D, V in SHAPES:
                key = f"{v.name} {label} {N}x{D}x{V}"
                out[key] = trace(impl, N, D, V)
                print(f"{key:70s} " + "  ".join(f"{a} {b}" for a, b in out[key].items() if a != "CTA 0 stamps"),
                      flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/kgen-out"), "llp-trace.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
