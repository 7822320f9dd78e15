"""torch.func transforms over kgen's ops (kgen/runtime/op.py `define`, `composition`): under
vmap, grad, vjp, jvp, jacrev and hessian an op runs its PyTorch composition, which the
transform traces through as through PyTorch's own ops. Kernels take plain tensors only: on
CUDA the ops used to fail inside a launch ("Cannot access data pointer of Tensor that doesn't
have storage") or, under grad, with autograd.Function's setup_context error.

Each result is judged against what the op gives outside the transform: vmap against a loop
of calls, grad against torch.autograd with the op's own backward, jvp by <u, J v> = <J^T u, v>."""

import pytest
import torch
from torch.func import grad, hessian, jacrev, jvp, vmap

from kgen import ops
from kgen.runtime.op import define

B = 3  # the vmapped batch


def _cases(device):
    """(name, f(x, *rest), x batch [B, ...] floating or int8, rest, tol) with awkward sizes;
    f is the op with every argument but x fixed, x batched along dim 0 for vmap."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    bf = torch.bfloat16
    targets = torch.randint(0, 301, (B, 19), generator=g).to(device)
    targets[:, ::5] = -100
    b8 = torch.randint(-128, 128, (70, 96), generator=g, dtype=torch.int8).to(device)
    s8 = (torch.rand(70, generator=g) / 100).to(device)
    wl = torch.rand(37, 45, generator=g).to(device)
    wl[3] = 0  # a zero weight row: -inf output, no NaN gradient
    blocks, row_ptr, col_idx = torch.rand(3, 32, 32, generator=g).to(device), torch.tensor([0, 2, 3]).to(device), \
        torch.tensor([0, 1, 1]).to(device)
    ws = [r(40, 13) / 4, r(1, 40) / 6]
    bs = [r(40), None]
    return [
        ("fused_bias_act", lambda x: ops.fused_bias_act(x, bias_fba, act="gelu"), r(B, 5, 77), None),
        ("linear_logp", None, r(B, 19, 48) * 0.5, (targets, r(301, 48) / 7)),
        ("logmatmul", lambda x: ops.logmatmul(x, wl), r(B, 5, 45), None),
        ("block_sparse_logmatmul", lambda x: ops.block_sparse_logmatmul(x, blocks, row_ptr, col_idx, 32),
         r(B, 4, 64), None),
        ("int8_mm", lambda x: ops.int8_mm(x, b8), torch.randint(-128, 128, (B, 5, 96), generator=g,
                                                                 dtype=torch.int8).to(device), None),
        ("w8a16_linear", lambda x: ops.w8a16_linear(x, b8, s8), r(B, 5, 96).to(bf), None),
        ("fused_mlp", lambda x: ops.fused_mlp(x, ws, bs, activation="silu"), r(B, 33, 13), None),
    ] if (bias_fba := r(77)) is not None else []


def _fn(case):
    name, f, x, extra = case
    if name == "linear_logp":
        targets, weight = extra
        return (lambda h, t=None: ops.linear_logp(h, weight, targets[0] if t is None else t)), x, targets
    return f, x, None


def _vmap_matches_a_loop(case):
    name, _, x, _ = case
    f, x, targets = _fn(case)
    if targets is not None:
        out = vmap(f)(x, targets)
        loop = torch.stack([f(x[i], targets[i]) for i in range(B)])
    else:
        out = vmap(f)(x)
        loop = torch.stack([f(x[i]) for i in range(B)])
    assert out.shape == loop.shape and out.dtype == loop.dtype
    if out.dtype == torch.int32:
        assert torch.equal(out, loop)  # exact
    else:
        # the same math on a batch of B calls at once (its matmuls may sum in another order)
        torch.testing.assert_close(out, loop, equal_nan=True)


def _grad_matches_autograd(case):
    name, _, x, _ = case
    if not x.is_floating_point():
        return
    f, x, _ = _fn(case)
    x0 = x[0].clone()
    u = torch.randn(f(x0).shape, device=x.device)
    got = grad(lambda t: (f(t).float() * u).sum())(x0)
    leaf = x0.clone().requires_grad_()
    (want,) = torch.autograd.grad((f(leaf).float() * u).sum(), leaf)  # the op's own backward
    assert got.dtype == want.dtype
    # the composition's autograd against the op's backward formula: float32 sums in another
    # order, rounded to x's dtype (bf16 w8a16: one bf16 ulp of the largest)
    atol = 2e-2 * float(want.abs().max()) if x.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol)


def _close_to_the_op(composed, op_out):
    """The composition's output against the op's own (on CUDA a kernel's): the same float32
    math summed in another order (the kernels' exp2 / log2 forms, their tiles), and at 16-bit
    outputs one rounding that may fall the other way (one ulp)."""
    tol = 1e-4 if composed.dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(composed, op_out, rtol=tol, atol=tol, equal_nan=True)


def _jvp_agrees_with_reverse_mode(case):
    name, _, x, _ = case
    if not x.is_floating_point():
        return
    f, x, _ = _fn(case)
    x0 = x[0].clone()
    v = torch.randn_like(x0)
    out, t = jvp(f, (x0,), (v,))
    _close_to_the_op(out, f(x0))
    u = torch.randn(out.shape, device=x.device)
    leaf = x0.clone().requires_grad_()
    (jtu,) = torch.autograd.grad(f(leaf).float(), leaf, u)
    got, want = float((u.double() * t.double()).sum()), float((jtu.double() * v.double()).sum())
    scale = float((u.double() * t.double()).abs().sum())
    rel = 2e-2 if x.dtype == torch.bfloat16 else 1e-4  # as above
    assert abs(got - want) <= rel * scale, (got, want)


@pytest.mark.parametrize("case", range(7))
def test_vmap_grad_and_jvp_over_each_op(case):
    c = _cases("cpu")[case]
    _vmap_matches_a_loop(c)
    _grad_matches_autograd(c)
    _jvp_agrees_with_reverse_mode(c)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(7))
def test_gpu_vmap_grad_and_jvp_over_each_op(case):
    """On CUDA, after plain calls of the same signatures (the eager fast paths hold them):
    under a transform those step aside and the composition runs."""
    c = _cases("cuda")[case]
    f, x, targets = _fn(c)
    for _ in range(2):
        f(x[0]) if targets is None else f(x[0], targets[0])
    _vmap_matches_a_loop(c)
    _grad_matches_autograd(c)
    _jvp_agrees_with_reverse_mode(c)


def _registered(device):
    """(name, f(x) through torch.ops.kgen.<name>, the same through kgen.ops, x)."""
    g = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    b, w, ws = r(77), torch.rand(37, 45, generator=g).to(device), [r(40, 13) / 4, r(3, 40) / 6]
    return [
        ("fused_bias_act", lambda x: torch.ops.kgen.fused_bias_act(x, b, None, 1.0, "gelu"),
         lambda x: ops.fused_bias_act(x, b, act="gelu"), r(5, 77)),
        ("logmatmul", lambda x: torch.ops.kgen.logmatmul(x, w), lambda x: ops.logmatmul(x, w), r(5, 45)),
        ("fused_mlp", lambda x: torch.ops.kgen.fused_mlp(x, ws, [], 0, "relu", "silu"),
         lambda x: ops.fused_mlp(x, ws, None, activation="relu", last_activation="silu"), r(9, 13)),
    ]


def _registered_ops_under_transforms(device):
    for name, registered, python, x in _registered(device):
        v = torch.randn_like(x)
        out, t = jvp(registered, (x,), (v,))
        want_out, want_t = jvp(python, (x,), (v,))
        # the same composition on both paths: the same tangent (it was all zeros)
        assert t.abs().max() > 0, name
        torch.testing.assert_close(t, want_t, msg=name)
        _close_to_the_op(out, registered(x))
        u = torch.randn(out.shape, device=device)
        got = grad(lambda s: (registered(s) * u).sum())(x)  # (raised setup_context's error)
        leaf = x.clone().requires_grad_()
        (want,) = torch.autograd.grad((registered(leaf) * u).sum(), leaf)  # the op's own backward
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(jacrev(registered)(x), jacrev(python)(x), msg=name)
        torch.testing.assert_close(vmap(registered)(x[None].expand(2, *x.shape)), registered(x).expand(2, *out.shape),
                                   rtol=1e-4, atol=1e-5, msg=name)


def test_registered_ops_under_transforms():
    """torch.ops.kgen.<name> called directly under jvp gave zero tangents silently and under
    grad raised; now both run the composition, as kgen.ops.<name> does."""
    _registered_ops_under_transforms("cpu")


@pytest.mark.gpu
def test_gpu_registered_ops_under_transforms():
    _registered_ops_under_transforms("cuda")


def test_registered_ops_read_plain_arguments_under_grad_and_batch_any_output():
    """At the Autograd key grad and jvp wrap every argument of a registered op, plain ones too:
    block_sparse_logmatmul's pattern is still read (it raised "cannot be batched under vmap"),
    linear_logp's checked mode still checks (its bad target gave a NaN gradient row). vmap stacks Tensor[] outputs (fused_mlp_backward crashed) and takes an
    empty batch (an IndexError)."""
    g = torch.Generator().manual_seed(5)
    blocks, row_ptr, col_idx = torch.rand(3, 32, 32, generator=g), torch.tensor([0, 2, 3]), torch.tensor([0, 1, 1])
    x = torch.randn(4, 64, generator=g)
    bsl = lambda t: torch.ops.kgen.block_sparse_logmatmul(t, blocks, row_ptr, col_idx, 32)  # noqa: E731
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(bsl(leaf).sum(), leaf)
    torch.testing.assert_close(grad(lambda t: bsl(t).sum())(x), want, rtol=1e-5, atol=1e-6)
    assert jvp(bsl, (x,), (torch.ones_like(x),))[1].isfinite().all()
    # (a vmapped pattern: the registered op's vmap rule calls it once a sample, each with its own)
    cols = torch.stack([col_idx, torch.tensor([1, 0, 0])])
    got = vmap(lambda c: torch.ops.kgen.block_sparse_logmatmul(x, blocks, row_ptr, c, 32))(cols)
    assert torch.equal(got, torch.stack([torch.ops.kgen.block_sparse_logmatmul(x, blocks, row_ptr, c, 32)
                                         for c in cols]))

    h, w = torch.randn(5, 16, generator=g), torch.randn(10, 16, generator=g) / 4
    bad = torch.tensor([1, 99, 2, 3, 4])
    with pytest.raises(ValueError, match="target holds 99"):
        grad(lambda t: torch.ops.kgen.linear_logp(t, w, bad, None, 1.0, -100, False, True)[0].sum())(h)

    ws, gr = [torch.randn(40, 13, generator=g) / 4, torch.randn(3, 40, generator=g) / 6], torch.randn(9, 3, generator=g)
    xs = torch.randn(2, 9, 13, generator=g)
    backward = lambda a: torch.ops.kgen.fused_mlp_backward(gr, a, ws, [], 0, "relu", "none", True)  # noqa: E731
    out = vmap(backward)(xs)
    assert isinstance(out, list)
    for got, *each in zip(out, backward(xs[0]), backward(xs[1])):
        assert torch.equal(got, torch.stack(each))
    empty = vmap(lambda a: torch.ops.kgen.fused_mlp(a, ws, [], 0, "relu", "silu"))(xs[:0])
    assert empty.shape == (0, 9, 3)
    outs = vmap(lambda a, t: torch.ops.kgen.linear_logp(a, w, t, None, 1.0, -100, True, False))(
        torch.randn(0, 5, 16), bad.expand(0, 5))
    assert [o.shape[0] for o in outs] == [0] * len(outs)


def test_registered_in_place_op_refuses_a_gradient():
    """torch.ops.kgen.fused_bias_act_ on a tensor that requires grad left autograd's graph as it
    was: backward gave the gradient of the value before the op (all ones here), silently."""
    x, b = torch.randn(4, 8, requires_grad=True), torch.randn(8)
    with pytest.raises(RuntimeError, match="fused_bias_act_ writes its input in place and is not differentiable"):
        torch.ops.kgen.fused_bias_act_(x * 1, b, None, 1.0, "gelu")
    with torch.no_grad():
        u = x * 1
        torch.ops.kgen.fused_bias_act_(u, b, None, 1.0, "gelu")  # (no gradient wanted: runs)
    torch.testing.assert_close(u, torch.nn.functional.gelu(x + b, approximate="tanh"), rtol=1e-5, atol=1e-6)


def test_registered_in_place_op_under_vmap():
    """torch.ops.kgen.fused_bias_act_ had no vmap rule ("Batching rule not implemented"), while
    PyTorch's in-place ops and kgen.ops' inplace form run under vmap: each sample is written in
    place; an unbatched written tensor with batched other inputs is refused, as PyTorch does."""
    g = torch.Generator().manual_seed(6)
    x, b = torch.randn(5, 3, 8, generator=g), torch.randn(5, 8, generator=g)

    def write(x, b):
        x = x.clone()
        torch.ops.kgen.fused_bias_act_(x, b, None, 1.0, "gelu")
        return x

    want = torch.nn.functional.gelu(x + b[:, None], approximate="tanh")
    torch.testing.assert_close(vmap(write)(x, b), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(vmap(write, in_dims=(0, None))(x, b[0]),
                               torch.nn.functional.gelu(x + b[0], approximate="tanh"), rtol=1e-5, atol=1e-6)
    fixed = torch.randn(3, 8, generator=g)
    with pytest.raises(RuntimeError, match="writes x in place, which is not batched"):
        vmap(lambda b: torch.ops.kgen.fused_bias_act_(fixed, b, None, 1.0, "relu"))(b)


def test_public_ops_under_vmap_over_an_empty_batch():
    """kgen.ops.linear_logp and fused_mlp raised "cannot reshape tensor of 0 elements into shape
    [0, -1, 8]" (a reshape(-1, D) under vmap's empty batch); PyTorch's expressions give empty
    outputs."""
    g = torch.Generator().manual_seed(7)
    w, t = torch.randn(11, 8, generator=g), torch.tensor([1, 2, 3])
    h = torch.randn(0, 3, 8)
    logp, ent = vmap(lambda a: ops.linear_logp(a, w, t, return_entropy=True))(h)
    assert logp.shape == ent.shape == (0, 3)
    assert vmap(lambda a: ops.linear_logp(a, w, t.expand(2, 3)))(h[:, None].expand(0, 2, 3, 8)).shape == (0, 2, 3)
    w1 = torch.randn(4, 8, generator=g)
    assert vmap(lambda a: ops.fused_mlp(a, [w1]))(h).shape == (0, 3, 4)


def _per_sample_gradients(device):
    """vmap(grad(...)): per-sample gradients of a loss through linear_logp and fused_mlp
    against a loop of torch.autograd calls."""
    torch.manual_seed(3)
    w = [torch.randn(24, 11, device=device) / 3, torch.randn(9, 24, device=device) / 5]
    b = [torch.randn(24, device=device), torch.randn(9, device=device)]
    head = torch.randn(50, 9, device=device) / 3
    x = torch.randn(6, 11, device=device)
    t = torch.randint(0, 50, (6,), device=device)

    def loss(params, xi, ti):
        h = ops.fused_mlp(xi[None], params[:2], params[2:], activation="gelu")
        return -ops.linear_logp(h, head, ti[None]).sum()

    params = (*w, *b)
    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, t)
    for i in range(x.shape[0]):
        leaves = [p.clone().requires_grad_() for p in params]
        want = torch.autograd.grad(loss(leaves, x[i], t[i]), leaves)
        for got, exp in zip(per, want):
            torch.testing.assert_close(got[i], exp, rtol=1e-4, atol=1e-5)


def test_per_sample_gradients():
    _per_sample_gradients("cpu")


@pytest.mark.gpu
def test_gpu_per_sample_gradients():
    _per_sample_gradients("cuda")


def test_second_order_through_the_composition():
    """jacrev of jacrev and hessian: the composition is PyTorch math, differentiable again
    (outside a transform the op's backward stays once differentiable: test_ops_contract)."""
    torch.manual_seed(4)
    x, w = torch.randn(7), torch.rand(5, 7)
    f = lambda t: ops.logmatmul(t[None], w).sum()  # noqa: E731
    h = hessian(f)(x)
    torch.testing.assert_close(h, h.T)  # a Hessian is symmetric
    # against the expression's Hessian, computed by the same transform
    ref = hessian(lambda t: torch.logsumexp(t[None, None, :] + w.log()[None], -1).sum())(x)
    torch.testing.assert_close(h, ref, rtol=1e-4, atol=1e-6)
    j2 = jacrev(jacrev(lambda t: ops.fused_bias_act(t, torch.zeros(7), act="silu")))(x)
    assert j2.shape == (7, 7, 7)
    d = torch.sigmoid(x)
    silu2 = d * (1 - d) * (2 + x * (1 - 2 * d))  # silu''(x)
    torch.testing.assert_close(torch.diagonal(torch.diagonal(j2)), silu2, rtol=1e-4, atol=1e-6)


def test_an_op_without_a_composition_says_so_under_a_transform():
    """A family op defined without `composition` (a user's, say) refuses a transform with a
    NotImplementedError naming it, before its implementation sees a wrapped tensor; with one,
    the composition runs in the implementation's place."""
    calls = []

    def impl(x: torch.Tensor) -> torch.Tensor:
        calls.append("impl")
        return x * 2

    f = define("_test_transform_none", impl, fake=lambda x: torch.empty_like(x))
    x = torch.randn(3, 4)
    assert torch.equal(f(x), x * 2) and calls == ["impl"]
    for transform in (vmap(f), grad(lambda t: f(t).sum()), lambda t: jvp(f, (t,), (t,))):
        with pytest.raises(NotImplementedError, match="kgen::_test_transform_none does not run under torch.func"):
            transform(x)
    assert calls == ["impl"]

    def composition(x):
        calls.append("composition")
        return x * 2

    g = define("_test_transform_some", impl, fake=lambda x: torch.empty_like(x), composition=composition)
    calls.clear()
    assert torch.equal(vmap(g)(x), x * 2) and calls == ["composition"]


def test_a_registered_op_with_keyword_only_arguments_under_jvp():
    """The registered op's transform path passes keyword-only arguments (and ones left at their
    defaults) to the composition in schema order: jvp's tangent is the scale given, or the
    default one."""
    def impl(x: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
        return x * scale

    define("_test_transform_kwonly", impl, fake=lambda x, *, scale=2.0: torch.empty_like(x),
           composition=lambda x, scale=2.0: x * scale)
    x, v = torch.randn(3), torch.ones(3)
    assert torch.equal(jvp(lambda t: torch.ops.kgen._test_transform_kwonly(t, scale=3.0), (x,), (v,))[1], 3 * v)
    assert torch.equal(jvp(lambda t: torch.ops.kgen._test_transform_kwonly(t), (x,), (v,))[1], 2 * v)


def _special_values(device):
    """The op's rules for special values hold under the transforms as in its normal calls
    (each found broken in the composition by a probe, then fixed)."""
    # linear_logp: an ignored row whose hidden state is NaN gives no gradient (0 x NaN was NaN
    # in grad_bias and that row's grad_hidden); a target outside [0, V) gives NaN gradients
    # (a select made them 0, as if the row were ignored)
    g = torch.Generator().manual_seed(5)
    h, w, b = (torch.randn(*s, generator=g).to(device) for s in ((3, 4), (5, 4), (5,)))
    h[1] = float("nan")
    for t, nan_grads in ((torch.tensor([0, -100, 2]), False), (torch.tensor([0, 9, 2]), True)):
        t = t.to(device)
        loss = lambda hh, bb: ops.linear_logp(hh, w, t, bb, return_entropy=True)[1].sum() + \
            ops.linear_logp(hh, w, t, bb).sum()  # noqa: E731
        gh, gb = grad(loss, argnums=(0, 1))(h if nan_grads else h, b)
        leaves = [h.clone().requires_grad_(), b.clone().requires_grad_()]
        wh, wb = torch.autograd.grad(loss(*leaves), leaves)  # the op's own backward
        if nan_grads:
            assert bool(gb.isnan().all()) and bool(wb.isnan().all()) and bool(gh[1].isnan().all())
        else:
            assert not bool(gb.isnan().any()) and bool((gh[1] == 0).all())
            torch.testing.assert_close(gb, wb, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(gh[[0, 2]], wh[[0, 2]], rtol=1e-4, atol=1e-5)
    # logmatmul: a node whose terms lie 90-104 below the row maximum (float32's subnormal sums):
    # the gradient was [nan, inf, inf]
    x = torch.tensor([[0.0, -95.0, -100.0]], device=device)
    wl = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]], device=device)
    got = grad(lambda t: ops.logmatmul(t, wl).sum())(x)
    exact = torch.tensor([[1.0, 1 / (1 + torch.e ** -5), 1 / (1 + torch.e ** 5)]], device=device)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-6)
    # block_sparse_logmatmul: block row by block row, as the kernels -- a NaN in one block row's
    # children leaves the others finite, and a block row whose children lie 120 below the row's
    # maximum is finite, not -inf (the dense form shifted by the whole row's maximum)
    blocks = torch.rand(3, 32, 32, generator=g).to(device)
    row_ptr, col_idx = torch.tensor([0, 2, 3], device=device), torch.tensor([0, 2, 1], device=device)
    xb = torch.randn(2, 96, generator=g).to(device)
    xb[0, 5] = float("nan")
    xb[1, 32:64] -= 120
    f = lambda t: ops.block_sparse_logmatmul(t, blocks, row_ptr, col_idx, 32)  # noqa: E731
    out, vout = f(xb), vmap(lambda t: f(t[None])[0])(xb)
    assert bool(out[0, :32].isnan().all()) and not bool(out[0, 32:].isnan().any())
    assert bool(out[1, 32:].isfinite().all())
    torch.testing.assert_close(vout, out, rtol=1e-5, atol=1e-4, equal_nan=True)
    with pytest.raises(ValueError, match="row_ptr and col_idx cannot be batched"):
        vmap(lambda rp: ops.block_sparse_logmatmul(xb, blocks, rp, col_idx, 32))(row_ptr[None].expand(2, -1))


def test_special_values_under_transforms():
    _special_values("cpu")


@pytest.mark.gpu
def test_gpu_special_values_under_transforms():
    _special_values("cuda")


def test_checked_targets_under_vmap():
    """check_targets reads target's values on the host: over a batched target vmap cannot, and
    the check is skipped there (a bad row NaN, as unchecked); over a plain one it still raises."""
    torch.manual_seed(6)
    H, W = torch.randn(2, 3, 4), torch.randn(5, 4)
    T = torch.tensor([[0, 1, 2], [3, 9, -100]])
    out = vmap(lambda h, t: ops.linear_logp(h, W, t, check_targets=True))(H, T)
    loop = torch.stack([ops.linear_logp(H[i], W, T[i]) for i in range(2)])
    torch.testing.assert_close(out, loop, equal_nan=True)
    assert bool(out[1, 1].isnan()) and int(out.isnan().sum()) == 1
    with pytest.raises(ValueError, match="9"):
        vmap(lambda h: ops.linear_logp(h, W, T[1], check_targets=True))(H)


def test_torch_compile_of_a_transform():
    """torch.compile around jvp, grad, vmap and forward_ad: the compiled function traces the
    composition too (the registered op has no rule for a transform: compiled jvp tangents were 0)."""
    torch.manual_seed(8)
    x, b, v = torch.randn(4, 6), torch.randn(6), torch.randn(4, 6)
    f = lambda t: ops.fused_bias_act(t, b, act="gelu")  # noqa: E731
    import torch.autograd.forward_ad as fwad

    def dual(t):
        with fwad.dual_level():
            return fwad.unpack_dual(f(fwad.make_dual(t, v))).tangent

    for fn in (lambda t: jvp(f, (t,), (v,))[1], lambda t: grad(lambda s: f(s).sum())(t), vmap(f), dual):
        want = fn(x)
        got = torch.compile(fn, backend="aot_eager")(x)
        assert got is not None and bool(want.abs().sum() > 0)
        torch.testing.assert_close(got, want)
    # ops whose composition pins the reference (op.with_reference: Override.using, which used
    # to `del` a threading.local attribute: Dynamo raised InternalTorchDynamoError)
    ws, bs = [torch.randn(7, 6) / 3, torch.randn(3, 7) / 3], [torch.randn(7), None]
    g = lambda t: ops.fused_mlp(t, ws, bs, activation="silu")  # noqa: E731
    w8, s8 = torch.randint(-128, 128, (5, 6), dtype=torch.int8), torch.rand(5) / 100
    h = lambda t: ops.w8a16_linear(t, w8, s8)  # noqa: E731
    for fn, t in ((vmap(g), x), (lambda t: grad(lambda s: g(s).sum())(t), x), (vmap(h), x.bfloat16())):
        want = fn(t)
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(t)
        torch.testing.assert_close(got, want)


def _module_per_sample_gradients(device):
    """kgen.nn.FusedMLP through torch.func.functional_call: per-sample gradients of every
    parameter by vmap(grad(...)) against a loop of torch.autograd calls on the module."""
    from kgen.nn import FusedMLP

    torch.manual_seed(10)
    net = FusedMLP([13, 40, 7, 1], activation="gelu", last_activation="sigmoid", device=device)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, y = torch.randn(5, 13, device=device), torch.rand(5, 1, device=device)

    def loss(p, xi, yi):
        return ((torch.func.functional_call(net, p, (xi[None],)) - yi) ** 2).sum()

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(x.shape[0]):
        net.zero_grad()
        ((net(x[i:i + 1]) - y[i]) ** 2).sum().backward()
        for k, p in net.named_parameters():
            torch.testing.assert_close(per[k][i], p.grad, rtol=1e-4, atol=1e-6)


def test_module_per_sample_gradients():
    _module_per_sample_gradients("cpu")


@pytest.mark.gpu
def test_gpu_module_per_sample_gradients():
    _module_per_sample_gradients("cuda")
