"""Launching a Triton kernel again without `JITFunction.run`'s host cost.

`kernel[grid](*args, **kw)` spends 20-35 us of Python on an H100 host before Triton's C
launcher runs: it binds the arguments, specialises each one, formats a cache key, reads its
knobs and builds launch metadata. A kernel launched again with arguments Triton would
specialise the same way gets the same compiled binary, so `launch(kernel, grid, args, kw)`
runs `kernel[grid]` the first time it sees a specialisation (Triton compiles or finds the
binary and returns it, a `CompiledKernel`) and afterwards calls that binary's launcher as
`JITFunction.run` does (Triton 3.6 to 3.9 read; the same call in all four):
`compiled.run(grid0, grid1, grid2, stream, compiled.function, compiled.packed_metadata,
launch_metadata, enter_hook, exit_hook, *every_argument_in_order)`, on the current torch
stream of the current device (where Triton launches too), without a host synchronisation
(CUDA-graph capture records it like any launch).

The key a binary is kept under is at least as fine as Triton's specialisation, so the binary
reused is the one Triton would pick: the kernel; the current device; the keyword options
(num_warps, ...); Triton's knobs that enter its key (debug, instrumentation mode, 3.9's
fpsan casts); and per argument, its value for constexpr parameters, else a tensor's dtype and
whether its address is 16-byte aligned, an int's i32 / i64 / u64 range, == 1 and % 16 == 0
(also for do_not_specialize ints: finer than Triton, never coarser), a float's or a bool's
type, a host-side TMA descriptor's (triton.tools.tensor_descriptor.TensorDescriptor) base
dtype, block shape, padding and TF32 rounding (Triton keys the first two; its launcher
encodes the descriptor from the rest on every launch, direct ones included). Anything else
(another argument type, an unhashable constexpr) takes the plain launch.

The plain `kernel[grid]` launch runs instead (counted in STATS) where this could differ from
it: the Triton interpreter (not a JITFunction), torch.compile tracing (Dynamo traces the
kernel itself), a Triton release outside 3.6-3.9 or a non-CUDA binary (`disabled()` says why;
the tests assert it is None), launch hooks (profilers: `knobs.runtime.launch_enter_hook` /
`launch_exit_hook` with hooks in them, Triton 3.7+'s stages inspection hook) or a kernel's
own pre-run hooks. Triton's check that a kernel's global constants have not changed since it
compiled (an error there) is made here too.

`replay` serves an op's eager fast path, which fixes everything per call signature but the
addresses of its tensors (and maybe a scalar): the launches of that signature, recorded
once, replayed with new addresses. A replayed binary that needs nothing but its parameters
(one CTA per cluster, no programmatic-dependent or cooperative launch, no global or profile
scratch, no TMA descriptor arguments, no instrumentation) is launched by the driver's
cuLaunchKernel through kgen's C trampoline (`launcher.c`'s triton_call), its parameters packed
as the binary's PTX `.entry` lists them: the launch Triton's launcher makes for such a binary,
without its per-call Python (scratch-allocator lookups, closures, argument annotation:
1.0-1.4 us of a 9-12 us replayed call on an H200 host, BENCHMARKS.md thirty-fifth
session). Anything that does not line up (the PTX's parameters against the arguments Triton
passes, their types against the signature's) keeps Triton's launcher for that binary;
KGEN_TRITON_DRIVER_CALL=0 keeps it for all. Where every launch of a replay goes that way, the
parameters are packed once into a plan (`launcher.c`'s replay_plan) and each call is one C call
(replay_go: the kernels' global constants and the CUDA context checked, the alignment check,
the new addresses and scalars patched in, every launch), not a Python loop over the launches'
parameters: 1.4-3.7 us less a call with one or two launches on an H200 host (BENCHMARKS.md,
sixty-seventh session), and the values given as arguments (`Replay.go`), not in a list.
"""

from __future__ import annotations

import inspect
import os
import re

import torch

# current_device: the device Triton launches on, torch's current one (what
# driver.active.get_current_device returns)
from kgen.runtime.streams import current_device, current_raw_stream

