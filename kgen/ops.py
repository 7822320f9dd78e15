"""The public ops: `from kgen import ops; ops.fused_bias_act(...)`.

Each family module registers its `torch.ops.kgen.*` ops when imported and lists its public
functions in `OPS`; this module finds them by name, so adding a family (kgen's own, an
installed plugin, or one given to `kgen.register_family`) edits nothing here. A family that
fails to load is skipped with one warning and named in the error for its ops.
"""

from __future__ import annotations

import logging

from kgen.errors import KgenError
from kgen.families import FAMILY_NAMES, module_of

log = logging.getLogger("kgen")


def _families():
    """(name, module or the KgenError it raised) for every known family."""
    for family in FAMILY_NAMES():
        try:
            yield family, module_of(family)
        except KgenError as e:
            yield family, e


def __getattr__(name: str):
    broken = []
    for family, mod in _families():
        if isinstance(mod, KgenError):
            broken.append(str(mod))
            continue
        fn = getattr(mod, "OPS", {}).get(name)
        if fn is not None:
            globals()[name] = fn
            return fn
    hint = f" (families that failed to load: {'; '.join(broken)})" if broken else ""
    raise AttributeError(f"kgen.ops has no op {name!r}{hint}")


def __dir__():
    return sorted(n for _, m in _families() if not isinstance(m, KgenError) for n in getattr(m, "OPS", {}))


# Importing kgen.ops registers every family's torch.ops.kgen.* ops, so
# torch.ops.kgen.<name> works right after `import kgen.ops`.
for _family, _mod in _families():
    if isinstance(_mod, KgenError):
        log.warning("kgen: %s", _mod)
