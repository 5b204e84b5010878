"""The HiSparse attention backend: wraps the configured one (reference or triton) and routes the
rows of requests read through hot buffers (kv/hisparse/runtime.py) to them; every other call and
every other row goes to the wrapped backend unchanged. Chosen once at start-up, so the model's
hot path never asks whether HiSparse is on."""

from __future__ import annotations

from dsaserve.kernels.registry import AttentionBackend, HotRows
from dsaserve.kv.hisparse.runtime import HiSparseRuntime


class HiSparseBackend:
    """A layer's step (invalidate, resolve_tables, fetch_misses) has no host sync and no host
    state (the LRU stamp is a device tensor), and a padded decode step's description lives in static
    buffers (kv/hisparse/padded.py): it captures into a CUDA graph wherever the wrapped backend
    does."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.capturable = inner.capturable
        self.runtime: HiSparseRuntime | None = None  # set once the caches exist

    def __getattr__(self, name: str):  # counters and helpers of the wrapped backend
        if name == "inner":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def prepare(self, device):
        self.inner.prepare(device)

    def write_kv(self, kv_cache, slots, c, k_pe):
        self.inner.write_kv(kv_cache, slots, c, k_pe)

    def write_index_k(self, index_cache, slots, k):
        self.inner.write_index_k(index_cache, slots, k)

    def sparse_mla(self, q, kv_cache, slot_indices, scale, kv_lora_rank):
        return self.inner.sparse_mla(q, kv_cache, slot_indices, scale, kv_lora_rank)

    def indexer_topk(self, q, weights, index_cache, meta, topk):
        return self.inner.indexer_topk(q, weights, index_cache, meta, topk)

    def sparse_mla_positions(self, q, kv_cache, positions, meta, scale, kv_lora_rank,
                             hot=None):
        step, rt = meta.hisparse, self.runtime
        assert hot is None, "HiSparse routes its own rows"
        if step is None or rt is None:
            return self.inner.sparse_mla_positions(q, kv_cache, positions, meta, scale,
                                                   kv_lora_rank)
        # 1. hot copies of rows this forward rewrote are stale
        layer = rt.layer_of(kv_cache)
        rt.invalidate(layer, step)
        if not step.num_hot:
            return self.inner.sparse_mla_positions(q, kv_cache, positions, meta, scale,
                                                   kv_lora_rank)
        # 2. residency: hits, misses fetched, each selected row's hot slot
        rows = rt.resolve(layer, positions, meta, step)  # [T, K] flat hot rows
        # 3. sparse MLA over the hot buffer (the same kernel: it is laid out as a paged cache).
        #    Every row decodes: the call over all rows is the one the wrapped backend makes
        #    for a batch of decode rows (one call, no workspace), so the rows round as they
        #    would in the all-GPU engine.
        if step.num_hot == step.num_reqs and not step.padded:
            return self.inner.sparse_mla(q, rt.hot[layer], rows, scale, kv_lora_rank)
        # 4. a mixed batch (a padded step's always): the other requests read their GPU pages,
        #    and the hot rows are read in the wrapped backend's calls over the same rows
        return self.inner.sparse_mla_positions(q, kv_cache, positions, meta, scale,
                                               kv_lora_rank, HotRows(rt.hot[layer], rows,
                                                                     step.row_hot))
