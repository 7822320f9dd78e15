"""Tuning tables: the keys, the tables on disk and what dispatch reads from them.

A key is `family|device|dtype|bucket`: the device by name, compute capability and SM count
(`NVIDIA H100 80GB HBM3|sm_90|132`), the bucket by the family's `tune_bucket`. Tables, most
trusted first: the user's (`<cache dir>/tuning.json`, written by `kgen tune` and by online
tuning), then the ones kgen ships (`kgen/tuning/*.json`, made by `kgen tune` on the named
GPUs and reviewed like `generated/`). A file that is not a table of this format is ignored
with one warning. Writes take the cache's per-file lock, re-read the file, merge
(tuning_rules.merged_entry) and replace it atomically, so concurrent tuners never corrupt
it. Entries are read once per process (`TABLES`) and again after this process records one.
What an entry holds, and how it is measured: kgen.runtime.tune."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import threading
import time
from pathlib import Path

from kgen import config
from kgen.runtime.tuning_rules import merged_entry

log = logging.getLogger("kgen")
FORMAT = "kgen-tuning-1"
REFERENCE = "reference"
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tuning"
USER_FILE = "tuning.json"
# A nearby bucket's winner carries over (see tuning_rules.transfers) only from within this
# many powers of two, summed over the bucket's classes but those the family names in
# TUNE_FREE_DIMS (rows that every variant tiles alike, beyond the tuned ones): a tile chosen for 1000 columns wastes most of its work on 59
# (fused_bias_act 17527 x 59 fp16 on an H200 took 25 us of GPU time with the winner of
# cols <= 1024 against 3.1 for spec order's choice; BENCHMARKS.md, twenty-second session)
NEAR_MAX_DISTANCE = 2


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


class UnreadableTable(Exception):
    """A table file that exists but is not one kgen can read (why: the message); `io`: it
    could not be read at all (a directory, no permission), not read and found wrong."""

    def __init__(self, why: str, io: bool = False):
        super().__init__(why)
        self.io = io


def read_table(path: Path) -> dict:
    """The entries of one table file; {} (with one warning) when absent, corrupt or foreign.
    Entries that are not well formed (entry_problem) are dropped, with one warning a file."""
    try:
        raw = _read_raw(path)
    except FileNotFoundError:
        return {}
    except UnreadableTable as e:
        _warn_once(path, str(e))
        return {}
    entries, dropped = {}, []
    for k, v in raw.items():
        why = entry_problem(k, v)
        if why is None:
            entries[k] = v
        else:
            dropped.append(f"{k!r}: {why}")
    if dropped:
        _warn_once(path, f"{len(dropped)} malformed entr{'y' if len(dropped) == 1 else 'ies'} left out "
                         f"(first: {dropped[0]})", what="entries of")
    return entries


def _read_raw(path: Path) -> dict:
    """A table file's entries as stored, raising FileNotFoundError or UnreadableTable
    instead of warning (record() neither replaces a table it could not read nor drops the
    entries that read_table leaves out)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UnreadableTable(f"cannot read it ({type(e).__name__}: {e})", io=True) from None
    except (ValueError, RecursionError) as e:  # (RecursionError: JSON nested past the stack)
        raise UnreadableTable(f"cannot read it ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("entries"), dict):
        raise UnreadableTable(f"not a kgen tuning table of format {FORMAT}")
    return raw["entries"]


_TIMES = ("times_us", "gpu_us", "confirm_us", "confirm_gpu_us")
_CHOICE_TIMES = ("choices_us", "choices_gpu_us", "choices_confirm_us", "choices_confirm_gpu_us")


def entry_problem(k, v) -> str | None:
    """Why table entry `k: v` is not one dispatch and `kgen tune --show` can use, or None: a
    key of six `|` fields (family, device name, sm_XY, SM count, dtype, bucket with numeric
    classes in ASCII digits), a winner, and any time fields of the shapes `kgen tune` writes
    (candidate -> a positive finite float; choices: choice -> option -> one), probes a list
    of such measurements, shapes of non-negative ints (and the op's flags: bools, strings)."""
    if not isinstance(k, str) or len(k.split("|")) != 6:
        return "key is not family|device|sm_XY|SMs|dtype|bucket"
    for part in k.split("|")[5].split("."):
        name, sep, value = part.partition("<=")
        if sep and not (value.isascii() and value.isdigit()):
            return f"bucket class {part!r} is not a number"
    if not isinstance(v, dict):
        return "not an object"
    if not isinstance(v.get("winner"), str) or not v["winner"]:
        return "no winner"
    if "choices" in v and not _str_map(v["choices"]):
        return "choices is not a map of names"
    probes = v.get("probes", [])
    if not isinstance(probes, list):
        return "probes is not a list"
    for p in [v, *probes]:
        if not isinstance(p, dict):
            return "a probe is not an object"
        if ("times_us" in p or p is not v) and not (_times(p.get("times_us")) and p["times_us"]):
            return "times_us not candidate -> positive time"  # (an entry may hold none: a hand-written one)
        if any(f in p and not _times(p[f]) for f in _TIMES):
            return "a time field is not candidate -> positive time"
        if any(f in p and not (isinstance(p[f], dict) and all(isinstance(n, str) and _times(t) and t
                                                               for n, t in p[f].items())) for f in _CHOICE_TIMES):
            return "a choices time field is not choice -> option -> positive time"
        shape = p.get("shape", {})
        if not (isinstance(shape, dict) and all(isinstance(n, str) and (type(x) is int and x >= 0 or
                                                                          type(x) in (bool, str))
                                                 for n, x in shape.items())):
            return "shape is not dimension -> size (or flag)"
    timed = [set(p["times_us"]) for p in [v, *probes] if "times_us" in p]
    if len(timed) > 1 and not set.intersection(*timed):  # (merging a new measurement compares them)
        return "no candidate was timed at every probe"
    return None


# a recorded time above this (µs: 30 years) is no measurement; it also bounds an integer one, which
# compares below math.inf at any size and then overflows a float division (10**400)
MAX_US = 1e15


def _times(t) -> bool:
    return isinstance(t, dict) and all(isinstance(n, str) and type(x) in (int, float) and 0 < x < MAX_US
                                       for n, x in t.items())


def _str_map(m) -> bool:
    return isinstance(m, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in m.items())


_warned: set = set()


def _warn_once(path: Path, why: str, what: str = "tuning table") -> None:
    if (str(path), what) not in _warned:
        _warned.add((str(path), what))
        log.warning("kgen: ignoring %s %s: %s", what, path, why)


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
        merged = self._merged  # (read once: invalidate() may clear it from another thread)
        if merged is None:
            with self._lock:
                merged = self._merged
                if merged is None:
                    merged = self._merged = {**_shipped(), **read_table(user_path())}
        return merged

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
    stand-in}) replaced (dropped where the stand-in is ""), None where it maps none: the
    entry dispatch takes for a bucket nobody tuned (fused_bias_act's `vec8` rows take the
    `tail` entry of the same sizes, whose winner runs them at least as fast; fused_mlp's
    `padded` weights the entry of the same call with dense ones)."""
    prefix, _, bucket = k.rpartition("|")
    other = ".".join(_stand_in_parts(prefix.partition("|")[0], bucket.split(".")))
    return f"{prefix}|{other}" if other != bucket else None


def _stand_in_parts(family: str, parts) -> tuple:
    mapping = _family_attr(family, "TUNE_CLASS_FALLBACK", {})
    return tuple(q for q in (mapping.get(p, p) for p in parts) if q)


def nearest(k: str) -> tuple[str, dict] | None:
    """The tuned entry closest to key `k` on the same family, device and dtype: same flags,
    smallest summed distance of the numeric classes in powers of two, at most
    NEAR_MAX_DISTANCE over the classes the family does not name free (`TUNE_FREE_DIMS`).
    How a shape between the tuned ones is served; None when nothing comparable is tuned
    that near. The entries of its `stand_in`'s flags are searched too, and serve where one
    is strictly closer than any of its own flags (fused_mlp's padded buckets tuned at
    B = 512-4096 only: B = 32768 takes the dense B <= 16384 winner, not the padded B <= 4096
    one, a kernel 1.7x slower there)."""
    prefix, _, bucket = k.rpartition("|")
    nums, flags = _parts(bucket)
    family = prefix.partition("|")[0]
    free = _free_dims(family)
    found = []
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
            found.append(best)
    if not found:
        return None
    best = found[0] if len(found) == 1 or found[0][0][0] <= found[1][0][0] else found[1]
    return best[0][1], best[1]


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
        try:
            merged = _read_raw(path)
        except FileNotFoundError:
            merged = {}
        except UnreadableTable as e:  # keep what it held: moved aside, never overwritten
            if e.io:  # (a directory, a file kgen may not read: not kgen's to move)
                raise OSError(f"cannot record into the tuning table {path}: {e}") from None
            stamp = f"{path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}"
            aside = next(p for n in itertools.count() if not (p := path.with_name(f"{stamp}-{n}")).exists())
            os.replace(path, aside)  # (under the lock: no other kgen process picks the same name)
            log.warning("kgen: tuning table %s %s; moved it to %s and started a new one", path,
                        str(e).replace("cannot read it", "could not be read"), aside)
            merged = {}
        for k, e in entries.items():
            old = merged.get(k)
            merged[k] = e if replace or old is None or entry_problem(k, old) else merged_entry(old, e)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"format": FORMAT, "entries": dict(sorted(merged.items()))}, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, f"cannot write the tuning table {path}: {e.strerror}") from None
    TABLES.invalidate()
    return path
