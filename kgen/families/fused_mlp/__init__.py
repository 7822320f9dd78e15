"""fused_mlp: a whole small MLP (nn.Linear + activation layers, up to 8) in one kernel.

The family's modules: `schema` (knobs, variant rules, which widths a variant takes, the
template context: an exact variant's plan of steps and kernels), `reference` (activations,
the eager composition, the float64 oracle, the backward's per-layer GEMMs), `checks`
(arguments), `launch` (how the Triton forward runs and the backward: its docstring), `cuda`
(the CUDA cluster variant's forward beside its Triton companion), `tuning` (the tuning
hooks, what the op runs for a variant, the order for untuned widths), `op` (kernel choice,
the torch.library ops with autograd, `fused_mlp`, golden numerics), `train` (the eager training fast path), `fused_backward` (its backward on CUDA:
every gradient in two or three Triton launches) and `module` (kgen.nn.FusedMLP). This module
is the contract kgen's core reads.

The forward's Triton kernels live in kgen/templates/fused_mlp/triton.py.j2 (rendered per
variant), the CUDA cluster kernels (exact widths, inference) in cuda.cu.j2 (sm_90, mma.sync),
cuda_wgmma.cu.j2 (sm_90a, WGMMA) and cuda_ring.cu.j2 (sm_90a with `stages`: WGMMA with the batch
as N, the weights streamed by TMA, multicast over a cluster or, with `split_n`, split over the
cluster's CTAs sharing one row tile; cuda_sm90a.cu.j2 picks one of the two; helpers shared through
device.cuh.j2); the
backward's, generic in the widths (constexprs), in fused_backward_kernels.py (launched by
fused_backward.py).
"""

from kgen.families.fused_mlp.checks import check_inputs
from kgen.families.fused_mlp.launch import backward, forward, precision
from kgen.families.fused_mlp.op import (
    DLRM_BOTTOM, DLRM_TOP, GOLDEN_CASES, KERNELS, OPS, TUNE_CLASS_FALLBACK, TUNE_DIMS, TUNE_FREE_DIMS, TUNE_SHAPES, TUNE_VARIATIONS,
    bucket_extras, fused_mlp, golden, grad_check, implementation, layout_of, make_inputs, module_for, tune_bucket,
    tune_choices, tune_inputs, tune_runner, untuned_order, using)
from kgen.families.fused_mlp.reference import act, dact, eager, reference
from kgen.families.fused_mlp.schema import (
    ACTIVATIONS, MAX_LAYERS, MAX_WIDTH, SCHEMA, TEMPLATES, template_context, triton_aot, variant_fits)

BENCHMARK = "kgen.benchmarks.fused_mlp"
