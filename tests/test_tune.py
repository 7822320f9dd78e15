"""The tuning table and dispatch's use of it (kgen.runtime.tune, dispatch.choose).

CPU tests inject a fake timer and a fake device key; Triton variants load under the
interpreter, so dispatch really loads the table's winner. GPU tests time real kernels."""

import functools
import json
import logging
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from kgen import spec as spec_mod
from kgen.families import fused_bias_act as fba
from kgen.families import linear_logp as llp
from kgen.runtime import dispatch, timing, tune, tuning_table

FAKE_DEVICE = "Fake GPU|sm_90|132"
OTHER_DEVICE = "Other GPU|sm_80|108"


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A private cache dir (user table), an empty shipped dir, and a fake device key."""
    monkeypatch.setenv("KGEN_CACHE_DIR", str(tmp_path / "cache"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tuning_table, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(tuning_table, "device_key", lambda index: FAKE_DEVICE)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("KGEN_VARIANT", raising=False)
    monkeypatch.delenv("KGEN_BACKEND", raising=False)
    monkeypatch.delenv("KGEN_AUTOTUNE", raising=False)
    tuning_table._shipped.cache_clear()
    tune.TABLES.invalidate()
    yield shipped
    tuning_table._shipped.cache_clear()
    tune.TABLES.invalidate()


CUDA0 = types.SimpleNamespace(type="cuda", index=0)  # a stand-in device for dispatch.choose
SHAPE = {"rows": 3, "cols": 40, "has_y": True}


def _fake_timer(times_by_name):
    """A timer that returns a fixed time per candidate (identified by its runner)."""
    def timer(fn, min_us):
        return times_by_name[fn.candidate]
    return timer


@pytest.fixture
def labelled_runners(monkeypatch):
    """tune_runner returns a labelled no-op so the fake timer knows which candidate it times
    (and at what width: `cols`)."""
    def runner(kernel, inputs):
        def fn():
            pass
        fn.candidate = kernel.name if kernel is not None else tune.REFERENCE
        fn.cols = inputs["x"].shape[1]
        return fn
    monkeypatch.setattr(fba, "tune_runner", runner)


def _triton_f32():
    return [v for v in dispatch.shipped_spec("fused_bias_act").variants
            if v.backend == "triton" and v.dtype == "float32"]


def test_the_fastest_candidate_wins_and_every_time_is_kept(tables, labelled_runners):
    a, b = _triton_f32()[:2]
    times = {a.name: 30.0, b.name: 10.0, tune.REFERENCE: 50.0}
    res = tune.tune("fused_bias_act", torch.device("cpu"), "float32", SHAPE, variants=[a, b],
                    timer=_fake_timer(times))
    assert res.winner == b.name
    assert res.times == times
    assert res.key == f"fused_bias_act|{FAKE_DEVICE}|float32|{fba.tune_bucket(**SHAPE)}"
    assert res.margin() == pytest.approx(2.0)
    e = res.entry()
    assert e["winner"] == b.name and e["kgen"] and e["date"]


def test_a_lucky_winner_is_re_timed_against_spec_order_and_loses(tables, labelled_runners):
    # b's first timing is a lucky outlier (the winner's curse); its later ones equal a's
    a, b = _triton_f32()[:2]
    calls = {}

    def timer(fn, min_us):
        calls[fn.candidate] = calls.get(fn.candidate, 0) + 1
        if fn.candidate == b.name:
            return 5.0 if calls[b.name] == 1 else 10.0
        return {a.name: 10.0, tune.REFERENCE: 50.0}[fn.candidate]

    res = tune.tune("fused_bias_act", torch.device("cpu"), "float32", SHAPE, variants=[a, b], timer=timer)
    assert res.times[b.name] == 5.0  # the screening saw b win ...
    assert res.winner == a.name  # ... the paired re-timing did not
    assert res.confirm == {a.name: 10.0, b.name: 10.0}
    assert calls[b.name] == 3 + tune.CONFIRM_ROUNDS
    assert res.entry()["confirm_us"] == {a.name: 10.0, b.name: 10.0}


def test_a_real_winner_survives_the_re_timing(tables, labelled_runners):
    a, b = _triton_f32()[:2]
    res = tune.tune("fused_bias_act", torch.device("cpu"), "float32", SHAPE, variants=[a, b],
                    timer=_fake_timer({a.name: 10.0, b.name: 9.0, tune.REFERENCE: 50.0}))
    assert res.winner == b.name and res.confirm == {a.name: 10.0, b.name: 9.0}
    # a tie in the re-timing (within TIE) goes to spec order, as in pick
    w, again, again_gpu = tune.confirm({"a": 10.0, "b": 9.0}, "b", {"a": "A", "b": "B"},
                                       lambda fn, us: {"A": 10.0, "B": 9.9}[fn], 1.0)
    assert w == "a" and again == {"a": 10.0, "b": 9.9} and again_gpu == {}


def test_near_ties_go_to_spec_order():
    assert tune.pick({"first": 10.1, "second": 10.0, "reference": 9.0}) == "reference"
    assert tune.pick({"first": 10.1, "second": 10.0}) == "first"  # 1 % apart: a tie
    assert tune.pick({"first": 10.5, "second": 10.0}) == "second"  # 5 % apart
    # long GPU-bound calls (>= LONG_US each) tie within LONG_TIE only: 1.5 % is a difference
    assert tune.pick({"first": 355.0, "second": 350.0}) == "second"
    assert tune.pick({"first": 351.0, "second": 350.0}) == "first"  # 0.3 %: a tie
    assert tune.pick({"first": 101.5, "second": 99.9}) == "first"  # one below LONG_US: TIE
    assert tune.beats("b", "a", {"a": 355.0, "b": 350.0}) and not tune.beats("b", "a", {"a": 351.0, "b": 350.0})
    # host-bound long calls keep the host's tie (HOST_TIE), then the GPU times decide
    assert tune.pick({"first": 300.0, "second": 290.0}, {"first": 100.0, "second": 99.0}) == "first"


def test_host_bound_ties_go_to_the_least_gpu_time():
    # every total is the host's launch time (~75 us); the kernels differ
    totals = {"first": 75.5, "second": 75.0, "third": 76.0, "reference": 90.0}
    gpu = {"first": 70.0, "second": 50.0, "third": 49.5, "reference": 40.0}
    assert tune.pick(totals) == "first"  # totals alone: a tie, spec order
    assert tune.pick(totals, gpu) == "second"  # GPU times 50 and 49.5 tie in turn: spec order
    # the reference is faster on the GPU but not tied in total: the totals still rule
    assert tune.pick(totals, gpu) != "reference"
    # GPU-bound candidates (GPU time = total): the same choice as without GPU times
    for t in ({"a": 10.1, "b": 10.0, "c": 9.0}, {"a": 10.0, "b": 9.95}, {"a": 10.5, "b": 10.0}):
        assert tune.pick(t, dict(t)) == tune.pick(t)
    # GPU times of only some candidates: the totals decide
    assert tune.pick(totals, {"second": 1.0}) == "first"
    # host-bound candidates 2-10 % apart in total still tie (a shared host's noise) ...
    totals = {"first": 280.0, "b16": 180.7, "b64": 181.1, "b128": 177.2}
    gpu = {"first": 280.0, "b16": 89.6, "b64": 63.2, "b128": 99.5}
    assert tune.pick(totals, gpu) == "b64"
    assert tune.pick(totals) == "b128"  # unknown to be host-bound: long calls 2 % apart differ
    # ... and with a GPU-bound fastest one: a host-bound candidate within HOST_TIE of it costs
    # the same in a host-bound loop, give or take the host's noise, and less wherever the GPU
    # bounds the call (a captured graph, a busy stream), so the GPU times decide
    assert tune.pick({"a": 100.0, "b": 105.0}, {"a": 100.0, "b": 60.0}) == "b"
    assert tune.beats("b", "a", {"a": 100.0, "b": 105.0}, {"a": 100.0, "b": 60.0})
    assert tune.beats("b", "a", {"a": 100.0, "b": 108.0}, {"a": 90.0, "b": 60.0})  # both host-bound
    # (the H200 table's float32 logmatmul B <= 64, N, K <= 1024 bucket: 22.4 GPU-bound against
    # 22.9 host-bound with 14.0 us of GPU time, which the old rule lost at 2.0 %)
    assert tune.pick({"b128": 22.421, "b16": 22.872}, {"b128": 22.376, "b16": 14.04}) == "b16"
    # past HOST_TIE the totals rule; nor does a host-bound candidate's GPU time win when it is not less
    assert tune.pick({"a": 100.0, "b": 111.0}, {"a": 100.0, "b": 60.0}) == "a"
    assert tune.pick({"a": 100.0, "b": 105.0}, {"a": 100.0, "b": 99.0}) == "a"


def test_the_re_timing_keeps_a_host_bound_winner_by_its_gpu_time():
    def timer(totals, gpus):
        return lambda fn, us: timing.Timing(totals[fn], gpus[fn])

    runners = {"a": "A", "b": "B"}
    # totals tie (host-bound), b's kernel takes 30 % less GPU time: b stays
    w, again, again_gpu = tune.confirm({"a": 75.0, "b": 75.0}, "b", runners,
                                       timer({"A": 75.4, "B": 75.0}, {"A": 60.0, "B": 42.0}), 1.0,
                                       gpu={"a": 60.0, "b": 42.0})
    assert w == "b" and again_gpu == {"a": 60.0, "b": 42.0}
    # GPU times tie too: spec order
    w, _, _ = tune.confirm({"a": 75.0, "b": 75.0}, "b", runners,
                           timer({"A": 75.4, "B": 75.0}, {"A": 42.5, "B": 42.0}), 1.0)
    assert w == "a"
    # b 5 % slower in total, both host-bound: within the host's noise (HOST_TIE), b
    w, _, _ = tune.confirm({"a": 75.0, "b": 75.0}, "b", runners,
                           timer({"A": 75.0, "B": 79.0}, {"A": 60.0, "B": 42.0}), 1.0)
    assert w == "b"
    # b less GPU time but 13 % slower in total (its launch costs more): a
    w, _, _ = tune.confirm({"a": 75.0, "b": 75.0}, "b", runners,
                           timer({"A": 75.0, "B": 85.0}, {"A": 60.0, "B": 42.0}), 1.0)
    assert w == "a"


def test_tuning_records_gpu_times_and_decides_on_them(tables, labelled_runners):
    a, b = _triton_f32()[:2]
    totals = {a.name: 75.0, b.name: 74.8, tune.REFERENCE: 200.0}
    gpus = {a.name: 70.0, b.name: 40.0, tune.REFERENCE: 150.0}
    res = tune.tune("fused_bias_act", torch.device("cpu"), "float32", SHAPE, variants=[a, b],
                    timer=lambda fn, us: timing.Timing(totals[fn.candidate], gpus[fn.candidate]))
    assert res.winner == b.name
    e = res.entry()
    assert e["gpu_us"] == gpus and e["confirm_gpu_us"] == {a.name: 70.0, b.name: 40.0}
    assert tune.pick(e["times_us"], e["gpu_us"]) == b.name


def test_the_reference_can_win(tables, labelled_runners):
    a = _triton_f32()[0]
    res = tune.tune("fused_bias_act", torch.device("cpu"), "float32", SHAPE, variants=[a],
                    timer=_fake_timer({a.name: 9.0, tune.REFERENCE: 3.0}))
    assert res.winner == tune.REFERENCE


def test_cuda_candidates_build_together_before_any_loads(tables, labelled_runners, monkeypatch):
    """The tuner's candidates: every CUDA variant built in one build_cuda call (one ninja run,
    nvcc in parallel) before the first load; one that failed there is reported with its
    compiler's first line and not built again by a load."""
    from kgen.errors import CompileError
    from kgen.runtime import build

    cuda = [v for v in dispatch.shipped_spec("fused_bias_act").variants
            if v.backend == "cuda" and v.dtype == "float32"][:3]
    assert len(cuda) == 3
    events = []

    def build_cuda(variants, on_progress=None):
        events.append(("build", [v.name for v in variants]))
        return [build.BuildResult(v, "failed", error=CompileError(v.qualname, "nvcc", "boom", "src.cu"))
                if v is cuda[1] else build.BuildResult(v, "built") for v in variants]

    def load(v):
        events.append(("load", v.name))
        return types.SimpleNamespace(name=v.name)

    monkeypatch.setattr(build, "build_cuda", build_cuda)
    monkeypatch.setattr(dispatch, "load", load)
    inputs = fba.tune_inputs(torch.device("cpu"), "float32", 3, 40)
    runners, errors = tune.candidate_runners(fba, [*cuda, *_triton_f32()[:1]], inputs)
    assert events[0] == ("build", [v.name for v in cuda])  # (the Triton one is not nvcc's)
    assert [e for e in events[1:] if e[0] == "build"] == []
    assert ("load", cuda[1].name) not in events
    assert errors == {cuda[1].name: f"compiling {cuda[1].qualname} failed"}
    assert set(runners) == {cuda[0].name, cuda[2].name, _triton_f32()[0].name, tune.REFERENCE}


