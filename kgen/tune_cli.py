"""`kgen tune SPEC`: measure which candidate wins per shape bucket on this GPU, record it,
print a table; `kgen tune --show` prints what the tables hold for this device."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def parse_shape(text: str, dims: tuple[str, ...]) -> dict:
    """`8192x11008` (the family's TUNE_DIMS in order) or `rows=8192,cols=11008,has_y=0`."""
    if "=" in text:
        out = {}
        for part in text.split(","):
            k, _, v = part.partition("=")
            v = v.strip()
            out[k.strip()] = int(v) if v.lstrip("-").isdigit() else v  # e.g. fused_mlp's widths=13-512-256
        return out
    values = [int(p) for p in text.lower().split("x")]
    if len(values) != len(dims):
        raise ValueError(f"shape {text!r}: expected {'x'.join(dims)}")
    return dict(zip(dims, values))


def shapes_arg(fam, texts) -> list[dict]:
    """`--shapes` as the shapes to tune: each parsed (parse_shape), its dimensions the
    family's (TUNE_DIMS, all given, sizes >= 1) plus the op's variations it knows
    (TUNE_VARIATIONS, e.g. fused_bias_act's has_y; a variation given is kept as given, the
    others added one shape each), and its bucket computable (tune_bucket). ValueError naming
    the shape for anything else, before any kernel is built or timed."""
    variations = tuple(getattr(fam, "TUNE_VARIATIONS", ({},)))
    example = dict(next(iter(getattr(fam, "TUNE_SHAPES", ())), {}))
    known = dict.fromkeys([*fam.TUNE_DIMS, *(k for x in variations for k in x), *example])
    shapes = []
    for text in texts:
        try:
            given = parse_shape(text, fam.TUNE_DIMS)
        except ValueError:
            raise ValueError(f"--shapes {text!r}: expected {'x'.join(fam.TUNE_DIMS)} (integers) or "
                             f"name=value,... with names from {', '.join(known)}") from None
        unknown = [k for k in given if k not in known]
        if unknown:
            raise ValueError(f"--shapes {text!r}: unknown dimension {unknown[0]!r}; this family's: {', '.join(known)}")
        missing = [d for d in fam.TUNE_DIMS if d not in given]
        if missing:
            raise ValueError(f"--shapes {text!r}: missing {', '.join(missing)} (give {', '.join(fam.TUNE_DIMS)})")
        for k, v in given.items():
            like = example.get(k, next((x[k] for x in variations if k in x), None))
            if isinstance(like, bool):  # a flag: 0 / 1
                if v not in (0, 1):
                    raise ValueError(f"--shapes {text!r}: {k} is a flag, 0 or 1; got {v!r}")
                given[k] = bool(v)
            elif isinstance(like, int) or (like is None and k in fam.TUNE_DIMS):
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"--shapes {text!r}: {k} must be a positive integer, got {v!r}")
        for x in variations:
            shape = {**x, **given}
            try:
                fam.tune_bucket(**shape)
            except (TypeError, ValueError) as e:
                raise ValueError(f"--shapes {text!r}: not a shape of this family ({e})") from None
            if shape not in shapes:
                shapes.append(shape)
    return shapes


TF32_MODES = {"on": (True,), "off": (False,), "both": (False, True)}


def jobs(fam, dtypes, shapes, tf32: str | None = None) -> list[tuple[str, dict, bool | None]]:
    """(dtype, shape, TF32 setting to tune under, None: as it is) per bucket to tune.
    `tf32` ("on", "off", "both") applies to float32 where the family's buckets depend on
    the setting (its `bucket_extras`); elsewhere the setting changes no bucket, so each
    shape is tuned once."""
    modes = TF32_MODES[tf32] if tf32 and hasattr(fam, "bucket_extras") else (None,)
    return [(d, s, m) for d in dtypes for s in shapes for m in (modes if d == "float32" else (None,))]


def build_first(console, spec, device, todo) -> dict:
    """Every CUDA candidate that some job's shape can take (the family's variant_fits), built
    in one ninja run before the first timing, nvcc KGEN_JOBS at a time: each tune.tune call
    would otherwise build its dtype's candidates when it reaches them. Says how long it took
    where it compiled anything. Returns dispatch.prebuild's {name: build error}."""
    import time

    from kgen import config
    from kgen.runtime import dispatch

    wanted = {}
    for dtype, shape, _ in todo:
        fits = dispatch.fits_shape(spec.family, shape)
        for v in dispatch.runnable(spec.family, dtype, device, spec=spec):
            if v.backend == "cuda" and (fits is None or fits(v)):
                wanted[v.qualname] = v
    t0 = time.perf_counter()
    failed = dispatch.prebuild(list(wanted.values()))
    took = time.perf_counter() - t0
    if took >= 1.0:
        console.print(f"built {len(wanted)} CUDA candidates in {took:.0f} s ({config.build_jobs()} nvcc at a time)"
                      + (f"; {len(failed)} failed: {', '.join(sorted(failed))}" if failed else ""))
    return failed


