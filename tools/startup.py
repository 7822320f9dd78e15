"""Start-up time of a new process: import torch, CUDA init, import kgen.ops, and the first
fused_bias_act and linear_logp results, per phase, with the kgen cache cold and then warm.

    python tools/startup.py [--runs 3] [--cache DIR]

Each run is a fresh interpreter; the first run with an empty cache builds (cold), the next
ones load from it (warm). Prints a table; --json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t = {"start": time.perf_counter()}
import torch
t["import torch"] = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t["cuda init"] = time.perf_counter()
from kgen import ops
t["import kgen.ops"] = time.perf_counter()
x = torch.randn(1000, 4104, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4104, device="cuda", dtype=torch.bfloat16)
ops.fused_bias_act(x, b, x, alpha=0.5, act="gelu"); torch.cuda.synchronize()
t["fused_bias_act"] = time.perf_counter()
h = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
w = torch.randn(32000, 1024, device="cuda", dtype=torch.bfloat16)
tg = torch.randint(0, 32000, (300,), device="cuda")
ops.linear_logp(h, w, tg); torch.cuda.synchronize()
t["linear_logp"] = time.perf_counter()
heavy = [m for m in ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.fsdp",
                     "torch._higher_order_ops.triton_kernel_wrap", "triton.compiler") if m in sys.modules]
print("KGEN-STARTUP " + json.dumps({"t": t, "heavy": heavy}))
"""


def run_once(env) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("KGEN-STARTUP ")), None)
    if r.returncode or line is None:
        raise SystemExit(f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return json.loads(line.removeprefix("KGEN-STARTUP "))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="warm runs after the cold one")
    ap.add_argument("--cache", help="kgen cache dir (default: a new empty one)")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help="run the measured steps in this process "
                    "(for python -X importtime / -m cProfile)")
    args = ap.parse_args()
    if args.child:
        exec(CHILD, {})
        return 0
    env = dict(os.environ)
    env["KGEN_CACHE_DIR"] = args.cache or tempfile.mkdtemp(prefix="kgen-startup-")
    rows = []
    for i in range(1 + args.runs):
        res = run_once(env)
        t = res["t"]
        phases, prev = {}, t["start"]
        for k, v in t.items():
            if k != "start":
                phases[k] = v - prev
                prev = v
        after_cuda = t["linear_logp"] - t["cuda init"]
        rows.append({"run": "cold" if i == 0 else f"warm {i}", **phases, "after cuda init": after_cuda,
                     "heavy modules": res["heavy"]})
    names = [k for k in rows[0] if k not in ("run", "heavy modules")]
    print("| run | " + " | ".join(f"{n} (s)" for n in names) + " | heavy modules imported |")
    print("|---|" + "---:|" * len(names) + "---|")
    for r in rows:
        print(f"| {r['run']} | " + " | ".join(f"{r[n]:.2f}" for n in names) + f" | {', '.join(r['heavy modules']) or '-'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
