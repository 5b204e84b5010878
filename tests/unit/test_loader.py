"""Weight loading into a stand-in module that follows the naming contract (experts stacked)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dsaserve.config import ConfigError, ModelConfig
from dsaserve.model.loader import (
    LoadError,
    checkpoint_has_mtp,
    checkpoint_tensor_names,
    dequantize_fp8_blocks,
    load_weights,
)
from dsaserve.model.make_model import make_model


# ------------------------------------------------------------------------------------------------
# A stand-in model: parameter names and shapes only, written from MODEL_SPEC.md §1.3
# ------------------------------------------------------------------------------------------------
def _linear(in_dim: int, out_dim: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(in_dim, out_dim, bias=False, dtype=dtype)


class _Norm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))


class _Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.index_head_dim
        self.wq_b = _linear(cfg.q_lora_rank, cfg.index_n_heads * d, dtype)
        self.wk = _linear(cfg.hidden_size, d, dtype)
        self.k_norm = nn.LayerNorm(d, dtype=dtype)
        self.weights_proj = _linear(cfg.hidden_size, cfg.index_n_heads, torch.float32)  # kept fp32


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = _linear(h, cfg.q_lora_rank, dtype)
        self.q_a_layernorm = _Norm(cfg.q_lora_rank, dtype)
        self.q_b_proj = _linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, dtype)
        self.kv_a_proj_with_mqa = _linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype)
        self.kv_a_layernorm = _Norm(cfg.kv_lora_rank, dtype)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                 dtype)
        self.o_proj = _linear(nh * cfg.v_head_dim, h, dtype)
        if cfg.has_indexer(layer):
            self.indexer = _Indexer(cfg, dtype)


class _MLP(nn.Module):
    def __init__(self, h: int, i: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = _linear(h, i, dtype)
        self.up_proj = _linear(h, i, dtype)
        self.down_proj = _linear(i, h, dtype)


class _Experts(nn.Module):
    def __init__(self, e: int, h: int, i: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype))  # [E, 2I, H]: gate | up
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype))  # [E, H, I]


class _Gate(nn.Module):
    def __init__(self, e: int, h: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(e, h, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.empty(e, dtype=torch.float32))


class _MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = _Gate(cfg.n_routed_experts, h, dtype)
        self.experts = _Experts(cfg.n_routed_experts, h, i, dtype)
        self.shared_experts = _MLP(h, i * cfg.n_shared_experts, dtype)


class _SharedHead(nn.Module):
    def __init__(self, h: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = _Norm(h, dtype)


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = _Norm(h, dtype)
        self.post_attention_layernorm = _Norm(h, dtype)
        self.self_attn = _Attention(cfg, layer, dtype)
        self.mlp = (_MoE(cfg, dtype) if cfg.is_moe_layer(layer)
                    else _MLP(h, cfg.intermediate_size, dtype))
        if layer == cfg.mtp_layer_index:
            self.enorm = _Norm(h, dtype)
            self.hnorm = _Norm(h, dtype)
            self.eh_proj = _linear(2 * h, h, dtype)
            self.shared_head = _SharedHead(h, dtype)


class _Inner(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool, dtype: torch.dtype) -> None:
        super().__init__()
        n = cfg.num_hidden_layers + (1 if with_mtp else 0)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(cfg, i, dtype) for i in range(n))
        self.norm = _Norm(cfg.hidden_size, dtype)


class StandIn(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = _Inner(cfg, with_mtp, dtype)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, dtype)
        with torch.no_grad():  # every value must come from the checkpoint
            for t in self.state_dict(keep_vars=True).values():
                t.fill_(float("nan"))


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def read_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def rewrite(src: Path, dst: Path, drop: tuple[str, ...] = (),
            add: dict[str, torch.Tensor] | None = None) -> Path:
    """Copy a checkpoint as a single model.safetensors, minus `drop`, plus `add`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {k: v for k, v in read_checkpoint(src).items() if k not in drop}
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def ref_dequant(wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block by block, independently of the loader's vectorised version."""
    out = torch.empty(wq.shape, dtype=torch.float32)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            rows, cols = slice(r * 128, (r + 1) * 128), slice(c * 128, (c + 1) * 128)
            out[rows, cols] = wq[rows, cols].float() * scale[r, c]
    return out


def assert_matches_checkpoint(module: nn.Module, ckpt: dict[str, torch.Tensor],
                              cfg: ModelConfig) -> None:
    sd = module.state_dict()
    for t in sd.values():
        assert not torch.isnan(t).any()  # every tensor was written
    i = cfg.moe_intermediate_size
    n_checked = 0
    for name, t in ckpt.items():
        if name.endswith("_scale_inv") or name.endswith(
                (".layers.4.embed_tokens.weight", ".shared_head.head.weight")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = ref_dequant(t, ckpt[name + "_scale_inv"])
        parts = name.split(".")
        if ".mlp.experts." in name:
            base, e, proj = ".".join(parts[:5]), int(parts[5]), parts[6]
            if proj == "down_proj":
                dst = sd[base + ".w2"][e]
            else:
                w13 = sd[base + ".w13"][e]
                dst = w13[:i] if proj == "gate_proj" else w13[i:]
        else:
            dst = sd[name]
        assert dst.dtype == (torch.float32 if ("weights_proj" in name or "e_score" in name)
                             else module.model.norm.weight.dtype), name
        assert torch.equal(dst, t.to(dst.dtype)), name
        n_checked += 1
    assert n_checked > 100


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny-glm5", tmp_path_factory.mktemp("glm"))


def test_load_fp32_glm(glm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ModelConfig.from_file(glm)
    module = StandIn(cfg, with_mtp=True, dtype=torch.float32)
    load_weights(module, glm, cfg, torch.float32, progress=True)
    assert "loading shards" in capsys.readouterr().err
    assert_matches_checkpoint(module, read_checkpoint(glm), cfg)
    assert checkpoint_has_mtp(glm, cfg)


def test_load_bf16_deepseek_drops_mtp_copies(tmp_path: Path) -> None:
    d = make_model("tiny-dsv32", tmp_path, num_shards=3, overrides={"torch_dtype": "bfloat16"})
    cfg = ModelConfig.from_file(d)
    ckpt = read_checkpoint(d)
    assert ckpt["model.layers.4.embed_tokens.weight"].dtype == torch.bfloat16
    module = StandIn(cfg, with_mtp=True, dtype=torch.bfloat16)
    load_weights(module, d, cfg, torch.bfloat16, progress=False)
    assert_matches_checkpoint(module, ckpt, cfg)


def test_load_fp8_dequantizes_per_block(glm: Path, tmp_path: Path) -> None:
    d = make_model("tiny-glm5", tmp_path, fp8=True)
    cfg = ModelConfig.from_file(d)
    module = StandIn(cfg, with_mtp=True, dtype=torch.float32)
    load_weights(module, d, cfg, torch.float32, progress=False)
    assert_matches_checkpoint(module, read_checkpoint(d), cfg)
    # And the dequantized weights are the fp32 checkpoint's up to e4m3 rounding.
    ref = StandIn(cfg, with_mtp=True, dtype=torch.float32)
    load_weights(ref, glm, cfg, torch.float32, progress=False)
    w, w_ref = module.state_dict(), ref.state_dict()
    experts = "model.layers.1.mlp.experts.w13"
    assert not torch.equal(w[experts], w_ref[experts])  # it was quantized
    torch.testing.assert_close(w[experts], w_ref[experts], rtol=1 / 16, atol=2e-3)


def test_dequantize_partial_blocks() -> None:
    g = torch.Generator().manual_seed(0)
    wq = (torch.randn(200, 300, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=g) + 0.5
    assert torch.equal(dequantize_fp8_blocks(wq, scale), ref_dequant(wq, scale))


def test_checkpoint_without_mtp(tmp_path: Path) -> None:
    d = make_model("tiny-glm5", tmp_path, with_mtp=False)
    cfg = ModelConfig.from_file(d)
    assert not cfg.has_mtp and not checkpoint_has_mtp(d, cfg)
    module = StandIn(cfg, with_mtp=False, dtype=torch.float32)
    load_weights(module, d, cfg, torch.float32, progress=False)
    assert_matches_checkpoint(module, read_checkpoint(d), cfg)
    # A config that asks for MTP but a checkpoint without its weights (as HF saves them).
    raw = json.loads((d / "config.json").read_text())
    assert not checkpoint_has_mtp(d, ModelConfig.from_hf({**raw, "num_nextn_predict_layers": 1}))


def test_mtp_tensors_ignored_when_module_has_none(glm: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    cfg = ModelConfig.from_file(glm)
    module = StandIn(cfg, with_mtp=False, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="dsaserve.model.loader"):
        load_weights(module, glm, cfg, torch.float32, progress=False)
    assert len(caplog.records) == 1 and "MTP" in caplog.records[0].getMessage()
    assert not any(torch.isnan(t).any() for t in module.state_dict().values())


def test_indexer_on_shared_layer_ignored(glm: Path, tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    ckpt = read_checkpoint(glm)
    extra = {k.replace("layers.0.", "layers.1."): v for k, v in ckpt.items()
             if k.startswith("model.layers.0.self_attn.indexer.")}
    d = rewrite(glm, tmp_path / "ck", add=extra)
    cfg = ModelConfig.from_file(d)
    module = StandIn(cfg, with_mtp=True, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="dsaserve.model.loader"):
        load_weights(module, d, cfg, torch.float32, progress=False)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "ignored 5 indexer tensors" in messages[0]
    assert "shared" in messages[0]


@pytest.mark.parametrize("dropped", ["model.layers.2.self_attn.kv_b_proj.weight",
                                     "model.layers.3.mlp.experts.6.up_proj.weight",
                                     "model.layers.4.eh_proj.weight"])
def test_missing_tensor_named(glm: Path, tmp_path: Path, dropped: str) -> None:
    d = rewrite(glm, tmp_path / "ck", drop=(dropped,))
    cfg = ModelConfig.from_file(d)
    with pytest.raises(LoadError, match=rf"1 tensors missing .*{dropped}"):
        load_weights(StandIn(cfg, True, torch.float32), d, cfg, torch.float32, progress=False)


def test_unknown_tensor_named(glm: Path, tmp_path: Path) -> None:
    d = rewrite(glm, tmp_path / "ck", add={"model.layers.0.self_attn.bogus.weight": torch.ones(2)})
    cfg = ModelConfig.from_file(d)
    with pytest.raises(LoadError, match=r"model\.layers\.0\.self_attn\.bogus\.weight: unknown"):
        load_weights(StandIn(cfg, True, torch.float32), d, cfg, torch.float32, progress=False)
    d = rewrite(glm, tmp_path / "ck2",
                add={"model.layers.1.mlp.experts.8.down_proj.weight": torch.ones(128, 64)})
    with pytest.raises(LoadError, match=r"experts\.8\.down_proj\.weight: expert 8 out of range"):
        load_weights(StandIn(cfg, True, torch.float32), d, cfg, torch.float32, progress=False)


def test_shape_mismatch_named(glm: Path, tmp_path: Path) -> None:
    d = rewrite(glm, tmp_path / "ck", add={"model.norm.weight": torch.ones(129)})
    cfg = ModelConfig.from_file(d)
    with pytest.raises(LoadError, match=r"model\.norm\.weight: shape mismatch: checkpoint \[129\], "
                                        r"module expects \[128\]"):
        load_weights(StandIn(cfg, True, torch.float32), d, cfg, torch.float32, progress=False)
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    d = rewrite(glm, tmp_path / "ck2", add={name: torch.ones(32, 128)})
    with pytest.raises(LoadError, match=rf"{name}: shape mismatch: checkpoint \[32, 128\], "
                                        r"module expects \[64, 128\]"):
        load_weights(StandIn(cfg, True, torch.float32), d, cfg, torch.float32, progress=False)


def test_fp8_weight_without_scale(tmp_path: Path) -> None:
    d = make_model("tiny-glm5", tmp_path / "fp8", fp8=True)
    weight = "model.layers.0.self_attn.o_proj.weight"
    d = rewrite(d, tmp_path / "ck", drop=(weight + "_scale_inv",))
    cfg = ModelConfig.from_file(d)
    with pytest.raises(LoadError, match=rf"{weight}: FP8 weight without its scale"):
        load_weights(StandIn(cfg, True, torch.float32), d, cfg, torch.float32, progress=False)


def test_module_dtype_checked(glm: Path) -> None:
    cfg = ModelConfig.from_file(glm)
    module = StandIn(cfg, True, torch.float32)
    module.model.norm.half()
    with pytest.raises(LoadError, match=r"model\.norm\.weight: module holds torch\.float16"):
        load_weights(module, glm, cfg, torch.float32, progress=False)


def test_checkpoint_tensor_names(glm: Path, tmp_path: Path) -> None:
    names = checkpoint_tensor_names(glm)
    index = json.loads((glm / "model.safetensors.index.json").read_text())
    assert names == set(index["weight_map"]) == set(read_checkpoint(glm))
    single = rewrite(glm, tmp_path / "single")
    assert checkpoint_tensor_names(single) == names
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match="no checkpoint"):
        checkpoint_tensor_names(tmp_path / "empty")


def test_config_errors_name_the_field(glm: Path, tmp_path: Path) -> None:
    raw = json.loads((glm / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "indexer_types": ["full"] * 3}))
    with pytest.raises(ConfigError, match="indexer_types"):
        ModelConfig.from_file(tmp_path)
    bad_first = {**raw, "indexer_types": ["shared", "full"] * 2}
    (tmp_path / "config.json").write_text(json.dumps(bad_first))
    with pytest.raises(ConfigError, match=r"indexer_types\[0\]"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": -1}))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_file(tmp_path / "nowhere")
