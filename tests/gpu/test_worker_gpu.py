"""On a CUDA machine: a worker process (spawned, NCCL world of one, cuda:0) produces the tokens of
the in-process engine. Run on the device machine with `pytest -m gpu tests/gpu/test_worker_gpu.py`
(checked on one H200: equal)."""

from __future__ import annotations

import pytest
import torch

from dsaserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.executor import MultiprocExecutor

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_worker_process_on_cuda_matches_in_process(model_dirs):
    d = model_dirs["tiny-glm5"]
    cfg = EngineConfig(str(d), ModelConfig.from_file(d),
                       cache=CacheConfig(block_size=16, num_gpu_blocks=64),
                       scheduler=SchedulerConfig(max_model_len=256), dtype="float32",
                       device="cuda")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8] * 10 for i in range(3)]
    local = LLMEngine.from_config(cfg).generate(prompts, params)
    engine = LLMEngine(cfg, MultiprocExecutor(cfg), None)
    try:
        assert engine.generate(prompts, params) == local
        engine.check_integrity()
    finally:
        engine.shutdown()
