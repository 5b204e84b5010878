"""Registers, spills and shared memory of the Triton kernels, built for sm_90 on any machine.

    python benchmarks/sm90_resources.py [--only sparse_mla,sparse_mla_gluon,indexer,...]
                                        [--check]
      (parts: sparse_mla, sparse_mla_gluon, sparse_mla_pingpong, sparse_mla_pingpong_fp8,
       indexer, indexer_gluon, row_topk, writers, residency, residency_mtp, fetch, moe,
       w8a8, sampling)

Compiles each kernel configuration ahead of time with Triton's own ptxas (no GPU needed) and
prints one table row per build: shared memory, registers per thread, stack bytes (spills), and
the tensor-core instructions in the PTX (wgmma = Hopper's asynchronous MMA; mma.sync = the older
synchronous one, what Triton falls back to below 64 rows). docs/kernels.md quotes these. Pointer
arguments and strides are declared divisible by 16, as the JIT specializes them at run time for
the shapes the engine uses; without that Triton emits no cp.async and the numbers would not be
the ones the GPU runs.

--check exits with status 1 if a build spills, needs more shared memory than an SM has, or
draws a ptxas note (a serialized wgmma pipeline costs 1.3x in the Gluon sparse MLA kernel and
is reported as an "info" line only); tests/unit/test_sm90_builds.py runs it for the parts
whose builds are all clean.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from dsaserve.kernels import formats
from dsaserve.kernels.triton import (
    fp8_linear,
    fp8_w8a8,
    index_cache,
    indexer,
    indexer_gluon,
    l2_hint,
    logsumexp,
    moe_combine,
    moe_pairs,
    residency,
    routing,
    row_gather,
    row_topk,
    sparse_mla,
    sparse_mla_gluon,
    sparse_mla_pingpong,
)

TARGET = GPUTarget("cuda", 90, 64)
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one CTA may use on an H100 / H200


@dataclass(frozen=True)
class Build:
    label: str
    fn: object  # a triton.jit function
    signature: dict[str, str]  # argument → type ("*fp32", "i32", "constexpr")
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int = 3
    gluon: bool = False  # a gluon.jit kernel (GluonASTSource)
    maxnreg: int | None = None
    # integer arguments besides strides that the JIT specializes as divisible by 16 at the
    # shapes the engine uses (a model dimension as a loop bound: the masks of its tiles are
    # then known constant and the loads vectorized, as on the GPU)
    divisible: tuple[str, ...] = ()


def _cuobjdump() -> str:
    found = glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                   "backends/nvidia/bin/cuobjdump"))
    if not found:
        raise SystemExit("sm90_resources: Triton's cuobjdump not found")
    return found[0]


def resources(build: Build) -> dict[str, int]:
    """Compile one build for sm_90 → shared, registers, stack, wgmma and mma.sync counts."""
    aligned = [i for i, (name, t) in enumerate(build.signature.items())
               if t.startswith("*") or name.startswith("stride") or name in build.divisible]
    source = GluonASTSource if build.gluon else ASTSource
    src = source(fn=build.fn, signature=build.signature, constexprs=build.constexprs,
                 attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    options = {"num_warps": build.num_warps, "num_stages": build.num_stages}
    if build.maxnreg is not None:
        options["maxnreg"] = build.maxnreg
    kernel = triton.compile(src, target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage, sass = (subprocess.run([_cuobjdump(), flag, f.name], capture_output=True,
                                      text=True, check=True).stdout
                       for flag in ("-res-usage", "-sass"))
    ptx = kernel.asm["ptx"]
    warnings = _ptxas_warnings(ptx)
    if build.constexprs.get("L2_MARK") and ".L2::256B" not in ptx:
        warnings.append("l2_hint: the copies of a kernel built with an L2_MARK were not rewritten")
    unset = l2_hint.undefined_descriptors(sass)
    if unset:  # ptxas's cp.async cache-policy miscompile (l2_hint): a trap at run time
        warnings.append(f"{len(unset)} instructions read an unset descriptor: {unset[0]}")
    return {"shared": kernel.metadata.shared,
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "wgmma": ptx.count("wgmma.mma_async"), "mma.sync": ptx.count("mma.sync"),
            "setmaxnreg": ", ".join(sorted({f"{kind} {n}" for kind, n in re.findall(
                r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)})) or "-",
            "warnings": warnings}


def _ptxas_warnings(ptx: str) -> list[str]:
    """ptxas -v's warnings and performance notes on the PTX (C7510–C7515: a wgmma pipeline
    serialized, e.g. for lack of registers, across a function boundary, or because an
    accumulator register is written while a wgmma is in flight), less the one every
    255-register build gives ("Too many maxnreg": Triton writes .maxnreg 256, ptxas keeps its
    limit of 255)."""
    ptxas = os.path.join(os.path.dirname(_cuobjdump()), "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                             capture_output=True, text=True)
    # ptxas reports a serialized wgmma pipeline as "info (C7515) Potential Performance Loss",
    # not as a warning: both kinds are kept.
    return [line for line in (out.stdout + out.stderr).splitlines()
            if ("warning" in line or "Performance Loss" in line)
            and "Too many maxnreg" not in line]


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


def _gluon_mla_sig(split_arg: str) -> dict[str, str]:
    """The run-time arguments of both Gluon sparse MLA kernels (bf16 rows; the last one, the
    split size, is counted in each kernel's own unit)."""
    sig = _sig({"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "o_ptr": "*bf16",
                "lse_ptr": "*fp32"},
               ["num_tokens", "num_heads", "num_slots", "topk", "stride_qt", "stride_qh",
                "stride_it"], [])
    return sig | {"sm_scale_log2": "fp32", split_arg: "i32"}


def sparse_mla_gluon_builds() -> list[Build]:
    """The Gluon kernel as `sparse_mla_gluon.launch` builds it: 4 warps per partition (softmax,
    P·V, gather), its ring depth and register split, for bf16 and fp8_ds_mla rows."""
    sig = _sig({"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "o_ptr": "*bf16",
                "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"},
               ["num_tokens", "num_heads", "num_slots", "topk", "stride_qt", "stride_qh",
                "stride_it"], [])
    sig = sig | {"sm_scale_log2": "fp32", "num_ctas": "i32", "splits": "i32"}
    default = sparse_mla_gluon.BUILD
    even = replace(default, softmax_cols=256, pv_regs=208)  # the split it was measured against
    builds = []
    for b, fp8, l2 in ((default, False, l2_hint.PLAIN), (default, True, l2_hint.PLAIN),
                       (even, False, l2_hint.PLAIN), (even, True, l2_hint.PLAIN),
                       (default, True, l2_hint.PREFETCH)):
        consts = {"KV_FP8": fp8, "BN": b.block_n, "NBUF": b.num_bufs, "PV_REGS": b.pv_regs,
                  "GATHER_REGS": b.gather_regs, "SCOLS": b.softmax_cols,
                  "L2_MARK": l2_hint.mark_asm(l2)}
        kind_sig = sig | {"kv_ptr": "*fp8e4nv" if fp8 else "*bf16"}
        rows = "fp8 rows (staged in the K slots)" if fp8 else "bf16 rows"
        builds.append(Build(f"sparse MLA Gluon {rows}, 64 heads, {b.block_n} rows, K ring "
                            f"{b.num_bufs}, 3 partitions x 4 warps, O columns "
                            f"{b.softmax_cols} / {512 - b.softmax_cols}, P·V registers "
                            f"{b.pv_regs}{_l2_label(l2)}",
                            sparse_mla_gluon._sparse_mla_gluon_kernel,
                            kind_sig | {c: "constexpr" for c in consts}, consts, 4, gluon=True,
                            maxnreg=b.maxnreg))
    return builds


def _l2_label(mode: str) -> str:
    return "" if mode == l2_hint.PLAIN else f", {mode} L2 copies"


def sparse_mla_pingpong_builds(modes: tuple[str, ...] = (l2_hint.PLAIN, l2_hint.PREFETCH),
                               fp8: bool = False) -> list[Build]:
    """The ping-pong kernel as `sparse_mla_pingpong.launch` builds it: bf16 rows with each of
    `modes` (l2_hint) for its copies, or fp8_ds_mla rows (its own register split)."""
    pp = sparse_mla_pingpong
    sig = _gluon_mla_sig("pairs_per_split")
    if fp8:
        sig = sig | {"kv_ptr": "*fp8e4nv"}
        modes, wg1, gather = (l2_hint.PLAIN,), pp.FP8_WG1_REGS, pp.FP8_GATHER_REGS
    else:
        wg1, gather = pp.WG1_REGS, pp.GATHER_REGS
    builds = []
    for l2 in modes:
        consts = {"KV_FP8": fp8, "WG1_REGS": wg1, "GATHER_REGS": gather,
                  "L2_MARK": l2_hint.mark_asm(l2)}
        builds.append(Build(
            f"sparse MLA ping-pong {'fp8_ds_mla' if fp8 else 'bf16'} rows, 64 heads, blocks "
            f"of {pp.BN.value} rows in two buffers, 3 partitions x 4 warps, registers {wg1} / "
            f"{wg1} / {gather}{_l2_label(l2)}",
            pp._sparse_mla_pingpong_kernel, sig | {c: "constexpr" for c in consts}, consts, 4,
            gluon=True, maxnreg=pp.MAXNREG))
    return builds


def sparse_mla_pingpong_fp8_builds() -> list[Build]:
    """The ping-pong kernel on fp8_ds_mla rows (opt-in). Its own part, outside the clean parts
    that tests/unit/test_sm90_builds.py checks: at 216 registers a consumer warpgroup spills 8
    bytes (sparse_mla_pingpong.FP8_WG1_REGS)."""
    return sparse_mla_pingpong_builds(fp8=True)


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


def indexer_gluon_builds() -> list[Build]:
    """Every tile the step plan can make (up to 256 / H tokens), as `launch_logits_gluon`
    launches it: the TMA descriptors' types (block shape, shared layout) from CPU stand-ins."""
    d, bs = 128, 64
    cache = torch.zeros(4, bs * formats.index_token_bytes(d), dtype=torch.uint8)
    k_desc, ks_desc = indexer_gluon.page_descriptors(cache, d, bs)
    sig = _sig({"q_ptr": "*bf16", "w_ptr": "*fp32", "k_desc": mangle_type(k_desc),
                "ks_desc": mangle_type(ks_desc), "block_table_ptr": "*i32",
                "tile_req_ptr": "*i32", "tile_tok_ptr": "*i32", "tile_len_ptr": "*i32",
                "limit_ptr": "*i32", "out_ptr": "*fp32", "gmax_ptr": "*fp32"},
               ["stride_bt", "stride_out", "stride_gmax", "s_out"],
               ["H", "D", "BS", "BLOCK_T", "PAGES_PER_PROG", "GROUP", "NB", "FP8_MAX",
                "MIN_AMAX", "REGS", "PAIRS"])
    # The signature is positional: its order must be the kernel's.
    assert list(sig) == indexer_gluon._indexer_logits_gluon_kernel.arg_names
    builds = []
    for heads in (64, 32):
        for block_t in (8, 4, 2, 1):
            if heads * block_t > 256:
                continue
            regs = indexer_gluon.registers_per_thread(heads, block_t)
            consts = {"H": heads, "D": d, "BS": bs, "BLOCK_T": block_t,
                      "PAGES_PER_PROG": 128 if heads * block_t == 256 else 64,
                      "GROUP": row_topk.GROUP, "NB": indexer_gluon.NUM_BUF,
                      "FP8_MAX": formats.FP8_MAX, "MIN_AMAX": formats.INDEX_MIN_AMAX,
                      "REGS": regs, "PAIRS": False}
            builds.append(Build(f"indexer logits Gluon, {heads} heads x {block_t} token(s)",
                                indexer_gluon._indexer_logits_gluon_kernel, sig, consts, 4,
                                gluon=True, maxnreg=None if regs == 256 else regs))
            if block_t == 1:  # the decode tiles, also with pages in pairs
                builds.append(replace(builds[-1], label=builds[-1].label + ", pages in pairs",
                                      constexprs=consts | {"PAIRS": True}))
    return builds


def _key_order_sig(dtype: str, scalars: list[str], constexprs: list[str]) -> dict[str, str]:
    return _sig({"values_ptr": "*fp32", "local_ptr": f"*{dtype}", "out_values_ptr": "*fp32",
                 "out_local_ptr": f"*{dtype}"}, scalars, constexprs)


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
        *[Build(f"row_topk key order (64-bit sort), {dtype} keys", row_topk._key_sort64_kernel,
                _key_order_sig(dtype, ["num_rows", "K", "stride_v", "stride_l"], ["BLOCK"]),
                {"BLOCK": k}, 8) for dtype in ("i64", "i32")],
        *[Build(f"row_topk key order (32-bit sort), {dtype} keys", row_topk._key_sort32_kernel,
                _key_order_sig(dtype, ["num_rows", "K", "stride_v", "stride_l"],
                               ["BLOCK", "LOG_BLOCK"]),
                {"BLOCK": k, "LOG_BLOCK": 11}, 8) for dtype in ("i64", "i32")],
    ]


