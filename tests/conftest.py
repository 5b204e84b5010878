"""Shared fixtures: tiny checkpoints built once per session, and engine-config factories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Lazily built tiny checkpoints, keyed by preset name (tiny-glm5, tiny-dsv32)."""
    from dsaserve.model.make_model import make_model

    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("models")

    class _Dirs(dict):
        def __missing__(self, preset: str) -> Path:
            cache[preset] = make_model(preset, root / preset)
            self[preset] = cache[preset]
            return cache[preset]

    return _Dirs()


@pytest.fixture
def engine_config():
    """engine_config(model_dir, kv_cache_dtype=..., block_size=..., ...) → EngineConfig."""
    from dsaserve.config import (
        AttentionConfig,
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )

    def build(model_dir: Path, *, kv_cache_dtype: str = "auto", block_size: int = 16,
              num_blocks: int | None = 64, prefix_caching: bool = True, max_model_len: int = 256,
              max_num_seqs: int = 16, max_num_batched_tokens: int = 512, force_mqa: bool = True,
              dtype: str = "auto") -> EngineConfig:
        return EngineConfig(
            model_path=str(model_dir),
            model=ModelConfig.from_file(model_dir),
            cache=CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                              num_gpu_blocks=num_blocks, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            attention=AttentionConfig(sparse_mla_force_mqa=force_mqa),
            dtype=dtype,
        )

    return build
