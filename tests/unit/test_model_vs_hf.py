"""The model against the Hugging Face transformers implementation of each model type.

Logits of a full prefill, of chunked prefills of several chunk sizes and of incremental decode must
match HF's full forward (fp32 weights, model-dtype KV: max relative error ≤ 1e-4). The tiny models
have 16 indexer heads and top-k 16 < 48 tokens, so the indexer's selection is exercised.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.core import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from dsaserve.engine.runner import ModelRunner
from dsaserve.kernels import formats

SEQ_LEN = 48
PRESETS = ["tiny-glm5", "tiny-dsv32"]


def _hf_logits(model_dir, preset: str, ids: list[int], *, simulate_fp8_latent: bool = False
               ) -> torch.Tensor:
    import transformers

    cls = {"tiny-glm5": transformers.GlmMoeDsaForCausalLM,
           "tiny-dsv32": transformers.DeepseekV32ForCausalLM}[preset]
    model = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if simulate_fp8_latent:
        # What the DeepSeek reference does to model an fp8_ds_mla cache: quantize + dequantize the
        # latent c right after kv_a_layernorm (MODEL_SPEC §2.3).
        def roundtrip(_module, _inputs, c):
            rows = formats.quantize_mla_rows(c.reshape(-1, 512), torch.zeros(c.numel() // 512, 64))
            return formats.dequantize_mla_rows(rows)[:, :512].reshape(c.shape)

        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm.register_forward_hook(roundtrip)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [T, V]


def _prompt(vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (SEQ_LEN,), generator=g).tolist()


def run_chunks(runner: ModelRunner, ids: list[int], chunks: list[int], block_size: int
               ) -> torch.Tensor:
    """Feed `ids` to the runner in the given chunk sizes; logits of every position [T, V]."""
    n_blocks = -(-len(ids) // block_size)
    blocks = tuple(range(n_blocks))
    out, done, rid = [], 0, "r0"
    for i, n in enumerate(chunks):
        if i == 0:
            new = (NewRequestData(rid, tuple(ids), SamplingParams(), blocks, 0),)
            so = SchedulerOutput(new, (), {rid: n}, ())
        else:
            so = SchedulerOutput((), (CachedRequestData(rid, (), (), done),), {rid: n}, ())
        out.append(runner.execute_all_logits(so)[rid])
        done += n
    assert done == len(ids)
    runner.execute(SchedulerOutput((), (), {}, (rid,)))  # drop the request
    return torch.cat(out)


def _max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=PRESETS)
def setup(request, model_dirs):
    preset = request.param
    model_dir = model_dirs[preset]
    from dsaserve.config import ModelConfig

    cfg = ModelConfig.from_file(model_dir)
    assert cfg.index_topk < SEQ_LEN and cfg.index_n_heads >= 16
    ids = _prompt(cfg.vocab_size)
    return preset, model_dir, ids, _hf_logits(model_dir, preset, ids)


@pytest.mark.parametrize("chunks", [[SEQ_LEN], [16, 16, 16], [5, 20, 23], [40] + [1] * 8,
                                    [1] * 6 + [42]])
def test_logits_match_hf(setup, engine_config, chunks):
    preset, model_dir, ids, ref = setup
    runner = ModelRunner(engine_config(model_dir, block_size=16, num_blocks=8))
    ours = run_chunks(runner, ids, chunks, block_size=16)
    assert ours.shape == ref.shape
    assert _max_rel_err(ours, ref) <= 1e-4, (preset, chunks)


def test_dense_path_matches_hf_on_short_prompts(setup, engine_config):
    """With sparse_mla_force_mqa off, a batch whose queries all see ≤ top-k keys takes the dense
    MHA path; it must agree with HF (and with the absorbed path) too."""
    preset, model_dir, ids, _ = setup
    short = ids[:12]
    ref = _hf_logits(model_dir, preset, short)
    for force in (False, True):
        runner = ModelRunner(engine_config(model_dir, block_size=16, num_blocks=8, force_mqa=force))
        assert _max_rel_err(run_chunks(runner, short, [12], 16), ref) <= 1e-4, force


def test_fp8_kv_matches_quantisation_simulated_in_hf(setup, engine_config):
    """fp8_ds_mla rows (e4m3 latent, power-of-two tile scales, bf16 RoPE key) equal HF with the
    latent quantised the same way, up to the bf16 rounding of k_pe, where every query sees ≤
    top-k keys (so the FP8 indexer's choice cannot matter); beyond, it may pick other near-ties."""
    preset, model_dir, ids, ref = setup
    topk = 16
    sim = _hf_logits(model_dir, preset, ids[:topk], simulate_fp8_latent=True)
    runner = ModelRunner(engine_config(model_dir, kv_cache_dtype="fp8_ds_mla", block_size=16,
                                       num_blocks=8))
    ours = run_chunks(runner, ids, [5, 15, 28], 16)
    assert _max_rel_err(ours[:topk], sim) < 2e-2
    assert _max_rel_err(ours[:topk], ref[:topk]) > 1e-3  # the quantisation is really applied
    assert torch.isfinite(ours).all()
