"""Moving real caches through a plan: the target equals the caches the decode rank would have
written itself, byte for byte (bf16 and FP8 formats, IndexShare and MTP layers, B_s ≠ B_t)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from dsaserve.config import DisaggConfig
from dsaserve.core import KVRecv, KVTransferParams
from dsaserve.disagg import descriptors, kvio, staging, transport
from dsaserve.disagg.connector import ConnectorWorker
from dsaserve.disagg.hostplan import HostDest
from dsaserve.disagg.relayout import CopyRuns, KVLayout, plan_transfer
from dsaserve.disagg.shmcopy import CopyThread
from dsaserve.kernels import formats
from dsaserve.kv import layout
from dsaserve.kv.hisparse.mla_pages import SPILLED
from dsaserve.model.dsa import LayerCache

L, R, D = 128, 16, 32  # latent, RoPE and indexer widths (fp8_ds_mla needs L % 128 == 0)
HAS_INDEX = (True, False, True)  # a full layer, an IndexShare layer, the MTP layer


def _caches(num_blocks: int, b: int, fp8: bool, gen: torch.Generator) -> list[LayerCache]:
    """Caches filled with random bytes, so that a stray or a missing write shows."""
    out = []
    for has_index in HAS_INDEX:
        kv = torch.empty(formats.mla_cache_shape(num_blocks, b, fp8, L, R),
                         dtype=torch.uint8 if fp8 else torch.bfloat16)
        index = torch.empty(formats.index_cache_shape(num_blocks, b, fp8, D),
                            dtype=torch.uint8 if fp8 else torch.bfloat16)
        for t in (kv, index):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8, generator=gen))
        out.append(LayerCache(kv=kv, index=index if has_index else None))
    return out


def _write(caches: list[LayerCache], kv: KVLayout, rank: int, pos: torch.Tensor,
           data: list[tuple[torch.Tensor, ...]]) -> None:
    """What the engine does: rank `rank` writes the positions it owns (owner writes)."""
    slots = layout.slot_mapping(pos, torch.zeros_like(pos), torch.tensor([kv.block_ids]),
                                kv.block_size, kv.dcp_size, rank, kv.interleave)
    for cache, (c, k_pe, k) in zip(caches, data, strict=True):
        formats.write_mla_cache(cache.kv, slots, c[pos], k_pe[pos])
        if cache.index is not None:
            formats.write_index_cache(cache.index, slots, k[pos])


def _table(rng: random.Random, num_tokens: int, b: int, n: int) -> tuple[tuple[int, ...], int]:
    blocks = -(-num_tokens // (b * n))
    num_blocks = 3 * blocks + 2
    return tuple(rng.sample(range(num_blocks), blocks)), num_blocks


def _bytes(caches: list[LayerCache]) -> list[torch.Tensor]:
    return [t.view(torch.uint8) for c in caches for t in (c.kv, c.index) if t is not None]


LAYOUTS = [  # (N_s, I_s, B_s, N_t, I_t, B_t)
    (1, 1, 4, 1, 1, 4),  # plain copy
    (2, 4, 4, 1, 1, 4),  # whole pages (vLLM's interleave = block size)
    (2, 1, 4, 1, 1, 8),  # token round robin into bigger pages
    (4, 2, 4, 1, 2, 2),  # into smaller pages
    (2, 2, 8, 2, 1, 4),  # DCP on both sides, different interleaves
    (4, 1, 2, 2, 2, 4),
]


def _scenario(fp8: bool, ns: int, i_s: int, bs: int, nt: int, i_t: int, bt: int,
              layouts: bool = False):
    """Source caches of every prefill rank, and two identical sets of target caches: `got`
    holds the decode side's cached prefix and is to receive the rest, `want` is the decode
    rank having written every token itself. Returns (plan, src, got, want), and with
    `layouts` also (source KVLayout, target KVLayout, cached prefix, tokens)."""
    rng = random.Random(hash((fp8, ns, i_s, bs, nt, i_t, bt)))
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    num_tokens = rng.randint(2 * ns * bs, 5 * ns * bs + 3)
    cached = rng.choice([0, bt * nt, rng.randint(1, num_tokens - 1)])  # decode's own prefix
    data = [tuple(torch.randn(num_tokens, w, generator=gen) * 3 for w in (L, R, D))
            for _ in HAS_INDEX]  # per layer: c, k_pe, indexer key of every position
    pos = torch.arange(num_tokens)

    s_ids, s_blocks = _table(rng, num_tokens, bs, ns)
    d_ids, d_blocks = _table(rng, num_tokens, bt, nt)
    src, dst = KVLayout(s_ids, bs, ns, i_s), KVLayout(d_ids, bt, nt, i_t)
    src_caches = [_caches(s_blocks, bs, fp8, gen) for _ in range(ns)]
    for r, caches in enumerate(src_caches):
        _write(caches, src, r, pos, data)
    seed = rng.randint(0, 2**31)
    got = [_caches(d_blocks, bt, fp8, torch.Generator().manual_seed(seed + q)) for q in range(nt)]
    want = [_caches(d_blocks, bt, fp8, torch.Generator().manual_seed(seed + q)) for q in range(nt)]
    for q in range(nt):
        _write(got[q], dst, q, pos[:cached], data)
        _write(want[q], dst, q, pos, data)
    out = plan_transfer(src, dst, cached, num_tokens), src_caches, got, want
    return (*out, src, dst, cached, num_tokens) if layouts else out


def _assert_same(got: list[list[LayerCache]], want: list[list[LayerCache]]) -> None:
    for g_rank, w_rank in zip(got, want, strict=True):
        for g, w in zip(_bytes(g_rank), _bytes(w_rank), strict=True):
            assert torch.equal(g, w)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("ns,i_s,bs,nt,i_t,bt", LAYOUTS)
def test_transfer_equals_decode_side_writes(fp8: bool, ns: int, i_s: int, bs: int, nt: int,
                                            i_t: int, bt: int) -> None:
    plan, src_caches, got, want = _scenario(fp8, ns, i_s, bs, nt, i_t, bt)
    kvio.check_compatible(src_caches[0], got[0])
    moved = kvio.apply_plan(plan, src_caches, got)
    _assert_same(got, want)
    rb = kvio.row_bytes(got[0])
    assert rb.kv == ((L + 4 * L // 128 + 2 * R,) * 3 if fp8 else (2 * (L + R),) * 3)
    assert rb.index == tuple((D + 4 if fp8 else 2 * D) * h for h in HAS_INDEX)
    assert moved == plan.nbytes(rb) == (plan.end - plan.start) * rb.per_token


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("ns,i_s,bs,nt,i_t,bt", LAYOUTS)
def test_byte_segments_equal_decode_side_writes(fp8: bool, ns: int, i_s: int, bs: int, nt: int,
                                               i_t: int, bt: int) -> None:
    """The zero-copy form: copying the plan's byte segments between whole cache tensors (what
    a NIXL READ of registered caches does) gives the same target, and moves plan.nbytes."""
    plan, src_caches, got, want = _scenario(fp8, ns, i_s, bs, nt, i_t, bt)
    moved = 0
    for pair in plan.pairs:
        src_fmt = descriptors.layer_formats(src_caches[pair.src_rank])
        dst_fmt = descriptors.layer_formats(got[pair.dst_rank])
        layers = descriptors.plan_segments(pair, src_fmt, dst_fmt)
        moved += descriptors.segments_nbytes(layers)
        src_regions = descriptors.cache_regions(src_caches[pair.src_rank])
        dst_regions = descriptors.cache_regions(got[pair.dst_rank])
        for i, layer in enumerate(layers):
            for part, segs in layer.items():
                a, b = src_regions[f"L{i}.{part}"], dst_regions[f"L{i}.{part}"]
                for s, d, n in segs.tolist():
                    b[d: d + n] = a[s: s + n]
    _assert_same(got, want)
    assert moved == plan.nbytes(kvio.row_bytes(got[0]))


def _staged_targets(caches: list[LayerCache]) -> list[dict[str, list[torch.Tensor]]]:
    return [{"kv": (v := kvio.part_views(c))[:1], "index": v[1:]} for c in caches]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("ns,i_s,bs,nt,i_t,bt", LAYOUTS)
def test_staged_read_equals_decode_side_writes(fp8: bool, ns: int, i_s: int, bs: int, nt: int,
                                              i_t: int, bt: int) -> None:
    """The staged form: the pair's rows copied by their segments from the source's cache
    tensors into a buffer (what the READ into a staging region does), then scattered: the same
    target, plan.nbytes moved, and no more segments per tensor than the pieces of consecutive
    source slots in one source page (fewer than zero-copy needs wherever staging is chosen)."""
    plan, src_caches, got, want = _scenario(fp8, ns, i_s, bs, nt, i_t, bt)
    moved = 0
    for pair in plan.pairs:
        src_fmt = descriptors.layer_formats(src_caches[pair.src_rank])
        dst_fmt = descriptors.layer_formats(got[pair.dst_rank])
        sp = staging.plan_staged(pair, src_fmt, dst_fmt)
        buf = torch.zeros(sp.nbytes, dtype=torch.uint8)
        src_regions = descriptors.cache_regions(src_caches[pair.src_rank])
        for i, layer in enumerate(sp.reads):
            for part, segs in layer.items():
                a = src_regions[f"L{i}.{part}"]
                for s, d, n in segs.tolist():
                    buf[d: d + n] = a[s: s + n]
                    moved += n
        staging.scatter_staged(sp, buf, _staged_targets(got[pair.dst_rank]))
        # pieces of consecutive source slots within one source page
        slots = pair.src_slots().sort().values
        pieces = 1 + int(((slots[1:] != slots[:-1] + 1) | (slots[1:] % bs == 0)).sum())
        per_tensor = [2 if part == "index" and fp8 else 1
                      for layer in sp.reads for part in layer]
        assert sp.num_segments <= pieces * sum(per_tensor)
        zero_copy = descriptors.plan_segments(pair, src_fmt, dst_fmt)
        if staging.worth_staging(zero_copy, sp):
            assert sp.num_segments < sum(int(g.shape[0]) for layer in zero_copy
                                         for g in layer.values())
    _assert_same(got, want)
    assert moved == plan.nbytes(kvio.row_bytes(got[0]))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_staged_is_chosen_where_segments_are_per_row(fp8: bool) -> None:
    """PCP/DCP 2 at interleave 1 → a DP rank: one zero-copy segment per row (two per FP8 key),
    above the threshold; at interleave = block size one per page, below it. The staged READ of
    the interleave-1 pair needs one segment per source page per tensor."""
    b, n = 16, 2
    fmt = [descriptors.LayerFormat(b, 656, 132 if fp8 else 64, fp8)] * 3
    dst = KVLayout(tuple(range(8)), b)
    per_row = {}
    for i in (1, b):
        plan = plan_transfer(KVLayout((3, 1, 6, 0), b, n, i), dst, 0, 8 * b - 1)
        pair = plan.pair(0, 0)
        assert pair is not None
        per_row[i] = staging.segments_per_row(descriptors.plan_segments(pair, fmt, fmt),
                                              pair.num_rows)
        sp = staging.plan_staged(pair, fmt, fmt)
        assert staging.worth_staging(descriptors.plan_segments(pair, fmt, fmt), sp) == (i == 1)
        if i == 1:
            # source pages 0, 1, 3, 6: kv rows and bf16 keys merge the adjacent 0-1; an FP8
            # page's values and scales are two segments, never merged across pages
            assert sp.num_segments == 3 * (3 + (8 if fp8 else 3))
            assert sp.nbytes == pair.num_rows * 3 * (656 + fmt[0].index_bytes)
    assert per_row[1] == (3 if fp8 else 2) >= staging.STAGE_SEGMENTS_PER_ROW
    assert per_row[b] < staging.STAGE_SEGMENTS_PER_ROW


def test_keys_alone_are_staged_where_only_some_layers_have_keys() -> None:
    """A plan of indexer keys alone (a HiSparse destination moves keys and MLA rows apart) over
    layers where IndexShare leaves most without keys: its segments per row count the layers
    with keys only. Averaged over every layer, interleave 1's one segment per bf16 key row fell
    to 1/3, under the threshold, and the pair went zero-copy at a segment per row."""
    b = 16
    fmt = [descriptors.LayerFormat(b, 656, 64, False),
           descriptors.LayerFormat(b, 656, 0, False), descriptors.LayerFormat(b, 656, 0, False)]
    plan = plan_transfer(KVLayout((3, 1, 6, 0), b, 2, 1), KVLayout(tuple(range(8)), b), 0,
                         8 * b - 1)
    pair = plan.pair(0, 0)
    assert pair is not None
    keys = descriptors.plan_segments(pair, fmt, fmt, ("index",))
    assert [bool(layer) for layer in keys] == [True, False, False]
    assert staging.segments_per_row(keys, pair.num_rows) == 1.0
    assert staging.worth_staging(keys, staging.plan_staged(pair, fmt, fmt, ("index",)))


@pytest.mark.parametrize("b", [4, 16])
def test_whole_pages_are_one_segment_per_page(b: int) -> None:
    """I = B_s = B_t: every MLA and FP8 indexer segment is whole pages (a page's values and
    scales travel as one), and pages with consecutive ids on both sides merge.

        position page p : 0  1  2  3  4  5
        source rank     : 0  1  0  1  0  1      source page 5 6 9 (each rank's p // 2)
        target page     : 1  7  2  8 11 12      → (5, 6) → (1, 2) and (7, 8) merge
    """
    src = KVLayout((5, 6, 9), b, 2, b)
    dst = KVLayout((1, 7, 2, 8, 11, 12), b)
    plan = plan_transfer(src, dst, 0, 6 * b)
    fmt = [descriptors.LayerFormat(b, 656, 132, True)]
    page = b * 132
    for pair in plan.pairs:
        (layer,) = descriptors.plan_segments(pair, fmt, fmt)
        assert layer["kv"].tolist() == [[5 * b * 656, [1, 7][pair.src_rank] * b * 656, 2 * b * 656],
                                        [9 * b * 656, [11, 12][pair.src_rank] * b * 656, b * 656]]
        assert layer["index"].tolist() == [[5 * page, [1, 7][pair.src_rank] * page, 2 * page],
                                           [9 * page, [11, 12][pair.src_rank] * page, page]]


def _rowwise_page_segments(pair: CopyRuns, head_dim: int, bs: int, bt: int) -> torch.Tensor:
    """The reference: per row, its D value bytes and its 4 scale bytes at their places in each
    side's page (MODEL_SPEC's FP8 indexer page), then coalesced."""
    rows = [(s, t) for s0, t0, n in zip(pair.src_start.tolist(), pair.dst_start.tolist(),
                                        pair.length.tolist(), strict=True)
            for s, t in zip(range(s0, s0 + n), range(t0, t0 + n), strict=True)]
    segs = []
    for s, t in rows:
        src_page, dst_page = (s // bs) * bs * (head_dim + 4), (t // bt) * bt * (head_dim + 4)
        segs.append((src_page + s % bs * head_dim, dst_page + t % bt * head_dim, head_dim))
        segs.append((src_page + bs * head_dim + s % bs * 4, dst_page + bt * head_dim + t % bt * 4,
                     4))
    return descriptors.coalesce(torch.tensor(segs, dtype=torch.int64).reshape(-1, 3))


def _runny_table(rng: random.Random, num_blocks: int) -> tuple[int, ...]:
    """Block ids in stretches of consecutive ids (runs then span pages), stretches shuffled."""
    first = rng.randint(0, 5)
    ids = list(range(first, first + num_blocks))
    cuts = sorted(rng.sample(range(1, num_blocks), min(num_blocks - 1, rng.randint(0, 3))))
    parts = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, num_blocks], strict=True)]
    rng.shuffle(parts)
    return tuple(i for part in parts for i in part)


@pytest.mark.parametrize("ns", [1, 2, 4])
@pytest.mark.parametrize("bs,bt", [(16, 16), (64, 64), (16, 64), (64, 16)])
def test_fp8_page_segments_equal_the_row_wise_reference(ns: int, bs: int, bt: int) -> None:
    """Segments built from the runs (cut at either side's page boundaries) are the very tensor
    the row-wise construction gives, over tables with and without consecutive ids, interleave 1
    and = B on either side, DCP on either side, and ranges that start and end mid-page."""
    rng = random.Random(ns * 1000 + bs * 10 + bt)
    for _ in range(20):
        i_s, i_t = rng.choice([1, bs]), rng.choice([1, bt])
        nt = rng.choice([1, 2, ns])  # = ns: whole pages of one source rank land on one target
        num_tokens = rng.randint(1, 5 * max(ns * bs, nt * bt))
        tables = []
        for b, n in ((bs, ns), (bt, nt)):
            blocks = -(-num_tokens // (b * n))
            tables.append(_runny_table(rng, blocks) if rng.random() < 0.7
                          else tuple(rng.sample(range(3 * blocks + 2), blocks)))
        plan = plan_transfer(KVLayout(tables[0], bs, ns, i_s), KVLayout(tables[1], bt, nt, i_t),
                             rng.randint(0, num_tokens), num_tokens)
        for pair in plan.pairs:
            head_dim = rng.choice([8, 128])
            fmt_s = [descriptors.LayerFormat(bs, 656, head_dim + 4, True)]
            fmt_t = [descriptors.LayerFormat(bt, 656, head_dim + 4, True)]
            (layer,) = descriptors.plan_segments(pair, fmt_s, fmt_t, ("index",))
            assert torch.equal(layer["index"], _rowwise_page_segments(pair, head_dim, bs, bt))


def test_fp8_page_segments_of_hand_made_runs() -> None:
    """Runs laid out apart from any plan: long runs that cross several pages of each side at
    different offsets, runs of one row, and a pair with no runs."""
    rng = random.Random(7)
    for bs, bt in [(16, 16), (64, 64), (16, 64), (64, 16), (4, 6)]:
        for _ in range(20):
            lengths = [rng.choice([1, 1, rng.randint(1, 3 * max(bs, bt))])
                       for _ in range(rng.randint(0, 8))]
            starts = []
            for order in (range(len(lengths)), rng.sample(range(len(lengths)), len(lengths))):
                at, side = rng.randint(0, 40), {}
                for k in order:  # each side's slots apart, the target's in another order
                    side[k] = at
                    at += lengths[k] + rng.choice([0, 0, rng.randint(1, 70)])
                starts.append([side[k] for k in range(len(lengths))])
            pair = CopyRuns(0, 0, *(torch.tensor(v, dtype=torch.int64).reshape(-1)
                                    for v in (*starts, lengths)))
            got = descriptors._page_segments(pair, 128, bs, bt)
            assert torch.equal(got, _rowwise_page_segments(pair, 128, bs, bt))
            assert int(got[:, 2].sum()) == 132 * sum(lengths)
    none = torch.zeros(0, dtype=torch.int64)
    assert descriptors._page_segments(CopyRuns(0, 0, none, none, none), 128, 16, 64).shape == (0, 3)


def test_coalesce_sorted_or_not() -> None:
    """Sorted by source, segments that continue on both sides join; the input's order does not
    matter (sorted input skips the sort)."""
    segs = torch.tensor([[0, 100, 4], [4, 104, 4], [8, 50, 4], [12, 54, 2], [20, 56, 4]])
    want = [[0, 100, 8], [8, 50, 6], [20, 56, 4]]
    assert descriptors.coalesce(segs).tolist() == want
    assert descriptors.coalesce(segs[torch.tensor([3, 0, 4, 2, 1])]).tolist() == want
    assert descriptors.coalesce(segs[:0]).shape == (0, 3)


BACKENDS = [
    "shm",
    pytest.param("nixl", marks=pytest.mark.skipif(not transport.nixl_available(),
                                                  reason="nixl not installed")),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_copy_read_through_a_transport(backend: str) -> None:
    """Caches in registered memory; the decode agent READs the plan's segments straight from
    each prefill agent's caches into its own, and each prefill agent is told it may free."""
    plan, src_caches, got, want = _scenario(True, 2, 1, 4, 1, 1, 8)
    agents = [transport.make_transport(backend, f"{backend}-prefill-{r}") for r in range(2)]
    decode = transport.make_transport(backend, f"{backend}-decode-0")
    try:
        src_caches = [descriptors.register_caches(a, c) for a, c in zip(agents, src_caches,
                                                                          strict=True)]
        got = [descriptors.register_caches(decode, got[0])]
        peers = [decode.add_peer(a.metadata()) for a in agents]
        for a in agents:
            a.add_peer(decode.metadata())
        dst_fmt = descriptors.layer_formats(got[0])
        moved = 0
        for pair in plan.to_target(0):
            peer = peers[pair.src_rank]
            layers = descriptors.plan_segments(
                pair, descriptors.layer_formats(src_caches[pair.src_rank]), dst_fmt)
            moved += descriptors.segments_nbytes(layers)
            xfers = [decode.read(peer, f"L{i}.{part}", f"L{i}.{part}", descriptors.for_read(segs))
                     for i, layer in enumerate(layers) for part, segs in layer.items()]
            for x in xfers:
                decode.wait(x, timeout_s=10)
            decode.send_notification(peer, b"req-0 done")
        _assert_same(got, want)
        assert moved == plan.nbytes(kvio.row_bytes(got[0]))
        for a in agents:
            a.wait_notification(decode.name, b"req-0 done", timeout_s=10)
    finally:
        for a in [*agents, decode]:
            a.close()


def test_fp8_index_page_is_handled_exactly() -> None:
    """One token's key in a buffer is its D value bytes, then its scale, taken from the two
    halves of the page (a row-major read of the page would mix tokens)."""
    b = 4
    cache = LayerCache(kv=torch.zeros(2, b, 656, dtype=torch.uint8),
                       index=torch.zeros(2, b * (D + 4), dtype=torch.uint8))
    k = torch.randn(2 * b, D, generator=torch.Generator().manual_seed(0))
    formats.write_index_cache(cache.index, torch.arange(2 * b), k)
    buf = kvio.gather_rows([cache], torch.tensor([6]))
    values, scale = formats.read_index_cache(cache.index, torch.tensor([6]), D)
    key = buf[656:]
    assert key.numel() == D + 4
    assert torch.equal(key[:D], values[0].view(torch.uint8))
    assert torch.equal(key[D:].view(torch.float32), scale)


def test_incompatible_formats_are_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="same format"):
        kvio.check_compatible(_caches(2, 4, True, gen), _caches(2, 4, False, gen))
    with pytest.raises(ValueError, match="layers"):
        kvio.check_compatible(_caches(2, 4, True, gen), _caches(2, 4, True, gen)[:2])
    with pytest.raises(ValueError, match="out must be"):
        kvio.gather_rows(_caches(2, 4, True, gen), torch.tensor([0, 1]),
                         out=torch.empty(10, dtype=torch.uint8))


