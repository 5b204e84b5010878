"""CUDA C++ kernels, where Triton cannot express what they need (shared-memory atomics, wgmma
issued by hand with the epilogue written out).

    topk_rows.cu        exact top-k of long score rows, one thread block per row (a cluster of
                        2-8 on Hopper where rows are few)
    topk.py             its Python entry point
    indexer_logits.cu   FP8 indexer logits of prefill tiles on sm_90a: a cp.async producer warp,
                        consumer warpgroups issuing wgmma and reducing the heads themselves
    indexer_logits.py   its Python entry point, block shapes and launch maths
    mbarrier.cuh        the shared-memory barrier helpers both kernels use
    build.py            torch.utils.cpp_extension compiles every .cu on first use (nvcc and
                        ninja needed; cached under TORCH_EXTENSIONS_DIR) into one library,
                        torch.ops.dsaserve_cuda

Nothing here is built or imported unless a CUDA kernel is asked for; where it cannot be built,
callers keep their Triton kernels.
"""
