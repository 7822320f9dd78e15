"""logmatmul's block-sparse CUDA forward on the CPU: its K-split plan, what CudaForward.bsl
passes the library's launcher and where it declines (a fake library), and the kernels as
compiled (streamed 16-byte weight loads, no local memory). Its numerics on a GPU are in
test_logmatmul_gpu.py (test_gpu_cuda_block_sparse)."""

import re

import pytest
import torch

from conftest import requires_nvcc
from kgen.families.logmatmul import launch, plans, schema
from test_logmatmul import CUDA, SPEC, _FakeCuda


def test_bsl_cuda_splits():
    split = plans.bsl_cuda_splits
    # N = K = 4096, 8 of 32 128-blocks a row, 8 nodes a CTA, 132 SMs: 512 CTAs at B <= 4, 2048 at
    # B = 16 (4 row tiles); virtual K 1024 is 2 steps: one split
    for B in (1, 4, 16):
        assert split(B, 32, 256, 128, 8, 4, 512, 4, 132) == 1
    # 2 block rows of 128 nodes (64 CTAs of 4 nodes), 64 blocks a row (16 steps): ~8 CTAs a node
    # group would fill the SMs, each part at least MIN_SPLIT_STEPS steps: 4
    assert split(1, 2, 128, 128, 4, 8, 512, 4, 132) == 16 // plans.MIN_SPLIT_STEPS
    assert split(1, 2, 4096, 128, 4, 8, 512, 4, 132) == 8  # long rows: the SMs decide
    assert split(3, 4, 0, 32, 8, 4, 512, 4, 132) == 1  # no blocks at all
    assert split(1, 32, 256, 128, 8, 4, 512, 4, 132, splits=5) == 5
    assert split(1, 32, 256, 128, 8, 4, 512, 4, 132, splits=10 ** 6) == 65535


def test_bsl_shape_of_each_variant():
    """FMA variants keep their nodes, unroll and rows (at most 4 rows with 2+ steps in flight);
    the tensor-core form runs the first FMA variant's shape."""
    for name in CUDA:
        v = SPEC.variant(name)
        nodes, unroll, rows = schema.cuda_bsl_shape(v.params, v.dtype)
        assert 32 % nodes == 0  # a node group never straddles a block row (block_size >= 32)
        if v.params["mma"]:
            assert (nodes, unroll, rows) == schema.BSL_MMA_SHAPE == (8, 1, 4)
        else:
            assert (nodes, unroll) == (v.params["nodes"], v.params["unroll"])
            assert rows == min(schema.cuda_rows(v.params, v.dtype), 4 if unroll > 1 else 16)
        ctx = schema.template_context(v)
        assert (ctx["BSL_NODES"], ctx["BSL_UNROLL"], ctx["BSL_ROWS"], ctx["BSL_MAX_B"]) == (nodes, unroll, rows, 16)
        assert ctx["bsl_instances"][-1] == rows


def _bsl_args(B=3, R=4, C=6, bs=32, x_dtype=torch.float32, w_dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, C * bs, generator=g).to(x_dtype)
    blocks = torch.rand(R * 2, bs, bs, generator=g).to(w_dtype)
    row_ptr = torch.arange(0, 2 * R + 1, 2, dtype=torch.int32)
    col_idx = torch.tensor([0, 3] * R, dtype=torch.int64)
    return x, blocks, row_ptr, col_idx


def test_bsl_launch_arguments_and_declines(monkeypatch):
    """CudaForward.bsl hands kgen_bsl_launch the arguments its template comment lists (part_m
    and part_s two halves of one allocation with K splits, out's address without), and
    declines B above 16, x in another dtype and unaligned bases (then the Triton kernel runs)."""
    monkeypatch.setattr(launch, "current_raw_stream", lambda index: 77)
    mod = launch.CudaForward(_FakeCuda(), None)
    calls = []
    mod._bsl = (lambda ptr, *args: calls.append((ptr, args)) or 0, 99)
    x, blocks, row_ptr, col_idx = _bsl_args()
    B, K = x.shape
    N, bs = 4 * 32, 32
    out = launch.bsl_forward(mod, x, blocks, row_ptr, col_idx, bs)
    (ptr, args), = calls
    assert ptr == 99 and len(args) == 17
    assert args[1:8] == (x.data_ptr(), blocks.data_ptr(), True, row_ptr.data_ptr(), False, col_idx.data_ptr(), True)
    assert args[8] == args[9] == args[10] == out.data_ptr()  # one split: no partials
    assert args[11:] == (B, N, K, bs, 1, 77)
    calls.clear()
    out = launch.bsl_forward(mod, x, blocks, row_ptr, col_idx, bs, splits=3)
    (_, args), = calls
    assert args[15] == 3 and args[10] == out.data_ptr()
    assert args[9] - args[8] == 3 * B * N * 4  # part_s right after part_m's [3, B, N] floats

    calls.clear()
    o = torch.empty(B, N)
    x17 = torch.randn(17, K)
    assert not mod.bsl(x17, blocks, row_ptr, col_idx, bs, torch.empty(17, N))
    assert not mod.bsl(x.to(torch.bfloat16), blocks, row_ptr, col_idx, bs, o)
    unaligned = torch.randn(B * K + 1)[1:].view(B, K)
    assert not mod.bsl(unaligned, blocks, row_ptr, col_idx, bs, o)
    mod._bsl = None  # a library built before kgen_bsl_launch
    assert not mod.bsl(x, blocks, row_ptr, col_idx, bs, o)
    assert not calls


def _function_sass(sass: str) -> dict:
    """{mangled kernel name: its SASS} of a cuobjdump --dump-sass listing."""
    parts = re.split(r"\n\s+Function : (\S+)\n", "\n" + sass)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.fixture(scope="module")
def cuda_builds():
    from kgen.runtime import build

    return {r.variant.name: r for r in build.build([SPEC.variant(n) for n in CUDA])}


@requires_nvcc
@pytest.mark.parametrize("name", CUDA)
def test_bsl_kernels_compile_with_streamed_16_byte_loads_and_no_local_memory(cuda_builds, name):
    """Every variant's library holds bsl_partials per rows instance (and per weight dtype where
    w may be x's 16-bit dtype) and lmm_combine<true>: the weights in streamed 16-byte loads
    (LDG.E.NA.128), no local memory."""
    from kgen.runtime import build, toolchain

    r = cuda_builds[name]
    assert r.status in ("built", "cached"), r.error
    v = r.variant
    lib = r.entry.file(build.CUDA_LIB)
    res = toolchain.resource_usage(lib)
    bsl = [k for k in res if "bsl_partials" in k]
    _, _, rows = schema.cuda_bsl_shape(v.params, v.dtype)
    assert len(bsl) == rows.bit_length() * (1 if v.dtype == "float32" else 2), res
    assert any("lmm_combineILb1E" in k for k in res), res
    assert all(res[k]["local"] == 0 and res[k]["stack"] == 0 for k in bsl), res
    functions = _function_sass(toolchain.sass(lib))
    for k in bsl:
        assert "LDG.E.NA.128" in functions[k], k
        assert not re.search(r"\b(LDL|STL)\b", functions[k]), k
