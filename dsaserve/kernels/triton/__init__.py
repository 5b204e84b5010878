"""Triton kernels for the "triton" attention backend (GPU; CPU tests run them interpreted).

    mla_cache.py         fp8_ds_mla / float MLA cache writer (exact e4m3 rounding helpers)
    index_cache.py       FP8 / float indexer key writer
    sparse_mla.py        sparse MLA (MQA form) over a paged cache: prefill and decode, o + lse
    sparse_mla_gluon.py  the same in Gluon, warp-specialized, for sm_90 (chosen there)
    mla_work.py          its grid: whole rows back to back per CTA, or a split of a row each
    sparse_mla_pingpong.py  the same with FlashMLA's ping-pong schedule (bf16 rows; fp8 opt-in)
    l2_hint.py           PTX rewrite: cp.async with an L2 evict_last policy (opt-in)
    indexer.py           paged FP8 indexer logits with group maxima, causal top-k
    indexer_gluon.py     the logits in Gluon for sm_90 (chosen for decode tiles)
    row_topk.py          exact top-k of long rows (threshold, compaction, selection)
    backend.py           TritonBackend: the methods the registry expects, reference fallback
    norm.py              RMSNorm in one pass (the model's norms on a GPU)
    rotary.py            rotary embedding in one pass (the model's rotations on a GPU)
    fp8_linear.py        weight-only FP8 GEMMs: dense (split K for decode), dequant; the grouped
                         MoE GEMM (FP8 or bf16 experts, silu(gate) · up optionally fused)

Importing this package needs `triton`; nothing here is imported by the engine unless the
"triton" backend is chosen.
"""
