"""Where the op's host time goes at 128x512 bf16: each piece timed interleaved with
torch.add, min over rounds (host noise only adds time)."""
import torch

from kgen import ops
from kgen.benchmarks.fused_bias_act import interleaved_min
from kgen.families import fused_bias_act as fba

x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
y, b = torch.randn_like(x), torch.randn(512, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(x)
ops.fused_bias_act(x, b, y, alpha=0.5, act="gelu")
k = fba.op._kernel(x.device, x.dtype)
pieces = {
    "torch.add(x, y)": lambda: torch.add(x, y),
    "ops.fused_bias_act": lambda: ops.fused_bias_act(x, b, y, alpha=0.5, act="gelu"),
    "fba._forward": lambda: fba.op._forward(x, b, y, 0.5, "gelu", False),
    "fba.launch (no alloc, no checks)": lambda: fba.launch(k, x, b, y, 0.5, "gelu", out),
    "torch.empty_like(x)": lambda: torch.empty_like(x),
    "fba._check": lambda: fba.checks._check(x, b, y, 0.5, "gelu", False),
    "4x data_ptr + stream": lambda: (x.data_ptr(), y.data_ptr(), b.data_ptr(), out.data_ptr(), fba.launcher._raw_stream(0)),
    "empty python call": lambda: None,
}
for name, us in interleaved_min(list(pieces.items()), 2000, 15).items():
    print(f"{us:7.2f} us  {name}")
