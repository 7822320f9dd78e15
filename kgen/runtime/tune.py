"""Autotuning: which candidate wins for one (family, device, dtype, shape bucket), measured,
remembered in a table, and read by dispatch.

A key is `family|device|dtype|bucket`: the device by name, compute capability and SM count
(`NVIDIA H100 80GB HBM3|sm_90|132`), the bucket by the family's `tune_bucket` (its shape
classes and specialisations, documented there). An entry holds the winner, every
candidate's median time in microseconds, the shape timed, kgen's version and the date; a
bucket tuned at several shapes (`kgen tune` runs or lists that share it) keeps each shape's
times (`probes`) and a winner chosen over all of them (`bucket_winner`). Candidates are every
variant of the family that runs on the device and `reference`, the family's non-kgen path
(PyTorch), so kgen uses its own kernel only where it wins.

Tables, most trusted first: the user's (`<cache dir>/tuning.json`, written by `kgen tune`
and by online tuning), then the ones kgen ships (`kgen/tuning/*.json`, made by `kgen tune`
on the named GPUs and reviewed like `generated/`). A file that is not a table of this
format is ignored with one warning. Writes take the cache's per-file lock, re-read the file,
merge and replace it atomically, so concurrent tuners never corrupt it.

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
import functools
import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import kgen
from kgen import config
from kgen.runtime.timing import MIN_MEASURE_US, cuda_timer, gpu_part

log = logging.getLogger("kgen")
FORMAT = "kgen-tuning-1"
REFERENCE = "reference"
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tuning"
USER_FILE = "tuning.json"
TIE = 0.02  # candidates within 2 % of the fastest are a tie (see pick)
# ... but two that each take LONG_US or more tie within LONG_TIE only: far past L2 their times
# repeat within ~0.3 % between processes (H100, fused_bias_act float32 8192 x 11008:
# torch.compile 350.8-351.9 us in four processes, one kgen variant 356.0-357.4), so a
# steady 1.5 % (8-byte against 16-byte float32 accesses there) is a difference, not noise;
# shorter calls, partly L2-resident, move up to 5 % between processes (4096 x 4096 fp16)
LONG_US = 100.0
LONG_TIE = 0.005
# host-bound candidates (host time above the GPU time) within 10 % of each other are a tie
# that their GPU times decide (see pick): a shared host's launch times move 10-30 % between
# calls (H100 hosts, BENCHMARKS.md), its GPU times a few %
HOST_TIE = 0.10
NEAR_MARGIN = 0.10  # a nearby bucket's winner carries over only with this margin (transfers)
# ... and only from within this many powers of two, summed over the bucket's classes but
# those the family names in TUNE_FREE_DIMS (rows that every variant tiles alike, beyond
# the tuned ones): a tile chosen for 1000 columns wastes most of its work on 59
# (fused_bias_act 17527 x 59 fp16 on an H200 took 25 us of GPU time with the winner of
# cols <= 1024 against 3.1 for spec order's choice; BENCHMARKS.md, twenty-second session)
NEAR_MAX_DISTANCE = 2
CONFIRM_ROUNDS = 4  # alternating re-timings of a winner against spec order's choice (confirm)


# --------------------------------------------------------------------------- keys


@functools.cache
def device_key(index: int) -> str:
    import torch

    p = torch.cuda.get_device_properties(index)
    return f"{p.name}|sm_{p.major}{p.minor}|{p.multi_processor_count}"


def key(family: str, device: str, dtype: str, bucket: str) -> str:
    return f"{family}|{device}|{dtype}|{bucket}"


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): a shape class."""
    return 1 << max(0, n - 1).bit_length()


# --------------------------------------------------------------------------- tables