def test_a_candidate_that_cannot_take_the_shape_is_neither_built_nor_timed(tables, monkeypatch):
    """linear_logp's gemv variants take N <= 16 rows (variant_fits): tuning N = 40 reports them
    as not taking the shape without loading (building) them."""
    variants = [v for v in dispatch.shipped_spec("linear_logp").variants if v.dtype == "bfloat16"]
    gemv = [v for v in variants if v.params.get("kernel") == "gemv"]
    others = [v for v in variants if v.params.get("kernel") != "gemv"][:2]
    assert gemv and len(others) == 2
    loaded = []

    def load(v):
        loaded.append(v.name)
        return types.SimpleNamespace(name=v.name)

    def runner(kernel, inputs):
        fn = lambda: None  # noqa: E731
        fn.candidate = kernel.name if kernel is not None else tune.REFERENCE
        return fn

    monkeypatch.setattr(dispatch, "load", load)
    monkeypatch.setattr(dispatch, "prebuild", lambda variants: {})
    monkeypatch.setattr(llp, "tune_runner", runner)
    times = {v.name: 5.0 + i for i, v in enumerate(others)} | {tune.REFERENCE: 9.0}
    res = tune.tune("linear_logp", torch.device("cpu"), "bfloat16", {"N": 40, "D": 64, "V": 300},
                    variants=[*gemv, *others], timer=_fake_timer(times))
    assert loaded and not set(loaded) & {v.name for v in gemv}
    assert all(res.errors[v.name] == "does not take the shape" for v in gemv)
    assert res.winner == others[0].name and set(res.times) == set(times)


def test_buckets():
    b = fba.tune_bucket
    assert b(1000, 4104, True) == "rows<=1024.cols<=8192.vec16.y"
    assert b(1024, 4100, False) == "rows<=1024.cols<=8192.vec8.no-y"
    assert b(1024, 4101, False) == b(1024, 4102, False) == "rows<=1024.cols<=8192.tail.no-y"
    assert b(1, 1) == "rows<=1.cols<=1.tail.y"
    assert b(1025, 4104) != b(1024, 4104)
    assert llp.tune_bucket(4096, 2048, 151936) == "N<=4096.D<=2048.V<=262144"
    assert llp.tune_bucket(1, 1, 1) == "N<=1.D<=1.V<=1"
    assert llp.tune_bucket(1, 1, 1, precision="tf32") == "N<=1.D<=1.V<=1.tf32"
    # the per-call cache keys follow the buckets exactly
    shapes = ((1, 1), (3, 40), (1000, 4104), (1024, 4100), (1024, 4101), (1025, 4104), (1000, 4102))
    for r, c in shapes:
        for r2, c2 in shapes:
            same_key = fba.op._key(0, None, r, c, True) == fba.op._key(0, None, r2, c2, True)
            assert same_key == (b(r, c) == b(r2, c2))


def test_a_bucket_tuned_at_two_shapes_takes_the_least_bad_candidate_at_its_worst_shape(tables, labelled_runners):
    a, b, c = _triton_f32()[:3]
    # 40 and 48 columns share a bucket; a wins at 40, c at 48, b is within 5 % at both
    times = {40: {a.name: 10.0, b.name: 10.5, c.name: 13.0, tune.REFERENCE: 50.0},
             48: {a.name: 14.0, b.name: 10.4, c.name: 10.0, tune.REFERENCE: 50.0}}
    timer = lambda fn, min_us: times[fn.cols][fn.candidate]  # noqa: E731
    s40, s48 = dict(SHAPE, cols=40), dict(SHAPE, cols=48)
    assert fba.tune_bucket(**s40) == fba.tune_bucket(**s48)
    r40 = tune.tune("fused_bias_act", torch.device("cpu"), "float32", s40, variants=[a, b, c], timer=timer)
    r48 = tune.tune("fused_bias_act", torch.device("cpu"), "float32", s48, variants=[a, b, c], timer=timer)
    assert (r40.winner, r48.winner) == (a.name, c.name) and r40.entry()["shape"] == s40
    path = tune.record({r40.key: r40.entry()})
    tune.record({r48.key: r48.entry()})
    e = tune.lookup(r40.key)
    assert [p["shape"] for p in tune.probes(e)] == [s40, s48]
    # worst slowdowns: a 1.4 (at 48), b 1.05 (at 40), c 1.3 (at 40)
    assert tune.worst_slowdowns(e) == pytest.approx({a.name: 1.4, b.name: 1.05, c.name: 1.3, tune.REFERENCE: 5.0})
    assert e["winner"] == b.name and tune.ranking(e)[:3] == [b.name, c.name, a.name]
    assert dispatch.choose("fused_bias_act", CUDA0, "float32", r40.key.split("|")[-1], s40)[0].name == b.name
    # a shape tuned again replaces its own probe: b now 1.35 off at 40, so c (1.3) is the least bad
    times[40][b.name] = 13.5
    r40b = tune.tune("fused_bias_act", torch.device("cpu"), "float32", s40, variants=[a, b, c], timer=timer)
    tune.record({r40b.key: r40b.entry()})
    e = tune.lookup(r40.key)
    assert [p["shape"] for p in tune.probes(e)] == [s48, s40] and e["winner"] == c.name
    assert json.loads(path.read_text())["entries"][r40.key] == e
    # other candidates (another spec) or replace=True: the new shape alone
    r2 = tune.tune("fused_bias_act", torch.device("cpu"), "float32", s48, variants=[a, b], timer=timer)
    tune.record({r2.key: r2.entry()})
    assert tune.probes(tune.lookup(r40.key)) == [tune.lookup(r40.key)] and tune.lookup(r40.key)["winner"] == b.name
    tune.record({r40b.key: r40b.entry()}, replace=True)
    assert tune.lookup(r40.key) == r40b.entry() | {"date": tune.lookup(r40.key)["date"]}
    # an entry without a shape (a table from before probes) is replaced, never merged
    legacy = {k: v for k, v in r48.entry().items() if k != "shape"}
    tune.record({r40.key: legacy}, replace=True)
    tune.record({r40.key: r40.entry()})
    assert tune.probes(tune.lookup(r40.key)) == [tune.lookup(r40.key)]


