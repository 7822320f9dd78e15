"""Dispatch: pick, build (through the cache) and load the variant an op runs.

For one (family, device, dtype, shape bucket), most specific first:
1. `KGEN_VARIANT=<name>` forces one variant (benchmarks, bisecting); `KGEN_BACKEND=
   cuda|triton|reference` one backend.
2. The tuning table (`kgen.runtime.tuning_table`): the measured winner for the bucket on this
   device — a variant, or `reference` when the family's PyTorch path was fastest.
3. With `KGEN_AUTOTUNE=1`, an untuned bucket is tuned on its first call (not while a CUDA
   graph is captured or torch.compile traces); without it, the winner of the nearest tuned
   bucket of the same device and dtype, if it beat spec order's first choice there clearly
   (`tuning_rules.transfers`) and the family's optional `nearby_transfers(shape, bucket, variant)`
   does not veto it for the call's shape.
4. Spec order (nothing tuned for this device and dtype): CUDA variants whose arch runs on
   the device (exact arch before an older minor of the same major), then Triton variants;
   the op falls back to its PyTorch reference when none can be built. A family's optional
   `untuned_order(variants, shape)` reorders or thins that list for the call's shape (an
   empty list: the reference).
Variants come from the family's shipped specs and the user's (KGEN_SPEC_PATH, add_spec).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

from kgen import config
from kgen import spec as spec_mod
from kgen.errors import KgenError, SpecError
from kgen.runtime import build, loader

log = logging.getLogger("kgen")


@functools.cache
def shipped_specs(family: str) -> tuple[spec_mod.Spec, ...]:
    """The specs the family ships (kgen/specs/<family>.yaml for kgen's own), read once."""
    from kgen.families import shipped_spec_paths

    return tuple(spec_mod.load(p) for p in shipped_spec_paths(family))


def shipped_spec(family: str) -> spec_mod.Spec:
    """The family's first (main) shipped spec."""
    return shipped_specs(family)[0]


# --------------------------------------------------------------------------- user specs

_added: list[Path] = []
_warned_missing: set[str] = set()


def add_spec(path) -> spec_mod.Spec:
    """`kgen.add_spec(path)`: a spec file whose variants join their family's shipped ones
    for dispatch, the tuner and KGEN_VARIANT, in this process. Validated now (a SpecError
    names file, line and key); returns the spec."""
    p = Path(path).expanduser().absolute()
    spec = spec_mod.load(p)
    if p not in _added:
        _added.append(p)
    _user_specs.cache_clear()
    return spec


def spec_files() -> list[Path]:
    """Specs from outside the package: `KGEN_SPEC_PATH` (os.pathsep-separated files, or
    folders whose *.yaml are read in name order), then those given to add_spec."""
    files: list[Path] = []
    for part in os.environ.get("KGEN_SPEC_PATH", "").split(os.pathsep):
        if not part:
            continue
        p = Path(part).expanduser()
        if p.is_dir():
            files.extend(sorted(p.glob("*.yaml")))
        elif p.exists():
            files.append(p)
        elif part not in _warned_missing:  # like PATH: a missing entry is skipped, said once
            _warned_missing.add(part)
            log.warning("kgen: KGEN_SPEC_PATH entry %s does not exist; skipped", part)
    files.extend(_added)
    return files


@functools.cache
def _user_specs(files: tuple[Path, ...]) -> tuple[spec_mod.Spec, ...]:
    """The user's specs that load. One that does not (malformed, or of a family that is not
    installed) is skipped with one warning naming it and why: it never breaks the other
    specs, nor the families it is not about (add_spec validates its file when given)."""
    specs = []
    for f in files:
        try:
            specs.append(_load_user_spec(f))
        except KgenError as e:  # (SpecError, or its family failing to load: a plugin that does not import)
            if str(f) not in _warned_broken:
                _warned_broken.add(str(f))
                log.warning("kgen: user spec %s skipped: %s", f, e)
    return tuple(specs)


_warned_broken: set[str] = set()


def _load_user_spec(f: Path) -> spec_mod.Spec:
    """spec_mod.load(f), any failure a KgenError naming the file: a user's spec (or the plugin
    family it is for) failing in a way kgen did not foresee must not break the shipped
    families' listing and dispatch (a malformed plugin SCHEMA raised a KeyError there)."""
    try:
        return spec_mod.load(f)
    except KgenError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a user's spec or plugin raises is that spec's
        raise KgenError(f"{f}: {type(e).__name__}: {e}") from e


def broken_user_specs() -> list[tuple[Path, KgenError]]:
    """The user's spec files (spec_files) that do not load, each with its error: what `kgen
    list` and `kgen doctor` report (dispatch skips them, warning once)."""
    broken = []
    for f in spec_files():
        try:
            _load_user_spec(f)
        except KgenError as e:
            _warned_broken.add(str(f))
            broken.append((f, e))
    return broken


def family_specs(family: str) -> list[spec_mod.Spec]:
    """The family's shipped specs, then the user's specs of that family."""
    return [*shipped_specs(family), *(s for s in _user_specs(tuple(spec_files())) if s.family == family)]


def family_variants(family: str) -> list[spec_mod.Variant]:
    """Every variant of the family, shipped first, each name once: a variant listed in
    several files (same family and name) is the same kernel, and its first listing wins."""
    seen: dict[str, spec_mod.Variant] = {}
    for s in family_specs(family):
        for v in s.variants:
            seen.setdefault(v.name, v)
    return list(seen.values())


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether SASS built for `arch` runs on a device of `capability`."""
    num = arch.removeprefix("sm_")
    if num.endswith("a"):  # arch-specific features (wgmma, setmaxnreg): that exact chip only
        return (int(num[:-2]), int(num[-2])) == capability
    major, minor = int(num[:-1]), int(num[-1])
    return major == capability[0] and minor <= capability[1]


def runnable(family: str, dtype: str, device, spec: spec_mod.Spec | None = None) -> list[spec_mod.Variant]:
    """Every variant of the family (or of `spec`) for dtype that can run on `device`, CUDA
    by arch match first, then Triton: what the tuner measures. Ignores KGEN_VARIANT."""
    import torch

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return _ordered(family, dtype, capability, spec=spec)


def _ordered(family: str, dtype: str, capability: tuple[int, int] | None,
             backend: str | None = None, spec: spec_mod.Spec | None = None) -> list[spec_mod.Variant]:
    variants = [v for v in (spec.variants if spec else family_variants(family)) if v.dtype == dtype]
    cuda = []
    if capability is not None:
        cuda = [v for v in variants if v.backend == "cuda" and arch_runs_on(v.arch, capability)]
        exact = f"sm_{capability[0]}{capability[1]}"
        cuda.sort(key=lambda v: v.arch.rstrip("a") != exact)  # stable: spec order within each group
    triton = [v for v in variants if v.backend == "triton"]
    if backend == "cuda":
        return cuda
    if backend == "triton":
        return triton
    if backend == "reference":
        return []
    return cuda + triton


def _forced(family: str, dtype: str) -> list[spec_mod.Variant] | None:
    """[the variant KGEN_VARIANT names] for this family and dtype; None where it is unset or
    names another family's variant (that family's calls are forced, this one's are not: one
    op can be pinned in a model that calls several); KgenError where it names this family's
    variant of another dtype, or no family's variant at all."""
    forced = os.environ.get("KGEN_VARIANT")
    if not forced:
        return None
    mine = [v for v in family_variants(family) if v.name == forced]
    chosen = [v for v in mine if v.dtype == dtype]
    if chosen:
        return chosen
    if not mine and _other_family_has(forced, family):
        return None
    raise KgenError(f"KGEN_VARIANT={forced} names no {family} variant for {dtype}; "
                    f"`kgen list` shows the names")


