"""Triton kernels against the PyTorch reference on the GPU, fresh random inputs every run.

Tolerances (stated once, used below):
  - bf16 operands (q, a bf16 cache, P rounded to bf16): ‖o − ref‖ / ‖ref‖ ≤ 1e-2 and
    |lse − ref| ≤ 1e-2 · max(1, |ref|), ref computed in fp32 from the same bf16 / fp8 inputs;
  - fp8 caches: the reference reads the same bytes and dequantizes them (e4m3 · power-of-two
    scale is exact in bf16), so the same bound holds;
  - cache writers: byte-exact against dsaserve.kernels.formats;
  - rotary embedding: within one bf16 rounding step of the PyTorch arithmetic (fused
    multiply-adds); RMSNorm: within two (the sum's order can move the normalized value, cast
    to bf16 before the weight's product, to its neighbour; the product rounds again);
  - FP8 indexer logits: ‖Δ‖ / ‖ref‖ ≤ 1e-3 per row (fp8 products are exact, the tensor core
    accumulates in reduced fp32); top-k: the reference scores of the chosen keys equal the
    reference top-k scores within that tolerance (tie-tolerant set equality).
Run on the device machine: `pytest -m gpu tests/gpu/test_kernels_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels import formats, reference
from dsaserve.kernels.metadata import AttentionMetadata, scattered_block_table
from dsaserve.kernels.registry import ReferenceBackend, position_slots
from dsaserve.kv import layout

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    # Skip before importing triton: on a CPU machine the interpreter tests
    # (tests/unit/test_triton_interpret.py) need to be the first to import it.
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")

from dsaserve.kernels.cuda import indexer_logits as cuda_logits  # noqa: E402
from dsaserve.kernels.triton import (  # noqa: E402
    index_cache,
    indexer,
    mla_cache,
    mla_workspace,
    norm,
    rotary,
    row_topk,
    sparse_mla,
)
from dsaserve.kernels.triton.backend import TritonBackend  # noqa: E402

DEV = "cuda"
L, R, TOPK = 512, 64, 2048
SCALE = 192**-0.5 * 1.873854  # DeepSeek-V3.2's softmax scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _check_attention(o, lse, ref_o, ref_lse, idx) -> None:
    """Rows with no valid index (by design, or because the random holes took every index of a
    short row) must give o = 0 and lse = −inf; the others match the reference."""
    assert not bool(o.isnan().any()) and not bool(lse.isnan().any())
    empty_rows = (idx < 0).all(dim=1)
    live = ~empty_rows
    assert _rel(o[live], ref_o[live]) <= 1e-2
    err = (lse[live] - ref_lse[live]).abs() / ref_lse[live].abs().clamp_min(1.0)
    assert float(err.max()) <= 1e-2
    assert bool((o[empty_rows] == 0).all()) and bool((lse[empty_rows] == float("-inf")).all())


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_mla_writer_matches_formats(g, kind):
    num_blocks, block_size, n = 61, 64, 1777
    slots = torch.randperm(num_blocks * block_size, device=DEV, generator=g)[:n]
    slots[torch.rand(n, device=DEV, generator=g) < 0.1] = -1
    magnitude = torch.exp(torch.randn(n, 1, device=DEV, generator=g) * 3)
    c = (torch.randn(n, L, device=DEV, generator=g) * magnitude).bfloat16()
    k_pe = torch.randn(n, R, device=DEV, generator=g).bfloat16()
    fp8 = kind == "fp8"
    shape = formats.mla_cache_shape(num_blocks, block_size, fp8)
    if fp8:
        ours = torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV, generator=g)
    else:
        ours = torch.randn(shape, device=DEV, generator=g).bfloat16()
    ref = ours.clone()
    mla_cache.write_mla_cache(ours, slots, c, k_pe)
    formats.write_mla_cache(ref, slots, c, k_pe)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))


def test_index_writer_matches_formats(g):
    num_blocks, block_size, n, head_dim = 37, 64, 1500, 128
    slots = torch.randperm(num_blocks * block_size, device=DEV, generator=g)[:n]
    slots[torch.rand(n, device=DEV, generator=g) < 0.1] = -1
    k = (torch.randn(n, head_dim, device=DEV, generator=g)
         * torch.exp(torch.randn(n, 1, device=DEV, generator=g) * 3)).bfloat16()
    shape = formats.index_cache_shape(num_blocks, block_size, True, head_dim)
    ours = torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV, generator=g)
    ref = ours.clone()
    index_cache.write_index_cache(ours, slots, k)
    formats.write_index_cache(ref, slots, k)
    assert torch.equal(ours, ref)


# --------------------------------------------------------------------------------------------
# Sparse MLA
# --------------------------------------------------------------------------------------------
def _random_cache(g, num_slots: int, block_size: int, fp8: bool) -> torch.Tensor:
    num_blocks = -(-num_slots // block_size)
    shape = formats.mla_cache_shape(num_blocks, block_size, fp8)
    cache = torch.empty(shape, dtype=torch.uint8 if fp8 else torch.bfloat16, device=DEV)
    slots = torch.arange(num_blocks * block_size, device=DEV)
    c = torch.randn(len(slots), L, device=DEV, generator=g)
    k_pe = torch.randn(len(slots), R, device=DEV, generator=g)
    mla_cache.write_mla_cache(cache, slots, c.bfloat16(), k_pe.bfloat16())
    return cache


def _random_indices(g, num_tokens: int, contexts: torch.Tensor, num_slots: int,
                    slot_of=None) -> torch.Tensor:
    """[T, TOPK] int32: up to TOPK distinct positions < contexts[t] (rest −1), random holes."""
    keys = torch.rand(num_tokens, num_slots, device=DEV, generator=g)
    keys[torch.arange(num_slots, device=DEV)[None, :] >= contexts[:, None]] = -1.0
    pos = keys.topk(TOPK, dim=1).indices  # [T, TOPK]
    visible = torch.arange(TOPK, device=DEV)[None, :] < contexts[:, None]
    visible &= torch.rand(num_tokens, TOPK, device=DEV, generator=g) > 0.05
    slots = pos if slot_of is None else slot_of(pos)
    return torch.where(visible, slots, -1).int()


# The Triton kernel forced, and the automatic choice (the Gluon kernel on an H100 / H200).
MLA_KERNELS = {"triton": sparse_mla.SparseMlaConfig(gluon=False), "auto": None}


@pytest.mark.parametrize("kernel", list(MLA_KERNELS))
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_sparse_prefill_matches_reference(g, heads, kind, kernel):
    num_tokens, num_slots = 291, 6007
    cache = _random_cache(g, num_slots, 64 if kind == "fp8" else num_slots, kind == "fp8")
    contexts = torch.randint(1, num_slots, (num_tokens,), device=DEV, generator=g)
    contexts[:7] = torch.tensor([1, 5, 100, 2047, 2048, 2049, 0], device=DEV)
    idx = _random_indices(g, num_tokens, contexts, num_slots)  # row 6: no valid index
    q = torch.randn(num_tokens, heads, L + R, device=DEV, generator=g).bfloat16()
    o, lse = sparse_mla.sparse_mla_fwd(q, cache, idx, SCALE, L, config=MLA_KERNELS[kernel])
    ref_o, ref_lse = reference.sparse_mla_paged(q, cache, idx, SCALE, L, R)
    assert o.dtype == torch.bfloat16 and o.shape == (num_tokens, heads, L)
    assert bool((idx[6] < 0).all())
    _check_attention(o, lse, ref_o, ref_lse, idx)


@pytest.mark.parametrize("kernel", list(MLA_KERNELS))
@pytest.mark.parametrize("batch,s_q", [(32, 1), (7, 4), (130, 1)])
def test_fp8_decode_matches_reference(g, batch, s_q, kernel):
    """Paged decode (MTP verify rows share nothing but their request); small batches take the
    split path and its merge."""
    block_size, max_ctx, heads = 64, 5000, 64
    contexts = torch.randint(1, max_ctx, (batch,), device=DEV, generator=g)
    contexts[0] = 3  # fewer keys than TOPK
    blocks_per_req = -(-max_ctx // block_size)
    table = torch.randperm(batch * blocks_per_req, device=DEV, generator=g).view(batch, -1)
    cache = _random_cache(g, batch * blocks_per_req * block_size, block_size, True)
    rows = torch.arange(batch, device=DEV).repeat_interleave(s_q)  # [T] request of each row

    def slot_of(pos):  # request-local positions → physical slots
        return table[rows[:, None], pos // block_size] * block_size + pos % block_size

    idx = _random_indices(g, batch * s_q, contexts[rows], max_ctx, slot_of)
    q = torch.randn(batch * s_q, heads, L + R, device=DEV, generator=g).bfloat16()
    o, lse = sparse_mla.sparse_mla_fwd(q, cache, idx, SCALE, L, config=MLA_KERNELS[kernel])
    ref_o, ref_lse = reference.sparse_mla_paged(q, cache, idx, SCALE, L, R)
    _check_attention(o, lse, ref_o, ref_lse, idx)


def test_backend_tiny_heads(g):
    """The tiny preset's 4 heads (padded to a 16-row tile) through the registry interface."""
    cache = _random_cache(g, 4096, 64, True)
    contexts = torch.randint(1, 4096, (19,), device=DEV, generator=g)
    idx = _random_indices(g, 19, contexts, 4096)
    q = torch.randn(19, 4, L + R, device=DEV, generator=g).bfloat16()
    o, lse = TritonBackend().sparse_mla(q, cache, idx.long(), SCALE, L)
    ref_o, ref_lse = ReferenceBackend().sparse_mla(q, cache, idx, SCALE, L)
    assert o.dtype == ref_o.dtype == torch.bfloat16
    _check_attention(o, lse, ref_o.float(), ref_lse, idx)