def test_family_choices_are_timed_recorded_and_chosen_over_probes(tables, labelled_runners, monkeypatch):
    """A family's `tune_choices` (fused_mlp: its training backward) are timed beside the
    candidates: the entry keeps each option's time and the winner per choice (`pick`: a tie
    goes to the option listed first), a failing option is left out with its reason, and a
    bucket tuned at two shapes takes the option least far from each shape's best."""
    a, b = _triton_f32()[:2]
    opt_times = {40: {"x": 10.0, "y": 5.0, "z": 1.0}, 48: {"x": 10.0, "y": 10.1, "z": 1.0}}

    def choices(inputs):
        cols = inputs["x"].shape[1]

        def option(name):
            def fn():
                if name == "z":
                    raise RuntimeError("z does not build\nmore")
            fn.candidate, fn.cols = f"c:{name}", cols
            return fn
        return {"c": {n: option(n) for n in ("x", "y", "z")}}

    monkeypatch.setattr(fba, "tune_choices", choices, raising=False)
    def timer(fn, us):
        fn()  # as cuda_timer runs it: z raises
        return opt_times[fn.cols][fn.candidate[2:]] if fn.candidate.startswith("c:") else 9.0

    s40, s48 = dict(SHAPE, cols=40), dict(SHAPE, cols=48)
    r40 = tune.tune("fused_bias_act", torch.device("cpu"), "float32", s40, variants=[a, b], timer=timer)
    assert r40.choices["choices_us"] == {"c": {"x": 10.0, "y": 5.0}} and r40.errors["c:z"] == "z does not build"
    assert r40.choices["choices_confirm_us"] == {"c": {"x": 10.0, "y": 5.0}}  # y re-timed against x, the first
    assert r40.entry()["choices"] == {"c": "y"} and r40.entry()["choices_us"] == r40.choices["choices_us"]
    r48 = tune.tune("fused_bias_act", torch.device("cpu"), "float32", s48, variants=[a, b], timer=timer)
    assert r48.entry()["choices"] == {"c": "x"}  # 1 % apart: a tie, to the first listed
    tune.record({r40.key: r40.entry()})
    assert tune.choice(r40.key, "c") == "y" and tune.choice(r40.key, "other") is None
    tune.record({r48.key: r48.entry()})
    e = tune.lookup(r40.key)
    assert len(tune.probes(e)) == 2
    assert e["choices"] == {"c": "y"}  # y at worst 1.01x (at 48), x 2x (at 40)
    assert tune.choice(tune.key("fused_bias_act", FAKE_DEVICE, "float16", "none"), "c") is None
    # a lucky first timing (the winner's curse) does not survive the paired re-timing
    calls = {}

    def lucky(fn, us):
        calls[fn.candidate] = calls.get(fn.candidate, 0) + 1
        if fn.candidate == "c:y":
            return 5.0 if calls["c:y"] == 1 else 10.0
        return 10.0 if fn.candidate == "c:x" else 9.0

    opt_times[40].pop("z")
    r = tune.tune("fused_bias_act", torch.device("cpu"), "float32", s40, variants=[a, b], timer=lucky)
    assert r.choices["choices_us"]["c"]["y"] == 5.0 and r.entry()["choices"] == {"c": "x"}


def test_linear_logp_float32_buckets_name_the_precision(monkeypatch):
    """linear_logp's float32 buckets carry the dot precision (TF32 on or off: a few rows run
    the logits path with it off, the tiles with it on), the 16-bit ones nothing; the op's
    per-bucket choice is kept per precision, so toggling TF32 chooses anew once."""
    from kgen.families.linear_logp import op as llp_op

    seen = []
    monkeypatch.setattr(llp_op, "_MODULES", {})
    monkeypatch.setattr(llp_op, "_choose", lambda device, dtype, shape: seen.append(
        (dtype, llp.tune_bucket(*shape, **llp.bucket_extras(str(dtype)[6:])))) or object())
    cuda = types.SimpleNamespace(type="cuda", index=0)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:  # (restored by hand: torch's C++ state, which monkeypatch fails to restore)
        for on in (False, True, False, True):
            torch.backends.cuda.matmul.allow_tf32 = on
            for dtype in (torch.float32, torch.bfloat16):
                llp_op._module(cuda, dtype, (8, 512, 1024))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert seen == [(torch.float32, "N<=8.D<=512.V<=1024.tf32x3"), (torch.bfloat16, "N<=8.D<=512.V<=1024"),
                    (torch.float32, "N<=8.D<=512.V<=1024.tf32")]


def test_fused_mlp_backward_choice_reads_the_table(tables, capsys, monkeypatch):
    """fused_mlp's training backward takes the bucket's tuned choice (or the nearest tuned B's
    for the same widths and dtype), else the default rule."""
    from kgen.families import fused_mlp as fm
    from kgen.families.fused_mlp import tuning

    top, cuda = (367, 512, 256, 1), types.SimpleNamespace(type="cuda", index=0)
    bucket = fm.tune_bucket(16384, top)
    e = {"winner": tune.REFERENCE, "times_us": {tune.REFERENCE: 1.0},
         "choices_us": {"backward": {"fused": 3.0, "lean": 1.0}}, "choices": {"backward": "lean"},
         "kgen": "0", "date": "2026-11-29"}
    tune.record({tune.key("fused_mlp", FAKE_DEVICE, "bfloat16", bucket): e})
    assert tuning.backward_choice(cuda, torch.bfloat16, top, 16384) == "lean"
    assert tuning.backward_choice(cuda, torch.bfloat16, top, 100) == "lean"  # B is free: the nearest tuned
    assert tuning.backward_choice(cuda, torch.bfloat16, (367, 512, 1), 16384) == "fused"  # other widths: default
    assert tuning.backward_choice(cuda, torch.float16, top, 16384) == "fused"
    e["choices"] = {"backward": "fused_m32"}  # a chain option: 16-bit only
    f32_bucket = fm.tune_bucket(16384, top, **fm.bucket_extras("float32"))
    tune.record({tune.key("fused_mlp", FAKE_DEVICE, "bfloat16", bucket): e,
                 tune.key("fused_mlp", FAKE_DEVICE, "float32", f32_bucket): e})
    assert tuning.backward_choice(cuda, torch.bfloat16, top, 16384) == "fused_m32"
    assert tuning.backward_choice(cuda, torch.float32, top, 16384) == "fused"  # not the default's "lean"
    # `kgen tune --show` names a bucket's choices in its notes
    from kgen import cli

    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "400")  # one line a row
    assert cli.main(["tune", "--show", "kgen/specs/fused_mlp.yaml", "--dtype", "bfloat16"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if bucket in line)
    assert "backward: fused_m32" in row


def test_a_winner_carries_to_near_buckets_only_with_its_margin_at_every_probe():
    one = {"winner": "b", "times_us": {"a": 12.0, "b": 10.0}, "shape": {"cols": 40}}
    assert tune.transfers(one)
    two = {**one, "probes": [{"shape": {"cols": 48}, "times_us": {"a": 10.5, "b": 10.0}}]}
    assert not tune.transfers(two)


def test_record_persists_merges_and_replaces_atomically(tables):
    k1 = tune.key("fused_bias_act", FAKE_DEVICE, "float32", "b1")
    k2 = tune.key("fused_bias_act", FAKE_DEVICE, "float32", "b2")
    path = tune.record({k1: {"winner": "x", "times_us": {"x": 1.0}}})
    tune.record({k2: {"winner": "y", "times_us": {"y": 1.0}}})
    data = json.loads(path.read_text())
    assert data["format"] == tune.FORMAT and set(data["entries"]) == {k1, k2}
    assert not list(path.parent.glob(".tuning.json.*.tmp"))  # nothing left half-written
    tune.TABLES.invalidate()
    assert tune.lookup(k1)["winner"] == "x" and tune.lookup(k2)["winner"] == "y"


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "someone-else", "entries": {}}),
                                     json.dumps([1, 2, 3])])