def _other_family_has(name: str, family: str) -> bool:
    from kgen.families import FAMILY_NAMES

    for other in FAMILY_NAMES():
        if other != family:
            try:
                if any(v.name == name for v in family_variants(other)):
                    return True
            except KgenError:  # a broken plugin family: not the one named
                continue
    return False


def candidates(family: str, dtype: str, capability: tuple[int, int] | None,
               backend: str | None = None) -> list[spec_mod.Variant]:
    """Variants to try in order. `backend` restricts them to one backend (a family asking
    for a companion, e.g. the Triton kernels a CUDA forward shares its backward with);
    KGEN_VARIANT then applies only when it names a variant of that backend."""
    forced = _forced(family, dtype)
    if forced and (backend is None or forced[0].backend == backend):
        return forced
    return _ordered(family, dtype, capability, backend or forced_backend())


BACKENDS = ("cuda", "triton", "reference")


def forced_backend() -> str | None:
    """KGEN_BACKEND (cuda, triton or reference), or None where unset; KgenError for any
    other value (a typo must not silently turn tuned dispatch into spec order)."""
    backend = os.environ.get("KGEN_BACKEND")
    if not backend:
        return None
    if backend not in BACKENDS:
        raise KgenError(f"KGEN_BACKEND={backend} is not one of {', '.join(BACKENDS)}")
    return backend


