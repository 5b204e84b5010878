"""Attention under context parallelism (DESIGN.md §5–6): the flows that differ from a single rank.

Cache writes (PCP): every rank computes the new latent KV / RoPE key / indexer key rows of its own
tokens; the rows are all-gathered over the PCP group, restored to the global order and written by
their owners (every rank when DCP = 1, 1/N of them when DCP = N).

Attention under DCP = N (each rank stores 1/N of every request's tokens):

  * shared rows — identical on every rank of the group (every row without PCP; decode rows and
    short prefills with PCP): local indexer scores → local top-k (score, id) → all-gather → exact
    global top-k; attend over the owned part of it → (o, lse) partials merged by log-sum-exp
    (`ag_rs`: all-gather LSE + reduce-scatter heads; `a2a`: one all-to-all; with PCP every rank
    keeps all heads: all-gather LSE + all-reduce).
  * own rows — PCP-split prefill rows that only this rank computes: a temporary full copy of the
    request's context in the cache's own byte format (the part cached before the step prefetched
    one layer ahead, see ContextPrefetch; the step's new rows from the PCP gather), attended like
    a single rank, then freed.

Every shape entering a collective is derived from the global batch (same on every rank).
"""

from __future__ import annotations

import torch

from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.kernels.registry import AttentionBackend
from dsaserve.kv import layout
from dsaserve.parallel.dcp import lse_merge, merge_topk_candidates
from dsaserve.parallel.groups import Group, PendingGather


