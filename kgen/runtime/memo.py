"""Values kept per exact call signature, for the ops' eager fast paths.

A fast path may run a launcher bound at an earlier call only when this call's tensors have
the metadata it was bound for: Python type, shape, strides, dtype, device, requires_grad.
Read from Python that costs ~0.3-0.4 us a tensor (a 3-layer MLP's 7 tensors: ~2.4 us of a
~12 us call on an H200 host). torch checks the same properties before every call of a
torch.compile'd function with one C++ object, `torch._C._dynamo.guards.TensorGuards`
(~0.1 us a tensor); `CallMemo` uses it where this torch has it and it behaves as `_probe`
finds, else a tuple of the same properties read in Python (KGEN_TENSOR_GUARDS=0 forces the
tuple). TensorGuards is private API: the probe runs once per process and any surprise
(missing, another constructor, a wrong answer on the probe's tensors) falls back.

A call is `(key, tensors)`: `key` hashable, everything else the value depends on (scalars,
which optional tensors are absent, process state such as the TF32 setting); `tensors` a tuple
of tensors, always the same count for one key. Both modes find a value under the same calls:
a guard compares these properties (and the dispatch keys), and where it fails the Python
comparison decides.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def tensor_guards():
    """TensorGuards when it exists and passes the probe, else None."""
    if os.environ.get("KGEN_TENSOR_GUARDS", "1") == "0":
        return None
    try:
        from torch._C._dynamo.guards import TensorGuards

        return TensorGuards if _probe(TensorGuards) else None
    except Exception:  # noqa: BLE001 (private API: anything unexpected means "not here")
        return None


def _guard(cls, tensors):
    return cls(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
               dynamic_dims_strides=[list(t.stride()) for t in tensors])


def _probe(cls) -> bool:
    a, b = torch.zeros(2, 3), torch.zeros(3)
    g = _guard(cls, (a, b))
    same = g.check(torch.ones(2, 3), torch.ones(3))
    other = (
        (torch.zeros(3, 3), b),  # shape
        (torch.zeros(3, 2).t(), b),  # strides
        (a, b.double()),  # dtype
        (a, b.clone().requires_grad_()),  # requires_grad
        (torch.nn.Parameter(a), b),  # Python type
        (a, None),  # not a tensor
    )
    return same is True and not any(g.check(*o) for o in other)


class CallMemo:
    """At most `max_entries` values, each under a call's key and its tensors' metadata. Full:
    cleared (a process making that many signatures is not served by a memo). `size`: how
    many are kept (as len(), without a Python call: fast paths test it first).

    A guard is built by the first `get` that finds its entry by the Python comparison, in that
    caller's context: TensorGuards compares dispatch keys as the thread-local dispatch state
    shows them, which differs inside an op's implementation (where `put` runs, below
    autograd) from the caller's. A call whose guard fails but whose metadata equal an entry's
    (another thread-local dispatch state) is still found, at the Python comparison's cost, and
    the entry's guard rebuilt for that state."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._guards = tensor_guards()
        self._d: dict = {}  # key -> [[metadata, guard or None, value], ...], newest first
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def clear(self):
        self._d.clear()
        self.size = 0

    def get(self, call):
        """The value kept for this call, or None (also where `tensors` holds something else)."""
        key, tensors = call
        kept = self._d.get(key)
        if kept is None:
            return None
        if self._guards is not None:
            for e in kept:
                if e[1] is not None and e[1].check(*tensors):
                    return e[2]
        try:
            e = _find(kept, _meta(tensors))
        except AttributeError:  # not tensors
            return None
        if e is None:
            return None
        if self._guards is not None:
            e[1] = _guard(self._guards, tensors)
        return e[2]

    def has(self, call) -> bool:
        """Whether a value is kept for this call (compared in Python: builds no guard)."""
        key, tensors = call
        kept = self._d.get(key)
        return bool(kept) and _find(kept, _meta(tensors)) is not None

    def put(self, call, value):
        """Keep `value` for calls like this one (replacing what was kept for it)."""
        key, tensors = call
        meta = _meta(tensors)
        e = _find(self._d.get(key, ()), meta)
        if e is not None:
            e[1], e[2] = None, value
            return
        if self.size >= self.max_entries:
            self.clear()
        self._d.setdefault(key, []).insert(0, [meta, None, value])
        self.size += 1


def _meta(tensors) -> tuple:
    return tuple((type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors)


def _find(kept, meta):
    for e in kept:
        if e[0] == meta:
            return e
    return None