def read_table(path: Path) -> dict:
    """The entries of one table file; {} (with one warning) when absent, corrupt or foreign."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn_once(path, f"cannot read it ({e})")
        return {}
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("entries"), dict):
        _warn_once(path, f"not a kgen tuning table of format {FORMAT}")
        return {}
    return {k: v for k, v in raw["entries"].items()
            if isinstance(v, dict) and isinstance(v.get("winner"), str)}


_warned: set = set()


def _warn_once(path: Path, why: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        log.warning("kgen: ignoring tuning table %s: %s", path, why)


def user_path() -> Path:
    return config.cache_dir() / USER_FILE


@functools.cache
def _shipped() -> dict:
    entries: dict = {}
    for f in sorted(SHIPPED_DIR.glob("*.json")):
        entries.update(read_table(f))
    return entries


class _Tables:
    """Entries of the user's table over the shipped ones, read once per process (and again
    after this process records a result)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._merged: dict | None = None

    def entries(self) -> dict:
        if self._merged is None:
            with self._lock:
                if self._merged is None:
                    self._merged = {**_shipped(), **read_table(user_path())}
        return self._merged

    def invalidate(self) -> None:
        self._merged = None


TABLES = _Tables()


def lookup(k: str) -> dict | None:
    return TABLES.entries().get(k)


def choice(k: str, name: str) -> str | None:
    """The option a table holds for choice `name` (see `tune_choices`) in key `k`'s bucket, or
    in the nearest tuned one (`nearest`); None where neither was tuned with that choice."""
    e = lookup(k)
    if e is None:
        near = nearest(k)
        e = near[1] if near else None
    return (e or {}).get("choices", {}).get(name)


def _parts(bucket: str) -> tuple[dict, tuple]:
    """A bucket string's numeric classes (`rows<=1024` -> {"rows": 10.0}, log2) and its
    other parts (flags such as `vec16`), which must match exactly."""
    nums, flags = {}, []
    for part in bucket.split("."):
        name, sep, value = part.partition("<=")
        if sep and value.isdigit():
            nums[name] = math.log2(max(1, int(value)))
        else:
            flags.append(part)
    return nums, tuple(flags)


def _family_attr(family: str, name: str, default):
    """A family module's optional attribute (`default` for none, or a family that does not load)."""
    from kgen.errors import KgenError
    from kgen.families import module_of

    try:
        return getattr(module_of(family), name, default)
    except KgenError:
        return default


def _free_dims(family: str) -> tuple:
    """The family's TUNE_FREE_DIMS (bucket classes a nearby winner carries across at any
    distance), () for none."""
    return tuple(_family_attr(family, "TUNE_FREE_DIMS", ()))


def stand_in(k: str) -> str | None:
    """Key `k` with each bucket flag the family maps in `TUNE_CLASS_FALLBACK` ({flag:
    stand-in}) replaced, None where it maps none: the entry dispatch takes for a bucket
    nobody tuned (fused_bias_act's `vec8` rows take the `tail` entry of the same sizes,
    whose winner runs them at least as fast)."""
    prefix, _, bucket = k.rpartition("|")
    other = ".".join(_stand_in_parts(prefix.partition("|")[0], bucket.split(".")))
    return f"{prefix}|{other}" if other != bucket else None


def _stand_in_parts(family: str, parts) -> tuple:
    mapping = _family_attr(family, "TUNE_CLASS_FALLBACK", {})
    return tuple(mapping.get(p, p) for p in parts)


def nearest(k: str) -> tuple[str, dict] | None:
    """The tuned entry closest to key `k` on the same family, device and dtype: same flags,
    smallest summed distance of the numeric classes in powers of two, at most
    NEAR_MAX_DISTANCE over the classes the family does not name free (`TUNE_FREE_DIMS`).
    How a shape between the tuned ones is served; None when nothing comparable is tuned
    that near. Where nothing of its flags is, those of its `stand_in` are searched."""
    prefix, _, bucket = k.rpartition("|")
    nums, flags = _parts(bucket)
    family = prefix.partition("|")[0]
    free = _free_dims(family)
    for want in dict.fromkeys((flags, _stand_in_parts(family, flags))):  # its own flags, then the stand-in's
        best = None
        for other, entry in TABLES.entries().items():
            o_prefix, _, o_bucket = other.rpartition("|")
            if o_prefix != prefix:
                continue
            o_nums, o_flags = _parts(o_bucket)
            if o_flags != want or o_nums.keys() != nums.keys():
                continue
            d = sum(abs(nums[n] - o_nums[n]) for n in nums)
            bounded = sum(abs(nums[n] - o_nums[n]) for n in nums if n not in free)
            if bounded <= NEAR_MAX_DISTANCE and (best is None or (d, other) < best[0]):
                best = ((d, other), entry)
        if best:
            return best[0][1], best[1]
    return None