def test_a_corrupt_or_foreign_table_is_ignored_with_one_warning(tables, caplog, content):
    tune.user_path().parent.mkdir(parents=True, exist_ok=True)
    tune.user_path().write_text(content)
    tuning_table._warned.clear()
    with caplog.at_level(logging.WARNING, logger="kgen"):
        assert tune.lookup("anything") is None
        tune.TABLES.invalidate()
        assert tune.lookup("anything") is None
    assert len([r for r in caplog.records if "ignoring tuning table" in r.message]) == 1
    # and recording over it starts a valid table
    tune.record({"k": {"winner": "w"}})
    assert json.loads(tune.user_path().read_text())["entries"] == {"k": {"winner": "w"}}


def _entry(winner, first=None):
    """An entry whose winner beat `first` (spec order's choice) clearly, or ran alone."""
    times = {first: 2.0, winner: 1.0} if first else {winner: 1.0}
    return {"winner": winner, "times_us": times}


def test_dispatch_takes_the_tuned_winner_and_devices_do_not_mix(tables):
    a, b = _triton_f32()[:2]
    bucket = fba.tune_bucket(**SHAPE)
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket): _entry(b.name, first=a.name),
                 tune.key("fused_bias_act", OTHER_DEVICE, "float32", bucket): _entry(a.name)})
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", bucket)
    assert (kernel.name, why) == (b.name, "tuned")
    # an untuned bucket with the same flags takes the nearest tuned bucket's winner when it
    # beat spec order's choice clearly there, not on a narrow win
    near_bucket = fba.tune_bucket(7, 40, True)  # one class (rows 4 -> 8) away
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", near_bucket)
    assert (kernel.name, why) == (b.name, f"tuned nearby ({bucket})")
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket):
                 {"winner": b.name, "times_us": {a.name: 1.05, b.name: 1.0}}})
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", near_bucket)
    assert why in ("spec order", "fallback")
    # other flags (no y) are not comparable: spec order (the first runnable variant is a
    # CUDA one, which cannot be built without a GPU here, so the first Triton variant loads)
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", fba.tune_bucket(3, 40, False))
    assert why in ("spec order", "fallback")
    # a device whose table names something else: OTHER_DEVICE's entry is not used
    tuning_table.device_key = lambda index: "Third GPU|sm_90|66"
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", bucket)
    assert why != "tuned"


def test_a_winner_that_cannot_take_the_shape_gives_way_to_its_buckets_runner_up(tables, monkeypatch):
    # a variant built for part of a bucket's range (linear_logp's gemv kernel: N <= 16) must
    # not serve a call it cannot take: the same entry's next-best candidate that can does
    a, b, c = _triton_f32()[:3]
    monkeypatch.setattr(fba, "variant_fits", lambda v, shape: v.name != b.name or shape["rows"] < 8, raising=False)
    bucket = fba.tune_bucket(**SHAPE)
    times = {a.name: 2.0, b.name: 1.0, c.name: 1.5, tune.REFERENCE: 1.8}
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket): {"winner": b.name, "times_us": times}})
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", bucket, SHAPE)
    assert (kernel.name, why) == (b.name, "tuned")  # rows 3: the winner takes it
    big = {**SHAPE, "rows": 9}
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", bucket, big)
    assert kernel.name == c.name and why == f"tuned, runner-up ({b.name} does not take the shape)"
    # the reference, when it is the runner-up
    times[c.name] = 3.0
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket): {"winner": b.name, "times_us": times}})
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", bucket, big)
    assert kernel is None and why.startswith("tuned, runner-up")
    # a nearby bucket's entry, carried over, gives way the same way (the family's own veto on
    # wide row tiles at 40 columns set aside: another test's subject)
    monkeypatch.setattr(fba, "nearby_transfers", lambda shape, bucket, variant: True)
    near = fba.tune_bucket(17, 40, True)
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", near, {**SHAPE, "rows": 17})
    assert kernel is None and why == f"tuned nearby ({bucket}), runner-up ({b.name} does not take the shape)"
    # an entry that recorded no times (a hand-written table) names no runner-up: spec order
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket): {"winner": b.name}})
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", bucket, big)
    assert why in ("spec order", "fallback") and (kernel is None or kernel.name != b.name)


def test_a_family_vetoes_a_nearby_winner_where_its_own_rule_knows_better(tables):
    """`nearby_transfers`: logmatmul keeps a nearby bucket's winner for B <= 16 and for rows
    beyond the tuned ones at the same N and K classes, and otherwise runs its batch rule;
    fused_bias_act refuses a Triton row tile more than twice as wide as the call's bucket."""
    from kgen.families import logmatmul as lmm

    f32 = dispatch.runnable("logmatmul", "float32", CUDA0)
    wide = next(v for v in f32 if v.backend == "triton" and v.params["block_b"] == 128)
    first = f32[0].name

    def choose(B, N, K):
        shape = {"B": B, "N": N, "K": K}
        return dispatch.choose("logmatmul", CUDA0, "float32", lmm.tune_bucket(**shape), shape)

    tuned = lmm.tune_bucket(256, 1024, 1024)
    tune.record({tune.key("logmatmul", FAKE_DEVICE, "float32", tuned): _entry(wide.name, first=first)})
    assert choose(200, 1000, 1000) == (dispatch.load(wide), "tuned")
    kernel, why = choose(1000, 1000, 1000)  # rows beyond the tuned ones, same N and K classes
    assert (kernel.name, why) == (wide.name, f"tuned nearby ({tuned})")
    for B, N, K in ((100, 300, 545), (100, 2500, 1024), (130, 300, 1024)):  # other classes / fewer rows
        kernel, why = choose(B, N, K)
        rule = lmm.rules._by_batch(f32, B, N, K)
        assert why == "untuned rule" and kernel.name == rule.name != wide.name, (B, N, K)
    kernel, why = choose(1000, 1000, 1001)  # odd K: a 128-row tile would load one element at a time
    assert why == "untuned rule" and kernel.params["block_b"] == lmm.rules.ODD_K_ROWS
    assert lmm.nearby_transfers({"B": 8, "N": 300, "K": 545}, tuned, wide)
    assert lmm.rules.TUNED_ROWS == max(s["B"] for s in lmm.TUNE_SHAPES)

    # fused_bias_act: the cols <= 1024 bucket's 1024-wide row tile does not serve 168 columns
    row_tile = next(v for v in _triton_f32() if v.params["order"] == "down" and v.params["block_cols"] == 1024)
    flat = next(v for v in _triton_f32() if v.params["order"] == "flat")
    tuned = fba.tune_bucket(10000, 1000, True)
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float32", tuned): _entry(row_tile.name, first=flat.name)})
    for cols, carried in ((168, False), (264, True), (4000, True)):
        shape = {"rows": 10000, "cols": cols, "has_y": True}
        kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", fba.tune_bucket(**shape), shape)
        assert (why == f"tuned nearby ({tuned})") == carried and (kernel.name == row_tile.name) == carried, cols
    assert fba.nearby_transfers({"rows": 9, "cols": 168, "has_y": True}, tuned, flat)


