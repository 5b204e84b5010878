"""CUDA C++ kernels, where Triton cannot express what they need (shared-memory atomics).

    topk_rows.cu   exact top-k of long score rows, one thread block per row (a cluster of 2-8
                   on Hopper where rows are few)
    topk.py        its Python entry point, and the build: torch.utils.cpp_extension compiles the
                   sources on first use (nvcc and ninja needed; cached under
                   TORCH_EXTENSIONS_DIR) and registers them as torch.ops.dsaserve_cuda

Nothing here is built or imported unless a CUDA kernel is asked for; where it cannot be built,
callers keep their Triton kernels.
"""
