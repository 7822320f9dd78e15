"""kgen.runtime.triton_launch on the CPU: a JITFunction whose Triton "compiles" are fakes
that key their binaries by Triton's own specialisation (its real binder), so each test can
ask whether the binary a direct launch reused is the one Triton would have picked."""

import random
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import CompiledKernel
from triton.runtime.jit import JITFunction, create_function_from_signature
from triton.tools.tensor_descriptor import TensorDescriptor

from kgen.runtime import interpret
from kgen.runtime import triton_launch as tlaunch


def _kernel(a_ptr, b_ptr, n, flag, scale, BLOCK: tl.constexpr, MODE: tl.constexpr):  # never compiled
    pass


_Meta = namedtuple("_Meta", "target")
_Target = namedtuple("_Target", "backend arch warp_size")


class FakeCompiled(CompiledKernel):
    """One "binary": its launcher records (binary, grid, stream, hooks, args)."""

    def __init__(self, triton, key):
        self.key, self.module, self.function = key, None, 1000 + len(triton.binaries)
        self.packed_metadata = ("packed", key)
        self.metadata = _Meta(_Target("cuda", 90, 32))
        self._run = lambda g0, g1, g2, stream, function, meta, lmeta, enter, exit_, *args: triton.launches.append(
            ("direct", self, (g0, g1, g2), stream, (function, meta, lmeta, enter, exit_), args))


class FakeTriton:
    """`jit[grid](...)` as JITFunction.run does it, but "compiling" to FakeCompiled: Triton's
    binder and its specialisation of every argument decide the binary."""

    def __init__(self, fn, **jit_kw):
        self.jit = JITFunction(fn, **jit_kw)
        self.binder = create_function_from_signature(self.jit.signature, self.jit.params, CUDABackend)
        self.binaries, self.launches = {}, []
        self.jit.run = self.run

    def run(self, *args, grid, warmup, **kw):
        kw = dict(kw, debug=kw.get("debug", self.jit.debug))
        bound, spec, options = self.binder(*args, **kw)
        key = repr((spec, sorted(options.items())))
        if key not in self.binaries:
            self.binaries[key] = FakeCompiled(self, key)
        k = self.binaries[key]
        self.launches.append(("plain", k, tuple(grid), None, None, tuple(bound.values())))
        return k


@pytest.fixture
def fake(monkeypatch):
    tlaunch.clear()
    monkeypatch.setattr(tlaunch, "current_device", lambda: 0)
    monkeypatch.setattr(tlaunch, "current_raw_stream", lambda index: 4242 + index)
    for k in tlaunch.STATS:
        monkeypatch.setitem(tlaunch.STATS, k, 0)
    t = FakeTriton(_kernel, do_not_specialize=["flag"])
    yield t
    tlaunch.clear()


def _go(t, *args, grid=(3,), **kw):
    kw = {"BLOCK": 64, "MODE": "a", "num_warps": 4, **kw}
    tlaunch.launch(t.jit, grid, args, kw)
    return t.launches[-1]


def test_direct_on_this_triton():
    """Loudly: the installed Triton is one this was written for (else every launch would be
    the plain one and the other tests would not see it)."""
    assert tlaunch.disabled() is None


def test_second_launch_is_direct_with_every_argument_in_order(fake):
    a, b = torch.empty(64), torch.empty(64)
    first = _go(fake, a, b, 32, 7, 0.5)
    assert first[0] == "plain"
    second = _go(fake, a, b, 32, 7, 0.5)
    kind, binary, grid, stream, head, args = second
    assert kind == "direct" and binary is first[1] and grid == (3, 1, 1) and stream == 4242
    assert head == (binary.function, binary.packed_metadata, None, None, None)
    assert args == first[5] == (a, b, 32, 7, 0.5, 64, "a")  # constexprs too, as JITFunction.run passes them
    assert tlaunch.STATS == {"direct": 1, "plain": 1, "driver": 0}
    # a 2-D grid and the flag (not specialised) changing: still the same binary
    kind, binary, grid, *_ = _go(fake, a, b, 32, 9, 1.5, grid=(3, 2))
    assert (kind, binary, grid) == ("direct", first[1], (3, 2, 1))


@pytest.mark.parametrize("change", ["dtype", "align", "div16", "one", "i64", "constexpr", "bool_constexpr",
                                    "option", "device"])
def test_a_new_specialisation_recompiles(fake, change, monkeypatch):
    a, b = torch.empty(64), torch.empty(64)
    base = _go(fake, a, b, 32, 7, 0.5)
    args, kw = [a, b, 32, 7, 0.5], {}
    if change == "dtype":
        args[1] = torch.empty(64, dtype=torch.float16)
    elif change == "align":
        args[0] = a[1:]
    elif change == "div16":
        args[2] = 33  # Triton: no longer % 16 == 0
    elif change == "one":
        args[2] = 1  # Triton: a constexpr 1
    elif change == "i64":
        args[2] = 1 << 40
    elif change == "constexpr":
        kw["BLOCK"] = 128
    elif change == "bool_constexpr":
        kw["MODE"] = True
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "device":
        monkeypatch.setattr(tlaunch, "current_device", lambda: 1)
    new = _go(fake, *args, **kw)
    assert new[0] == "plain"
    if change != "device":  # (the fake's binaries do not know devices; Triton keeps them per device)
        assert new[1] is not base[1], "Triton compiled a new binary for this"
    assert _go(fake, *args, **kw)[0] == "direct"  # and it is reused in its turn


