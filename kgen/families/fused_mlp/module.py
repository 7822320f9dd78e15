"""kgen.nn.FusedMLP: an nn.Module holding an MLP's parameters that runs it with fused_mlp."""

from __future__ import annotations

import math
import operator

import torch
from torch import nn

from kgen.families.fused_mlp.launch import row_padded
from kgen.families.fused_mlp.op import fused_mlp
from kgen.families.fused_mlp.schema import ACTIVATIONS, MAX_LAYERS, MAX_WIDTH, fits, weight_strides

# activation module type -> fused_mlp's name (GELU only in its tanh form: checked below)
_ACT_MODULES = {nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.GELU: "gelu", nn.SiLU: "silu"}
_ACT_BUILDERS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "gelu": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU}


# The devices pad_weights lays weights out on: where the kernels run (tests add "cpu" to
# exercise the layout's bookkeeping without a GPU).
PAD_DEVICES = ("cuda",)


class FusedMLP(nn.Module):
    """Linear layers `widths[0] -> widths[1] -> ... -> widths[-1]` with `activation` after
    every layer but the last and `last_activation` after the last, run as one fused_mlp
    call. Parameters `weights[i]` `[w(i+1), w(i)]` and `biases[i]` (nn.Linear's layout and
    initialisation); `bias=False` leaves them out.

    `pad_weights=True` lays out each weight that fused_mlp's exact kernels read at a wider row
    stride (a weight of 64 KB or more whose rows are not whole 16-byte vectors: the DLRM top
    MLP's 367-wide W0; schema.weight_strides), where a spec has a variant for exactly these
    widths (the generic kernels would copy it dense each call), in row-padded storage: the same shape and values,
    rows 16-byte aligned (a view of [N, stride] storage; the padding is never read). The
    kernels then read it in place, where they would copy it into a padded scratch each call
    (one launch, ~3 us of GPU time on an H100: BENCHMARKS.md). On CUDA devices only (a CPU
    module runs PyTorch's composition, which gains nothing); kept through `.to()`, `.half()`,
    `.cuda()` (and dropped by `.cpu()`), `copy.deepcopy` and pickling. Such a parameter is not
    dense: CUDA optimizers with `fused=True` refuse it (their kernels need dense tensors; the
    default foreach ones take it; the CPU fused kernels do not check, and updated a padded
    weight wrongly), which is why it is not the default."""

    def __init__(self, widths, activation: str = "relu", last_activation: str = "none", *, bias: bool = True,
                 dtype=None, device=None, pad_weights: bool = False):
        super().__init__()
        try:
            widths = tuple(operator.index(w) for w in widths)
        except TypeError:
            raise TypeError(f"FusedMLP: widths must be a sequence of ints (w0, w1, ..., wL), got {widths!r}") from None
        if not 2 <= len(widths) <= MAX_LAYERS + 1:
            raise ValueError(f"FusedMLP: {len(widths)} widths make {len(widths) - 1} layers; 1 to {MAX_LAYERS} "
                             "are supported")
        if any(not 1 <= w <= MAX_WIDTH for w in widths):
            raise ValueError(f"FusedMLP: widths {widths} must each be in 1..{MAX_WIDTH}")
        for name, a in (("activation", activation), ("last_activation", last_activation)):
            if a not in ACTIVATIONS:
                raise ValueError(f"FusedMLP: unknown {name} {a!r}; expected one of {', '.join(ACTIVATIONS)}")
        self.widths, self.activation, self.last_activation = widths, activation, last_activation
        self.pad_weights = bool(pad_weights)
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList() if bias else None
        for i in range(len(widths) - 1):
            lin = nn.Linear(widths[i], widths[i + 1], bias=bias, dtype=dtype, device=device)
            self.weights.append(lin.weight)
            if bias:
                self.biases.append(lin.bias)
        self._lay_out()

    def reset_parameters(self) -> None:
        """Every layer initialised as nn.Linear initialises its own (weight Kaiming-uniform
        with a = sqrt(5), bias uniform in +-1/sqrt(fan_in)): what meta-device construction
        followed by `to_empty` and FSDP-style deferred initialisation call."""
        with torch.no_grad():
            for i, w in enumerate(_params(self.weights)):
                nn.init.kaiming_uniform_(w, a=math.sqrt(5))
                if self.biases is not None:
                    bound = 1 / math.sqrt(w.shape[1]) if w.shape[1] > 0 else 0
                    nn.init.uniform_(_params(self.biases)[i], -bound, bound)

    def _lay_out(self) -> None:
        """With pad_weights, each weight the exact kernels read at a wider row stride moved
        to row-padded storage (launch.row_padded; the Parameter objects kept, as `.to()` keeps
        them); a weight already laid out so, or any without pad_weights, left as it is."""
        if not getattr(self, "pad_weights", False):  # (a FusedMLP pickled before it had one)
            return
        if not _has_exact_variant(self.widths):  # (the generic kernels copy a padded weight dense each call)
            return
        held = self.weights._parameters  # (a parametrized weight is not here: left alone)
        with torch.no_grad():
            for i, w in enumerate(_params(self.weights)):
                if (held.get(str(i)) is not w or not w.is_floating_point() or w.dim() != 2
                        or w.device.type not in PAD_DEVICES):
                    continue
                s = weight_strides(self.widths, w.element_size())[i]  # (per weight: its own itemsize)
                if s != w.shape[1] and w.stride() != (s, 1):
                    w.data = row_padded(w.data, s)

    def _apply(self, fn, *args, **kwargs):
        # (.to(), .half(), .cuda() make dense copies: padded again after)
        out = super()._apply(fn, *args, **kwargs)
        self._lay_out()
        return out

    def __setstate__(self, state):
        # (copy.deepcopy and pickle: a Parameter's copy is dense)
        super().__setstate__(state)
        self._lay_out()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lists = (self.weights,) if self.biases is None else (self.weights, self.biases)
        for plist in lists:  # (the lists are never called: their pre-hooks, e.g. torch.nn.utils.prune's
            if plist._forward_pre_hooks:  # or the old weight_norm's, which recompute a weight, run here)
                _run_pre_hooks(plist)
        biases = _params(self.biases) if self.biases is not None else None
        return fused_mlp(x, _params(self.weights), biases, activation=self.activation,
                         last_activation=self.last_activation)

    def extra_repr(self) -> str:
        return (f"widths={list(self.widths)}, activation={self.activation!r}, "
                f"last_activation={self.last_activation!r}, bias={self.biases is not None}"
                + (", pad_weights=True" if self.pad_weights else ""))

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, *, pad_weights: bool = False) -> "FusedMLP":
        """The same network from an nn.Sequential of nn.Linear layers, each followed by at
        most one of nn.ReLU, nn.Sigmoid, nn.GELU(approximate="tanh"), nn.SiLU (nn.Identity
        and nested nn.Sequential are skipped through); every hidden layer's activation must
        be the same. The parameters are copied (dtype and device kept: every layer's must be
        the same), each keeping its requires_grad (a frozen layer stays frozen). Anything else
        is a TypeError or ValueError naming the module: a subclass of nn.Linear, nn.Identity or
        nn.Sequential that computes something else (its own forward: LoRA, fake quantisation),
        and any module with forward hooks (they would not run), included."""
        if not isinstance(seq, nn.Sequential):
            raise TypeError(f"FusedMLP.from_sequential: expected an nn.Sequential, got {type(seq).__name__}")
        _no_hooks(seq, "the Sequential")
        _own_forward(seq, nn.Sequential, "the Sequential")
        mods = list(_flatten(seq))
        linears, acts = [], []
        for i, m in enumerate(mods):
            _no_hooks(m, f"module {i} ({type(m).__name__})")
            if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward:
                raise TypeError(f"FusedMLP.from_sequential: module {i} is {type(m).__name__}, an nn.Linear with a "
                                "forward of its own; fused_mlp computes nn.Linear's")
            if isinstance(m, nn.Linear):
                linears.append(m)
                acts.append("none")
            elif type(m) in _ACT_MODULES:
                if isinstance(m, nn.GELU) and m.approximate != "tanh":
                    raise ValueError(f"FusedMLP.from_sequential: module {i} is nn.GELU(approximate="
                                     f"{m.approximate!r}); fused_mlp computes the tanh form only "
                                     "(nn.GELU(approximate='tanh'))")
                if not linears or acts[-1] != "none":
                    raise ValueError(f"FusedMLP.from_sequential: module {i} ({type(m).__name__}) does not "
                                     "follow an nn.Linear directly")
                acts[-1] = _ACT_MODULES[type(m)]
            else:
                raise TypeError(f"FusedMLP.from_sequential: module {i} is {type(m).__name__}; supported: nn.Linear, "
                                "nn.ReLU, nn.Sigmoid, nn.GELU(approximate='tanh'), nn.SiLU, nn.Identity")
        if not linears:
            raise ValueError("FusedMLP.from_sequential: the Sequential has no nn.Linear")
        params = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
        if len({id(p) for p in params}) != len(params):  # (copies would untie them: another model once trained)
            raise ValueError("FusedMLP.from_sequential: a parameter is shared between layers (the same nn.Linear "
                             "twice, or tied weights); FusedMLP holds each layer's own parameters")
        hidden = set(acts[:-1])
        if len(hidden) > 1:
            raise ValueError(f"FusedMLP.from_sequential: hidden layers use different activations {acts[:-1]}; "
                             "fused_mlp takes one activation for all layers but the last")
        bias = {lin.bias is not None for lin in linears}
        if len(bias) > 1:
            raise ValueError("FusedMLP.from_sequential: some nn.Linear layers have a bias and some do not")
        for a, b in zip(linears, linears[1:]):
            if b.in_features != a.out_features:
                raise ValueError(f"FusedMLP.from_sequential: nn.Linear({a.in_features}, {a.out_features}) feeds "
                                 f"nn.Linear({b.in_features}, {b.out_features})")
        w = linears[0].weight
        for i, lin in enumerate(linears):
            for p in (lin.weight, lin.bias):
                if p is not None and (p.dtype != w.dtype or p.device != w.device):
                    raise ValueError(f"FusedMLP.from_sequential: nn.Linear {i} holds {p.dtype} on {p.device}, "
                                     f"the first {w.dtype} on {w.device}; fused_mlp takes one dtype and device")
        widths = [linears[0].in_features] + [lin.out_features for lin in linears]
        out = cls(widths, hidden.pop() if hidden else "none", acts[-1], bias=bias.pop(), dtype=w.dtype,
                  device=w.device, pad_weights=pad_weights)
        with torch.no_grad():
            for i, lin in enumerate(linears):
                out.weights[i].copy_(lin.weight)
                out.weights[i].requires_grad_(lin.weight.requires_grad)  # a frozen layer stays frozen
                if lin.bias is not None:
                    out.biases[i].copy_(lin.bias)
                    out.biases[i].requires_grad_(lin.bias.requires_grad)
        return out

    def to_sequential(self) -> nn.Sequential:
        """The same network as an nn.Sequential of nn.Linear and activation modules."""
        layers = []
        L = len(self.weights)
        for i, w in enumerate(self.weights):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=self.biases is not None, dtype=w.dtype, device=w.device)
            with torch.no_grad():
                lin.weight.copy_(w)
                lin.weight.requires_grad_(w.requires_grad)
                if self.biases is not None:
                    lin.bias.copy_(self.biases[i])
                    lin.bias.requires_grad_(self.biases[i].requires_grad)
            layers.append(lin)
            a = self.last_activation if i == L - 1 else self.activation
            if a != "none":
                layers.append(_ACT_BUILDERS[a]())
        return nn.Sequential(*layers)


