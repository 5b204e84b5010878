"""A fix to Triton 3.6's CPU interpreter shared by the interpreted kernel tests."""

from __future__ import annotations


def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with int(array) on a size-1 array,
    which numpy ≥ 2.4 refuses; kernels with a loop bound computed at run time need it."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_size1_index", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._size1_index = True
    interpreter._patch_lang_tensor = patched
