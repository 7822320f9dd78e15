"""fused_bias_act: out = act(x + alpha * y + bias[col]) over a row-major [rows, cols] tensor.

Modules: `schema` (knobs, variant rules, template context, ahead-of-time builds),
`reference` (the math in PyTorch: the CPU path, the backward, the float64 oracle),
`checks` (arguments), `launcher` (how a loaded CUDA or Triton variant runs), `op` (kernel
choice and tuning hooks, the torch.library ops and autograd, the public function) and
`numerics` (golden numerics for `kgen verify` and the tests).
"""

from kgen.families.fused_bias_act.launcher import launch
from kgen.families.fused_bias_act.numerics import GOLDEN_SHAPES, golden
from kgen.families.fused_bias_act.op import (
    OPS, TUNE_CLASS_FALLBACK, TUNE_DIMS, TUNE_FREE_DIMS, TUNE_SHAPES, TUNE_VARIATIONS, fused_bias_act, nearby_transfers, tune_bucket, tune_inputs,
    tune_runner)
from kgen.families.fused_bias_act.reference import reference
from kgen.families.fused_bias_act.schema import ACTIVATIONS, SCHEMA, TEMPLATES, template_context, triton_aot
