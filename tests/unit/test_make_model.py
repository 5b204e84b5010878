"""Random HF-format checkpoints: determinism, naming, sharding, FP8, and HF transformers loading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsaserve.config import ConfigError, ModelConfig
from dsaserve.kernels.fp8_weights import quantize_blocks
from dsaserve.model.make_model import (
    add_parser,
    assign_shards,
    build_config,
    main,
    make_model,
)
from dsaserve.model.presets import DEEPSEEK_V3_2, GLM_5_3

# Shapes of GLM-5.3 shrunk to CPU size (the layer count and IndexShare rule stay real).
SMALL_GLM53 = {
    "num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
    "num_attention_heads": 2, "q_lora_rank": 32, "index_n_heads": 2, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": 512, "first_k_dense_replace": 1,
}


def read_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                tensors[k] = h.get_tensor(k)
    return tensors


def dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny-glm5", tmp_path_factory.mktemp("glm"))


@pytest.fixture(scope="module")
def dsv32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny-dsv32", tmp_path_factory.mktemp("dsv32"), num_shards=3)


def test_deterministic(glm: Path, tmp_path: Path) -> None:
    again = make_model("tiny-glm5", tmp_path / "again")
    assert dir_bytes(again) == dir_bytes(glm)
    other = make_model("tiny-glm5", tmp_path / "seed1", seed=1)
    a, b = read_checkpoint(glm), read_checkpoint(other)
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.layers.0.self_attn.q_a_proj.weight"],
                           b["model.layers.0.self_attn.q_a_proj.weight"])


def test_files_and_index(dsv32: Path) -> None:
    names = {p.name for p in dsv32.iterdir()}
    shards = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert names == {*shards, "model.safetensors.index.json", "config.json",
                     "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    index = json.loads((dsv32 / "model.safetensors.index.json").read_text())
    total = 0
    for shard in shards:
        with safe_open(str(dsv32 / shard), framework="pt") as h:
            keys = set(h.keys())
            assert keys, shard
            assert {k for k, v in index["weight_map"].items() if v == shard} == keys
            for k in keys:
                t = h.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    gen = json.loads((dsv32 / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0 and gen["bos_token_id"] == 0


def test_tensor_names_follow_the_spec(glm: Path, dsv32: Path) -> None:
    g = read_checkpoint(glm)
    cfg = ModelConfig.from_file(glm)
    assert cfg.indexer_types == ("full", "shared", "full", "shared")
    for layer in range(5):  # 4 decoder layers + the MTP layer (4)
        has_idx = any(k.startswith(f"model.layers.{layer}.self_attn.indexer.") for k in g)
        assert has_idx == (layer in (0, 2, 4)), layer
        dense = f"model.layers.{layer}.mlp.gate_proj.weight" in g
        assert dense == (layer == 0), layer
    idx = "model.layers.2.self_attn.indexer."
    assert g[idx + "wq_b.weight"].shape == (16 * 128, 64)
    assert g[idx + "wk.weight"].shape == (128, 128)
    assert g[idx + "k_norm.bias"].shape == (128,)
    assert g[idx + "weights_proj.weight"].shape == (16, 128)
    bias = g["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.shape == (8,) and bias.abs().min() > 0
    assert g["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (128, 64)
    assert g["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (64, 128)
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert f"model.layers.4.{k}" in g
    assert g["model.layers.4.eh_proj.weight"].shape == (128, 256)
    assert "model.layers.4.embed_tokens.weight" not in g  # GLM ships no copies
    d = read_checkpoint(dsv32)
    assert all(f"model.layers.{i}.self_attn.indexer.wk.weight" in d for i in range(5))
    # DeepSeek's MTP copies are exact copies.
    assert torch.equal(d["model.layers.4.embed_tokens.weight"], d["model.embed_tokens.weight"])
    assert torch.equal(d["model.layers.4.shared_head.head.weight"], d["lm_head.weight"])
    assert all(t.dtype == torch.float32 for t in d.values())


def test_without_mtp(glm: Path, tmp_path: Path) -> None:
    out = make_model("tiny-glm5", tmp_path, with_mtp=False, num_shards=1)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert not (out / "model.safetensors.index.json").exists()
    no_mtp, full = read_checkpoint(out), read_checkpoint(glm)
    assert not any(k.startswith("model.layers.4.") for k in no_mtp)
    # Per-tensor seeds: the shared tensors are identical.
    assert all(torch.equal(t, full[k]) for k, t in no_mtp.items())
    assert set(full) - set(no_mtp) == {k for k in full if k.startswith("model.layers.4.")}


@pytest.mark.parametrize("preset,cls", [("tiny-glm5", "GlmMoeDsaForCausalLM"),
                                        ("tiny-dsv32", "DeepseekV32ForCausalLM")])
def test_transformers_loads_and_runs(preset: str, cls: str, glm: Path, dsv32: Path) -> None:
    import transformers

    d = glm if preset == "tiny-glm5" else dsv32
    model, info = getattr(transformers, cls).from_pretrained(
        d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    # HF has no MTP layer: only its tensors are left over.
    assert info["unexpected_keys"] and all(k.startswith("model.layers.4.")
                                           for k in info["unexpected_keys"])
    ckpt = read_checkpoint(d)
    sd = model.state_dict()
    # HF stacks experts gate-first: [E, 2I, H].
    gate_up = sd["model.layers.3.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[5, :64], ckpt["model.layers.3.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(gate_up[5, 64:], ckpt["model.layers.3.mlp.experts.5.up_proj.weight"])
    assert torch.equal(sd["model.layers.3.mlp.gate.e_score_correction_bias"],
                       ckpt["model.layers.3.mlp.gate.e_score_correction_bias"])
    ids = torch.randint(4, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (2, 40, 512) and torch.isfinite(out.logits).all()
    # The scales keep activations O(1) through the layers.
    for h in out.hidden_states:
        assert 0.3 < h.std().item() < 5.0


def test_fp8(glm: Path, tmp_path: Path) -> None:
    out = make_model("tiny-glm5", tmp_path, fp8=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == DEEPSEEK_V3_2["quantization_config"]
    assert ModelConfig.from_hf(cfg).fp8_weights is not None
    q, ref = read_checkpoint(out), read_checkpoint(glm)
    unquantized = ("norm", "layernorm", "mlp.gate.", "weights_proj", "embed_tokens", "lm_head",
                   "eh_proj", "k_norm")
    for name, t in ref.items():
        if t.dim() == 2 and not any(u in name for u in unquantized):
            assert q[name].dtype == torch.float8_e4m3fn, name
            scale = q[name + "_scale_inv"]
            assert scale.dtype == torch.float32
            assert scale.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128)), name
            # Dequantized values are the fp32 checkpoint's up to e4m3 rounding (3 mantissa bits).
            s = scale.repeat_interleave(128, 0)[: t.shape[0]]
            s = s.repeat_interleave(128, 1)[:, : t.shape[1]]
            err = (q[name].float() * s - t).abs()
            assert (err <= t.abs() / 16 + s / 512).all(), name
        else:
            assert torch.equal(q[name], t), name
            assert name + "_scale_inv" not in q
    # [576, 128]: the last block row is partial.
    assert q["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 1)


def test_quantize_blocks_partial_blocks() -> None:
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    wq, scale = quantize_blocks(w)
    assert wq.shape == (200, 300) and scale.shape == (2, 3)
    for r in range(2):
        for c in range(3):
            block = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
            qb = wq[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128].float()
            assert scale[r, c] == block.abs().max() / 448
            # The block's largest magnitude lands exactly on ±448.
            assert qb.abs().max() == 448
            assert ((qb * scale[r, c] - block).abs() <= block.abs() / 16 + scale[r, c] / 512).all()


def test_quantize_blocks_in_passes_equals_whole() -> None:
    """Passes of 128 rows (a large lm_head is quantized so on a GPU) give the whole matrix's
    bytes and scales, the partial last block row included."""
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    whole, passes = quantize_blocks(w), quantize_blocks(w, rows_per_pass=128)
    assert torch.equal(whole[0].view(torch.uint8), passes[0].view(torch.uint8))
    assert torch.equal(whole[1], passes[1])
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_blocks(w, rows_per_pass=100)


def test_assign_shards_invariants() -> None:
    rng = random.Random(0)
    for _ in range(500):
        sizes = [rng.choice([1, 10, 1000, 10**6]) for _ in range(rng.randrange(1, 30))]
        n = rng.randrange(1, len(sizes) + 1)
        s = assign_shards(sizes, n)
        assert s[0] == 0 and s[-1] == n - 1
        # Contiguous runs, none empty.
        assert all(b - a in (0, 1) for a, b in zip(s, s[1:], strict=False))
    assert assign_shards([5] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="num_shards"):
        assign_shards([1, 2], 3)


def test_overrides_trim_indexer_types() -> None:
    raw = build_config("glm-5.3", overrides=SMALL_GLM53)
    # Derived with GLM-5.3's own rule: the prefix of its real schedule.
    assert raw["indexer_types"] == GLM_5_3["indexer_types"][:8]
    assert raw["indexer_types"] == ["full"] * 3 + ["shared"] * 3 + ["full", "shared"]
    tiny6 = build_config("tiny-glm5", overrides={"num_hidden_layers": 6})
    assert tiny6["indexer_types"] == ["full", "shared"] * 3
    with pytest.raises(ConfigError, match="indexer_types"):
        build_config("tiny-glm5", overrides={"num_hidden_layers": 6,
                                              "indexer_types": ["full"] * 4})
    with pytest.raises(ConfigError, match="n_group"):
        build_config("deepseek-v3.2", overrides={"n_routed_experts": 12})
    with pytest.raises(ConfigError, match="--preset"):
        build_config("no-such-model")


def test_real_preset_with_overrides(tmp_path: Path) -> None:
    out = make_model("glm-5.3", tmp_path, overrides=SMALL_GLM53, fp8=True)
    cfg = ModelConfig.from_file(out)
    assert cfg.num_hidden_layers == 8 and cfg.full_indexer_layers == (0, 1, 2, 6)
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    with_indexer = {int(n.split(".")[2]) for n in names if ".indexer." in n}
    assert with_indexer == {0, 1, 2, 6, 8}  # full layers + the MTP layer
    assert "model.layers.3.mlp.experts.3.up_proj.weight_scale_inv" in names
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "tiny-dsv32", "--no-mtp", "--num-shards", "1", "--seed", "3",
                 str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert (tmp_path / "a" / "model.safetensors").is_file()
    assert main(["--overrides", "{bad", str(tmp_path / "b")]) == 2
    assert "--overrides" in capsys.readouterr().err
    assert main(["--overrides", '{"num_hidden_layers": 0}', str(tmp_path / "c")]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err

    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-model", "--preset", "tiny-glm5", "--fp8", str(tmp_path / "d")])
    assert args.fp8 and args.with_mtp and args.seed == 0
    assert args.func(args) == 0
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" in json.loads(
        (tmp_path / "d" / "model.safetensors.index.json").read_text())["weight_map"]
