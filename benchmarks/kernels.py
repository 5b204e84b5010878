"""Kernel benchmark: ceilings, the plain-PyTorch path and the Triton kernels, one table.

    python benchmarks/kernels.py [--quick] [--sweep] [--only PARTS] [--heads H,..]
                                 [--indices uniform,recent] [--json FILE] [--parts FILE]
                                 [--profile]

(--profile launches each kernel once without timing, for `ncu ... python benchmarks/kernels.py`;
e.g. `ncu -k regex:indexer_logits --section WarpStateStats python benchmarks/kernels.py --only
indexer_prefill --heads 32 --profile` reports every logits kernel and block shape at 32 heads.)

Measures on the current GPU, in one run:
  ceilings       device-to-device copy (bytes read + written), bf16 and fp8 8192³ matmuls
  sparse MLA     prefill from a bf16 workspace (64 heads, top-2048, 128K-token context,
                 T = 4096 and 16384; indices drawn uniformly over the context and as
                 FlashMLA's own benchmark draws them, mostly from the last 20,000 positions)
                 and FP8 paged decode (b = 128 s_q = 1 / 4, b = 32 s_q = 1; its default grid
                 against one CTA per row, mla_work.py), against a plain-PyTorch gather + bmm
                 path and FlashMLA as timed beside these kernels on an H200 (per index draw,
                 graph against graph: FLASHMLA_PREFILL_TFLOPS, FLASHMLA_DECODE_GRAPH_US)
  prefill_fp8    the same prefill (T = 4096) over an fp8_ds_mla page pool: the fp8 kernel
                 (its grid, one CTA per row, against 128 CTAs of 32 rows) against the
                 backend's bf16 workspace path, and the workspace's dequantization
                 (--sweep: both paths over chunk lengths and contexts, the break-even)
  routing        the MoE router's noaux_tc routing after its GEMM (GLM-5.3: 256 experts, 8 per
                 token; DeepSeek-V3.2: 8 groups, 4 kept) in one kernel, against PyTorch's chain
  moe_combine    the grouped MoE's combine (k = 8 rows per token summed back, H = 6144) at
                 decode and prefill sizes, against PyTorch's fp32 copy + index_add_; its pair
                 layout by expert (decode sizes) against PyTorch's sort
  indexer        FP8 paged logits (T = 4096 queries at the end of a 128K context; decode
                 b = 64 over 64K keys) with and without the top-k
  indexer_decode the decode rows of `indexer` alone
  indexer_prefill the prefill rows of `indexer` alone
  topk           the top-k stage alone on those logits (row_topk and the CUDA top-k against
                 torch.topk)
  writers        fp8_ds_mla and indexer-key cache writers
Times are medians of triton.testing.do_bench (CUDA events, L2 flushed before each run).
Inputs are random (never zeros); each Triton configuration is checked against the reference on
a slice of rows before it is timed.

--parts FILE writes the figures of the simulator's parts (dsaserve/plan/parts.py) that the
sections run measured, for `Parts.load` (`dsaserve simulate --parts`,
`benchmarks/simulate_calibration.py --parts`); each names this GPU, the date and the command.
The rows that measure them (`Row.part`; MEASURED_PARTS):
  hbm_tbps, matmul_bf16_tflops, matmul_fp8_tflops   ceilings: the copy and the two matmuls
  mla_prefill_tflops        prefill, uniform indices: the mean over the T it ran (4096, 16384)
  mla_decode_us             decode, CUDA graph: µs at 32 / 128 / 512 query rows (b 32; b 128
                            s_q 1; b 128 s_q 4)
  indexer_prefill_tflops    indexer, logits + the engine's top-k, 32 heads, T 4096 × 128K keys
  indexer_decode_tbps       indexer, logits + the engine's top-k, b 64 × 64K keys, s_q 1, CUDA
                            graph
(the engine's top-k: CUDA where it builds, else Triton), and the GPU's memory as torch sees
it. The smallest run that measures all of them (--quick would drop the decode curve's 512-row
point and T = 16384; the indexer's decode rows at s_q 2 and 4 still run, unused):

    python benchmarks/kernels.py --only ceilings,prefill,decode,indexer --heads 32 \
        --indices uniform --parts parts.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import triton
import triton.language as tl
import triton.testing

from dsaserve.kernels import reference
from dsaserve.kernels.cuda import indexer_logits as cuda_logits
from dsaserve.kernels.cuda import topk as cuda_topk
from dsaserve.kernels.metadata import AttentionMetadata, scattered_block_table
from dsaserve.kernels.triton import (
    index_cache,
    indexer,
    l2_hint,
    mla_cache,
    mla_work,
    mla_workspace,
    row_topk,
    sparse_mla,
)
from dsaserve.kernels.triton.backend import TritonBackend
from dsaserve.kernels.triton.sparse_mla import SparseMlaConfig
from dsaserve.kv import layout
from dsaserve.plan.parts import Curve, Measured, parts_json

DEV = "cuda"
L, R, TOPK, HEADS = 512, 64, 2048, 64
SCALE = 192**-0.5 * 1.873854
CONTEXT = 131072  # 128K-token contexts
FLOP_PER_ROW_HEAD = 2 * (L + R) + 2 * L  # per selected row, per head: q·k and p·v

# FlashMLA (9241ae3, its SM90 sparse kernels) timed side by side with these kernels on one
# H200, on this benchmark's own index draws, the decode from CUDA graphs
# (../shared/ANCHORS.md, 2026-12-04; the middle of its two runs). Compare per draw and graph
# against graph: FlashMLA itself runs ~480 TFLOP/s on uniform draws and ~560 on recent ones,
# so one figure (the 510 these rows were once held to) is no anchor. They are H200 figures:
# on another GPU the ratio is not printed.
FLASHMLA_PREFILL_TFLOPS = {(4096, "uniform"): 478.0, (4096, "recent"): 556.0,
                           (16384, "uniform"): 455.0, (16384, "recent"): 565.0}
FLASHMLA_DECODE_GRAPH_US = {(128, 1): 114.5, (128, 4): 442.5, (32, 1): 47.8}
ANCHOR_GPU = "H200"
TARGET_INDEXER_PREFILL_TFLOPS = 900.0
TARGET_INDEXER_DECODE_TBS = 3.4
INDEXER_HEADS = 32  # GLM-5.3's index_n_heads: the heads of the indexer_prefill_tflops part

# The figures of plan/parts.py's Parts that rows measure (Row.part: the name, "@x" for a point
# of a curve): --parts writes them.
MEASURED_PARTS = ("hbm_tbps", "matmul_bf16_tflops", "matmul_fp8_tflops", "mla_prefill_tflops",
                  "mla_decode_us", "indexer_prefill_tflops", "indexer_decode_tbps")


@dataclass
class Row:
    name: str
    ms: float
    value: float  # TFLOP/s or TB/s
    unit: str
    note: str = ""
    part: str = ""  # the Parts figure it measures (MEASURED_PARTS; "name@x": a curve's point)


ROWS: list[Row] = []


PROFILE = False  # --profile: run each timed kernel once (for Nsight Compute), report NaN
SWEEP = False  # --sweep: also time other launch shapes


def timed(fn: Callable[[], object], rep_ms: int = 200, graph: bool = False) -> float:
    """Median ms of fn. graph=True replays it from a CUDA graph: GPU time without the gaps the
    host leaves between launches (what an engine running CUDA graphs sees)."""
    fn()
    torch.cuda.synchronize()
    if PROFILE:
        return math.nan
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def flashmla_note(ours: float, anchor: float | None, higher_is_faster: bool,
                  gpu: str | None = None) -> str:
    """"x FlashMLA" (> 1: ours faster) against FlashMLA's figure for the same case and draw,
    where this GPU (`gpu`: its name, default the current device's) is the one it was
    measured on; else why there is no ratio."""
    if anchor is None:
        return "no FlashMLA figure for this case"
    if ANCHOR_GPU not in (gpu or torch.cuda.get_device_name()):
        return f"FlashMLA's figures are {ANCHOR_GPU} ones: no ratio on this GPU"
    ratio = ours / anchor if higher_is_faster else anchor / ours
    return f"{ratio:.2f}x FlashMLA ({anchor:g}, side by side on an {ANCHOR_GPU}, same draw)"


def add(name: str, ms: float, value: float, unit: str, note: str = "", part: str = "") -> None:
    assert not part or part.partition("@")[0] in MEASURED_PARTS, part
    ROWS.append(Row(name, ms, value, unit, note, part))
    print(f"  {name:<52} {ms * 1e3:>10.1f} us {value:>8.1f} {unit:<7} {note}", flush=True)


# --------------------------------------------------------------------------------------------
# Ceilings
# --------------------------------------------------------------------------------------------
PAGE_WORDS = 64 * 132 // 4  # one index-cache page (64 keys × 132 B) in int32 words: 2112


@triton.jit
def _page_read_kernel(src_ptr, pages_ptr, out_ptr, PAGE_WORDS: tl.constexpr):
    """Reads one whole page (its number from pages_ptr) and stores a checksum, so that the
    loads stay: the read-only traffic of the indexer's decode, without its math."""
    page = tl.load(pages_ptr + tl.program_id(0)).to(tl.int64)
    base = src_ptr + page * PAGE_WORDS
    head = tl.load(base + tl.arange(0, 2048))
    tail = tl.load(base + 2048 + tl.arange(0, PAGE_WORDS - 2048))
    tl.store(out_ptr + tl.program_id(0), tl.sum(head, 0) + tl.sum(tail, 0))


def page_read_ceiling(order: str, num_pages: int = 65536) -> float:
    """TB/s of reading num_pages index-cache pages (8,448 B each: the decode benchmark's 554
    MB), one program per page, in page order or in a random order: the access pattern of the
    indexer's decode logits, where requests' pages lie scattered in the pool."""
    src = torch.randint(0, 1 << 20, (num_pages * PAGE_WORDS,), device=DEV, dtype=torch.int32)
    pages = (torch.arange(num_pages, device=DEV) if order == "in order" else
             torch.randperm(num_pages, device=DEV)).int()
    out = torch.empty(num_pages, device=DEV, dtype=torch.int32)
    ms = timed(lambda: _page_read_kernel[(num_pages,)](src, pages, out, PAGE_WORDS=PAGE_WORDS,
                                                        num_warps=4))
    tbs = src.numel() * 4 / ms / 1e9
    add(f"page reads, 8.25 KB pages {order}", ms, tbs, "TB/s")
    return tbs


def ceilings() -> dict[str, float]:
    print("ceilings", flush=True)
    src = torch.randn(1 << 30, device=DEV, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms = timed(partial(dst.copy_, src))
    copy_tbs = 2 * src.numel() * 2 / ms / 1e9
    add("copy d2d (read + write)", ms, copy_tbs, "TB/s", part="hbm_tbps")
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms = timed(partial(torch.matmul, a, b))
    bf16 = 2 * n**3 / ms / 1e9
    add("matmul bf16 8192^3", ms, bf16, "TFLOP/s", part="matmul_bf16_tflops")
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV)
    ms = timed(partial(torch._scaled_mm, a8, b8.t(), one, one, out_dtype=torch.bfloat16))
    fp8 = 2 * n**3 / ms / 1e9
    add("matmul fp8 8192^3", ms, fp8, "TFLOP/s", part="matmul_fp8_tflops")
    page_read_ceiling("in order")
    pages_tbs = page_read_ceiling("in random order")
    return {"copy_tbs": copy_tbs, "bf16_tflops": bf16, "fp8_tflops": fp8,
            "page_tbs": pages_tbs}


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------
def topk_positions(limits: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """[T, k] distinct random positions < limits[t] (limits ≥ k here), int64."""
    out = torch.empty(len(limits), k, dtype=torch.int64, device=DEV)
    width = int(limits.max())
    for s in range(0, len(limits), chunk):
        keys = torch.rand(min(chunk, len(limits) - s), width, device=DEV)
        keys[torch.arange(width, device=DEV)[None, :] >= limits[s : s + chunk, None]] = -1.0
        out[s : s + chunk] = keys.topk(k, dim=1).indices
    return out


def recent_topk_positions(limits: torch.Tensor, k: int, window: int = 20000,
                          far: float = 1 / 32) -> torch.Tensor:
    """[T, k] positions < limits[t] drawn as FlashMLA's sparse-prefill benchmark draws its
    indices: each one, with probability 1 − far, uniform over the last `window` positions
    (with repeats), otherwise from k distinct uniform positions. The working set is then
    ~window rows (23 MB of bf16 workspace rows at 20,000), which fits in the H200's 50 MB L2,
    where uniform draws over a 128K-token context touch all of its 151 MB."""
    pos = topk_positions(limits, k)
    lo = (limits - window).clamp_min(0)[:, None]
    span = (limits[:, None] - 1 - lo).clamp_min(1)
    near = lo + (torch.rand(pos.shape, device=DEV) * span).long()
    return torch.where(torch.rand(pos.shape, device=DEV) >= far, near, pos)


INDEX_DRAWS = {"uniform": topk_positions, "recent": recent_topk_positions}


def fill_mla_cache(cache: torch.Tensor, chunk: int = 1 << 20) -> None:
    """Random latents through the Triton writer (so the cache holds valid fp8_ds_mla rows)."""
    num_slots = cache.shape[0] * cache.shape[1]
    for s in range(0, num_slots, chunk):
        n = min(chunk, num_slots - s)
        c = torch.randn(n, L, device=DEV, dtype=torch.bfloat16)
        k_pe = torch.randn(n, R, device=DEV, dtype=torch.bfloat16)
        mla_cache.write_mla_cache(cache, torch.arange(s, s + n, device=DEV), c, k_pe)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# --------------------------------------------------------------------------------------------
# Plain PyTorch paths (what a backend without kernels does: gather, bmm, softmax, bmm)
# --------------------------------------------------------------------------------------------
def torch_sparse_mla(q: torch.Tensor, rows_of: Callable[[torch.Tensor], torch.Tensor],
                     idx: torch.Tensor, chunk: int) -> torch.Tensor:
    """q [T, H, 576] bf16; rows_of(idx [C, K]) → [C, K, 576] bf16 rows; bf16 bmm, fp32 softmax."""
    out = torch.empty(q.shape[0], q.shape[1], L, dtype=q.dtype, device=DEV)
    for s in range(0, q.shape[0], chunk):
        i = idx[s : s + chunk]
        kv = rows_of(i)  # [C, K, 576]
        logits = torch.bmm(q[s : s + chunk], kv.transpose(1, 2)).float() * SCALE
        logits.masked_fill_((i < 0)[:, None, :], float("-inf"))
        p = torch.softmax(logits, dim=-1).to(q.dtype)
        out[s : s + chunk] = torch.bmm(p, kv[..., :L])
    return out


def gather_rows(flat: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return flat[i.clamp_min(0).long()]  # [C, K, 576]


def fp8_rows(cache: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    flat = cache.view(-1, cache.shape[-1])

    def rows_of(i: torch.Tensor) -> torch.Tensor:
        raw = flat[i.clamp_min(0).long()]  # [C, K, 656]
        vals = raw[..., :L].view(torch.float8_e4m3fn).to(torch.bfloat16)
        scales = raw[..., L : L + 16].contiguous().view(torch.float32).to(torch.bfloat16)
        c = (vals.view(*vals.shape[:-1], 4, 128) * scales[..., None]).flatten(-2)
        return torch.cat((c, raw[..., L + 16 :].contiguous().view(torch.bfloat16)), dim=-1)

    return rows_of


# --------------------------------------------------------------------------------------------
# Sparse MLA
# --------------------------------------------------------------------------------------------
# Triton (block_h, block_n, num_warps, num_stages), its default first, and the Gluon kernels
# (bf16 rows: the ping-pong kernel, then sparse_mla_gluon.py's 32-row kernel, the previous
# version; fp8_ds_mla rows take the latter unless pingpong_fp8, which decode and prefill_fp8
# time beside it), the default Gluon kernel also with its copies in each other l2_hint mode;
# --sweep adds the other Triton shapes.
MLA_CONFIGS = [SparseMlaConfig(64, 64, 8, 3, gluon=False), SparseMlaConfig(gluon=True)] + [
    SparseMlaConfig(gluon=True, l2_copies=mode) for mode in l2_hint.MODES
    if mode != SparseMlaConfig.l2_copies]
MLA_PREFILL_CONFIGS = MLA_CONFIGS + [SparseMlaConfig(gluon=True, pingpong=False)]
MLA_SWEEP = [SparseMlaConfig(64, 64, 8, 2, gluon=False), SparseMlaConfig(64, 32, 8, 5, gluon=False)]


def _mla_label(cfg: SparseMlaConfig, fp8: bool = True) -> str:
    if not cfg.gluon:
        return f"triton (n={cfg.block_n},st={cfg.num_stages})"
    hint = "" if cfg.l2_copies == "plain" else f", {cfg.l2_copies} L2 copies"
    pingpong = cfg.pingpong_fp8 if fp8 else cfg.pingpong
    return ("gluon ping-pong" if pingpong else "gluon 32-row") + hint


def check_config(q, cache, idx, cfg, rows: int = 48) -> float:
    o, _ = sparse_mla.sparse_mla_fwd(q[:rows], cache, idx[:rows], SCALE, L, cfg)
    ref, _ = reference.sparse_mla_paged(q[:rows], cache, idx[:rows], SCALE, L, R)
    err = rel_err(o, ref)
    if not err <= 1e-2:
        raise AssertionError(f"config {cfg}: relative error {err:.2e} > 1e-2")
    return err


def best_config(configs, q, cache, idx, flops, label) -> tuple[SparseMlaConfig, float]:
    best, best_ms = configs[0], math.inf
    fp8 = cache.dtype == torch.uint8
    for cfg in configs:
        try:
            check_config(q, cache, idx, cfg)
            ms = timed(partial(sparse_mla.sparse_mla_fwd, q, cache, idx, SCALE, L, cfg))
        except Exception as e:  # a configuration that does not compile (resources) is skipped
            print(f"  {label} {cfg}: skipped ({type(e).__name__}: {str(e)[:120]})", flush=True)
            continue
        print(f"    {label} {_mla_label(cfg, fp8)}: {ms * 1e3:.1f} us, "
              f"{flops / ms / 1e9:.1f} TFLOP/s", flush=True)
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms


def bench_prefill(quick: bool, sweep: bool, draws: tuple[str, ...]) -> None:
    """Each T with each index draw (INDEX_DRAWS): the Triton and Gluon configurations are
    compared on the first draw at T = 4096, and the Gluon kernel's L2 copy modes are timed
    again on the others, where rows are shared and an L2 policy can matter."""
    print("sparse MLA prefill (bf16 workspace, 64 heads, top-2048, 128K context)", flush=True)
    cache = torch.randn(1, CONTEXT, L + R, device=DEV, dtype=torch.bfloat16)
    flat = cache.view(CONTEXT, L + R)
    configs = MLA_PREFILL_CONFIGS + (MLA_SWEEP if sweep else [])
    gluon_modes = [SparseMlaConfig(gluon=True, l2_copies=m) for m in l2_hint.MODES]
    best = configs[0]
    for num_tokens in ((4096,) if quick else (4096, 16384)):
        positions = torch.arange(CONTEXT - num_tokens, CONTEXT, device=DEV)
        q = torch.randn(num_tokens, HEADS, L + R, device=DEV, dtype=torch.bfloat16)
        flops = num_tokens * HEADS * TOPK * FLOP_PER_ROW_HEAD
        for draw in draws:
            idx = INDEX_DRAWS[draw](positions + 1, TOPK).int()  # [T, 2048] workspace rows
            label = f"T={num_tokens} {draw} indices"
            first = draw == draws[0]
            if first and num_tokens == 4096:
                best, ms = best_config(configs, q, cache, idx, flops, label)
                cfg = best
            elif first:
                cfg = best
                check_config(q, cache, idx, cfg)
                ms = timed(partial(sparse_mla.sparse_mla_fwd, q, cache, idx, SCALE, L, cfg))
            else:
                cfg, ms = best_config(gluon_modes, q, cache, idx, flops, label)
            tflops = flops / ms / 1e9
            add(f"prefill {_mla_label(cfg, False)} {label}", ms, tflops, "TFLOP/s",
                flashmla_note(tflops, FLASHMLA_PREFILL_TFLOPS.get((num_tokens, draw)), True),
                part="mla_prefill_tflops" if draw == "uniform" else "")
            if first and num_tokens == 4096:
                torch_ms = timed(partial(torch_sparse_mla, q, partial(gather_rows, flat), idx,
                                         256), rep_ms=500)
                add("prefill plain-PyTorch T=4096", torch_ms, flops / torch_ms / 1e9,
                    "TFLOP/s", f"kernel {torch_ms / ms:.1f}x faster")


def bench_prefill_fp8(draws: tuple[str, ...], sweep: bool) -> None:
    """T = 4096 rows at the end of a 128K-token context whose pages lie scattered in an
    fp8_ds_mla pool, as the engine's prefill chunks see it: the fp8 kernel reading the selected
    rows through their slots, against TritonBackend.sparse_mla_positions (the context's pages
    dequantized once into a bf16 workspace, then the ping-pong kernel), and the
    dequantization alone. --sweep: both paths over chunk lengths and contexts, for
    SparseMlaConfig.workspace_min_reads (the reads per context row where the workspace pays)."""
    print("sparse MLA prefill over an fp8_ds_mla cache (64 heads, top-2048, 128K context)",
          flush=True)
    num_tokens, block_size = 4096, 64
    pages = CONTEXT // block_size
    cache = torch.empty(4 * pages, block_size, 656, dtype=torch.uint8, device=DEV)
    fill_mla_cache(cache)
    table = torch.randperm(4 * pages, device=DEV)[:pages].int()[None]  # [1, 2048]
    meta = AttentionMetadata.for_requests([CONTEXT], [num_tokens], table, block_size)
    q = torch.randn(num_tokens, HEADS, L + R, device=DEV, dtype=torch.bfloat16)
    flops = num_tokens * HEADS * TOPK * FLOP_PER_ROW_HEAD
    backend = TritonBackend()
    for draw in draws:
        pos = INDEX_DRAWS[draw](meta.positions + 1, TOPK).int()  # [T, 2048] positions
        slots = layout.logical_to_slots(pos, meta.req_indices, table, block_size).int()
        check_config(q, cache, slots, SparseMlaConfig())
        o, _ = backend.sparse_mla_positions(q, cache, pos, meta, SCALE, L)
        ref, _ = reference.sparse_mla_paged(q[:48], cache, slots[:48], SCALE, L, R)
        if not rel_err(o[:48], ref) <= 1e-2:
            raise AssertionError(f"workspace path: relative error {rel_err(o[:48], ref):.2e}")
        ms = timed(partial(sparse_mla.sparse_mla_fwd, q, cache, slots, SCALE, L))
        # The default grid (one CTA per row here) against whole rows back to back, one CTA
        # per SM at most (mla_work.choose_grid: why not for this many rows).
        ctas = mla_work.whole_row_ctas(num_tokens,
                                       torch.cuda.get_device_properties(0).multi_processor_count)
        packed = SparseMlaConfig(num_splits=1, num_ctas=ctas)
        packed_ms = timed(partial(sparse_mla.sparse_mla_fwd, q, cache, slots, SCALE, L, packed))
        add(f"prefill fp8 cache, gluon 32-row, T=4096 {draw} indices", ms, flops / ms / 1e9,
            "TFLOP/s", f"{ctas} CTAs of {triton.cdiv(num_tokens, ctas)} rows "
            f"{packed_ms * 1e3:.1f} us ({ms / packed_ms:.3f}x)")
        pingpong = SparseMlaConfig(pingpong_fp8=True)
        check_config(q, cache, slots, pingpong)
        pp_ms = timed(partial(sparse_mla.sparse_mla_fwd, q, cache, slots, SCALE, L, pingpong))
        add(f"prefill fp8 cache, gluon ping-pong, T=4096 {draw} indices", pp_ms,
            flops / pp_ms / 1e9, "TFLOP/s", f"{ms / pp_ms:.2f}x the 32-row kernel")
        ws_ms = timed(partial(backend.sparse_mla_positions, q, cache, pos, meta, SCALE, L))
        add(f"prefill fp8 cache via bf16 workspace, T=4096 {draw} indices", ws_ms,
            flops / ws_ms / 1e9, "TFLOP/s",
            f"{ms / ws_ms:.2f}x the fp8 kernel; " + flashmla_note(
                flops / ws_ms / 1e9, FLASHMLA_PREFILL_TFLOPS.get((num_tokens, draw)), True))
    segment = mla_workspace.Segment((0, num_tokens), (0,), True)
    deq_ms = timed(partial(mla_workspace.build_workspace, cache, table, segment,
                           meta.seq_lens, L))
    moved = CONTEXT * (656 + (L + R) * 2)  # fp8 rows read, bf16 rows written
    add("fp8_ds_mla pages -> bf16 workspace, 128K rows", deq_ms, moved / deq_ms / 1e9, "TB/s")
    if sweep:
        workspace_sweep(cache, block_size)


def workspace_sweep(cache: torch.Tensor, block_size: int) -> None:
    """Both paths of sparse_mla_positions (the workspace forced on, then off) for chunks of T
    tokens at the end of a context, uniform draws: where does the workspace start to pay?"""
    always = TritonBackend(SparseMlaConfig(workspace_min_reads=1e-9))
    never = TritonBackend(SparseMlaConfig(workspace_min_reads=math.inf))
    print("  workspace break-even (uniform draws, CUDA graph): context, T, reads per context "
          "row, fp8 kernel us, workspace us, ratio", flush=True)
    for context in (16384, 65536, CONTEXT):
        table = torch.randperm(cache.shape[0], device=DEV)[:context // block_size].int()[None]
        for num_tokens in (64, 256, 1024, 4096):
            meta = AttentionMetadata.for_requests([context], [num_tokens], table, block_size)
            pos = topk_positions(meta.positions + 1, TOPK).int()
            q = torch.randn(num_tokens, HEADS, L + R, device=DEV, dtype=torch.bfloat16)
            ms = {}
            for name, backend in (("fp8", never), ("workspace", always)):
                ms[name] = timed(partial(backend.sparse_mla_positions, q, cache, pos, meta, SCALE,
                                         L), graph=True)
            reads = num_tokens * TOPK / context
            print(f"    {context:>7} {num_tokens:>5} {reads:>8.1f} {ms['fp8'] * 1e3:>9.1f} "
                  f"{ms['workspace'] * 1e3:>9.1f} {ms['fp8'] / ms['workspace']:>6.2f}x",
                  flush=True)


def decode_case(batch: int, s_q: int, pool_pages: int, cache: torch.Tensor):
    pages_per_req = CONTEXT // 64
    table = torch.randint(0, pool_pages, (batch, pages_per_req), device=DEV)  # shared pool
    rows = torch.arange(batch, device=DEV).repeat_interleave(s_q)
    limits = torch.full((batch * s_q,), CONTEXT, device=DEV)
    pos = topk_positions(limits, TOPK)
    idx = (table[rows[:, None], pos // 64] * 64 + pos % 64).int()  # [T, 2048] slots
    q = torch.randn(batch * s_q, HEADS, L + R, device=DEV, dtype=torch.bfloat16)
    return q, idx


def bench_routing() -> None:
    """kernels/triton/routing.py against model/dsa.py's `route_reference` (PyTorch's chain of
    small kernels), CUDA graphs, decode and prefill batch sizes."""
    from dsaserve.config import ModelConfig
    from dsaserve.kernels.triton import routing
    from dsaserve.model.dsa import route_reference
    from dsaserve.model.presets import preset_config

    print("MoE routing after the router GEMM: kernel / PyTorch (us)", flush=True)
    for preset in ("glm-5.3", "deepseek-v3.2"):
        cfg = ModelConfig.from_hf(preset_config(preset))
        for n in (1, 64, 4096):
            logits = torch.randn(n, cfg.n_routed_experts, device=DEV)
            bias = torch.randn(cfg.n_routed_experts, device=DEV) * 0.1
            kernel = partial(routing.route, logits, bias, cfg.num_experts_per_tok, cfg.n_group,
                             cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
            plain = partial(route_reference, logits, bias, cfg)
            # the same experts but where two choices are near-tied (the kernel's sigmoid takes
            # Triton's fast exp, an ulp or two from PyTorch's): counted, with the widest gap
            # between the two selections' summed choice scores
            ids_k, ids_p = kernel()[0], plain()[0]
            choice = logits.sigmoid() + bias
            gap = (choice.gather(1, ids_p).sum(1) - choice.gather(1, ids_k).sum(1)).abs()
            parted = int((ids_k != ids_p).any(1).sum())
            print(f"  routing {preset} N={n}: {parted} tokens routed otherwise, widest gap "
                  f"{float(gap.max()):.2e}", flush=True)
            ms = [timed(fn, graph=True) for fn in (kernel, plain)]
            add(f"routing {preset} N={n}", ms[0], n / ms[0] / 1e3, "Mtok/s",
                f"PyTorch {ms[1] * 1e3:.1f} us: {ms[1] / ms[0]:.2f}x")


def _index_add_combine(y: torch.Tensor, token_of: torch.Tensor, w_sorted: torch.Tensor,
                       n: int) -> torch.Tensor:
    """The PyTorch combine moe_combine replaced: fp32 copies and atomic adds."""
    out = torch.zeros(n, y.shape[1], dtype=torch.float32, device=y.device)
    return out.index_add_(0, token_of, y.float() * w_sorted[:, None])


def bench_moe_combine() -> None:
    """kernels/triton/moe_combine.py against the PyTorch combine it replaced (an fp32 copy of
    the pair rows, their product with the weights, atomic index_add_), GLM-5.3's k and H."""
    from dsaserve.kernels.triton import moe_combine, moe_pairs
    from dsaserve.model import moe_compute

    k, hidden, experts = 8, 6144, 256
    print("MoE combine (k = 8, H = 6144): kernel / PyTorch index_add_ (us)", flush=True)
    for n in (64, 256, 4096, 16384):
        ids = torch.argsort(torch.rand(n, experts, device=DEV), dim=1)[:, :k]
        weights = torch.rand(n, k, device=DEV)
        order, _ = moe_compute._sort_pairs(ids, 0, experts, held_all=True)
        y = torch.randn(n * k, hidden, device=DEV, dtype=torch.bfloat16)
        pos = moe_compute.pair_positions(order, weights.shape)
        token_of, w_sorted = order // k, weights.flatten()[order]

        plain = partial(_index_add_combine, y, token_of, w_sorted, n)
        got = moe_combine.moe_combine(y, pos, weights)
        torch.testing.assert_close(got, plain(), rtol=1e-5, atol=1e-4)
        ms = [timed(fn, graph=True) for fn in (partial(moe_combine.moe_combine, y, pos, weights),
                                              plain)]
        moved = y.numel() * 2 + n * hidden * 4  # y read once, out written once
        add(f"moe_combine N={n}", ms[0], moved / ms[0] / 1e9, "TB/s",
            f"PyTorch index_add_ {ms[1] * 1e3:.1f} us: {ms[1] / ms[0]:.2f}x")
        if n * k <= moe_pairs.MAX_PAIRS:  # the pairs' layout by expert, against the sort
            ms = [timed(partial(moe_pairs.moe_pairs, ids, 0, experts), graph=True),
                  timed(partial(moe_compute.pair_layout_reference, ids, 0, experts, True),
                        graph=True)]
            add(f"moe_pairs N={n}", ms[0], n / ms[0] / 1e3, "Mtok/s",
                f"PyTorch sort {ms[1] * 1e3:.1f} us: {ms[1] / ms[0]:.2f}x")


def bench_decode(quick: bool, sweep: bool) -> None:
    print("sparse MLA FP8 decode (fp8_ds_mla pages of 64, 64 heads, top-2048)", flush=True)
    pool_pages = 65536  # 4M slots, 2.75 GB; requests map their 128K positions into it randomly
    cache = torch.empty(pool_pages, 64, 656, dtype=torch.uint8, device=DEV)
    fill_mla_cache(cache)
    cases = [(128, 1), (32, 1)] if quick else [(128, 1), (128, 4), (32, 1)]
    configs = MLA_CONFIGS + (MLA_SWEEP if sweep else [])
    best = configs[0]
    for batch, s_q in cases:
        q, idx = decode_case(batch, s_q, pool_pages, cache)
        flops = batch * s_q * HEADS * TOPK * FLOP_PER_ROW_HEAD
        if (batch, s_q) == (128, 1):
            best, _ = best_config(configs, q, cache, idx, flops, f"b={batch} s_q={s_q}")
        else:
            check_config(q, cache, idx, best)
        # GPU time from a CUDA graph, as an engine runs its decode steps: eager timing of the
        # split path (partials allocated, kernel, merge) at b = 32 measures the host instead
        # (H200: 72-160 µs eager, varying run to run, against 41 µs of GPU time).
        fn = partial(sparse_mla.sparse_mla_fwd, q, cache, idx, SCALE, L, best)
        ms, eager_ms = timed(fn, graph=True), timed(fn)
        add(f"decode {_mla_label(best)} b={batch} s_q={s_q}, CUDA graph", ms,
            flops / ms / 1e9, "TFLOP/s",
            flashmla_note(ms * 1e3, FLASHMLA_DECODE_GRAPH_US.get((batch, s_q)), False)
            + f"; eager {eager_ms * 1e3:.1f} us", part=f"mla_decode_us@{batch * s_q}")
        if best.gluon:  # the default grid against one CTA per row (the schedule before it)
            per_row = dataclasses.replace(best, num_splits=1, num_ctas=batch * s_q)
            per_row_ms = timed(partial(sparse_mla.sparse_mla_fwd, q, cache, idx, SCALE, L,
                                       per_row), graph=True)
            print(f"    b={batch} s_q={s_q} {_mla_label(best)}, one CTA per row, CUDA graph: "
                  f"{per_row_ms * 1e3:.1f} us (default grid {per_row_ms / ms:.3f}x)",
                  flush=True)
        others = []
        if best.gluon:  # the other Gluon kernel for fp8_ds_mla rows, then the other L2 copies
            others.append(dataclasses.replace(best, pingpong_fp8=not best.pingpong_fp8))
            others += [dataclasses.replace(best, l2_copies=mode) for mode in l2_hint.MODES
                       if mode != best.l2_copies]
        for other in others:
            label = f"b={batch} s_q={s_q} {_mla_label(other)}, CUDA graph"
            try:
                check_config(q, cache, idx, other)
            except RuntimeError as e:  # l2_hint refusing a miscompiled variant: not timed
                print(f"    {label}: skipped ({str(e)[:160]})", flush=True)
                continue
            other_ms = timed(partial(sparse_mla.sparse_mla_fwd, q, cache, idx, SCALE, L, other),
                             graph=True)
            print(f"    {label}: {other_ms * 1e3:.1f} us (default {other_ms / ms:.3f}x)",
                  flush=True)
        if (batch, s_q) == (128, 1):
            torch_ms = timed(partial(torch_sparse_mla, q, fp8_rows(cache), idx, 32), rep_ms=500)
            add("decode plain-PyTorch b=128 s_q=1", torch_ms, flops / torch_ms / 1e9, "TFLOP/s",
                f"kernel {torch_ms / ms:.1f}x faster")


# --------------------------------------------------------------------------------------------
# Indexer
# --------------------------------------------------------------------------------------------
def index_meta(seq_lens: list[int], new: list[int], block_size: int = 64):
    pages = [-(-s // block_size) for s in seq_lens]
    table = scattered_block_table(pages, device=DEV)
    meta = AttentionMetadata.for_requests(seq_lens, new, table, block_size)
    cache = torch.empty(sum(pages), block_size * 132, dtype=torch.uint8, device=DEV)
    slots = torch.arange(sum(pages) * block_size, device=DEV)
    for s in range(0, len(slots), 1 << 20):
        part = slots[s : s + (1 << 20)]
        index_cache.write_index_cache(cache, part, torch.randn(len(part), 128, device=DEV,
                                                           dtype=torch.bfloat16))
    return meta, cache


def topk_stage(logits: torch.Tensor, group_max: torch.Tensor, limits: torch.Tensor,
               label: str) -> None:
    """The top-k stage alone: torch.topk on the logits rows against row_topk (Triton: threshold
    from the group maxima, one compaction pass, selection from the short lists; three launches)
    and the CUDA kernel (the same in one launch, a block per row). Each checked equal to
    torch.topk first; --sweep also times other launch shapes."""
    nbytes = float(limits.clamp_max(logits.shape[1]).sum()) * 4
    ref = torch.topk(logits, TOPK, 1)
    ms_torch = timed(partial(torch.topk, logits, TOPK, 1))
    add(f"top-2048 torch.topk {label}", ms_torch, nbytes / ms_torch / 1e9, "TB/s",
        "of logits read")
    kernels = {"row_topk": partial(row_topk.topk_rows, logits, group_max, limits, TOPK)}
    if cuda_topk.available():
        kernels["CUDA topk"] = partial(cuda_topk.topk_rows, logits, group_max, limits, TOPK)
    else:
        print(f"    CUDA topk: {cuda_topk.unavailable_reason()}", flush=True)
    for name, fn in kernels.items():
        ours_first = fn()[0].sort(dim=1, descending=True).values  # their order is arbitrary
        assert torch.equal(ours_first, ref.values), f"{name} differs from torch.topk"
        ms = timed(fn)
        add(f"top-2048 {name} {label}", ms, nbytes / ms / 1e9, "TB/s",
            f"{ms_torch / ms:.1f}x torch.topk")
        ms = timed(fn, graph=True)
        add(f"top-2048 {name} {label}, CUDA graph", ms, nbytes / ms / 1e9, "TB/s",
            f"{ms_torch / ms:.1f}x torch.topk")
    if SWEEP:
        variants = [{"segment": seg, "slot_per_key": per_key}
                    for seg in (1024, 2048) for per_key in (False, True)]
        variants += [{"threshold_warps": t, "finish_warps": f}
                     for t, f in ((4, 4), (8, 4), (8, 8), (16, 4), (16, 8))]
        for kw in variants:
            fn = partial(row_topk.topk_rows, logits, group_max, limits, TOPK, **kw)
            assert torch.equal(fn()[0].sort(dim=1, descending=True).values, ref.values)
            print(f"    row_topk {kw}: {timed(fn, graph=True) * 1e3:.1f} us", flush=True)
        if "CUDA topk" in kernels:
            # (threads, blocks per row, compaction): the groups above the threshold, the
            # whole row from memory, or the whole row staged in shared memory first.
            shapes = [(512, 1, "groups"), (512, 1, "row")]
            shapes += [(1024, c, how) for c in cuda_topk.CLUSTER_SIZES
                       for how in ("groups", "row", "staged row")]
            for threads, cluster, how in shapes:
                fn = partial(cuda_topk.topk_rows, logits, group_max, limits, TOPK,
                             threads=threads, cluster=cluster, group_list=how == "groups",
                             stage=how == "staged row")
                assert torch.equal(fn()[0].sort(dim=1, descending=True).values, ref.values)
                print(f"    CUDA topk {threads} threads, {cluster} blocks per row, {how}: "
                      f"{timed(fn, graph=True) * 1e3:.1f} us", flush=True)
    if not PROFILE:
        for name, fn in kernels.items():
            kernel_times(fn, f"{name} {label}")


def kernel_times(fn: Callable[[], object], label: str) -> None:
    """Per-kernel GPU time of one call (torch.profiler), to see where a multi-kernel op goes."""
    fn()
    torch.cuda.synchronize()
    activity = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[activity], acc_events=True) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    parts = ", ".join(f"{e.key[:40]} {e.device_time_total:.0f} us"
                      for e in sorted(events, key=lambda e: -e.device_time_total)[:6])
    print(f"    {label} kernels: {parts}", flush=True)


def _indexer_configs(sweep: bool) -> list[indexer.IndexerConfig]:
    """The logits kernels (Triton, Gluon, CUDA where it builds) at their default launch shapes;
    --sweep: others."""
    cuda = cuda_logits.supported(torch.zeros(1, 64, 128, device=DEV, dtype=torch.bfloat16),
                                 torch.zeros(1, dtype=torch.uint8, device=DEV), 64)
    if not sweep:
        return [indexer.IndexerConfig(gluon=False, cuda_logits=False),
                indexer.IndexerConfig(gluon=True, cuda_logits=False)] + \
            [indexer.IndexerConfig(cuda_logits=True, cuda_shape=sh) for sh in cuda_logits.SHAPES
             if cuda]
    return [indexer.IndexerConfig(rows_per_tile=r, pages_per_prog=p, gluon=gl, cuda_logits=False)
            for gl in (False, True) for r in (128, 256) for p in (16, 32, 64, 128)] + \
        [indexer.IndexerConfig(pages_per_prog=p, cuda_logits=True, cuda_shape=sh)
         for sh in cuda_logits.SHAPES for p in (32, 64, 128, 256) if cuda]


def _best(fn: Callable[..., object], configs: list[indexer.IndexerConfig], label: str,
          abs_fn: Callable[..., object] | None = None) -> tuple[float, indexer.IndexerConfig]:
    """The fastest of configs for fn (indexer_logits_paged with all but the config bound), each
    checked against the first one's logits (same fp8 products: equal up to the fp32 order of
    the head sum; −inf in the same places; the CUDA kernel's linear shapes within
    indexer_logits.LINEAR_REL_ERROR of abs_fn's logits, the same call on abs_inputs) before it
    is timed."""
    best = (math.inf, configs[0])
    ref = fn(config=configs[0])[0]
    linear = [c for c in configs if c.cuda_shape and cuda_logits.Shape(*c.cuda_shape).linear]
    bound = abs_fn(config=configs[0])[0] * cuda_logits.LINEAR_REL_ERROR \
        if linear and abs_fn else None
    for cfg in configs[1:]:
        _check_logits(fn(config=cfg)[0], ref, _label(cfg), bound if cfg in linear else None)
    del ref, bound
    for cfg in configs:
        ms = timed(partial(fn, config=cfg))
        if len(configs) > 1:
            print(f"    {label} {_label(cfg)}: {ms * 1e3:.1f} us", flush=True)
        best = min(best, (ms, cfg), key=lambda x: x[0])
    return best


def _check_logits(out: torch.Tensor, ref: torch.Tensor, label: str,
                  bound: torch.Tensor | None = None) -> None:
    """Same fp8 products: equal up to the fp32 order of the head sum (or within bound), −inf in
    the same places."""
    assert torch.equal(out.isneginf(), ref.isneginf()), f"{label}: −inf differs"
    finite = ref.isfinite()
    atol = 1e-5 * float(ref[finite].abs().max())
    if bound is None:
        torch.testing.assert_close(out[finite], ref[finite], rtol=1e-5, atol=atol)
    else:
        excess = float(((out - ref)[finite].abs() - bound[finite]).max())
        assert excess <= atol, f"{label}: beyond the linear shapes' bound by {excess}"


def _label(cfg: indexer.IndexerConfig) -> str:
    if cfg.cuda_logits:
        if not cfg.cuda_shape:
            return f"(CUDA, auto shape, {cfg.pages_per_prog or 'auto'} pages)"
        shape = cuda_logits.Shape(*cfg.cuda_shape)
        return (f"(CUDA, {shape.consumers} x {shape.rows} rows, depth {shape.depth}"
                f"{', linear' if shape.linear else ''}, {cfg.pages_per_prog or 'auto'} pages)")
    if cfg.gluon:
        return (f"(Gluon, {cfg.rows_per_tile} rows, {cfg.pages_per_prog or 'auto'} pages"
                f"{', in pairs' if cfg.gluon_pairs else ''})")
    return (f"(Triton, {cfg.rows_per_tile} rows, {cfg.pages_per_prog or 'auto'} pages, "
            f"{cfg.num_stages} st, {cfg.num_warps} warps)")


def bench_indexer(quick: bool, sweep: bool, prefill: bool = True, decode: bool = True,
                  heads_list: tuple[int, ...] = (64, 32)) -> None:
    print("FP8 indexer (pages of 64 x 132 B)", flush=True)
    configs = _indexer_configs(sweep)
    for heads in (heads_list[:1] if quick else heads_list) if prefill else ():
        num_tokens = 4096
        meta, cache = index_meta([CONTEXT], [num_tokens])
        q = torch.randn(num_tokens, heads, 128, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(num_tokens, heads, device=DEV) * heads**-0.5 * 128**-0.5
        visible = float((meta.positions + 1).sum())
        flops = visible * heads * 128 * 2
        logits = partial(indexer.indexer_logits_paged, q, w, cache, meta)
        abs_logits = partial(indexer.indexer_logits_paged, *cuda_logits.abs_inputs(q, w, cache),
                             meta)
        ms, cfg = _best(logits, configs, f"prefill logits H={heads}", abs_logits)
        add(f"indexer prefill logits H={heads} T=4096 S=128K {_label(cfg)}", ms,
            flops / ms / 1e9, "TFLOP/s", f"target {TARGET_INDEXER_PREFILL_TFLOPS:.0f}")
        for i, topk_kernel in enumerate(_topk_kernels()):  # the engine's first
            run = dataclasses.replace(cfg, topk_kernel=topk_kernel)
            ms = timed(partial(indexer.indexer_topk, q, w, cache, meta, TOPK, run), rep_ms=500)
            add(f"indexer prefill logits+topk H={heads}, {topk_kernel} top-k", ms,
                flops / ms / 1e9, "TFLOP/s", f"target {TARGET_INDEXER_PREFILL_TFLOPS:.0f}",
                part="indexer_prefill_tflops" if heads == INDEXER_HEADS and i == 0 else "")
    batch, keys = 64, 65536
    for s_q in ((1,) if quick else (1, 2, 4)) if decode else ():
        meta, cache = index_meta([keys] * batch, [s_q] * batch)
        q = torch.randn(batch * s_q, 64, 128, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(batch * s_q, 64, device=DEV) * 64**-0.5 * 128**-0.5
        nbytes = batch * keys * 132
        logits = partial(indexer.indexer_logits_paged, q, w, cache, meta)
        abs_logits = partial(indexer.indexer_logits_paged, *cuda_logits.abs_inputs(q, w, cache),
                             meta)
        # One-token tiles (s_q = 1) also with the Gluon kernel's pages taken in pairs.
        pairs = [indexer.IndexerConfig(gluon=True, cuda_logits=False, gluon_pairs=True)
                 ] if s_q == 1 else []
        ms, cfg = _best(logits, configs + pairs, f"decode logits s_q={s_q}", abs_logits)
        add(f"indexer decode logits b=64 s_q={s_q} 64K keys {_label(cfg)}", ms, nbytes / ms / 1e9,
            "TB/s", f"target {TARGET_INDEXER_DECODE_TBS}")
        for i, topk_kernel in enumerate(_topk_kernels()):  # the engine's first
            run = dataclasses.replace(cfg, topk_kernel=topk_kernel)
            both = partial(indexer.indexer_topk, q, w, cache, meta, TOPK, run)
            label = f"indexer decode logits+topk b=64 s_q={s_q}, {topk_kernel} top-k"
            ms = timed(both)
            add(label, ms, nbytes / ms / 1e9, "TB/s", "eager: includes the host's launch gaps")
            ms = timed(both, graph=True)
            add(f"{label}, CUDA graph", ms, nbytes / ms / 1e9, "TB/s",
                f"target {TARGET_INDEXER_DECODE_TBS}",
                part="indexer_decode_tbps" if s_q == 1 and i == 0 else "")
            if s_q == 1:
                kernel_times(both, f"decode logits+topk s_q=1, {topk_kernel} top-k")


def _topk_kernels() -> list[str]:
    """The top-k kernels to time: the CUDA one where it builds, and the Triton one (the first:
    the one the engine takes, IndexerConfig.topk_kernel)."""
    if cuda_topk.available():
        return ["cuda", "triton"]
    print(f"    CUDA topk: {cuda_topk.unavailable_reason()}", flush=True)
    return ["triton"]


def bench_topk() -> None:
    """The top-k stage alone on the indexer's own logits (prefill and decode shapes)."""
    print("top-2048 of indexer logits rows", flush=True)
    cases = [([CONTEXT], [4096], "prefill T=4096 S=128K"),
             # A row pass of a 1M-token context (indexer_topk: 512 tokens × 1M keys
             # is the 2 GiB logits bound): rows longer than the top-k caches its maxima for.
             ([1 << 20], [512], "prefill window T=512 S=1M")]
    cases += [([65536] * 64, [s_q] * 64, f"decode b=64 s_q={s_q} S=64K")  # 4: MTP's verify
              for s_q in (1, 4)]
    for seq_lens, new, label in cases:
        meta, cache = index_meta(seq_lens, new)
        q = torch.randn(meta.num_tokens, 64, 128, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(meta.num_tokens, 64, device=DEV) * 64**-0.5 * 128**-0.5
        topk_stage(*indexer._logits(q, w, cache, meta, indexer.IndexerConfig()), label)
        del meta, cache, q, w


def bench_writers() -> None:
    print("cache writers", flush=True)
    n = 1 << 16
    cache = torch.empty(4096, 64, 656, dtype=torch.uint8, device=DEV)
    slots = torch.randperm(cache.shape[0] * 64, device=DEV)[:n]
    c = torch.randn(n, L, device=DEV, dtype=torch.bfloat16)
    k_pe = torch.randn(n, R, device=DEV, dtype=torch.bfloat16)
    ms = timed(partial(mla_cache.write_mla_cache, cache, slots, c, k_pe))
    add("fp8_ds_mla writer N=65536", ms, n * (2 * (L + R) + 656 + 8) / ms / 1e9, "TB/s")
    icache = torch.empty(4096, 64 * 132, dtype=torch.uint8, device=DEV)
    k = torch.randn(n, 128, device=DEV, dtype=torch.bfloat16)
    ms = timed(partial(index_cache.write_index_cache, icache, slots, k))
    add("indexer key writer N=65536", ms, n * (256 + 132 + 8) / ms / 1e9, "TB/s")


def parts_figures(rows: list[Row], source: str) -> dict[str, Measured | Curve]:
    """The Parts figures that `rows` measured (Row.part): a scalar figure is the mean of its
    rows' rates, a curve's points are its rows' µs by x; each figure's source is `source` and
    the rows it came from. A curve measured at fewer than 2 points is left out."""
    scalars: dict[str, list[Row]] = {}
    points: dict[str, dict[float, Row]] = {}
    for r in rows:
        name, _, x = r.part.partition("@")
        if x:
            points.setdefault(name, {})[float(x)] = r
        elif name:
            scalars.setdefault(name, []).append(r)
    out: dict[str, Measured | Curve] = {}
    for name, rs in scalars.items():
        if len({r.unit for r in rs}) != 1:
            raise ValueError(f"{name}: rows in several units: {[r.unit for r in rs]}")
        out[name] = Measured(statistics.mean(r.value for r in rs), rs[0].unit,
                             f"{source}; mean of: {' / '.join(r.name for r in rs)}"
                             if len(rs) > 1 else f"{source}; {rs[0].name}")
    for name, by_x in points.items():
        if len(by_x) < 2:
            print(f"--parts: {name} measured at {len(by_x)} point(s), not written", flush=True)
            continue
        xs = tuple(sorted(by_x))
        out[name] = Curve(xs, tuple(by_x[x].ms * 1e3 for x in xs), "us",
                          f"{source}; {' / '.join(by_x[x].name for x in xs)}")
    return out


def parts_file(rows: list[Row], gpu: str, date: str, command: str,
               hbm_bytes: int | None = None) -> dict:
    """What --parts writes: the figures of `rows` as the file Parts.load reads."""
    source = f"{gpu} run, benchmarks/kernels.py, {date}"
    return parts_json(parts_figures(rows, source), gpu, date, command, hbm_bytes)


def head_counts(text: str) -> tuple[int, ...]:
    """--heads: comma-separated positive head counts."""
    try:
        counts = tuple(int(h) for h in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 64,32, got {text!r}")
    return counts


def index_draws(text: str) -> tuple[str, ...]:
    draws = tuple(text.split(","))
    bad = [d for d in draws if d not in INDEX_DRAWS]
    if bad or not draws:
        raise argparse.ArgumentTypeError(
            f"--indices: {','.join(bad) or text!r} not among {', '.join(INDEX_DRAWS)}")
    return draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--sweep", action="store_true", help="time several tile configurations")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--parts", default=None, metavar="FILE",
                        help="also write the simulator's parts the rows measured to this file "
                             "(dsaserve/plan/parts.py's Parts.load)")
    parser.add_argument("--only",
                        default="ceilings,prefill,prefill_fp8,decode,moe_combine,"
                                "routing,indexer,topk,writers")
    parser.add_argument("--heads", type=head_counts, default=(64, 32),
                        help="index head counts of the indexer prefill rows (default 64,32)")
    parser.add_argument("--indices", type=index_draws, default=("uniform", "recent"),
                        help="index draws of the sparse MLA prefill rows: uniform (over the "
                             "whole context) and/or recent (FlashMLA's benchmark: 31 in 32 "
                             "from the last 20,000 positions); default uniform,recent")
    parser.add_argument("--profile", action="store_true",
                        help="launch each timed kernel once, no timing (run under ncu)")
    args = parser.parse_args()
    if args.parts and args.profile:
        parser.error("--parts needs timings; --profile takes none")
    global PROFILE, SWEEP
    PROFILE, SWEEP = args.profile, args.sweep
    torch.manual_seed(int(time.time()))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}", flush=True)
    parts = args.only.split(",")

    def write_parts() -> None:
        """--parts after each section: a run cut short keeps what it measured."""
        if args.parts:
            data = parts_file(ROWS, torch.cuda.get_device_name(),
                              time.strftime("%Y-%m-%d", time.gmtime()),
                              " ".join(["python", *sys.argv]),
                              torch.cuda.get_device_properties(0).total_memory)
            with open(args.parts, "w") as f:
                json.dump(data, f, indent=1)
            missing = [p for p in MEASURED_PARTS if p not in data["figures"]]
            print(f"\n--parts {args.parts}: {', '.join(data['figures']) or 'no figures'} "
                  f"(not measured: {', '.join(missing) or 'none'})", flush=True)

    ceil = ceilings() if "ceilings" in parts else {}
    write_parts()
    if "prefill" in parts:
        bench_prefill(args.quick, args.sweep, args.indices)
        write_parts()
    if "prefill_fp8" in parts:
        bench_prefill_fp8(args.indices, args.sweep)
    if "decode" in parts:
        bench_decode(args.quick, args.sweep)
        write_parts()
    if "moe_combine" in parts:
        bench_moe_combine()
    if "routing" in parts:
        bench_routing()
    prefill, decode = {"indexer", "indexer_prefill"} & set(parts), \
        {"indexer", "indexer_decode"} & set(parts)
    if prefill or decode:
        bench_indexer(args.quick, args.sweep, prefill=bool(prefill), decode=bool(decode),
                      heads_list=args.heads)
        write_parts()
    if "topk" in parts:
        bench_topk()
    if "writers" in parts:
        bench_writers()
    print("\n| kernel | time (us) | rate | note |\n|---|---:|---:|---|")
    for row in ROWS:
        frac = ""
        if row.unit == "TFLOP/s" and "matmul" not in row.name and ceil:
            peak = ceil["fp8_tflops"] if "indexer" in row.name else ceil["bf16_tflops"]
            frac = f"; {row.value / peak:.0%} of matmul"
        elif row.unit == "TB/s" and "copy" not in row.name and ceil:
            frac = f"; {row.value / ceil['copy_tbs']:.0%} of copy"
            if "indexer decode" in row.name:
                frac += f", {row.value / ceil['page_tbs']:.0%} of random page reads"
        print(f"| {row.name} | {row.ms * 1e3:.1f} | {row.value:.1f} {row.unit} | "
              f"{row.note}{frac} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceil, "rows": [asdict(r) for r in ROWS]}, f, indent=1)


if __name__ == "__main__":
    main()
