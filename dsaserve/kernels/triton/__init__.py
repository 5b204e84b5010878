"""Triton kernels for the "triton" attention backend (GPU; CPU tests run them interpreted).

    mla_cache.py   fp8_ds_mla / float MLA cache writer
    sparse_mla.py  sparse MLA (MQA form) over a paged cache: prefill and decode, o + lse
    indexer.py     FP8 indexer-key writer, FP8 indexer logits, causal top-k
    backend.py     TritonBackend: the methods the registry expects, reference fallback on CPU

Importing this package needs `triton`; nothing here is imported by the engine unless the
"triton" backend is chosen.
"""