def test_tma_descriptor_arguments(fake):
    """A host-side TMA descriptor argument: launched directly once its dtype and block shape
    were launched before (the descriptor object itself passed on: Triton's launcher encodes
    it from its base, shape and strides on every launch), a new block shape or dtype goes to
    Triton; a replay with one is refused (its base address is inside the descriptor)."""
    x, y, h = torch.empty(16, 16), torch.empty(32, 16), torch.empty(16, 16, dtype=torch.float16)
    b = torch.empty(64)
    d1, d2 = TensorDescriptor.from_tensor(x, [8, 16]), TensorDescriptor.from_tensor(y, [8, 16])
    first = _go(fake, d1, b, 32, 7, 0.5)
    second = _go(fake, d2, b, 32, 7, 0.5)
    assert first[0] == "plain" and second[0] == "direct" and second[1] is first[1] and second[5][0] is d2
    for other in (TensorDescriptor.from_tensor(x, [16, 16]), TensorDescriptor.from_tensor(h, [8, 16])):
        got = _go(fake, other, b, 32, 7, 0.5)
        assert got[0] == "plain" and got[1] is not first[1]
    assert tlaunch.replay([(fake.jit, (3,), (d1, b, 32, 7, 0.5), {"BLOCK": 64, "MODE": "a", "num_warps": 4})],
                          (x, b)) is None


def test_reused_binary_is_always_tritons_choice(fake):
    """Random calls over every class Triton specialises: each launch ran the binary Triton's
    own specialisation picks for its arguments, and most of them directly."""
    rng = random.Random(0)
    base = torch.empty(256)
    ints = [0, 1, 2, 15, 16, 17, 32, 48, -16, -1, (1 << 31) - 16, 1 << 31, 1 << 40, (1 << 63) + 16]
    # host-side TMA descriptors: Triton keys their dtype and block shape
    descs = [TensorDescriptor.from_tensor(t.view(16, -1), blk) for t in (base, base.half(), base.clone())
             for blk in ([8, 16], [16, 16], [16, 8])]
    calls = []  # 60 argument sets, each drawn several times below
    for _ in range(60):
        a = base[rng.choice([0, 0, 1, 4, 8]):]
        b = rng.choice([base, base.half()[3:], base.bfloat16(), *rng.sample(descs, 2)])
        args = (a, b, rng.choice(ints), rng.choice(ints), rng.choice([0.5, 2.0]))
        kw = {"BLOCK": rng.choice([16, 64]), "MODE": rng.choice(["a", "b", 1, True]), "num_warps": rng.choice([4, 8])}
        calls.append((args, kw))
    for _ in range(400):
        args, kw = rng.choice(calls)
        launched = _go(fake, *args, **kw)
        _, spec, options = fake.binder(*args, **dict(kw, debug=None))
        want = fake.binaries[repr((spec, sorted(options.items())))]
        assert launched[1] is want, (args, kw)
        assert launched[5][:5] == args
    # every binary was first a plain launch; most calls repeated a key seen before
    assert tlaunch.STATS["plain"] >= len(fake.binaries) and tlaunch.STATS["direct"] > 100


def test_hooks_force_the_plain_launch(fake):
    from triton import knobs

    a, b = torch.empty(64), torch.empty(64)
    _go(fake, a, b, 32, 7, 0.5)
    assert _go(fake, a, b, 32, 7, 0.5)[0] == "direct"
    go = tlaunch.replay([(fake.jit, (3,), (a, b, 32, 7, 0.5), {"BLOCK": 64, "MODE": "a", "num_warps": 4})], (a, b))
    assert go is not None

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert tlaunch.hooked()
        assert _go(fake, a, b, 32, 7, 0.5)[0] == "plain"
        n = len(fake.launches)
        assert go((a.data_ptr(), b.data_ptr())) is False and len(fake.launches) == n
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert _go(fake, a, b, 32, 7, 0.5)[0] == "direct"
    fake.jit.pre_run_hooks.append(lambda *a, **k: None)
    assert _go(fake, a, b, 32, 7, 0.5)[0] == "plain"
    fake.jit.pre_run_hooks.clear()
    assert go((a.data_ptr(), b.data_ptr())) is True
    assert fake.launches[-1][5] == (a.data_ptr(), b.data_ptr(), 32, 7, 0.5, 64, "a")


