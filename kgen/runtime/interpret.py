"""Running Triton variants on the CPU: the Triton interpreter, and two fixes it needs.

Triton's interpreter (3.9 seen) multiplies bfloat16 `tl.dot` operands as their uint16 bit
patterns, since numpy has no bfloat16: any bf16 matmul kernel gives garbage there. `enable`
widens bf16 dot operands to float32 first, which is what a GPU's bf16 MMA with float32
accumulation computes. The kernels themselves are not changed.

One process either interprets or compiles: Triton decorates its own library functions
(tl.cdiv, ...) at import, as interpreted ones under TRITON_INTERPRET=1, and those cannot be
compiled ahead of time (nor can compiled ones be called by interpreted kernels). So
`kgen.runtime.build` refuses ahead-of-time builds in an interpreting process.
"""

from __future__ import annotations

import os


def active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def enable() -> None:
    """Interpret Triton kernels created from now on (set before a generated module is
    imported), with bf16 dot operands widened and device-function calls scoped."""
    os.environ["TRITON_INTERPRET"] = "1"
    _widen_bf16_dot()
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


def _widen_bf16_dot() -> None:
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp

        original = interp.InterpreterBuilder.create_dot
        convert = interp._convert_float
    except (ImportError, AttributeError):  # another Triton layout: leave it as it is
        return
    if getattr(original, "_kgen_widened", False):
        return

    def widen(x):
        if x.dtype == tl.bfloat16:
            data = convert(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interp.TensorHandle(data.reshape(x.data.shape), tl.float32)
        return x

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, widen(a), widen(b), d, *args, **kwargs)

    create_dot._kgen_widened = True
    interp.InterpreterBuilder.create_dot = create_dot