def record(entries: dict, path: Path | None = None, replace: bool = False) -> Path:
    """Merge `entries` into the table at `path` (default: the user's) atomically. An entry
    measured at a shape (its "shape") joins the table's entry for the same bucket as one more
    probe where that one was measured at other shapes over the same candidates (`merged`);
    otherwise, or with `replace`, it replaces it."""
    import hashlib

    from kgen.runtime import cache

    path = (path or user_path()).absolute()
    # the lock lives in the cache dir (created 0700), never beside a shipped table
    lock = cache.root() / ".locks" / f"tuning-{hashlib.sha256(str(path).encode()).hexdigest()[:16]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with cache.lock(lock):
        merged = read_table(path)
        for k, e in entries.items():
            merged[k] = e if replace or k not in merged else merged_entry(merged[k], e)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "entries": dict(sorted(merged.items()))}, indent=1) + "\n")
        os.replace(tmp, path)
    TABLES.invalidate()
    return path


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
    k = key(family, device_key(device.index), dtype, fam.tune_bucket(**shape))
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


def _host_bound(n: str, times: dict[str, float], gpu: dict[str, float] | None) -> bool:
    return bool(gpu) and n in gpu and times[n] > gpu[n] * (1 + TIE)


def _margin(ta: float, tb: float) -> float:
    """The relative difference below which two times of GPU-bound candidates tie: LONG_TIE
    where both are LONG_US or more, else TIE."""
    return LONG_TIE if min(ta, tb) >= LONG_US else TIE


def _tie(a: str, b: str, times: dict[str, float], gpu: dict[str, float] | None) -> float:
    """How far apart a's and b's totals may be and still tie: HOST_TIE where the host bounds
    both (its noise), else `_margin`."""
    if _host_bound(a, times, gpu) and _host_bound(b, times, gpu):
        return HOST_TIE
    return _margin(times[a], times[b])


def _by_gpu(a: str, b: str, times: dict[str, float], gpu: dict[str, float] | None) -> bool:
    """Whether a and b are compared by GPU time: both have one and their totals tie (`_tie`)."""
    w = _tie(a, b, times, gpu)
    return bool(gpu) and a in gpu and b in gpu and times[a] <= times[b] * (1 + w) and times[b] <= times[a] * (1 + w)


def beats(a: str, b: str, times: dict[str, float], gpu: dict[str, float] | None = None) -> bool:
    """Whether candidate a wins over b: where their totals tie (`_tie`) and GPU times are
    known, by `_margin` in GPU time; else by `_margin` in total time."""
    t = gpu if _by_gpu(a, b, times, gpu) else times
    return t[a] * (1 + _margin(t[a], t[b])) < t[b]


def transfers(entry: dict) -> bool:
    """Whether a tuned bucket's winner should serve an untuned bucket near it: only when it
    beat the spec-order choice (the first candidate measured) there by NEAR_MARGIN, at every
    shape the bucket was tuned at. Within
    a bucket the fit of a shape to a variant's tile changes (5000 columns in 2048-wide
    tiles waste 19 % where 12288 waste none), so a narrow win does not carry over; measured
    on an H200, carrying every nearby winner over lost up to 25 % at 6000 x 5000."""
    def by_margin(times: dict) -> bool:
        first = next(iter(times), None)
        w = times.get(entry["winner"])
        return first is not None and w is not None and w * (1 + NEAR_MARGIN) <= times[first]

    return all(by_margin(p.get("times_us") or {}) for p in probes(entry))


def _recorded(us: float) -> float:
    """A time as the table records it (ns resolution): the tuner decides on these values,
    so that a table's winners follow from its recorded times exactly (a rule applied to
    unrounded times can fall the other way at a boundary)."""
    return round(us, 3)


