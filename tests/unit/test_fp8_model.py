"""Matrices kept in FP8 (model/fp8.py) against dequantizing them at load.

The model keeps an FP8 checkpoint's matrices as float8_e4m3fn with their block scales (on CUDA by
default; `keep_fp8_weights=True` here, on the CPU); the product uses the value dequantizing at load
gave, so the logits must be bit-equal to that path on the CPU (the reference dequantizes, then
F.linear), for both model types, in float32 and bfloat16, over prefill and decode chunks, and the
matrices take one byte per value.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_vs_hf import _prompt, run_chunks

from dsaserve.engine.runner import ModelRunner
from dsaserve.model import fp8
from dsaserve.model.make_model import make_model


@pytest.fixture(scope="module", params=["tiny-glm5", "tiny-dsv32"])
def fp8_dir(request, tmp_path_factory):
    return make_model(request.param, tmp_path_factory.mktemp("fp8") / request.param, fp8=True)


def _kept(config):
    return dataclasses.replace(config, keep_fp8_weights=True)


def _dequantized_at_load(config):
    return dataclasses.replace(config, keep_fp8_weights=False)


def test_cpu_default_dequantizes_at_load(fp8_dir, engine_config):
    """Without FP8 kernels (the CPU) the reference would dequantize every matrix at every step:
    the default dequantizes once, at load."""
    model = ModelRunner(engine_config(fp8_dir, block_size=16, num_blocks=8)).model
    assert not any(isinstance(m, fp8.Fp8Linear) for m in model.modules())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kept_equals_dequantized_at_load(fp8_dir, engine_config, dtype):
    config = engine_config(fp8_dir, block_size=16, num_blocks=8, dtype=dtype)
    assert config.model.fp8_weights is not None
    ids = _prompt(config.model.vocab_size)
    kept = ModelRunner(_kept(config))
    layer = kept.model.model.layers[1]
    assert isinstance(layer.self_attn.q_a_proj, fp8.Fp8Linear)
    assert layer.mlp.experts.w13.dtype == torch.float8_e4m3fn
    assert not isinstance(layer.self_attn.kv_b_proj, fp8.Fp8Linear)  # absorbed: dequantized
    ref = ModelRunner(_dequantized_at_load(config))
    for chunks in ([48], [5, 20, 23], [40] + [1] * 8):
        a, b = run_chunks(kept, ids, chunks, 16), run_chunks(ref, ids, chunks, 16)
        assert torch.equal(a, b), chunks


def test_every_fp8_matrix_stays_fp8(fp8_dir, engine_config):
    """Every matrix the checkpoint stores in FP8 is held in FP8 (one byte per value, its block
    scales beside it), except kv_b_proj, which attention reads absorbed."""
    config = engine_config(fp8_dir, block_size=16, num_blocks=8, dtype="bfloat16")
    model = ModelRunner(_kept(config)).model
    plain = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    assert plain <= {"kv_b_proj", "weights_proj", "eh_proj", "lm_head"}, plain
    for name, p in model.named_parameters():
        if name.endswith(("experts.w13", "experts.w2")):
            assert p.dtype == torch.float8_e4m3fn, name
    fp8_bytes = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    ref = ModelRunner(_dequantized_at_load(config)).model
    ref_bytes = sum(p.numel() * p.element_size() for n, p in ref.named_parameters()
                    if p.dtype == torch.bfloat16 and p.dim() >= 2)
    kept_bf16 = sum(p.numel() * p.element_size() for p in model.parameters()
                    if p.dtype == torch.bfloat16 and p.dim() >= 2)
    # the FP8 values replace exactly half the bf16 bytes of what they hold
    assert fp8_bytes * 2 == ref_bytes - kept_bf16


def test_quantization_fp8_quantizes_a_bf16_checkpoint_at_load(tmp_path):
    """`--quantization fp8` on a float32 checkpoint: its matrices quantized at load into the
    bytes and block scales an FP8 checkpoint of the same weights stores (make_model quantizes them
    the same way), kept in FP8 even on the CPU; kv_b_proj, which stays in the model dtype, keeps
    the checkpoint's values."""
    import argparse

    from dsaserve.engine.args import add_engine_args, engine_config_from_args

    plain = make_model("tiny-glm5", tmp_path / "plain")
    stored = make_model("tiny-glm5", tmp_path / "fp8", fp8=True)
    parser = add_engine_args(argparse.ArgumentParser())
    flags = ["--block-size", "16", "--num-gpu-blocks-override", "8", "--max-model-len", "256",
             "--device", "cpu", "-q", "fp8"]
    online = engine_config_from_args(parser.parse_args(flags), str(plain))
    assert online.keep_fp8_weights and online.model.fp8_weights is not None
    got = ModelRunner(online).model.state_dict()
    want = ModelRunner(engine_config_from_args(parser.parse_args(flags), str(stored))
                       ).model.state_dict()
    plain_model = ModelRunner(engine_config_from_args(parser.parse_args(flags[:-2]), str(plain))
                              ).model.state_dict()
    fp8_names = [n for n, t in want.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8_names) > 20
    for name, t in want.items():
        if "kv_b_proj" in name:
            assert torch.equal(got[name], plain_model[name]), name
        else:  # FP8 values compared as bytes (float8 has no equality kernel on the CPU)
            a, b = (got[name], t) if t.dtype != torch.float8_e4m3fn else (
                got[name].view(torch.uint8), t.view(torch.uint8))
            assert torch.equal(a, b), name
