"""Registers, spills and shared memory of the Triton kernels, built for sm_90 on any machine.

    python benchmarks/sm90_resources.py [--only sparse_mla,indexer,row_topk,writers]

Compiles each kernel configuration ahead of time with Triton's own ptxas (no GPU needed) and
prints one table row per build: shared memory, registers per thread, stack bytes (spills), and
the tensor-core instructions in the PTX (wgmma = Hopper's asynchronous MMA; mma.sync = the older
synchronous one, what Triton falls back to below 64 rows). docs/kernels.md quotes these. Pointer
arguments and strides are declared divisible by 16, as the JIT specializes them at run time for
the shapes the engine uses; without that Triton emits no cp.async and the numbers would not be
the ones the GPU runs.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsaserve.kernels.triton import index_cache, indexer, row_topk, sparse_mla

TARGET = GPUTarget("cuda", 90, 64)


@dataclass(frozen=True)
class Build:
    label: str
    fn: object  # a triton.jit function
    signature: dict[str, str]  # argument → type ("*fp32", "i32", "constexpr")
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int = 3


def _cuobjdump() -> str:
    found = glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                   "backends/nvidia/bin/cuobjdump"))
    if not found:
        raise SystemExit("sm90_resources: Triton's cuobjdump not found")
    return found[0]


def resources(build: Build) -> dict[str, int]:
    """Compile one build for sm_90 → shared, registers, stack, wgmma and mma.sync counts."""
    aligned = [i for i, (name, t) in enumerate(build.signature.items())
               if t.startswith("*") or name.startswith("stride")]
    src = ASTSource(fn=build.fn, signature=build.signature, constexprs=build.constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    kernel = triton.compile(src, target=TARGET,
                            options={"num_warps": build.num_warps, "num_stages": build.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared,
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "wgmma": ptx.count("wgmma.mma_async"), "mma.sync": ptx.count("mma.sync")}


def _sig(pointers: dict[str, str], scalars: list[str], constexprs: list[str]) -> dict[str, str]:
    return pointers | {s: "i32" for s in scalars} | {c: "constexpr" for c in constexprs}


def sparse_mla_builds() -> list[Build]:
    sig = _sig({"q_ptr": "*bf16", "kv_ptr": "*fp8e4nv", "idx_ptr": "*i32", "o_ptr": "*bf16",
                "lse_ptr": "*fp32"},
               ["num_tokens", "num_heads", "num_slots", "topk", "stride_qt", "stride_qh",
                "stride_it"],
               [])
    sig = sig | {"sm_scale_log2": "fp32"} | {c: "constexpr" for c in (
        "L", "R", "KV_FP8", "ROW", "BLOCK_H", "BLOCK_N", "NUM_SPLITS", "BLOCKS_PER_SPLIT",
        "DOT_PRECISION")}
    builds = []
    for block_h, block_n, warps, stages in ((64, 64, 8, 3), (64, 32, 8, 5), (32, 64, 4, 3)):
        consts = {"L": 512, "R": 64, "KV_FP8": True, "ROW": 656, "BLOCK_H": block_h,
                  "BLOCK_N": block_n, "NUM_SPLITS": 1, "BLOCKS_PER_SPLIT": 2048 // block_n,
                  "DOT_PRECISION": "tf32"}
        builds.append(Build(f"sparse MLA fp8 rows, {block_h} heads, {block_n} rows, "
                            f"{stages} stages", sparse_mla._sparse_mla_fwd_kernel, sig, consts,
                            warps, stages))
    return builds


def indexer_builds() -> list[Build]:
    sig = _sig({"q_ptr": "*bf16", "w_ptr": "*fp32", "cache_ptr": "*fp8e4nv",
                "block_table_ptr": "*i32", "tile_req_ptr": "*i32", "tile_tok_ptr": "*i32",
                "tile_len_ptr": "*i32", "limit_ptr": "*i32", "out_ptr": "*fp32",
                "gmax_ptr": "*fp32"},
               ["stride_bt", "stride_out", "stride_gmax", "s_out"],
               ["H", "D", "BS", "KV_FP8", "BLOCK_T", "PAGES_PER_PROG", "GROUP", "DOT_PRECISION",
                "FP8_MAX", "MIN_AMAX"])
    builds = []
    for block_t in (1, 2, 4):
        consts = {"H": 64, "D": 128, "BS": 64, "KV_FP8": True, "BLOCK_T": block_t,
                  "PAGES_PER_PROG": 32, "GROUP": row_topk.GROUP, "DOT_PRECISION": "tf32",
                  "FP8_MAX": 448.0, "MIN_AMAX": 1e-4}
        builds.append(Build(f"indexer logits, {block_t} token(s) x 64 heads",
                            indexer._indexer_logits_kernel, sig, consts, 4))
    return builds


def row_topk_builds() -> list[Build]:
    k = 2048
    return [
        Build("row_topk threshold", row_topk._threshold_kernel,
              _sig({"logits_ptr": "*fp32", "gmax_ptr": "*fp32", "limit_ptr": "*i32",
                    "tau_ptr": "*i32", "count_ptr": "*i32"}, ["stride_l", "stride_g"],
                   ["K", "GROUP", "NA"]),
              {"K": k, "GROUP": row_topk.GROUP, "NA": 16384}, 16),
        *[Build(f"row_topk compaction, {'slot per key' if per_key else 'prefix sum'}",
                row_topk._compact_kernel,
                _sig({"logits_ptr": "*fp32", "limit_ptr": "*i32", "tau_ptr": "*i32",
                      "count_ptr": "*i32", "list_ptr": "*i64"}, ["stride_l", "stride_c"],
                     ["C", "SEG", "SLOT_PER_KEY"]),
                {"C": 2 * k, "SEG": 1024 if per_key else 2048, "SLOT_PER_KEY": per_key}, 4)
          for per_key in (False, True)],
        Build("row_topk finish", row_topk._finish_kernel,
              _sig({"logits_ptr": "*fp32", "limit_ptr": "*i32", "count_ptr": "*i32",
                    "list_ptr": "*i64", "val_ptr": "*fp32", "idx_ptr": "*i64"},
                   ["stride_l", "stride_c", "stride_o"], ["K", "C", "BLOCK"]),
              {"K": k, "C": 2 * k, "BLOCK": 1024}, 8),
    ]


def writer_builds() -> list[Build]:
    return [Build("indexer key writer, 16 keys", index_cache._write_index_fp8_kernel,
                  _sig({"cache_ptr": "*fp8e4nv", "slots_ptr": "*i64", "k_ptr": "*bf16"},
                       ["n", "stride_k"], ["D", "BS", "FP8_MAX", "MIN_AMAX", "TOKENS"]),
                  {"D": 128, "BS": 64, "FP8_MAX": 448.0, "MIN_AMAX": 1e-4, "TOKENS": 16}, 4)]


PARTS = {"sparse_mla": sparse_mla_builds, "indexer": indexer_builds,
         "row_topk": row_topk_builds, "writers": writer_builds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated parts of {', '.join(PARTS)}")
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(sorted(unknown))}")
    print("| build | warps | shared (B) | registers | stack (B) | wgmma | mma.sync |\n"
          "|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for part in args.only.split(","):
        for build in PARTS[part]():
            r = resources(build)
            print(f"| {build.label} | {build.num_warps} | {r['shared']} | {r['registers']} | "
                  f"{r['stack']} | {r['wgmma']} | {r['mma.sync']} |", flush=True)


if __name__ == "__main__":
    main()
