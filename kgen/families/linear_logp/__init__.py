"""linear_logp: logp[i] = log_softmax((hidden[i] @ weight.T + bias) / T)[target[i]].

The family's modules: `schema` (knobs, variant rules, template context, ahead-of-time
builds), `reference` (the math in PyTorch), `checks` (arguments and target range), `plans`
(precision, TMA, splits, grids), `launch` (the forward's kernels and how they run, and the
float32 few-rows path), `backward_launch` (the backward's: recomputation by vocabulary
chunks, where grad_hidden's float32 sums live, what a call decides once per shape; their
docstrings describe both algorithms), `kept` (keep_logits: the forward keeps the logits,
the backward reads them), `cuda_variant` (`CudaForward`: a CUDA variant's C entry points,
their grids, and when the backward takes its dz kernel), `tuning` (buckets and the tuner's
hooks), `op` (kernel choice, the torch.library ops, autograd, `linear_logp` and when its
eager fast path serves a call, golden numerics), `fast` (that fast path's per-signature
entries and autograd.Function) and `dist` (`linear_logp(..., group=)`: the vocabulary split
over a torch.distributed group). This module is the contract kgen's core reads and the
names callers use.

The Triton kernels live in kgen/templates/linear_logp/triton.py.j2; `mod` in `launch` and
`op` is that template rendered and imported (module constants BLOCK_N, BLOCK_V, BLOCK_D,
NUM_WARPS, NUM_STAGES, SPLIT_V plus the kernels), or a `CudaForward`: a CUDA variant's
forward-partials kernel (cuda_sm90a.cu.j2: TMA + mbarrier + warp-specialised WGMMA;
cuda_sm80.cu.j2: cp.async + ldmatrix + mma.sync, also built for sm_90; cuda_gemv.cu.j2, the
`kernel: gemv` variants: N <= 16 rows, the weight streamed once into mma.sync registers;
float32 ones on TF32 mma.sync, 3 products a step with TF32 off) with
its own combine, paired with a Triton module that supplies the backward. Dispatch takes the
forward the tuning table names for the device, dtype and (N, D, V) bucket, else (up to 64
rows, `tuning.untuned_order`) the gemv variants and 64-row tiles first, else the CUDA
variants whose arch runs on the device first; inputs they cannot take (rows not whole 16-byte
units, D % 8 != 0 for the tiled kernels, pointers off 16-byte alignment, more rows than a gemv
variant's block_m) run the Triton forward of the
same pair. The backward's kernels are spec order's, but where the forward's bucket ran the
PyTorch reference, the backward does too.

Outputs are float32: logp [N], and optionally the entropy [N] of the tempered softmax.
Rows whose target is ignore_index get logp = 0 and entropy = 0, and no gradient.

Inputs are made contiguous (a copy when they are not: weight should arrive contiguous);
no pointer alignment is required: 16-bit operands with D % 8 == 0 and 16-byte aligned
bases load their logit tiles by TMA on sm_90+ (the forward and dz kernels), anything else by
pointer loads (Triton specialises on 16-byte alignment by itself).
Float32 inputs use TF32 tensor cores only when torch.backends.cuda.matmul.allow_tf32 is
set, as torch.matmul does (with it off, "tf32x3" tiles and the gemv kernel's 3 products keep
float32's accuracy, and a few rows the gemv kernel does not serve take the logits from cuBLAS:
launch.logits_path); their buckets name the setting.
Float16 inputs keep dz in float16 (as eager PyTorch does), so probabilities below ~6e-8
flush to zero there.
"""

# Not re-exported: the switches and patch points plans.TMA, plans._device_props,
# backward_launch.WORKSPACE_BYTES, .ACCUMULATOR_BYTES, .PLAN_CACHE and .DH_TRITON,
# launch.F32_LOGITS_MAX_ROWS, .F32_LOGITS_MAX_ELEMS, fast.SHARED_PARTIALS_BYTES, launch._empty, cuda_variant.CUDA_DZ,
# op.FAST and op._FAST; set them on their own module (a copy here would not take effect).
from kgen.families.linear_logp.backward_launch import backward, backward_plan
from kgen.families.linear_logp.checks import TARGET_CHECK_BLOCK, check_inputs, check_target_range
from kgen.families.linear_logp.cuda_variant import CudaForward
from kgen.families.linear_logp.launch import LN2, LOG2E, forward
from kgen.families.linear_logp.op import (
    _FORCED, _MODULES, GRAD_TOL, OPS, _module, golden, implementation, linear_logp, using)
from kgen.families.linear_logp.plans import (
    COMBINE_BLOCK, COMBINE_DOT_BLOCK, GROUP, GROUP_BYTES, TARGET_BLOCK_D, _precision, _target_in_tile, _tma,
    combine_grid, dz_grid, fwd_grid, triton_splits, wave_splits)
from kgen.families.linear_logp.reference import reference, reference_backward, reference_dz
from kgen.families.linear_logp.schema import SCHEMA, TEMPLATES, template_context, triton_aot, variant_fits
from kgen.families.linear_logp.tuning import (
    TUNE_DIMS, TUNE_FREE_DIMS, TUNE_SHAPES, bucket_extras, tune_bucket, tune_inputs, tune_runner, untuned_order)
# Registers torch.ops.kgen.linear_logp_dist(_backward) (group=...; imports op).
from kgen.families.linear_logp import dist  # noqa: E402,F401  isort: skip