# ---- the connector's choice (ConnectorWorker: two prefill ranks, one decode rank) ---------------
class _Pd:
    """Two prefill ranks (DCP 2) and a decode rank as the connector's workers, over real caches
    in registered memory; `recv()` is the decode rank's job for the scenario's request."""

    def __init__(self, backend: str, fp8: bool, layout: tuple[int, ...], staging_mb: int = 1024,
                 transfer_timeout_s: float = 30.0) -> None:
        ns, i_s, bs, nt, i_t, bt = layout
        (self.plan, src_caches, got, self.want, self.src, self.dst, self.cached,
         self.num_tokens) = _scenario(fp8, *layout, layouts=True)
        role = DisaggConfig(kv_role="kv_producer", backend=backend, side_channel_port=0)
        self.prefill = [ConnectorWorker(role, rank=r, dcp_rank=r, world_size=ns, block_size=bs,
                                        dcp_size=ns, interleave=i_s) for r in range(ns)]
        self.decode = ConnectorWorker(
            DisaggConfig(kv_role="kv_consumer", backend=backend, side_channel_port=0,
                         staging_mb=staging_mb, transfer_timeout_s=transfer_timeout_s),
            rank=0, dcp_rank=0, world_size=1, block_size=bt, dcp_size=nt, interleave=i_t)
        self.src_caches = [w.register(c) for w, c in zip(self.prefill, src_caches, strict=True)]
        self.got = [self.decode.register(got[0])]

    def recv(self) -> KVRecv:
        params = KVTransferParams(
            remote_request_id="req", remote_block_ids=self.src.block_ids,
            remote_block_size=self.src.block_size, remote_dcp_size=self.src.dcp_size,
            remote_interleave=self.src.interleave, remote_num_tokens=self.num_tokens + 1)
        return KVRecv("req", self.dst.block_ids, self.cached, self.num_tokens, params,
                      tuple(w.metadata() for w in self.prefill))

    def settle(self) -> tuple[tuple[str, ...], dict[str, str]]:
        for _ in range(10_000):
            done, failed = self.decode.poll_receives()
            if done or failed:
                return done, failed
            time.sleep(0.001)
        raise AssertionError("the READs never settled")

    def close(self) -> None:
        for w in [self.decode, *self.prefill]:
            w.close()