def gather_new_rows(rows: torch.Tensor, meta: AttentionMetadata, group: Group) -> torch.Tensor:
    """rows [n_local, ...] of this rank's tokens → [N_global, ...] in global order (PCP)."""
    assert meta.pcp is not None
    padded = rows.new_zeros((meta.pcp.padded_len, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = group.all_gather(padded).flatten(0, 1)  # [pcp·P, ...] rank-major
    return gathered[meta.pcp.restore_index]


# ---- temporary full copies of one request's context (own rows under PCP × DCP) -------------------
def _raw_rows(cache: torch.Tensor, slots: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """The bytes (or values) of each slot's row, as a [n, W] tensor in the cache's own format.

    A uint8 index cache stores a page of values then a page of scales; the row of one token is
    returned as [values (D) | scale (4)], which is the page format for a block of one token."""
    if cache.dim() == 3:  # [num_blocks, B, W]: one contiguous row per token
        return cache.view(-1, cache.shape[-1])[slots]
    assert head_dim is not None
    block_size = cache.shape[1] // (head_dim + 4)
    block, offset = slots // block_size, slots % block_size
    page = cache[block]  # [n, B·(D+4)]
    val_start = (offset * head_dim)[:, None] + torch.arange(head_dim, device=cache.device)
    sc_start = (block_size * head_dim + offset * 4)[:, None] + torch.arange(4, device=cache.device)
    return torch.cat((page.gather(1, val_start), page.gather(1, sc_start)), dim=1)


class ContextPrefetch:
    """The cached context of every PCP-split request, all-gathered one layer ahead.

    Under PCP × DCP a split request's rows need its whole context. The part cached before this
    step does not change during the step, so layer i+1's shards are gathered (asynchronously, on a
    communicator of their own) while layer i computes; the step's new rows come from the PCP
    gather of new KV that every layer does anyway. Only the temporary copies are full-size; the
    persistent cache stays divided by N.
    """

    def __init__(self, meta: AttentionMetadata, caches: list, group: Group,
                 index_head_dim: int) -> None:
        assert meta.pcp is not None
        self.meta, self.caches, self.group, self.head_dim = meta, caches, group, index_head_dim
        # Split requests with a cached part, and that part's length.
        self.requests = [(r, meta.seq_lens[r] - meta.pcp.query_lens[r])
                         for r in range(meta.num_reqs) if not meta.pcp.replicated[r]
                         and meta.seq_lens[r] > meta.pcp.query_lens[r]]
        self._pending: dict[tuple[int, int, str], tuple[int, PendingGather]] = {}

    def start(self, layer: int) -> None:
        """Launch layer `layer`'s gathers (every rank calls this at the same point)."""
        cache = self.caches[layer]
        for r, cached in self.requests:
            self._launch(layer, r, "kv", cache.kv, cached, None)
            if cache.index is not None:
                head_dim = self.head_dim if cache.index.dtype == torch.uint8 else None
                self._launch(layer, r, "index", cache.index, cached, head_dim)

    def _launch(self, layer, r, kind, cache, cached, head_dim) -> None:
        n, rank, inter = self.group.size, self.group.rank_in_group, self.meta.interleave
        slots, _ = layout.context_slots(cached, self.meta.block_table[r], self.meta.block_size,
                                        n, rank, inter)
        rows = _raw_rows(cache, slots.to(cache.device), head_dim)  # [local_len, W]
        max_len = layout.dcp_local_seq_len(cached, n, 0, inter)  # rank 0 holds the most
        padded = rows.new_zeros((max_len, rows.shape[1]))
        padded[: rows.shape[0]] = rows
        self._pending[(layer, r, kind)] = (cached, self.group.all_gather_async(padded))

    def take(self, layer: int, r: int, kind: str) -> torch.Tensor | None:
        """The request's cached rows [cached, W] in position order (None: nothing cached)."""
        item = self._pending.pop((layer, r, kind), None)
        if item is None:
            return None
        cached, pending = item
        gathered = pending.wait()  # [N, max_len, W]
        n, inter = self.group.size, self.meta.interleave
        full = gathered.new_empty((cached, gathered.shape[-1]))
        for q in range(n):
            length = layout.dcp_local_seq_len(cached, n, q, inter)
            pos = layout.dcp_global_position(torch.arange(length), n, q, inter)
            full[pos.to(full.device)] = gathered[q, :length]
        return full


def _full_copy(cache: torch.Tensor, seq_len: int, cached_rows: torch.Tensor | None
               ) -> torch.Tensor:
    """A temporary row cache [L, 1, W] of `seq_len` one-token blocks in `cache`'s format, the
    cached part filled."""
    full = cache.new_zeros((seq_len, 1, cache.shape[-1]))
    if cached_rows is not None:
        full[: cached_rows.shape[0], 0] = cached_rows
    return full


def _index_copy(cache: torch.Tensor, seq_len: int, cached_rows: torch.Tensor | None,
                head_dim: int) -> torch.Tensor:
    """The index-key counterpart of _full_copy: [L, 1, D] float, or [L, D+4] uint8 pages of one
    token ([values | scale], the page format for a block of one)."""
    if cache.dtype != torch.uint8:
        return _full_copy(cache, seq_len, cached_rows)
    full = cache.new_zeros((seq_len, head_dim + 4))
    if cached_rows is not None:
        full[: cached_rows.shape[0]] = cached_rows
    return full


def own_rows_attention(attn, q_idx, w_idx, q_full, prev_topk, meta: AttentionMetadata,
                       cache, backend: AttentionBackend, new_rows, cached: tuple
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for PCP-split rows of one request (meta holds just that request) over a
    temporary full copy of its context: the prefetched cached rows plus the step's new rows
    (`new_rows` = c [q, L], k_pe [q, R], index keys [q, D] or None, in position order), written
    in the cache's own format, then attended exactly as a single rank would."""
    seq_len = meta.seq_lens[0]
    c, k_pe, idx_k = new_rows
    if seq_len > c.shape[0] and cached[0] is None:
        raise RuntimeError("PCP × DCP: a split request's cached context was not prefetched")
    new_slots = torch.arange(seq_len - c.shape[0], seq_len, device=c.device)
    kv_full = _full_copy(cache.kv, seq_len, cached[0])
    backend.write_kv(kv_full, new_slots, c, k_pe)
    full_meta = AttentionMetadata(
        positions=meta.positions, req_indices=torch.zeros_like(meta.req_indices),
        slot_mapping=meta.slot_mapping,
        block_table=torch.arange(seq_len, dtype=torch.int32, device=meta.positions.device)[None],
        query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens, block_size=1,
        use_dense=False,
    )
    topk = prev_topk
    if attn.indexer is not None:
        index_full = _index_copy(cache.index, seq_len, cached[1], attn.indexer.head_dim)
        backend.write_index_k(index_full, new_slots, idx_k)
        _, topk = backend.indexer_topk(q_idx, w_idx, index_full, full_meta, attn.cfg.index_topk)
    # The copy's positions are its slots; a backend may still read them another way (the
    # triton backend: a long chunk from bf16 rows dequantized once).
    o, _ = backend.sparse_mla_positions(q_full, kv_full, topk, full_meta, attn.scale,
                                        attn.kv_lora_rank)
    return o, topk


# ---- shared rows: distributed top-k and LSE merge ------------------------------------------------
def distributed_topk(q_idx, w_idx, cache, meta: AttentionMetadata, backend: AttentionBackend,
                     group: Group, topk: int) -> torch.Tensor:
    """Local top-k over this rank's keys → all-gather (score, id) → exact global top-k [T, k]."""
    scores, ids = backend.indexer_topk(q_idx, w_idx, cache.index, meta, topk)
    all_scores = group.all_gather(scores.float())  # [N, T, k]
    all_ids = group.all_gather(ids.to(torch.int64))
    return merge_topk_candidates(all_scores, all_ids, topk)


def merged_sparse_attention(q_full, topk, meta: AttentionMetadata, cache, backend, scale: float,
                            kv_lora_rank: int, group: Group, comm_backend: str,
                            heads_split: bool) -> torch.Tensor:
    """Attend over the owned part of the global top-k and merge the partials over the group.

    q_full [T, H_all, L+R] holds every head (gathered over the group first when `heads_split`,
    i.e. DCP over TP ranks); returns o [T, H_out, L]: this rank's heads when `heads_split`, else
    all heads."""
    # Over this rank's keys only (another rank's count as skipped), merged below.
    o, lse = backend.sparse_mla_positions(q_full, cache.kv, topk, meta, scale, kv_lora_rank)
    n = group.size
    t, h = lse.shape
    if comm_backend == "a2a" and heads_split:
        hl = h // n
        packed = torch.cat((o.float(), lse[..., None]), dim=-1)  # [T, H, L+1]
        packed = packed.view(t, n, hl, -1).transpose(0, 1).contiguous()  # [N, T, Hl, L+1]
        recv = group.all_to_all(packed)  # [N (source), T, Hl, L+1]
        merged, _ = lse_merge(recv[..., :-1], recv[..., -1])
        return merged.to(q_full.dtype)
    # All-gather the LSEs (small), rescale the local partial by exp(lse_local − lse_global), then
    # sum: reduce-scatter over heads (`ag_rs`), or all-reduce when every rank keeps every head
    # (PCP × DCP, vLLM's `ag_ar`).
    all_lse = group.all_gather(lse)  # [N, T, H]
    _, global_lse = lse_merge(torch.zeros(n, t, h, 1, device=lse.device), all_lse)
    weight = torch.exp(lse - global_lse)
    weight = torch.where(torch.isfinite(lse) & torch.isfinite(global_lse), weight, 0.0)
    scaled = o.float() * weight[..., None]  # [T, H, L]
    if not heads_split:
        return group.all_reduce(scaled).to(q_full.dtype)
    hl = h // n
    scaled = scaled.view(t, n, hl, -1).transpose(0, 1)  # [N, T, Hl, L]
    return group.reduce_scatter(scaled.reshape(n * t, hl, -1)).to(q_full.dtype)
