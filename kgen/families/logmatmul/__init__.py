"""logmatmul: out[b, n] = log sum_k w[n, k] exp(x[b, k]), the sum layer of probabilistic
circuits and HMMs, dense and block-sparse, with both gradient flows.

Modules: `schema` (knobs, variant rules, template context, ahead-of-time builds),
`reference` (the math in PyTorch: the CPU path and the float64 oracle), `checks`
(arguments), `plans` (rows per program, K splits, grids), `launch` (the forward kernels and
how they run; its docstring and the Triton template's header describe the algorithms),
`backward_launch` (the backward's, and its bound form per call signature), `rules`
(kernel choice beside the tuning table: buckets, the untuned rule, vetoes on a tuned
winner), `op` (the op's memoised choice, tuning hooks, the torch.library ops and autograd,
the public functions) and `numerics` (golden numerics for `kgen verify` and the tests).
"""

from kgen.families.logmatmul.numerics import GRAD_TOL, golden, make_inputs
from kgen.families.logmatmul.backward_launch import backward, bsl_backward
from kgen.families.logmatmul.launch import CudaForward, bsl_forward, forward
from kgen.families.logmatmul.op import (
    OPS, TUNE_SHAPES, block_sparse_logmatmul, dense_from_blocks, implementation, logmatmul, runner, tune_inputs,
    tune_runner, using)
from kgen.families.logmatmul.reference import reference, reference_backward
from kgen.families.logmatmul.rules import (
    TUNE_DIMS, TUNE_FREE_DIMS, nearby_transfers, tune_bucket, tuned_transfers, untuned_order)
from kgen.families.logmatmul.schema import SCHEMA, TEMPLATES, template_context, triton_aot

BENCHMARK = "kgen.benchmarks.logmatmul"
