"""The tuner's rules over recorded times (pure functions of a tuning table's entries: no
timing, no I/O): which candidate wins one shape (`pick`, `beats`, with the tie margins
below), which wins a bucket tuned at several shapes (`bucket_winner`, `merged_entry`,
`bucket_choices`), and whether a bucket's winner may serve the buckets near it
(`transfers`). kgen.runtime.tune applies them to fresh timings, kgen.runtime.tuning_table
when it merges an entry into a table, dispatch when it reads one."""

from __future__ import annotations

TIE = 0.02  # candidates within 2 % of the fastest are a tie (see pick)
# ... but two that each take LONG_US or more tie within LONG_TIE only: far past L2 their times
# repeat within ~0.3 % between processes (H100, fused_bias_act float32 8192 x 11008:
# torch.compile 350.8-351.9 us in four processes, one kgen variant 356.0-357.4), so a
# steady 1.5 % (8-byte against 16-byte float32 accesses there) is a difference, not noise;
# shorter calls, partly L2-resident, move up to 5 % between processes (4096 x 4096 fp16)
LONG_US = 100.0
LONG_TIE = 0.005
# a host-bound candidate (host time above the GPU time) within 10 % of another is a tie that
# their GPU times decide (see pick, _tie): a shared host's launch times move 10-30 % between
# calls (H100 hosts, BENCHMARKS.md), its GPU times a few %
HOST_TIE = 0.10
NEAR_MARGIN = 0.10  # a nearby bucket's winner carries over only with this margin (transfers)


def _host_bound(n: str, times: dict[str, float], gpu: dict[str, float] | None) -> bool:
    return bool(gpu) and n in gpu and times[n] > gpu[n] * (1 + TIE)


def _margin(ta: float, tb: float) -> float:
    """The relative difference below which two times of GPU-bound candidates tie: LONG_TIE
    where both are LONG_US or more, else TIE."""
    return LONG_TIE if min(ta, tb) >= LONG_US else TIE


def _tie(a: str, b: str, times: dict[str, float], gpu: dict[str, float] | None) -> float:
    """How far apart a's and b's totals may be and still tie: HOST_TIE where the host bounds
    either (its noise), else `_margin`. Either, not both: a GPU-bound candidate's total is
    its kernel's, and a host-bound one within HOST_TIE of it costs the same in a host-bound
    loop give or take the host's noise, while its kernel is what a captured graph or a busy
    stream runs (float32 logmatmul 64 x 1024 x 1024 on an H200 host: a Triton tile host-bound
    at 22.9 us with 14.0 us of GPU time lost at 2.0 % to one GPU-bound at 22.4, and served
    47 x 848 x 806 at 25.5 us against 13.5; BENCHMARKS.md, sixtieth session)."""
    if _host_bound(a, times, gpu) or _host_bound(b, times, gpu):
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


def pick(times: dict[str, float], gpu: dict[str, float] | None = None) -> str:
    """The winner: the first candidate in the order measured (spec order, the reference
    last) whose time is within TIE of the fastest (LONG_TIE where both take LONG_US or
    more). Candidates that close are a tie within run-to-run noise (a few % between
    processes, measured on an H100), and a tie goes to the order the spec's author gave, so
    that noise does not flip choices between tables.

    With GPU times (`gpu`, candidate -> GPU part of its time), a candidate ties with the
    fastest one within HOST_TIE where the host bounds either of them (`_tie`), and the tied
    candidates are narrowed
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