def _shape_text(shape: dict | None) -> str:
    return "?" if not shape else ",".join(f"{k}={v}" for k, v in shape.items())


def _fmt_us(us: float | None) -> str:
    return "-" if us is None else (f"{us:.1f}" if us < 1000 else f"{us / 1000:.2f} ms")


def _table(console, title: str, rows: list[tuple[str, dict, str]]):
    """One row per bucket: each candidate's time, the winner and its margin over the
    runner-up. Called once per dtype so that the columns are that dtype's candidates."""
    from rich.table import Table

    names = sorted({n for _, times, _ in rows for n in times}, key=lambda n: (n == "reference", n))
    t = Table(title=title)
    for col in ("bucket", *names, "winner", "margin"):
        t.add_column(col, justify="left" if col in ("bucket", "winner") else "right", overflow="fold")
    for bucket, times, winner in rows:
        ranked = sorted(times.values())
        margin = f"{(ranked[1] / ranked[0] - 1) * 100:.1f} %" if len(ranked) > 1 else "-"
        t.add_row(bucket, *(_fmt_us(times.get(n)) for n in names), winner, margin)
    console.print(t)


def _tables(console, title: str, rows: list[tuple], table=None):
    """`table` (default `_table`) once per distinct first field of `rows` (the dtype, or
    family, dtype and device), given the rest of each of its rows."""
    for group in dict.fromkeys(r[0] for r in rows):
        (table or _table)(console, f"{title}, {group}", [r[1:] for r in rows if r[0] == group])


def _summary_row(e: dict) -> tuple[str, str, float | None, str, str]:
    """One entry as (winner's us, runner-up, its slowdown, candidates, shapes): the winner's
    time at the bucket's first shape, and the candidate the bucket would take without it —
    the next by worst slowdown over its shapes (`tuning_rules.ranking`) — with its worst slowdown ÷
    the winner's (below 1: the two tied and the tuner's rules gave it to the winner). "-"
    (None) where the entry recorded no times (a hand-written one)."""
    from kgen.runtime import tuning_rules

    ps, winner = tuning_rules.probes(e), e["winner"]
    times = e.get("times_us") or {}
    if not all(p.get("times_us") for p in ps) or winner not in times:
        return "-", "-", None, str(len(times) or "-"), str(len(ps))
    worst = tuning_rules.worst_slowdowns(e)  # (tuning_rules.ranking's order)
    runner = min((n for n in worst if n != winner), key=worst.get, default=None)
    slower = worst[runner] / worst[winner] if runner and winner in worst else None
    return _fmt_us(times[winner]), runner or "-", slower, str(len(times)), str(len(ps))


