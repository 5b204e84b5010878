"""Build of the CUDA extension: every .cu of this package, compiled once per process by
torch.utils.cpp_extension (nvcc and ninja needed; cached under TORCH_EXTENSIONS_DIR) into one
library whose ops are torch.ops.dsaserve_cuda.*."""

from __future__ import annotations

import functools
import logging
import pathlib
import shutil

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted(pathlib.Path(__file__).parent.glob("*.cu"))


def arch_flag(major: int, minor: int) -> str:
    """nvcc's target for compute capability major.minor: Hopper gets sm_90a, the target with
    wgmma and setmaxnreg (indexer_logits.cu needs them; the code runs on sm_90 parts only)."""
    suffix = "a" if (major, minor) == (9, 0) else ""
    return f"-gencode=arch=compute_{major}{minor}{suffix},code=sm_{major}{minor}{suffix}"


@functools.cache
def build() -> str | None:
    """Compile and load the extension once per process → None, or why it is unavailable."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    from torch.utils import cpp_extension

    if shutil.which("nvcc") is None and not cpp_extension.CUDA_HOME:
        return "nvcc not found (set CUDA_HOME)"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"compute capability {major}.{minor} < 8.0"
    logger.info("building the CUDA kernels (once; cached under TORCH_EXTENSIONS_DIR)")
    try:
        cpp_extension.load(
            name="dsaserve_cuda", sources=[str(p) for p in SOURCES], is_python_module=False,
            extra_cuda_cflags=["-O3", arch_flag(major, minor)], verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as e:  # a compiler or loader failure
        logger.warning("the CUDA kernels did not build; the Triton ones are used: %s", e)
        return f"build failed: {e}"
    return None
