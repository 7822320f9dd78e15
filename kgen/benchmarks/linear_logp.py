"""linear_logp benchmark: logp[i] = log_softmax(hidden[i] @ weight.T)[target[i]], bf16, at
(N, D, V) = (4096, 2048, 151936) and (8192, 4096, 128256) (`quick`: the first only).

Implementations, each timed forward and forward+backward (loss = (logp * g).sum() with a
fixed random float32 g; gradients into hidden and weight through torch.autograd.grad):
  - `hidden @ weight.T` by cuBLAS alone, the baseline; its fwd+bwd is that GEMM plus the
    two backward GEMMs of a matmul, driven by a random bf16 gradient of the logits' shape;
  - kgen.ops.linear_logp (dispatch's choice), the same with keep_logits=True (the logits
    kept for the backward; its fwd row is the forward without a gradient, which keeps
    nothing), then each bf16 variant of the spec that runs
    on the device (CUDA: forward partials by the CUDA kernel, combine and backward by
    dispatch's first Triton variant);
  - eager PyTorch (log_softmax of the float32 logits, gather) and torch.compile of it;
  - Apple's cut-cross-entropy (`-linear_cross_entropy(..., reduction="none", impl="cce")`),
    once with its default gradient filter (filter_eps="high": skips gradient blocks whose
    softmax is below bf16 eps / 32) and once exact (filter_eps=None);
  - Liger-Kernel's `liger_fused_linear_cross_entropy(..., reduction="none")` (negated).

Columns:
  ms: median of triton.testing.do_bench (it flushes L2 between calls); an implementation's
    fwd ms is the median of its PAIRED_ROUNDS paired timings (below).
  TFLOP/s: 2*N*V*D / fwd time; 6*N*V*D / fwd+bwd time (the useful flops of the three GEMMs,
    whatever an implementation recomputes).
  f+b / fwd GEMM: fwd+bwd time / the forward GEMM's time (issue 19's measure: recomputing
    the logits with O(N) memory, the floor is 4.0).
  x GEMM: fwd: paired, the median over PAIRED_ROUNDS rounds of (its time / the GEMM's time),
    the two timed back to back in each round. At a power cap the clock drifts with the
    card's temperature over a run by more than the differences that matter here (an H100
    GEMM measured 11.6 ms at the start of one run and 12.5 ms interleaved in the next), so
    a ratio to a baseline timed minutes earlier would say more about the drift than about
    the kernel. fwd+bwd: time / the baseline's time (three GEMMs), not paired.
  MiB (peak extra memory): torch.cuda.max_memory_allocated() during one call (after a
    warm-up call, so compilation and autotuning are excluded) minus memory_allocated()
    just before it. Before the call the allocator holds the inputs: hidden, weight, target,
    g (and, for the baseline's fwd+bwd, its random logits gradient). Counted: everything
    the call allocates, including its output logp (4*N bytes) and, for fwd+bwd, the
    forward's saved tensors and all workspaces; the two gradient tensors (grad_hidden,
    grad_weight: the sizes of the tensors returned, N*D*2 + V*D*2 bytes) are outputs and
    are subtracted. The forward runs on inputs that do not require grad (inference).
  logp err: max |logp - ref| over the first 64 rows, ref = float32 math (tf32 off) on the
    same bf16 inputs.
  dH err, dW err: max |grad - ref| / max |ref| for grad_hidden's first 64 rows and for
    grad_weight's rows at vocab ids 0..63 plus the first 64 targets, ref in float32.

Inputs: hidden ~ N(0, 1), weight ~ N(0, 4/D) (logits with std ~2), uniform random targets
(no ignored rows), g ~ N(0, 1). Every implementation is wrapped: an error becomes the row's
note, never the end of the run. A progress line is printed after each implementation.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time

import torch
import triton

SHAPES = [(4096, 2048, 151936), (8192, 4096, 128256)]
# Environment: KGEN_BENCH_LLP_SHAPES="N,D,V;N,D,V" replaces SHAPES; KGEN_BENCH_LLP_VARIANTS=0
# leaves out the rows of the individual kgen variants (dispatch's choice stays);
# KGEN_BENCH_LLP_NS="1,8,16" replaces the row counts of `--dispatch` (default: TUNE_SHAPES' own).


def _shapes() -> list[tuple[int, int, int]]:
    text = os.environ.get("KGEN_BENCH_LLP_SHAPES", "").strip()
    if not text:
        return SHAPES
    return [tuple(int(x) for x in item.split(",")) for item in text.split(";") if item.strip()]

CHECK_ROWS = 64
DEVICE = "cuda"
# Past this many seconds into the run, the individual kgen variants are timed forward only.
VARIANT_BWD_DEADLINE_S = 240.0
COLS = ["impl", "fwd ms", "fwd TFLOP/s", "fwd x GEMM", "fwd MiB", "fwd+bwd ms", "f+b TFLOP/s",
        "f+b x GEMM", "f+b / fwd GEMM", "f+b MiB", "logp err", "dH err", "dW err", "note"]

_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[linear_logp bench {time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)


def _free() -> None:
    gc.collect()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - a broken context shows in the next rows' notes
        _log(f"cleanup failed: {_short(e)}")


def _short(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s[:240]


def _bench(fn, quick: bool, bwd: bool) -> float:
    if quick:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=150 if bwd else 100, return_mode="median")


PAIRED_ROUNDS = 7
# Milliseconds of calls per paired timing: 30 ms held 2-3 calls of a 12 ms forward, and the
# medians of two such runs of one kernel differed by 2 % (H100); 100 ms holds 8.
PAIRED_REP_MS = 100


def _paired(fn, base, quick: bool) -> tuple[float, float]:
    """(median ms of fn, median over rounds of fn's ms / base's ms), fn and base timed back to
    back in each of PAIRED_ROUNDS rounds (3 with quick), so that clock drift moves both."""
    times, ratios = [], []
    rep = 30 if quick else PAIRED_REP_MS
    for _ in range(3 if quick else PAIRED_ROUNDS):
        b = triton.testing.do_bench(base, warmup=5, rep=rep, return_mode="median")
        f = triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")
        times.append(f)
        ratios.append(f / b)
    return sorted(times)[len(times) // 2], sorted(ratios)[len(ratios) // 2]


def _peak_extra(fn, subtract_outputs: bool) -> int:
    """Bytes: peak allocated during one call of fn minus allocated before it; with
    subtract_outputs, less the sizes of the tensors fn returns (the gradients)."""
    _free()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    if subtract_outputs:
        peak -= sum(t.numel() * t.element_size() for t in out if t is not None)
    del out
    return peak


# --------------------------------------------------------------------------- implementations


def _eager(hidden, weight, target):
    return torch.log_softmax((hidden @ weight.T).float(), -1).gather(1, target[:, None]).squeeze(1)


def _kgen_dispatch():
    from kgen import ops

    return ops.linear_logp


def _kgen_keep():
    from kgen import ops

    return lambda h, w, t: ops.linear_logp(h, w, t, keep_logits=True)


def _kgen_variant(variant):
    """(fn, context): the op with this variant's kernels. With the family's `using(mod)`
    the backward reads the forced module when it runs, so the whole fwd+bwd runs inside
    the context; an older `linear_logp(mod, ...)` takes the module directly."""
    from kgen.families import linear_logp as llp
    from kgen.runtime import dispatch

    impl = llp.implementation(dispatch.load(variant))
    return llp.linear_logp, lambda: llp.using(impl)


def _cce(filter_eps):
    from cut_cross_entropy import linear_cross_entropy

    return lambda h, w, t: -linear_cross_entropy(h, w, t, reduction="none", filter_eps=filter_eps,
                                                 impl="cce")


def _liger():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return lambda h, w, t: -liger_fused_linear_cross_entropy(h, w, t, reduction="none")


_COMPILED = None


def _compiled():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_eager, dynamic=False)
    return _COMPILED


def _dispatch_name() -> str:
    try:
        from kgen.runtime import dispatch

        k = dispatch.select("linear_logp", torch.device("cuda"), "bfloat16")
        return k.name if k is not None else "reference"
    except Exception as e:  # noqa: BLE001 - only a label
        return f"? ({_short(e)[:60]})"


# --------------------------------------------------------------------------- reference


def _reference(h, w, t, g):
    """float32 (tf32 off) logp of the first CHECK_ROWS rows, grad_hidden of those rows, and
    grad_weight at the vocab rows `cols`."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        N = h.shape[0]
        wf = w.float()
        lse = torch.empty(N, dtype=torch.float32, device=h.device)
        for r in range(0, N, 512):
            lse[r:r + 512] = torch.logsumexp(h[r:r + 512].float() @ wf.T, -1)
        rows = torch.arange(CHECK_ROWS, device=h.device)
        z = h[:CHECK_ROWS].float() @ wf.T
        logp = z[rows, t[:CHECK_ROWS]] - lse[:CHECK_ROWS]
        dz = -torch.exp(z - lse[:CHECK_ROWS, None])
        dz[rows, t[:CHECK_ROWS]] += 1
        dz *= g[:CHECK_ROWS, None]
        gh = dz @ wf
        del z, dz
        cols = torch.unique(torch.cat([torch.arange(CHECK_ROWS, device=h.device), t[:CHECK_ROWS]]))
        zc = h.float() @ wf[cols].T
        dzc = (t[:, None] == cols[None, :]).float() - torch.exp(zc - lse[:, None])
        dzc *= g[:, None]
        gw = dzc.T @ h.float()
        del wf, zc, dzc
        return logp, gh, gw, cols
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _rel(got, ref) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------- one shape