def _held_copies(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Shared memory's copy thread holds every READ until the event is set or it is cancelled."""
    release = threading.Event()
    real = CopyThread._copy

    def held(thread: CopyThread, job) -> bool:
        while not (release.wait(0.002) or job.cancelled):
            pass
        return real(thread, job)

    monkeypatch.setattr(CopyThread, "_copy", held)
    return release


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout,path", [
    ((2, 1, 4, 1, 1, 8), "staged"),  # interleave 1: one zero-copy segment per row
    ((2, 4, 4, 1, 1, 4), "zero-copy"),  # interleave = block size: whole pages
], ids=["i1", "i=b"])
def test_the_connector_chooses_per_pair(backend: str, fp8: bool, layout, path: str) -> None:
    """The decode rank's READs of both prefill ranks' shares: staged where zero-copy would be
    per row, zero-copy where pages line up; the target = the decode rank's own writes, bytes =
    plan.nbytes, the staging buffer back once the rows are scattered, the producer notified."""
    pd = _Pd(backend, fp8, layout)
    try:
        pd.decode.start_receives([pd.recv()])
        assert pd.decode.staging is not None
        pd.decode.check_integrity()
        assert pd.settle() == (("req",), {})
        _assert_same(pd.got, pd.want)
        assert pd.decode.bytes_received == pd.plan.nbytes(kvio.row_bytes(pd.got[0]))
        staged = 2 if path == "staged" else 0
        assert (pd.decode.pairs_staged, pd.decode.pairs_zero_copy) == (staged, 2 - staged)
        assert not pd.decode.staging.in_use and len(pd.decode.staging.free) == staged // 2
        pd.decode.check_integrity()
        for _ in range(1000):
            if pd.prefill[0].poll_sends() == ("req",):
                break
            time.sleep(0.001)
        else:
            raise AssertionError("the producer was not notified")
    finally:
        pd.close()