def test_plain_while_tracing_or_on_another_triton(fake, monkeypatch):
    a, b = torch.empty(64), torch.empty(64)
    _go(fake, a, b, 32, 7, 0.5)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _go(fake, a, b, 32, 7, 0.5)[0] == "plain"
    monkeypatch.undo()
    monkeypatch.setattr(tlaunch, "current_device", lambda: 0)
    monkeypatch.setattr(tlaunch, "current_raw_stream", lambda index: 4242 + index)
    import triton

    tlaunch.clear()
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    assert "3.10.0" in tlaunch.disabled()
    _go(fake, a, b, 32, 7, 0.5)
    assert _go(fake, a, b, 32, 7, 0.5)[0] == "plain"


def test_a_changed_global_constant_is_left_to_triton(fake):
    a, b = torch.empty(64), torch.empty(64)
    g = {"C": 1}
    fake.jit.cache_key  # Triton fills used_global_vals here (its first compile)
    fake.jit.used_global_vals = {("C", id(g)): (1, g)}
    _go(fake, a, b, 32, 7, 0.5)
    assert _go(fake, a, b, 32, 7, 0.5)[0] == "direct"
    g["C"] = 2  # Triton raises for this; the direct launch must not run the stale binary
    assert _go(fake, a, b, 32, 7, 0.5)[0] == "plain"


def test_replay_before_and_after_a_launch(fake, monkeypatch):
    a, b = torch.empty(64), torch.empty(64)
    kw = {"BLOCK": 64, "MODE": "a", "num_warps": 4}
    todo = [(fake.jit, (5,), (a, b, 32, 7, 0.5), kw)]
    assert tlaunch.replay(todo, (a, b)) is None  # nothing compiled yet
    _go(fake, a, b, 32, 7, 0.5)
    go = tlaunch.replay(todo, (a, b), scalars=((0, 4),))
    assert go((16, 32, 2.5)) is True
    assert fake.launches[-1][2:4] == ((5, 1, 1), 4242) and fake.launches[-1][5] == (16, 32, 32, 7, 2.5, 64, "a")
    n = len(fake.launches)
    assert go((16, 40, 2.5)) is False and len(fake.launches) == n  # b's new address not 16-byte aligned
    monkeypatch.setattr(tlaunch, "current_device", lambda: 1)  # another device is current
    assert go((16, 32, 2.5)) is False and len(fake.launches) == n


def test_replay_resolves_views_and_refuses_what_it_cannot_tell_apart(fake):
    """Tensor arguments become (slot, offset): a slot itself, or a view inside one (a
    scratch buffer's halves); several launches replay together, or none of them."""
    x, scratch = torch.empty(64), torch.empty(256)
    lo, hi = scratch[:128], scratch[128:]
    kw = {"BLOCK": 64, "MODE": "a", "num_warps": 4}
    todo = [(fake.jit, (2,), (x, lo, 32, 7, 0.5), kw), (fake.jit, (3,), (hi, x, 32, 7, 0.5), kw)]
    for _, grid, args, kw_ in todo:
        tlaunch.launch(fake.jit, grid, args, kw_)
    go = tlaunch.replay(todo, (x, scratch))
    assert go((1 << 20, 1 << 24)) is True
    assert [f[5][:2] for f in fake.launches[-2:]] == [(1 << 20, 1 << 24), ((1 << 24) + 512, 1 << 20)]
    assert [f[2] for f in fake.launches[-2:]] == [(2, 1, 1), (3, 1, 1)]
    assert tlaunch.replay(todo, (x,)) is None  # the scratch's views belong to no slot
    assert tlaunch.replay(todo, (x, scratch, lo)) is None  # overlapping slots
    assert tlaunch.replay(todo, (x, x, scratch)) is None  # one tensor in two slots
    assert tlaunch.replay(todo, (x, scratch[1:])) is None  # a slot not 16-byte aligned
    # a kernel whose global constant changed since: none of the launches runs
    g = {"C": 1}
    fake.jit.used_global_vals = {("C", id(g)): (1, g)}
    tlaunch.clear()
    for _, grid, args, kw_ in todo:
        tlaunch.launch(fake.jit, grid, args, kw_)
    go = tlaunch.replay(todo, (x, scratch))
    g["C"] = 2
    n = len(fake.launches)
    assert go((1 << 20, 1 << 24)) is False and len(fake.launches) == n


def test_cache_is_bounded(fake, monkeypatch):
    monkeypatch.setattr(tlaunch, "MAX_ENTRIES", 4)
    a, b = torch.empty(64), torch.empty(64)
    for blk in (16, 32, 64, 128, 256, 512):
        _go(fake, a, b, 32, 7, 0.5, BLOCK=blk)
    assert len(tlaunch._CACHE) <= 4


def test_interpreted_or_unknown_kernels_take_the_plain_launch():
    class NotJit:
        def __getitem__(self, grid):
            return lambda *args, **kw: ("ran", grid, args, kw)

    assert tlaunch.launch(NotJit(), (2,), (1, 2), {"X": 3}) == ("ran", (2,), (1, 2), {"X": 3})


# ------------------------------------------------------------------ the trampoline's driver launch


def _real_body(x_ptr, out_ptr, n, scale, wide, one, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m)
    tl.store(out_ptr + offs, v * scale * one + wide, mask=m)