# what the plain path takes and the direct one skips, for tests and benchmarks
STATS = {"direct": 0, "plain": 0, "driver": 0}  # driver: of the direct ones, by the trampoline's cuLaunchKernel
# launcher.c's replay_run / replay_go: nothing launched (no CUDA context; a slot misaligned; a
# guard failed: a kernel's global rebound or another context current, the Python checks decide)
NATIVE_NOT_LAUNCHED, NATIVE_MISALIGNED, NATIVE_STALE = -1, -2, -4
DRIVER_CALL = os.environ.get("KGEN_TRITON_DRIVER_CALL", "1") != "0"
MAX_ENTRIES = 4096  # specialisations kept (kernels x arguments x devices); cleared beyond
SUPPORTED = ((3, 6), (3, 7), (3, 8), (3, 9))  # the releases whose JITFunction.run was read

# Keys hold id(kernel), not the kernel: a JITFunction hashes through its source hash, under a
# lock. An entry keeps its kernel, so the id is not reused while the entry lives.
_CACHE: dict = {}  # key -> _Entry
_FNS: dict = {}  # id(JITFunction) -> (it, (arg_names, constexpr positions, defaults) or None)
_MISSING = object()
_TDESC = _MISSING  # triton.tools.tensor_descriptor.TensorDescriptor, once _check_triton read it
_state: dict = {}  # "reason": why direct launches are off (None: on), "knobs": the knob reader


def disabled() -> str | None:
    """Why direct launches are off in this process (None: they are on)."""
    if "reason" not in _state:
        _state["reason"] = _check_triton()
    return _state["reason"]


def set_enabled(on: bool) -> None:
    """Turn direct launches off (every launch Triton's own; benchmarks' "before") or back on."""
    if on:
        _state.pop("reason", None)
    else:
        disabled()
        _state["reason"] = "turned off by set_enabled(False)"


def _check_triton() -> str | None:
    try:
        import triton
        from triton import knobs
        from triton.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError as e:
        return f"Triton's layout is not the one read ({e})"
    try:
        version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return f"Triton {triton.__version__}: not a release this was written for"
    if version not in SUPPORTED:
        return f"Triton {triton.__version__}: JITFunction.run was read for 3.6-3.9 only"
    if not all(hasattr(CompiledKernel, a) for a in ("run", "launch_metadata")):
        return "Triton's CompiledKernel has no run / launch_metadata"
    rt, comp = knobs.runtime, knobs.compilation
    if not all(hasattr(rt, a) for a in ("debug", "launch_enter_hook", "launch_exit_hook")):
        return "Triton's runtime knobs are not the ones read"
    if not hasattr(comp, "instrumentation_mode"):
        return "Triton's compilation knobs are not the ones read"
    # the knobs JITFunction.run puts into its options (part of its cache key)
    if hasattr(comp, "fpsan_homomorphic_casts"):  # 3.9
        _state["knobs"] = lambda: (rt.debug, comp.instrumentation_mode, comp.fpsan_homomorphic_casts)
    else:
        _state["knobs"] = lambda: (rt.debug, comp.instrumentation_mode)
    # Triton 3.7+ has a stages inspection hook; on 3.6 asking for it raised and caught an
    # AttributeError on every launch: whether the knob exists is read once
    _state.update(jit=JITFunction, compiled=CompiledKernel, runtime=rt,
                  stages_knob=hasattr(rt, "add_stages_inspection_hook"))
    global _TDESC
    _TDESC = TensorDescriptor
    return None


def hooked() -> bool:
    """Whether a launch must go through Triton's own path for its hooks (a profiler's launch
    hooks; Triton 3.7+'s stages inspection hook)."""
    from triton import knobs

    return _hooked(knobs.runtime)


def _hooked(rt) -> bool:
    # 3.6-3.9 keep a HookChain (never None); an empty one calls nothing, as None does
    h = rt.launch_enter_hook
    if h is not None and getattr(h, "calls", True):
        return True
    h = rt.launch_exit_hook
    if h is not None and getattr(h, "calls", True):
        return True
    if not _state.get("stages_knob", True):  # read once (_check_triton); unknown: ask
        return False
    return getattr(rt, "add_stages_inspection_hook", None) is not None


def _params(fn):
    """(arg_names, constexpr positions, defaults by name) of a JITFunction, read once."""
    got = _FNS.get(id(fn))
    if got is not None and got[0] is fn:
        return got[1]
    try:
        kinds = {q.kind for q in fn.signature.parameters.values()}
        if kinds - {inspect.Parameter.POSITIONAL_OR_KEYWORD}:  # *args or keyword-only parameters: not read here
            raise AttributeError
        names = tuple(fn.arg_names)
        const = frozenset(fn.constexprs)
        defaults = {kp.name: kp.default for kp in fn.params if kp.has_default}
        p = (names, const, defaults)
    except AttributeError:
        p = None
    if len(_FNS) >= MAX_ENTRIES:
        _FNS.clear()
    _FNS[id(fn)] = (fn, p)
    return p


