"""kgen.runtime.memo.CallMemo: a value is found exactly for calls whose key and tensors'
type, shape, strides, dtype, device and requires_grad equal the call it was kept for, in
both modes (torch's TensorGuards, the Python tuple), also when kept inside an op's
implementation (another thread-local dispatch state) and looked up outside it."""

import pytest
import torch

from kgen.runtime import memo
from kgen.runtime.memo import CallMemo


@pytest.fixture(params=["guards", "tuple"])
def make(request, monkeypatch):
    if request.param == "guards" and memo.tensor_guards() is None:
        pytest.fail("this torch's TensorGuards did not pass the probe (the fast paths lose ~1-2 us a call)")

    def new(n=4096):
        m = CallMemo(n)
        if request.param == "tuple":
            m._guards = None
        return m

    return new


def _tensors():
    return torch.randn(4, 3), torch.randn(5, 3), torch.randn(5)


def test_found_for_equal_metadata_only(make):
    m = make()
    x, w, b = _tensors()
    with torch._C._AutoDispatchBelowAutograd():  # as an op's implementation keeps it
        m.put((("k", 1), (x, w, b)), "v")
    for _ in range(2):  # the Python comparison, then the guard it built
        assert m.get((("k", 1), tuple(t.clone() for t in (x, w, b)))) == "v"
    assert m.has((("k", 1), (x, w, b))) and len(m) == 1
    others = [
        (("k", 2), (x, w, b)),  # another key
        (("k", 1), (torch.randn(4, 4), w, b)),  # shape
        (("k", 1), (torch.randn(3, 4).t(), w, b)),  # strides
        (("k", 1), (x, w.double(), b)),  # dtype
        (("k", 1), (x, w.clone().requires_grad_(), b)),  # requires_grad
        (("k", 1), (x, torch.nn.Parameter(w), b)),  # Python type
    ]
    for call in others:
        assert m.get(call) is None and not m.has(call), call[0]


def test_replace_and_bound(make):
    m = make(2)
    x, w, b = _tensors()
    m.put(("a", (x, w, b)), 1)
    m.put(("a", (x.clone(), w, b)), 2)  # the same metadata: replaced
    assert len(m) == 1 and m.get(("a", (x, w, b))) == 2
    m.put(("a", (torch.randn(2, 3), w, b)), 3)
    assert len(m) == 2 and m.get(("a", (x, w, b))) == 2 and m.get(("a", (torch.randn(2, 3), w, b))) == 3
    m.put(("b", (x, w, b)), 4)  # full: cleared, then kept
    assert len(m) == 1 and m.get(("a", (x, w, b))) is None and m.get(("b", (x, w, b))) == 4
    m.clear()
    assert not m and m.get(("b", (x, w, b))) is None


def test_not_tensors(make):
    m = make()
    x, w, b = _tensors()
    m.put(("k", (x, w, b)), "v")
    assert m.get(("k", (x, None, b))) is None and m.get(("k", (x, 3, b))) is None


def test_probe_rejects_a_checker_that_answers_wrongly():
    class Loose:
        def __init__(self, *tensors, **kw):
            pass

        def check(self, *tensors):
            return True

    assert not memo._probe(Loose)
    if memo.tensor_guards() is not None:
        assert memo._probe(memo.tensor_guards())


def test_keeps_no_tensor_alive(make):
    """The memo holds metadata (and guards built from it), never the tensors: a launcher
    kept for a call does not keep that call's activations or weights in memory."""
    import gc
    import weakref

    m = make()
    x, w, b = _tensors()
    refs = [weakref.ref(t) for t in (x, w, b)]
    m.put(("k", (x, w, b)), "v")
    assert m.get(("k", (x, w, b))) == "v"  # (builds the guard)
    del x, w, b
    gc.collect()
    assert all(r() is None for r in refs)