def env_problems() -> list[str]:
    """What is wrong with the dispatch environment variables (for `kgen doctor`)."""
    from kgen.runtime import tune

    problems = []
    for check in (forced_backend, tune.autotune_enabled):
        try:
            check()
        except KgenError as e:
            problems.append(str(e))
    forced = os.environ.get("KGEN_VARIANT")
    if forced:  # (an op raises only when its own family's dispatch runs: on a GPU)
        from kgen.families import FAMILY_NAMES

        names = set()
        for family in FAMILY_NAMES():
            try:
                names.update(v.name for v in family_variants(family))
            except KgenError:  # (a family that does not load: reported on its own)
                pass
        if forced not in names:
            problems.append(f"KGEN_VARIANT={forced} names no variant of any family (kgen list shows them)")
    return problems


def load(variant: spec_mod.Variant) -> loader.Kernel:
    """Build (or find in the cache) and load one variant. Raises KgenError on failure, also
    where the cache cannot be written (read-only, full: the OSError's words), so that the
    callers' fallbacks (the next variant, the family's reference) apply."""
    try:
        if variant.backend == "cuda":
            (result,) = build.build_cuda([variant])
            if result.error:
                raise result.error
            return loader.load_cuda(variant, result.entry)
        return loader.load_triton(variant, build.triton_source_entry(variant))
    except OSError as e:
        raise KgenError(f"{variant.qualname}: the cache at {config.cache_dir()} cannot be used: "
                        f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}") from e


def prebuild(variants) -> dict[str, Exception]:
    """Build the CUDA variants among `variants` (None entries skipped) in one ninja run,
    nvcc KGEN_JOBS at a time, before callers `load` them one by one (each load would build
    its variant alone, one nvcc after another: a tuner's or verifier's first pass over a
    family's candidates on a fresh cache). Returns {name: its CompileError} for those that
    failed to build (loading one would build it again); {} where nvcc or ninja is missing
    (each load then says so)."""
    from kgen.errors import KgenError

    cuda = [v for v in variants if v is not None and v.backend == "cuda"]
    if len(cuda) < 2:
        return {}
    try:
        results = build.build_cuda(cuda)
    except KgenError:
        return {}
    return {r.variant.name: r.error for r in results if r.error is not None}


def fits_shape(family: str, shape: dict | None):
    """The family's optional `variant_fits(variant, shape) -> bool` bound to `shape` (a
    variant built for some shapes only, e.g. fused_mlp's exact widths), or None."""
    if shape is None:
        return None
    from kgen.families import module_of

    fits = getattr(module_of(family), "variant_fits", None)
    return (lambda v: fits(v, shape)) if fits is not None else None