def _spec(a):
    """An argument's class, as fine as Triton's specialisation of a non-constexpr one, or
    _MISSING for a type not handled here."""
    t = type(a)
    if t is torch.Tensor or t is torch.nn.Parameter:
        return a.dtype, not a.data_ptr() & 15
    if t is int:
        r = 0 if -0x80000000 <= a < 0x80000000 else 1 if -(1 << 63) <= a < (1 << 63) else 2 if 0 <= a < (1 << 64) else 3
        return r, a == 1, not a & 15
    if t is float or t is bool:
        return t
    if a is None:
        return None
    if t is _TDESC:
        return (t, a.base.dtype, tuple(a.block_shape), getattr(a, "padding", "zero"),
                getattr(a, "round_f32_to_tf32", False))
    return _MISSING


def _key(fn, args, kw):
    """(the cache key, every argument in the kernel's order) or (None, None)."""
    p = _params(fn)
    if p is None:
        return None, None
    names, const, defaults = p
    n = len(args)
    tail = []
    for name in names[n:]:
        v = kw.get(name, _MISSING)
        if v is _MISSING:
            v = defaults.get(name, _MISSING)
            if v is _MISSING:  # Triton raises for it
                return None, None
        tail.append(v)
    every = (*args, *tail)
    specs = []
    for i, a in enumerate(every):
        if i in const:
            s = (type(a), a)  # 1 and True are distinct constexprs
        else:
            s = _spec(a)
            if s is _MISSING:
                return None, None
        specs.append(s)
    opts = tuple((k, v) for k, v in kw.items() if k not in names)
    try:
        key = (id(fn), current_device(), opts, fn.debug, _state["knobs"](), tuple(specs))
        hash(key)
    except TypeError:  # an unhashable constexpr or option
        return None, None
    return key, every


class _Entry:
    """One specialisation's binary: its launcher, function handle, packed metadata, and the
    kernel's global constants as they were when it compiled."""

    __slots__ = ("fn", "run", "function", "metadata", "globals", "compiled", "_driver")

    def __init__(self, fn, compiled):
        self.fn, self.compiled, self._driver = fn, compiled, _MISSING
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        # (name, the object bound now, the value Triton compiled with, the globals dict):
        # Triton keeps a copy of each value, so comparing with it (`!=` on tl.constexpr) is
        # the slow part; the object bound when Triton last checked is the fast one
        self.globals = tuple((name, g.get(name, _MISSING), val, g)
                             for (name, _), (val, g) in getattr(fn, "used_global_vals", {}).items())

    def globals_unchanged(self) -> bool:
        for name, bound, val, g in self.globals:
            now = g.get(name, _MISSING)
            if now is not bound and now != val:
                return False
        return True

    def driver(self):
        """(block threads, shared bytes, codes, parameter positions) for a launch through the
        trampoline's cuLaunchKernel (see the module doc), or None: Triton's launcher (read
        once per binary)."""
        if self._driver is _MISSING:
            try:
                self._driver = driver_plan(self.compiled, _params(self.fn))
            except Exception:  # noqa: BLE001 (Triton's internals differ: its own launcher serves)
                self._driver = None
        return self._driver


_PTX_CODE = {"u64": "q", "s64": "q", "b64": "q", "u32": "i", "s32": "i", "b32": "i", "f32": "f", "f64": "d"}
_SIG_CODE = {"i32": "i", "u32": "i", "i64": "q", "u64": "q", "fp32": "f", "f64": "d", "fp64": "d"}


