"""What every op promises alike, whatever its family (kgen/runtime/op.py): gradients are
once differentiable, loudly; a registered op under torch.autocast computes as the Python
function does; autocast never casts float64; an op without a backward raises PyTorch's
"no autograd formula" error on every path rather than dropping a gradient."""

import pytest
import torch

from kgen import ops
from kgen.runtime.op import autocast


def _int8(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)


def _cases(device):
    """(op name, f(x, w) -> output) for each differentiable op, x [3, 32] and w [4, 32]
    leaves of the right kind."""
    target = torch.tensor([0, 3, 1], device=device)
    row_ptr, col_idx = torch.tensor([0, 1], device=device), torch.tensor([0], device=device)
    b8, s8 = _int8(4, 32).to(device), torch.rand(4, device=device) / 127
    return [
        ("fused_mlp", lambda x, w: ops.fused_mlp(x, [w], None, last_activation="sigmoid")),
        ("fused_mlp", lambda x, w: torch.ops.kgen.fused_mlp(x, [w], [], 0, "none", "silu")),
        ("fused_bias_act", lambda x, w: ops.fused_bias_act(x, w[0], act="gelu")),
        ("logmatmul", lambda x, w: ops.logmatmul(x, w.abs())),
        ("block_sparse_logmatmul",
         lambda x, w: ops.block_sparse_logmatmul(x, w.abs().reshape(1, 4, 32).repeat(1, 8, 1), row_ptr, col_idx, 32)),
        ("linear_logp", lambda x, w: ops.linear_logp(x, w, target)),
        # (x's gradient does not depend on the bias: its derivative in w is truly none)
        ("w8a16_linear", lambda x, w: ops.w8a16_linear(x.bfloat16(), b8, s8, w[0, :4].bfloat16())),
    ]


def _second_derivative_raises(name, f, device):
    torch.manual_seed(0)
    x = torch.randn(3, 32, device=device, requires_grad=True)
    w = torch.randn(4, 32, device=device, requires_grad=True)
    plain = torch.autograd.grad(f(x, w).float().sum(), (x, w), allow_unused=True)
    first = torch.autograd.grad(f(x, w).float().sum(), (x, w), create_graph=True, allow_unused=True)
    # the first derivative is the same with create_graph; differentiating it again raises,
    # whether through .backward() or torch.autograd.grad to a weight
    for p, c in zip(plain, first):
        assert (p is None) == (c is None)
        if p is not None:
            assert torch.equal(p, c) and not p.requires_grad
    g = first[0] if first[0] is not None else first[1]
    with pytest.raises(RuntimeError, match=f"kgen::{name} has no second derivative"):
        g.pow(2).sum().backward()
    if name == "w8a16_linear":
        return
    g = torch.autograd.grad(f(x, w).float().sum(), (x, w), create_graph=True, allow_unused=True)
    g = g[0] if g[0] is not None else g[1]
    with pytest.raises(RuntimeError, match=f"kgen::{name} has no second derivative"):
        torch.autograd.grad(g.pow(2).sum(), w, allow_unused=True)


