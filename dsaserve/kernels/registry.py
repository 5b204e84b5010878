"""Attention backends, chosen by name: the hot path never branches on which one is in use.

A backend implements the four per-layer operations the model needs from the paged caches. The
"reference" backend is plain PyTorch (CPU and GPU); faster ones (the "triton" backend) register
under their own name and must agree with it within stated tolerances.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from dsaserve.kernels import formats, reference
from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.kv import layout


def use_kernels(t: torch.Tensor) -> bool:
    """Whether work on t runs the GPU kernels (kernels/triton): on CUDA tensors, and on CPU
    tensors under TRITON_INTERPRET=1 (tests, and engine/host_ops.gpu_branches)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class HotRows:
    """Rows of a step that read another paged cache than the layer's (HiSparse's hot buffer,
    kv/hisparse/): row t with rows[t] reads kv at slots[t] instead of the layer's cache at its
    positions. A backend reads them in the very calls it makes for the step's other rows (same
    rows per call, same shapes): a kernel's grid and splits follow a call's row count, so a
    row's rounding must not depend on which of the step's rows read the hot buffer."""

    kv: torch.Tensor  # [P, B, row] a paged cache in the layer cache's format
    slots: torch.Tensor  # [T, K] flat rows of kv (−1 skip)
    rows: torch.Tensor  # [T] bool: the row reads kv at its slots


def with_hot(o: torch.Tensor, lse: torch.Tensor, hot_o: torch.Tensor, hot_lse: torch.Tensor,
             rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, H, L], lse [T, H]) with the rows marked in rows [T] taken from the hot call's."""
    return torch.where(rows[:, None, None], hot_o, o), torch.where(rows[:, None], hot_lse, lse)