def writer_builds() -> list[Build]:
    return [Build("indexer key writer, 16 keys", index_cache._write_index_fp8_kernel,
                  _sig({"cache_ptr": "*fp8e4nv", "slots_ptr": "*i64", "k_ptr": "*bf16"},
                       ["n", "stride_k"], ["D", "BS", "FP8_MAX", "MIN_AMAX", "TOKENS"]),
                  {"D": 128, "BS": 64, "FP8_MAX": 448.0, "MIN_AMAX": 1e-4, "TOKENS": 16}, 4)]


def _residency_build(k: int, max_rows: int, size: int) -> Build:
    """HiSparse's residency kernel as the runtime launches it (kernels/triton/residency.py)."""
    width = max_rows * k
    wb, sb = triton.next_power_of_2(width), triton.next_power_of_2(size)
    pointers = {name: "*i64" for name in (
        "row_region_ptr", "row_rank_ptr", "tok_ptr", "stamp_ptr", "regions_ptr", "now_ptr",
        "hot_ptr", "miss_pos_ptr", "miss_slot_ptr", "num_miss_ptr", "u_ptr", "at_ptr")}
    consts = {"K": k, "S": size, "MAX_ROWS": max_rows, "W": width, "WB": wb,
              "WLOG": wb.bit_length() - 1, "SB": sb, "SLOG": sb.bit_length() - 1, "TB": 256}
    sig = {"topk_ptr": "*i32", "stride_topk": "i32", "row_region_ptr": "*i64",
           "row_rank_ptr": "*i64", "num_rows": "i32"} | pointers | {"vic_ptr": "*i32"}
    sig = {name: sig[name] for name in residency._residency_kernel.arg_names if name in sig}
    return Build(f"residency, top-k {k} × {max_rows} rows, {size:,} slots",
                 residency._residency_kernel, sig | {c: "constexpr" for c in consts}, consts,
                 residency._num_warps(max(wb, sb)))