def test_staging_that_does_not_fit_reads_zero_copy() -> None:
    """staging_mb 0: the same per-row pairs READ zero-copy, same bytes, same target."""
    pd = _Pd("shm", True, (2, 1, 4, 1, 1, 8), staging_mb=0)
    try:
        pd.decode.start_receives([pd.recv()])
        assert pd.settle() == (("req",), {})
        _assert_same(pd.got, pd.want)
        assert (pd.decode.pairs_staged, pd.decode.pairs_zero_copy) == (0, 2)
        assert pd.decode.bytes_received == pd.plan.nbytes(kvio.row_bytes(pd.got[0]))
        pd.decode.check_integrity()
    finally:
        pd.close()


def _end_early(pd, end: str) -> None:
    """Stop request "req"'s READs in flight: cancelled, timed out, or the worker closed."""
    if end == "cancel":
        pd.decode.cancel_receives(["req"])
    elif end == "timeout":
        done, failed = pd.settle()
        assert not done and "transfer timeout" in failed["req"]
    else:
        pd.decode.close()


@pytest.mark.parametrize("end", ["cancel", "timeout", "close"])
def test_a_staged_read_that_ends_early_gives_its_buffer_back(end: str, monkeypatch) -> None:
    """READs held in flight by the copy thread, then cancelled (an abort), timed out, or the
    decode rank closed: the staging buffer is given back, and nothing lands in the target
    (its caches keep their bytes: no scatter from a buffer whose READs did not all land)."""
    release = _held_copies(monkeypatch)
    pd = _Pd("shm", True, (2, 1, 4, 1, 1, 8), transfer_timeout_s=0.2)
    try:
        before = [t.clone() for t in _bytes(pd.got[0])]
        pd.decode.start_receives([pd.recv()])
        assert pd.decode.staging is not None and len(pd.decode.staging.in_use) == 1
        pd.decode.check_integrity()
        _end_early(pd, end)
        assert not pd.decode.staging.in_use and pd.decode.num_receiving == 0
        pd.decode.check_integrity()
        release.set()
        assert all(torch.equal(a, b) for a, b in zip(before, _bytes(pd.got[0]), strict=True))
    finally:
        release.set()
        pd.close()


