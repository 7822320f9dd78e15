"""Cache behaviour: hits, misses, key sensitivity, races between processes, corruption."""

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kgen import spec
from kgen.runtime import build, cache

ROOT = Path(__file__).resolve().parent.parent
FBA = spec.load(ROOT / "kgen" / "specs" / "fused_bias_act.yaml")
CUDA_V = FBA.variant("sm90_t256_v8_r1_bf16")
TRITON_V = FBA.variant("triton_c1024_r1_w4_f32")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("KGEN_CACHE_DIR", str(d))
    return d


@pytest.fixture
def counting_nvcc(tmp_path, monkeypatch):
    """KGEN_NVCC pointing at a wrapper that logs each compile, then runs the real nvcc."""
    real = subprocess.run(["which", "nvcc"], capture_output=True, text=True).stdout.strip()
    if not real:
        pytest.skip("nvcc not installed") if not os.environ.get("CI") else pytest.fail("nvcc missing in CI")
    log = tmp_path / "nvcc-calls.log"
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("KGEN_NVCC", str(wrapper))
    return lambda: [ln for ln in log.read_text().splitlines() if "--version" not in ln] if log.exists() else []


def test_cache_dir_is_private_and_not_the_cwd(fresh_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    build.triton_source_entry(TRITON_V)
    assert stat.S_IMODE(fresh_cache.stat().st_mode) == 0o700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # nothing else in the cwd


def test_hit_miss_and_key_sensitivity(fresh_cache, counting_nvcc, monkeypatch):
    (r1,) = build.build_cuda([CUDA_V])
    assert r1.status == "built" and len(counting_nvcc()) == 1
    (r2,) = build.build_cuda([CUDA_V])
    assert r2.status == "cached" and r2.entry.path == r1.entry.path
    assert len(counting_nvcc()) == 1  # a hit compiles nothing

    monkeypatch.setenv("KGEN_NVCC_FLAGS", "-lineinfo")  # a changed flag rebuilds
    (r3,) = build.build_cuda([CUDA_V])
    assert r3.status == "built" and r3.entry.path != r1.entry.path
    assert "-lineinfo" in counting_nvcc()[-1]
    monkeypatch.delenv("KGEN_NVCC_FLAGS")
    (r4,) = build.build_cuda([CUDA_V])  # and back: the first entry is still there
    assert r4.status == "cached" and r4.entry.path == r1.entry.path
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # a Triton-only variable: no CUDA rebuild
    (r5,) = build.build_cuda([CUDA_V])
    assert r5.status == "cached" and len(counting_nvcc()) == 2


def test_template_change_rebuilds(fresh_cache, counting_nvcc, monkeypatch):
    (r1,) = build.build_cuda([CUDA_V])
    real = build.render

    def edited(variant):
        r = real(variant)
        return type(r)(r.variant, r.filename, r.text + "\n// an edit to the template\n")

    monkeypatch.setattr(build, "render", edited)
    (r2,) = build.build_cuda([CUDA_V])
    assert r2.status == "built" and r2.entry.path != r1.entry.path
    assert len(counting_nvcc()) == 2


def test_triton_aot_options_change_the_key(fresh_cache, tmp_path, monkeypatch):
    """An ahead-of-time Triton build's signatures and options (num_warps, num_stages) come
    from the family's `triton_aot`, not the rendered text: a change to the file holding it
    is a new cache key, never a hit on the old build's resource report. (The key is read
    where the build looks its entry up, before any compile.)"""
    from kgen.families import module_of

    looked_up = []
    real_lookup = cache.lookup
    monkeypatch.setattr(cache, "lookup", lambda path: looked_up.append(path) or real_lookup(path))
    build.build_triton(TRITON_V, "sm_90")
    build.build_triton(TRITON_V, "sm_90")
    fam = module_of(TRITON_V.family)
    edited = tmp_path / "schema_copy.py"
    edited.write_text(Path(build.inspect.getsourcefile(fam.triton_aot)).read_text() + "\n# num_stages changed\n")
    real = build.inspect.getsourcefile
    monkeypatch.setattr(build.inspect, "getsourcefile",
                        lambda obj: str(edited) if obj is fam.triton_aot else real(obj))
    build.build_triton(TRITON_V, "sm_90")
    assert looked_up[0] == looked_up[1] != looked_up[2]


def test_truncated_artifact_is_rebuilt(fresh_cache, counting_nvcc):
    (r1,) = build.build_cuda([CUDA_V])
    lib = r1.entry.file(build.CUDA_LIB)
    lib.write_bytes(lib.read_bytes()[:1000])
    assert cache.lookup(r1.entry.path) is None  # the manifest hash no longer matches
    (r2,) = build.build_cuda([CUDA_V])
    assert r2.status == "built" and r2.entry.path == r1.entry.path
    assert cache.lookup(r2.entry.path) is not None and len(counting_nvcc()) == 2


def test_partial_entry_without_manifest_is_rebuilt(fresh_cache):
    e = build.triton_source_entry(TRITON_V)
    (e.path / cache.MANIFEST).unlink()
    e2 = build.triton_source_entry(TRITON_V)
    assert e2.path == e.path and (e2.path / cache.MANIFEST).exists()


@pytest.mark.parametrize("manifest", [
    None, [], "abc", {}, {"files": None}, {"files": []}, {"files": "kernel.py"}, {"files": {}},
    {"files": {"kernel.py": 5}}, {"files": {"../kernel.py": "0" * 64}},
    {"files": {"kernel.py": "<hash>"}, "resources": []},
], ids=repr)
def test_malformed_manifest_is_corrupt_and_rebuilt(fresh_cache, manifest):
    """Valid JSON of the wrong shape is as corrupt as garbage: no crash, the entry is rebuilt."""
    import json

    e = build.triton_source_entry(TRITON_V)
    good = json.loads((e.path / cache.MANIFEST).read_text())
    text = json.dumps(manifest).replace("<hash>", good["files"]["kernel.py"])
    (e.path / cache.MANIFEST).write_text(text)
    assert cache.lookup(e.path) is None
    e2 = build.triton_source_entry(TRITON_V)
    assert e2.path == e.path and json.loads((e2.path / cache.MANIFEST).read_text()) == good


def test_manifest_without_the_entry_main_file_is_corrupt(fresh_cache):
    """An entry is loaded from one file (CUDA: lib.so; Triton: kernel.py; the launcher: its
    extension module): a manifest that does not list it does not make an entry."""
    import sysconfig

    launcher = "kgen_launcher" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    for family, name, main in [(CUDA_V.family, CUDA_V.name, build.CUDA_LIB),
                               (TRITON_V.family, TRITON_V.name, build.TRITON_SOURCE),
                               (TRITON_V.family, f"{TRITON_V.name}-sm90", build.TRITON_SOURCE),
                               ("_runtime", "launcher", launcher)]:
        path = cache.entry_path(family, name, "ab" * 32)
        cache.lock(path)  # (makes the family folder, as a builder's lock does)
        staging = cache.new_staging(name)
        for f in ("kernel.cu", "build.log", "launcher.c", main):
            (staging / f).write_text(f)
        facts = {"resources": {}}
        cache.publish(staging, path, ["kernel.cu", "build.log", "launcher.c"], facts)
        assert cache.lookup(path) is None, path.name
        staging = cache.new_staging(name)
        for f in ("kernel.cu", main):
            (staging / f).write_text(f)
        cache.publish(staging, path, ["kernel.cu", main], facts)
        assert cache.lookup(path) is not None, path.name


def test_toolchain_memo_of_the_wrong_shape_is_rewritten(fresh_cache):
    """toolchain.json that is JSON but not an object (or holds a non-string version) is
    ignored and rewritten, like one that is not JSON, rather than failing every CUDA build."""
    import json

    from kgen.runtime import toolchain

    memo = cache.root() / "toolchain.json"
    for text in ("[]", "null", '"abc"', "7", '{"nvcc|1|2": 5}'):
        memo.write_text(text)
        assert toolchain._memo.__wrapped__("nvcc|1|2", lambda: "release 12.8") == "release 12.8"
        assert json.loads(memo.read_text()) == {"nvcc|1|2": "release 12.8"}


def test_clear_removes_corrupt_entries_and_only_the_cache_layout(fresh_cache):
    """What `info` counts, `clear` removes and reports, manifests or not; what is not of the
    cache's layout stays (KGEN_CACHE_DIR may be a shared folder)."""
    variants = [v for v in FBA.variants if v.backend == "triton"][:3]
    entries = [build.triton_source_entry(v) for v in variants]
    for e in entries:
        (e.path / cache.MANIFEST).unlink()
    (fresh_cache / "tuning.json").write_text("{}")
    (fresh_cache / "notes.txt").write_text("not kgen's")
    (fresh_cache / "photos" / "trip-2024").mkdir(parents=True)  # not <name>-<20 hex digits>
    (fresh_cache / TRITON_V.family / "README").write_text("mine")  # a file in a family folder
    assert cache.info()["entries"] == len(entries)
    assert cache.clear() == len(entries)
    assert cache.info()["entries"] == 0
    assert not any(e.path.exists() or Path(f"{e.path}.lock").exists() for e in entries)
    assert sorted(p.relative_to(fresh_cache).as_posix() for p in fresh_cache.rglob("*")) == [
        "fused_bias_act", "fused_bias_act/README", "notes.txt", "photos", "photos/trip-2024", "tuning.json"]
    assert cache.clear() == 0


def test_clear_leaves_a_build_in_progress_its_staging_dir(fresh_cache):
    """`kgen cache clear` removed .staging while another process built into it: that build
    reported most of its variants as failed compiles of a source that no longer existed. A
    staging dir left from an interrupted build (older than any build takes) still goes."""
    import os
    import time

    live = cache.new_staging("live")
    (live / "kernel.cu").write_text("//")
    old = cache.new_staging("old")
    (old / "kernel.cu").write_text("//")
    then = time.time() - cache.STALE_STAGING_S - 60
    os.utime(old, (then, then))
    cache.clear()
    assert (live / "kernel.cu").is_file() and not old.exists()
    cache.discard(live)
    cache.clear()
    assert not (fresh_cache / ".staging").exists()


RACER = textwrap.dedent("""
    import sys, time
    from kgen import spec
    from kgen.runtime import build
    s = spec.load(sys.argv[1])
    start = float(sys.argv[2])
    while time.time() < start:
        time.sleep(0.005)
    (r,) = build.build_cuda([s.variant(sys.argv[3])])
    print(r.status, r.entry.path)
""")


def test_two_processes_racing_for_one_key_build_once(fresh_cache, counting_nvcc, tmp_path):
    import time

    script = tmp_path / "racer.py"
    script.write_text(RACER)
    start = str(time.time() + 3)  # both processes import kgen first, then start together
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script), str(ROOT / "kgen/specs/fused_bias_act.yaml"), start,
                               CUDA_V.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    statuses = sorted(o[0].split()[0] for o in outs)
    assert statuses == ["built", "cached"], outs
    assert len({o[0].split()[1] for o in outs}) == 1
    assert len(counting_nvcc()) == 1


