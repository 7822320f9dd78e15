"""Host TMA descriptors whose loads round float32 to TF32, for tl.dot's "tf32" inputs.

The tensor cores take a TF32 operand's 10 mantissa bits and drop the other 13: Triton hands
them float32 tiles as they are, so its TF32 products are truncated (a -7e-4 relative bias on
an H200, BENCHMARKS.md forty-sixth session), where cuBLAS rounds its operands to nearest.
The TMA unit can round on the way to shared memory instead, at no cost: a tensor map of
type CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 over float32 data rounds each element to the nearest
TF32 value (ties to even; infinities and NaN kept). Triton 3.7 and later ask for it with
`TensorDescriptor(..., round_f32_to_tf32=True)` (its launcher encodes the map with that type;
its interpreter rounds likewise). Triton 3.6 has no such field: `rounding_descriptor` then sets
the attribute on the descriptor and teaches 3.6's launcher the same thing, once per process,
by wrapping `triton.backends.nvidia.driver.make_tensordesc_arg` so that a descriptor carrying
the attribute is encoded with the TF32 element type (what 3.7's launcher does; the wrapper
changes nothing for any other descriptor). 3.6's interpreter does not round.

`rounding_descriptor` returns None where this Triton offers neither (callers then take plain
descriptors, whose float32 tiles the tensor cores truncate)."""

from __future__ import annotations

import inspect

from triton.tools.tensor_descriptor import TensorDescriptor

TMA_TF32 = 11  # CUtensorMapDataType's TFLOAT32 (the same number in Triton's device enum)

_state: dict = {}  # "how": "field" (Triton >= 3.7), "backport" (3.6, launcher wrapped), None (neither)


def _how() -> str | None:
    if "how" not in _state:
        _state["how"] = _decide()
    return _state["how"]


def _decide() -> str | None:
    if "round_f32_to_tf32" in inspect.signature(TensorDescriptor.from_tensor).parameters:
        return "field"
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None
    make = getattr(driver, "make_tensordesc_arg", None)
    table = getattr(driver, "TMA_DTYPE_DEVICE_TO_HOST", None)
    # 3.6's make_tensordesc_arg(arg, metadata) reads metadata["elem_type"], mapped to the
    # host enum by TMA_DTYPE_DEVICE_TO_HOST (the identity at TFLOAT32)
    if make is None or table is None or table.get(TMA_TF32) != TMA_TF32:
        return None
    if list(inspect.signature(make).parameters) != ["arg", "metadata"]:
        return None
    if not getattr(make, "_kgen_tf32", False):
        def make_tensordesc_arg(arg, metadata):
            if metadata is not None and getattr(arg, "round_f32_to_tf32", False):
                metadata = dict(metadata, elem_type=TMA_TF32)
            return make(arg, metadata)

        make_tensordesc_arg._kgen_tf32 = True
        driver.make_tensordesc_arg = make_tensordesc_arg  # (looked up by name on every launch)
    return "backport"


def rounding_descriptor(tensor, block_shape) -> TensorDescriptor | None:
    """TensorDescriptor.from_tensor(tensor, block_shape) whose loads round float32 to the
    nearest TF32 value, or None where this Triton cannot (see the module docstring)."""
    how = _how()
    if how == "field":
        return TensorDescriptor.from_tensor(tensor, block_shape, round_f32_to_tf32=True)
    if how == "backport":
        d = TensorDescriptor.from_tensor(tensor, block_shape)
        d.round_f32_to_tf32 = True
        return d
    return None
