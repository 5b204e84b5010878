"""Config parsing: both rope layouts, HF defaults for absent keys, IndexShare schedules, errors."""

from __future__ import annotations

import json

import pytest

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from dsaserve.model.presets import preset_config


def test_glm53_indexshare_schedule_and_scale():
    cfg = ModelConfig.from_hf(preset_config("glm-5.3"))
    assert cfg.full_indexer_layers == (0, 1, 2, *range(6, 78, 4))
    assert len(cfg.full_indexer_layers) == 21
    assert cfg.has_indexer(78)  # the MTP layer has its own indexer
    assert cfg.softmax_scale == 256**-0.5
    assert cfg.kv_cache_width == 576


def test_indexer_types_fallbacks_follow_hf():
    raw = preset_config("glm-5.3")
    del raw["indexer_types"]
    # freq 4, offset 3 (the config's own keys) reproduce the explicit list ...
    assert ModelConfig.from_hf(raw).full_indexer_layers == (0, 1, 2, *range(6, 78, 4))
    # ... while vLLM's default offset 2 would give a different set (MODEL_SPEC §1.2).
    del raw["index_skip_topk_offset"]
    assert ModelConfig.from_hf(raw).full_indexer_layers[:3] == (0, 1, 5)
    raw["index_topk_pattern"] = "FS" * 39
    assert ModelConfig.from_hf(raw).full_indexer_layers == tuple(range(0, 78, 2))


def test_deepseek_legacy_and_new_rope_layouts_agree():
    legacy = preset_config("deepseek-v3.2")
    new = dict(legacy)
    scaling = dict(new.pop("rope_scaling"))
    scaling["rope_type"] = scaling.pop("type")
    scaling["rope_theta"] = new.pop("rope_theta")
    new["rope_parameters"] = scaling
    a, b = ModelConfig.from_hf(legacy), ModelConfig.from_hf(new)
    assert a.rope == b.rope
    assert a.softmax_scale == pytest.approx(0.135234, abs=1e-6)
    assert not a.indexer_rope_interleave  # NeoX in DeepSeek's indexer


def test_absent_optional_keys_take_model_type_defaults():
    raw = {"model_type": "deepseek_v32", "num_hidden_layers": 2}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.n_group, cfg.topk_group, cfg.index_n_heads) == (8, 4, 64)
    assert cfg.indexer_types == ("full", "full")
    assert cfg.num_nextn_predict_layers == 0 and not cfg.has_mtp
    glm = ModelConfig.from_hf({"model_type": "glm_moe_dsa", "num_hidden_layers": 3})
    assert glm.indexer_rope_interleave and glm.rope.theta == 10000.0


@pytest.mark.parametrize("field,value,needle", [
    ("model_type", "llama", "model_type"),
    ("indexer_types", ["full"], "indexer_types"),
    ("hidden_size", 0, "hidden_size"),
    ("scoring_func", "softmax", "scoring_func"),
    ("n_group", 3, "n_group"),
    ("rope_scaling", {"type": "longrope", "factor": 2}, "rope_type"),
])
def test_errors_name_the_field(field, value, needle):
    raw = preset_config("tiny-dsv32")
    raw[field] = value
    if field == "rope_scaling":
        raw.pop("rope_parameters", None)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf(raw)


def test_from_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="invalid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny-glm5")))
    assert ModelConfig.from_file(tmp_path).model_type == "glm_moe_dsa"


def test_engine_side_configs_name_their_flag():
    with pytest.raises(ConfigError, match="--block-size"):
        CacheConfig(block_size=48)
    with pytest.raises(ConfigError, match="--kv-cache-dtype"):
        CacheConfig(kv_cache_dtype="fp8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--max-num-seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="--dcp-comm-backend"):
        ParallelConfig(dcp_comm_backend="nccl")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--attention-config"):
        AttentionConfig.from_json('{"sparse_mla_force_mqa": 1}')
    with pytest.raises(ConfigError, match="unknown keys"):
        AttentionConfig.from_json('{"foo": true}')
    assert AttentionConfig.from_json('{"sparse_mla_force_mqa": true}').sparse_mla_force_mqa


def test_expert_parallel_sizes_and_divisibility():
    """EP shards the routed experts over the engine's ranks, and with DP over every replica's
    (vLLM's DP + EP); a layout that cannot cut them evenly is a ConfigError naming the flag,
    raised when the engine's config is built (not in its workers)."""
    p = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, enable_expert_parallel=True)
    assert p.ep_spans_replicas and p.expert_parallel_size == 8
    assert ParallelConfig(data_parallel_size=4).expert_parallel_size == 1
    assert not ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).ep_spans_replicas
    model = ModelConfig.from_hf(preset_config("glm-5.3"))  # 256 experts
    EngineConfig("unused", model, parallel=p)
    with pytest.raises(ConfigError, match=r"--enable-expert-parallel: 6 ranks \(3 replicas × 2\)"):
        EngineConfig("unused", model, parallel=ParallelConfig(
            tensor_parallel_size=2, data_parallel_size=3, enable_expert_parallel=True))
    with pytest.raises(ConfigError, match="--tensor-parallel-size: 3 does not divide"):
        EngineConfig("unused", model, parallel=ParallelConfig(tensor_parallel_size=3))