@pytest.mark.parametrize("dcp", [(1, 0), (2, 1)], ids=["dcp1", "dcp2rank1"])
@pytest.mark.parametrize("block_size", [64, 1])  # 1: PCP's full copy of a context
@pytest.mark.parametrize("heads", [64, 128])
def test_backend_positions_workspace(g, heads, block_size, dcp):
    """A step of decode rows and a long prefill chunk over an fp8 cache: the chunk reads a bf16
    workspace of its pages (the ping-pong kernel), the decode rows the cache (the fp8 kernel);
    all against the reference over this rank's slots, the workspace's rows exact."""
    seq_lens, new = (3000, 4000, 1500, 2500), (1, 700, 0, 4)
    local = [layout.dcp_local_seq_len(s, *dcp, 1) for s in seq_lens]
    table = scattered_block_table([-(-n // block_size) for n in local], g, DEV)
    meta = AttentionMetadata.for_requests(seq_lens, new, table, block_size, dcp_size=dcp[0],
                                          dcp_rank=dcp[1])
    cache = _random_cache(g, (int(table.max()) + 1) * block_size, block_size, True)
    positions = _random_indices(g, meta.num_tokens, meta.positions + 1, max(seq_lens))
    q = torch.randn(meta.num_tokens, heads, L + R, device=DEV, generator=g).bfloat16()
    cfg = sparse_mla.SparseMlaConfig()
    segments = mla_workspace.plan_segments(meta.query_start_loc, meta.seq_lens, local,
                                           block_size, TOPK, cfg.workspace_min_reads,
                                           cfg.workspace_max_rows)
    assert [s.workspace for s in segments] == [False, True, False]
    ws, ws_table = mla_workspace.build_workspace(cache, table, segments[1], local, L)
    slots, _ = layout.context_slots(seq_lens[1], table[1], block_size, *dcp)
    want = formats.read_mla_cache(cache, slots.to(DEV), L, R)
    pages = -(-local[1] // block_size)  # request 1's pages are the workspace's first
    assert ws_table[1, :pages].tolist() == list(range(pages))
    assert torch.equal(ws.view(-1, L + R)[: local[1]].float(), want)
    o, lse = TritonBackend(cfg).sparse_mla_positions(q, cache, positions, meta, SCALE, L)
    ref_o, ref_lse = ReferenceBackend().sparse_mla_positions(q, cache, positions, meta, SCALE, L)
    owned = position_slots(positions, meta)  # −1 where another rank owns the key
    _check_attention(o, lse, ref_o.float(), ref_lse, owned)


# --------------------------------------------------------------------------------------------
# Indexer
# --------------------------------------------------------------------------------------------
def _indexer_case(g, heads: int, dcp: tuple[int, int] = (1, 0)):
    """A 300-token prefill chunk over a 4000-token context, and decode rows with s_q 1..4."""
    block_size, head_dim = 64, 128
    seq_lens = (4000, 2100, 77, 3001, 2500)
    new = (300, 1, 4, 2, 3)
    local = [layout.dcp_local_seq_len(s, dcp[0], dcp[1], 1) for s in seq_lens]
    need = [-(-n // block_size) for n in local]
    table = scattered_block_table(need, g, DEV)
    meta = AttentionMetadata.for_requests(seq_lens, new, table, block_size, dcp_size=dcp[0],
                                          dcp_rank=dcp[1])
    cache = torch.zeros(formats.index_cache_shape(sum(need), block_size, True, head_dim),
                        dtype=torch.uint8, device=DEV)
    for r, s in enumerate(seq_lens):
        slots, _ = layout.context_slots(s, table[r], block_size, *dcp)
        keys = torch.randn(len(slots), head_dim, device=DEV, generator=g).bfloat16()
        index_cache.write_index_cache(cache, slots, keys)
    q = torch.randn(meta.num_tokens, heads, head_dim, device=DEV, generator=g).bfloat16()
    w = torch.randn(meta.num_tokens, heads, device=DEV, generator=g) * heads**-0.5 * 128**-0.5
    return meta, cache, q, w


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("dcp", [(1, 0), (2, 1)], ids=["dcp1", "dcp2rank1"])
@pytest.mark.parametrize("path", ["torch_topk", "row_topk", "key_windows", "row_passes",
                                  "two_token_tiles"])
def test_indexer_logits_and_topk_match_reference(g, heads, dcp, path):
    meta, cache, q, w = _indexer_case(g, heads, dcp)
    # Rows up to 4000 keys: the default list (4096) sends them to torch.topk, a 2048 list
    # through row_topk; a logits budget of 1024 keys per row scores them in 4 windows, or
    # the rows in passes of about a quarter of them over every key.
    config = {"torch_topk": indexer.IndexerConfig(),
              "row_topk": indexer.IndexerConfig(list_len=TOPK),
              "key_windows": indexer.IndexerConfig(max_logits_bytes=4 * len(q) * 1024,
                                                   logits_split="keys"),
              "row_passes": indexer.IndexerConfig(max_logits_bytes=4 * len(q) * 1024),
              "two_token_tiles": indexer.IndexerConfig(rows_per_tile=128)}[path]
    logits, limits = indexer.indexer_logits_paged(q, w, cache, meta, config)
    scores, pos = indexer.indexer_topk(q, w, cache, meta, TOPK, config)
    ref_scores, ref_pos = ReferenceBackend().indexer_topk(q, w, cache, meta, TOPK)
    assert torch.equal(pos >= 0, ref_pos >= 0), "rows with keys differ"
    # The CUDA kernel's linear shapes differ from the ReLU form by up to LINEAR_REL_ERROR of
    # the same scores from |q|, |w| and |k| (indexer_logits.abs_inputs).
    shape = indexer._cuda_shape(q, cache, config, meta)
    linear = shape is not None and shape.linear
    q8, q_scale = formats.quantize_index_q(q)
    for r in range(meta.num_reqs):
        a, b = meta.query_range(r)
        slots, key_pos = layout.context_slots(meta.seq_lens[r], meta.block_table[r],
                                              meta.block_size, *dcp)
        k8, k_scale = formats.read_index_cache(cache, slots)
        ref = reference.indexer_logits_fp8(q8[a:b], q_scale[a:b], w[a:b], k8, k_scale)
        bound = reference.indexer_logits_fp8(q8[a:b].float().abs(), q_scale[a:b], w[a:b].abs(),
                                             k8.float().abs(), k_scale) if linear else None
        local_of = torch.full((meta.seq_lens[r],), -1, dtype=torch.long, device=DEV)
        local_of[key_pos] = torch.arange(len(key_pos), device=DEV)
        for t in range(a, b):
            n = int(limits[t])
            assert n == int((key_pos <= meta.positions[t]).sum())
            if bound is None:
                assert _rel(logits[t, :n], ref[t - a, :n]) <= 1e-3
            else:  # a row of few keys can score near 0 where the bound is not: per score
                err = (logits[t, :n] - ref[t - a, :n]).abs()
                slack = cuda_logits.LINEAR_REL_ERROR * bound[t - a, :n] + \
                    1e-3 * ref[t - a, :n].abs().max()
                assert bool((err <= slack).all()), f"logits, request {r}, token {t}, {n} keys"
            assert bool((logits[t, n:] == float("-inf")).all())
            chosen = pos[t][pos[t] >= 0].long()
            assert len(chosen) == min(n, TOPK) and len(chosen.unique()) == len(chosen)
            # Tie-tolerant set equality: the reference scores of our keys are its top-k scores.
            ours = ref[t - a, local_of[chosen]].sort().values
            theirs = ref_scores[t, : len(chosen)].sort().values
            tol = 1e-3 * float(ref[t - a, :n].abs().max())
            if bound is not None:  # twice a score's bound: keys picked by scores each within
                # e of the reference's are within 2e of its picks, rank by rank
                tol += 2 * cuda_logits.LINEAR_REL_ERROR * float(bound[t - a, :n].max())
            where = f"request {r}, token {t}, {n} keys, linear {linear}, tol {tol:.3g}"
            assert float((ours - theirs).abs().max()) <= tol, f"chosen set: {where}"
            ours_first = scores[t, : len(chosen)].sort(descending=True).values
            gap = ours_first - ref_scores[t, : len(chosen)]  # both best first
            assert float(gap.abs().max()) <= tol, f"scores, {float(gap.abs().max()):.3g}: {where}"


def test_row_topk_matches_torch_topk(g):
    """Long rows (up to 256K keys), every path of row_topk: short rows searched directly, group
    thresholds, coarsened groups, overflow (ascending rows fill whole groups; ties)."""
    seq = 262144
    lens = torch.tensor([0, 100, 2048, 16384, 16385, 40000, 131072, seq, seq, seq, seq],
                        device=DEV)
    logits = torch.randn(len(lens), seq, device=DEV, generator=g)
    logits[-3] = torch.arange(seq, device=DEV, dtype=torch.float32)  # clustered at the end
    logits[-2] = 0.25  # all tied
    logits[-1] = torch.randn(seq, device=DEV, generator=g).round()  # heavy ties at the k-th
    logits.masked_fill_(torch.arange(seq, device=DEV)[None, :] >= lens[:, None], float("-inf"))
    group_max = logits.view(len(lens), -1, row_topk.GROUP).amax(2)
    values, idx = row_topk.topk_rows(logits, group_max, lens, TOPK)
    ref = torch.topk(logits, TOPK, dim=1).values
    assert torch.equal(values.sort(dim=1, descending=True).values, ref)  # any order
    again = row_topk.topk_rows(logits, group_max, lens, TOPK)
    assert torch.equal(again[1].sort().values, idx.sort().values)  # the same keys every time
    for t in range(len(lens)):
        n = min(int(lens[t]), TOPK)
        assert bool((idx[t, n:] == -1).all()) and bool((idx[t, :n] < lens[t]).all())
        assert len(idx[t, :n].unique()) == n
        assert torch.equal(logits[t, idx[t, :n]], values[t, :n])


@pytest.mark.parametrize("rows,dim", [(16384, 6144), (3, 2048), (5, 512), (1, 100)])
def test_rms_norm_matches_pytorch(g, rows, dim):
    """norm.rms_norm (what the model's RMSNorm runs on a GPU) against the module's PyTorch
    arithmetic, bf16 rows and weight; rows strided as the kv latent's are (a slice of wider
    rows)."""
    x = torch.randn(rows, dim + 64, device=DEV, generator=g).bfloat16()[:, :dim]
    w = (torch.rand(dim, device=DEV, generator=g) + 0.5).bfloat16()
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    got = norm.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-6)


@pytest.mark.parametrize("rows,dim", [(16384, 6144), (3, 6144), (1, 100)])
def test_add_rms_norm_matches_pytorch(g, rows, dim):
    """norm.add_rms_norm (a decoder layer's residual add and the norm after it) against
    PyTorch's add, then the module's arithmetic: the sum bit for bit, bf16."""
    h = torch.randn(rows, dim, device=DEV, generator=g).bfloat16()
    d = torch.randn(rows, dim, device=DEV, generator=g).bfloat16()
    w = (torch.rand(dim, device=DEV, generator=g) + 0.5).bfloat16()
    total = h + d
    xf = total.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
    got, got_total = norm.add_rms_norm(h, d, w, 1e-6)
    assert torch.equal(got_total, total)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape,rope", [((16384, 64, 64), 64), ((3, 64), 64), ((5, 32, 128), 64)])
def test_rotary_matches_pytorch(g, interleaved, shape, rope):
    """rotary.rotate (what apply_rope and the indexer run on a GPU) against model/rope.py's
    PyTorch arithmetic (run on the CPU copies), bf16: MLA's q_pe (a slice of q's rows), k_pe,
    and the indexer's queries (the first 64 of 128 columns rotated, the rest copied)."""
    from dsaserve.model.rope import apply_rope

    x = torch.randn(*shape[:-1], shape[-1] + 128, device=DEV, generator=g).bfloat16()[..., 128:]
    angles = torch.rand(shape[0], rope // 2, device=DEV, generator=g) * 1e4
    cos, sin = angles.cos(), angles.sin()
    xc = x.cpu()
    want = torch.cat((apply_rope(xc[..., :rope], cos.cpu(), sin.cpu(), interleaved),
                      xc[..., rope:]), dim=-1)
    got = rotary.rotate(x, cos, sin, interleaved)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=2 ** -7, atol=1e-5)