def _spilling_dest(pd: _Pd) -> tuple[list[torch.Tensor], HostDest]:
    """A host pool registered on the decode rank (zeroed) and a destination that spills every
    block of the request but the last (its write tail, into a GPU page)."""
    num_blocks = -(-pd.num_tokens // pd.dst.block_size)
    host = pd.decode.register_host_pool([torch.zeros_like(c.kv) for c in pd.got[0]])
    mla_pages = (SPILLED,) * (num_blocks - 1) + (pd.dst.block_ids[num_blocks - 1],)
    return host, HostDest(tuple(reversed(range(num_blocks))), mla_pages)


def _reads_by_region(worker: ConnectorWorker,
                     monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], int]:
    """Bytes READ per (local region, remote region), recorded as the worker posts them."""
    out: dict[tuple[str, str], int] = {}
    real = worker.transport.read_regions

    def read_regions(peer: str, items, notify: bytes = b""):
        for local, remote, segments in items:
            key = (local, remote)
            out[key] = out.get(key, 0) + sum(n for _, _, n in segments)
        return real(peer, items, notify)

    monkeypatch.setattr(worker.transport, "read_regions", read_regions)
    return out


@pytest.mark.parametrize("staging_mb", [1024, 0], ids=["staged", "no-room"])
def test_staged_into_a_hisparse_host_pool(staging_mb: int, monkeypatch) -> None:
    """Into a spilling HiSparse rank: the MLA rows of spilled blocks READ into the host pool
    (staged: through a host-memory buffer of their own, then scattered into the pool; no room:
    zero-copy, straight into the pool), the tail's into GPU pages, every key into its indexer
    page. The caches' staging buffer carries only rows bound for the caches."""
    pd = _Pd("shm", True, (2, 1, 4, 1, 1, 8), staging_mb=staging_mb)
    try:
        b, blocks = pd.dst.block_size, pd.dst.block_ids
        host, dest = _spilling_dest(pd)
        reads = _reads_by_region(pd.decode, monkeypatch)
        pd.decode.start_receives([pd.recv()], {"req": dest})
        pd.decode.check_integrity()
        assert pd.settle() == (("req",), {})
        # the keys, the host pool's rows and the tail's rows, from both prefill ranks
        paths = (pd.decode.pairs_staged, pd.decode.pairs_zero_copy)
        assert paths == ((6, 0) if staging_mb else (0, 6))
        to_host, to_gpu = pd.decode.mla_rows_to_host, pd.decode.mla_rows_to_gpu
        assert to_host and to_gpu
        for g, w, h in zip(pd.got[0], pd.want[0], host, strict=True):
            if w.index is not None:
                assert torch.equal(g.index, w.index)
            g_kv, w_kv, h_kv = (kvio.kv_rows(t) for t in (g.kv, w.kv, h))
            for p in range(pd.cached, pd.num_tokens):
                slot = blocks[p // b] * b + p % b
                if dest.mla_pages[p // b] == SPILLED:
                    assert torch.equal(h_kv[dest.host_blocks[p // b] * b + p % b], w_kv[slot])
                else:
                    assert torch.equal(g_kv[slot], w_kv[slot])
        # where each MLA row was READ into: a host-memory staging buffer (SH*) or the pool
        # itself (H*) for the spilled blocks, the caches' staging buffer (S<k>) or pages for
        # the tail; the caches' buffer never carries a row bound for the host pool
        kv_bytes = sum(f.kv_bytes for f in pd.decode.formats)

        def mla_bytes_into(pool: staging.StagingPool | None, prefix: str = "") -> int:
            names = {b.name for b in [*pool.free, *pool.in_use.values()]} if pool else set()
            return sum(n for (local, remote), n in reads.items() if remote.endswith(".kv")
                       and (local in names if pool else local[0] == prefix))

        assert mla_bytes_into(pd.decode.staging) == (to_gpu * kv_bytes if staging_mb else 0)
        pools = (pd.decode.staging, pd.decode.host_staging)
        assert pools[0] is not None and pools[1] is not None
        assert mla_bytes_into(pools[1]) == (to_host * kv_bytes if staging_mb else 0)
        assert mla_bytes_into(None, "H") == (0 if staging_mb else to_host * kv_bytes)
        assert mla_bytes_into(None, "L") == (0 if staging_mb else to_gpu * kv_bytes)
        assert all(b.name.startswith("SH") for b in pools[1].free)
        for pool in pools:
            assert not pool.in_use and pool.allocated == (pool.MIN_BYTES if staging_mb else 0)
        pd.decode.check_integrity()
    finally:
        pd.close()


@pytest.mark.parametrize("end", ["cancel", "timeout", "close"])
def test_staged_reads_into_a_host_pool_that_end_early_give_both_buffers_back(
        end: str, monkeypatch) -> None:
    """A request into a spilling HiSparse rank holds two staging buffers (the caches', the host
    pool's) while its READs are in flight; cancelled (an abort), timed out or closed, it gives
    both back, and neither the caches nor the host pool receive a byte."""
    release = _held_copies(monkeypatch)
    pd = _Pd("shm", True, (2, 1, 4, 1, 1, 8), transfer_timeout_s=0.2)
    try:
        host, dest = _spilling_dest(pd)
        before = [t.clone() for t in [*_bytes(pd.got[0]), *host]]
        pd.decode.start_receives([pd.recv()], {"req": dest})
        pools = (pd.decode.staging, pd.decode.host_staging)
        assert pools[0] is not None and pools[1] is not None
        assert [len(pool.in_use) for pool in pools] == [1, 1]
        pd.decode.check_integrity()
        _end_early(pd, end)
        assert [len(pool.in_use) for pool in pools] == [0, 0]
        assert [len(pool.free) for pool in pools] == [1, 1] and pd.decode.num_receiving == 0
        pd.decode.check_integrity()
        release.set()
        after = [*_bytes(pd.got[0]), *host]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    finally:
        release.set()
        pd.close()
