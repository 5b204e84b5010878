"""The Triton kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny fp32 shapes,
against the PyTorch reference. Skipped when triton is not installed (CI does not install it).

What the interpreter cannot show, the GPU suite (tests/gpu/test_kernels_gpu.py) does: bf16
rounding (the interpreter truncates fp32→bf16), tensor-core numerics, and real shapes. The fp8
quantizers round in fp32 themselves (mla_cache.to_e4m3), so their bytes are compared exactly on
any data; everything else exactly or to fp32 tolerance.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import random
import sys
from types import SimpleNamespace

import pytest
import torch
from triton_interp import patch_interpreter_index

# triton decides at import time whether its own helpers (tl.zeros, ...) are interpreted.
_FRESH = "triton" not in sys.modules
_saved_env = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    importlib.import_module("triton.experimental.gluon")  # imported lazily by the first launch
finally:
    if _saved_env is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = _saved_env
if not _FRESH and _saved_env != "1":
    pytest.skip("triton was imported before this module without TRITON_INTERPRET=1",
                allow_module_level=True)

from dsaserve.kernels import formats, reference  # noqa: E402
from dsaserve.kernels.metadata import AttentionMetadata, scattered_block_table  # noqa: E402
from dsaserve.kernels.registry import HotRows, ReferenceBackend, position_slots  # noqa: E402
from dsaserve.kv import layout  # noqa: E402

# Reload order: dependencies first.
_MODULES = ("mla_cache", "index_cache", "sparse_mla", "mla_workspace", "slots", "row_topk",
            "indexer", "backend", "norm", "rotary", "mla_work", "row_gather",
            "residency")


def _load(interpret: bool) -> SimpleNamespace:
    """(Re)import the kernel modules; triton.jit picks interpreted or compiled at import time."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        mods = {}
        for name in _MODULES:
            mod = importlib.import_module(f"dsaserve.kernels.triton.{name}")
            mods[name] = importlib.reload(mod)
        return SimpleNamespace(**mods)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture(scope="module")
def k():
    patch_interpreter_index()
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read again at launch time by the interpreter
    try:
        yield _load(interpret=True)
    finally:
        _load(interpret=False)  # leave compiled kernels behind for anything imported later
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved


L, R = 128, 16  # one fp8 tile; the smallest rope width a tensor-core dot accepts


def _gen(seed: int = 0) -> torch.Generator:
    """The same inputs every run (a failure replays as it happened); tests whose cases are
    random draws take several fixed seeds instead of fresh ones."""
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# MLA cache writer
# --------------------------------------------------------------------------------------------
def test_mla_writer_fp8_matches_formats(k):
    g = _gen()
    num_blocks, block_size, n = 3, 8, 14
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[[2, 9]] = -1
    k_pe = torch.randn(n, R, generator=g).bfloat16()  # bf16 in: no rounding on the way
    row_bytes = formats.mla_row_bytes(L, R)
    # Random latents (tiny ones too: e4m3 subnormals): every byte, payload included, as the
    # reference's round-to-nearest-even.
    c = torch.randn(n, L, generator=g) * torch.rand(n, 1, generator=g) * 100
    c[0, :64] *= 1e-4
    ours = torch.full((num_blocks, block_size, row_bytes), 0xAB, dtype=torch.uint8)
    ref = ours.clone()
    k.mla_cache.write_mla_cache(ours, slots, c, k_pe)
    formats.write_mla_cache(ref, slots, c, k_pe)
    assert torch.equal(ours, ref)
    # Latents already on the e4m3 grid of their scale: every payload byte must match too.
    scale = torch.exp2(torch.randint(-8, 8, (n, 1), generator=g).float())
    grid = torch.randint(0, 256, (n, L), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    grid = torch.where(grid.float().isnan(), 0.0, grid.float())
    grid[:, 0] = 448.0  # amax = 448·scale → the scale rule gives back `scale` exactly
    c = grid * scale
    ours.fill_(0xAB)
    ref.fill_(0xAB)
    k.mla_cache.write_mla_cache(ours, slots, c, k_pe)
    formats.write_mla_cache(ref, slots, c, k_pe)
    assert torch.equal(ours, ref)


def test_mla_writer_float_cache(k):
    g = _gen()
    slots = torch.tensor([5, -1, 0, 17])
    c, k_pe = torch.randn(4, L, generator=g), torch.randn(4, R, generator=g)
    ours = torch.full((3, 8, L + R), float("nan"))
    ref = ours.clone()
    k.mla_cache.write_mla_cache(ours, slots, c, k_pe)
    formats.write_mla_cache(ref, slots, c, k_pe)
    assert torch.equal(ours.nan_to_num(7.0), ref.nan_to_num(7.0))


# --------------------------------------------------------------------------------------------
# Sparse MLA
# --------------------------------------------------------------------------------------------
def _mla_case(fp8: bool, g: torch.Generator):
    num_blocks, block_size, num_tokens, num_heads, topk = 4, 16, 6, 5, 40
    num_slots = num_blocks * block_size
    c = torch.randn(num_slots, L, generator=g)
    k_pe = torch.randn(num_slots, R, generator=g)
    shape = formats.mla_cache_shape(num_blocks, block_size, fp8, L, R)
    cache = torch.zeros(shape, dtype=torch.uint8 if fp8 else torch.float32)
    formats.write_mla_cache(cache, torch.arange(num_slots), c, k_pe)
    q = torch.randn(num_tokens, num_heads, L + R, generator=g)
    idx = torch.stack([torch.randperm(num_slots, generator=g)[:topk] for _ in range(num_tokens)])
    idx[0, ::3] = -1  # scattered skips
    idx[1] = -1  # a row with no valid slot
    idx[2, 16:] = -1  # the second split of this row is empty
    return q, cache, idx.int()


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("splits", [1, 2, 3, None])  # 3: the merge pads to a power of two
def test_sparse_mla_matches_reference(k, fp8, splits):
    q, cache, idx = _mla_case(fp8, _gen())
    cfg = k.sparse_mla.SparseMlaConfig(block_n=16, num_splits=splits)
    o, lse = k.sparse_mla.sparse_mla_fwd(q, cache, idx, 0.125, L, cfg)
    ref_o, ref_lse = reference.sparse_mla_paged(q, cache, idx, 0.125, L, R)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and bool((lse[1] == float("-inf")).all())
    assert torch.allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Indexer
# --------------------------------------------------------------------------------------------
def test_index_writer_fp8_matches_formats(k):
    g = _gen()
    head_dim, block_size, n = 32, 8, 11
    slots = torch.randperm(4 * block_size, generator=g)[:n]
    slots[4] = -1
    scale = torch.exp2(torch.randint(-6, 6, (n, 1), generator=g).float())
    grid = torch.randint(0, 256, (n, head_dim), generator=g, dtype=torch.uint8)
    grid = grid.view(torch.float8_e4m3fn).float().nan_to_num(0.0)
    grid[:, 3] = -448.0
    for keys in (torch.randn(n, head_dim, generator=g) * 30, grid * scale):
        shape = formats.index_cache_shape(4, block_size, True, head_dim)
        ours = torch.full(shape, 0xCD, dtype=torch.uint8)
        ref = ours.clone()
        k.index_cache.write_index_cache(ours, slots, keys)
        formats.write_index_cache(ref, slots, keys)
        values, scales = formats._index_page_views(ours, head_dim)
        ref_values, ref_scales = formats._index_page_views(ref, head_dim)
        assert torch.equal(scales, ref_scales)
        assert torch.equal(values, ref_values)


def _index_meta(g: torch.Generator, dcp_size: int, dcp_rank: int, block_size: int):
    """Four requests over shuffled pages: a prefill chunk, a decode, MTP-like 2 tokens, and a
    first chunk from position 0 (under DCP its first token sees no key of rank 1: an empty
    row; every token of it sees fewer keys than the top-k)."""
    seq_lens, new = (67, 9, 41, 5), (6, 1, 2, 5)
    pages = [-(-layout.dcp_local_seq_len(s, dcp_size, dcp_rank, 1) // block_size)
             for s in seq_lens]
    table = scattered_block_table(pages, g)
    return AttentionMetadata.for_requests(seq_lens, new, table, block_size, dcp_size=dcp_size,
                                          dcp_rank=dcp_rank)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "float"])
