"""Where one row's latency goes in the CUDA top-k (kernels/cuda/topk_rows.cu).

    python benchmarks/topk_phases.py [--rows 64] [--keys 65536] [--threads 1024] [--cluster C]
                                     [--no-group-list] [--no-stage]

Builds the kernel a second time with DSASERVE_TOPK_PHASES (the blocks that finish the first and
last row print the nanoseconds of each phase: caching the group maxima, the threshold, listing
the groups above it (with the barrier after it), the compaction, the selection from the list,
the output) and runs it three times on random rows
(the first run includes the warm-up). The kernel's time as a whole:
benchmarks/kernels.py --only topk.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils import cpp_extension

from dsaserve.kernels.cuda import build as cuda_build
from dsaserve.kernels.cuda import topk as cuda_topk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--keys", type=int, default=65536)
    parser.add_argument("--threads", type=int, default=1024)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--cluster", type=int, default=None,
                        help="blocks per row (default: topk.blocks_per_row's choice)")
    parser.add_argument("--no-group-list", action="store_true",
                        help="the compaction reads whole rows (topk_rows group_list=False)")
    parser.add_argument("--no-stage", action="store_true",
                        help="the compaction reads the row from memory (topk_rows stage=False)")
    args = parser.parse_args()
    major, minor = torch.cuda.get_device_capability()
    sources = [str(p) for p in cuda_build.SOURCES if p.name == "topk_rows.cu"]
    cpp_extension.load(name="dsaserve_cuda_phases", sources=sources, is_python_module=False,
                       extra_cuda_cflags=["-O3", "-DDSASERVE_TOPK_PHASES",
                                          cuda_build.arch_flag(major, minor)])
    logits = torch.randn(args.rows, args.keys, device="cuda")
    group_max = logits.view(args.rows, -1, 8).amax(2)
    limits = torch.full((args.rows,), args.keys, device="cuda")
    props = torch.cuda.get_device_properties(0)
    cluster = args.cluster or cuda_topk.blocks_per_row(args.rows, props.multi_processor_count,
                                                       args.threads, major)
    print(f"{args.rows} rows of {args.keys} keys, {args.threads} threads, {cluster} blocks per "
          f"row", flush=True)
    values = torch.empty(args.rows, args.k, device="cuda")
    indices = torch.empty(args.rows, args.k, dtype=torch.int32, device="cuda")
    for run in range(3):
        print(f"run {run}", flush=True)
        torch.ops.dsaserve_cuda.topk_rows(logits, group_max, limits, args.k, 8, args.threads,
                                          cluster, not args.no_group_list, not args.no_stage,
                                          values, indices)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