def pick(times: dict[str, float], gpu: dict[str, float] | None = None) -> str:
    """The winner: the first candidate in the order measured (spec order, the reference
    last) whose time is within TIE of the fastest (LONG_TIE where both take LONG_US or
    more). Candidates that close are a tie within run-to-run noise (a few % between
    processes, measured on an H100), and a tie goes to the order the spec's author gave, so
    that noise does not flip choices between tables.

    With GPU times (`gpu`, candidate -> GPU part of its time), a host-bound candidate ties
    with a host-bound fastest one within HOST_TIE, and the tied candidates are narrowed
    first to those within TIE of the least GPU time among them: where the host's launch
    time bounds every candidate, the totals tie whatever the kernels cost, and the GPU time
    is what still tells them apart (logmatmul B = 16 on a slow host: every candidate
    ~75 us, the spec-order pick 83.5 us of GPU time against the best one's 56.2;
    BENCHMARKS.md, thirteenth session). Where the GPU time bounds them, it equals the total
    and this changes nothing."""
    f = min(times, key=times.get)
    tied = [n for n, t in times.items() if t <= times[f] * (1 + _tie(n, f, times, gpu))]
    if gpu and all(n in gpu for n in tied):
        least = min(gpu[n] for n in tied)
        tied = [n for n in tied if gpu[n] <= least * (1 + _margin(gpu[n], least))]
    return tied[0]


# --------------------------------------------------------------------------- buckets of several shapes
#
# A bucket spans shapes that fit a variant's tiles differently: fused_bias_act's bucket of
# 513-1024 columns was tuned at 1024, where a 1024-wide Triton tile wins, and served 768,
# where that tile idles a quarter of its lanes (0.90 of the fastest candidate, fp16
# 30000 x 768 on an H200; BENCHMARKS.md, twenty-third session). Tuned at both, the bucket
# takes the candidate that is least far from the best at its worst shape.

CHOICE_FIELDS = ("choices_us", "choices_gpu_us", "choices_confirm_us", "choices_confirm_gpu_us")
PROBE_FIELDS = ("shape", "times_us", "gpu_us", "confirm_us", "confirm_gpu_us", *CHOICE_FIELDS)


def probes(entry: dict) -> list[dict]:
    """An entry's measurements, one per shape tuned in its bucket: the entry's own fields
    (its first shape's), then `entry["probes"]`."""
    return [entry, *entry.get("probes", ())]


def probe_winner(p: dict) -> str:
    """The winner the tuner's rules give one shape's recorded times: `pick`, then `confirm`'s
    paired re-timing against spec order's choice where there is one."""
    times = p["times_us"]
    picked, first, again = pick(times, p.get("gpu_us")), next(iter(times)), p.get("confirm_us")
    if again and picked != first and picked in again and first in again:
        return picked if beats(picked, first, again, p.get("confirm_gpu_us")) else first
    return picked


def _slowdown(n: str, w: str, p: dict) -> float:
    """How many times slower candidate n is than w at one probe, compared as `beats`
    compares them (by GPU time where the host bounds both)."""
    times, gpu = p["times_us"], p.get("gpu_us")
    t = gpu if _by_gpu(n, w, times, gpu) else times
    return t[n] / t[w]


def _worst(ps: list[dict], winners: list[str]) -> dict[str, float]:
    return {n: max(_slowdown(n, w, p) for p, w in zip(ps, winners))
            for n in ps[0]["times_us"] if all(n in p["times_us"] for p in ps)}


def worst_slowdowns(entry: dict) -> dict[str, float]:
    """Per candidate timed at every probe of the entry, in measurement order: its largest
    slowdown (`_slowdown`) against the probe's own winner over the entry's probes."""
    ps = probes(entry)
    return _worst(ps, [probe_winner(p) for p in ps])