def test_a_family_vetoes_its_own_buckets_winner_at_a_shape_it_fails(tables, monkeypatch):
    """`tuned_transfers`: logmatmul's bucket tuned at an even K keeps its wide tl.dot winner
    at every even K of the bucket, but an odd K (where that tile loads one element at a time)
    goes to the batch rule, memoised per shape (not for the bucket); an odd-K probe keeps it.
    A CUDA winner is vetoed where K is not whole 16-byte vectors."""
    from kgen.families import logmatmul as lmm

    f32 = dispatch.runnable("logmatmul", "float32", CUDA0)
    wide = next(v for v in f32 if v.backend == "triton" and v.params["block_b"] == 128)
    bucket = lmm.tune_bucket(256, 1024, 1024)
    entry = {**_entry(wide.name, first=f32[0].name), "shape": {"B": 256, "N": 1024, "K": 1024}}
    tune.record({tune.key("logmatmul", FAKE_DEVICE, "float32", bucket): entry})

    def choose(B, N, K):
        shape = {"B": B, "N": N, "K": K}
        assert lmm.tune_bucket(**shape) == bucket
        return dispatch.choose("logmatmul", CUDA0, "float32", bucket, shape)

    assert choose(138, 535, 780) == (dispatch.load(wide), "tuned")
    kernel, why = choose(138, 535, 779)
    rule = lmm.rules._by_batch(f32, 138, 535, 779)
    assert kernel.name == rule.name != wide.name
    assert why == f"untuned rule (the tuned winner {wide.name} vetoed for the shape)"
    assert not dispatch.holds_for_bucket(why)
    # a hand-written probe without the family's dimensions: not readable by the rule, left
    # out of what it sees (a KeyError escaped into the op); the entry's own shape still vetoes
    bare = {**entry, "probes": [{"shape": {"rows": 128, "cols": 1024}, "times_us": entry["times_us"]}]}
    tune.record({tune.key("logmatmul", FAKE_DEVICE, "float32", bucket): bare}, replace=True)
    assert choose(138, 535, 779)[0].name == rule.name
    # measured at an odd K too: the table knows, the winner stays
    odd = {**entry, "shape": {"B": 200, "N": 600, "K": 777}}
    tune.record({tune.key("logmatmul", FAKE_DEVICE, "float32", bucket): {**entry, "probes": [odd]}}, replace=True)
    assert choose(138, 535, 779) == (dispatch.load(wide), "tuned")
    # the op memoises a tuned choice per bucket and K's parity: an even K's tuned winner is not
    # handed to an odd K of the same bucket
    calls = []

    def fake_choose(device, dtype, B, N, K):
        calls.append(K)
        return ("rule", "untuned rule (vetoed)") if K % 2 else ("wide", "tuned")

    monkeypatch.setattr(lmm.op, "_choose", fake_choose)
    monkeypatch.setattr(lmm.op, "_MODULES", {})
    monkeypatch.setattr(lmm.op, "_BY_SHAPE", {})
    module = functools.partial(lmm.op._module, CUDA0, torch.float32)
    assert [module(138, 535, 780), module(140, 600, 788), module(138, 535, 779), module(140, 600, 701)] == \
        ["wide", "wide", "rule", "rule"]
    assert calls == [780, 779, 701]  # the even K's choice served K's class; each odd K chose anew
    assert module(140, 600, 782) == "wide" and calls[-1] == 782  # K % 8 == 6: a class of its own
    # the small-batch forms and the 16-row tile load along K whatever its parity: never vetoed
    narrow = next(v for v in f32 if v.backend == "triton" and v.params["block_b"] == lmm.rules.ODD_K_ROWS)
    assert lmm.tuned_transfers({"B": 138, "N": 535, "K": 779}, [{"B": 256, "N": 1024, "K": 1024}], narrow)
    assert lmm.tuned_transfers({"B": 138, "N": 535, "K": 779}, [{"B": 256, "N": 1024, "K": 1024}], None)
    # a CUDA winner where K is not whole 16-byte vectors of x's dtype (w float32 or x's dtype):
    # the form would hand the call to its Triton companion, the small-batch form, at any batch
    probes = [{"B": 64, "N": 4096, "K": 4096}]
    for dtype, aligned, short in (("float32", 3000, 3002), ("bfloat16", 3000, 3004)):
        cuda = next(v for v in dispatch.runnable("logmatmul", dtype, CUDA0) if v.backend == "cuda")
        assert lmm.tuned_transfers({"B": 50, "N": 3000, "K": aligned}, probes, cuda)
        assert not lmm.tuned_transfers({"B": 50, "N": 3000, "K": short}, probes, cuda)


def test_untuned_shapes_go_by_the_familys_rule(tables):
    """Step 5 with a family's `untuned_order` (fused_mlp): its order, not spec order's, and
    the reference where it leaves nothing; a tuned bucket still takes its winner."""
    import kgen.families.fused_mlp as fm

    def choose(widths, B):
        shape = {"B": B, "widths": "-".join(map(str, widths))}
        return dispatch.choose("fused_mlp", CUDA0, "bfloat16", fm.tune_bucket(**shape), shape)

    assert choose((1024, 4096, 1024), 256) == (None, "untuned rule")  # spec order: a generic variant
    kernel, why = choose((32, 64, 64, 1), 300)
    assert (kernel.name, why) == ("triton_mw4096_m32_k64_w4_bf16", "untuned rule")
    shape = {"B": 300, "widths": "1024-4096-1024"}
    tune.record({tune.key("fused_mlp", FAKE_DEVICE, "bfloat16", fm.tune_bucket(**shape)):
                 _entry("triton_mw4096_m64_k64_w4_bf16")})
    kernel, why = choose((1024, 4096, 1024), 300)
    assert (kernel.name, why) == ("triton_mw4096_m64_k64_w4_bf16", "tuned")


def test_linear_logp_gemv_variants_fit_up_to_block_m_rows():
    vs = dispatch.shipped_spec("linear_logp").variants
    gemv = [v for v in vs if v.params.get("kernel") == "gemv"]
    tiled = [v for v in vs if v.backend == "cuda" and v.params.get("kernel") != "gemv"]
    assert gemv and tiled
    for v in gemv:
        m = v.params["block_m"]
        assert llp.variant_fits(v, {"N": m, "D": 64, "V": 100})
        assert not llp.variant_fits(v, {"N": m + 1, "D": 64, "V": 100})
    assert all(llp.variant_fits(v, {"N": 5000, "D": 64, "V": 100}) for v in tiled + [v for v in vs if v.backend == "triton"])


def test_nearest_bucket():
    def entries(*buckets):
        return {tune.key("f", FAKE_DEVICE, "float32", b): _entry(b) for b in buckets}

    tune.TABLES._merged = entries("N<=1.D<=1024", "N<=64.D<=1024", "N<=4096.D<=4096", "N<=8.D<=1024.flag")
    try:
        near = lambda b: tune.nearest(tune.key("f", FAKE_DEVICE, "float32", b))  # noqa: E731
        assert near("N<=4.D<=1024")[1]["winner"] == "N<=1.D<=1024"  # 2 classes away vs 4
        assert near("N<=32.D<=1024")[1]["winner"] == "N<=64.D<=1024"
        assert near("N<=8192.D<=2048")[1]["winner"] == "N<=4096.D<=4096"
        assert near("N<=256.D<=256") is None  # 2 + 2 classes from the nearest: too far
        assert near("N<=1024.D<=16384") is None and near("N<=128.D<=2048")[1]["winner"] == "N<=64.D<=1024"
        # a family's TUNE_FREE_DIMS do not count toward the bound (still toward nearness)
        free = lambda b: tune.nearest(tune.key("linear_logp", FAKE_DEVICE, "float32", b))  # noqa: E731
        tune.TABLES._merged = {tune.key("linear_logp", FAKE_DEVICE, "float32", b): _entry(b)
                               for b in ("N<=4096.D<=4096.V<=65536", "N<=512.D<=4096.V<=65536")}
        assert free("N<=65536.D<=4096.V<=65536")[1]["winner"] == "N<=4096.D<=4096.V<=65536"
        assert free("N<=65536.D<=4096.V<=524288") is None  # V: 3 classes over; N does not count
        assert free("N<=65536.D<=8192.V<=131072")[1]["winner"] == "N<=4096.D<=4096.V<=65536"
        assert free("N<=4096.D<=512.V<=65536") is None  # D: 3 classes
        assert near("N<=8.D<=1024.other") is None  # flags must match
        assert tune.nearest(tune.key("f", OTHER_DEVICE, "float32", "N<=1.D<=1024")) is None
        assert tune.nearest(tune.key("f", FAKE_DEVICE, "float16", "N<=1.D<=1024")) is None
    finally:
        tune.TABLES.invalidate()


def test_a_stand_in_entry_strictly_closer_than_its_own_flags_serves():
    """nearest searches a bucket's own flags and its stand-in's (fused_mlp: `padded` -> none):
    the stand-in's entry serves where it is strictly closer (padded weights tuned at B <= 4096
    only: B = 32768 takes the dense B <= 16384 winner, B = 64 the dense B <= 128 one), its own
    on a tie or where closer."""
    def key(b):
        return tune.key("fused_mlp", FAKE_DEVICE, "bfloat16", b)

    tune.TABLES._merged = {key(b): _entry(b) for b in ("w8-8.B<=4096.padded", "w8-8.B<=16384", "w8-8.B<=128")}
    try:
        def near(b):
            return tune.nearest(key(b))[1]["winner"]

        assert near("w8-8.B<=32768.padded") == "w8-8.B<=16384"
        assert near("w8-8.B<=64.padded") == "w8-8.B<=128"
        assert near("w8-8.B<=2048.padded") == "w8-8.B<=4096.padded"
        assert near("w8-8.B<=8192.padded") == "w8-8.B<=4096.padded"  # 1 class from both: its own
        assert near("w8-8.B<=8192") == "w8-8.B<=16384"  # a dense bucket never takes a padded entry
    finally:
        tune.TABLES.invalidate()