def _row(impl: str) -> dict:
    r = {c: "" for c in COLS}
    r["impl"] = impl
    return r


def _shape(spec, quick: bool, N: int, D: int, V: int, rows: list[dict]) -> None:
    """Appends one row per implementation to `rows` as each finishes."""
    torch.manual_seed(0)
    dev = DEVICE
    h = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(V, D, device=dev) * (2.0 / math.sqrt(D))).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=dev)
    g = torch.randn(N, device=dev)
    ref_logp, ref_gh, ref_gw, cols = _reference(h, w, t, g)
    _free()
    hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
    case = f"{N}x{D}x{V}"
    fwd_flop, fb_flop = 2.0 * N * V * D, 6.0 * N * V * D

    # -- the GEMM baseline
    r = _row("hidden @ weight.T (cuBLAS), baseline")
    gemm_ms = gemm_fb_ms = float("nan")
    gemm = lambda: h @ w.T  # noqa: E731
    try:
        fwd = gemm
        fwd()
        r["fwd MiB"] = _peak_extra(fwd, False) >> 20
        gemm_ms = _bench(fwd, quick, False)
        r.update({"fwd ms": gemm_ms, "fwd TFLOP/s": fwd_flop / gemm_ms / 1e9, "fwd x GEMM": 1.0})
        dlogits = torch.randn(N, V, device=dev, dtype=torch.bfloat16)  # an input: not counted

        def fb():
            return torch.autograd.grad(hg @ wg.T, (hg, wg), dlogits)

        fb()
        r["f+b MiB"] = _peak_extra(fb, True) >> 20
        gemm_fb_ms = _bench(fb, quick, True)
        r.update({"fwd+bwd ms": gemm_fb_ms, "f+b TFLOP/s": fb_flop / gemm_fb_ms / 1e9, "f+b x GEMM": 1.0,
                  "f+b / fwd GEMM": gemm_fb_ms / gemm_ms})
        del dlogits
    except Exception as e:  # noqa: BLE001 - one failed impl must not end the run
        r["note"] = _short(e)
    rows.append(r)
    _free()
    _log(f"{case} {r['impl']}: fwd {r['fwd ms']} ms, fwd+bwd {r['fwd+bwd ms']} ms {r['note']}")

    impls = [(f"kgen.ops.linear_logp (dispatch: {_dispatch_name()})", _kgen_dispatch, True),
             ("kgen.ops.linear_logp(..., keep_logits=True)", _kgen_keep, True),
             ('cut-cross-entropy 25.1 (impl="cce", filter_eps="high", its default)',
              lambda: _cce("high"), True),
             ('cut-cross-entropy 25.1 (impl="cce", filter_eps=None, exact)', lambda: _cce(None), True),
             ('liger-kernel (liger_fused_linear_cross_entropy, reduction="none")', _liger, True),
             ("eager PyTorch (log_softmax(float(h @ w.T)).gather)", lambda: _eager, True),
             ("torch.compile of the eager function", _compiled, True)]
    from kgen.runtime import dispatch

    capability = torch.cuda.get_device_capability()
    for v in spec.variants if os.environ.get("KGEN_BENCH_LLP_VARIANTS", "1") != "0" else ():
        if v.dtype == "bfloat16" and (v.backend == "triton" or dispatch.arch_runs_on(v.arch, capability)):
            impls.append((f"kgen {v.name}", lambda v=v: _kgen_variant(v), None))

    for name, make, with_bwd in impls:
        r = _row(name)
        try:
            made = make()
            fn, ctx = made if isinstance(made, tuple) else (made, contextlib.nullcontext)

            def fwd():
                with ctx():
                    return fn(h, w, t)

            # forward, inference (inputs without requires_grad)
            out = fwd()
            torch.cuda.synchronize()
            r["logp err"] = float((out[:CHECK_ROWS].float() - ref_logp).abs().max())
            del out
            r["fwd MiB"] = _peak_extra(fwd, False) >> 20
            ms, ratio = _paired(fwd, gemm, quick)
            r.update({"fwd ms": ms, "fwd TFLOP/s": fwd_flop / ms / 1e9, "fwd x GEMM": ratio})
        except Exception as e:  # noqa: BLE001
            r["note"] = "fwd: " + _short(e)
            with_bwd = False
        _free()
        if with_bwd is None:  # individual variants: fwd+bwd while the time budget allows
            with_bwd = quick or time.perf_counter() - _T0 < VARIANT_BWD_DEADLINE_S
            if not with_bwd:
                r["note"] = "fwd+bwd skipped (time budget)"
        if with_bwd:
            try:
                def fb():
                    with ctx():
                        return torch.autograd.grad((fn(hg, wg, t) * g).sum(), (hg, wg))

                gh, gw = fb()
                torch.cuda.synchronize()
                r["dH err"] = _rel(gh[:CHECK_ROWS], ref_gh)
                r["dW err"] = _rel(gw[cols], ref_gw)
                del gh, gw
                r["f+b MiB"] = _peak_extra(fb, True) >> 20
                ms = _bench(fb, quick, True)
                r.update({"fwd+bwd ms": ms, "f+b TFLOP/s": fb_flop / ms / 1e9, "f+b x GEMM": ms / gemm_fb_ms,
                          "f+b / fwd GEMM": ms / gemm_ms})
            except Exception as e:  # noqa: BLE001
                r["note"] = (r["note"] + "; " if r["note"] else "") + "fwd+bwd: " + _short(e)
        fn = fwd = fb = None
        rows.append(r)
        _free()
        _log(f"{case} {name}: fwd {r['fwd ms']} ms ({r['fwd MiB']} MiB), fwd+bwd {r['fwd+bwd ms']} ms "
             f"({r['f+b MiB']} MiB), logp err {r['logp err']}, dH {r['dH err']}, dW {r['dW err']} {r['note']}")
    del h, w, t, g, hg, wg, ref_logp, ref_gh, ref_gw, cols
    _free()