def bucket_winner(entry: dict) -> str:
    """The winner of a bucket from its probes: the probes' own winner where they agree (one
    probe: the tuner's rules as ever), else the candidate whose worst slowdown against
    each probe's winner is least, a tie within TIE going to the one measured first."""
    ps = probes(entry)
    winners = [probe_winner(p) for p in ps]
    if len(set(winners)) == 1:
        return winners[0]
    worst = _worst(ps, winners)
    least = min(worst.values())
    # a slowdown's noise is its probe's: LONG_TIE only where every probe's winner is long
    long = all(p["times_us"][w] >= LONG_US for p, w in zip(ps, winners))
    return next(n for n, s in worst.items() if s <= least * (1 + (LONG_TIE if long else TIE)))


def merged_entry(old: dict, new: dict) -> dict:
    """`new` (one shape's entry) joined to `old`, the table's entry for the same bucket: a
    probe more where both name their shapes, `new`'s shape is not among old's (a shape
    re-tuned replaces its probe) and the same candidates were timed; else `new` alone,
    replacing `old` (another spec's candidates, a table from before probes)."""
    if "shape" not in new or any("shape" not in p for p in probes(old)) \
            or set(old.get("times_us", ())) != set(new["times_us"]):
        return new
    kept = [p for p in probes(old) if p["shape"] != new["shape"]]
    if not kept:
        return new
    ps = [{f: p[f] for f in PROBE_FIELDS if f in p} for p in (*kept, new)]
    e = {**ps[0], "probes": ps[1:], "winner": "", "kgen": new["kgen"], "date": new["date"]}
    e["winner"] = bucket_winner(e)
    if any("choices_us" in p for p in probes(e)):
        e["choices"] = bucket_choices(e)
    return e


def probe_choice(p: dict, name: str) -> str:
    """The option one shape's recorded times give choice `name`, as `probe_winner` gives the
    winner: `pick`, then the paired re-timing against the first option where there is one."""
    times, gpu = p["choices_us"][name], p.get("choices_gpu_us", {}).get(name)
    picked, first = pick(times, gpu), next(iter(times))
    again = p.get("choices_confirm_us", {}).get(name)
    if again and picked != first and picked in again and first in again:
        return picked if beats(picked, first, again, p.get("choices_confirm_gpu_us", {}).get(name)) else first
    return picked


def bucket_choices(entry: dict) -> dict[str, str]:
    """Per choice the entry's probes timed (`choices_us`): the option `probe_choice` gives
    where the probes agree, else the one whose worst slowdown against each probe's choice is
    least (a tie within TIE going to the option timed first, the family's default)."""
    ps = [p for p in probes(entry) if "choices_us" in p]
    out = {}
    for name in ps[0]["choices_us"] if ps else ():
        timed = [p for p in ps if name in p["choices_us"]]
        picks = [probe_choice(p, name) for p in timed]
        if len(set(picks)) == 1:
            out[name] = picks[0]
            continue
        ts = [p["choices_us"][name] for p in timed]
        worst = {o: max(t[o] / t[w] for t, w in zip(ts, picks)) for o in ts[0] if all(o in t for t in ts)}
        if not worst:  # no option timed at every probe (one failed to build at some shape)
            out[name] = picks[0]
            continue
        least = min(worst.values())
        out[name] = next(o for o, s in worst.items() if s <= least * (1 + TIE))
    return out


def ranking(entry: dict) -> list[str]:
    """An entry's candidates, best first by their worst slowdown over its probes (one
    probe: by time)."""
    worst = worst_slowdowns(entry)
    return sorted(worst, key=worst.get)


_online_lock = threading.Lock()


def tune_online(family: str, device, dtype: str, shape: dict) -> str | None:
    """KGEN_AUTOTUNE=1: tune this bucket now, record it, and return the winner; None when
    tuning is not allowed here (CUDA graph capture, torch.compile tracing)."""
    import torch

    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return None
    with _online_lock:
        res = tune(family, device, dtype, shape)
        record({res.key: res.entry()})
    log.info("kgen: tuned %s: %s", res.key, res.winner)
    return res.winner


def autotune_enabled() -> bool:
    return os.environ.get("KGEN_AUTOTUNE", "0") not in ("", "0")
