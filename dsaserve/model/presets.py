"""Model presets as Hugging Face `config.json` dicts.

Real shapes (GLM-5.3, DeepSeek-V3.2) serve the cost model and GPU benchmarks; tiny shapes are the
built-in default model everywhere (`dsaserve make-model --preset tiny-glm5 OUT`). The tiny models
keep the real attention row widths (512-wide latent, 64-wide RoPE key, 128-wide indexer keys) so
that the 656-byte fp8_ds_mla rows and 132-byte indexer keys are exercised byte for byte, and 16
indexer heads so that indexer ties are rare.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

# GLM-5.2/5.3 (`glm_moe_dsa`): MODEL_SPEC.md §1.2. IndexShare: full = {0,1,2,6,10,...,74}.
_GLM_FULL = {0, 1, 2} | set(range(6, 78, 4))
GLM_5_3: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "head_dim": 192,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "index_topk_pattern": None,
    "indexer_types": ["full" if i in _GLM_FULL else "shared" for i in range(78)],
    "index_share_for_mtp_iteration": True,
    "rope_interleave": True,
    "indexer_rope_interleave": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8e6},
    "max_position_embeddings": 1048576,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_router_dtype": "float32",
    "rms_norm_eps": 1e-5,
    "num_nextn_predict_layers": 1,
    "eos_token_id": [154820, 154827, 154829],
    "pad_token_id": 154820,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V3.2 (`deepseek_v32`): MODEL_SPEC.md §1.1, legacy rope_theta + rope_scaling layout.
DEEPSEEK_V3_2: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 163840,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
    },
}

_TINY_COMMON: dict[str, Any] = {
    # The tiny tokenizer (dsaserve.tokenizer) has 512 entries; ids 0..3 are its special tokens.
    "vocab_size": 512,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}

TINY_GLM5: dict[str, Any] = {
    **_TINY_COMMON,
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "n_group": 1,
    "topk_group": 1,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8e6},
    # IndexShare: layers 1 and 3 reuse the top-k of layers 0 and 2.
    "indexer_types": ["full", "shared", "full", "shared"],
    "index_share_for_mtp_iteration": True,
    "indexer_rope_interleave": True,
    "rope_interleave": True,
}

TINY_DSV32: dict[str, Any] = {
    **_TINY_COMMON,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "n_group": 4,
    "topk_group": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
}

REAL_PRESETS: dict[str, dict[str, Any]] = {"glm-5.3": GLM_5_3, "deepseek-v3.2": DEEPSEEK_V3_2}
TINY_PRESETS: dict[str, dict[str, Any]] = {"tiny-glm5": TINY_GLM5, "tiny-dsv32": TINY_DSV32}

# The trained tiny model shipped inside the package (`dsaserve train-tiny`, docs/trained_model.md):
# a glm_moe_dsa checkpoint that writes Python. The default of `generate`, `serve` and `make demo`;
# the random presets above stay for tests.
TRAINED_MODEL = "tiny-trained"
DEFAULT_MODEL = TRAINED_MODEL


def trained_model_dir() -> Path:
    """The shipped trained checkpoint's directory (package data)."""
    return Path(__file__).parent / "tiny_trained"


def glm53_shaped(num_layers: int, num_experts: int = 8, mtp: bool = False) -> dict[str, Any]:
    """Overrides of the glm-5.3 preset for a GPU test model: the real attention and indexer
    dimensions (64 heads, 576/512 latent, 32 × 128 indexer, top-2048) with few layers and
    experts, a small vocabulary, and the MTP layer only when `mtp` (for
    `make_model(..., overrides=)`)."""
    return {"num_hidden_layers": num_layers, "n_routed_experts": num_experts,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "vocab_size": 8192,
            "num_nextn_predict_layers": int(mtp), "torch_dtype": "bfloat16"}


def preset_config(name: str) -> dict[str, Any]:
    """A deep copy of a preset's config.json dict (callers may edit it)."""
    table = {**REAL_PRESETS, **TINY_PRESETS}
    if name not in table:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(table)}")
    return copy.deepcopy(table[name])
