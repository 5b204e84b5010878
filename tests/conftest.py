"""Shared fixtures: tiny checkpoints built once per session, and engine-config factories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def pytest_collectreport(report) -> None:
    """tests/unit/test_triton_interpret.py skips itself when triton was imported before it
    without the interpreter: right on a GPU machine (the GPU modules import it), a silent loss of
    every interpreted kernel test on a CPU one, where it means that a module collected earlier
    imported triton at import time (unit modules import it inside their tests instead)."""
    if (report.nodeid.endswith("test_triton_interpret.py") and report.skipped
            and "imported before" in str(report.longrepr) and not torch.cuda.is_available()):
        raise pytest.UsageError(
            "test_triton_interpret.py was skipped: a test module collected before it imported "
            "triton without TRITON_INTERPRET=1 (import dsaserve.kernels.triton inside tests)")


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


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    """The built-in tiny tokenizer, written once per session."""
    from dsaserve.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tok(tok_dir: Path):
    """The tiny tokenizer, loaded."""
    from dsaserve.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tok_dir)


def _mixed_prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (21–99 tokens for n = 5) with a shared 40-token prefix over the tiny
    vocabulary: prefix hits, sparse top-k (tiny top-k is 16) and, under PCP, both split and
    replicated prefills happen."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(4, 512, (40,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(4, 512, (3 + 11 * i,), generator=g).tolist()
        out.append(shared + tail if i % 2 == 0 else tail + shared[:7])
    return out


@pytest.fixture(scope="session")
def mixed_prompts():
    """mixed_prompts(n=5, seed=0) → prompts (token ids) every engine test can share."""
    return _mixed_prompts


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
