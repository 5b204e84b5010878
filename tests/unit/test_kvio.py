"""Moving real caches through a plan: the target equals the caches the decode rank would have
written itself, byte for byte (bf16 and FP8 formats, IndexShare and MTP layers, B_s ≠ B_t)."""

from __future__ import annotations

import random

import pytest
import torch

from dsaserve.disagg import descriptors, kvio, transport
from dsaserve.disagg.relayout import KVLayout, plan_transfer
from dsaserve.kernels import formats
from dsaserve.kv import layout
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


def _scenario(fp8: bool, ns: int, i_s: int, bs: int, nt: int, i_t: int, bt: int):
    """Source caches of every prefill rank, and two identical sets of target caches: `got`
    holds the decode side's cached prefix and is to receive the rest, `want` is the decode
    rank having written every token itself. Returns (plan, src, got, want)."""
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
    return plan_transfer(src, dst, cached, num_tokens), src_caches, got, want


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
