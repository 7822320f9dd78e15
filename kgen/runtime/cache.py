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
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kgen import config

MANIFEST = "manifest.json"


def root() -> Path:
    """The cache root, created 0700 on first use (never at import)."""
    d = config.cache_dir()
    if not d.is_dir():
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask
    return d


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
    """The entry at `path` if it is complete and every file matches its hash."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for fname, expected in manifest["files"].items():
            if file_hash(path / fname) != expected:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Entry(path, manifest)


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


def info() -> dict:
    r = config.cache_dir()
    entries, size = 0, 0
    if r.is_dir():
        for fam in r.iterdir():
            if fam.is_dir() and not fam.name.startswith("."):
                for e in fam.iterdir():
                    if e.is_dir():
                        entries += 1
                        size += sum(f.stat().st_size for f in e.rglob("*") if f.is_file())
    return {"path": str(r), "entries": entries, "bytes": size}


# Files in the cache dir that `clear` keeps: the user's tuning table (measurements, not
# builds: `kgen tune` took minutes to make it).
KEPT = ("tuning.json",)


def clear() -> int:
    """Remove every build entry (and the staging, lock and toolchain memo files kgen keeps
    beside them); returns how many entries there were. The user's tuning table stays, as
    does anything kgen did not put there (KGEN_CACHE_DIR may name a folder shared with other
    files): only the family folders of entries (their manifests say so), `.staging`,
    `.locks` and toolchain.json go."""
    r = config.cache_dir()
    n = info()["entries"]
    if not r.is_dir():
        return n
    for p in r.iterdir():
        if p.name in KEPT:
            continue
        if p.is_dir() and (p.name in (".staging", ".locks") or _holds_entries(p)):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name == "toolchain.json":
            p.unlink(missing_ok=True)
    return n


def _holds_entries(d: Path) -> bool:
    """A family folder of the cache: it holds an entry (a folder with a manifest), beside
    the entries' lock files."""
    return any(e.is_dir() and (e / MANIFEST).is_file() for e in d.iterdir())
