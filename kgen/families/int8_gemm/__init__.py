"""int8_gemm: C[i32] = A[i8, M x K] @ B[i8, N x K]^T exactly (int8_mm); W8A8 with the
dequantisation fused into the epilogue (int8_linear); weight-only int8 with the weight
widened in registers (w8a16_linear).

Modules: `schema` (knobs, variant rules, template context, ahead-of-time builds),
`reference` (the math in PyTorch, the CPU path and the oracle), `checks` (arguments),
`plans` (K splits, grids, the shape preference where nothing is tuned), `launch` (the
Triton and CUDA launches), `op` (kernel choice, tuning hooks, the torch.library ops, the
public functions) and `golden` (what `kgen verify` runs). This module is the contract
kgen's core reads and the names callers use.

Kernels: kgen/templates/int8_gemm/triton.py.j2 (a tiled tl.dot GEMM for all three ops,
split-K with a deterministic combine for small M), cuda_sm80.cu.j2 (cp.async + ldmatrix +
mma.sync m16n8k32 s8, int8 x int8 with the W8A8 epilogue; built for sm_80 and sm_90),
cuda_sm90a.cu.j2 (Hopper: TMA + mbarrier ring, warp-specialised WGMMA s8, K split with a
deterministic combine where the tiles do not fill the SMs; int8 x int8 with the epilogue)
and cuda_gemv.cu.j2 (M <= 16, all three ops). int8_linear runs int8_mm's choice, except
where that is the reference: then the bucket's fastest kgen candidate (op._fused_impl).
Dispatch picks per (M bucket, N, K) from the tuning table, else by shape
(plans.preference) among the variants of the specs (W8A16 at large M and K: the reference,
plans.w8a16_prefers_reference); torch._int_mm / the PyTorch W8A16 expression are the
`reference` candidate of the tuner.
"""

from kgen.families.int8_gemm.checks import check_int8_linear, check_int8_mm, check_w8a16_linear
from kgen.families.int8_gemm.golden import CPU_SHAPES, GPU_SHAPES, golden
from kgen.families.int8_gemm.launch import Impl, gemm
from kgen.families.int8_gemm.op import (
    OPS, TUNE_DIMS, TUNE_FREE_DIMS, TUNE_SHAPES, implementation, int8_linear, int8_mm, tune_bucket, tune_inputs,
    tune_runner, using, w8a16_linear)
from kgen.families.int8_gemm.plans import MODE_LINEAR, MODE_MM, MODE_W8A16
from kgen.families.int8_gemm.schema import SCHEMA, TEMPLATES, template_context, triton_aot

BENCHMARK = "kgen.benchmarks.int8_gemm"
