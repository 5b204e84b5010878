"""What the interpreted kernel tests share: their modules reloaded under Triton's CPU
interpreter, and a fix to Triton 3.6's interpreter."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch


def _reload(names: tuple[str, ...], interpret: bool) -> list[ModuleType]:
    """The modules imported again: triton.jit picks interpreted or compiled at import time."""
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    return [importlib.reload(importlib.import_module(name)) for name in names]


# The FP8 GEMM modules in import order (each imports the ones before it).
FP8_KERNELS = ("dsaserve.kernels.triton.grouped_tiles", "dsaserve.kernels.triton.fp8_w8a8",
               "dsaserve.kernels.triton.fp8_linear")


def interpreted(*names: str) -> Iterator[ModuleType]:
    """A module-scoped fixture's body: the kernel modules `names` under TRITON_INTERPRET=1 (the
    last one yielded), compiled again afterwards for anything imported later. Skips without
    triton; fails on a CPU where triton was imported compiled before (these tests are then the
    kernels' only check: never a silent skip; in the whole suite
    tests/unit/test_triton_interpret.py imports it interpreted at collection)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        import triton.language.standard as std
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(std.zeros, InterpretedFunction):
            why = "triton was imported before without TRITON_INTERPRET=1"
            if torch.cuda.is_available():
                pytest.skip(f"{why} (the GPU suites; tests/gpu covers these kernels)")
            pytest.fail(f"{why}: a module run earlier imported it; run this file with "
                        "tests/unit/test_triton_interpret.py or on its own")
        patch_interpreter_index()
        yield _reload(names, interpret=True)[-1]
        _reload(names, interpret=False)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


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
