"""Deterministic random checkpoints in the Hugging Face layout (`dsaserve make-model`).

The output directory is what a real model download looks like: `config.json`, safetensors shards
with an index, `generation_config.json` and a tokenizer, with tensor names exactly as MODEL_SPEC.md
§1.3 (per-expert tensors, indexer tensors only on "full" layers, the MTP layer at index
num_hidden_layers).
HF transformers loads it, so it doubles as the fixture for reference tests.

Values are random but chosen so the tiny models behave like trained ones numerically: projections
have std 1/sqrt(fan_in) (activations stay O(1) through the layers), norm weights are 1 + noise, and
the indexer scores are well spread (no ReLU ties). Each tensor has its own generator seeded from
(seed, name), so a tensor's values do not depend on which other tensors exist: the FP8 checkpoint is
the quantized bf16/fp32 one, and the no-MTP checkpoint is the MTP one minus the MTP layer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from dsaserve.config import ConfigError, ModelConfig
from dsaserve.kernels.fp8_weights import FP8_BLOCK, quantize_blocks
from dsaserve.model.presets import DEEPSEEK_V3_2, REAL_PRESETS, TINY_PRESETS, preset_config
from dsaserve.tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Init = Literal["matrix", "embed", "norm", "noise", "router_bias"]


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name, shape, how its values are drawn, how it is stored."""

    name: str
    shape: tuple[int, ...]
    init: Init
    quantizable: bool = False  # stored as FP8 + weight_scale_inv in FP8 checkpoints
    fp32: bool = False  # always stored in float32 (e_score_correction_bias)


# ------------------------------------------------------------------------------------------------
# Which tensors a checkpoint holds
# ------------------------------------------------------------------------------------------------
def _decoder_layer_specs(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    p = f"model.layers.{layer}."
    h, nh = cfg.hidden_size, cfg.num_attention_heads

    def mat(name: str, out_dim: int, in_dim: int, quantizable: bool = True) -> TensorSpec:
        return TensorSpec(p + name, (out_dim, in_dim), "matrix", quantizable=quantizable)

    def norm(name: str, dim: int) -> TensorSpec:
        return TensorSpec(p + name, (dim,), "norm")

    specs = [
        norm("input_layernorm.weight", h),
        norm("post_attention_layernorm.weight", h),
        mat("self_attn.q_a_proj.weight", cfg.q_lora_rank, h),
        norm("self_attn.q_a_layernorm.weight", cfg.q_lora_rank),
        mat("self_attn.q_b_proj.weight", nh * cfg.qk_head_dim, cfg.q_lora_rank),
        mat("self_attn.kv_a_proj_with_mqa.weight", cfg.kv_cache_width, h),
        norm("self_attn.kv_a_layernorm.weight", cfg.kv_lora_rank),
        mat("self_attn.kv_b_proj.weight", nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            cfg.kv_lora_rank),
        mat("self_attn.o_proj.weight", h, nh * cfg.v_head_dim),
    ]
    if cfg.has_indexer(layer):  # IndexShare: "shared" layers carry no indexer tensors
        d = cfg.index_head_dim
        specs += [
            mat("self_attn.indexer.wq_b.weight", cfg.index_n_heads * d, cfg.q_lora_rank),
            mat("self_attn.indexer.wk.weight", d, h),
            norm("self_attn.indexer.k_norm.weight", d),
            TensorSpec(p + "self_attn.indexer.k_norm.bias", (d,), "noise"),
            mat("self_attn.indexer.weights_proj.weight", cfg.index_n_heads, h, quantizable=False),
        ]
    if not cfg.is_moe_layer(layer):
        i = cfg.intermediate_size
        specs += [mat("mlp.gate_proj.weight", i, h), mat("mlp.up_proj.weight", i, h),
                  mat("mlp.down_proj.weight", h, i)]
        return specs
    e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
    specs += [
        mat("mlp.gate.weight", e, h, quantizable=False),
        TensorSpec(p + "mlp.gate.e_score_correction_bias", (e,), "router_bias", fp32=True),
    ]
    for j in range(e):
        specs += [mat(f"mlp.experts.{j}.gate_proj.weight", i, h),
                  mat(f"mlp.experts.{j}.up_proj.weight", i, h),
                  mat(f"mlp.experts.{j}.down_proj.weight", h, i)]
    if cfg.n_shared_experts:
        s = i * cfg.n_shared_experts
        specs += [mat("mlp.shared_experts.gate_proj.weight", s, h),
                  mat("mlp.shared_experts.up_proj.weight", s, h),
                  mat("mlp.shared_experts.down_proj.weight", h, s)]
    return specs


def checkpoint_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a checkpoint for `cfg`, in file order; the MTP layer iff cfg.has_mtp.

    DeepSeek ships copies of embed_tokens / lm_head inside its MTP layer; GLM does not.
    """
    h, v = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", (v, h), "embed")]
    for layer in range(cfg.num_hidden_layers):
        specs += _decoder_layer_specs(cfg, layer)
    specs += [TensorSpec("model.norm.weight", (h,), "norm"),
              TensorSpec("lm_head.weight", (v, h), "matrix")]
    if cfg.has_mtp:
        n = cfg.mtp_layer_index
        p = f"model.layers.{n}."
        specs += _decoder_layer_specs(cfg, n)
        specs += [
            TensorSpec(p + "enorm.weight", (h,), "norm"),
            TensorSpec(p + "hnorm.weight", (h,), "norm"),
            # Not quantized in DeepSeek's FP8 release (vLLM builds it as a plain nn.Linear).
            TensorSpec(p + "eh_proj.weight", (h, 2 * h), "matrix"),
            TensorSpec(p + "shared_head.norm.weight", (h,), "norm"),
        ]
        if cfg.model_type == "deepseek_v32":
            specs += [TensorSpec(p + "embed_tokens.weight", (v, h), "embed"),
                      TensorSpec(p + "shared_head.head.weight", (v, h), "matrix")]
    return specs


# Copies DeepSeek keeps in the MTP layer: same values as the main tensor (drawn under its name).
def _value_source(name: str) -> str:
    if name.endswith(".embed_tokens.weight"):
        return "model.embed_tokens.weight"
    if name.endswith(".shared_head.head.weight"):
        return "lm_head.weight"
    return name


# ------------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------------
def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The float32 values of one tensor (deterministic in (seed, name))."""
    gen = torch.Generator().manual_seed(_tensor_seed(seed, _value_source(spec.name)))
    x = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.init == "matrix":  # unit-variance outputs for unit-variance inputs
        return x / math.sqrt(spec.shape[-1])
    if spec.init == "embed":  # hidden states start O(1)
        return x
    if spec.init == "norm":
        return 1.0 + 0.1 * x
    if spec.init == "noise":
        return 0.1 * x
    if spec.init == "router_bias":  # sigmoid scores are in (0, 1); the bias shifts selection a bit
        return 0.05 * x
    raise AssertionError(spec.init)


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
def _fit_indexer_types(raw: dict[str, Any], explicit: bool) -> None:
    """Keep an explicit `indexer_types` list consistent with num_hidden_layers (after overrides).

    Presets with an index_topk_freq/offset rule re-derive the list from it (HF's rule, so trimming
    GLM-5.3 keeps its real schedule prefix); otherwise the list's pattern is repeated or cut.
    """
    types = raw.get("indexer_types")
    n = raw["num_hidden_layers"]
    if explicit or not isinstance(types, list) or len(types) == n:
        return
    if "index_topk_freq" in raw and "index_skip_topk_offset" in raw:
        freq = max(int(raw["index_topk_freq"]), 1)
        offset = int(raw["index_skip_topk_offset"])
        raw["indexer_types"] = [
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)
        ]
    else:
        raw["indexer_types"] = [types[i % len(types)] for i in range(n)]