@pytest.mark.parametrize("dcp", [(1, 0), (2, 1)], ids=["dcp1", "dcp2rank1"])
@pytest.mark.parametrize("windowed", [False, "keys", "rows"],
                         ids=["one_pass", "key_windows", "row_passes"])
def test_indexer_topk_matches_reference(k, fp8, dcp, windowed):
    """windowed: a logits budget of 32 keys per row; "keys": the keys are scored 32 at a time
    and each window's top-k merged into the running one; "rows": the rows in passes of whole
    tiles over every key (of at most 32·T / 67 rows: the step has T rows over 67 keys)."""
    g = _gen()
    heads, head_dim, block_size, topk = 16, 32, 16, 8
    meta = _index_meta(g, *dcp, block_size)
    cache = torch.zeros(formats.index_cache_shape(16, block_size, fp8, head_dim),
                        dtype=torch.uint8 if fp8 else torch.float32)
    for r, s in enumerate(meta.seq_lens):
        slots, _ = layout.context_slots(s, meta.block_table[r], block_size, *dcp)
        formats.write_index_cache(cache, slots, torch.randn(len(slots), head_dim, generator=g))
    q = torch.randn(meta.num_tokens, heads, head_dim, generator=g)
    w = torch.randn(meta.num_tokens, heads, generator=g)
    config = k.indexer.IndexerConfig(max_logits_bytes=4 * meta.num_tokens * 32 if windowed
                                     else 2**31, logits_split=windowed or "rows")
    if windowed == "rows":
        assert len(k.indexer._step_plan(meta, q, cache, config).row_passes) > 1
    scores, pos = k.indexer.indexer_topk(q, w, cache, meta, topk, config)
    ref_scores, ref_pos = ReferenceBackend().indexer_topk(q, w, cache, meta, topk)
    assert torch.equal(pos >= 0, ref_pos >= 0) and torch.equal(scores > -1e30, pos >= 0)
    # Same scores (in any order; exact ties may pick different keys, never different scores).
    order = scores.sort(dim=1, descending=True)
    scores, pos = order.values, pos.gather(1, order.indices)
    assert torch.allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    logits, limits = k.indexer.indexer_logits_paged(q, w, cache, meta)
    assert int(limits.min()) == (0 if dcp[0] == 2 else 1)  # an empty row under DCP
    assert bool((pos[limits == 0] == -1).all())
    for t in range(meta.num_tokens):
        r = int(meta.req_indices[t])
        _, key_pos = layout.context_slots(meta.seq_lens[r], meta.block_table[r], block_size, *dcp)
        local = {int(p): j for j, p in enumerate(key_pos)}
        chosen = [local[int(p)] for p in pos[t] if p >= 0]  # each a visible key of this rank
        assert len(set(chosen)) == len(chosen) and all(j < int(limits[t]) for j in chosen)
        assert torch.equal(logits[t, chosen], scores[t, : len(chosen)])
        assert bool((logits[t, int(limits[t]):] == float("-inf")).all())


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "float"])
def test_indexer_bounded_metadata_follows_positions_across_steps(k, fp8):
    """A captured decode step's view (engine/decode_graph.py): seq_lens at the bound, a block
    table as wide as the bound (−1 past each request's pages), and ONE metadata object whose
    positions are rewritten in place from step to step. Its top-k equals the reference's on
    each step's exact metadata: the plan derived once holds nothing that depends on positions,
    and pages past a row's position are never read."""
    g = _gen()
    heads, head_dim, block_size, topk, bound = 16, 32, 16, 8, 64
    steps = [(40, 9, 23), (41, 30, 2)]  # seq_lens of two consecutive steps, 2 rows each
    pages = [-(-max(s) // block_size) for s in zip(*steps, strict=True)]
    exact_table = scattered_block_table(pages, g)
    table = torch.full((3, bound // block_size), -1, dtype=torch.int32)
    table[:, : exact_table.shape[1]] = exact_table
    cache = torch.zeros(formats.index_cache_shape(sum(pages), block_size, fp8, head_dim),
                        dtype=torch.uint8 if fp8 else torch.float32)
    for r, s in enumerate(pages):
        slots, _ = layout.context_slots(s * block_size, exact_table[r], block_size)
        formats.write_index_cache(cache, slots, torch.randn(len(slots), head_dim, generator=g))
    positions = torch.zeros(6, dtype=torch.int64)
    bounded = AttentionMetadata(
        positions=positions, req_indices=torch.arange(6) // 2, slot_mapping=torch.full((6,), -1),
        block_table=table, query_start_loc=(0, 2, 4, 6), seq_lens=(bound,) * 3,
        block_size=block_size, use_dense=False, bounded_seq_lens=True)
    for seq_lens in steps:
        exact = AttentionMetadata.for_requests(seq_lens, (2, 2, 2), exact_table, block_size)
        positions.copy_(exact.positions)
        q = torch.randn(6, heads, head_dim, generator=g)
        w = torch.randn(6, heads, generator=g)
        scores, pos = k.indexer.indexer_topk(q, w, cache, bounded, topk)
        ref_scores, ref_pos = ReferenceBackend().indexer_topk(q, w, cache, exact, topk)
        assert torch.equal(pos >= 0, ref_pos >= 0)
        order = scores.sort(dim=1, descending=True)
        assert torch.allclose(order.values, ref_scores, rtol=1e-5, atol=1e-5)
        # the reference reads the same keys through the bounded metadata
        again_scores, _ = ReferenceBackend().indexer_topk(q, w, cache, bounded, topk)
        assert torch.equal(again_scores, ref_scores)
    assert len(bounded.derived) == 1  # one plan, built at the first step


def test_indexer_limits_are_kept_for_one_step_and_its_positions(k):
    """The visible-key limits [T] are the same for every indexer layer of a step: the first
    layer's are kept on the step's metadata (one entry) and the second reads them; moved
    positions (a new tensor, on new metadata) and the next step's metadata compute their own,
    each equal to what its positions give: min(position + 1, its request's keys)."""
    g = _gen()
    heads, head_dim, block_size, topk = 16, 32, 16, 8

    def run(meta):
        cache = torch.zeros(formats.index_cache_shape(16, block_size, True, head_dim),
                            dtype=torch.uint8)
        q = torch.randn(meta.num_tokens, heads, head_dim, generator=g)
        w = torch.randn(meta.num_tokens, heads, generator=g)
        k.indexer.indexer_topk(q, w, cache, meta, topk)
        kept = [v for key, v in meta.derived.items() if key[0] == "indexer_limits"]
        assert len(kept) == 1 and kept[0][0] is meta.positions
        limits, limits_i32 = kept[0][1]
        seq = torch.tensor(meta.seq_lens)[meta.req_indices]
        assert torch.equal(limits, torch.minimum(meta.positions + 1, seq))
        assert torch.equal(limits_i32, limits.to(torch.int32))
        return kept[0][1]

    meta = _index_meta(g, 1, 0, block_size)
    first = run(meta)
    assert run(meta) is first  # the step's second layer: the same tensors
    moved = dataclasses.replace(meta, positions=(meta.positions - 1).clamp(min=0))
    assert run(moved) is not first
    # (the same metadata object with another positions tensor: not the kept one's)
    object.__setattr__(meta, "positions", meta.positions.clone())
    assert run(meta) is not first
    other = AttentionMetadata.for_requests((30, 4), (3, 4), scattered_block_table([2, 1], g),
                                           block_size)
    assert not torch.equal(run(other)[0], first[0][:7])


def test_window_merge_keeps_the_best_and_breaks_ties_by_index(k):
    """Key windows are merged by (score, then smaller key index), as row_topk breaks ties, so
    a windowed top-k picks the same keys every run; −0.0 and +0.0 keep their float order."""
    values = torch.tensor([[1.0, -2.0, float("-inf"), 1.0, 3.0, -0.0, 0.0, float("-inf")]])
    index = torch.tensor([[5, 2, -1, 1, 9, 7, 3, -1]])
    best, best_index = k.indexer._merge_best(values, index, 5)
    assert best.tolist() == [[3.0, 1.0, 1.0, 0.0, -0.0]]
    assert best_index.tolist() == [[9, 1, 5, 3, 7]]
    best, best_index = k.indexer._merge_best(values, index, 8)
    assert best_index[0, -2:].tolist() == [-1, -1] and best[0, -1] == float("-inf")


@pytest.mark.parametrize("rows_per_tile", [16, 64], ids=["token_tiles", "4_token_tiles"])
def test_indexer_logits_match_reference_fp8(k, rows_per_tile):
    g = _gen()
    heads, head_dim, block_size = 16, 32, 16
    meta = _index_meta(g, 1, 0, block_size)
    cache = torch.zeros(formats.index_cache_shape(16, block_size, True, head_dim),
                        dtype=torch.uint8)
    for r, s in enumerate(meta.seq_lens):
        slots, _ = layout.context_slots(s, meta.block_table[r], block_size)
        formats.write_index_cache(cache, slots, torch.randn(s, head_dim, generator=g))
    q = torch.randn(meta.num_tokens, heads, head_dim, generator=g)
    w = torch.randn(meta.num_tokens, heads, generator=g)
    config = k.indexer.IndexerConfig(rows_per_tile=rows_per_tile)
    logits, limits = k.indexer.indexer_logits_paged(q, w, cache, meta, config)
    q8, q_scale = formats.quantize_index_q(q)
    for r in range(meta.num_reqs):
        a, b = meta.query_range(r)
        slots, _ = layout.context_slots(meta.seq_lens[r], meta.block_table[r], block_size)
        k8, k_scale = formats.read_index_cache(cache, slots, head_dim)
        ref = reference.indexer_logits_fp8(q8[a:b], q_scale[a:b], w[a:b], k8, k_scale)
        for t in range(a, b):
            n = int(limits[t])
            assert n == int(meta.positions[t]) + 1
            assert torch.allclose(logits[t, :n], ref[t - a, :n], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Exact top-k of long rows (row_topk)
# --------------------------------------------------------------------------------------------
def _group_max(logits: torch.Tensor, group: int) -> torch.Tensor:
    t, s = logits.shape
    pad = torch.full((t, -s % group), float("-inf"))
    return torch.cat([logits, pad], 1).view(t, -1, group).amax(2)


def _check_topk_rows(k, logits: torch.Tensor, limits: torch.Tensor, topk: int, **kw) -> None:
    past = torch.arange(logits.shape[1])[None, :] >= limits[:, None]
    logits = logits.masked_fill(past, float("-inf"))  # the logits kernel's contract
    rows = k.row_topk.topk_rows(logits, _group_max(logits, k.row_topk.GROUP), limits, topk, **kw)
    values, idx = rows
    assert idx.dtype == kw.get("index_dtype", torch.int64)
    ref = torch.topk(logits, topk, dim=1).values
    # The same scores (in any order), (−inf, −1) past the limit.
    assert torch.equal(values.sort(dim=1, descending=True).values, ref)
    for t in range(logits.shape[0]):
        n = min(int(limits[t]), topk)
        assert bool((idx[t, n:] == -1).all()) and bool((idx[t, :n] < limits[t]).all())
        assert len(idx[t, :n].unique()) == n
        assert torch.equal(logits[t, idx[t, :n]], values[t, :n])


@pytest.mark.parametrize("method", ["sort32", "sort64", None])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("topk", [8, 48, 2048])
def test_in_key_order_equals_the_sort(k, topk, index_dtype, method):
    """The top-k's keys in ascending key order, padding (−1) last, each score with its key:
    each one-launch kernel (and the default's choice) gives the PyTorch sort's result (scores
    bit for bit, −inf and negative scores included), on rows of a wider buffer."""
    g = _gen(topk)
    rows = 5
    local = torch.stack([torch.randperm(4 * topk, generator=g)[:topk] for _ in range(rows)])
    local[1, topk // 2:] = -1  # a short row: padding in the list's order
    local[3] = -1  # nothing visible
    values = torch.randn(rows, topk, generator=g) * 100
    values[local < 0] = float("-inf")
    wide_v = torch.cat((values, values), dim=1)[:, :topk]
    wide_l = torch.cat((local, local), dim=1)[:, :topk].to(index_dtype)
    got = k.row_topk.in_key_order(wide_v, wide_l, 4 * topk, method)
    want = k.row_topk.in_key_order_reference(values, local.to(index_dtype))
    assert got[1].dtype == index_dtype
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_in_key_order_at_its_bounds(k):
    """The 32-bit sort takes key indices up to pack32_max_keys − 1 (the largest shifted one
    just below the padding's) and refuses longer rows; the largest key indices of a 1M-key
    row through the 64-bit sort (the default's choice there)."""
    assert k.row_topk.pack32_max_keys(2048) == (1 << 20) - 1
    assert k.row_topk.pack32_max_keys(2049) == (1 << 19) - 1
    top = 8
    most = k.row_topk.pack32_max_keys(top)
    local = torch.tensor([[most - 1, 0, -1, most - 2, 5, -1, 3, 1]])
    values = torch.tensor([[1.0, -2.0, float("-inf"), 0.5, -0.0, float("-inf"), 7.0, 2.0]])
    want = k.row_topk.in_key_order_reference(values, local)
    for method in ("sort32", "sort64", None):
        got = k.row_topk.in_key_order(values, local, most, method)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), method
    with pytest.raises(ValueError, match="sort32 takes rows of at most"):
        k.row_topk.in_key_order(values, local, most + 1, "sort32")
    big = torch.tensor([[(1 << 20) + 3, (1 << 20) - 1, -1, (1 << 20) + 1, 2, -1, 9, 1 << 20]])
    want = k.row_topk.in_key_order_reference(values, big)
    for method in ("sort64", None):
        got = k.row_topk.in_key_order(values, big, (1 << 20) + 4, method)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), method


@pytest.mark.parametrize("topk", [8, 64])
@pytest.mark.parametrize("per_key", [False, True], ids=["prefix_sum", "slot_per_key"])
@pytest.mark.parametrize("overflow", [False, True], ids=["list", "list_of_k"])
def test_topk_rows_random_rows(k, topk, per_key, overflow):
    """Rows from empty to far longer than the search array: short rows are searched directly,
    long ones through their group maxima (coarsened when there are too many); both ways of
    claiming list slots. A list of exactly k slots overflows on almost every row, which sends
    them through the radix select over the whole row."""
    g = _gen()
    na = max(triton.next_power_of_2(k.row_topk.GROUP * topk), 1024)
    lens = [0, 3, topk, topk + 1, 500, na, na + 1, 3 * na + 5, 20 * na]
    logits = torch.full((len(lens), max(lens)), float("-inf"))
    for t, n in enumerate(lens):
        logits[t, :n] = torch.randn(n, generator=g) * 10 ** float(torch.randn(1, generator=g))
    logits[4, 100:500] *= -1  # negatives and positives mixed in order
    _check_topk_rows(k, logits, torch.tensor(lens), topk, slot_per_key=per_key,
                     list_len=topk if overflow else None)


def test_topk_rows_overflow_and_ties(k):
    """More than C keys clear the group threshold: ascending rows (the top keys fill whole
    groups), all-equal rows (ties), and a row where ties straddle the k-th score."""
    topk, n = 8, 5000
    rising = torch.arange(n, dtype=torch.float32)
    ties = torch.full((n,), 0.5)
    straddle = torch.zeros(n)
    straddle[torch.arange(0, n, 7)] = 1.0  # 715 keys tie at 1.0 ...
    straddle[[11, 4000, 4999]] = 2.0  # ... below three keys: the k-th score is a tie
    logits = torch.stack([rising, -rising, ties, straddle])
    _check_topk_rows(k, logits, torch.full((4,), n), topk, list_len=16)
    _check_topk_rows(k, logits, torch.tensor([n, 1500, 33, n - 1]), topk, list_len=16)
    # int32 limits in, int32 indices out (what the indexer's decode path asks for).
    _check_topk_rows(k, logits, torch.tensor([n, 1500, 33, n - 1], dtype=torch.int32), topk,
                     list_len=16, index_dtype=torch.int32)
    # A list long enough for the 718 keys ≥ τ of the last row: the finish kernel breaks the
    # ties itself (smallest key index first).
    values, idx = k.row_topk.topk_rows(logits[3:], _group_max(logits[3:], k.row_topk.GROUP),
                                       torch.tensor([n]), topk, list_len=1024)
    assert sorted(idx[0].tolist()) == [0, 7, 11, 14, 21, 28, 4000, 4999]


def test_cuda_logits_are_chosen_on_gpus_only(k):
    """CPU tensors (the interpreter) never take the CUDA logits kernel, whatever the config asks;
    the step's plan then cuts tiles of rows_per_tile (256 rows: 4 tokens of 64 heads)."""
    g = _gen()
    meta = _index_meta(g, 1, 0, 64)
    q = torch.randn(meta.num_tokens, 64, 128, generator=g).bfloat16()
    cache = torch.zeros(formats.index_cache_shape(16, 64, True, 128), dtype=torch.uint8)
    for cuda_logits in (None, True):
        config = k.indexer.IndexerConfig(cuda_logits=cuda_logits)
        assert k.indexer._cuda_shape(q, cache, config, meta) is None
        plan = k.indexer._step_plan(meta, q, cache, config)
        assert (plan.block_t * 64, plan.cuda_shape) == (256, None)


def test_indexer_topk_kernel_choice(k):
    """topk_kernel is checked when the config is made; 'cuda' where it cannot run says why
    instead of falling back silently; None falls back to row_topk."""
    with pytest.raises(ValueError, match="topk_kernel"):
        k.indexer.IndexerConfig(topk_kernel="radix")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="topk_kernel='cuda' is unavailable"):
            k.indexer._use_cuda_topk(k.indexer.IndexerConfig(topk_kernel="cuda"), 8)
        assert not k.indexer._use_cuda_topk(k.indexer.IndexerConfig(), 8)
    assert not k.indexer._use_cuda_topk(k.indexer.IndexerConfig(topk_kernel="triton"), 8)
    # CPU logits (the interpreter) never take the CUDA kernel, even on a GPU machine.
    assert not k.indexer._use_cuda_topk(k.indexer.IndexerConfig(), 8, on_cuda=False)
    with pytest.raises(RuntimeError, match="not on a GPU"):
        k.indexer._use_cuda_topk(k.indexer.IndexerConfig(topk_kernel="cuda"), 8, on_cuda=False)


def test_backend_prepare_builds_the_cuda_topk_on_gpus_only(k, monkeypatch):
    """The engine's start-up call: on a GPU the CUDA kernels (top-k, indexer logits) are built
    then (not in the first request); on the CPU nothing is built or asked."""
    calls = []
    monkeypatch.setattr(k.backend.cuda_build, "build",
                        lambda: calls.append("build") or "no CUDA device")
    backend = k.backend.TritonBackend()
    backend.prepare(torch.device("cpu"))
    assert calls == []
    backend.prepare(torch.device("cuda"))
    assert calls == ["build"]
    ReferenceBackend().prepare(torch.device("cpu"))


def test_e4m3_rounding_is_exact(k):
    """to_e4m3 (through the MLA writer, scale 1) against torch's round-to-nearest-even cast:
    every e4m3 value, every midpoint between neighbours (ties to even), subnormals, ±0."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].sort().values
    g = _gen()
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.randn(2000, generator=g) * 100,
                   torch.rand(1000, generator=g) * 0.03, torch.tensor([-0.0])])
    per_row = L - 1
    x = torch.nn.functional.pad(x, (0, -len(x) % per_row)).view(-1, per_row)
    c = torch.cat([torch.full((len(x), 1), 448.0), x], 1)  # amax 448: the row's scale is 1
    slots = torch.arange(len(c))
    shape = formats.mla_cache_shape(len(c), 1, True, L, R)
    ours, ref = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    k_pe = torch.zeros(len(c), R)
    k.mla_cache.write_mla_cache(ours, slots, c, k_pe)
    formats.write_mla_cache(ref, slots, c, k_pe)
    assert torch.equal(ours, ref)


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,cols", [((5, 48), 48), ((5, 64), 40), ((2, 3, 100), 100),
                                        ((0, 32), 32)])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_model(k, shape, cols, weight_dtype):
    """norm.rms_norm against the model's RMSNorm on the CPU (its PyTorch path), fp32 rows:
    rows strided (the first `cols` columns of wider rows), three dimensions, a width that is
    not a power of two, no row; the weight in fp32 (the result in fp32) or bf16."""
    from dsaserve.model.dsa import RMSNorm

    g = _gen()
    x = torch.randn(shape, generator=g)[..., :cols]
    module = RMSNorm(cols, 1e-6)
    module.weight.data = (torch.rand(cols, generator=g) + 0.5).to(weight_dtype)
    want = module(x)
    got = k.norm.rms_norm(x, module.weight, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,cols", [(5, 48), (3, 100), (0, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_the_model(k, rows, cols, dtype):
    """norm.add_rms_norm against RMSNorm.add's PyTorch path (the add, then the norm): the sum
    bit for bit (PyTorch's add rounds it to the rows' dtype as the kernel does), the norm to
    fp32's rounding; h is left as it was; a d of another dtype is refused."""
    from dsaserve.model.dsa import RMSNorm

    g = _gen()
    h = torch.randn(rows, cols, generator=g).to(dtype)
    d = torch.randn(rows, cols, generator=g).to(dtype)
    module = RMSNorm(cols, 1e-6)
    module.weight.data = (torch.rand(cols, generator=g) + 0.5).to(dtype)
    want, want_sum = module.add(h, d)
    kept = h.clone()
    got, got_sum = k.norm.add_rms_norm(h, d, module.weight, 1e-6)
    assert torch.equal(got_sum, want_sum) and torch.equal(h, kept)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    with pytest.raises(ValueError, match="one dtype"):
        k.norm.add_rms_norm(h, d.double(), module.weight, 1e-6)


# --------------------------------------------------------------------------------------------
# Rotary embedding
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape,rope", [((6, 4, 16), 16), ((6, 16), 16), ((5, 3, 40), 8),
                                        ((7, 24), 8), ((0, 2, 8), 8)])
def test_rotary_matches_apply_rope(k, interleaved, shape, rope):
    """rotary.rotate against model/rope.py's PyTorch path: whole rows rotated (MLA's q_pe and
    k_pe, here strided: a slice of wider rows) and only the first columns of wider rows (the
    indexer's, the rest copied), both pairings, 2-D and 3-D rows, no token."""
    from dsaserve.model.rope import apply_rope

    g = _gen()
    x = torch.randn(*shape[:-1], shape[-1] + 8, generator=g)[..., 8:]  # strided rows
    angles = torch.rand(shape[0], rope // 2, generator=g) * 6.0
    cos, sin = angles.cos() * 1.2, angles.sin() * 1.2
    want = torch.cat((apply_rope(x[..., :rope], cos, sin, interleaved), x[..., rope:]), dim=-1)
    got = k.rotary.rotate(x, cos, sin, interleaved)
    assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # into `out`: the last columns of wider rows (MLA's absorbed query), the rest untouched
    wide = torch.full((*shape[:-1], shape[-1] + 5), 7.0)
    back = k.rotary.rotate(x, cos, sin, interleaved, out=wide[..., 5:])
    assert back.data_ptr() == wide[..., 5:].data_ptr()
    torch.testing.assert_close(wide[..., 5:], want, rtol=1e-6, atol=1e-6)
    assert (wide[..., :5] == 7.0).all()
    with pytest.raises(ValueError, match="rotary: out"):
        k.rotary.rotate(x, cos, sin, interleaved, out=wide[..., 4:])


# --------------------------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------------------------
def test_backend_runs_kernels_under_interpreter(k, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = _gen()
    q, cache, idx = _mla_case(True, g)
    backend = k.backend.TritonBackend()
    o, lse = backend.sparse_mla(q, cache, idx, 0.1, L)
    ref_o, ref_lse = ReferenceBackend().sparse_mla(q, cache, idx, 0.1, L)
    assert o.dtype == q.dtype and torch.allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    c = torch.randn(3, L, generator=g).bfloat16()
    k_pe = torch.randn(3, R, generator=g).bfloat16()
    slots = torch.tensor([1, -1, 40])
    ours, ref = cache.clone(), cache.clone()
    backend.write_kv(ours, slots, c, k_pe)
    formats.write_mla_cache(ref, slots, c, k_pe)
    assert torch.equal(ours[..., L:], ref[..., L:])


@pytest.mark.parametrize("block_size", [16, 1, 24])  # 1: PCP's full copies; 24: not 2^n
def test_dequantize_pages_matches_formats(k, block_size):
    g = _gen()
    num_blocks = 5
    slots = torch.arange(num_blocks * block_size)
    c = torch.randn(len(slots), L, generator=g) * torch.rand(len(slots), 1, generator=g) * 50
    k_pe = torch.randn(len(slots), R, generator=g).bfloat16()
    cache = torch.zeros(formats.mla_cache_shape(num_blocks, block_size, True, L, R),
                        dtype=torch.uint8)
    formats.write_mla_cache(cache, slots, c, k_pe)
    pages = torch.tensor([3, 0, 4])
    ws = k.mla_workspace.dequantize_pages(cache, pages, L)
    want = formats.read_mla_cache(cache, (pages[:, None] * block_size
                                          + torch.arange(block_size)).reshape(-1), L, R)
    # e4m3 times a power-of-two scale, and the bf16 RoPE part: exact in bf16.
    assert ws.dtype == torch.bfloat16 and torch.equal(ws.float(), want)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        k.mla_workspace.dequantize_pages(cache, pages, 2 * L)


def _random_fp8_cache(table: torch.Tensor, block_size: int, g: torch.Generator
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8_ds_mla cache with a random row in every slot of table's pages → (cache, slots)."""
    num_blocks = int(table.max()) + 1
    cache = torch.zeros(formats.mla_cache_shape(num_blocks, block_size, True, L, R),
                        dtype=torch.uint8)
    slots = torch.arange(num_blocks * block_size)
    formats.write_mla_cache(cache, slots, torch.randn(len(slots), L, generator=g),
                            torch.randn(len(slots), R, generator=g))
    return cache, slots


@pytest.mark.parametrize("min_reads", [1.0, float("inf")], ids=["workspace", "cache_only"])
@pytest.mark.parametrize("block_size,dcp", [
    (16, (1, 0, 1)), (1, (1, 0, 1)),  # 1: PCP's full copy of a context
    (16, (2, 1, 1)), (1, (2, 1, 1)), (16, (3, 0, 2)),  # (DCP size, rank, interleave)
], ids=["b16", "b1", "b16_dcp2r1", "b1_dcp2r1", "b16_dcp3i2"])
def test_backend_positions_match_reference(k, monkeypatch, min_reads, block_size, dcp):
    """A step of a decode row, a long chunk, a request without rows and another decode row:
    with min_reads 1 the chunk reads a bf16 workspace of its pages (under DCP: of this rank's
    local sequence), the decode rows the cache (three segments); either way the same result as
    the reference over this rank's slots."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = _gen()
    topk, heads = 24, 3
    seq_lens, new = [40, 70, 20, 33], [1, 6, 0, 1]
    local = [layout.dcp_local_seq_len(s, *dcp) for s in seq_lens]
    table = scattered_block_table([-(-n // block_size) for n in local], generator=g)
    meta = AttentionMetadata.for_requests(seq_lens, new, table, block_size, dcp_size=dcp[0],
                                          dcp_rank=dcp[1], interleave=dcp[2])
    cache, slots = _random_fp8_cache(table, block_size, g)
    limits = meta.positions + 1  # causal: position p sees 0 … p
    positions = torch.stack([torch.randperm(int(n), generator=g)[:topk] for n in limits])
    positions = torch.cat((positions, torch.full((len(limits), topk - positions.shape[1]), -1)),
                          dim=1) if positions.shape[1] < topk else positions
    positions[1, ::4] = -1
    q = torch.randn(meta.num_tokens, heads, L + R, generator=g)
    cfg = k.sparse_mla.SparseMlaConfig(block_n=16, workspace_min_reads=min_reads)
    segments = k.mla_workspace.plan_segments(meta.query_start_loc, meta.seq_lens, local,
                                             block_size, topk, min_reads,
                                             cfg.workspace_max_rows)
    assert [s.workspace for s in segments] == ([False, True, False] if min_reads == 1.0
                                               else [False])
    backend = k.backend.TritonBackend(cfg)
    o, lse = backend.sparse_mla_positions(q, cache, positions, meta, 0.1, L)
    ref_o, ref_lse = ReferenceBackend().sparse_mla_positions(q, cache, positions, meta, 0.1, L)
    assert torch.allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # The step's next layers, over their own caches: a shared (IndexShare) layer attends over
    # the same top-k tensor (its slots kept from the layer before), a full layer over a new
    # one (slots made again); the workspace plan is the step's.
    other = torch.where(positions >= 0, positions.flip(1), -1)
    other = torch.where(other >= 0, torch.minimum(other, (limits - 1)[:, None]), -1)
    for top in (positions, other):
        layer_cache = torch.zeros_like(cache)
        formats.write_mla_cache(layer_cache, slots, torch.randn(len(slots), L, generator=g),
                                torch.randn(len(slots), R, generator=g))
        o, lse = backend.sparse_mla_positions(q, layer_cache, top, meta, 0.1, L)
        ref_o, ref_lse = ReferenceBackend().sparse_mla_positions(q, layer_cache, top, meta, 0.1,
                                                                 L)
        assert torch.allclose(o, ref_o, rtol=1e-5, atol=1e-5)
        assert torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_hot_rows_round_as_in_the_cache(k, monkeypatch):
    """HiSparse's hot rows (decode rows reading another paged cache) give bit for bit what the
    same rows give reading the layer's cache, in a mixed fp8 step: a decode row, a chunk read
    through the workspace, a decode row (three calls). Each hot row is read in its segment's
    own call shape: a decode row alone splits its 8 blocks in two on the interpreter's 4 "SMs",
    a call over all 8 rows does not split, and a split rounds otherwise."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = _gen(3)
    topk, heads, block_size = 128, 3, 16
    seq_lens, new = [200, 300, 150, 180], [1, 6, 0, 1]
    table = scattered_block_table([-(-n // block_size) for n in seq_lens], generator=g)
    meta = AttentionMetadata.for_requests(seq_lens, new, table, block_size)
    cache, slots = _random_fp8_cache(table, block_size, g)
    positions = torch.stack([torch.randperm(int(n) + 1, generator=g)[:topk]
                             for n in meta.positions])
    q = torch.randn(meta.num_tokens, heads, L + R, generator=g)
    cfg = k.sparse_mla.SparseMlaConfig(block_n=16, workspace_min_reads=1.0)
    segments = k.mla_workspace.plan_segments(meta.query_start_loc, meta.seq_lens, seq_lens,
                                             block_size, topk, 1.0, cfg.workspace_max_rows)
    assert [s.workspace for s in segments] == [False, True, False]
    backend = k.backend.TritonBackend(cfg)
    want_o, want_lse = backend.sparse_mla_positions(q, cache, positions, meta, 0.1, L)
    # the decode rows' selected rows, shuffled into a hot cache of their own
    rows = torch.zeros(meta.num_tokens, dtype=torch.bool)
    rows[[0, meta.num_tokens - 1]] = True
    found = position_slots(positions, meta)[rows]  # [2, K]
    hot_flat = torch.randperm(found.numel(), generator=g).view_as(found)
    hot_kv = torch.zeros(formats.mla_cache_shape(found.numel() // block_size, block_size,
                                                 True, L, R), dtype=torch.uint8)
    hot_kv.flatten(0, 1)[hot_flat.flatten()] = cache.flatten(0, 1)[found.flatten()]
    hot_slots = torch.full_like(positions, -1)
    hot_slots[rows] = hot_flat.to(hot_slots.dtype)
    cache.flatten(0, 1)[found.flatten()] = 0  # the hot rows must not read the layer's cache
    o, lse = backend.sparse_mla_positions(q, cache, positions, meta, 0.1, L,
                                          HotRows(hot_kv, hot_slots, rows))
    assert torch.equal(o[rows], want_o[rows]) and torch.equal(lse[rows], want_lse[rows])
    ref_o, ref_lse = ReferenceBackend().sparse_mla_positions(q, cache, positions, meta, 0.1, L,
                                                             HotRows(hot_kv, hot_slots, rows))
    assert torch.allclose(ref_o, want_o, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ref_lse, want_lse, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Host-side layout helpers
# --------------------------------------------------------------------------------------------
def test_plan_segments(k):
    plan, Seg = k.mla_workspace.plan_segments, k.mla_workspace.Segment
    # The docstring's step: two decode rows, then a 4096-token chunk over 128K.
    lens = (900, 5000, 131072)
    assert plan((0, 1, 2, 4098), lens, lens, 64, 2048, 8, 1 << 19) == [
        Seg((0, 2), (0, 1), False), Seg((2, 4098), (2,), True)]
    # Rows × min(topk, context) against min_reads × context; requests without rows skipped.
    qsl, lens = (0, 8, 8, 9, 17), (64, 30, 100, 64)
    assert plan(qsl, lens, lens, 16, 16, 2, 1000) == [
        Seg((0, 8), (0,), True), Seg((8, 9), (2,), False), Seg((9, 17), (3,), True)]
    assert plan(qsl, lens, lens, 16, 16, 2.01, 1000) == [Seg((0, 17), (0, 2, 3), False)]
    # The workspace cap counts whole pages of the local rows, first come first served.
    assert plan(qsl, lens, lens, 16, 16, 2, 100) == [
        Seg((0, 8), (0,), True), Seg((8, 17), (2, 3), False)]
    assert plan(qsl, lens, (32, 15, 50, 32), 16, 16, 2, 64) == [
        Seg((0, 8), (0,), True), Seg((8, 9), (2,), False), Seg((9, 17), (3,), True)]
    assert plan((0, 0), (5,), (5,), 16, 16, 1, 100) == []


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dcp", [(1, 0, 1), (2, 1, 1), (4, 2, 2)], ids=["dcp1", "dcp2r1", "dcp4i2"])
def test_position_slots_match_layout(k, dcp, seed):
    g = _gen(seed)
    block_size, topk, num_rows = 8, 40, 7
    pages = [6, 3, 9]
    table = scattered_block_table(pages, generator=g)
    table[2, 7] = -1  # an unallocated block: its positions have no slot
    req = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    span = torch.tensor(pages)[req] * block_size * dcp[0]  # positions the rows' tables cover
    pos = (torch.rand(num_rows, topk, generator=g) * span[:, None]).long()
    pos[torch.rand(num_rows, topk, generator=g) < 0.2] = -1
    got = k.slots.position_slots(pos.int(), req, table, block_size, *dcp)
    want = layout.logical_to_slots(pos, req, table, block_size, *dcp)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert bool((got[3:6][pos[3:6] // (block_size * dcp[0]) == 7] == -1).all())


def test_workspace_config_is_checked(k):
    with pytest.raises(ValueError, match="workspace_min_reads"):
        k.sparse_mla.SparseMlaConfig(workspace_min_reads=0)
    with pytest.raises(ValueError, match="workspace_max_rows"):
        k.sparse_mla.SparseMlaConfig(workspace_max_rows=-1)


def test_workspace_indices(k):
    """Workspace pages renumber a segment's requests' pages consecutively; the slot rule over
    that table gives workspace rows (request 1 at row 0, request 2 after its 2 pages of 64)."""
    seg = k.mla_workspace.Segment((2, 5), (1, 2), True)
    block_table = torch.tensor([[9, -1, -1], [4, 7, -1], [2, 0, 5]], dtype=torch.int32)
    pages, table = k.mla_workspace.workspace_pages(block_table, seg, (10, 128, 100), 64)
    assert pages.tolist() == [4, 7, 2, 0] and table.tolist() == [[-1, -1], [0, 1], [2, 3]]
    pos = torch.tensor([[3, -1, 0], [7, 2, -1], [0, 1, 2]], dtype=torch.int32)
    req = torch.tensor([1, 1, 2])
    got = k.slots.position_slots(pos, req, table, 64)
    assert got.dtype == torch.int32
    assert got.tolist() == [[3, -1, 0], [7, 2, -1], [128, 129, 130]]
    # DCP 2, interleave 1, rank 1: odd positions are this rank's, at local index p // 2.
    got = k.slots.position_slots(pos, req, table, 64, 2, 1, 1)
    assert got.tolist() == [[1, -1, -1], [3, -1, -1], [-1, 128, -1]]


def test_tiles_and_splits(k):
    assert k.indexer._tiles((0, 3, 4, 6), 2).tolist() == [[0, 0, 1, 2], [0, 2, 3, 4],
                                                          [2, 1, 1, 2]]
    assert k.indexer._tiles((0, 0, 5), 4).tolist() == [[1, 1], [0, 4], [4, 1]]
    assert k.indexer._tiles((0,), 4).shape == (3, 0)
    # against the definition, token by token: every request's tokens cut from its first, in
    # order, into tiles of block_t but the last
    rng = random.Random(0)
    for _ in range(200):
        qsl = [0]
        for _ in range(rng.randint(0, 6)):
            qsl.append(qsl[-1] + rng.choice([0, 1, 2, 3, 5, 8, 17, 64]))
        block_t = rng.choice([1, 2, 4, 8, 16])
        want = [(r, t, min(block_t, qsl[r + 1] - t)) for r in range(len(qsl) - 1)
                for t in range(qsl[r], qsl[r + 1], block_t)]
        assert [tuple(t) for t in k.indexer._tiles(tuple(qsl), block_t).T.tolist()] == want
    # Row passes: whole tiles, in order, at most max_rows rows unless one tile is longer.
    passes = k.indexer._row_passes
    assert passes([0, 4, 8, 9], [4, 4, 1, 3], 8) == [(0, 8, 0, 2), (8, 12, 2, 4)]
    assert passes([0, 4, 8, 9], [4, 4, 1, 3], 3) == [(0, 4, 0, 1), (4, 8, 1, 2), (8, 9, 2, 3),
                                                      (9, 12, 3, 4)]
    assert passes([0, 4], [4, 4], 100) == [(0, 8, 0, 2)] and passes([], [], 8) == []
    for _ in range(200):  # against the greedy definition, tile by tile
        lens = [rng.randint(1, 9) for _ in range(rng.randint(0, 30))]
        toks = [sum(lens[:i]) for i in range(len(lens))]
        max_rows = rng.randint(1, 40)
        want, first = [], 0
        for i in range(1, len(toks) + 1):
            if i == len(toks) or toks[i] + lens[i] - toks[first] > max_rows:
                want.append((toks[first], toks[i - 1] + lens[i - 1], first, i))
                first = i
        assert passes(toks, lens, max_rows) == want
    choose = k.sparse_mla.choose_num_splits
    assert choose(4096, 64, 132) == 1 and choose(128, 64, 132) == 1  # a wave already
    assert choose(32, 64, 132) == 4 and choose(28, 64, 132) == 4
    assert choose(1, 64, 132) == 16  # capped so that every split keeps >= 4 blocks
    assert choose(1, 2, 132) == 1


@pytest.mark.parametrize("rows,nb,num_ctas,splits", [
    (512, 64, 128, 1), (512, 64, 132, 1), (26, 64, 3, 1), (7, 4, 7, 1), (1, 64, 1, 1),
    (32, 64, 128, 4), (6, 64, 18, 3), (5, 4, 20, 4), (3, 7, 15, 5),
])
def test_cta_blocks_tile_the_rows(k, rows, nb, num_ctas, splits):
    """mla_work.cta_blocks (the ranges the 32-row Gluon kernel computes itself; its GPU tests
    check the results) against the picture: the ranges tile the rows' blocks exactly, in order,
    whole rows or one split of one row per CTA, sizes as even as they can be."""
    ranges = [k.mla_work.cta_blocks(c, num_ctas, rows, nb, splits) for c in range(num_ctas)]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows * nb
    # in order, no gap, no overlap
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [end - start for start, end in ranges]
    assert all(size > 0 for size in sizes)
    if splits == 1:  # whole rows, as even as possible
        assert all(start % nb == 0 and end % nb == 0 for start, end in ranges)
        assert max(sizes) - min(sizes) <= nb
    else:  # one split of one row each; splits of a row differ by at most one block
        assert num_ctas == rows * splits
        assert all(start // nb == (end - 1) // nb for start, end in ranges)
        assert max(sizes) - min(sizes) <= 1


def test_choose_grid(k):
    choose = k.mla_work.choose_grid
    # Many rows: whole rows, the fewest CTAs for the same most rows per CTA.
    assert choose(512, 64, 132) == (128, 1)  # b = 128, s_q = 4: 4 rows each
    assert choose(128, 64, 132) == (128, 1)  # one wave, one row each
    assert choose(151, 64, 132) == (76, 1)  # 2 rows per CTA at most either way
    assert choose(528, 64, 132) == (132, 1)  # 4 rows each
    assert choose(529, 64, 132) == (529, 1)  # past 4 rows per SM: one CTA per row
    assert choose(4096, 64, 132) == (4096, 1)
    # Few rows: splits as for the other kernels (a power of two filling the SMs once, at most 8
    # of top-2048, none under 8 blocks); a caller's count is capped at the blocks (none empty).
    assert choose(32, 64, 132) == (128, 4)
    assert choose(1, 64, 132) == (8, 8)
    assert choose(5, 4, 132) == (5, 1)  # 4 blocks: too few to split
    # What a caller asks for: splits capped at the blocks; CTAs at the rows.
    assert choose(6, 64, 132, splits=3) == (18, 3)
    assert choose(5, 4, 132, splits=16) == (20, 4)
    assert choose(64, 64, 132, splits=1, num_ctas=7) == (7, 1)
    assert choose(16, 64, 132, splits=1, num_ctas=100) == (16, 1)
    assert choose(16, 64, 132, splits=1) == (16, 1)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("row_bytes", [656, 1152])  # an fp8_ds_mla row; a bf16 latent+rope row
def test_row_gather_matches_the_reference_fetch(k, row_bytes, seed):
    from dsaserve.kv.hisparse.fetch import fetch_rows_reference

    g = _gen(seed)
    host = torch.randint(0, 256, (40, row_bytes), dtype=torch.uint8, generator=g)
    gpu = torch.randint(0, 256, (30, row_bytes), dtype=torch.uint8, generator=g)
    n = 21  # not a multiple of the rows per program
    dst_idx = torch.randperm(25, generator=g)[:n]
    dst_idx[::3] = -1  # masked entries fetch nothing
    host_idx = torch.randint(0, 40, (n,), generator=g)
    gpu_idx = torch.randint(0, 30, (n,), generator=g)
    from_host = torch.rand(n, generator=g) < 0.5
    want = torch.randint(0, 256, (25, row_bytes), dtype=torch.uint8, generator=g)
    got = want.clone()
    fetch_rows_reference(want, dst_idx, host, host_idx, gpu, gpu_idx, from_host)
    k.row_gather.row_gather(got, dst_idx, host, host_idx, gpu, gpu_idx, from_host)
    assert torch.equal(got, want)


def _fetch_case(g: torch.Generator, width: int, row_bytes: int):
    """The fetch's operands as the runtime hands them: 4 request regions of 6 (C = 6, the trash
    region 6) and 2 padded slots in the trash region, in shuffled order; per region distinct
    miss slots < S, most entries masked (−1 / S); positions below mirrored_upto (host pool)
    and above (GPU pages, some blocks past the block table's width: clamped); block tables
    int32 with −1 (unallocated) entries; a little of everything from the trash region too."""
    b, size, max_req, nb, mb = 4, 10, 6, 8, 6
    region_rows = -(-(size + 1) // b) * b  # P
    regions = torch.cat([torch.randperm(max_req, generator=g)[:4], torch.tensor([max_req] * 2)])
    order = torch.randperm(6, generator=g)
    regions = regions[order]
    requests = torch.randperm(7, generator=g)[:6]  # rows of the step's block table
    upto = torch.randint(0, nb * b, (6,), generator=g)
    miss_pos = torch.full((6, width), -1, dtype=torch.int64)
    miss_slot = torch.full((6, width), size, dtype=torch.int64)
    for i in range(6):
        n = int(torch.randint(0, min(width, size) + 1, (), generator=g))
        cols = torch.randperm(width, generator=g)[:n]
        miss_pos[i, cols] = torch.randint(0, nb * b, (n,), generator=g)
        miss_slot[i, cols] = torch.randperm(size, generator=g)[:n]
    num_host = (max_req + 2) * nb  # host blocks, more than the windows
    host_table = torch.randperm(num_host, generator=g)[: (max_req + 1) * nb].view(-1, nb)
    block_table = torch.randint(-1, 9, (7, mb), generator=g, dtype=torch.int32)
    host = torch.randint(0, 256, (num_host * b, row_bytes), dtype=torch.uint8, generator=g)
    gpu = torch.randint(0, 256, (9 * b, row_bytes), dtype=torch.uint8, generator=g)
    hot = torch.randint(0, 256, (max_req * region_rows, row_bytes), dtype=torch.uint8,
                        generator=g)
    layout = dict(block_size=b, buffer_rows=size, region_rows=region_rows, trash_region=max_req)
    return (hot, host, gpu, miss_pos, miss_slot, regions, requests, upto, host_table,
            block_table), layout


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("width,entries", [(8, 16), (24, 16), (37, 4)])  # top-k × 1, 3 rows; odd
@pytest.mark.parametrize("row_bytes", [656, 1152])  # an fp8_ds_mla row; a bf16 latent+rope row
def test_fused_fetch_matches_the_reference(k, row_bytes, width, entries, seed):
    """The one-launch fetch (operands derived in the kernel, counters in it) against
    `fetch_misses_reference` (the runtime's former index maths + `fetch_rows_reference`):
    the hot buffer byte for byte and both counters."""
    from dsaserve.kv.hisparse.fetch import fetch_misses_reference

    g = _gen(seed)
    for _ in range(3):
        (hot, *rest), layout = _fetch_case(g, width, row_bytes)
        want, got = hot.clone(), hot.clone()
        counts_want = torch.tensor([5, 2])  # the counters add to what they held
        counts_got = counts_want.clone()
        fetch_misses_reference(want, *rest, counts_want, **layout)
        k.row_gather.fetch_misses(got, *rest, counts_got, **layout, entries_per_program=entries)
        assert torch.equal(got, want)
        assert torch.equal(counts_got, counts_want)
        miss_pos = rest[2]
        assert int(counts_want[0]) - 5 == int((miss_pos >= 0).sum())
    assert not torch.equal(want, hot), "nothing was fetched"


@pytest.mark.parametrize("seed", [0, 1])
def test_residency_kernel_updates_the_tables_in_place(k, seed):
    """`resolve_triton` with `regions`: the runtime's [C, S] tables, the rows of the regions
    resolved in place (no gather or scatter around it), the others untouched, a repeated
    trash region (empty union) unchanged; the outputs equal the reference's on the rows."""
    from dsaserve.kv.hisparse.residency import resolve

    g = _gen(seed)
    size, k_top, max_rows, now = 12, 4, 3, 40
    topk, region, rank, token, stamp = _residency_case(
        g, num_regions=3, size=size, k=k_top, max_rows=max_rows, span=3 * size, now=now,
        dtype=torch.int64)
    tables_tok = torch.full((6, size), -1, dtype=torch.int64)  # rows 0..4 requests', 5 trash
    tables_stamp = torch.full_like(tables_tok, -1)
    other = torch.randint(0, 30, (6, size), generator=g)
    tables_tok[:5], tables_stamp[:5] = other[:5], other[:5] // 2
    regions = torch.cat([torch.randperm(5, generator=g)[:3], torch.tensor([5, 5])])
    tables_tok[regions[:3]], tables_stamp[regions[:3]] = token, stamp
    before_tok, before_stamp = tables_tok.clone(), tables_stamp.clone()
    want = resolve(topk, region, rank, token, stamp, torch.tensor(now), max_rows)
    out = k.residency.resolve_triton(topk, region, rank, tables_tok, tables_stamp,
                                     torch.tensor(now), max_rows, regions=regions)
    assert out[3] is tables_tok and out[4] is tables_stamp
    assert torch.equal(out[0], want.hot_slots)
    assert torch.equal(out[1][:3], want.miss_pos) and torch.equal(out[2][:3], want.miss_slot)
    assert (out[1][3:] == -1).all() and (out[2][3:] == size).all()  # the trash: no fetch
    assert torch.equal(tables_tok[regions[:3]], want.slot_token)
    assert torch.equal(tables_stamp[regions[:3]], want.slot_stamp)
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[regions[:3]] = False
    assert torch.equal(tables_tok[untouched], before_tok[untouched])
    assert torch.equal(tables_stamp[untouched], before_stamp[untouched])
    assert int(want.num_misses.sum()) > 0


def _residency_case(g: torch.Generator, num_regions: int, size: int, k: int, max_rows: int,
                    span: int, now: int, dtype: torch.dtype):
    """Random tables (some slots empty, stamps with ties) and rows: 0..max_rows rows per region,
    each a top-k of distinct positions, about half of them already held, some −1 pads; rows of
    other requests (not hot, ranks past max_rows) in between; row order shuffled."""
    token = torch.full((num_regions, size), -1, dtype=torch.int64)
    stamp = torch.full_like(token, -1)
    rows, region, rank = [], [], []
    for r in range(num_regions):
        n_full = int(torch.randint(0, size + 1, (), generator=g))
        slots = torch.randperm(size, generator=g)[:n_full]
        token[r, slots] = torch.randperm(span, generator=g)[:n_full]
        stamp[r, slots] = torch.randint(0, max(now // 4, 1), (n_full,), generator=g) * 4
        for q in range(int(torch.randint(0, max_rows + 1, (), generator=g))):
            held = token[r][token[r] >= 0]
            pick = torch.cat([held[torch.randperm(held.numel(), generator=g)[: k // 2]],
                              torch.randperm(span, generator=g)])
            row = torch.unique(pick, sorted=False)  # distinct positions
            row = row[torch.randperm(row.numel(), generator=g)][:k]
            row[torch.rand(k, generator=g) < 0.15] = -1
            rows.append(row)
            region.append(r)
            rank.append(q)
    for q in range(int(torch.randint(0, 6, (), generator=g))):
        rows.append(torch.randint(-1, span, (k,), generator=g))
        region.append(-1)
        rank.append(q)
    order = torch.randperm(len(rows), generator=g)
    topk = torch.stack(rows)[order].to(dtype) if rows else torch.empty((0, k), dtype=dtype)
    return (topk, torch.tensor(region, dtype=torch.int64)[order],
            torch.tensor(rank, dtype=torch.int64)[order], token, stamp)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k_top,max_rows,extra", [(8, 1, 0), (8, 4, 5), (6, 3, 0), (5, 2, 9)])
def test_residency_kernel_matches_the_reference(k, k_top, max_rows, extra, seed):
    from dsaserve.kv.hisparse.residency import Residency, resolve

    g = _gen(seed)
    size = max_rows * k_top + extra  # the configured minimum, and above
    hits = misses = 0
    for case in range(40):  # at least 4 random cases, more until both paths were exercised
        if case >= 4 and misses > 0 and hits > 0:
            break
        now = 40 + case
        topk, region, rank, token, stamp = _residency_case(
            g, num_regions=3, size=size, k=k_top, max_rows=max_rows, span=3 * size, now=now,
            dtype=torch.int32 if case % 2 else torch.int64)
        want = resolve(topk, region, rank, token, stamp, torch.tensor(now), max_rows)
        got = Residency(*k.residency.resolve_triton(topk, region, rank, token, stamp,
                                                     torch.tensor(now), max_rows))
        for name in Residency.__dataclass_fields__:
            assert torch.equal(getattr(got, name), getattr(want, name)), (case, name)
        misses += int(want.num_misses.sum())
        hits += int((want.slot_stamp == now).sum() - want.num_misses.sum())  # slots touched
    assert misses > 0 and hits > 0  # the cases exercise both paths
