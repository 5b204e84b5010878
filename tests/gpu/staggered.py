"""The GPU engine tests' staggered workload: the trained tiny model (confident logits: bf16
batch-shape differences do not flip its argmax) on the triton backend, fp8_ds_mla KV, and five
code snippets joining at three steps and leaving at different ones (running batches of 1 to 5
requests), greedy."""

from __future__ import annotations

import dataclasses

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.model.presets import trained_model_dir
from dsaserve.tokenizer import Tokenizer

SNIPPETS = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n",
            "class Stack:\n    def __init__(self):\n", "for i in range(10):\n",
            "def is_prime(n):\n    if n < 2:\n"]
JOINS = [0, 0, 1, 3, 3]  # the step each snippet's request joins at


def trained_config(compilation: CompilationConfig, k: int, async_scheduling: bool = False,
                   **fields) -> EngineConfig:
    """The engine the workload runs on: MTP with k drafts (0: none); `fields`: other
    EngineConfig fields (parallel, step_log)."""
    d = trained_model_dir()
    cfg = EngineConfig(str(d), ModelConfig.from_file(d),
                       cache=CacheConfig(block_size=64, num_gpu_blocks=128,
                                         kv_cache_dtype="fp8_ds_mla"),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024,
                                                 async_scheduling=async_scheduling),
                       attention=AttentionConfig(backend="triton", sparse_mla_force_mqa=True),
                       dtype="bfloat16", device="cuda", compilation=compilation, **fields)
    if k:
        cfg = dataclasses.replace(cfg, speculative=SpecConfig(num_speculative_tokens=k))
    return cfg


def run_staggered(engine, tok: Tokenizer) -> dict[str, list[int]]:
    """Every snippet's request added at its step, the engine stepped until all are done →
    the tokens each request generated; the engine's invariants checked at the end."""
    outputs: dict[str, list[int]] = {}
    for step in range(400):
        for i, at in enumerate(JOINS):
            if at == step:
                engine.add_request(f"r{i}", tok.encode(SNIPPETS[i]), SamplingParams(
                    max_tokens=24 + 8 * i, temperature=0.0, ignore_eos=True))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if step > max(JOINS) and not engine.has_unfinished_requests():
            break
    engine.check_integrity()
    return outputs
