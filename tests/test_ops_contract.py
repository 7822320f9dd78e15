"""What every op promises alike, whatever its family (kgen/runtime/op.py): gradients are
once differentiable, loudly; a registered op under torch.autocast computes as the Python
function does; autocast never casts float64; a gradient is the same on every path (kgen.ops
and torch.ops.kgen), never dropped on one of them."""

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


def _tangents_checked(name, f, device):
    """Forward-mode AD through the op's composition: for a tangent v on x (then on w), the
    output's tangent t satisfies <u, t> = <J^T u, v> for a random u, J^T u from reverse mode
    (the op's own backward); the registered op (torch.ops.kgen.*) too, where torch.library's
    own kernel dropped them (define's Autograd kernel sends it to the composition)."""
    import torch.autograd.forward_ad as fwad

    torch.manual_seed(0)
    x, w = torch.randn(3, 32, device=device), torch.randn(4, 32, device=device)
    f(x, w)  # (on CUDA: plain calls first, so that a fast path could serve the dual one)
    plain = f(x, w)
    for which in (0, 1):
        v = torch.randn_like((x, w)[which])
        with fwad.dual_level():
            args = [x, w]
            args[which] = fwad.make_dual(args[which], v)
            out = f(*args)
            t = fwad.unpack_dual(out).tangent
            # plain tensors inside a dual level still run, and the composition's primal is the
            # op's output up to float32 summation order (on CUDA a kernel's; bf16: one rounding)
            tol = 1e-4 if out.dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(fwad.unpack_dual(out).primal, f(x, w), rtol=tol, atol=tol)
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        y = f(*leaves)
        u = torch.randn_like(y, dtype=torch.float32)
        (gin,) = torch.autograd.grad(y.float(), leaves[which], u, allow_unused=True)
        want = float((gin.double() * v.double()).sum()) if gin is not None else 0.0
        got = float((u.double() * t.double()).sum()) if t is not None else 0.0
        # float32 (bf16 for w8a16) products summed in another order by the two modes, and the
        # backward's rounding of its gradient to the input's dtype (bf16: 2^-8 of each term)
        rel = 2e-2 if name == "w8a16_linear" else 1e-4
        scale = float((u.double().abs() * (t.double().abs() if t is not None else 0)).sum()) + 1e-6
        assert abs(got - want) <= rel * max(scale, abs(want)), (which, got, want)
        assert plain.shape == y.shape


@pytest.mark.parametrize("case", range(len(_cases("cpu"))))
def test_forward_mode_ad_gives_the_compositions_tangent(case):
    """A forward-mode tangent (torch.autograd.forward_ad) on any input runs the op's PyTorch
    composition, whose output carries the right tangent; before, the kernels' outputs
    carried none (a silently wrong JVP), then it was refused."""
    _tangents_checked(*_cases("cpu")[case], "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_cases("cpu"))))
def test_gpu_forward_mode_ad_gives_the_compositions_tangent(case):
    """The same on CUDA, where the repeated calls would take the eager fast paths."""
    _tangents_checked(*_cases("cuda")[case], "cuda")


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


def test_int8_linear_gradient_is_the_same_on_every_path():
    """int8_linear's gradient in its scales (its float inputs): the same through kgen.ops as
    through torch.ops (the op had no backward: both raised PyTorch's error; a path giving no
    graph where the other gives gradients is the failure this guards), none under no_grad."""
    a, b = _int8(3, 16), _int8(4, 16, seed=1)
    sb = torch.rand(4)
    grads = []
    for call in (lambda s: ops.int8_linear(a, b, s, sb, None, torch.float32),
                 lambda s: torch.ops.kgen.int8_linear(a, b, s, sb, None, torch.float32)):
        scale_a = torch.ones(3, requires_grad=True)
        y = call(scale_a)
        assert y.requires_grad
        y.sum().backward()
        grads.append(scale_a.grad)
        with torch.no_grad():
            assert not call(scale_a).requires_grad
    want = (a.long() @ b.long().t()).float() @ sb  # d/d scale_a[m] of sum = sum_n C[m, n] sb[n]
    torch.testing.assert_close(grads[0], want)
    assert torch.equal(grads[0], grads[1])


def test_integer_arguments_under_dynamic_compile():
    """ignore_index, block_size and group_size are SymInts in the ops' schemas: torch.compile
    with dynamic=True, or a second value of ignore_index (automatic dynamic), passes them as
    torch.SymInt, which the checks refused with a TypeError."""
    torch.manual_seed(9)
    W, h, t = torch.randn(11, 6), torch.randn(4, 6), torch.randint(0, 11, (4,))
    f = torch.compile(lambda h, t, ii: ops.linear_logp(h, W, t, ignore_index=ii), backend="aot_eager", fullgraph=True)
    for ii in (-100, 0, int(t[1])):
        assert torch.equal(f(h, t, ii), ops.linear_logp(h, W, t, ignore_index=ii))
    blocks, row_ptr, col_idx, x = torch.rand(3, 32, 32), torch.tensor([0, 2, 3]), torch.tensor([0, 1, 1]), torch.randn(3, 64)
    g = torch.compile(lambda x, bs: ops.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, bs), backend="aot_eager",
                      fullgraph=True, dynamic=True)
    assert torch.equal(g(x, 32), ops.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, 32))
    b8, sg, xb = _int8(6, 32), torch.rand(6, 2) / 100, torch.randn(3, 32).bfloat16()
    k = torch.compile(lambda x, gs: ops.w8a16_linear(x, b8, sg, None, gs), backend="aot_eager", fullgraph=True,
                      dynamic=True)
    assert torch.equal(k(xb, 16), ops.w8a16_linear(xb, b8, sg, None, 16))