@pytest.mark.parametrize("case", range(len(_cases("cpu"))))
def test_second_derivative_raises_naming_the_op(case):
    """The CPU path's backward is PyTorch math that autograd could differentiate, the CUDA
    path's is kernels that it cannot: both raise alike rather than one giving a second
    derivative and the other a silently partial one."""
    _second_derivative_raises(*_cases("cpu")[case], "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_cases("cpu"))))
def test_gpu_second_derivative_raises_naming_the_op(case):
    """The same on CUDA, where linear_logp's and fused_mlp's eager training fast paths
    (their own autograd.Functions) serve the repeated calls."""
    name, f = _cases("cuda")[case]
    torch.manual_seed(0)
    x = torch.randn(3, 32, device="cuda", requires_grad=True)
    w = torch.randn(4, 32, device="cuda", requires_grad=True)
    general = torch.autograd.grad(f(x, w).float().sum(), (x, w), allow_unused=True)
    fast = torch.autograd.grad(f(x, w).float().sum(), (x, w), allow_unused=True)
    # The first call's backward (the op's) remembers the signature; the later calls take the
    # training fast path, whose backward is the op's (fused_mlp: train.gradients): bit for bit.
    for g, h in zip(general, fast):
        assert (g is None) == (h is None)
        if g is not None:
            assert torch.equal(h, g)
    for _ in range(2):
        _second_derivative_raises(name, f, "cuda")


def _tangent_refused(name, f, device):
    import torch.autograd.forward_ad as fwad

    torch.manual_seed(0)
    x, w = torch.randn(3, 32, device=device), torch.randn(4, 32, device=device)
    f(x, w)  # (on CUDA: a plain call first, so that a fast path could serve the dual one)
    f(x, w)
    with fwad.dual_level():
        for dual in ((fwad.make_dual(x, torch.ones_like(x)), w), (x, fwad.make_dual(w, torch.ones_like(w)))):
            if name == "w8a16_linear" and dual[1] is not w:
                continue  # (its w is only a bias source here: w[0, :4] would keep the tangent)
            with pytest.raises(NotImplementedError, match=f"kgen::{name} has no forward-mode derivative"):
                f(*dual)
        f(x, w)  # plain tensors inside a dual level still run


@pytest.mark.parametrize("case", range(len(_cases("cpu"))))
def test_forward_mode_ad_raises_naming_the_op(case):
    """A forward-mode tangent (torch.autograd.forward_ad) on any input is refused, not
    dropped: the kernels' outputs carry none, which would be a silently wrong JVP. The CPU
    path refuses alike, so that code right on a CPU is not wrong on a GPU."""
    _tangent_refused(*_cases("cpu")[case], "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_cases("cpu"))))
def test_gpu_forward_mode_ad_raises_naming_the_op(case):
    """The same on CUDA, where the repeated calls would take the eager fast paths."""
    _tangent_refused(*_cases("cuda")[case], "cuda")


def test_registered_ops_under_autocast_compute_as_outside():
    """torch.ops.kgen.* called under torch.autocast: the op's own math (its CPU reference
    here) runs with autocast off, as the Python functions run it, bit for bit; the matmul
    inside logmatmul's reference under autocast would round to bf16 (7e-3 off at K = 4096)."""
    torch.manual_seed(1)
    x, w = torch.randn(4, 4096) * 3, torch.rand(8, 4096)
    blocks = torch.rand(2, 32, 32)
    row_ptr, col_idx = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    xb, b8, s8 = torch.randn(3, 512).bfloat16(), _int8(5, 512), torch.rand(5) / 127
    calls = [lambda: torch.ops.kgen.logmatmul(x, w),
             lambda: torch.ops.kgen.block_sparse_logmatmul(x[:, :64], blocks, row_ptr, col_idx, 32),
             lambda: torch.ops.kgen.w8a16_linear(xb, b8, s8, None, None),
             lambda: ops.logmatmul(x, w)]
    want = [c() for c in calls]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = [c() for c in calls]
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_autocast_leaves_float64_alone():
    """torch.autocast casts float32 / float16 / bfloat16 (its eligible types), never float64;
    an op given float64 under autocast then says it does not take float64, as outside."""
    x64, x32 = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out64, out32 = autocast(x64, x32)
        assert out64 is x64 and out32.dtype == torch.bfloat16
        with pytest.raises(TypeError, match="float64"):
            ops.fused_mlp(x64, [torch.randn(3, 4, dtype=torch.float64)])


def test_op_without_a_backward_raises_on_every_path():
    """int8_linear has no gradient (its float inputs are the scales and bias): a call whose
    scale requires one runs, and its backward raises PyTorch's error, through kgen.ops as
    through torch.ops, instead of giving no graph on one path and gradients on another."""
    a, b = _int8(3, 16), _int8(4, 16, seed=1)
    for call in (lambda s: ops.int8_linear(a, b, s, torch.rand(4), None, torch.float32),
                 lambda s: torch.ops.kgen.int8_linear(a, b, s, torch.rand(4), None, torch.float32)):
        scale_a = torch.rand(3, requires_grad=True)
        y = call(scale_a)
        assert y.requires_grad
        with pytest.raises(RuntimeError, match="no autograd formula"):
            y.sum().backward()
        assert scale_a.grad is None
        with torch.no_grad():
            assert not call(scale_a).requires_grad