def residency_builds() -> list[Build]:
    """One query row a request, the default buffer (2 × top-k): clean."""
    return [_residency_build(2048, 1, 4096)]


def residency_mtp_builds() -> list[Build]:
    """MTP1 and MTP3 unions (2 and 4 rows) with their default buffers: these spill (72 and
    584 stack bytes when written)."""
    return [_residency_build(2048, 2, 6144), _residency_build(2048, 4, 10240)]


def fetch_builds() -> list[Build]:
    """HiSparse's fetch and mirror (kernels/triton/row_gather.py) on 656-byte fp8_ds_mla and
    1,152-byte bf16 rows, as launched (16 entries a program; an int32 block table)."""
    builds = []
    for row_bytes in (656, 1152):
        words = row_bytes // 4
        consts = {"WORDS": words, "BLOCK": triton.next_power_of_2(words), "ENTRIES": 16}
        warps = row_gather._num_warps(consts["BLOCK"], consts["ENTRIES"])
        fetch = _sig({"hot_ptr": "*i32", "host_ptr": "*i32", "gpu_ptr": "*i32",
                      "miss_pos_ptr": "*i64", "miss_slot_ptr": "*i64", "regions_ptr": "*i64",
                      "requests_ptr": "*i64", "upto_ptr": "*i64", "host_table_ptr": "*i64",
                      "stride_host": "i32", "block_table_ptr": "*i32", "stride_block": "i32",
                      "max_blocks": "i32", "counts_ptr": "*i64"}, ["n", "W"],
                     ["S", "P", "TRASH", "B"] + list(consts))
        assert list(fetch) == row_gather._fetch_kernel.arg_names  # positional
        mirror = _sig({"dst_ptr": "*i32", "dst_idx_ptr": "*i64", "host_ptr": "*i32",
                       "host_idx_ptr": "*i64", "gpu_ptr": "*i32", "gpu_idx_ptr": "*i64",
                       "from_host_ptr": "*u8"}, ["n"], list(consts))
        assert list(mirror) == row_gather._row_gather_kernel.arg_names
        builds += [
            Build(f"HiSparse fetch, {row_bytes}-byte rows", row_gather._fetch_kernel, fetch,
                  {"S": 4096, "P": 4160, "TRASH": 64, "B": 64} | consts, warps),
            Build(f"HiSparse mirror (row gather), {row_bytes}-byte rows",
                  row_gather._row_gather_kernel, mirror, consts, warps)]
    return builds


