"""Autotuning: which candidate wins for one (family, device, dtype, shape bucket), measured,
for the tables dispatch reads.

An entry (what `Result.entry` makes) holds the winner, every candidate's median time in
microseconds, the shape timed, kgen's version and the date; a bucket tuned at several shapes
(`kgen tune` runs or lists that share it) keeps each shape's times (`probes`) and a winner
chosen over all of them (`bucket_winner`). Candidates are every variant of the family that
runs on the device and `reference`, the family's non-kgen path (PyTorch), so kgen uses its
own kernel only where it wins.

This module measures (`tune`, `tune_online`). The keys and the tables on disk, and what
dispatch reads from them, are kgen.runtime.tuning_table's; the rules that turn recorded
times into winners are kgen.runtime.tuning_rules'.

A family takes part by providing (see `kgen.families.fused_bias_act` for an example):
- `tune_bucket(**shape) -> str`: the bucket of one call's shape (cheap: runs per new shape);
- `TUNE_SHAPES`: default shapes (dicts) for `kgen tune`; `TUNE_DIMS`: their dimension names;
- `tune_inputs(device, dtype, **shape) -> dict`: fresh inputs of that shape;
- `tune_runner(kernel, inputs) -> () -> None`: one launch of a loaded variant (`kernel`,
  or None for `reference`) that writes only into scratch buffers of its own;
- optionally `bucket_extras(dtype) -> dict`: shape keys from the process's state that change
  what a call computes or costs and so belong in its bucket (fused_mlp: float32's TF32
  setting); the tuner adds them to every shape it tunes (`with_extras`), and the family's
  dispatch adds the same keys to its calls' shapes;
- optionally `tune_choices(inputs) -> {choice: {option: () -> None}}`: further ways of running
  a call that the family picks per bucket besides the kernel (fused_mlp: its training
  backward, fused kernels or per-layer GEMMs), the family's default option first. Each
  option is timed as the candidates are; the entry keeps the times (`choices_us`) and the
  winner per choice (`choices`, read through `choice`).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import threading
from dataclasses import dataclass, field

import kgen
from kgen.runtime import tuning_table
from kgen.runtime.timing import MIN_MEASURE_US, cuda_timer, gpu_part

# The tables' and the rules' public names, readable here too (`tune.key`, `tune.record`,
# `tune.pick`, ...) as families, the CLI and family packages made from the scaffold have
# always used them. Code that replaces one (a test's monkeypatch) does so on the module that
# owns it, whose own functions and kgen's call sites read it there.
from kgen.runtime.tuning_rules import (  # noqa: F401,E402
    CHOICE_FIELDS, HOST_TIE, LONG_TIE, LONG_US, NEAR_MARGIN, PROBE_FIELDS, TIE, beats, bucket_choices, bucket_winner,
    merged_entry, pick, probe_choice, probe_winner, probes, ranking, transfers, worst_slowdowns)
from kgen.runtime.tuning_table import (  # noqa: F401,E402
    FORMAT, NEAR_MAX_DISTANCE, REFERENCE, SHIPPED_DIR, TABLES, USER_FILE, choice, device_key, key, lookup, nearest,
    pow2_at_least, read_table, record, stand_in, user_path)

log = logging.getLogger("kgen")
CONFIRM_ROUNDS = 4  # alternating re-timings of a winner against spec order's choice (confirm)


# --------------------------------------------------------------------------- tuning


@dataclass
class Result:
    key: str
    times: dict[str, float]  # candidate -> median us (failed candidates absent)
    winner: str
    errors: dict[str, str] = field(default_factory=dict)
    confirm: dict[str, float] = field(default_factory=dict)  # the re-timing of `confirm`, if any
    gpu: dict[str, float] = field(default_factory=dict)  # candidate -> its GPU time alone, if timed
    confirm_gpu: dict[str, float] = field(default_factory=dict)
    shape: dict | None = None  # the shape timed (with the family's extras)
    choices: dict[str, dict] = field(default_factory=dict)  # time_choices' fields (CHOICE_FIELDS)

    def entry(self) -> dict:
        e = {"winner": self.winner, "times_us": {k: round(v, 3) for k, v in self.times.items()},
             "kgen": kgen.__version__, "date": datetime.date.today().isoformat()}
        if self.shape is not None:
            e["shape"] = dict(self.shape)
        if self.gpu:
            e["gpu_us"] = {k: round(v, 3) for k, v in self.gpu.items()}
        if self.confirm:
            e["confirm_us"] = {k: round(v, 3) for k, v in self.confirm.items()}
        if self.confirm_gpu:
            e["confirm_gpu_us"] = {k: round(v, 3) for k, v in self.confirm_gpu.items()}
        if self.choices:
            e.update(self.choices)
            e["choices"] = bucket_choices(e)
        return e

    def margin(self) -> float:
        """How much slower the runner-up is than the winner (0.05 = 5 %)."""
        t = sorted(self.times.values())
        return t[1] / t[0] - 1 if len(t) > 1 else math.inf


def tune(family: str, device, dtype: str, shape: dict, variants=None, timer=None,
         min_us: float = MIN_MEASURE_US, rounds: int = 3) -> Result:
    """Time every candidate for one shape and return the result (not recorded).

    `variants`: the variants to consider (default: every variant of the family's specs
    that runs on the device); `timer(fn, min_us) -> us`: cuda_timer, or a fake in tests."""
    from kgen.errors import KgenError
    from kgen.families import module_of
    from kgen.runtime import dispatch

    fam = module_of(family)
    if variants is None:
        variants = dispatch.runnable(family, dtype, device)
    shape = with_extras(fam, dtype, shape)
    inputs = fam.tune_inputs(device, dtype, **shape)
    timer = timer or cuda_timer
    fits = dispatch.fits_shape(family, shape)  # (one that cannot take the shape is not even built)
    misfits = {v.name: "does not take the shape" for v in variants if fits is not None and not fits(v)}
    runners, errors = candidate_runners(fam, [v for v in variants if v.name not in misfits], inputs)
    errors.update(misfits)
    times, gpu = time_rounds(runners, timer, min_us, rounds, errors)
    if not times:
        raise KgenError(f"{family}: no candidate ran at {shape} ({errors})")
    winner, again, again_gpu = confirm(times, pick(times, gpu), runners, timer, min_us, gpu=gpu)
    k = tuning_table.key(family, tuning_table.device_key(device.index), dtype, fam.tune_bucket(**shape))
    return Result(k, times, winner, errors, again, gpu, again_gpu, shape,
                  time_choices(fam, inputs, timer, min_us, rounds, errors))


def time_rounds(runners: dict, timer, min_us: float, rounds: int, errors: dict, prefix: str = ""
                ) -> tuple[dict[str, float], dict[str, float]]:
    """(the minimum time per runner, its GPU part: {} where the timer gives none) over
    `rounds` interleaved rounds: clocks drift and other work interferes over seconds, and a
    slow round should not decide between runners a few % apart. A runner that fails is
    dropped from `runners` with its reason in `errors` (under `prefix` + its name)."""
    from kgen.errors import KgenError

    times, gpu = {}, {}
    for _ in range(rounds):
        for name, fn in list(runners.items()):
            try:
                t = timer(fn, min_us)
            except (KgenError, RuntimeError, ValueError) as e:
                errors[prefix + name] = str(e).splitlines()[0]
                del runners[name]
                times.pop(name, None)
                gpu.pop(name, None)
                continue
            _keep_min(times, gpu, name, t)
    if len(gpu) != len(times):
        gpu = {}  # a timer without GPU parts (a fake): totals alone decide
    return times, gpu


def time_choices(fam, inputs: dict, timer, min_us: float, rounds: int, errors: dict) -> dict[str, dict]:
    """The family's `tune_choices` timed as the candidates are (interleaved rounds, the
    minimum; an option other than the first that wins is re-timed against the first,
    `confirm`): {"choices_us": {choice: {option: us}}, "choices_gpu_us": the GPU parts (where
    the timer gives them), "choices_confirm_us" / "choices_confirm_gpu_us": the re-timings},
    each left out where empty. An option that fails is left out with its reason in `errors`
    (`choice:option`)."""
    hook = getattr(fam, "tune_choices", None)
    out = {f: {} for f in CHOICE_FIELDS}
    for name, options in (hook(inputs) if hook is not None else {}).items():
        options = dict(options)
        times, gpu = time_rounds(options, timer, min_us, rounds, errors, f"{name}:")
        if not times:
            continue
        _, again, again_gpu = confirm(times, pick(times, gpu), options, timer, min_us, gpu=gpu)
        for f, d in zip(CHOICE_FIELDS, (times, gpu, again, again_gpu)):
            if d:
                out[f][name] = d
    return {f: d for f, d in out.items() if d}


def candidate_runners(fam, variants, inputs: dict) -> tuple[dict, dict]:
    """({name: one call on `inputs`}, {name: why it cannot run}) for `variants` in order,
    then the reference (REFERENCE): each variant built (the CUDA ones first, together:
    dispatch.prebuild) and loaded, a candidate that cannot take the shape (or fails to
    build) left out with its reason."""
    from kgen.errors import KgenError
    from kgen.runtime import dispatch

    runners, errors = {}, {}
    failed = dispatch.prebuild(variants)  # (the CUDA candidates' nvcc runs in parallel)
    for v in [*variants, None]:
        name = v.name if v is not None else REFERENCE
        if name in failed:
            errors[name] = str(failed[name]).splitlines()[0]
            continue
        try:
            runners[name] = fam.tune_runner(dispatch.load(v) if v is not None else None, inputs)
        except (KgenError, RuntimeError, ValueError) as e:
            errors[name] = str(e).splitlines()[0]
    return runners, errors


def with_extras(fam, dtype: str, shape: dict) -> dict:
    """`shape` with the family's `bucket_extras(dtype)` keys (the process state its bucket
    depends on), where it has any."""
    extras = getattr(fam, "bucket_extras", None)
    return {**shape, **extras(dtype)} if extras is not None else shape


def _keep_min(times: dict, gpu: dict, name: str, t: float) -> None:
    """Fold one timing into the per-candidate minima (as recorded: see _recorded), the
    total and its GPU part each on its own."""
    us, g = _recorded(t), gpu_part(t)
    times[name] = min(times.get(name, us), us)
    if g is not None:
        g = _recorded(g)
        gpu[name] = min(gpu.get(name, g), g)


def confirm(times: dict[str, float], winner: str, runners: dict, timer, min_us: float,
            rounds: int = CONFIRM_ROUNDS, gpu: dict[str, float] | None = None
            ) -> tuple[str, dict[str, float], dict[str, float]]:
    """Re-time a winner that is not spec order's choice (the first candidate measured)
    against that choice, alternating the two, and keep it only if it still wins (`beats`).

    The minimum of many noisy times is biased low (the winner's curse): where candidates
    are really equal - every CUDA variant of a host-bound call runs the same launch path,
    6-14 us a call on an H100 host, around 2-5 us of GPU time - one of ~16 wins by luck,
    by up to 30 % (BENCHMARKS.md, eleventh session). The second, paired measurement has no
    such selection in it. Returns (winner, the re-timed minimum per candidate and its GPU
    part, each {} if not re-timed; the GPU part also {} where the timer gives none)."""
    first = next(iter(times))
    if winner == first or winner not in runners or first not in runners:
        return winner, {}, {}
    again: dict[str, float] = {}
    again_gpu: dict[str, float] = {}
    for _ in range(rounds):
        for name in (first, winner):
            _keep_min(again, again_gpu, name, timer(runners[name], min_us))
    if len(again_gpu) != 2:
        again_gpu = {}
    return (winner if beats(winner, first, again, again_gpu) else first), again, again_gpu


def _recorded(us: float) -> float:
    """A time as the table records it (ns resolution): the tuner decides on these values,
    so that a table's winners follow from its recorded times exactly (a rule applied to
    unrounded times can fall the other way at a boundary)."""
    return round(us, 3)


_online_lock = threading.Lock()


def tune_online(family: str, device, dtype: str, shape: dict) -> str | None:
    """KGEN_AUTOTUNE=1: tune this bucket now, record it, and return the winner; None when
    tuning is not allowed here (CUDA graph capture, torch.compile tracing)."""
    import torch

    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return None
    with _online_lock:
        res = tune(family, device, dtype, shape)
        try:
            tuning_table.record({res.key: res.entry()})
        except OSError as e:  # a read-only cache: the call still runs its winner, untabled
            if res.key not in _session:  # (one warning a key)
                log.warning("kgen: KGEN_AUTOTUNE measured %s for %s but could not record it (%s); "
                            "using it in this process only", res.winner, res.key, e)
            _session[res.key] = res.winner
            return res.winner
    log.info("kgen: tuned %s: %s", res.key, res.winner)
    return res.winner


# winners KGEN_AUTOTUNE measured but could not record (this process's stand-in for the table)
_session: dict[str, str] = {}

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def autotune_enabled() -> bool:
    """KGEN_AUTOTUNE as a switch: 1 / true / yes / on, or 0 / false / no / off / unset (any
    case); anything else is a KgenError (a typo must not turn tuning on, nor silently off)."""
    raw = os.environ.get("KGEN_AUTOTUNE", "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    from kgen.errors import KgenError

    raise KgenError(f"KGEN_AUTOTUNE={raw!r}: expected 1 / true / yes / on or 0 / false / no / off")