def select(family: str, device, dtype: str, backend: str | None = None,
           shape: dict | None = None) -> loader.Kernel | None:
    """The first candidate for (device, dtype) that builds and loads (and, given the call's
    `shape`, that the family's `variant_fits` accepts); None means "use the reference".
    Each failure is logged once with its reason, then the next is tried."""
    fitting = _fitting(family, device, dtype, shape, backend)
    kernel = _first_loadable(fitting)
    forced = os.environ.get("KGEN_VARIANT")
    if kernel is None and _forced(family, dtype):
        if not fitting:
            raise KgenError(f"KGEN_VARIANT={forced} does not take this call ({family} {dtype}, {shape}); "
                            "unset it or name a variant that does")
        raise KgenError(f"KGEN_VARIANT={forced} could not be built or loaded (the log above says why)")
    return kernel


def _fitting(family: str, device, dtype: str, shape: dict | None, backend: str | None = None) -> list:
    """`candidates` for `device` that the family's `variant_fits` accepts for `shape`."""
    import torch

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    fits = fits_shape(family, shape)
    return [v for v in candidates(family, dtype, capability, backend) if fits is None or fits(v)]


def _first_loadable(variants) -> loader.Kernel | None:
    """The first of `variants` that builds and loads; each failure logged with its reason."""
    for v in variants:
        try:
            return load(v)
        except KgenError as e:
            log.warning("kgen: %s unavailable, trying the next variant: %s", v.qualname,
                        str(e).splitlines()[0])
    return None


def _untuned(family: str, device, dtype: str, shape: dict):
    """Spec order's step through the family's optional `untuned_order(variants, shape) ->
    variants`: the variants that fit `shape`, in spec order, reordered or thinned for a shape
    nothing was tuned for (an empty list: the reference). (kernel, why), or None where the
    family has no such rule."""
    from kgen.families import module_of

    order = getattr(module_of(family), "untuned_order", None)
    if order is None or shape is None:
        return None
    chosen = order(_fitting(family, device, dtype, shape), shape)
    if not chosen:
        return None, "untuned rule"
    kernel = _first_loadable(chosen)
    return kernel, "untuned rule" if kernel is not None else "fallback"


def triton_companion(family: str, kernel: loader.Kernel, purpose: str) -> loader.Kernel:
    """The Triton variant that works beside a CUDA variant (for the inputs or the kernels it
    lacks): spec order's first for the current device and the variant's dtype. Raises
    RuntimeError, naming `purpose`, when none can be built."""
    import torch

    companion = select(family, torch.device("cuda", torch.cuda.current_device()), kernel.variant.dtype,
                       backend="triton")
    if companion is None:
        raise RuntimeError(f"{family}: no Triton variant for {kernel.variant.dtype} could be built "
                           f"to {purpose} of {kernel.name}")
    return companion


