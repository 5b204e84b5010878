"""The "triton" attention backend: Triton kernels on CUDA tensors, the reference on the CPU.

Decode and prefill rows go through the same sparse MLA kernel: rows are independent given their
slot indices, and the kernel splits each index row across programs when the batch alone cannot
fill the GPU (decode), merging the partial (o, lse) itself. Callers need no per-request s_q.
"""

from __future__ import annotations

import logging

import torch

from dsaserve.kernels.cuda import build as cuda_build
from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.kernels.registry import HotRows, ReferenceBackend, use_kernels, with_hot
from dsaserve.kernels.triton import indexer, mla_cache, mla_workspace, slots, sparse_mla
from dsaserve.kernels.triton.index_cache import write_index_cache
from dsaserve.kv import layout

logger = logging.getLogger(__name__)


class TritonBackend:
    """Same operations and byte formats as ReferenceBackend; agrees with it within the stated
    tolerances (bf16 operands ≤ 1e-2 relative; fp8 caches against the dequantized reference)."""

    name = "triton"
    # Every decode-path kernel takes its sizes from shapes and the step's host metadata (at
    # the bound under a graph), none from device values: a decode step can be captured.
    capturable = True

    def __init__(self, mla_config: sparse_mla.SparseMlaConfig | None = None,
                 indexer_config: indexer.IndexerConfig | None = None) -> None:
        self.mla_config = mla_config
        self.indexer_config = indexer_config or indexer.IndexerConfig()
        self._reference = ReferenceBackend()

    def prepare(self, device: torch.device) -> None:
        """On a GPU, build the CUDA extension (the top-k and the prefill indexer logits) now,
        about a minute once, then cached under TORCH_EXTENSIONS_DIR, not in the first
        request's indexer; where it cannot build, the indexer keeps its Triton kernels and the
        log says why. (The Triton kernels still compile at their first launch.)"""
        if device.type != "cuda":
            return
        reason = cuda_build.build()
        if reason is None:
            logger.info("CUDA kernels ready (top-k, indexer logits)")
        else:
            logger.info("CUDA kernels unavailable (%s): the indexer uses its Triton kernels",
                        reason)

    def write_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, c: torch.Tensor,
                 k_pe: torch.Tensor) -> None:
        """c [N, L], k_pe [N, R] → rows at slots [N] (−1 skip); fp8_ds_mla or float cache."""
        if not use_kernels(kv_cache):
            self._reference.write_kv(kv_cache, slots, c, k_pe)
            return
        mla_cache.write_mla_cache(kv_cache, slots, c, k_pe)

    def write_index_k(self, index_cache: torch.Tensor, slots: torch.Tensor,
                      k: torch.Tensor) -> None:
        """k [N, D] → indexer cache rows at slots [N] (−1 skip); FP8 pages or float rows."""
        if not use_kernels(index_cache):
            self._reference.write_index_k(index_cache, slots, k)
            return
        write_index_cache(index_cache, slots, k)

    def sparse_mla(self, q: torch.Tensor, kv_cache: torch.Tensor, slot_indices: torch.Tensor,
                   scale: float, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, L+R], slot_indices [T, K] (−1 skip) → o [T, H, L] (q's dtype), lse [T, H]."""
        if not use_kernels(q):
            return self._reference.sparse_mla(q, kv_cache, slot_indices, scale, kv_lora_rank)
        if slot_indices.dtype != torch.int32:
            slot_indices = slot_indices.to(torch.int32)
        return sparse_mla.sparse_mla_fwd(q, kv_cache, slot_indices, scale, kv_lora_rank,
                                         self.mla_config)

    def sparse_mla_positions(self, q: torch.Tensor, kv_cache: torch.Tensor,
                             positions: torch.Tensor, meta: AttentionMetadata, scale: float,
                             kv_lora_rank: int, hot: HotRows | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T, K] request-local (−1 skip) of meta's rows → o [T, H, L], lse [T, H].
        Over an fp8_ds_mla cache, requests whose rows read their context many times over
        (long prefill chunks; mla_workspace.plan_segments) read a bf16 copy of their pages,
        the others the cache through their slots. `hot` rows (decode rows: never a workspace
        segment's, which reads its context many times over) are read from their cache in the
        call over their segment's rows."""
        cfg = self.mla_config or sparse_mla.SparseMlaConfig()
        if not use_kernels(q):
            return self._reference.sparse_mla_positions(q, kv_cache, positions, meta, scale,
                                                        kv_lora_rank, hot)
        dcp = (meta.dcp_size, meta.dcp_rank, meta.interleave)
        # Bounded seq_lens (a captured decode step) say nothing about which pages hold rows:
        # no workspace, whose pages would be read up to them.
        if (kv_cache.dtype != torch.uint8 or meta.pcp is not None or meta.bounded_seq_lens
                or not 0 < meta.num_tokens == q.shape[0]):
            found = _step_slots(positions, meta, None, meta.block_table, dcp)
            return self._cache_rows(q, kv_cache, found, scale, kv_lora_rank, hot, None)
        outs = []
        for seg, ws_pages, ws_table in _workspace_plan(meta, positions.shape[1], cfg):
            first, end = seg.rows
            whole = (first, end) == (0, q.shape[0])  # (no slicing ops for one segment)
            q_seg = q if whole else q[first:end]
            table = ws_table if seg.workspace else meta.block_table
            idx = _step_slots(positions, meta, seg.rows, table, dcp)
            if seg.workspace:
                ws = mla_workspace.dequantize_pages(kv_cache, ws_pages, kv_lora_rank)
                ws = ws.view(ws_pages.numel(), kv_cache.shape[1], ws.shape[1])
                outs.append(sparse_mla.sparse_mla_fwd(q_seg, ws, idx, scale, kv_lora_rank,
                                                      cfg))
            else:
                outs.append(self._cache_rows(q_seg, kv_cache, idx, scale, kv_lora_rank, hot,
                                             None if whole else seg.rows))
        if len(outs) == 1:
            return outs[0]
        # The segments cover the rows in order (rows are flattened request by request).
        return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])

    def _cache_rows(self, q: torch.Tensor, kv_cache: torch.Tensor, idx: torch.Tensor,
                    scale: float, kv_lora_rank: int, hot: HotRows | None,
                    span: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """sparse_mla of q [n, H, L+R] over the cache at idx [n, K], q being the step's rows
        `span` = [first, end) (None: all); with `hot`, those of them that read the hot cache
        from a second call over the same n rows."""
        o, lse = self.sparse_mla(q, kv_cache, idx, scale, kv_lora_rank)
        if hot is None:
            return o, lse
        first, end = span or (0, q.shape[0])
        hot_o, hot_lse = self.sparse_mla(q, hot.kv, hot.slots[first:end], scale, kv_lora_rank)
        return with_hot(o, lse, hot_o, hot_lse, hot.rows[first:end])

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                     meta: AttentionMetadata, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hi, D], weights [T, Hi] (scales folded in) → (scores [T, topk] fp32, positions
        [T, topk] int32) of the best keys this rank stores, in any order, (−inf, −1) padded."""
        if not use_kernels(q):
            return self._reference.indexer_topk(q, weights, index_cache, meta, topk)
        return indexer.indexer_topk(q, weights, index_cache, meta, topk, self.indexer_config)


def _workspace_plan(meta: AttentionMetadata, topk: int, cfg: sparse_mla.SparseMlaConfig
                    ) -> list[tuple[mla_workspace.Segment, torch.Tensor | None,
                                    torch.Tensor | None]]:
    """The step's segments (mla_workspace.plan_segments), each with its workspace's cache pages
    [P] and block table (None where it reads the cache): the same for every layer of the step,
    so made once and kept on the metadata (host work and small copies)."""
    key = ("mla_workspace", topk, cfg.workspace_min_reads, cfg.workspace_max_rows)
    plan = meta.derived.get(key)
    if plan is None:
        dcp = (meta.dcp_size, meta.dcp_rank, meta.interleave)
        local_lens = [layout.dcp_local_seq_len(n, *dcp) for n in meta.seq_lens]
        segments = mla_workspace.plan_segments(
            meta.query_start_loc, meta.seq_lens, local_lens, meta.block_size, topk,
            cfg.workspace_min_reads, cfg.workspace_max_rows)
        plan = [(seg, *(mla_workspace.workspace_pages(meta.block_table, seg, local_lens,
                                                      meta.block_size)
                        if seg.workspace else (None, None))) for seg in segments]
        meta.derived[key] = plan
    return plan


def _step_slots(positions: torch.Tensor, meta: AttentionMetadata,
                rows: tuple[int, int] | None, block_table: torch.Tensor,
                dcp: tuple[int, int, int]) -> torch.Tensor:
    """slots.position_slots of `rows` of positions [T, K] (None: all) through block_table.
    IndexShare's shared layers attend over the very top-k tensor of the layer before them, and
    the block tables are the step's: their slots are that layer's, kept on the metadata with
    the tensor they came from (a new top-k, the next step's or a full layer's, is another
    object). Under a CUDA graph the reuse is captured as it runs: the shared layer reads the
    slots the full layer's launch writes at every replay."""
    key = ("mla_slots", rows, block_table.data_ptr())
    kept = meta.derived.get(key)
    if kept is not None and kept[0] is positions:
        return kept[1]
    first, end = rows if rows is not None else (0, positions.shape[0])
    whole = (first, end) == (0, positions.shape[0])
    found = slots.position_slots(positions if whole else positions[first:end],
                                 meta.req_indices if whole else meta.req_indices[first:end],
                                 block_table, meta.block_size, *dcp)
    meta.derived[key] = (positions, found)
    return found
