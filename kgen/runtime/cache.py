"""The build cache: content-addressed entries, staged and published atomically.

Layout: <root>/<family>/<variant>-<key[:20]>/ holding the entry's files and a
`manifest.json` (sha256 of each file plus build facts). An entry is built in a private
staging dir under <root>/.staging and published with one rename, under a per-key OS lock
(flock via `filelock`: the kernel drops it when the holder dies). A reader verifies the
manifest's hashes; a corrupt or partial entry counts as absent and is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kgen import config
from kgen.errors import KgenError

MANIFEST = "manifest.json"


def root() -> Path:
    """The cache root, created 0700 on first use (never at import)."""
    d = config.cache_dir()
    if not d.is_dir():
        if d.exists():
            raise CacheDirError(d, "is not a directory")
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask
        except OSError as e:
            raise CacheDirError(d, f"cannot be created: {e.strerror or e}") from None
    return d


class CacheDirError(KgenError):
    """The cache directory cannot be used; `why` says how (what `kgen doctor` prints)."""

    def __init__(self, path: Path, why: str):
        self.path, self.why = path, why
        super().__init__(f"kgen's cache directory {path} (KGEN_CACHE_DIR, or the platform's user cache dir) {why}")


def digest(parts: dict) -> str:
    """sha256 over a JSON object of strings: the cache key of one entry."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Entry:
    path: Path
    manifest: dict

    def file(self, name: str) -> Path:
        return self.path / name


def entry_path(family: str, name: str, key: str) -> Path:
    return root() / family / f"{name}-{key[:20]}"