def test_a_vec8_bucket_nobody_tuned_takes_the_tail_entry_of_its_sizes(tables):
    a, b, c = _triton_f32()[:3]
    vec8, tail = fba.tune_bucket(1000, 4100), fba.tune_bucket(1000, 4102)
    k_vec8, k_tail = (tune.key("fused_bias_act", FAKE_DEVICE, "float32", x) for x in (vec8, tail))
    assert tune.stand_in(k_vec8) == k_tail and tune.stand_in(k_tail) is None
    # a near-tie (no margin to carry it to a nearby bucket) still serves the same sizes
    tune.record({k_tail: {**_entry(a.name), "times_us": {a.name: 10.0, b.name: 10.1}}})
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", vec8)
    assert (kernel.name, why) == (a.name, f"tuned as {tail}")
    # ... and nearby vec8 buckets search the tail entries when no vec8 one is tuned
    far = fba.tune_bucket(5000, 4100)
    near = tune.nearest(tune.key("fused_bias_act", FAKE_DEVICE, "float32", far))
    assert near[0] == k_tail
    # a vec8 entry of its own wins over the stand-in, and over tail entries nearby
    tune.record({k_vec8: _entry(c.name)})
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", vec8)
    assert (kernel.name, why) == (c.name, "tuned")
    assert tune.nearest(tune.key("fused_bias_act", FAKE_DEVICE, "float32", far))[0] == k_vec8
    # the tail bucket never takes the vec8 one's entry
    assert dispatch.choose("fused_bias_act", CUDA0, "float32", tail)[0].name == a.name


def test_the_user_table_overrides_the_shipped_one(tables):
    a, b = _triton_f32()[:2]
    bucket = fba.tune_bucket(**SHAPE)
    k = tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket)
    (tables / "gpu.json").write_text(json.dumps({"format": tune.FORMAT, "entries": {k: _entry(a.name)}}))
    tuning_table._shipped.cache_clear()
    tune.TABLES.invalidate()
    assert dispatch.choose("fused_bias_act", CUDA0, "float32", bucket)[0].name == a.name
    tune.record({k: _entry(b.name)})
    assert dispatch.choose("fused_bias_act", CUDA0, "float32", bucket)[0].name == b.name


def test_only_a_tuned_choice_holds_for_its_bucket():
    """An op memoises choose's result per bucket only where it is the bucket's (tuned); the
    untuned rule's, a nearby bucket's, spec order's and a runner-up's are the shape's own."""
    for why in ("tuned", "autotuned", "tuned as B<=256.N<=512.K<=1024"):
        assert dispatch.holds_for_bucket(why), why
    for why in ("untuned rule", "tuned nearby (B<=256.N<=1024.K<=1024)", "spec order", "spec order, by shape",
                "fallback", "forced", "tuned, runner-up (gemv does not take the shape)"):
        assert not dispatch.holds_for_bucket(why), why


def test_a_reference_winner_dispatches_to_the_reference(tables):
    bucket = fba.tune_bucket(**SHAPE)
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket): _entry(tune.REFERENCE)})
    assert dispatch.choose("fused_bias_act", CUDA0, "float32", bucket) == (None, "tuned")


def test_a_stale_winner_falls_back_to_spec_order(tables):
    bucket = fba.tune_bucket(**SHAPE)
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket): _entry("no_such_variant")})
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", bucket)
    assert why != "tuned"


def test_forced_variants_override_the_table(tables, monkeypatch):
    a, b = _triton_f32()[:2]
    bucket = fba.tune_bucket(**SHAPE)
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket): _entry(b.name)})
    monkeypatch.setenv("KGEN_VARIANT", a.name)
    assert dispatch.choose("fused_bias_act", CUDA0, "float32", bucket)[0].name == a.name
    monkeypatch.delenv("KGEN_VARIANT")
    monkeypatch.setenv("KGEN_BACKEND", "reference")
    assert dispatch.choose("fused_bias_act", CUDA0, "float32", bucket) == (None, "forced")


def test_online_tuning_records_the_bucket_once(tables, monkeypatch):
    a = _triton_f32()[0]
    calls = []

    def fake_tune(family, device, dtype, shape):
        calls.append(shape)
        return tune.Result(tune.key(family, FAKE_DEVICE, dtype, fba.tune_bucket(**shape)),
                           {a.name: 1.0, tune.REFERENCE: 2.0}, a.name)

    monkeypatch.setattr(tune, "tune", fake_tune)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("KGEN_AUTOTUNE", "1")
    bucket = fba.tune_bucket(**SHAPE)
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", bucket, SHAPE)
    assert (kernel.name, why) == (a.name, "autotuned")
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", bucket, SHAPE)
    assert (kernel.name, why) == (a.name, "tuned") and len(calls) == 1
    assert json.loads(tune.user_path().read_text())["entries"][
        tune.key("fused_bias_act", FAKE_DEVICE, "float32", bucket)]["winner"] == a.name