def _no_hooks(m: nn.Module, what: str) -> None:
    """TypeError where `m` has forward (pre-)hooks of its own (torch.nn.utils.weight_norm's
    too): the FusedMLP made from it would not run them."""
    if m._forward_hooks or m._forward_pre_hooks:
        raise TypeError(f"FusedMLP.from_sequential: {what} has forward hooks, which a FusedMLP would not run; "
                        "remove them first (torch.nn.utils.parametrize keeps a computed weight without hooks)")


def _flatten(seq):
    for m in seq:
        if isinstance(m, nn.Sequential):
            _no_hooks(m, "a nested Sequential")
            _own_forward(m, nn.Sequential, "a nested Sequential")
            yield from _flatten(m)
        elif isinstance(m, nn.Identity):
            _no_hooks(m, "an nn.Identity")
            _own_forward(m, nn.Identity, "a module skipped as nn.Identity")
        else:
            yield m


def _own_forward(m: nn.Module, base: type, what: str) -> None:
    """TypeError where `m` (an instance of `base`) has a forward of its own: what it computes
    would be lost."""
    if type(m).forward is not base.forward:
        raise TypeError(f"FusedMLP.from_sequential: {what} is {type(m).__name__}, a subclass of {base.__name__} "
                        "with a forward of its own, which a FusedMLP would not compute")