def dispatch_section(spec, quick) -> dict:
    """kgen's forward choice before (spec order) and after (tuning table) against the
    fastest candidate and the cuBLAS GEMM hidden @ weight.T, at the tuner's probes
    (TUNE_SHAPES: its (D, V) pairs, each at its row counts; KGEN_BENCH_LLP_NS="1,8" replaces
    the row counts)."""
    from kgen.bench import dispatch_effect
    from kgen.families.linear_logp import TUNE_SHAPES

    def peers(dtype, inp):
        h, w = inp["hidden"], inp["weight"]
        return {"GEMM": lambda: h @ w.T}

    shapes = tuple(dict.fromkeys((s["D"], s["V"]) for s in TUNE_SHAPES))
    default_ns = ",".join(str(n) for n in dict.fromkeys(s["N"] for s in TUNE_SHAPES))
    ns = tuple(int(n) for n in os.environ.get("KGEN_BENCH_LLP_NS", default_ns).split(","))
    cases = [(d, {"N": n, "D": dd, "V": v}) for d in ("bfloat16", "float16")
             for dd, v in shapes[: 1 if quick else None] for n in ns]
    return {"dispatch: spec order (before) vs tuning table (after), forward": dispatch_effect(
        "linear_logp", cases, peers, quick)}


def run(spec, quick) -> dict:
    global _T0
    _T0 = time.perf_counter()
    out = {}
    for N, D, V in _shapes()[:1] if quick else _shapes():
        title = f"linear_logp bf16, N x D x V = {N} x {D} x {V}"
        rows = out[title] = []
        try:
            _shape(spec, quick, N, D, V, rows)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory building the inputs
            print(f"linear_logp bench: {title}: {_short(e)}", file=sys.stderr, flush=True)
            rows.append({**_row("(rest of this shape)"), "note": _short(e)})
            _free()
    return out