def ptx_params(ptx: str, name: str) -> list[str] | None:
    """The `.entry name(...)` parameters' PTX types in order (e.g. ["u64", "u32", "f32"]),
    or None where the entry is not found."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(([^)]*)\)", ptx)
    if m is None:
        return None
    return re.findall(r"\.param\s+\.(\w+)", m.group(1))


def driver_plan(compiled, params) -> tuple | None:
    """How the trampoline launches `compiled` (a CUDA CompiledKernel of a JITFunction whose
    `_params` are `params`): (block threads, shared bytes, codes, positions of the kernel's
    arguments, in `every` order, that are parameters), or None where it must not: a launch
    needing more than its parameters (clusters, PDL, cooperative grids, scratch buffers, TMA
    descriptors, instrumentation), or parameters that do not line up — the PTX entry must
    list exactly the arguments Triton passes (those neither constexpr nor specialised into
    constants, in order) with the signature's types, then the 64-bit scratch pointers Triton's
    launcher appends (global and profile where the metadata has their sizes)."""
    if params is None or not DRIVER_CALL:
        return None
    md = compiled.metadata
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False)
            or getattr(md, "launch_cooperative_grid", False) or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0) or getattr(md, "tensordesc_meta", None)
            or getattr(md, "instrumentation_mode", "") or tuple(getattr(md, "cluster_dims", (1, 1, 1))) != (1, 1, 1)):
        return None
    names = params[0]
    src = compiled.src
    consts = set()
    for k in getattr(src, "constants", {}):
        if isinstance(k, str):
            k = (names.index(k),)
        if not (isinstance(k, tuple) and len(k) == 1):
            return None  # a tuple argument's element: not handled here
        consts.add(k[0])
    sig = src.signature
    types = [sig[n] for n in names] if all(isinstance(k, str) for k in sig) else list(sig.values())
    if len(types) != len(names):
        return None
    positions = [i for i, t in enumerate(types) if i not in consts and t != "constexpr"]
    ptx = ptx_params(compiled.asm["ptx"], md.name)
    # Triton's launchers (3.4-3.9 read) append a global and a profile scratch pointer to every
    # launch; exactly that many parameters past the arguments, or the binary is not read right
    scratch = hasattr(md, "global_scratch_size") + hasattr(md, "profile_scratch_size")
    if ptx is None or len(ptx) != len(positions) + scratch:
        return None
    codes = []
    for i, pt in zip(positions, ptx):
        t = types[i]
        code = _PTX_CODE.get(pt)
        if code is None or code != ("q" if t.startswith("*") else _SIG_CODE.get(t)):
            return None
        codes.append(code)
    for pt in ptx[len(positions):]:  # Triton's global and profile scratch pointers: null
        if _PTX_CODE.get(pt) != "q":
            return None
        codes.append("n")
    block = md.num_warps * getattr(md, "warp_size", 32)
    return block, md.shared, "".join(codes).encode(), tuple(positions)


def _usable(fn) -> bool:
    if torch.compiler.is_compiling() or disabled() is not None:
        return False
    return isinstance(fn, _state["jit"]) and not fn.pre_run_hooks and not _hooked(_state["runtime"])


def _grid3(grid):
    n = len(grid)
    return grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1


def launch(fn, grid: tuple, args, kw: dict):
    """`fn[grid](*args, **kw)`: the compiled binary's launcher directly where this
    specialisation was launched before (see the module doc; returns None), else Triton's
    own path (returns what it returns). `grid` is a tuple of 1 to 3 ints (not a callable)."""
    if not _usable(fn):
        STATS["plain"] += 1
        return fn[grid](*args, **kw)
    key, every = _key(fn, args, kw)
    e = _CACHE.get(key) if key is not None else None
    if e is not None and e.fn is fn and e.globals_unchanged():
        STATS["direct"] += 1
        g0, g1, g2 = _grid3(grid)
        e.run(g0, g1, g2, current_raw_stream(key[1]), e.function, e.metadata, None, None, None, *every)
        return None
    STATS["plain"] += 1
    compiled = fn[grid](*args, **kw)
    if key is not None and isinstance(compiled, _state["compiled"]) and _is_cuda(compiled):
        if len(_CACHE) >= MAX_ENTRIES:
            _CACHE.clear()
        _CACHE[key] = _Entry(fn, compiled)
    return compiled


def _is_cuda(compiled) -> bool:
    target = getattr(getattr(compiled, "metadata", None), "target", None)
    return getattr(target, "backend", None) == "cuda" and compiled.function is not None


def replay(launches, slots, scalars=()) -> "Replay | None":
    """A replay of launches an op just ran through `launch` (or would run: the same
    specialisations), for its eager fast path: `launches` is a list of (kernel, grid, args,
    kw); `slots` the tensors whose addresses change from call to call (x, weights, outputs,
    scratch); `scalars` (launch index, argument index) of non-tensor arguments that change
    too (an alpha). Returns a `Replay`, called with one address per slot and then one value
    per scalar, or None where the launches cannot be replayed: a TMA descriptor argument, a binary not launched yet,
    the plain path in force (see `launch`), a grid that is not a tuple of ints, a tensor
    argument that is neither a slot nor inside one, slots that overlap (aliased inputs: their
    addresses could not be told apart later) or a slot not 16-byte aligned (the recorded
    binaries assume aligned slots; an unaligned signature would pin every later aligned
    call to them).

    A tensor argument is resolved to the slot it is (identity), else to the slot whose bytes
    hold it, as (slot, byte offset): a view of a scratch buffer replays at the same offset
    into the new buffer. Every other argument is replayed as recorded."""
    if not launches or any(not _usable(fn) for fn, *_ in launches):
        return None
    spans = []
    for t in slots:
        p = t.data_ptr()
        if p & 15:
            return None
        spans.append((p, p + t.numel() * t.element_size()))
    ordered = sorted(spans)
    if any(a[1] > b[0] and a[0] < a[1] for a, b in zip(ordered, ordered[1:])) or len(set(map(id, slots))) < len(slots):
        return None
    steps, entries, device, knobs = [], [], None, None
    for li, (fn, grid, args, kw) in enumerate(launches):
        key, every = _key(fn, args, kw)
        e = _CACHE.get(key) if key is not None else None
        if e is None or e.fn is not fn or not all(type(g) is int for g in grid) or not 1 <= len(grid) <= 3:
            return None
        if device is None:
            device, knobs = key[1], key[4]
        elif (key[1], key[4]) != (device, knobs):
            return None
        template, patches = list(every), []
        for ai, a in enumerate(every):
            if isinstance(a, torch.Tensor):
                where = _slot_of(a, slots, spans)
                if where is None:
                    return None
                patches.append((ai, *where))
                template[ai] = None
            elif type(a) is _TDESC:  # (its base's address is inside it: not replayed)
                return None
        moved = tuple((ai, len(slots) + j) for j, (l2, ai) in enumerate(scalars) if l2 == li)
        steps.append((e.run, e.function, e.metadata, _grid3(grid), template, tuple(patches), moved,
                      _driver_step(e, template, patches, moved)))
        entries.append(e)
    return Replay(tuple(steps), tuple(entries), len(slots), device, knobs,
                  _native_plan(steps, len(slots), len(slots) + len(scalars), entries))


def _native_plan(steps, n_slots, n_values, entries=()):
    """launcher.c's replay plan of `steps` (every one launched by the trampoline, packed
    once: `replay_go` checks, patches and launches them all in C), guarded by `entries`'
    global constants (each name bound to the object it was bound to when Triton last checked)
    and the CUDA context current now; or None: the steps go one by one through `Replay`'s
    Python loop."""
    if any(st[7] is None for st in steps) or _trampoline_call() is None:
        return None
    plan = _state.get("rplan")
    if plan is None or _state.get("rgo") is None:
        return None
    guards = {(id(g), name): (g, name, bound) for e in entries for name, bound, _val, g in e.globals}
    rows = []
    for *_, (g0, g1, g2), _template, _patches, _moved, driver in steps:
        _call, fn_, block, shared, codes, t, dpatches, dmoved, _name = driver
        rows.append((fn_, g0, g1, g2, block, shared, codes, t, dpatches, dmoved))
    try:
        return plan(n_slots, n_values, rows, tuple(guards.values()))
    except (TypeError, ValueError, OverflowError):  # (a value it cannot pack: the Python loop packs it)
        return None


def _driver_step(e, template, patches, moved):
    """(trampoline call, function, block, shared, codes, the parameters' template, patches,
    moved scalars, with positions among the binary's parameters, and the kernel's name), or
    None: Triton's launcher replays this launch."""
    plan = e.driver()
    call = _trampoline_call() if plan is not None else None
    if call is None:
        return None
    block, shared, codes, positions = plan
    at = {ai: k for k, ai in enumerate(positions)}
    if any(ai not in at for ai, *_ in patches) or any(ai not in at for ai, _ in moved):
        return None  # (a patched argument that is not a parameter: not expected; Triton's path)
    return (call, e.function, block, shared, codes, [template[ai] for ai in positions],
            tuple((at[ai], si, off) for ai, si, off in patches), tuple((at[ai], vi) for ai, vi in moved),
            getattr(e.compiled.metadata, "name", "?"))