def lookup(path: Path) -> Entry | None:
    """The entry at `path` if it is complete and every file matches its hash.

    A manifest of the wrong shape (no "files" mapping, a name that is not a plain file
    name, no files at all, or without the file the entry is loaded from) is as corrupt
    as one that is not JSON: the entry counts as absent and is rebuilt."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if not _well_formed(manifest, path):
            return None
        for fname, expected in manifest["files"].items():
            if file_hash(path / fname) != expected:
                return None
    except (OSError, ValueError):
        return None
    return Entry(path, manifest)


def _well_formed(manifest, path: Path) -> bool:
    if not isinstance(manifest, dict):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for fname, expected in files.items():
        # a name with a separator would hash (and later load) a file outside the entry
        if not fname or "/" in fname or fname in (".", "..") or not isinstance(expected, str):
            return False
    main = _main_file(path)
    if main is not None and main not in files:
        return False
    if _AOT.match(path.name) and "resources" not in manifest:  # build.build_triton reads it
        return False
    resources = manifest.get("resources", {})  # read by build.BuildResult.summary
    return isinstance(resources, dict) and all(
        isinstance(r, dict) and all(isinstance(r.get(k), int) for k in ("registers", "shared", "local"))
        for r in resources.values())


# An ahead-of-time Triton entry: <variant>-<arch>-<key> (build.build_triton).
_AOT = re.compile(r"^triton_.*-sm\d+a?-[0-9a-f]{20}$")


def _main_file(path: Path) -> str | None:
    """The file the entry at `path` is loaded from, told by its name: a variant's name
    starts with its arch (CUDA: build.CUDA_LIB) or with "triton" (build.TRITON_SOURCE, in
    an ahead-of-time entry too), and `_runtime/launcher-*` is loader.trampoline's extension
    module. None for a name kgen does not make: then only the hashes are checked."""
    if path.parent.name == "_runtime":
        if path.name.startswith("launcher-"):
            return "kgen_launcher" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        return None
    if path.name.startswith("triton_"):
        return "kernel.py"
    if re.match(r"sm\d", path.name):
        return "lib.so"
    return None


def lock(path: Path):
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path) + ".lock")


def new_staging(name: str) -> Path:
    staging = root() / ".staging"
    staging.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=staging))


def publish(staging: Path, path: Path, files: list[str], facts: dict) -> Entry:
    """Write the manifest into `staging` and move it to `path` in one rename.

    The caller holds `lock(path)`. A stale (corrupt) entry at `path` is moved aside first.
    """
    manifest = {"files": {f: file_hash(staging / f) for f in files}, **facts}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if path.exists():
        trash = Path(tempfile.mkdtemp(prefix="stale-", dir=staging.parent))
        os.replace(path, trash / "entry")
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(staging, path)
    return Entry(path, manifest)


def obtain(family: str, name: str, key: str, make) -> Entry:
    """The entry for `key`, built by `make(staging) -> (files, facts)` if absent or corrupt.

    Check, lock, check again (a racing builder may have published meanwhile), build in a
    private staging dir, publish by rename. For builds of one entry at a time; the batched
    CUDA build in build.py follows the same steps for many entries under one ninja run.
    """
    path = entry_path(family, name, key)
    entry = lookup(path)
    if entry:
        return entry
    with lock(path):
        entry = lookup(path)
        if entry:
            return entry
        staging = new_staging(name)
        try:
            files, facts = make(staging)
        except BaseException:
            discard(staging)
            raise
        return publish(staging, path, files, facts)


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


# The cache's own layout, <root>/<family>/<name>-<key[:20]>: family folders are named like
# families (or `_runtime`), entries end in 20 hex digits of their key. `info` counts, and
# `clear` removes, only what matches, since KGEN_CACHE_DIR may name a folder shared with
# other files.
_FAMILY_DIR = re.compile(r"^_?[a-z][a-z0-9_]*$")
_ENTRY_DIR = re.compile(r"^.+-[0-9a-f]{20}$")


def _entries(r: Path) -> list[Path]:
    """Every entry directory under the root `r`, complete or corrupt."""
    found = []
    for fam in sorted(r.iterdir()) if r.is_dir() else ():
        if fam.is_dir() and not fam.is_symlink() and _FAMILY_DIR.match(fam.name):
            found += [e for e in sorted(fam.iterdir())
                      if e.is_dir() and not e.is_symlink() and _ENTRY_DIR.match(e.name)]
    return found


def info() -> dict:
    r = config.cache_dir()
    entries = _entries(r)
    size = sum(f.stat().st_size for e in entries for f in e.rglob("*") if f.is_file())
    return {"path": str(r), "entries": len(entries), "bytes": size}


# Files in the cache dir that `clear` keeps: the user's tuning table (measurements, not
# builds: `kgen tune` took minutes to make it).
KEPT = ("tuning.json",)


# a staging dir untouched this long (seconds) is an interrupted build's: `clear` removes it
STALE_STAGING_S = 3600


def _unlink_unheld_lock(path: Path) -> None:
    """Remove a lock file no process holds: taken without waiting and removed while held. One
    a process holds stays: removing it let a second process create and take a new lock of the
    same name while the first still held its own (two builders, or two tuners merging the
    table, at once)."""
    from filelock import FileLock, Timeout

    lk = FileLock(str(path))
    try:
        lk.acquire(timeout=0)
    except (Timeout, RuntimeError):  # (RuntimeError: this process holds it through another FileLock)
        return
    try:
        path.unlink(missing_ok=True)
    finally:
        lk.release()


def clear() -> int:
    """Remove every build entry, complete or corrupt, with its lock file (and the lock and
    toolchain memo files kgen keeps beside them, each lock only where no process holds it,
    and staging dirs of builds interrupted over STALE_STAGING_S ago: a younger one may be a
    build in progress); returns how many entries it removed. The user's tuning table stays, as does anything that is not of the cache's
    layout (see _ENTRY_DIR): a family folder is removed only once it is empty."""
    r = config.cache_dir()
    removed = 0
    for e in _entries(r):
        _remove(e)
        _unlink_unheld_lock(Path(f"{e}.lock"))
        removed += 1
    if not r.is_dir():
        return removed
    for p in r.iterdir():
        if p.name in KEPT:
            continue
        if p.name == ".staging" and p.is_dir() and not p.is_symlink():
            # a build in progress (another process) writes its staging dir: only those left
            # longer than any build takes, by one that was interrupted, go
            for d in p.iterdir():
                try:
                    stale = time.time() - d.stat().st_mtime > STALE_STAGING_S
                except OSError:  # (gone meanwhile: published or discarded)
                    continue
                if stale and d.is_dir() and not d.is_symlink():
                    _remove(d)
                elif stale:
                    d.unlink(missing_ok=True)
            try:
                p.rmdir()
            except OSError:  # builds in progress
                pass
        elif p.name == ".locks" and p.is_dir() and not p.is_symlink():
            for lk in p.iterdir():
                if lk.is_file() and not lk.is_symlink():
                    _unlink_unheld_lock(lk)
            try:
                p.rmdir()
            except OSError:  # a lock some process holds
                pass
        elif p.name == "toolchain.json":
            p.unlink(missing_ok=True)
        elif p.is_dir() and not p.is_symlink() and _FAMILY_DIR.match(p.name):
            for lk in p.glob("*.lock"):  # a lock whose entry is gone (a build that failed)
                if _ENTRY_DIR.match(lk.name.removesuffix(".lock")):
                    _unlink_unheld_lock(lk)
            try:
                p.rmdir()
            except OSError:  # it holds something kgen did not put there
                pass
    return removed


def _remove(d: Path) -> None:
    """Remove a directory tree; one that a concurrent `clear` removed first is no error,
    anything else (a file we may not delete) is raised, naming the file."""
    try:
        shutil.rmtree(d)
    except FileNotFoundError:
        pass