def choose(family: str, device, dtype: str, bucket: str, shape: dict | None = None):
    """The loaded variant an op runs for one shape bucket (None: the family's reference),
    and why: "forced", "tuned", "autotuned", "tuned as <bucket>" (the family's stand-in
    class of the same sizes, tuning_table.stand_in), "tuned nearby (<bucket>)" (the closest tuned
    bucket of the same device and dtype, where its winner clearly beat spec order), "spec
    order", "untuned rule" (the family's `untuned_order`, in spec order's stead) or
    "fallback" (those three followed by " (the tuned winner ... vetoed for the shape)" where
    the family's `tuned_transfers` refused the bucket's winner for `shape`: `_tuned_ok`);
    ", runner-up (...)" appended where the winner cannot take `shape` (the
    call's dimensions, which also let KGEN_AUTOTUNE tune an untuned bucket on the spot) and
    the same entry's next-best can (`_runner_up`)."""
    if device.type != "cuda":
        return None, "fallback"
    if forced_backend() or _forced(family, dtype):
        return select(family, device, dtype, shape=shape), "forced"
    from kgen.runtime import tune, tuning_rules, tuning_table

    k = tuning_table.key(family, tuning_table.device_key(device.index), dtype, bucket)
    entry = tuning_table.lookup(k)
    winner, why = (entry["winner"], "tuned") if entry else (None, None)
    if winner is None and k in tune._session:  # autotuned earlier, not recorded (read-only cache)
        winner, why = tune._session[k], "autotuned"
    elif winner is None and shape is not None and tune.autotune_enabled():
        winner, why = tune.tune_online(family, device, dtype, shape), "autotuned"
        entry = tuning_table.lookup(k)
    if winner is None and (sk := tuning_table.stand_in(k)) and (entry := tuning_table.lookup(sk)):
        winner, why = entry["winner"], f"tuned as {sk.rpartition('|')[2]}"
    vetoed = None
    if winner is not None and not _tuned_ok(family, device, dtype, shape, entry):
        vetoed, winner, entry = winner, None, None  # (not the nearest bucket's either: that is this one)
    if winner is None and vetoed is None:
        near = tuning_table.nearest(k)
        if near is not None and tuning_rules.transfers(near[1]) and _nearby_ok(family, device, dtype, shape, near):
            entry = near[1]
            winner, why = entry["winner"], f"tuned nearby ({near[0].rpartition('|')[2]})"
    fits = fits_shape(family, shape)
    if winner not in (None, tuning_table.REFERENCE):
        known = {v.name: v for v in reversed(runnable(family, dtype, device))}  # a name's first listing
        if fits is not None and entry is not None:
            winner, why = _runner_up(entry, winner, why, known, fits)
    if winner == tuning_table.REFERENCE:
        return None, why
    if winner is not None:
        v = known.get(winner)
        if v is None:
            log.warning("kgen: the tuned winner %s for %s %s [%s] is not a variant of the specs dispatch "
                        "knows; put its spec on KGEN_SPEC_PATH (or kgen.add_spec). Using spec order.",
                        winner, family, dtype, bucket)
        elif fits is not None and not fits(v):  # no candidate of its entry takes the shape either
            log.info("kgen: the tuned winner %s for %s %s [%s] does not take %s; using spec order.",
                     winner, family, dtype, bucket, shape)
        else:
            try:
                return load(v), why
            except KgenError as e:
                log.warning("kgen: tuned winner %s unavailable, using spec order: %s", winner,
                            str(e).splitlines()[0])
    by_rule = _untuned(family, device, dtype, shape)
    if by_rule is None:
        kernel = select(family, device, dtype, shape=shape)
        by_rule = kernel, "spec order" if kernel is not None else "fallback"
    if vetoed is not None:
        return by_rule[0], f"{by_rule[1]} (the tuned winner {vetoed} vetoed for the shape)"
    return by_rule


def _tuned_ok(family: str, device, dtype: str, shape: dict | None, entry: dict) -> bool:
    """Whether the winner of the call's own tuned bucket (`entry`) may serve `shape`: the
    family's optional `tuned_transfers(shape, probes, variant) -> bool` (probes: the shapes
    the entry was measured at; variant: the winner's, None for the reference or a name no spec
    dispatch knows) vetoes it where the family knows the winner fails at this shape though it
    won at the probes, e.g. logmatmul's wide tl.dot tiles at an odd K tuned at an even one
    (3x the 16-row tile's time). A veto leaves the call to `untuned_order` and spec order."""
    from kgen.families import module_of
    from kgen.runtime import tuning_rules

    hook = getattr(module_of(family), "tuned_transfers", None)
    if hook is None or shape is None:
        return True
    # (probe shapes without every dimension the call has: a hand-written entry's, which the
    # family's rule cannot compare; the rule sees only those it can read)
    shapes = [p["shape"] for p in tuning_rules.probes(entry) if p.get("shape") and set(shape) <= set(p["shape"])]
    return bool(hook(shape, shapes, _runnable_named(family, dtype, device, entry["winner"])))


