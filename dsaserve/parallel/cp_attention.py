"""Attention under context parallelism (DESIGN.md §5–6): the flows that differ from a single rank.

Cache writes (PCP): every rank computes the new latent KV / RoPE key / indexer key rows of its own
tokens; the rows are all-gathered over the PCP group, restored to the global order and written by
their owners (every rank when DCP = 1, 1/N of them when DCP = N).

Attention under DCP = N (each rank stores 1/N of every request's tokens):

  * shared rows — identical on every rank of the group (every row without PCP; decode rows and
    short prefills with PCP): local indexer scores → local top-k (score, id) → all-gather → exact
    global top-k; attend over the owned part of it → (o, lse) partials merged by log-sum-exp
    (`ag_rs`: all-gather LSE + reduce-scatter heads; `a2a`: one all-to-all; with PCP every rank
    keeps all heads, so the partials are all-gathered and merged).
  * own rows — PCP-split prefill rows that only this rank computes: the request's context shards
    are all-gathered into a temporary full copy (in the cache's own byte format), attended like a
    single rank, then freed.

Every shape entering a collective is derived from the global batch (same on every rank).
"""

from __future__ import annotations

import torch

from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.kernels.registry import AttentionBackend
from dsaserve.kv import layout
from dsaserve.parallel.dcp import lse_merge, merge_topk_candidates
from dsaserve.parallel.groups import Group


def gather_new_rows(rows: torch.Tensor, meta: AttentionMetadata, group: Group) -> torch.Tensor:
    """rows [n_local, ...] of this rank's tokens → [N_global, ...] in global order (PCP)."""
    assert meta.pcp is not None
    padded = rows.new_zeros((meta.pcp.padded_len, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = group.all_gather(padded).flatten(0, 1)  # [pcp·P, ...] rank-major
    return gathered[meta.pcp.restore_index]


# ---- temporary full copies of one request's context (own rows under PCP × DCP)
# ---------------------
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


def gather_context(cache: torch.Tensor, seq_len: int, block_row: torch.Tensor,
                   meta: AttentionMetadata, group: Group, head_dim: int | None = None
                   ) -> torch.Tensor:
    """All-gather a request's KV shards → a cache of `seq_len` blocks of one token each, in global
    position order ([L, 1, W] for row caches, [L, D+4] for a uint8 index cache)."""
    n, rank, inter = group.size, group.rank_in_group, meta.interleave
    slots, _ = layout.context_slots(seq_len, block_row, meta.block_size, n, rank, inter)
    rows = _raw_rows(cache, slots.to(cache.device), head_dim)  # [local_len, W]
    max_len = layout.dcp_local_seq_len(seq_len, n, 0, inter)  # rank 0 holds the most
    padded = rows.new_zeros((max_len, rows.shape[1]))
    padded[: rows.shape[0]] = rows
    gathered = group.all_gather(padded)  # [N, max_len, W]
    full = rows.new_empty((seq_len, rows.shape[1]))
    for q in range(n):
        length = layout.dcp_local_seq_len(seq_len, n, q, inter)
        pos = layout.dcp_global_position(torch.arange(length), n, q, inter).to(cache.device)
        full[pos] = gathered[q, :length]
    return full.view(seq_len, 1, -1) if cache.dim() == 3 else full


def own_rows_attention(attn, q_idx, w_idx, q_full, prev_topk, meta: AttentionMetadata,
                       cache, backend: AttentionBackend, group: Group
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for PCP-split rows of one request (meta holds just that request): build the
    temporary full copy and attend exactly as a single rank would."""
    seq_len = meta.seq_lens[0]
    kv_full = gather_context(cache.kv, seq_len, meta.block_table[0], meta, group)
    full_meta = AttentionMetadata(
        positions=meta.positions, req_indices=torch.zeros_like(meta.req_indices),
        slot_mapping=meta.slot_mapping,
        block_table=torch.arange(seq_len, dtype=torch.int32, device=meta.positions.device)[None],
        query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens, block_size=1,
        use_dense=False,
    )
    topk = prev_topk
    if attn.indexer is not None:
        head_dim = attn.indexer.head_dim if cache.index.dtype == torch.uint8 else None
        index_full = gather_context(cache.index, seq_len, meta.block_table[0], meta, group,
                                    head_dim)
        _, topk = backend.indexer_topk(q_idx, w_idx, index_full, full_meta, attn.cfg.index_topk)
    slot_indices = layout.logical_to_slots(topk, full_meta.req_indices, full_meta.block_table, 1)
    o, _ = backend.sparse_mla(q_full, kv_full, slot_indices, attn.scale, attn.kv_lora_rank)
    return o, topk


# ---- shared rows: distributed top-k and LSE merge
# ----------------------------------------------------
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
    slot_indices = layout.logical_to_slots(topk, meta.req_indices, meta.block_table,
                                           meta.block_size, meta.dcp_size, meta.dcp_rank,
                                           meta.interleave)  # −1 where another rank owns the key
    o, lse = backend.sparse_mla(q_full, cache.kv, slot_indices, scale, kv_lora_rank)
    n = group.size
    t, h = lse.shape
    if not heads_split:  # PCP × DCP: every rank keeps all heads
        merged, _ = lse_merge(group.all_gather(o.float()), group.all_gather(lse))
        return merged.to(q_full.dtype)
    hl = h // n
    if comm_backend == "a2a":
        packed = torch.cat((o.float(), lse[..., None]), dim=-1)  # [T, H, L+1]
        packed = packed.view(t, n, hl, -1).transpose(0, 1).contiguous()  # [N, T, Hl, L+1]
        recv = group.all_to_all(packed)  # [N (source), T, Hl, L+1]
        merged, _ = lse_merge(recv[..., :-1], recv[..., -1])
        return merged.to(q_full.dtype)
    # ag_rs: all-gather the LSEs, rescale the local partial, reduce-scatter over heads.
    all_lse = group.all_gather(lse)  # [N, T, H]
    _, global_lse = lse_merge(torch.zeros(n, t, h, 1, device=lse.device), all_lse)
    weight = torch.exp(lse - global_lse)
    weight = torch.where(torch.isfinite(lse) & torch.isfinite(global_lse), weight, 0.0)
    scaled = (o.float() * weight[..., None]).view(t, n, hl, -1).transpose(0, 1)  # [N, T, Hl, L]
    return group.reduce_scatter(scaled.reshape(n * t, hl, -1)).to(q_full.dtype)