def _trampoline_call():
    """launcher.c's triton_call, or None (no C compiler or Python headers here)."""
    if "tcall" not in _state:
        from kgen.runtime import loader

        tramp = loader.trampoline()
        _state["tcall"] = getattr(tramp, "triton_call", None)
        # (a launcher.c built before replay plans existed has none: then the Python loop)
        _state["rplan"] = getattr(tramp, "replay_plan", None)
        _state["rrun"] = getattr(tramp, "replay_run", None)
        _state["rgo"] = getattr(tramp, "replay_go", None)
    return _state["tcall"]


def _slot_of(a, slots, spans):
    """(slot index, byte offset) of tensor argument `a`, or None."""
    for i, t in enumerate(slots):
        if a is t:
            return i, 0
    p = a.data_ptr()
    for i, (lo, hi) in enumerate(spans):
        if lo <= p < hi:
            return i, p - lo
    return None


class Replay:
    """Recorded launches (see `replay`): `r(values)`, or `r.go(*values)`, launches them again
    on the current stream with the slots' new addresses and the scalars' new values and
    returns True, or launches nothing and returns False where Triton's own path must run: a
    slot address not 16-byte aligned, hooks set since, a knob or the current device changed,
    a kernel's global constant changed. The check is made for every launch before the first
    runs, so a call never half-replays. Where every launch goes through the trampoline, one
    call of launcher.c's `replay_go` checks the globals and the context, patches and launches
    them all (`native`, its packed plan); the hooks and knobs are read here first."""

    __slots__ = ("steps", "entries", "n_slots", "device", "knobs", "native")

    def __init__(self, steps, entries, n_slots, device, knobs, native=None):
        self.steps, self.entries, self.n_slots, self.device, self.knobs = steps, entries, n_slots, device, knobs
        self.native = native

    def __call__(self, values) -> bool:
        return self.go(*values)

    def go(self, *values) -> bool:
        """As `r(values)`, the values as arguments (a fast path's call builds no list)."""
        native = self.native
        if native is not None:
            st = _state
            if st.get("reason") is None and not _hooked(st["runtime"]) and st["knobs"]() == self.knobs:
                done = self._native_result(st["rgo"](native, current_raw_stream(self.device), *values))
                if done is not None:
                    return done
                # (not launched: no current context, or a guard failed: the checks below decide)
        return self._checked(values)

    def _native_result(self, rc):
        """True (launched: counted), False (a slot misaligned), None (not launched: no
        current context or a guard failed); a CUDA error raises, naming the kernels."""
        if rc == 0:
            n = len(self.steps)
            STATS["direct"] += n
            STATS["driver"] += n
            return True
        if rc == NATIVE_MISALIGNED:
            return False
        if rc > 0:
            names = ", ".join(st[7][8] for st in self.steps)
            raise RuntimeError(f"kgen: launching Triton kernels {names}: CUDA error {rc}")
        return None

    def _checked(self, values) -> bool:
        """Every check in Python, then replay_run (no guards of its own) or the Python loop."""
        if (_state.get("reason") is not None or _hooked(_state["runtime"])
                or current_device() != self.device or _state["knobs"]() != self.knobs):
            return False
        for e in self.entries:
            if not e.globals_unchanged():
                return False
        stream = current_raw_stream(self.device)
        if self.native is not None:
            done = self._native_result(_state["rrun"](self.native, stream, values))
            if done is not None:  # (else no current context: Triton's launchers below make one)
                return done
        bad = 0
        for v in values[:self.n_slots]:
            bad |= v
        if bad & 15:
            return False
        for run, function, metadata, (g0, g1, g2), template, patches, moved, driver in self.steps:
            STATS["direct"] += 1
            if driver is not None:
                call, fn_, block, shared, codes, t, dpatches, dmoved, name = driver
                a = t.copy()
                for k, si, off in dpatches:
                    a[k] = values[si] + off
                for k, vi in dmoved:
                    a[k] = values[vi]
                rc = call(fn_, g0, g1, g2, block, shared, stream, codes, *a)
                if rc == 0:
                    STATS["driver"] += 1
                    continue
                if rc != -1:  # (-1: not launched, no current context: Triton's launcher makes one)
                    raise RuntimeError(f"kgen: launching Triton kernel {name}: CUDA error {rc}")
            a = template.copy()
            for ai, si, off in patches:
                a[ai] = values[si] + off
            for ai, vi in moved:
                a[ai] = values[vi]
            run(g0, g1, g2, stream, function, metadata, None, None, None, *a)
        return True


def clear() -> None:
    """Forget every binary (tests)."""
    _CACHE.clear()
    _FNS.clear()
    _state.clear()
