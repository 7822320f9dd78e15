"""The `kgen` command: build, list, diff, verify, bench, cache, doctor, tune, new-family."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

from kgen.errors import KgenError, SpecError

SHIPPED = Path(__file__).resolve().parent / "specs"


def shipped_specs() -> list[Path]:
    return sorted(SHIPPED.glob("*.yaml"))


def _console():
    import shutil

    from rich.console import Console

    # Not a terminal (CI logs, pipes): a fixed wide layout instead of wrapping at 80 columns.
    return Console(highlight=False, width=None if sys.stdout.isatty() else max(160, shutil.get_terminal_size().columns))


def _load(path: str):
    from kgen import spec

    return spec.load(path)


def _select(spec, names: list[str] | None, given: str):
    """The variants `names` picks (a name given twice: once), or KeyError naming the spec as
    the user gave it (`given`: a shipped spec's package-relative name is not a path from
    wherever the user runs kgen)."""
    if not names:
        return list(spec.variants)
    known = {v.name: v for v in spec.variants}
    for n in names:
        if n not in known:
            raise KeyError(f"{given} has no variant {n!r}; `kgen list {given}` lists them")
    return [known[n] for n in dict.fromkeys(names)]


# --------------------------------------------------------------------------- render helpers


def _render_all(specs) -> dict[str, str]:
    from kgen.render import render

    files = {}
    for s in specs:
        for v in s.variants:
            r = render(v)
            files[r.filename] = r.text
    return files


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _write_if_different(path: Path, text: str) -> bool:
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return True


def _without_shipped(files: dict[str, str], family: str) -> dict[str, str]:
    """A spec of yours's rendered files less those of variants the family's shipped specs
    have too: those files are theirs (the same kernel; only the header's spec line differs)."""
    from kgen import spec as spec_mod
    from kgen.families import shipped_spec_paths

    theirs = {f"{v.family}/{v.name}" for p in shipped_spec_paths(family) for v in spec_mod.load(p).variants}
    return {name: text for name, text in files.items() if name.rsplit(".", 1)[0] not in theirs}


def _write_generated(spec, spec_file: str, out: Path) -> int:
    """Render a spec into out/<family>/. Where it is one of the family's shipped specs, the
    folder is theirs: files of variants none of them has any more are removed. A spec of
    yours only adds its files (the shipped variants' stay)."""
    from kgen import spec as spec_mod
    from kgen.families import shipped_spec_paths

    files = _render_all([spec])
    shipped = [p.resolve() for p in shipped_spec_paths(spec.family)]
    if Path(spec_file).resolve() not in shipped:
        files = _without_shipped(files, spec.family)
        return sum(_write_if_different(out / name, text) for name, text in files.items())
    changed = sum(_write_if_different(out / name, text) for name, text in files.items())

    owned = set(files) if len(shipped) == 1 else set(_render_all([spec_mod.load(p) for p in shipped]))
    for stale in (out / spec.family).glob("*"):
        if stale.is_file() and f"{spec.family}/{stale.name}" not in owned:
            stale.unlink()
            changed += 1
    return changed


# --------------------------------------------------------------------------- commands


def cmd_build(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from kgen.runtime import build as build_mod

    spec = _load(args.spec)
    variants = _select(spec, args.variants, args.spec)
    if args.arch:
        kept = [v for v in variants if v.backend == "triton" or v.arch == args.arch]
        if args.variants and len(kept) < len(variants):  # (named, then dropped: an empty table said nothing)
            names = ", ".join(v.name for v in variants if v not in kept)
            print(f"kgen: --arch {args.arch} leaves out {names} (another arch's CUDA variants)", file=sys.stderr)
            if not kept:
                return 2
        variants = kept
    out = Path(args.out)
    changed = _write_generated(spec, args.spec, out)
    console = _console()
    print(f"rendered {_count(len(spec.variants), 'variant')} of {spec.path} into {out}/{spec.family}/ "
          f"({changed} files changed)", flush=True)
    if args.no_compile:
        return 0
    triton_arch = args.arch or _local_arch() or build_mod.DEFAULT_TRITON_ARCH
    with Progress(TextColumn("building"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("", total=len(variants))

        def step(name: str):
            progress.update(task, advance=1, description=name)

        results = build_mod.build(variants, triton_arch=triton_arch, on_progress=step)
    table = Table(title=f"kgen build {spec.path}")
    for col in ("variant", "backend", "arch", "status", "regs", "smem B", "spill B", "stack B", "build"):
        table.add_column(col, justify="right" if col in ("regs", "smem B", "spill B", "stack B", "build") else "left")
    failed = []
    for r in results:
        s = r.summary()
        when = "cached" if r.status == "cached" else f"{r.seconds:.1f} s"
        table.add_row(r.variant.name, r.variant.backend, r.target or "-", r.status,
                      str(s.get("registers", "-")), str(s.get("shared", "-")), str(s.get("spill", "-")),
                      str(s.get("stack", "-")), when if r.status != "failed" else "-")
        if r.status == "failed":
            failed.append(r)
    console.print(table)
    skipped = [r for r in results if r.status == "skipped"]
    for backend in ("cuda", "triton"):
        some = [r for r in skipped if r.variant.backend == backend]
        if some:
            print(f"{len(some)} {backend} variants not compiled: {some[0].error}", file=sys.stderr)
    for r in failed:
        print(f"\n{r.error}", file=sys.stderr)
    return 1 if failed else 0


def _local_arch() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:  # noqa: BLE001 - no usable GPU means "use the default target"
        pass
    return None


def cmd_list(args) -> int:
    """With SPECs: their variants. Without: every family (kgen's own and plugins), the
    variants dispatch and the tuner consider — the shipped specs' and those of specs on
    KGEN_SPEC_PATH — each with the spec file it came from."""
    if args.specs:
        for p in args.specs:
            s = _load(p)
            print(f"{s.path}  ({s.family}, {len(s.variants)} variants)")
            for v in s.variants:
                print(f"  {v.name:40s} {v.backend:7s} {v.arch or '-':7s} {v.dtype}")
        return 0
    from kgen.families import FAMILY_NAMES, origin
    from kgen.runtime import dispatch

    status = 0
    for path, err in dispatch.broken_user_specs():  # skipped by dispatch: said here, with exit 1
        print(f"kgen list: user spec {path} skipped: {err}", file=sys.stderr)
        status = 1
    for family in FAMILY_NAMES():
        try:
            variants = dispatch.family_variants(family)
        except KgenError as e:
            print(f"{family}: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"{family}  ({origin(family)}, {len(variants)} variants)")
        for v in variants:
            print(f"  {v.name:40s} {v.backend:7s} {v.arch or '-':7s} {v.dtype:9s} {v.spec_path}:{v.line}")
    return status


def cmd_diff(args) -> int:
    if args.variants:
        if len(args.specs) != 1 or len(args.variants) != 2:
            print("kgen diff: --variants takes one SPEC and two variant names", file=sys.stderr)
            return 2
        from kgen.render import render

        s = _load(args.specs[0])
        a, b = (render(s.variant(n)) for n in args.variants)
        sys.stdout.writelines(difflib.unified_diff(a.text.splitlines(True), b.text.splitlines(True),
                                                   a.filename, b.filename))
        return 0
    from kgen.families import shipped_spec_paths

    paths = args.specs or [str(p) for p in shipped_specs()]
    specs = [_load(p) for p in paths]
    given = {Path(p).resolve() for p in paths}
    fresh = {}
    for p, s in zip(paths, specs):
        files = _render_all([s])
        ours = any(Path(p).resolve() == q.resolve() for q in shipped_spec_paths(s.family))
        fresh.update(files if ours else _without_shipped(files, s.family))
    out = Path(args.out)
    on_disk = {}
    for s in specs:
        # a family's whole folder where all its shipped specs are diffed (a file none renders
        # is stale); a spec of yours: only the files it renders
        whole = all(p.resolve() in given for p in shipped_spec_paths(s.family))
        for f in (out / s.family).glob("*"):
            if f.is_file() and (whole or f"{s.family}/{f.name}" in fresh):
                on_disk[f"{s.family}/{f.name}"] = f.read_text(encoding="utf-8")
    differ = False
    for name in sorted(set(fresh) | set(on_disk)):
        old, new = on_disk.get(name, ""), fresh.get(name, "")
        if old != new:
            differ = True
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       f"{out}/{name}" if name in on_disk else "/dev/null",
                                                       f"fresh/{name}" if name in fresh else "/dev/null"))
    if differ and args.check:
        print(f"\nkgen diff --check: {out}/ is stale; run `kgen build SPEC --no-compile` for each "
              "changed spec and commit the result", file=sys.stderr)
        return 1
    return 0


def cmd_verify(args) -> int:
    from kgen.verify import verify

    spec = _load(args.spec)
    return verify(spec, _select(spec, args.variants, args.spec))


def cmd_bench(args) -> int:
    from kgen.bench import bench

    spec = _load(args.spec)
    return bench(spec, args.json, args.quick, args.dispatch)


def cmd_cache(args) -> int:
    from kgen import config
    from kgen.runtime import cache

    d = config.cache_dir()
    if d.exists() and not d.is_dir():  # (info and clear read it: "0 entries" hid the problem)
        print(f"kgen: {cache.CacheDirError(d, 'is not a directory')}", file=sys.stderr)
        return 1
    if args.action == "info":
        i = cache.info()
        print(f"{i['path']}: {i['entries']} entries, {i['bytes'] / 2**20:.1f} MiB")
    else:
        print(f"removed {cache.clear()} build entries from {cache.info()['path']} (your tuning table, "
              f"{' '.join(cache.KEPT)}, is kept: `kgen tune --show` prints it)")
    return 0


def cmd_doctor(args) -> int:
    from kgen.doctor import doctor

    return doctor(shipped_specs(), args.require, _console())


def _add_doctor(sub) -> None:
    from kgen.doctor import REQUIREMENTS

    dr = sub.add_parser("doctor", help="what this machine can do: versions, nvcc, GPU, runnable variants, cache")
    dr.add_argument("--require", nargs="+", default=[], choices=sorted(REQUIREMENTS), metavar="NEED",
                    help="exit 1 unless these work here: " + "; ".join(f"{k}: {v}" for k, v in REQUIREMENTS.items()))
    dr.set_defaults(fn=cmd_doctor)


def cmd_tune(args) -> int:
    from kgen import tune_cli

    return tune_cli.run(args, _console())


def _add_tune(sub) -> None:
    from kgen.runtime.timing import MIN_MEASURE_US
    from kgen.spec import DTYPES

    t = sub.add_parser("tune", help="measure which variant wins per shape bucket on this GPU and record it")
    t.add_argument("spec", nargs="?")
    t.add_argument("--dtype", nargs="+", choices=tuple(DTYPES), metavar="DTYPE",
                   help=f"only these dtypes ({', '.join(DTYPES)}; default: the spec's)")
    t.add_argument("--shapes", nargs="+", metavar="SHAPE",
                   help="e.g. 8192x11008 (the family's dimensions in order) or rows=8192,cols=11008 "
                        "(default: the family's shape list)")
    t.add_argument("--json", help="also write every measurement here")
    t.add_argument("--out", help="record into this table file instead of the user's (shipped tables)")
    t.add_argument("--min-us", type=float, default=MIN_MEASURE_US, help="GPU time per candidate (default %(default)s)")
    t.add_argument("--tf32", choices=("on", "off", "both"),
                   help="float32 buckets that depend on TF32 (fused_mlp's, linear_logp's): tune them with it on, off or both "
                        "(default: torch's current setting)")
    t.add_argument("--replace", action="store_true",
                   help="drop what the table holds for the buckets tuned (by default a bucket keeps its other "
                        "shapes' measurements of the same candidates, and its winner is chosen over all of them)")
    t.add_argument("--show", action="store_true",
                   help="print what the tables hold for this device (every device's without a GPU): per "
                        "bucket the winner, its time and the runner-up; SPEC and --dtype narrow it")
    t.add_argument("--times", action="store_true", help="with --show: every candidate's time, a column each")
    t.set_defaults(fn=cmd_tune)


def cmd_new_family(args) -> int:
    from kgen.scaffold import commands, create

    dest = create(args.name, args.dir)
    steps = "\n".join(f"  {c}" for c in [f"cd {dest}", *commands(args.name)])
    print(f"wrote the kernel family {args.name} into {dest}/; next (from its README.md):\n{steps}")
    return 0


def _add_new_family(sub) -> None:
    nf = sub.add_parser("new-family", help="write a pip-installable kernel family package to start from "
                                           "(spec, templates, op, tests, README)")
    nf.add_argument("name", help="the family's name: a lowercase Python identifier, not an existing family")
    nf.add_argument("--dir", help="where to write it (default: ./NAME); must be absent or empty")
    nf.set_defaults(fn=cmd_new_family)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kgen", description="kernel code generator")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="render a spec into generated/ and compile its variants")
    b.add_argument("spec")
    from kgen.spec import ARCHS

    b.add_argument("--arch", choices=ARCHS, help="only CUDA variants for this arch; also the Triton target "
                                                 "(default: this GPU, else sm_90)")
    b.add_argument("--no-compile", action="store_true", help="render only")
    b.add_argument("--out", default="generated", help="where rendered sources go (default: generated)")
    b.add_argument("--variants", nargs="+", metavar="NAME", help="only these variants")
    b.set_defaults(fn=cmd_build)

    ls = sub.add_parser("list", help="list the variants of specs (default: every family's, with KGEN_SPEC_PATH's)")
    ls.add_argument("specs", nargs="*")
    ls.set_defaults(fn=cmd_list)

    d = sub.add_parser("diff", help="diff a fresh render against generated/, or two variants")
    d.add_argument("specs", nargs="*")
    d.add_argument("--check", action="store_true", help="exit 1 when generated/ is stale")
    d.add_argument("--out", default="generated")
    d.add_argument("--variants", nargs=2, metavar=("A", "B"), help="diff two variants of one spec")
    d.set_defaults(fn=cmd_diff)

    v = sub.add_parser("verify", help="golden numerics of every variant this machine can run")
    v.add_argument("spec")
    v.add_argument("--variants", nargs="+", metavar="NAME")
    v.set_defaults(fn=cmd_verify)

    be = sub.add_parser("bench", help="time variants against peers; prints a table, writes JSON")
    be.add_argument("spec")
    be.add_argument("--json", default="kgen-bench.json", help="where to write results")
    be.add_argument("--quick", action="store_true", help="fewer repetitions")
    be.add_argument("--dispatch", action="store_true",
                    help="only dispatch's choice (spec order vs the tuning table) against the fastest candidate")
    be.set_defaults(fn=cmd_bench)

    c = sub.add_parser("cache", help="show or clear the build cache")
    c.add_argument("action", choices=("info", "clear"))
    c.set_defaults(fn=cmd_cache)

    _add_doctor(sub)
    _add_tune(sub)
    _add_new_family(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except SpecError as e:
        print(f"kgen: {e}", file=sys.stderr)
        return 2
    except (KgenError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"kgen: {msg}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `kgen list | head`: the reader left; no traceback (Python's docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # a path that cannot be made or written (--out, --dir, KGEN_CACHE_DIR)
        print(f"kgen: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
