"""Dispatch: pick, build (through the cache) and load the variant an op runs.

Order, most specific first: CUDA variants whose arch runs on the device (exact arch before
an older minor of the same major), then Triton variants, each in spec order; the op falls
back to its PyTorch reference when none can be built. `KGEN_VARIANT=<name>` forces one
variant (for benchmarks and bisecting); `KGEN_BACKEND=cuda|triton|reference` one backend.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from kgen import spec as spec_mod
from kgen.errors import KgenError
from kgen.runtime import build, loader

log = logging.getLogger("kgen")
SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"


@functools.cache
def shipped_spec(family: str) -> spec_mod.Spec:
    return spec_mod.load(SPECS_DIR / f"{family}.yaml")


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether SASS built for `arch` runs on a device of `capability`."""
    num = arch.removeprefix("sm_")
    if num.endswith("a"):  # arch-specific features (wgmma, setmaxnreg): that exact chip only
        return (int(num[:-2]), int(num[-2])) == capability
    major, minor = int(num[:-1]), int(num[-1])
    return major == capability[0] and minor <= capability[1]


def candidates(family: str, dtype: str, capability: tuple[int, int] | None,
               backend: str | None = None) -> list[spec_mod.Variant]:
    """Variants to try in order. `backend` restricts them to one backend (a family asking
    for a companion, e.g. the Triton kernels a CUDA forward shares its backward with);
    KGEN_VARIANT then applies only when it names a variant of that backend."""
    variants = [v for v in shipped_spec(family).variants if v.dtype == dtype]
    forced = os.environ.get("KGEN_VARIANT")
    if forced:
        chosen = [v for v in variants if v.name == forced]
        if not chosen:
            raise KgenError(f"KGEN_VARIANT={forced} names no {family} variant for {dtype}; "
                            f"`kgen list` shows the names")
        if backend is None or chosen[0].backend == backend:
            return chosen
    backend = backend or os.environ.get("KGEN_BACKEND")
    cuda = []
    if capability is not None:
        cuda = [v for v in variants if v.backend == "cuda" and arch_runs_on(v.arch, capability)]
        exact = f"sm_{capability[0]}{capability[1]}"
        cuda.sort(key=lambda v: v.arch.rstrip("a") != exact)  # stable: spec order within each group
    triton = [v for v in variants if v.backend == "triton"]
    if backend == "cuda":
        return cuda
    if backend == "triton":
        return triton
    if backend == "reference":
        return []
    return cuda + triton


def load(variant: spec_mod.Variant) -> loader.Kernel:
    """Build (or find in the cache) and load one variant. Raises KgenError on failure."""
    if variant.backend == "cuda":
        (result,) = build.build_cuda([variant])
        if result.error:
            raise result.error
        return loader.load_cuda(variant, result.entry)
    return loader.load_triton(variant, build.triton_source_entry(variant))


def select(family: str, device, dtype: str, backend: str | None = None) -> loader.Kernel | None:
    """The first candidate for (device, dtype) that builds and loads; None means "use the
    reference". Each failure is logged once with its reason, then the next is tried."""
    import torch

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for v in candidates(family, dtype, capability, backend):
        try:
            return load(v)
        except KgenError as e:
            log.warning("kgen: %s unavailable, trying the next variant: %s", v.qualname,
                        str(e).splitlines()[0])
    if os.environ.get("KGEN_VARIANT"):
        raise KgenError(f"KGEN_VARIANT={os.environ['KGEN_VARIANT']} could not be built")
    return None