def _summary(console, title: str, rows: list[tuple[str, list[str], dict]]):
    """One row per bucket: (bucket, notes, entry)."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("bucket", "winner", "us", "runner-up", "slower", "candidates", "shapes", "note"):
        t.add_column(col, justify="right" if col in ("us", "slower", "candidates", "shapes") else "left",
                     overflow="fold")
    for bucket, notes, e in rows:
        us, runner, slower, cands, shapes = _summary_row(e)
        if slower is not None and slower < 1:
            notes = ["a tie: spec order or a re-timing chose", *notes]
        t.add_row(bucket, e["winner"], us, runner, "-" if slower is None else f"{slower:.3f}x", cands, shapes,
                  "; ".join(notes))
    console.print(t)


def show(console, family: str | None, dtypes=None, every_time: bool = False, table: Path | None = None) -> int:
    """What the tables hold for this GPU (every device's without one): by default one row a
    bucket (winner, runner-up and its slowdown: readable at any width); `every_time`: every
    candidate's time as columns, as `kgen tune` prints a run. `table`: that file alone (what
    `kgen tune --out` wrote) instead of the tables dispatch reads."""
    import torch

    from kgen.runtime import tuning_rules, tuning_table

    device = tuning_table.device_key(torch.cuda.current_device()) if torch.cuda.is_available() else None
    rows, stale = [], 0
    if table is not None and not table.is_file():
        print(f"kgen tune --show: no table at {table}", file=sys.stderr)
        return 1
    entries = tuning_table.read_table(table) if table is not None else tuning_table.TABLES.entries()
    for k, e in sorted(entries.items()):
        fam, dev_name, sm, sms, dtype, bucket = k.split("|")
        if (family and fam != family) or (device and f"{dev_name}|{sm}|{sms}" != device) \
                or (dtypes and dtype not in dtypes):
            continue
        n = len(tuning_rules.probes(e))
        notes = [f"{n} shapes; times: the first"] if n > 1 and every_time else []
        notes += [f"{name}: {opt}" for name, opt in (e.get("choices") or {}).items()]  # the family's further choices
        if not all("gpu_us" in p for p in tuning_rules.probes(e)):
            notes.append("no host timing: re-tune")
            stale += 1
        rows.append((f"{fam} {dtype}" + ("" if device else f" on {dev_name}"), bucket, notes, e))
    user, shipped = tuning_table.user_path(), tuning_table.SHIPPED_DIR
    where = table if table is not None else f"{user} over {shipped}/*.json"
    print(f"tuning tables: {where}; device: {device or 'all'}")
    if every_time:
        _tables(console, "tuned winners (us)", [(t, b + (f" ({'; '.join(ns)})" if ns else ""), e.get("times_us", {}),
                                                 e["winner"]) for t, b, ns, e in rows])
    else:
        _tables(console, "tuned winners", rows, _summary)
    if stale:
        # entries timed before the tuner measured host cost (GPU time alone): where a call is
        # host-bound they can name a candidate whose launch costs the most (BENCHMARKS.md,
        # twenty-fourth session: linear_logp on the H200, 0.70 of the fastest)
        print(f"{stale} of {len(rows)} entries were timed without the host's launch cost: `kgen tune` them again")
    return 0


def run(args, console) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kgen import spec as spec_mod
    from kgen.families import module_of
    from kgen.runtime import dispatch, tune, tuning_rules, tuning_table

    if args.show:
        family = spec_mod.load(args.spec).family if args.spec else None
        return show(console, family, args.dtype, args.times, Path(args.out) if args.out else None)
    if args.times:
        print("kgen tune: --times goes with --show", file=sys.stderr)
        return 2
    if not args.spec:
        print("kgen tune: give a SPEC (or --show)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("kgen tune: needs a CUDA GPU (it times kernels); `kgen doctor` says what this machine has",
              file=sys.stderr)
        return 1
    spec = spec_mod.load(args.spec)
    fam = module_of(spec.family)
    if not hasattr(fam, "tune_bucket"):
        print(f"kgen tune: family {spec.family} defines no tuning buckets", file=sys.stderr)
        return 1
    dtypes = args.dtype or list(spec.dtypes)
    if set(dtypes) - set(spec.dtypes):
        print(f"kgen tune: {spec.path} has no {', '.join(sorted(set(dtypes) - set(spec.dtypes)))} variants "
              f"(its dtypes: {', '.join(spec.dtypes)})", file=sys.stderr)
        return 2
    try:
        shapes = shapes_arg(fam, args.shapes) if args.shapes else list(fam.TUNE_SHAPES)
    except ValueError as e:
        print(f"kgen tune: {e}", file=sys.stderr)
        return 2
    if args.json:  # checked now, not after the whole run
        try:
            with open(args.json, "a"):
                pass
        except OSError as e:
            print(f"kgen tune: cannot write --json {args.json}: {e.strerror}", file=sys.stderr)
            return 1
    device = torch.device("cuda", torch.cuda.current_device())
    todo = jobs(fam, dtypes, shapes, args.tf32)
    tf32_was = torch.backends.cuda.matmul.allow_tf32
    build_first(console, spec, device, todo)
    results, rows, done = [], [], set()
    out = Path(args.out) if args.out else None  # None: the user's table
    path = out or tuning_table.user_path()
    with Progress(TextColumn("tuning"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("", total=len(todo))
        for dtype, shape, tf32 in todo:
            progress.update(task, description=f"{dtype} {shape}" + ("" if tf32 is None else f" tf32={tf32}"))
            variants = dispatch.runnable(spec.family, dtype, device, spec=spec)
            torch.backends.cuda.matmul.allow_tf32 = tf32_was if tf32 is None else tf32
            try:
                res = tune.tune(spec.family, device, dtype, shape, variants=variants, min_us=args.min_us)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32_was
            results.append((dtype, shape, res))
            rows.append((dtype, res.key.split("|")[-1], res.times, res.winner))
            # recorded as each shape ends (an atomic merge): an interrupted run keeps what it
            # measured; shapes that share a bucket are each one of its probes (tuning_rules.merged_entry)
            path = tuning_table.record({res.key: res.entry()}, out, replace=args.replace and res.key not in done)
            done.add(res.key)
            progress.advance(task)
    _tables(console, f"kgen tune {spec.path} on {tuning_table.device_key(device.index).split('|')[0]} (us)", rows)
    table = tuning_table.read_table(path)
    for k in sorted(done):
        e = table.get(k)
        if e is not None and len(tuning_rules.probes(e)) > 1:
            worst = tuning_rules.worst_slowdowns(e)
            print(f"{k.split('|')[-1]} ({k.split('|')[-2]}): {len(tuning_rules.probes(e))} shapes "
                  f"({', '.join(_shape_text(p.get('shape')) for p in tuning_rules.probes(e))}); winner {e['winner']}, "
                  f"at worst {worst.get(e['winner'], float('nan')):.3f}x a shape's own winner")
        for name, opt in ((e or {}).get("choices") or {}).items():
            timed = ", ".join(f"{o} {t:.1f} us" for o, t in e["choices_us"].get(name, {}).items())
            print(f"{k.split('|')[-1]} ({k.split('|')[-2]}): {name}: {opt} ({timed})")
    print(f"recorded {len(done)} buckets in {path}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"dtype": d, "shape": s, "key": r.key, "times_us": r.times, "gpu_us": r.gpu, "winner": r.winner,
              **r.choices, "errors": r.errors}
             for d, s, r in results], indent=1))
    return 0
