"""On a CUDA machine: the engine with an FP8 checkpoint's matrices kept in FP8 (model/fp8.py, the
default on CUDA) against the same checkpoint dequantized at load. The kernels form the product
from the same weight values in another order, so the logits agree within fp32 accumulation
differences and greedy tokens of the float32 tiny models are equal; a GLM-5.3-shaped model's
weights take about half the memory. Also graphed decode (the FP8 kernels inside CUDA graphs)
equals its padded steps run eager, and in float32 --enforce-eager; MTP3 drafting through the
FP8 copy of lm_head gives plain decoding's greedy tokens. Run with `pytest -m gpu -s
tests/gpu/test_fp8_model_gpu.py`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsaserve.config import SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine
from dsaserve.model.make_model import make_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny-glm5", "tiny-dsv32"])
def fp8_dir(request, tmp_path_factory):
    return make_model(request.param, tmp_path_factory.mktemp("fp8") / request.param, fp8=True)


def _config(engine_config, model_dir, keep: bool, *, eager: bool = True, dtype="float32"):
    cfg = engine_config(model_dir, kv_cache_dtype="auto", block_size=64, num_blocks=64,
                        max_model_len=256, dtype=dtype)
    return replace(cfg, device="cuda", keep_fp8_weights=keep,
                   attention=replace(cfg.attention, backend="triton"),
                   compilation=replace(cfg.compilation, enforce_eager=eager))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in (40, 90, 150)]


def test_fp8_kept_by_default_on_cuda(fp8_dir, engine_config):
    cfg = replace(_config(engine_config, fp8_dir, True), keep_fp8_weights=None)
    layer = LLMEngine.from_config(cfg).runner.model.model.layers[1]
    assert layer.mlp.experts.w13.dtype == torch.float8_e4m3fn


def test_fp8_kept_greedy_equals_dequantized(fp8_dir, engine_config):
    kept = LLMEngine.from_config(_config(engine_config, fp8_dir, True)).generate(_prompts(), PARAMS)
    ref = LLMEngine.from_config(_config(engine_config, fp8_dir, False)).generate(_prompts(), PARAMS)
    assert kept == ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kept_graphs_equal_eager(fp8_dir, engine_config, monkeypatch, dtype):
    """The graphs replay what their padded steps compute eagerly (the FP8 kernels captured), in
    both dtypes; they equal --enforce-eager (unpadded steps) in float32. In bfloat16 a GEMM's
    rounding depends on its row count, which padding changes, and a random tiny model's
    near-tied logits turn that into other tokens (docs/decode.md; part 50 saw it once)."""
    from dsaserve.engine import cudagraph

    graphed = LLMEngine.from_config(_config(engine_config, fp8_dir, True, eager=False,
                                            dtype=dtype))
    tokens = graphed.generate(_prompts(), PARAMS)
    assert graphed.runner.decode_graphs.num_replays > 0

    def no_capture(fn, pool=None, warmup=2):
        raise RuntimeError("capture refused by the test: the padded steps run eager")

    monkeypatch.setattr(cudagraph, "capture", no_capture)
    padded = LLMEngine.from_config(_config(engine_config, fp8_dir, True, eager=False,
                                           dtype=dtype))
    assert padded.generate(_prompts(), PARAMS) == tokens
    assert not padded.runner.decode_graphs.capture and padded.runner.decode_graphs.num_steps
    if dtype == "float32":
        eager = LLMEngine.from_config(_config(engine_config, fp8_dir, True, dtype=dtype))
        assert eager.generate(_prompts(), PARAMS) == tokens


@pytest.mark.parametrize("vocab", [None, tuple(range(0, 512, 3))])
def test_fp8_draft_head_greedy_equals_plain(fp8_dir, engine_config, vocab):
    """MTP3 with FP8 kept drafts through the FP8 copy of lm_head by default (the weight-only
    kernel, inside the drafts' CUDA graph), over every token or a draft vocabulary (a third of
    the ids: the argmax's index mapped back to its id inside the graph): greedy output equals
    plain decoding's."""
    plain = LLMEngine.from_config(_config(engine_config, fp8_dir, True, eager=False))
    spec = SpecConfig(num_speculative_tokens=3, draft_vocab=vocab)
    mtp = LLMEngine.from_config(replace(_config(engine_config, fp8_dir, True, eager=False),
                                        speculative=spec))
    assert mtp.runner.model.draft_head is not None
    assert mtp.generate(_prompts(), PARAMS) == plain.generate(_prompts(), PARAMS)
    assert mtp.runner.decode_graphs.num_draft_replays > 0


def test_glm53_shaped_weights_take_half_the_memory(tmp_path, engine_config):
    from dsaserve.model.presets import glm53_shaped

    d = make_model("glm-5.3", tmp_path / "glm53", fp8=True, with_mtp=False,
                   overrides=glm53_shaped(2))
    used = {}
    for keep in (True, False):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        engine = LLMEngine.from_config(_config(engine_config, d, keep, dtype="bfloat16"))
        params = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        used[keep] = params
        print(f"\nkeep_fp8_weights={keep}: parameters {params / 2**30:.2f} GiB, "
              f"allocated {(torch.cuda.memory_allocated() - before) / 2**30:.2f} GiB")
        del engine
    assert used[True] < 0.6 * used[False]