_real = JITFunction(_real_body)  # (not triton.jit: the tests run under TRITON_INTERPRET=1)


def _aot(signature, constexprs):
    """_real compiled for sm_90 here (no GPU needed): a real CompiledKernel's metadata, source
    signature and PTX."""
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(fn=_real, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


_SIG = {"x_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32", "scale": "fp32", "wide": "i64", "one": "i32",
        "FLAG": "constexpr", "BLOCK": "constexpr"}


def test_driver_plan_packs_the_ptx_entrys_parameters():
    """The codes follow the binary's PTX entry: pointers and the i64 as 64-bit, the i32 as
    32-bit, the float as float32; an argument Triton specialised into a constant (== 1 here)
    and the constexprs are not parameters; Triton's two scratch pointers are null."""
    compiled = _aot(_SIG, {"FLAG": True, "BLOCK": 128, "one": 1})
    ptx = tlaunch.ptx_params(compiled.asm["ptx"], compiled.metadata.name)
    assert ptx == ["u64", "u64", "u32", "f32", "u64", "u64", "u64"]  # then the global and profile scratch
    plan = tlaunch.driver_plan(compiled, tlaunch._params(_real))
    block, shared, codes, positions = plan
    assert block == compiled.metadata.num_warps * 32 and shared == compiled.metadata.shared
    assert positions == (0, 1, 2, 3, 4)  # `one` (== 1) and the constexprs are not parameters
    assert codes == b"qqifqnn"
    compiled = _aot(_SIG, {"FLAG": True, "BLOCK": 128})  # `one` a runtime i32 now
    assert tlaunch.driver_plan(compiled, tlaunch._params(_real))[2:] == (b"qqifqinn", (0, 1, 2, 3, 4, 5))


class _Src:
    def __init__(self, signature, constants):
        self.signature, self.constants = signature, constants


def _fake_compiled(ptx_types, **md):
    meta = dict(name="k", num_warps=4, shared=1024, num_ctas=1, launch_pdl=False, launch_cooperative_grid=False,
                global_scratch_size=0, profile_scratch_size=0, tensordesc_meta=[], instrumentation_mode="")
    meta.update(md)
    params = ",\n".join(f"  .param .{t} k_param_{i}" for i, t in enumerate(ptx_types))
    return SimpleNamespace(metadata=SimpleNamespace(**meta), src=_Src(_SIG, {(6,): True, (7,): 128}),
                           asm={"ptx": f".visible .entry k(\n{params}\n)\n{{ ret; }}"})


@pytest.mark.parametrize("why,ptx,md", [
    ("clusters", None, {"num_ctas": 2}),
    ("pdl", None, {"launch_pdl": True}),
    ("cooperative", None, {"launch_cooperative_grid": True}),
    ("global scratch", None, {"global_scratch_size": 256}),
    ("profile scratch", None, {"profile_scratch_size": 64}),
    ("tma descriptors", None, {"tensordesc_meta": [{"swizzle": 1}]}),
    ("instrumented", None, {"instrumentation_mode": "consan"}),
    ("a parameter missing", ["u64", "u64", "u32", "f32", "u64"], {}),
    ("a type that is not the signature's", ["u64", "u64", "u64", "f32", "u64", "u32", "u64", "u64"], {}),
    ("a 16-bit parameter", ["u64", "u64", "u32", "b16", "u64", "u32"], {}),
    ("three extra parameters", ["u64", "u64", "u32", "f32", "u64", "u32", "u64", "u64", "u64"], {}),
    ("one extra parameter", ["u64", "u64", "u32", "f32", "u64", "u32", "u64"], {}),
    ("a 32-bit extra parameter", ["u64", "u64", "u32", "f32", "u64", "u32", "u32", "u64"], {}),
])
def test_driver_plan_declines_what_it_does_not_launch(why, ptx, md):
    ok = ["u64", "u64", "u32", "f32", "u64", "u32", "u64", "u64"]
    assert tlaunch.driver_plan(_fake_compiled(ok), tlaunch._params(_real)) == (128, 1024, b"qqifqinn",
                                                                               (0, 1, 2, 3, 4, 5))
    assert tlaunch.driver_plan(_fake_compiled(ptx or ok, **md), tlaunch._params(_real)) is None, why


def test_driver_plan_off_by_switch(monkeypatch):
    monkeypatch.setattr(tlaunch, "DRIVER_CALL", False)
    ok = ["u64", "u64", "u32", "f32", "u64", "u32", "u64", "u64"]
    assert tlaunch.driver_plan(_fake_compiled(ok), tlaunch._params(_real)) is None


def test_replay_through_the_driver_call(fake, monkeypatch):
    """A replayed launch whose binary has a driver plan goes to the trampoline with only the
    parameters, in the PTX's order, the slots' new addresses patched in; where the trampoline
    does not launch (-1) Triton's launcher runs it; a CUDA error raises."""
    a, b = torch.empty(64), torch.empty(64)
    kw = {"BLOCK": 64, "MODE": "a", "num_warps": 4}
    todo = [(fake.jit, (5,), (a, b, 32, 7, 0.5), kw)]
    _go(fake, a, b, 32, 7, 0.5)
    calls, rcs = [], []

    def tcall(*args):
        calls.append(args)
        return rcs.pop(0)

    monkeypatch.setitem(tlaunch._state, "tcall", tcall)
    # the fake binary: every argument but the constexprs (BLOCK, MODE) a parameter, then 2 scratch
    monkeypatch.setattr(tlaunch._Entry, "driver", lambda self: (128, 512, b"qqiifnn", (0, 1, 2, 3, 4)))
    go = tlaunch.replay(todo, (a, b), scalars=((0, 4),))
    n = len(fake.launches)
    rcs[:] = [0]
    assert go((16, 48, 2.5)) is True and len(fake.launches) == n  # Triton's launcher not called
    binary = fake.launches[-1][1]
    assert calls[-1] == (tcall, binary.function, 5, 1, 1, 128, 512, 4242, b"qqiifnn", 16, 48, 32, 7, 2.5)[1:]
    assert tlaunch.STATS["driver"] == 1
    rcs[:] = [-1]  # not launched: Triton's launcher replays it
    assert go((32, 64, 1.5)) is True and fake.launches[-1][5] == (32, 64, 32, 7, 1.5, 64, "a")
    assert tlaunch.STATS["driver"] == 1
    rcs[:] = [700]
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        go((32, 64, 1.5))


def _two_driver_launches(fake, monkeypatch):
    """Two recorded launches of `fake` whose binaries the trampoline launches (every argument
    but the constexprs a parameter, then 2 scratch): slots x and a scratch whose halves the
    launches take, and scalars: launch 0's scale, launch 1's n."""
    x, scratch = torch.empty(64), torch.empty(256)
    kw = {"BLOCK": 64, "MODE": "a", "num_warps": 4}
    todo = [(fake.jit, (2,), (x, scratch[:128], 32, 7, 0.5), kw), (fake.jit, (3, 2), (scratch[128:], x, 48, 9, 1.5), kw)]
    for _, grid, args, kw_ in todo:
        tlaunch.launch(fake.jit, grid, args, kw_)
    monkeypatch.setattr(tlaunch._Entry, "driver", lambda self: (128, 512, b"qqiifnn", (0, 1, 2, 3, 4)))
    return todo, (x, scratch), ((0, 4), (1, 2))


def test_native_replay_packs_what_the_python_loop_passes(fake, monkeypatch):
    """Where every launch goes through the trampoline, one launcher.c call packs them all: its
    parameters (replay_args) are the ones the Python loop hands the trampoline, the scratch
    view at its offset and the moved scalars in; a misaligned slot launches nothing; on a
    machine with no CUDA driver (-1) the Python loop runs the launches instead."""
    if tlaunch._trampoline_call() is None:
        pytest.skip("no C compiler or Python headers here")
    from kgen.runtime import loader

    tramp_args = loader.trampoline().replay_args
    todo, slots, scalars = _two_driver_launches(fake, monkeypatch)
    go = tlaunch.replay(todo, slots, scalars)
    assert go.native is not None
    values = (1 << 20, (1 << 24) + 4096, 2.5, 100)

    # the Python loop's trampoline calls, recorded: (function, grid, block, shared, stream, codes, *args)
    calls = []
    monkeypatch.setitem(tlaunch._state, "tcall", lambda *a: calls.append(a) or 0)
    monkeypatch.setitem(tlaunch._state, "rplan", None)
    ref = tlaunch.replay(todo, slots, scalars)
    assert ref.native is None and ref(values) is True and len(calls) == 2
    for k, call in enumerate(calls):
        packed = tramp_args(go.native, k, values)
        assert len(packed) == len(call[7]) == 7
        assert [v for v, c in zip(packed, call[7]) if c != ord("n")] == list(call[8:])
        assert packed[5:] == (None, None)  # Triton's scratch pointers: null
    assert calls[0][8:] == (1 << 20, (1 << 24) + 4096, 32, 7, 2.5)
    assert calls[1][8:] == ((1 << 24) + 4096 + 512, 1 << 20, 100, 9, 1.5)
    assert tramp_args(go.native, 0, (1 << 20, (1 << 24) + 8, 2.5, 100)) == tlaunch.NATIVE_MISALIGNED

    # no CUDA driver on this machine: replay_run launches nothing, Triton's launchers run both
    n = len(fake.launches)
    assert go((1 << 20, 1 << 24, 2.5, 100)) is True and len(fake.launches) == n + 2
    assert fake.launches[-1][5] == ((1 << 24) + 512, 1 << 20, 100, 9, 1.5, 64, "a")
    assert go((1 << 20, (1 << 24) + 8, 2.5, 100)) is False and len(fake.launches) == n + 2


@pytest.mark.parametrize("rc", [0, tlaunch.NATIVE_MISALIGNED, 700])
def test_native_replay_results(fake, monkeypatch, rc):
    """replay_go's result: 0 counts both launches as direct driver launches; a misaligned
    slot is False; any other code raises, naming the kernels. It gets the values as
    arguments, on the replay's device's current stream; hooks or a changed knob (checked
    before it) never reach it."""
    if tlaunch._trampoline_call() is None:
        pytest.skip("no C compiler or Python headers here")
    todo, slots, scalars = _two_driver_launches(fake, monkeypatch)
    go = tlaunch.replay(todo, slots, scalars)
    runs = []
    monkeypatch.setitem(tlaunch._state, "rgo", lambda plan, stream, *values: runs.append((plan, stream, values)) or rc)
    monkeypatch.setitem(tlaunch._state, "rrun", None)  # (never reached)
    n = len(fake.launches)
    values = (1 << 20, 1 << 24, 2.5, 100)
    if rc == 700:
        with pytest.raises(RuntimeError, match="CUDA error 700"):
            go(values)
    else:
        assert go.go(*values) is (rc == 0)
    assert runs == [(go.native, 4242, values)] and len(fake.launches) == n
    assert tlaunch.STATS["driver"] == (2 if rc == 0 else 0)
    knobs = tlaunch._state["knobs"]
    monkeypatch.setitem(tlaunch._state, "knobs", lambda: ("changed",))
    assert go(values) is False and len(runs) == 1
    monkeypatch.setitem(tlaunch._state, "knobs", knobs)
    monkeypatch.setattr(tlaunch, "_hooked", lambda rt: True)
    assert go(values) is False and len(runs) == 1


@pytest.mark.parametrize("rc", [tlaunch.NATIVE_STALE, tlaunch.NATIVE_NOT_LAUNCHED])
def test_native_replay_not_launched_leaves_it_to_the_python_checks(fake, monkeypatch, rc):
    """Where replay_go launched nothing (a guard failed, or no current context), the Python
    checks decide: another device current is False with nothing launched; else replay_run
    (no guards of its own) launches them."""
    if tlaunch._trampoline_call() is None:
        pytest.skip("no C compiler or Python headers here")
    todo, slots, scalars = _two_driver_launches(fake, monkeypatch)
    go = tlaunch.replay(todo, slots, scalars)
    runs = []
    monkeypatch.setitem(tlaunch._state, "rgo", lambda plan, stream, *values: rc)
    monkeypatch.setitem(tlaunch._state, "rrun", lambda plan, stream, values: runs.append((plan, stream, values)) or 0)
    values = (1 << 20, 1 << 24, 2.5, 100)
    assert go(values) is True and runs == [(go.native, 4242, values)]
    assert tlaunch.STATS["driver"] == 2
    monkeypatch.setattr(tlaunch, "current_device", lambda: 1)
    assert go(values) is False and len(runs) == 1


def test_replay_go_checks_the_plans_guards():
    """launcher.c's replay_go: every guarded name still bound to its object, else -4 (a
    rebinding to an equal value too, and a deleted name), before the values are read; then
    the alignment check (-2); then no CUDA driver on this machine (-1). A plan made without
    guards checks none."""
    from kgen.runtime import loader

    tramp = loader.trampoline()
    if tramp is None:
        pytest.skip("no C compiler or Python headers here")
    step = (1, 1, 1, 1, 128, 0, b"qi", [None, 3], ((0, 0, 16),), ())
    big = 10 ** 6
    g = {"C": big, "D": "x"}
    guarded = tramp.replay_plan(1, 1, [step], ((g, "C", g["C"]), (g, "D", g["D"])))
    plain = tramp.replay_plan(1, 1, [step])
    assert tramp.replay_go(guarded, 0, 4096) == tlaunch.NATIVE_NOT_LAUNCHED
    assert tramp.replay_go(guarded, 0, 4104) == tlaunch.NATIVE_MISALIGNED
    g["C"] = int(str(big))  # equal, another object
    assert tramp.replay_go(guarded, 0, 4096) == tlaunch.NATIVE_STALE
    assert tramp.replay_go(guarded, 0, 4104) == tlaunch.NATIVE_STALE  # (the guards first)
    assert tramp.replay_go(plain, 0, 4096) == tlaunch.NATIVE_NOT_LAUNCHED
    del g["C"]
    assert tramp.replay_go(guarded, 0, 4096) == tlaunch.NATIVE_STALE
    with pytest.raises(ValueError):
        tramp.replay_go(plain, 0)  # a slot short
    for bad in [((g, "C"),), (({"C": 1}.items(), "C", 1),), [(g, "C", 1)]]:
        with pytest.raises(TypeError):
            tramp.replay_plan(1, 1, [step], bad)


def test_native_plan_guards_the_kernels_globals(fake, monkeypatch):
    """A Replay's plan carries its kernels' global constants: rebound, replay_go declines
    (-4) and the Python check decides: a new value is False, nothing launched."""
    if tlaunch._trampoline_call() is None:
        pytest.skip("no C compiler or Python headers here")
    g = {"C": 1}
    fake.jit.cache_key  # Triton fills used_global_vals here (its first compile)
    fake.jit.used_global_vals = {("C", id(g)): (1, g)}
    todo, slots, scalars = _two_driver_launches(fake, monkeypatch)
    go = tlaunch.replay(todo, slots, scalars)
    assert go.native is not None
    seen, real = [], tlaunch._state["rgo"]
    monkeypatch.setitem(tlaunch._state, "rgo", lambda *a: seen.append(real(*a)) or seen[-1])
    values = (1 << 20, 1 << 24, 2.5, 100)
    n = len(fake.launches)
    assert go(values) is True and seen == [tlaunch.NATIVE_NOT_LAUNCHED]  # (no CUDA here: Triton's launchers)
    assert len(fake.launches) == n + 2
    g["C"] = 2
    assert go(values) is False and seen[-1] == tlaunch.NATIVE_STALE and len(fake.launches) == n + 2


def test_replay_plan_refuses_what_it_cannot_pack():
    """replay_plan raises (the Replay then keeps the Python loop) for a patch onto a non-pointer
    parameter, a parameter left without a value, a moved value that is not a scalar's."""
    from kgen.runtime import loader

    tramp = loader.trampoline()
    if tramp is None:
        pytest.skip("no C compiler or Python headers here")
    step = (1, 1, 1, 1, 128, 0, b"qifn", [None, 3, 0.5], ((0, 0, 16),), ((2, 1),))
    plan = tramp.replay_plan(1, 2, [step])
    assert tramp.replay_args(plan, 0, (4096, 0.25)) == (4096 + 16, 3, 0.25, None)
    assert tramp.replay_run(plan, 0, (4096, 0.25)) == tlaunch.NATIVE_NOT_LAUNCHED  # no CUDA driver here
    for bad in [(1, 1, 1, 1, 128, 0, b"qifn", [None, 3, 0.5], ((1, 0, 0),), ()),  # patch onto an i32
                (1, 1, 1, 1, 128, 0, b"qifn", [None, 3, 0.5], (), ()),  # pointer with no value
                (1, 1, 1, 1, 128, 0, b"qifn", [None, 3, 0.5], ((0, 0, 0),), ((2, 0),)),  # moved from a slot
                (1, 1, 1, 1, 128, 0, b"qifn", [None, 3], ((0, 0, 0),), ()),  # template short
                (0, 1, 1, 1, 128, 0, b"qifn", [None, 3, 0.5], ((0, 0, 0),), ())]:  # null function
        with pytest.raises((ValueError, TypeError)):
            tramp.replay_plan(1, 2, [bad])


def test_trampoline_declines_without_a_launch():
    """launcher.c's triton_call returns -1 (nothing launched) for a null function, codes that
    do not match the arguments, or no CUDA driver (this machine), and checks its call."""
    from kgen.runtime import loader

    tramp = loader.trampoline()
    if tramp is None:
        pytest.skip("no C compiler or Python headers here")
    assert tramp.triton_call(0, 1, 1, 1, 128, 0, 0, b"qi", 1, 2) == -1
    assert tramp.triton_call(1, 1, 1, 1, 128, 0, 0, b"qi", 1) == -1  # an argument short
    assert tramp.triton_call(1, 1, 1, 1, 128, 0, 0, b"q", 1, 2) == -1  # one too many
    assert tramp.triton_call(1, 1, 1, 1, 128, 0, 0, b"x", 1) == -1  # an unknown code
    with pytest.raises(TypeError):
        tramp.triton_call(1, 1, 1, 1, 128, 0, 0, "qi", 1, 2)


def test_tf32_descriptor_backport_for_triton_36(monkeypatch):
    """runtime.tf32_descriptors on a Triton without `round_f32_to_tf32` (3.6's layout, faked):
    the descriptor carries the attribute and the launcher's make_tensordesc_arg, wrapped
    once, encodes it with the TFLOAT32 element type (11), every other descriptor (and the
    decomposed form, metadata None) as before; on Triton >= 3.7 the field itself."""
    import sys
    from dataclasses import dataclass

    import triton.backends.nvidia as nvidia_backends

    from kgen.runtime import tf32_descriptors as td

    if "round_f32_to_tf32" in TensorDescriptor.__dataclass_fields__:
        d = td.rounding_descriptor(torch.zeros(8, 8), [8, 8])
        assert type(d) is TensorDescriptor and d.round_f32_to_tf32

    @dataclass
    class Descriptor36:  # 3.6's fields and from_tensor signature
        base: object
        shape: list
        strides: list
        block_shape: list
        padding: str = "zero"

        @staticmethod
        def from_tensor(tensor, block_shape, padding="zero"):
            return Descriptor36(tensor, tensor.shape, tensor.stride(), block_shape, padding)

    seen = []

    def make_tensordesc_arg(arg, metadata):
        seen.append(None if metadata is None else metadata["elem_type"])
        return ["map"]

    driver = SimpleNamespace(make_tensordesc_arg=make_tensordesc_arg,
                             TMA_DTYPE_DEVICE_TO_HOST={**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9})
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.driver", driver)
    monkeypatch.setattr(nvidia_backends, "driver", driver, raising=False)
    monkeypatch.setattr(td, "TensorDescriptor", Descriptor36)
    monkeypatch.setattr(td, "_state", {})
    x = torch.zeros(8, 8)
    d = td.rounding_descriptor(x, [8, 8])
    assert type(d) is Descriptor36 and d.round_f32_to_tf32 and td._state["how"] == "backport"
    wrapped = driver.make_tensordesc_arg
    assert wrapped is not make_tensordesc_arg
    meta = {"elem_type": 7, "swizzle": 3}
    assert wrapped(d, meta) == ["map"] and wrapped(Descriptor36.from_tensor(x, [8, 8]), meta) == ["map"]
    wrapped(d, None)
    assert seen == [11, 7, None] and meta == {"elem_type": 7, "swizzle": 3}  # (the binary's metadata untouched)
    monkeypatch.setattr(td, "_state", {})
    td.rounding_descriptor(x, [8, 8])
    assert driver.make_tensordesc_arg is wrapped  # wrapped once a process
    # a launcher of another shape: no rounding offered (callers take plain descriptors)
    monkeypatch.setattr(td, "_state", {})
    driver.make_tensordesc_arg = lambda arg, metadata, extra: None
    assert td.rounding_descriptor(x, [8, 8]) is None


@pytest.mark.skipif(not interpret.active(), reason="the interpreter's leak: only where kernels are interpreted")
def test_a_device_function_called_outside_a_launch_leaves_triton_compilable():
    """Under the interpreter, a jit library function called from Python (tl.cdiv) undoes its
    patches of triton.language on return (kgen.runtime.interpret): Triton 3.9's interpreter
    left them in place, and every ahead-of-time compile after it in the process failed."""
    mul = tl.core.mul
    assert tl.cdiv(7, 2) == 4
    assert tl.core.mul is mul
    compiled = _aot(_SIG, {"FLAG": True, "BLOCK": 128, "one": 1})
    assert compiled.metadata.name


@triton.jit
def _bf16_elementwise(x_ptr, y_ptr, relu_ptr, gt_ptr, fma_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x, y = tl.load(x_ptr + i), tl.load(y_ptr + i)
    tl.store(relu_ptr + i, tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL))
    tl.store(gt_ptr + i, (x > y).to(tl.int8))
    tl.store(fma_ptr + i, x * y + x)


@pytest.mark.skipif(not interpret.active(), reason="the interpreter's bf16: only where kernels are interpreted")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_interpreted_bf16_elementwise_ops_compute_on_values(dtype):
    """Under the interpreter, bf16 max, comparisons and arithmetic work on the values
    (kgen.runtime.interpret), not on the uint16 bit patterns Triton 3.9's interpreter holds
    them as (where -1.5 > 2 and relu(-7) = -7): each bitwise equal to PyTorch's own, which
    rounds every bf16 op's result to nearest even as the GPU does; NaN, -inf, +-0 among the
    inputs. float16 (numpy's own float16) alike."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    x[:5] = torch.tensor([float("nan"), -0.0, float("-inf"), float("inf"), -7.0])
    relu, fma = torch.empty_like(x), torch.empty_like(x)
    gt = torch.empty(64, dtype=torch.int8)
    _bf16_elementwise[(1,)](x, y, relu, gt, fma, N=64)
    assert torch.equal(relu.nan_to_num(), torch.relu(x).nan_to_num()) and bool(relu[0].isnan())
    assert torch.equal(gt.bool(), x > y)
    assert torch.equal(fma.nan_to_num(), (x * y + x).nan_to_num())


@triton.jit
def _cast_to(src_ptr, dst_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(dst_ptr + i, tl.load(src_ptr + i).to(dst_ptr.dtype.element_ty))


@pytest.mark.skipif(not interpret.active(), reason="the interpreter's bf16: only where kernels are interpreted")
@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.float64], ids=str)
def test_interpreted_casts_to_bf16_round_to_nearest_even(src):
    """Under the interpreter, `.to(tl.bfloat16)` of float32, float16 and float64 rounds to
    nearest even, as the GPU's cvt.rn and PyTorch's .bfloat16() do (Triton 3.9's interpreter
    truncates float32's bits: half of random values an ulp toward zero), bitwise; ties, NaN,
    +-inf, +-0 and values that round up to inf among the inputs."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(256, generator=g, dtype=torch.float64) * 3
    ties = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 2.0 ** -130 * (1 + 2.0 ** -8)],
                        dtype=torch.float64)  # halfway between two bf16s: to the even one
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.3e38, -3.3e38],
                           dtype=torch.float64)
    x = torch.cat([ties, special, x]).to(src)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    n = 1 << (x.numel() - 1).bit_length()
    xp = torch.cat([x, x.new_zeros(n - x.numel())])
    outp = torch.empty(n, dtype=torch.bfloat16)
    _cast_to[(1,)](xp, outp, N=n)
    out = outp[:x.numel()]
    want = x.float().bfloat16() if src is torch.float64 else x.bfloat16()
    assert bool(out[4].isnan())  # (the first special value)
    assert torch.equal(out.nan_to_num(), want.nan_to_num())