def moe_builds() -> list[Build]:
    """The MoE's routing (kernels/triton/routing.py: GLM-5.3's 256 experts and 8 per token,
    DeepSeek-V3.2's 8 groups of which 4 kept, the tiny presets' 8 and 2), its pair layout
    (kernels/triton/moe_pairs.py: up to MAX_PAIRS pairs, every expert here or an EP8 rank's
    32) and its combine (kernels/triton/moe_combine.py: bf16 and fp32 pair rows, with and
    without experts held elsewhere), as launched."""
    route = _sig({"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64",
                  "weights_ptr": "*fp32"}, ["num_tokens"], [])
    route = route | {"scale": "fp32"} | {c: "constexpr" for c in (
        "E", "BLOCK_E", "K", "BLOCK_K", "GROUPS", "TOPK_GROUPS", "NORM")}
    assert list(route) == routing._route_kernel.arg_names  # positional
    builds = []
    for e, k, groups, kept in ((256, 8, 1, 1), (256, 8, 8, 4), (8, 2, 1, 1)):
        consts = {"E": e, "BLOCK_E": triton.next_power_of_2(e), "K": k,
                  "BLOCK_K": triton.next_power_of_2(k), "GROUPS": groups,
                  "TOPK_GROUPS": kept, "NORM": True}
        builds.append(Build(f"MoE routing, {e} experts, {k} per token, {groups} groups",
                            routing._route_kernel, route, consts, 4 if e > 128 else 1))
    pairs = _sig({"ids_ptr": "*i64", "token_ptr": "*i64", "pos_ptr": "*i64",
                  "ends_ptr": "*i32"}, ["num_pairs", "first", "count"], ["K", "BLOCK", "BINS"])
    assert list(pairs) == moe_pairs._moe_pairs_kernel.arg_names
    for block, count in ((16, 256), (512, 256), (moe_pairs.MAX_PAIRS, 256),
                         (moe_pairs.MAX_PAIRS, 32)):
        builds.append(Build(f"MoE pair layout, {block} pairs, {count} experts here",
                            moe_pairs._moe_pairs_kernel, pairs,
                            {"K": 8, "BLOCK": block, "BINS": triton.next_power_of_2(count + 2)},
                            max(1, min(8, block // 256))))
    for dtype, limited in (("bf16", False), ("bf16", True), ("fp32", True)):
        shared = dtype == "bf16" and limited  # the MoE's output: plus the shared experts'
        combine = _sig({"y_ptr": f"*{dtype}", "pos_ptr": "*i64", "w_ptr": "*fp32",
                        "limit_ptr": "*i64", "shared_ptr": "*bf16",
                        "out_ptr": "*bf16" if shared else "*fp32"},
                       ["num_tokens", "H", "stride_y"], ["K", "BLOCK", "LIMITED", "SHARED"])
        assert list(combine) == moe_combine._moe_combine_kernel.arg_names
        builds.append(Build(f"MoE combine, {dtype} rows, k = 8"
                            + (", experts held elsewhere" if limited else "")
                            + (", plus the shared experts' bf16 output" if shared else ""),
                            moe_combine._moe_combine_kernel, combine,
                            {"K": 8, "BLOCK": moe_combine.BLOCK_H, "LIMITED": limited,
                             "SHARED": shared}, 4))
    return builds + grouped_builds()


def grouped_builds() -> list[Build]:
    """The routed experts' grouped GEMM (kernels/triton/fp8_linear.py _grouped_kernel) at
    GLM-5.3's shapes over 8 experts, with the tiles choose_grouped_config gives: bf16 experts
    and FP8 experts at decode (2, 128 and 512 pairs: 0.25, 16 and 64 rows per expert, b = 1,
    b = 64 and its MTP3 verify), FP8 experts at prefill; the first projection with silu(gate)
    · up fused where it is used (moe_compute.triton_grouped); the K range split as
    choose_grouped_split splits it on 132 SMs."""
    sig = _sig({"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "ends_ptr": "*i32",
                "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"},
               ["P", "N", "K", "stride_x", "num_nb", "num_kb", "E", "k_tiles_per_split"],
               ["E_P2", "BLOCK_M", "BLOCK_N", "BLOCK_K", "HAS_SCALE", "GLU", "DOT_PRECISION",
                "SPLIT_K"])
    assert list(sig) == fp8_linear._grouped_kernel.arg_names
    h, inter, e = 6144, 2048, 8
    builds = []
    for fp8, pairs, glu in ((False, 2, True), (False, 2, False), (True, 2, True),
                            (True, 2, False), (False, 128, True), (False, 512, True),
                            (False, 512, False), (True, 128, True), (True, 512, True),
                            (True, 512, False), (True, 16384, False)):
        n = inter if glu else 2 * inter
        cfg = fp8_linear.choose_grouped_config(pairs, n, h, e, 1 if fp8 else 2)
        split = fp8_linear.choose_grouped_split(pairs, n, h, e, cfg, 132)
        consts = {"E_P2": e, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                  "BLOCK_K": cfg.block_k, "HAS_SCALE": fp8, "GLU": glu, "DOT_PRECISION": "tf32",
                  "SPLIT_K": split}
        builds.append(Build(
            f"MoE grouped GEMM, {'FP8' if fp8 else 'bf16'} experts, {pairs} pairs"
            + (", silu(gate) · up fused" if glu else "")
            + f", {cfg.block_m}×{cfg.block_n}×{cfg.block_k} tiles"
            + (f", K split {split}" if split > 1 else ""),
            fp8_linear._grouped_kernel, sig | {"w_ptr": "*fp8e4nv" if fp8 else "*bf16"},
            consts, cfg.num_warps, cfg.num_stages, divisible=("N", "K")))
    return builds


def w8a8_builds() -> list[Build]:
    """W8A8 (kernels/triton/fp8_w8a8.py): the activation quantization (also of the MoE's
    silu(gate) · up), the GEMM with the tiles choose_config gives at 256 rows (MTP3
    verification at b = 64; GLM-5.3's q_a and o_proj) and the experts' grouped GEMM."""
    quant = _sig({"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                 ["M", "K", "stride_x", "k_off", "stride_sr", "stride_sg"],
                 ["BLOCK_R", "AMAX_FLOOR", "QMAX", "GLU"])
    assert list(quant) == fp8_w8a8._act_quant_kernel.arg_names
    builds = [Build("W8A8 activation quantization, 16 rows × 128"
                    + (", of silu(gate) · up" if glu else ""), fp8_w8a8._act_quant_kernel,
                    quant, {"BLOCK_R": 16, "AMAX_FLOOR": 1e-10, "QMAX": 448.0, "GLU": glu}, 4)
              for glu in (False, True)]
    gemm = _sig({"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                 "out_ptr": "*bf16"}, ["M", "N", "K", "n_off", "k_off", "num_kb"],
                ["BLOCK_M", "BLOCK_N", "GROUP_M", "K_ALIGNED", "FP8_DOT"])
    assert list(gemm) == fp8_w8a8._w8a8_kernel.arg_names
    for m, (name, n) in ((256, ("q_a", 2048)), (256, ("o_proj", 6144))):
        cfg = fp8_w8a8.choose_config(m, n, 132)
        builds.append(Build(f"W8A8 GEMM, {m} rows, {name}, {cfg.block_m}×{cfg.block_n} tiles",
                            fp8_w8a8._w8a8_kernel, gemm,
                            {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                             "GROUP_M": cfg.group_m, "K_ALIGNED": True, "FP8_DOT": True},
                            cfg.num_warps, cfg.num_stages, divisible=("N", "K")))
    # the weight-only kernel at decode with its K range split, the tile's last split summing
    # the partials (b = 1: q_a's 32 n tiles)
    dense = _sig({"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16",
                  "part_ptr": "*fp32", "count_ptr": "*i32"},
                 ["M", "N", "K", "stride_x", "n_off", "k_off", "num_kb", "k_tiles_per_split"],
                 ["BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "K_ALIGNED", "DOT_PRECISION"])
    assert list(dense) == fp8_linear._fp8_linear_kernel.arg_names
    cfg = fp8_linear.choose_config(1, 2048, 6144)
    split = fp8_linear.choose_split_k(1, 2048, 6144, cfg, 132)
    builds.append(Build(f"FP8 weight-only GEMM, 1 row, q_a, {cfg.block_m}×{cfg.block_n} tiles, "
                        f"K split {split}", fp8_linear._fp8_linear_kernel, dense,
                        {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                         "SPLIT_K": split, "K_ALIGNED": True, "DOT_PRECISION": "tf32"},
                        cfg.num_warps, cfg.num_stages, divisible=("N", "K")))
    grouped = _sig({"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                    "s_ptr": "*fp32", "ends_ptr": "*i32", "out_ptr": "*bf16"},
                   ["P", "N", "K", "num_nb", "num_kb", "E"],
                   ["E_P2", "BLOCK_M", "BLOCK_N", "FP8_DOT"])
    assert list(grouped) == fp8_w8a8._grouped_w8a8_kernel.arg_names
    cfg = fp8_w8a8.GROUPED_TILES
    builds.append(Build(f"W8A8 grouped GEMM, 8 experts, {cfg.block_m}×{cfg.block_n} tiles",
                        fp8_w8a8._grouped_w8a8_kernel, grouped,
                        {"E_P2": 8, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                         "FP8_DOT": True}, cfg.num_warps, cfg.num_stages, divisible=("N", "K")))
    return builds


def sampling_builds() -> list[Build]:
    """The emitted tokens' log-probabilities: a row's log-sum-exp (kernels/triton/logsumexp.py)."""
    sig = _sig({"x_ptr": "*fp32", "out_ptr": "*fp32"}, ["V", "stride_x"], ["BLOCK"])
    assert list(sig) == logsumexp._row_lse_kernel.arg_names
    return [Build("row log-sum-exp, 2048 lanes", logsumexp._row_lse_kernel, sig,
                  {"BLOCK": 2048}, 8)]


PARTS = {"sparse_mla": sparse_mla_builds, "sparse_mla_gluon": sparse_mla_gluon_builds,
         "sparse_mla_pingpong": sparse_mla_pingpong_builds,
         "sparse_mla_pingpong_fp8": sparse_mla_pingpong_fp8_builds,
         "indexer": indexer_builds, "indexer_gluon": indexer_gluon_builds,
         "row_topk": row_topk_builds, "writers": writer_builds, "residency": residency_builds,
         "residency_mtp": residency_mtp_builds, "fetch": fetch_builds, "moe": moe_builds,
         "w8a8": w8a8_builds, "sampling": sampling_builds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated parts of {', '.join(PARTS)}")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a build spills, overflows shared memory or draws a "
                             "ptxas note")
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(sorted(unknown))}")
    print("| build | warps | shared (B) | registers | stack (B) | wgmma | mma.sync | "
          "setmaxnreg |\n|---|---:|---:|---:|---:|---:|---:|---|", flush=True)
    failed = []
    for part in args.only.split(","):
        for build in PARTS[part]():
            r = resources(build)
            print(f"| {build.label} | {build.num_warps} | {r['shared']} | {r['registers']} | "
                  f"{r['stack']} | {r['wgmma']} | {r['mma.sync']} | {r['setmaxnreg']} |",
                  flush=True)
            for warning in r["warnings"]:
                print(f"    ptxas: {warning}", flush=True)
            if r["stack"] or r["shared"] > SHARED_LIMIT or r["warnings"]:
                failed.append(build.label)
    if args.check and failed:
        print("not clean: " + "; ".join(failed), flush=True)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