def _params(plist: nn.ParameterList) -> list:
    """A ParameterList's parameters in index order. It keeps them in its `_parameters` under
    "0", "1", ... in that order (append registers the next index, assignment replaces one in
    place), so one read of that dict serves where `list(plist)` makes a __getattr__ call per
    index (7-16 us a forward of the DLRM MLPs on an H200 host, more than the fused call:
    BENCHMARKS.md, thirty-fifth session). Where the dict does not hold them all (a
    parametrization or weight_norm moved one out), the list's own iteration."""
    d = plist._parameters
    n = len(plist)
    if len(d) == n and tuple(d) == (_INDEX_KEYS.get(n) or _INDEX_KEYS.setdefault(n, tuple(map(str, range(n))))):
        return list(d.values())
    return list(plist)


# "0", "1", ...: the keys a ParameterList's dict holds in index order. A parameter removed and
# registered again (torch.nn.utils.parametrize.remove_parametrizations(leave_parametrized=True))
# goes to the dict's end, and prune renames one "0_orig": the dict's order is then not the
# list's (W1 ran as layer 0: a wrong output, no error), so `_params` checks the keys.
_INDEX_KEYS: dict[int, tuple[str, ...]] = {}


def _has_exact_variant(widths: tuple[int, ...]) -> bool:
    """Whether a fused_mlp spec (shipped or the user's) has a variant built for exactly these
    widths: only those read a row-padded weight in place."""
    from kgen.runtime import dispatch

    return any(v.params["widths"] and fits(v.params, tuple(widths)) for v in dispatch.family_variants("fused_mlp"))


def _run_pre_hooks(plist: nn.ParameterList) -> None:
    """A ParameterList's forward pre-hooks, as calling it would run them (with or without
    kwargs; what they return is dropped: the list takes no inputs)."""
    for key, hook in list(plist._forward_pre_hooks.items()):
        if key in plist._forward_pre_hooks_with_kwargs:
            hook(plist, (), {})
        else:
            hook(plist, ())