def test_no_online_tuning_during_graph_capture(tables, monkeypatch):
    monkeypatch.setattr(tune, "tune", lambda *a, **k: pytest.fail("tuned during capture"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setenv("KGEN_AUTOTUNE", "1")
    kernel, why = dispatch.choose("fused_bias_act", CUDA0, "float32", fba.tune_bucket(**SHAPE), SHAPE)
    assert why in ("spec order", "fallback")


def test_concurrent_writers_keep_every_entry(tables, tmp_path):
    script = textwrap.dedent("""
        import sys
        from kgen.runtime import tune
        for i in range(25):
            tune.record({f"k|{sys.argv[1]}|{i}": {"winner": "w"}})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)]) for n in range(3)]
    assert all(p.wait() == 0 for p in procs)
    entries = json.loads(tune.user_path().read_text())["entries"]
    assert len(entries) == 75


def test_shipped_tables_are_valid():
    """Every table kgen ships parses, names known variants, and its winner is the one the
    tie rule picks from its recorded times (kept in measurement order)."""
    from kgen.runtime.tuning_table import FORMAT, SHIPPED_DIR

    files = sorted(SHIPPED_DIR.glob("*.json"))
    assert files, "kgen ships tuning tables"
    names = {}  # family -> its shipped spec's variant names
    for f in files:
        data = json.loads(f.read_text())
        assert data["format"] == FORMAT
        for k, e in data["entries"].items():
            family, _, _, _, dtype, bucket = k.split("|")
            if family not in names:
                names[family] = {v.name for v in dispatch.shipped_spec(family).variants}
            assert e["winner"] in names[family] | {tune.REFERENCE}, (f.name, k)
            for p in tune.probes(e):
                assert set(p["times_us"]) == set(e["times_us"]), (f.name, k)
                if "confirm_us" in p:  # spec order's choice re-timed against the pick (tune.confirm)
                    assert next(iter(p["times_us"])) in p["confirm_us"] and len(p["confirm_us"]) == 2, (f.name, k)
            if len(tune.probes(e)) > 1:  # a bucket tuned at several shapes: each named, once
                shapes = [json.dumps(p.get("shape"), sort_keys=True) for p in tune.probes(e)]
                assert "null" not in shapes and len(set(shapes)) == len(shapes), (f.name, k)
            assert e["winner"] == tune.bucket_winner(e), (f.name, k)
            if "choices_us" in e:  # a family's further choices (fused_mlp's backward): known options, as timed
                assert e["choices"] == tune.bucket_choices(e), (f.name, k)
                if family == "fused_mlp":
                    from kgen.families.fused_mlp import tuning as fm_tuning

                    assert set(e["choices_us"]["backward"]) <= set(fm_tuning.BACKWARDS), (f.name, k)


# --------------------------------------------------------------------------- GPU


SLOW_SPEC = """\
family: fused_bias_act
dtypes: [float32]
variants:
  - backend: triton
    block_cols: 32
    rows: 16
    num_warps: 1
  - backend: triton
    block_cols: 2048
    rows: 1
    num_warps: 4
"""


@pytest.mark.gpu
def test_gpu_a_deliberately_slow_variant_never_wins(tmp_path):
    p = tmp_path / "slow.yaml"
    p.write_text(SLOW_SPEC)
    s = spec_mod.load(p)
    slow = next(v for v in s.variants if v.params["block_cols"] == 32)  # 32 x 16 per 1-warp program
    dev = torch.device("cuda", torch.cuda.current_device())
    for shape in ({"rows": 4096, "cols": 4096, "has_y": True}, {"rows": 8000, "cols": 1000, "has_y": False}):
        res = tune.tune("fused_bias_act", dev, "float32", shape, variants=list(s.variants), min_us=200)
        assert res.winner != slow.name, res.times
        assert res.times[slow.name] > min(res.times.values())


@pytest.mark.gpu
def test_gpu_online_tuning_leaves_the_callers_tensors_untouched(tmp_path, monkeypatch):
    monkeypatch.setenv("KGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KGEN_AUTOTUNE", "1")
    # no shipped tables: a bucket they hold is never tuned online (333 x 4104's is, since the
    # thirteenth session's H100 table)
    # (_shipped reads the folder once per process: an earlier test's dispatch may have read it)
    monkeypatch.setattr(tuning_table, "SHIPPED_DIR", tmp_path / "no-shipped-tables")
    tuning_table._shipped.cache_clear()
    tune.TABLES.invalidate()
    fba.op._KERNELS.clear()
    try:
        x = torch.randn(333, 4104, device="cuda", dtype=torch.bfloat16)
        b, y = torch.randn(4104, device="cuda", dtype=torch.bfloat16), torch.randn_like(x)
        x0, b0, y0 = x.clone(), b.clone(), y.clone()
        fba.fused_bias_act(x, b, y, alpha=0.5, act="gelu", inplace=True)  # tunes, then runs once
        assert torch.equal(b, b0) and torch.equal(y, y0)
        ref = fba.reference(x0, b0, y0, 0.5, "gelu", compute=torch.float64)
        err = ((x.double() - ref).abs() / (1e-5 + 1e-2 * ref.abs())).max().item()
        assert err <= 1.0  # applied exactly once: a second application would be far off
        assert json.loads(tune.user_path().read_text())["entries"]
    finally:
        monkeypatch.undo()
        tuning_table._shipped.cache_clear()
        tune.TABLES.invalidate()
        fba.op._KERNELS.clear()


@pytest.mark.gpu
def test_gpu_timer_reports_the_larger_of_host_and_gpu_time():
    """cuda_timer's two halves, checked on calls of known cost (bounds are wide: they test
    what is measured, not how fast anything is): ~200 us of host work around a tiny kernel
    measures as host-bound, a ~300 us spin kernel with a cheap launch as GPU-bound."""
    import time

    x = torch.zeros(1, device="cuda")
    cycles = timing._sleep_cycles_per_us(torch.cuda.current_device())

    def host_bound():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 200e-6:
            pass
        x.add_(1)

    def gpu_bound():
        torch.cuda._sleep(int(300 * cycles))

    assert 180 <= timing.cuda_timer(host_bound, 2000) <= 600
    assert 250 <= timing.cuda_timer(gpu_bound, 3000) <= 450


def test_tune_cli_tf32_jobs():
    """`kgen tune --tf32 both` tunes float32 twice (TF32 off, on) only where the family's
    buckets depend on the setting (fused_mlp's `bucket_extras`); other dtypes and families
    once, under the current setting (None)."""
    from kgen import cli, tune_cli
    from kgen.families import fused_mlp as fm

    shapes = [{"B": 128, "widths": "13-512-256-64-16"}]
    both = tune_cli.jobs(fm, ["float32", "bfloat16"], shapes, "both")
    assert [(d, m) for d, _, m in both] == [("float32", False), ("float32", True), ("bfloat16", None)]
    assert [m for _, _, m in tune_cli.jobs(fm, ["float32"], shapes, "on")] == [True]
    assert [m for _, _, m in tune_cli.jobs(fm, ["float32"], shapes, None)] == [None]
    assert [m for _, _, m in tune_cli.jobs(fba, ["float32"], [SHAPE], "both")] == [None]  # no TF32 in its buckets
    args = cli.parser().parse_args(["tune", "kgen/specs/fused_mlp.yaml", "--dtype", "float32", "--tf32", "both"])
    assert args.tf32 == "both"


def test_tune_cli_keeps_every_shape_of_a_bucket_and_says_so(tables, labelled_runners, monkeypatch, tmp_path, capsys):
    """`kgen tune --shapes` with two shapes of one bucket (the CLI's own path, the tuner's
    timer faked): both are the entry's probes, the winner is chosen over them and the run
    says which; `--replace` starts the bucket afresh."""
    from kgen import cli

    a, b = _triton_f32()[:2]
    times = {40: {a.name: 10.0, b.name: 12.0}, 48: {a.name: 13.0, b.name: 10.0}}
    real_tune = tune.tune

    def fake_tune(family, device, dtype, shape, variants=None, min_us=0.0):
        return real_tune(family, torch.device("cpu"), dtype, shape, variants=[a, b],
                         timer=lambda fn, us: times[fn.cols].get(fn.candidate, 50.0))

    built = []
    monkeypatch.setattr(tune, "tune", fake_tune)
    monkeypatch.setattr(dispatch, "prebuild", lambda vs: built.append(sorted(v.name for v in vs)) or {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    out = tmp_path / "t.json"
    argv = ["tune", "kgen/specs/fused_bias_act.yaml", "--dtype", "float32", "--out", str(out)]
    assert cli.main([*argv, "--shapes", "3x40", "3x48"]) == 0
    # every CUDA candidate built once, up front (nvcc in parallel), before the first timing
    # (then each tune.tune's own prebuild: cache hits on a GPU machine)
    assert built[0] == sorted(v.name for v in dispatch.runnable("fused_bias_act", "float32", CUDA0)
                              if v.backend == "cuda") and built[0]
    entries = json.loads(out.read_text())["entries"]
    assert len(entries) == 2  # has_y True / False (TUNE_VARIATIONS), one bucket each
    for e in entries.values():
        assert [p["shape"]["cols"] for p in tune.probes(e)] == [40, 48]
        assert e["winner"] == tune.bucket_winner(e) == b.name  # 1.2x at 40 against a's 1.3x at 48
    printed = capsys.readouterr().out
    assert "2 shapes" in printed and "at worst 1.200x" in printed
    assert cli.main([*argv, "--shapes", "3x40", "--replace"]) == 0
    entries = json.loads(out.read_text())["entries"]
    assert all(len(tune.probes(e)) == 1 and e["winner"] == a.name for e in entries.values())


def test_tune_cli_builds_only_the_cuda_candidates_some_shape_can_take(tables, monkeypatch):
    """linear_logp's gemv variants take N <= 16: built up front for an N = 8 job, not for
    N = 4096 alone; every other CUDA candidate either way, each once."""
    from rich.console import Console

    from kgen import tune_cli

    spec = dispatch.shipped_spec("linear_logp")
    built = []
    monkeypatch.setattr(dispatch, "prebuild", lambda vs: built.append([v.name for v in vs]) or {})
    cuda = [v.name for v in dispatch.runnable("linear_logp", "bfloat16", CUDA0, spec=spec) if v.backend == "cuda"]
    gemv = {v.name for v in spec.variants if v.params.get("kernel") == "gemv"}
    assert gemv & set(cuda) and set(cuda) - gemv
    big = {"N": 4096, "D": 64, "V": 300}
    tune_cli.build_first(Console(), spec, CUDA0, [("bfloat16", big, None)])
    tune_cli.build_first(Console(), spec, CUDA0, [("bfloat16", big, None), ("bfloat16", {**big, "N": 8}, None)])
    assert sorted(built[0]) == sorted(set(cuda) - gemv)
    assert sorted(built[1]) == sorted(cuda)


def test_tune_show_marks_entries_timed_without_host_cost(tables, capsys):
    """`kgen tune --show` lists the tables and names the entries from before the tuner timed
    the host's launch cost (no `gpu_us`), which can be wrong where calls are host-bound."""
    from kgen import cli

    old = tune.key("fused_bias_act", FAKE_DEVICE, "float32", "rows<=4.cols<=64.vec16.y")
    new = tune.key("fused_bias_act", FAKE_DEVICE, "float32", "rows<=4.cols<=64.vec16.no-y")
    tune.record({old: {"winner": "a", "times_us": {"a": 5.0, "reference": 9.0}},
                 new: {"winner": "a", "times_us": {"a": 5.0, "reference": 9.0}, "gpu_us": {"a": 4.0, "reference": 9.0}}})
    assert cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert out.count("no host timing") == 1 and "1 of 2 entries were timed without" in out


def test_tune_show_one_row_a_bucket_and_every_time_on_request(tables, capsys):
    """`kgen tune --show`: per bucket the winner, its time, the runner-up and how much slower
    it is (readable however many candidates a family has); `--times` every candidate's time
    as a column; SPEC and --dtype narrow what is shown."""
    from kgen import cli

    a, b, c = "sm90_a", "sm90_b", "sm90_c"
    k = tune.key("fused_bias_act", FAKE_DEVICE, "float32", "rows<=4.cols<=64.vec16.y")
    times = {a: 5.0, b: 4.0, c: 4.6, "reference": 9.0}
    tune.record({k: {"winner": b, "times_us": times, "gpu_us": dict(times)},
                 tune.key("fused_bias_act", FAKE_DEVICE, "bfloat16", "rows<=4.cols<=64.vec16.y"):
                     {"winner": a, "times_us": {a: 1.0}, "gpu_us": {a: 1.0}},
                 tune.key("linear_logp", FAKE_DEVICE, "float32", "N<=1.D<=64.V<=128"): {"winner": c}})
    assert cli.main(["tune", "--show", "kgen/specs/fused_bias_act.yaml", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "rows<=4.cols<=64.vec16.y" in line)
    cells = [x.strip() for x in row.strip("│ ").split("│")]
    assert cells[:7] == ["rows<=4.cols<=64.vec16.y", b, "4.0", c, "1.150x", "4", "1"]
    assert "bfloat16" not in out and "linear_logp" not in out and "sm90_a" not in out
    assert cli.main(["tune", "--show", "--times"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in (a, b, c)) and "linear_logp" in out and "9.0" in out
    # an entry without times (a hand-written table) shows its winner and dashes
    assert cli.main(["tune", "--show", "kgen/specs/linear_logp.yaml"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "N<=1.D<=64.V<=128" in line)
    assert [x.strip() for x in row.strip("│ ").split("│")][1:4] == [c, "-", "-"]
    assert cli.main(["tune", "kgen/specs/fused_bias_act.yaml", "--times"]) == 2  # --times goes with --show


def test_tune_names_the_tables_and_rules_as_their_own_modules_do():
    """kgen.runtime.tune re-exports the public names of tuning_table and tuning_rules (the
    namespace families and scaffold-made packages call), as the same objects: a call through
    either module runs the same code."""
    from kgen.runtime import tuning_rules

    for owner, names in ((tuning_table, ("key", "device_key", "lookup", "nearest", "stand_in", "choice", "record",
                                          "read_table", "user_path", "pow2_at_least", "TABLES", "REFERENCE")),
                         (tuning_rules, ("pick", "beats", "probes", "transfers", "worst_slowdowns", "ranking",
                                         "bucket_winner", "merged_entry", "bucket_choices"))):
        for n in names:
            assert getattr(tune, n) is getattr(owner, n), n


@pytest.mark.parametrize("bad", [
    {"winner": "w", "probes": 5}, {"winner": "w", "probes": [1]}, {"winner": "w", "times_us": [1.0]},
    {"winner": "w", "times_us": {"a": "fast"}}, {"winner": "w", "times_us": {"a": 0}}, {"winner": "w", "choices": [1]},
    {"winner": "w", "times_us": {"a": 10**400}},  # (below math.inf as an int; `--show` overflowed on it)
    # (record() merging into these raised ValueError: a probe sharing no candidate, an empty choice)
    {"winner": "a", "times_us": {"a": 1.0}, "probes": [{"shape": {"rows": 5}, "times_us": {"b": 1.0}}]},
    {"winner": "a", "times_us": {"a": 1.0}, "choices_us": {"bwd": {}}},
    {"winner": ""}, "w"])
def test_a_malformed_entry_is_left_out_with_one_warning(tables, caplog, bad):
    """A table entry kgen did not write that way (hand-edited, another tool's) is dropped
    when read, with one warning naming the file; the table's other entries, dispatch's
    lookups near it and `kgen tune --show` work; a later record keeps it on disk."""
    from kgen import cli

    good = tune.key("fused_bias_act", FAKE_DEVICE, "float16", "rows<=8.cols<=64.vec16.y")
    near = tune.key("fused_bias_act", FAKE_DEVICE, "float16", "rows<=4.cols<=64.vec16.y")
    odd = "fused_bias_act|G|sm_90|1|float16|rows<=\u00b2.cols<=64"  # a superscript digit: not a number
    tune.user_path().parent.mkdir(parents=True, exist_ok=True)
    tune.user_path().write_text(json.dumps({"format": tune.FORMAT, "entries": {
        good: {"winner": "sm90_a", "times_us": {"sm90_a": 1.0}}, near: bad, odd: {"winner": "x"}}}))
    with caplog.at_level(logging.WARNING, logger="kgen"):
        assert set(tune.TABLES.entries()) == {good}
        assert tune.nearest(near)[0] == good
        assert cli.main(["tune", "--show"]) == 0
    assert sum("malformed" in r.getMessage() for r in caplog.records) == 1
    tune.record({tune.key("fused_bias_act", FAKE_DEVICE, "float16", "x"): {"winner": "w"}})
    assert {near, odd} <= set(json.loads(tune.user_path().read_text())["entries"])
    tune.record({near: {"winner": "a", "shape": {"rows": 7}, "times_us": {"a": 2.0}}})  # (into its bucket)
    assert tune.TABLES.entries()[near]["winner"] == "a"


@pytest.mark.parametrize("text", ["{", json.dumps({"format": "kgen-tuning-2", "entries": {}}), "[" * 100000])
def test_record_moves_an_unparseable_table_aside(tables, text):
    """record() never overwrites a table it cannot parse (a newer format, a torn write): the
    old file is kept beside the new one, whose entries are the new ones."""
    path = tune.user_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    k = tune.key("fused_bias_act", FAKE_DEVICE, "float16", "rows<=8.cols<=64.vec16.y")
    tune.record({k: {"winner": "w"}})
    aside = list(path.parent.glob("tuning.json.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_text() == text
    assert list(json.loads(path.read_text())["entries"]) == [k]
    path.write_text(text)
    tune.record({k: {"winner": "w"}})  # a second time in the same second: its own name
    assert len(list(path.parent.glob("tuning.json.unreadable-*"))) == 2


def test_record_into_a_directory_raises_and_moves_nothing(tables):
    path = tune.user_path()
    path.mkdir(parents=True)
    with pytest.raises(OSError, match="cannot record into the tuning table"):
        tune.record({"k|G|sm_90|1|float16|b": {"winner": "w"}})
    assert path.is_dir() and not list(path.parent.glob("tuning.json.unreadable-*"))


@pytest.mark.parametrize("value,on", [("1", True), ("TRUE", True), (" on", True), ("yes", True), ("0", False),
                                      ("false", False), ("Off", False), ("no", False), ("", False)])
def test_autotune_switch_values(monkeypatch, value, on):
    monkeypatch.setenv("KGEN_AUTOTUNE", value)
    assert tune.autotune_enabled() is on


@pytest.mark.parametrize("value", ["00", "2", "enable", "of"])
def test_autotune_switch_typo_is_an_error(monkeypatch, value):
    from kgen.errors import KgenError
    from kgen.runtime import dispatch

    monkeypatch.setenv("KGEN_AUTOTUNE", value)
    with pytest.raises(KgenError, match="KGEN_AUTOTUNE"):
        tune.autotune_enabled()
    assert any("KGEN_AUTOTUNE" in p for p in dispatch.env_problems())


@pytest.mark.parametrize("text,match", [
    ("8192x", "expected rowsxcols"), (",", "expected rowsxcols"), ("rows=8192", "missing cols"),
    ("rows=8192,cols=1024,foo=1", "unknown dimension 'foo'"), ("rows=abc,cols=5", "positive integer"),
    ("rows=-5,cols=3", "positive integer"), ("0x0", "positive integer"), ("rows=8,cols=8,has_y=2", "a flag")])
def test_tune_shapes_are_checked_before_any_timing(text, match):
    from kgen.tune_cli import shapes_arg

    with pytest.raises(ValueError, match=match):
        shapes_arg(fba, [text])


def test_tune_shapes_keep_a_variation_given():
    from kgen.tune_cli import shapes_arg

    assert shapes_arg(fba, ["rows=8192,cols=1024,has_y=0"]) == [{"rows": 8192, "cols": 1024, "has_y": False}]
    assert shapes_arg(fba, ["8192x1024"]) == [{"has_y": True, "rows": 8192, "cols": 1024},
                                              {"has_y": False, "rows": 8192, "cols": 1024}]


def test_online_winner_that_cannot_be_recorded_serves_the_process_with_one_warning(monkeypatch, caplog):
    """KGEN_AUTOTUNE where the table cannot be written (a read-only cache): the measured winner
    is returned and kept for this process (dispatch.choose reads it), with one warning a key,
    not an exception out of the op call."""
    key = "fam|dev|sm_90|132|float32|b"
    res = types.SimpleNamespace(key=key, winner="v_fast", entry=lambda: {"winner": "v_fast"})
    calls = []
    monkeypatch.setattr(tune, "tune", lambda *a: calls.append(a) or res)

    def refuse(entries):
        raise OSError("read-only file system")

    monkeypatch.setattr(tuning_table, "record", refuse)
    monkeypatch.setattr(tune, "_session", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (CPU torch)
    with caplog.at_level(logging.WARNING, logger="kgen"):
        first = tune.tune_online("fam", None, "float32", {})
        second = tune.tune_online("fam", None, "float32", {})
    assert first == second == "v_fast" and len(calls) == 2
    assert tune._session == {key: "v_fast"}
    assert sum("could not record" in r.getMessage() for r in caplog.records) == 1