def _runnable_named(family: str, dtype: str, device, name: str):
    """The runnable variant called `name` (None: the reference, or a name no spec has)."""
    return next((v for v in runnable(family, dtype, device) if v.name == name), None)


def _nearby_ok(family: str, device, dtype: str, shape: dict | None, near: tuple[str, dict]) -> bool:
    """Whether the nearby bucket's winner may serve `shape`: the family's optional
    `nearby_transfers(shape, bucket, variant) -> bool` (variant: the winner's, None for the
    reference or a name no spec dispatch knows) vetoes carrying it where the family knows a
    better rule, e.g. a tile much wider than the call (a veto leaves the shape to the family's
    `untuned_order` and spec order)."""
    from kgen.families import module_of

    hook = getattr(module_of(family), "nearby_transfers", None)
    if hook is None or shape is None:
        return True
    variant = _runnable_named(family, dtype, device, near[1]["winner"])
    return bool(hook(shape, near[0].rpartition("|")[2], variant))


def _runner_up(entry: dict, winner: str, why: str, known: dict, fits):
    """(winner, why) where the bucket's winner takes the call's shape; else the candidate of
    the same entry with the least worst slowdown there (`tuning_rules.worst_slowdowns`) that does, and
    a `why` that says so. A variant built for part of a bucket's range (linear_logp's gemv
    kernel: N <= 16) would otherwise be handed shapes it cannot take, e.g. N = 24 through the
    nearby N <= 16 bucket."""
    from kgen.runtime import tuning_rules, tuning_table

    if winner not in known or fits(known[winner]) or not all(p.get("times_us") for p in tuning_rules.probes(entry)):
        return winner, why  # (an entry without times names no runner-up: spec order serves)
    for name, _ in sorted(tuning_rules.worst_slowdowns(entry).items(), key=lambda kv: kv[1]):
        if name == tuning_table.REFERENCE or (name in known and fits(known[name])):
            return name, f"{why}, runner-up ({winner} does not take the shape)"
    return winner, why


def choose_logged(family: str, device, dtype: str, bucket: str, shape: dict | None = None):
    """`choose`, and with KGEN_LOG=dispatch one line on stderr naming the choice, the spec
    file it came from and why (each family caches the result per bucket, so once each)."""
    kernel, why = choose(family, device, dtype, bucket, shape)
    log_choice(family, device, dtype, bucket, kernel, why)
    return kernel, why


def holds_for_bucket(why: str) -> bool:
    """Whether `choose`'s result (its `why`) holds for every shape of the bucket, so that an op
    may memoise it per bucket: a tuned bucket's winner ("tuned", "autotuned", "tuned as ...")
    does; the untuned rule's (the family's `untuned_order` sees the exact shape), a nearby
    bucket's winner (vetoed per shape), spec order's (a variant's fit) and a runner-up's (the
    winner did not take the shape) are the shape's own: memoised per bucket, the first shape a
    process sees there would decide for the rest."""
    return (why in ("tuned", "autotuned") or why.startswith("tuned as ")) and "runner-up" not in why


_logged: set = set()


def log_choice(family: str, device, dtype: str, bucket: str, kernel, why: str) -> None:
    if "dispatch" not in config.log_topics():
        return
    key = (family, str(device), dtype, bucket)
    if key in _logged:
        return
    _logged.add(key)
    if kernel is None:
        what = "the PyTorch reference"
    else:
        v = kernel.variant
        what = f"{v.name} (from {v.spec_path}:{v.line})"
    print(f"kgen dispatch: {family} {device} {dtype} [{bucket}] -> {what}; {why}", file=sys.stderr, flush=True)
