"""Running Triton variants on the CPU: the Triton interpreter, and the fixes it needs.

Triton's interpreter (3.9 seen) holds bfloat16 values as their uint16 bit patterns, since
numpy has no bfloat16, and computes on those: a bf16 `tl.dot` multiplies the patterns, and
`tl.maximum(z, 0.0)` or `z > 0` on a bf16 `z` compares them as unsigned integers (every
negative value is "larger" than every positive one). `enable` widens bf16 dot operands to
float32 first, which is what a GPU's bf16 MMA with float32 accumulation computes, and runs
bf16 elementwise float arithmetic, min / max and comparisons in float32, rounding
arithmetic results back to bf16 to nearest even as the GPU's bf16 instructions do (min,
max and comparisons are exact); and it rounds casts to bf16 (`.to(tl.bfloat16)` of float32,
float16 or float64) to nearest even, as the GPU's cvt.rn does, where the interpreter
truncates (506 of 1024 random float32 values off by an ulp, all toward zero: bf16 errors
~4x a GPU's). The kernels themselves are not changed.

One process either interprets or compiles: Triton decorates its own library functions
(tl.cdiv, ...) at import, as interpreted ones under TRITON_INTERPRET=1, and those cannot be
compiled ahead of time (nor can compiled ones be called by interpreted kernels). So
`kgen.runtime.build` refuses ahead-of-time builds in an interpreting process.
"""

from __future__ import annotations

import os


# TRITON_INTERPRET values Triton reads as on (triton.knobs' boolean parse, case-insensitive);
# anything else, "false" / "off" / "no" included, is off there and so here
_ON = ("1", "true", "yes", "on", "y")


def active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _ON


def enable() -> None:
    """Interpret Triton kernels created from now on (set before a generated module is
    imported), with bf16 dot operands widened, bf16 elementwise float operations computed on
    the values, and device-function calls scoped."""
    os.environ["TRITON_INTERPRET"] = "1"
    _widen_bf16_dot()
    _widen_bf16_float_ops()
    _round_bf16_casts()
    _scope_device_calls()


def _scope_device_calls() -> None:
    """Triton's interpreter (3.9 seen) patches triton.language for the interpreter when an
    interpreted jit function is called outside a launch (a library function such as tl.cdiv
    called from Python, or a jit helper called by a kernel) and never undoes it (a launch
    does): afterwards `triton.compile` in the same process fails ("'value' object has no
    attribute 'dtype'"). Each such call undoes its own patches on return."""
    try:
        from triton.runtime import interpreter as interp

        cls, patch, error = interp.InterpretedFunction, interp._patch_lang, interp.InterpreterError
        interp._LangPatchScope  # the layout whose __call__ this replaces
    except (ImportError, AttributeError):  # another Triton layout: leave it as it is
        return
    if getattr(cls.__call__, "_kgen_scoped", False):
        return

    def call(self, *args, **kwargs):
        scope = patch(self.fn)
        try:
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise error(repr(e)) from e
        finally:
            scope.restore()

    call._kgen_scoped = True
    cls.__call__ = call


def _bf16_to_f32(bits):
    """bf16 bit patterns -> float32, exactly (a bf16 is a float32's upper 16 bits)."""
    import numpy as np

    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16(values):
    """float32 -> bf16 bit patterns, rounded to nearest even (NaN kept a quiet NaN)."""
    import numpy as np

    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(np.isnan(values), quiet, rounded).astype(np.uint16)


def _round_bf16_casts() -> None:
    """Casts to bf16 from another float type rounded to nearest even (_f32_to_bf16; float64
    through float32), where the interpreter (3.9 seen) truncates float32's bits, or casts a
    float64's value to a uint16 pattern."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp

        original = interp.InterpreterBuilder.cast_impl
    except (ImportError, AttributeError):  # another Triton layout: leave it as it is
        return
    if getattr(original, "_kgen_rounded", False):
        return
    floats = (tl.float16, tl.float32, tl.float64)

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in floats:
            return interp.TensorHandle(_f32_to_bf16(src.data.astype(np.float32)), tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._kgen_rounded = True
    interp.InterpreterBuilder.cast_impl = cast_impl


def _widen_bf16_dot() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp

        original = interp.InterpreterBuilder.create_dot
    except (ImportError, AttributeError):  # another Triton layout: leave it as it is
        return
    if getattr(original, "_kgen_widened", False):
        return

    def widen(x):
        if x.dtype == tl.bfloat16:
            return interp.TensorHandle(_bf16_to_f32(x.data), tl.float32)
        return x

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, widen(a), widen(b), d, *args, **kwargs)

    create_dot._kgen_widened = True
    interp.InterpreterBuilder.create_dot = create_dot


# InterpreterBuilder's float binary operations that numpy would run on bf16's uint16 patterns
_BF16_OPS = ("create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_frem", "create_precise_divf",
             "create_approx_divf", "create_minimumf", "create_maximumf", "create_minnumf", "create_maxnumf") + tuple(
    f"create_fcmp{order}{rel}" for order in "OU" for rel in ("LT", "GT", "LE", "GE", "EQ", "NE"))


def _widen_bf16_float_ops() -> None:
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp

        builder = interp.InterpreterBuilder
        originals = {name: getattr(builder, name) for name in _BF16_OPS}
    except (ImportError, AttributeError):  # another Triton layout: leave it as it is
        return
    if getattr(originals["create_fadd"], "_kgen_widened", False):
        return

    def widened(original):
        def op(self, lhs, rhs):
            if lhs.dtype.scalar != tl.bfloat16 or lhs.data.dtype != np.uint16:
                return original(self, lhs, rhs)
            a = interp.TensorHandle(_bf16_to_f32(lhs.data), tl.float32)
            b = interp.TensorHandle(_bf16_to_f32(rhs.data), tl.float32)
            out = original(self, a, b)
            data = out.data if out.data.dtype == np.bool_ else _f32_to_bf16(out.data)  # min, max: exact
            return interp.TensorHandle(data, tl.bfloat16)

        op._kgen_widened = True
        return op

    for name, original in originals.items():
        setattr(builder, name, widened(original))