class AttentionBackend(Protocol):
    name: str
    # Whether a decode step through it can be captured in a CUDA graph (no host reads of
    # device data, grids sized from host metadata only; engine/decode_graph.py).
    capturable: bool

    def prepare(self, device: torch.device) -> None:
        """Build ahead of serving on device what the backend would otherwise compile during the
        first step (the engine calls it once per rank, before building the model)."""

    def write_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, c: torch.Tensor,
                 k_pe: torch.Tensor) -> None:
        """Store latent c [N, L] and RoPE key k_pe [N, R] at slots [N] (−1: skip)."""

    def write_index_k(self, index_cache: torch.Tensor, slots: torch.Tensor,
                      k: torch.Tensor) -> None:
        """Store indexer keys k [N, D] at slots [N] (−1: skip)."""

    def sparse_mla(self, q: torch.Tensor, kv_cache: torch.Tensor, slot_indices: torch.Tensor,
                   scale: float, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, L+R], slot_indices [T, K] (−1 skip) → o [T, H, L] (q's dtype), lse [T, H]."""

    def sparse_mla_positions(self, q: torch.Tensor, kv_cache: torch.Tensor,
                             positions: torch.Tensor, meta: AttentionMetadata, scale: float,
                             kv_lora_rank: int, hot: HotRows | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """sparse_mla over the rows of meta's step, selected as request-local token positions
        [T, K] (−1 skip; what indexer_topk returns), this rank's own slots found through
        meta's block table. Same result as sparse_mla on layout.logical_to_slots of them; a
        backend may read the rows another way (the triton backend: long prefill chunks from a
        bf16 copy of their requests' pages). `hot`: rows that read another cache instead
        (decode rows only: one row or a few per request)."""

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                     meta: AttentionMetadata, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hi, D], weights [T, Hi] (all scales folded in) → (scores [T, topk] fp32,
        positions [T, topk] int32): the best keys *this rank stores* that each query may see, as
        request-local token positions, the chosen keys first in any order (the reference: best
        first), padded with (−inf, −1). Without DCP that is the answer; under DCP the callers
        merge every rank's candidates."""


def position_slots(positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """positions [T, K] request-local (−1 pad) of meta's rows → [T, K] this rank's slots."""
    return layout.logical_to_slots(positions, meta.req_indices, meta.block_table,
                                   meta.block_size, meta.dcp_size, meta.dcp_rank,
                                   meta.interleave)


class ReferenceBackend:
    """Plain PyTorch over the byte formats of kernels/formats.py; the oracle for the others."""

    name = "reference"
    # It loops over requests on the host and reads a request's context length from the device
    # when the metadata gives only a bound: decode steps run eager through it.
    capturable = False

    def __init__(self) -> None:
        self.indexer_rows_scored = 0  # query rows this rank ran the indexer for (tests, metrics)

    def prepare(self, device):
        pass  # nothing is compiled

    def write_kv(self, kv_cache, slots, c, k_pe):
        formats.write_mla_cache(kv_cache, slots, c, k_pe)

    def write_index_k(self, index_cache, slots, k):
        formats.write_index_cache(index_cache, slots, k)

    def sparse_mla(self, q, kv_cache, slot_indices, scale, kv_lora_rank):
        rope_dim = q.shape[-1] - kv_lora_rank
        o, lse = reference.sparse_mla_paged(
            q, kv_cache, slot_indices, scale, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim
        )
        return o.to(q.dtype), lse

    def sparse_mla_positions(self, q, kv_cache, positions, meta, scale, kv_lora_rank,
                             hot=None):
        o, lse = self.sparse_mla(q, kv_cache, position_slots(positions, meta), scale,
                                 kv_lora_rank)
        if hot is None:
            return o, lse
        return with_hot(o, lse, *self.sparse_mla(q, hot.kv, hot.slots, scale, kv_lora_rank),
                        hot.rows)

    def indexer_topk(self, q, weights, index_cache, meta, topk):
        scores = torch.full((q.shape[0], topk), float("-inf"), device=q.device)
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
        head_dim = q.shape[-1]
        for r in range(meta.num_reqs):
            start, end = meta.query_range(r)
            if start == end:
                continue
            self.indexer_rows_scored += end - start
            # This rank's keys of the request, in position order (all of them without DCP);
            # with bounded seq_lens, those up to its last row (later pages may be unallocated)
            seq_len = meta.seq_lens[r]
            if meta.bounded_seq_lens:
                seq_len = int(meta.positions[start:end].max()) + 1
            key_slots, key_pos = layout.context_slots(
                seq_len, meta.block_table[r], meta.block_size,
                meta.dcp_size, meta.dcp_rank, meta.interleave,
            )
            if key_pos.numel() == 0:  # this DCP rank stores none of the request's tokens yet
                continue
            key_slots, key_pos = key_slots.to(index_cache.device), key_pos.to(q.device)
            keys, key_scales = formats.read_index_cache(index_cache, key_slots, head_dim=head_dim)
            if key_scales is None:
                logits = reference.indexer_logits(q[start:end].float(), weights[start:end], keys)
            else:
                q8, q_scale = formats.quantize_index_q(q[start:end])
                logits = reference.indexer_logits_fp8(q8, q_scale, weights[start:end], keys,
                                                      key_scales)
            # Key j is eligible for query t iff its position is ≤ t's position.
            limits = torch.searchsorted(key_pos, meta.positions[start:end], right=True)
            local = reference.topk_causal(logits, limits, topk)  # [n, topk] indices into keys
            found = local >= 0
            safe = local.clamp(min=0).long()
            scores[start:end] = torch.where(found, logits.gather(1, safe), float("-inf"))
            out[start:end] = torch.where(found, key_pos[safe], -1).to(torch.int32)
        return scores, out


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {"reference": ReferenceBackend}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _REGISTRY[name] = factory


def _load_triton() -> AttentionBackend:
    from dsaserve.kernels.triton.backend import TritonBackend  # imports triton: GPU machines only

    return TritonBackend()


register_backend("triton", _load_triton)


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        known = available_backends()
        raise ValueError(f"--attention-backend: unknown backend {name!r}; known: {known}")
    return _REGISTRY[name]()
