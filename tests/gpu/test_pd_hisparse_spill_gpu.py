"""On a CUDA machine: P/D over NIXL into a HiSparse decode engine with spilling (both engines on
the one GPU, in one process; the triton backend, 64-token pages). The prefill engine's VRAM rows
of a long prompt's blocks below its write tail are READ straight into the decode rank's pinned
host pool (registered with NIXL as DRAM), the tail's into its GPU MLA pages; greedy output equals
the aggregated engine's, every invariant checked after every step. Run on the device machine with
`pytest -m gpu tests/gpu/test_pd_hisparse_spill_gpu.py` (with the nixl wheel).

Float32 KV (tiny-glm5) is compared with the four prompts decoding together, as in
test_hisparse_spill_gpu.py: the P/D engines' batches differ from the aggregated engine's (the
arrivals join as their READs land), which float32 KV does not feel. fp8_ds_mla KV (tiny-dsv32)
is compared one prompt at a time, where both sides run the same shapes: in other batches a
GEMM rounds otherwise, an e4m3 step can turn that into another cached value and the tiny
model's near-tied indexer scores into another token (docs/hisparse.md); batched, prompt 0
parted at its third token on an H100 (2026-12-06)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsaserve.config import DisaggConfig, HiSparseConfig
from dsaserve.core import SamplingParams
from dsaserve.disagg import offline, transport
from dsaserve.engine.engine import LLMEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not transport.nixl_available(), reason="nixl not installed")]


@pytest.mark.parametrize(("preset", "kv"), [("tiny-glm5", "auto"), ("tiny-dsv32", "fp8_ds_mla")])
def test_pd_into_spilling_hisparse_on_cuda(model_dirs, engine_config, preset, kv):
    cfg = engine_config(model_dirs[preset], kv_cache_dtype=kv, block_size=64, num_blocks=64,
                        max_model_len=256, dtype="float32")
    cfg = replace(cfg, device="cuda", attention=replace(cfg.attention, backend="triton"),
                  compilation=replace(cfg.compilation, enforce_eager=True))
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (130, 150, 170, 190)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLMEngine.from_config(cfg)
    alone = kv == "fp8_ds_mla"  # one prompt at a time: the aggregated engine's shapes
    want = ([ref.generate([x], params)[0] for x in prompts] if alone
            else ref.generate(prompts, params))
    # 6 MLA pages: the four write tails and room to move on; the prompts' 12 blocks arrive
    # with only their tails on the GPU
    att = replace(cfg.attention, hisparse_device_buffer_size=cfg.model.index_topk,
                  hisparse_device_mla_pages=6, hisparse_config_given=True)

    def disagg(role: str) -> DisaggConfig:
        return DisaggConfig(kv_role=role, backend="nixl", side_channel_port=0)

    p = LLMEngine.from_config(replace(cfg, disagg=disagg("kv_producer")))
    d = LLMEngine.from_config(replace(cfg, attention=att, disagg=disagg("kv_consumer"),
                                      hisparse=HiSparseConfig(host_pool_bytes=64 << 20)))
    try:
        def check() -> None:
            d.check_integrity()
            p.check_integrity()

        if alone:
            got = [offline.generate_together(p, d, [x], params, tag=f"pd{i}",
                                             after_step=check)[0]
                   for i, x in enumerate(prompts)]
        else:
            got = offline.generate_together(p, d, prompts, params, after_step=check)
        assert got == want
        worker = d.runner.connector
        assert worker.mla_rows_to_host == sum((len(x) - 1) // 64 * 64 for x in prompts)
        assert worker.mla_rows_to_gpu == sum((len(x) - 1) % 64 for x in prompts)
    finally:
        p.shutdown()
        d.shutdown()