def build_config(
    preset: str, *, fp8: bool = False, with_mtp: bool = True,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config.json dict of a checkpoint: the preset, the overrides, then MTP/FP8 switches.

    Raises ConfigError (naming the field) when the result is not a valid model config.
    """
    try:
        raw = preset_config(preset)
    except KeyError as e:
        raise ConfigError(f"--preset: {e.args[0]}") from None
    overrides = dict(overrides or {})
    raw.update(overrides)
    _fit_indexer_types(raw, explicit="indexer_types" in overrides)
    if not with_mtp:
        raw["num_nextn_predict_layers"] = 0
    if fp8:
        raw["quantization_config"] = dict(DEEPSEEK_V3_2["quantization_config"])
    else:
        raw.pop("quantization_config", None)
    if raw.get("torch_dtype", "bfloat16") not in _DTYPES:
        raise ConfigError(
            f"torch_dtype: expected one of {sorted(_DTYPES)}, got {raw['torch_dtype']!r}"
        )
    if raw.get("vocab_size", 0) < TINY_VOCAB_SIZE:  # the written tokenizer must fit the embedding
        raise ConfigError(f"vocab_size: must be >= {TINY_VOCAB_SIZE} (the tiny tokenizer's size)")
    ModelConfig.from_hf(raw)  # validate once, before writing anything
    return raw


# ------------------------------------------------------------------------------------------------
# Sharding
# ------------------------------------------------------------------------------------------------
def assign_shards(sizes: Sequence[int], num_shards: int) -> list[int]:
    """Split tensors (in order) into `num_shards` contiguous, non-empty runs of similar byte size.

        sizes:   |■■■■■■■■|■■|■■■|■■■■■|■|■■■■|    tensor i starts at byte offset o_i
        shard:   0        0  0   1     1 1         s_i = floor(o_i · N / total), then clamped so
                                                   that s is non-decreasing, steps by at most 1,
                                                   and reaches N-1 by the last tensor.
    """
    n_tensors = len(sizes)
    if not 1 <= num_shards <= n_tensors:
        raise ValueError(f"num_shards: must be in [1, {n_tensors}] (one tensor at least per shard)")
    total = max(sum(sizes), 1)
    shards, offset, prev = [], 0, 0
    for i, size in enumerate(sizes):
        s = min(offset * num_shards // total, num_shards - 1)
        s = max(min(s, prev + 1), prev, num_shards - (n_tensors - i))
        shards.append(s)
        prev, offset = s, offset + size
    return shards


def _shard_file(k: int, num_shards: int) -> str:
    if num_shards == 1:
        return "model.safetensors"
    return f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"


def _stored_tensors(
    spec: TensorSpec, seed: int, dtype: torch.dtype, fp8: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    w = make_tensor(spec, seed)
    if spec.fp32:
        yield spec.name, w
    elif fp8 and spec.quantizable:
        wq, scale = quantize_blocks(w)
        yield spec.name, wq
        yield spec.name + "_scale_inv", scale
    else:
        yield spec.name, w.to(dtype)


def _stored_nbytes(spec: TensorSpec, dtype: torch.dtype, fp8: bool) -> int:
    numel = math.prod(spec.shape)
    if spec.fp32:
        return numel * 4
    if fp8 and spec.quantizable:
        out_dim, in_dim = spec.shape
        return numel + 4 * -(-out_dim // FP8_BLOCK) * -(-in_dim // FP8_BLOCK)
    return numel * dtype.itemsize


# ------------------------------------------------------------------------------------------------
# The checkpoint
# ------------------------------------------------------------------------------------------------
def make_model(
    preset: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    fp8: bool = False,
    with_mtp: bool = True,
    num_shards: int = 2,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a deterministic random HF-format checkpoint of `preset` into `out_dir`; return it.

    `overrides` are merged into the preset's config.json (e.g. {"num_hidden_layers": 2,
    "n_routed_experts": 8} to fit GLM-5.3's shapes on one GPU); `indexer_types` follows the layer
    count. Shards are written one at a time, so peak memory is about one shard.
    """
    raw = build_config(preset, fp8=fp8, with_mtp=with_mtp, overrides=overrides)
    cfg = ModelConfig.from_hf(raw)
    dtype = _DTYPES[raw.get("torch_dtype", "bfloat16")]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    specs = checkpoint_specs(cfg)
    shard_of = assign_shards([_stored_nbytes(s, dtype, fp8) for s in specs], num_shards)
    weight_map: dict[str, str] = {}
    total_size = 0
    for k in range(num_shards):
        tensors: dict[str, torch.Tensor] = {}
        for spec, shard in zip(specs, shard_of, strict=True):
            if shard == k:
                tensors.update(_stored_tensors(spec, seed, dtype, fp8))
        fname = _shard_file(k, num_shards)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total_size += t.numel() * t.element_size()
        del tensors
    if num_shards > 1:
        index = {"metadata": {"total_size": total_size},
                 "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out / "model.safetensors.index.json", index)

    _write_json(out / "config.json", raw)
    generation = {"_from_model_config": True, "bos_token_id": raw.get("bos_token_id"),
                  "eos_token_id": raw.get("eos_token_id")}
    if raw.get("pad_token_id") is not None:
        generation["pad_token_id"] = raw["pad_token_id"]
    _write_json(out / "generation_config.json", generation)
    build_tiny_tokenizer(out, model_max_length=cfg.max_position_embeddings)
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------------
# CLI: `dsaserve make-model` and `python -m dsaserve.model.make_model`
# ------------------------------------------------------------------------------------------------
def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny-glm5", choices=[*TINY_PRESETS, *REAL_PRESETS],
                   help="model shapes (default: tiny-glm5)")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    p.add_argument("--fp8", action="store_true",
                   help="store matrices as FP8 e4m3 with 128x128 block scales (weight_scale_inv)")
    p.add_argument("--no-mtp", dest="with_mtp", action="store_false",
                   help="omit the MTP layer (num_nextn_predict_layers = 0)")
    p.add_argument("--num-shards", type=int, default=2, help="safetensors files (default: 2)")
    p.add_argument("--overrides", default=None, metavar="JSON",
                   help='config.json keys to override, e.g. \'{"num_hidden_layers": 2}\'')
    p.add_argument("out", metavar="OUT", help="output directory")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `make-model` on the top-level CLI's subparsers."""
    p = subparsers.add_parser("make-model", help="write a deterministic random checkpoint",
                              description=__doc__.splitlines()[0])
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        overrides = json.loads(args.overrides) if args.overrides else None
        if overrides is not None and not isinstance(overrides, dict):
            raise ConfigError("--overrides: expected a JSON object")
        out = make_model(args.preset, args.out, seed=args.seed, fp8=args.fp8,
                         with_mtp=args.with_mtp, num_shards=args.num_shards, overrides=overrides)
    except json.JSONDecodeError as e:
        print(f"error: --overrides: invalid JSON ({e})", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsaserve.model.make_model",
                                description=__doc__.splitlines()[0])
    _add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
