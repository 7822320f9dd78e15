"""Quick device check of the op's host cost only (bench section 2), for iterating on it."""
import json
import sys

from kgen import spec
from kgen.bench import environment, print_table
from kgen.benchmarks import fused_bias_act as b

s = spec.load("kgen/specs/fused_bias_act.yaml")
print(json.dumps(environment()))
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    print_table("host cost per call, 128x512 bf16", b.host_cost(s, quick=False))
