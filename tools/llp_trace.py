"""Where a tile's cycles go in the sm_90a linear_logp kernel: each sm_90a variant is built
with -DKGEN_TRACE (consumer warpgroups stamp the SM clock at the start of each tile, when
its MMAs are done and when its fold is, sum the cycles they wait for panels and for MMAs,
and, in the first 4 CTAs, stamp every panel of tiles 2..5 with its waits) and, for
comparison, with the fold left out too (and, with --fake-fold, replaced by a busy wait).
Prints per build and shape the median over the first wave's CTAs of steady-state tiles
(2..12): MMA cycles, fold cycles, tile period, how far consumer 1 starts a tile after
consumer 0, how many cycles of consumer 0's fold consumer 1 spends folding too, panel and
MMA waits per tile; and per consumer the cycles from one panel's issue to the next (with
the hidden / weight barrier waits before it), p50 and p90, while the other consumer folds
("alone") and while both multiply. Writes $OUT/llp-trace.json (with CTA 0's raw stamps).

Usage (device machine, repo root): python3 tools/llp_trace.py [--spec S] [--variants A,B]
    [--flags=EXTRA_NVCC_FLAGS] [--no-ablate] [--fake-fold CYCLES]
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

TILES, CTAS, SLOTS = 16, 264, 5  # the template's TRACE_TILES, TRACE_CTAS, stamps per tile
PANEL_CTAS, PANEL_TILES, PANEL_TILE0, PANELS = 4, 4, 2, 64  # its PANEL_CTAS, PANEL_TILES, PANEL_TILE0, PANEL_KS


def panel_rates(tr, pan, consumers):
    """Per consumer, median cycles between consecutive panel issues and the waits for the
    hidden and the weight panel before each, split by whether the other consumer was
    folding (between its MMAs-done and fold-done stamps) meanwhile."""
    out = {}
    for q in range(consumers):
        rows = {True: [], False: []}
        for c in range(PANEL_CTAS):
            folds = [(tr[c][o][i][1], tr[c][o][i][2]) for o in range(consumers) if o != q
                     for i in range(TILES) if tr[c][o][i][2]]
            for pt in range(PANEL_TILES):
                st = [x for x in pan[c][q][pt] if x[0]]
                for a, b in zip(st, st[1:]):
                    rows[any(f0 <= (a[0] + b[0]) / 2 <= f1 for f0, f1 in folds)].append((b[0] - a[0], b[1], b[2]))
        for lone, xs in rows.items():
            if xs:
                cols = [sorted(col) for col in zip(*xs)]  # panel cycles, hidden wait, weight wait
                phase = f"c{q} {'alone' if lone else 'both'}"
                out[f"{phase} (n={len(xs)}) panel/hidden wait/weight wait p50"] = tuple(c[len(c) // 2] for c in cols)
                out[f"{phase} p90"] = tuple(c[len(c) * 9 // 10] for c in cols)
    return out


def trace(impl, N, D, V):
    """Launch the partials kernel (its own choice of splits and group) three times on a
    buffer with room for the stamps after the partials; the stamps of the last launch."""
    torch.manual_seed(0)
    h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, D, device="cuda") * (2.0 / math.sqrt(D))).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    p = impl.kernel.variant.params
    consumers = p["consumers"]
    tile_stamps = CTAS * consumers * TILES * SLOTS
    stamps = tile_stamps + PANEL_CTAS * consumers * PANEL_TILES * PANELS * 3
    bufs = []
    splits = impl.splits(N, V, h.device)
    for _ in range(3):  # partials' own buffer, followed by the int64 stamps
        n = 4 * splits * N
        bufs.append(torch.zeros(n + 2 * stamps, dtype=torch.float32, device=h.device))
        impl.partials(h, w, t, None, 1.0, False, splits, part=bufs[-1][:n].view(4, splits, N))
    torch.cuda.synchronize()
    raw = bufs[-1][4 * splits * N:].view(torch.int64)
    tr = raw[:tile_stamps].view(CTAS, consumers, TILES, SLOTS).cpu().tolist()
    pan = raw[tile_stamps:stamps].view(PANEL_CTAS, consumers, PANEL_TILES, PANELS, 3).cpu().tolist()
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
    full_wait = [tr[c][q][i][3] for c in range(sms) for q in range(consumers) for i in steady]
    mma_wait = [tr[c][q][i][4] for c in range(sms) for q in range(consumers) for i in steady]
    return {"MMA cycles": med(mma), "fold cycles": med(fold) if fold else 0, "tile period": med(period),
            "consumer 1 - consumer 0 start": med(offset), "folds overlapping": med(both),
            "panel waits": med(full_wait), "MMA waits": med(mma_wait),
            **(panel_rates(tr, pan, consumers) if consumers > 1 else {}),
            "CTA 0 stamps": [[[x - tr[0][0][0][0] for x in tile] for tile in q] for q in tr[0]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="kgen/specs/linear_logp.yaml")
    ap.add_argument("--variants", default="")
    ap.add_argument("--flags", default="", help="extra nvcc flags for every build (e.g. -DKGEN_LAG=0)")
    ap.add_argument("--no-ablate", action="store_true", help="only the build with the fold")
    ap.add_argument("--fake-fold", type=int, default=0,
                    help="also a build whose fold is a busy wait of this many cycles")
    args = ap.parse_args()
    wanted = set(filter(None, args.variants.split(",")))
    out = {}
    for v in spec_mod.load(args.spec).variants:
        if v.backend != "cuda" or v.arch != "sm_90a" or v.dtype != "bfloat16" or (wanted and v.name not in wanted):
            continue
        builds = [("with fold", "-DKGEN_TRACE")]
        if not args.no_ablate:
            builds.append(("no fold", "-DKGEN_TRACE -DKGEN_ABLATE_FOLD"))
        if args.fake_fold:
            builds.append((f"{args.fake_fold}-cycle wait for fold", f"-DKGEN_TRACE -DKGEN_FAKE_FOLD={args.fake_fold}"))
        for label, flags in builds:
            impl = llp.CudaForward(ablation_build(v, f"{flags} {args.flags}"), None)  # partials only: no Triton companion
            for N, D, V in SHAPES:
                key = f"{v.name} {label} {N}x{D}x{V}"
                out[key] = trace(impl, N, D, V)
                print(f"{key:70s} " + "\n    ".join(f"{a} {b}" for a, b in out[key].items() if a != "CTA 0 stamps"),
                      flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/kgen-out"), "llp-trace.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
