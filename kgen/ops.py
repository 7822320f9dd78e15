"""The public ops: `from kgen import ops; ops.fused_bias_act(...)`.

Each family module registers its `torch.ops.kgen.*` ops when imported and lists its public
functions in `OPS`; this module finds them by name, so adding a family edits nothing here.
"""

from __future__ import annotations

from kgen.families import FAMILY_NAMES, module_of


def __getattr__(name: str):
    for family in FAMILY_NAMES():
        fn = getattr(module_of(family), "OPS", {}).get(name)
        if fn is not None:
            globals()[name] = fn
            return fn
    raise AttributeError(f"kgen.ops has no op {name!r}")


def __dir__():
    return sorted(n for f in FAMILY_NAMES() for n in getattr(module_of(f), "OPS", {}))


# Importing kgen.ops registers every family's torch.ops.kgen.* ops, so
# torch.ops.kgen.<name> works right after `import kgen.ops`.
for _family in FAMILY_NAMES():
    module_of(_family)