def test_lock_is_released_when_its_holder_dies(fresh_cache, tmp_path):
    path = cache.entry_path(TRITON_V.family, TRITON_V.name, "0" * 64)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from kgen.runtime import cache
        from pathlib import Path
        held = cache.lock(Path({str(path)!r}))
        held.acquire()
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline().strip() == "locked"
    from filelock import Timeout

    with pytest.raises(Timeout):
        cache.lock(path).acquire(timeout=0.2)
    holder.kill()
    holder.wait()
    lk = cache.lock(path)
    lk.acquire(timeout=5)  # the OS dropped the dead holder's lock
    lk.release()


def test_warm_cache_second_process_runs_no_compiler(fresh_cache, counting_nvcc):
    build.build_cuda([CUDA_V])
    log = Path(os.environ["KGEN_NVCC"]).parent.parent / "nvcc-calls.log"
    n = len(log.read_text().splitlines())  # compiles and `--version` calls alike
    r = subprocess.run([sys.executable, "-c",
                        "from kgen import spec; from kgen.runtime import build;"
                        f"s = spec.load({str(ROOT / 'kgen/specs/fused_bias_act.yaml')!r});"
                        f"print(build.build_cuda([s.variant({CUDA_V.name!r})])[0].status)"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.strip() == "cached", r.stderr
    assert len(log.read_text().splitlines()) == n  # not even `nvcc --version`


def test_clear_leaves_locks_that_a_process_holds(fresh_cache, tmp_path):
    """`kgen cache clear` removed lock files live processes held (a build's, the tuning
    table's): the next process then created and took a new lock of the same name while the
    first still held its own. A held lock stays; a free one goes."""
    import subprocess
    import sys
    import textwrap

    held_path, free_path = fresh_cache / "fused_bias_act" / "x-0123456789abcdef0123", fresh_cache / ".locks" / "t"
    (fresh_cache / ".locks").mkdir(parents=True)
    free_path.write_text("")
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from kgen.runtime import cache
        held = cache.lock(Path({str(held_path)!r}))
        held.acquire()
        print("locked", flush=True)
        sys.stdin.readline()
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        cache.clear()
        assert Path(f"{held_path}.lock").exists() and not free_path.exists()
        from filelock import Timeout

        with pytest.raises(Timeout):
            cache.lock(held_path).acquire(timeout=0.2)
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=30)
    cache.clear()
    assert not Path(f"{held_path}.lock").exists()


def test_a_cache_that_cannot_be_used_is_a_clear_error(tmp_path, monkeypatch):
    """KGEN_CACHE_DIR naming a file: a KgenError naming the directory (a bare FileExistsError
    came out of an op's dispatch before)."""
    from kgen.errors import KgenError

    f = tmp_path / "afile"
    f.write_text("")
    monkeypatch.setenv("KGEN_CACHE_DIR", str(f))
    with pytest.raises(KgenError, match="not a directory"):
        cache.root()


def test_toolchain_memo_is_best_effort_and_thread_safe(fresh_cache, monkeypatch):
    """toolchain.json is a memo: where it cannot be written (read-only cache, disk full) the
    value is still returned (an OSError escaped into the op before); threads writing it at
    once leave it valid JSON holding both stamps (a pid-named temp file was shared: corrupt
    files and FileNotFoundError)."""
    import json
    import tempfile
    import threading

    from kgen.runtime import toolchain

    memo = toolchain._memo.__wrapped__
    real = tempfile.mkstemp

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert memo("nvcc|a|1", lambda: "release A") == "release A"
    monkeypatch.setattr(tempfile, "mkstemp", real)
    errors = []

    def run(i):
        try:
            for j in range(20):
                assert memo(f"s{i}|{j}", lambda: f"v{i}{j}") == f"v{i}{j}"
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    data = json.loads((cache.root() / "toolchain.json").read_text())
    assert all(data[f"s{i}|{j}"] == f"v{i}{j}" for i in range(2) for j in range(20))


def test_a_variant_whose_cache_cannot_be_written_is_unavailable_not_a_crash(fresh_cache, monkeypatch):
    """An OSError from building or locking (a read-only or full cache) is the variant's
    KgenError, naming the cache: dispatch's fallbacks (the next variant, the family's
    reference) then apply, where the OSError escaped into the op."""
    from kgen.errors import KgenError
    from kgen.runtime import dispatch

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied", str(fresh_cache / "fused_bias_act"))

    monkeypatch.setattr(build, "triton_source_entry", refuse)
    with pytest.raises(KgenError, match="cannot be used: Permission denied"):
        dispatch.load(TRITON_V)
    assert dispatch._first_loadable([TRITON_V]) is None


def test_empty_or_respaced_nvcc_flags_share_the_cache_key(monkeypatch):
    """KGEN_NVCC_FLAGS set but empty, or with other spacing, gives the nvcc command it gives
    unset or spaced once: the same CUDA cache key (each used to rebuild an identical binary)."""
    from kgen import config

    monkeypatch.delenv("KGEN_NVCC_FLAGS", raising=False)
    unset = config.code_env("cuda")
    for v in ("", "   "):
        monkeypatch.setenv("KGEN_NVCC_FLAGS", v)
        assert config.code_env("cuda") == unset
    monkeypatch.setenv("KGEN_NVCC_FLAGS", " -lineinfo   -Xptxas=-v ")
    spaced = config.code_env("cuda")
    monkeypatch.setenv("KGEN_NVCC_FLAGS", "-lineinfo -Xptxas=-v")
    assert config.code_env("cuda") == spaced != unset
