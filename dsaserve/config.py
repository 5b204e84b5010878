"""The frozen configuration tree.

Every component receives only the part it uses. Configs are validated once, when built, and never
mutated afterwards. `ModelConfig.from_hf` reads a Hugging Face `config.json` in any layout found
in the wild (legacy `rope_theta` + `rope_scaling`, or `rope_parameters`; optional keys absent).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dsaserve.spec import draft_vocab

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the field."""


def json_object(text: str, flag: str) -> dict[str, Any]:
    """A flag's JSON object (vLLM's --*-config flags); ConfigError naming the flag otherwise."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag}: expected a JSON object")
    return raw


# Defaults of the Hugging Face config classes (transformers 5.23) for keys a config.json may omit.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm_moe_dsa": dict(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=78, num_attention_heads=64, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
        v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=202752, rms_norm_eps=1e-5, bos_token_id=0,
        eos_token_id=1, tie_word_embeddings=False, index_topk=2048, index_head_dim=128,
        index_n_heads=32, first_k_dense_replace=3, topk_method="noaux_tc", scoring_func="sigmoid",
        # GLM uses interleaved RoPE in the indexer (HF hard-wires it; the config key says so too).
        indexer_rope_interleave=True, index_skip_topk_offset=2, index_topk_freq=1,
        num_nextn_predict_layers=0, index_share_for_mtp_iteration=False, hidden_act="silu",
    ),
    "deepseek_v32": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0,
        eos_token_id=1, tie_word_embeddings=False, index_topk=2048, index_head_dim=128,
        index_n_heads=64, first_k_dense_replace=3, topk_method="noaux_tc", scoring_func="sigmoid",
        # DeepSeek-V3.2's indexer uses NeoX (half-split) RoPE; its MLA uses interleaved.
        indexer_rope_interleave=False, index_skip_topk_offset=2, index_topk_freq=1,
        num_nextn_predict_layers=0, index_share_for_mtp_iteration=False, hidden_act="silu",
    ),
}
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies; `rope_type` is "default" or "yarn" (DeepSeek's variant)."""

    rope_type: str = "default"
    theta: float = _DEFAULT_ROPE_THETA
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def from_hf(raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"rope_parameters: expected an object, got {type(params).__name__}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA)))
        if rope_type == "default":
            return RopeConfig(theta=theta)
        if rope_type != "yarn":
            raise ConfigError(f"rope_parameters.rope_type: unsupported value {rope_type!r}")
        orig = params.get("original_max_position_embeddings")
        if orig is None:
            raise ConfigError(
                "rope_parameters.original_max_position_embeddings is required for yarn"
            )
        factor = params.get("factor") or max_position_embeddings / orig
        return RopeConfig(
            rope_type="yarn",
            theta=theta,
            factor=float(factor),
            original_max_position_embeddings=int(orig),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 1.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )

    @property
    def softmax_scale_multiplier(self) -> float:
        """YaRN's m² correction of the attention softmax scale (1.0 without YaRN)."""
        if self.rope_type != "yarn" or not self.mscale_all_dim or self.factor <= 1:
            return 1.0
        m = 0.1 * self.mscale_all_dim * math.log(self.factor) + 1.0
        return m * m


@dataclass(frozen=True)
class FP8WeightConfig:
    """Block-quantized FP8 weights (`weight_scale_inv` per 128×128 block)."""

    block_size: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DSA model (both families share it); see MODEL_SPEC.md §1–2."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per layer
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]  # "full" | "shared" per layer
    indexer_rope_interleave: bool
    num_nextn_predict_layers: int
    index_share_for_mtp_iteration: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_word_embeddings: bool
    torch_dtype: str = "bfloat16"
    fp8_weights: FP8WeightConfig | None = None
    # Epsilon of q_a_layernorm / kv_a_layernorm: HF and the DeepSeek reference use 1e-6 whatever
    # rms_norm_eps says (vLLM uses rms_norm_eps); we follow the independent references.
    latent_norm_eps: float = 1e-6
    # LayerNorm eps of the indexer's k_norm (hard-coded 1e-6 everywhere).
    index_k_norm_eps: float = 1e-6

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Width of one cached MLA row: latent + RoPE key (576 for the real models)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(nope + rope) times YaRN's m² (not 1/sqrt(576))."""
        return self.qk_head_dim**-0.5 * self.rope.softmax_scale_multiplier

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def mtp_layer_index(self) -> int:
        return self.num_hidden_layers

    def is_moe_layer(self, layer: int) -> bool:
        if layer >= self.num_hidden_layers:  # the MTP layer is a MoE layer
            return True
        return self.mlp_layer_types[layer] == "sparse"

    def has_indexer(self, layer: int) -> bool:
        """Whether `layer` runs its own indexer and keeps index keys (the MTP layer does)."""
        if layer >= self.num_hidden_layers:
            return True
        return self.indexer_types[layer] == "full"

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.has_indexer(i))

    # ---- construction -------------------------------------------------------------------------
    @staticmethod
    def from_hf(raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json; missing optional keys take HF's defaults."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type: {model_type!r} is not supported "
                f"(expected one of {SUPPORTED_MODEL_TYPES})"
            )
        d = dict(_HF_DEFAULTS[model_type])
        d.update({k: v for k, v in raw.items() if v is not None or k in ("q_lora_rank",)})

        def need_int(key: str, minimum: int = 1) -> int:
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
                raise ConfigError(f"{key}: expected an integer >= {minimum}, got {v!r}")
            return v

        n_layers = need_int("num_hidden_layers")
        if d.get("q_lora_rank") is None:
            raise ConfigError("q_lora_rank: models without q-LoRA are not supported")
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_dense = min(need_int("first_k_dense_replace", 0), n_layers)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        if len(mlp_types) != n_layers or any(t not in ("dense", "sparse") for t in mlp_types):
            raise ConfigError(f"mlp_layer_types: expected {n_layers} of 'dense'/'sparse'")
        indexer_types = _indexer_types(d, n_layers)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_pos = need_int("max_position_embeddings")
        quant = d.get("quantization_config")
        fp8 = None
        if quant:
            method = quant.get("quant_method", quant.get("dtype"))
            if method != "fp8":
                raise ConfigError(f"quantization_config.quant_method: unsupported {method!r}")
            fp8 = FP8WeightConfig(tuple(quant.get("weight_block_size", (128, 128))))
        cfg = ModelConfig(
            model_type=model_type,
            vocab_size=need_int("vocab_size"),
            hidden_size=need_int("hidden_size"),
            intermediate_size=need_int("intermediate_size"),
            moe_intermediate_size=need_int("moe_intermediate_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=need_int("num_attention_heads"),
            q_lora_rank=need_int("q_lora_rank"),
            kv_lora_rank=need_int("kv_lora_rank"),
            qk_nope_head_dim=need_int("qk_nope_head_dim"),
            qk_rope_head_dim=need_int("qk_rope_head_dim"),
            v_head_dim=need_int("v_head_dim"),
            n_routed_experts=need_int("n_routed_experts"),
            n_shared_experts=need_int("n_shared_experts", 0),
            num_experts_per_tok=need_int("num_experts_per_tok"),
            n_group=need_int("n_group"),
            topk_group=need_int("topk_group"),
            routed_scaling_factor=float(d["routed_scaling_factor"]),
            norm_topk_prob=bool(d["norm_topk_prob"]),
            mlp_layer_types=tuple(mlp_types),
            rms_norm_eps=float(d["rms_norm_eps"]),
            rope=RopeConfig.from_hf(raw, max_pos),
            max_position_embeddings=max_pos,
            index_n_heads=need_int("index_n_heads"),
            index_head_dim=need_int("index_head_dim"),
            index_topk=need_int("index_topk"),
            indexer_types=indexer_types,
            indexer_rope_interleave=bool(d["indexer_rope_interleave"]),
            num_nextn_predict_layers=need_int("num_nextn_predict_layers", 0),
            index_share_for_mtp_iteration=bool(d["index_share_for_mtp_iteration"]),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            fp8_weights=fp8,
        )
        cfg._validate(d)
        return cfg

    @staticmethod
    def from_file(path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"config.json not found at {path}") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON ({e})") from e
        return ModelConfig.from_hf(raw)

    def _validate(self, d: dict[str, Any]) -> None:
        if d.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(
                f"topk_method: only 'noaux_tc' is supported, got {d['topk_method']!r}"
            )
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(
                f"scoring_func: only 'sigmoid' is supported, got {d['scoring_func']!r}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is supported, got {d['hidden_act']!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim: must be even")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError("index_head_dim: must be at least qk_rope_head_dim")
        if self.n_routed_experts % self.n_group:
            raise ConfigError("n_group: must divide n_routed_experts")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError("topk_group: must be between 1 and n_group")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("num_experts_per_tok: larger than n_routed_experts")
        if self.indexer_types and self.indexer_types[0] != "full":
            raise ConfigError("indexer_types[0]: the first layer must be 'full' (nothing to share)")


def _indexer_types(d: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    """IndexShare schedule: explicit list, else the F/S pattern, else freq/offset (HF's rule)."""
    types = d.get("indexer_types")
    if types is None:
        pattern = d.get("index_topk_pattern")
        if pattern is not None:
            try:
                types = [{"F": "full", "S": "shared"}[c] for c in pattern]
            except KeyError as e:
                raise ConfigError(f"index_topk_pattern: unexpected letter {e}") from None
        else:
            freq = max(int(d.get("index_topk_freq", 1)), 1)
            offset = int(d.get("index_skip_topk_offset", 2))
            types = [
                "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)
            ]
    types = tuple(types)
    if len(types) != n_layers or any(t not in ("full", "shared") for t in types):
        raise ConfigError(f"indexer_types: expected {n_layers} entries of 'full'/'shared'")
    return types


# ------------------------------------------------------------------------------------------------
# Engine-side configs
# ------------------------------------------------------------------------------------------------
KVCacheDType = Literal["auto", "fp8_ds_mla"]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. `auto` stores latent+RoPE rows (and indexer keys) in the model dtype;
    `fp8_ds_mla` stores 656-byte rows and 132-byte FP8 indexer keys, as FlashMLA and DeepGEMM
    expect."""

    block_size: int = 64
    kv_cache_dtype: KVCacheDType = "auto"
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(
                f"--block-size: must be a positive power of two, got {self.block_size}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8_ds_mla"):
            raise ConfigError(
                f"--kv-cache-dtype: expected 'auto' or 'fp8_ds_mla', got {self.kv_cache_dtype!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization: must be in (0, 1]")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ConfigError("--num-gpu-blocks-override: must be >= 1")

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8_ds_mla"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    # --async-scheduling: step k + 1 is scheduled while step k runs; its inputs that continue
    # from step k are taken from step k's samples on the device (docs/decode.md)
    async_scheduling: bool = False
    # --max-logprobs: the largest SamplingParams.logprobs a request may ask for (vLLM's 20)
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1")
        if self.max_logprobs < 0:
            raise ConfigError("--max-logprobs: must be >= 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "--max-num-batched-tokens: must be >= --max-model-len without chunked prefill"
            )


@dataclass(frozen=True)
class AttentionConfig:
    """`--attention-config` JSON. `sparse_mla_force_mqa` makes every token use the absorbed sparse
    path; when off, prompts whose queries all see <= top-k keys take the dense path."""

    backend: str = "reference"
    sparse_mla_force_mqa: bool = False
    # hisparse_config.device_buffer_size: hot-buffer rows per request (None: the default)
    hisparse_device_buffer_size: int | None = None
    # hisparse_config.device_mla_pages: GPU pages of the MLA cache (None: one per KV block, no
    # spilling); fewer than the blocks makes long decoders' older MLA pages spill to the host
    # pool (kv/hisparse/mla_pages.py); "auto": sized by the runner from the host-admitted
    # concurrency and the KV budget (kv/hisparse/admission.py: size_mla_pages)
    hisparse_device_mla_pages: int | Literal["auto"] | None = None
    hisparse_config_given: bool = False  # whether hisparse_config was in the JSON

    @staticmethod
    def from_json(text: str | None, backend: str = "reference") -> AttentionConfig:
        if not text:
            return AttentionConfig(backend=backend)
        flag = "--attention-config"
        raw = json_object(text, flag)
        known = {"backend", "sparse_mla_force_mqa", "hisparse_config"}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"{flag}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        force = raw.get("sparse_mla_force_mqa", False)
        if not isinstance(force, bool):
            raise ConfigError(f"{flag}: sparse_mla_force_mqa must be true or false")
        hs = raw.get("hisparse_config")
        size = pages = None
        if hs is not None:
            if not isinstance(hs, dict) or set(hs) - {"device_buffer_size", "device_mla_pages"}:
                raise ConfigError(f"{flag}: hisparse_config must be an object with only "
                                  "device_buffer_size and device_mla_pages")
            size = hs.get("device_buffer_size")
            if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                     or not 1 <= size <= HISPARSE_MAX_BUFFER_ROWS):
                raise ConfigError(f"{flag}: hisparse_config.device_buffer_size must be an "
                                  f"integer in [1, {HISPARSE_MAX_BUFFER_ROWS}], got {size!r}")
            pages = hs.get("device_mla_pages")
            if pages is not None and pages != "auto" and (
                    isinstance(pages, bool) or not isinstance(pages, int) or pages < 1):
                raise ConfigError(f"{flag}: hisparse_config.device_mla_pages must be a positive "
                                  f"integer or \"auto\", got {pages!r}")
        return AttentionConfig(backend=str(raw.get("backend", backend)), sparse_mla_force_mqa=force,
                               hisparse_device_buffer_size=size,
                               hisparse_device_mla_pages=pages,
                               hisparse_config_given=hs is not None)


@dataclass(frozen=True)
class CompilationConfig:
    """`--compilation-config` JSON (vLLM's flag; only `cudagraph_capture_sizes` is read) and
    `--enforce-eager`. Capture sizes count tokens of a decode batch (requests × (1 + drafts));
    None: the default buckets up to the largest decode batch (engine/cudagraph.py)."""

    cudagraph_capture_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False

    @staticmethod
    def from_json(text: str | None, enforce_eager: bool = False) -> CompilationConfig:
        flag = "--compilation-config"
        if not text:
            return CompilationConfig(enforce_eager=enforce_eager)
        raw = json_object(text, flag)
        known = {"cudagraph_capture_sizes"}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"{flag}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        sizes = raw.get("cudagraph_capture_sizes")
        if sizes is not None:
            if not isinstance(sizes, list) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
                raise ConfigError(f"{flag}: cudagraph_capture_sizes must be a list of integers "
                                  f">= 1, got {sizes!r}")
            sizes = tuple(sorted(set(sizes)))
        return CompilationConfig(cudagraph_capture_sizes=sizes, enforce_eager=enforce_eager)


@dataclass(frozen=True)
class ParallelConfig:
    """world = dp × pcp × tp; dcp is a view over pcp (or tp) ranks, never extra ranks."""

    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    dcp_comm_backend: Literal["ag_rs", "a2a"] = "ag_rs"
    cp_kv_cache_interleave_size: int = 1

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
            "data_parallel_size",
            "cp_kv_cache_interleave_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1")
        if self.dcp_comm_backend not in ("ag_rs", "a2a"):
            raise ConfigError("--dcp-comm-backend: expected 'ag_rs' or 'a2a'")
        self._validate_layout()

    def _validate_layout(self) -> None:
        """The layout rules (as vLLM enforces them for these models); the message names the rule."""
        pcp, dcp, tp = (
            self.prefill_context_parallel_size,
            self.decode_context_parallel_size,
            self.tensor_parallel_size,
        )
        if dcp > 1 and pcp > 1 and dcp != pcp:
            raise ConfigError(
                f"--decode-context-parallel-size: with PCP the DCP group is the PCP group, so dcp "
                f"must equal --prefill-context-parallel-size ({pcp}), got {dcp}"
            )
        if dcp > 1 and pcp > 1 and self.dcp_comm_backend != "ag_rs":
            raise ConfigError("--dcp-comm-backend: PCP × DCP supports only 'ag_rs'")
        if dcp > 1 and pcp == 1 and dcp != tp:
            raise ConfigError(
                f"--decode-context-parallel-size: without PCP, DCP reuses the TP ranks, so dcp "
                f"must equal --tensor-parallel-size ({tp}), got {dcp}"
            )
        if self.cp_kv_cache_interleave_size > 1 and dcp == 1:
            raise ConfigError("--cp-kv-cache-interleave-size: only meaningful with DCP > 1")

    @property
    def world_size(self) -> int:
        """Ranks of ONE engine replica (pcp × tp); the deployment has data_parallel_size of them."""
        return self.prefill_context_parallel_size * self.tensor_parallel_size

    @property
    def ep_spans_replicas(self) -> bool:
        """DP + EP (vLLM's `--data-parallel-size N --enable-expert-parallel`): the routed experts
        are sharded over every rank of every replica, so the replicas step in lock-step
        (engine/dp.py); otherwise replicas share nothing."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are sharded over (1 without EP)."""
        if not self.enable_expert_parallel:
            return 1
        return self.world_size * (self.data_parallel_size if self.ep_spans_replicas else 1)


RejectionSampleMethod = Literal["standard", "synthetic"]
DraftLmHead = Literal["auto", "fp8", "model"]
DRAFT_LM_HEADS: tuple[DraftLmHead, ...] = ("auto", "fp8", "model")


@dataclass(frozen=True)
class SpecConfig:
    """`--speculative-config` JSON (vLLM's keys): MTP drafting of `num_speculative_tokens` tokens
    per step with the model's one MTP layer reused autoregressively, verified by the target.

    `rejection_sample_method` "standard" keeps the target's output distribution exactly (greedy:
    the same tokens). "synthetic" (benchmarks only, not output-faithful) accepts draft i with a
    fixed conditional probability whatever the target says; give exactly one of
    `synthetic_acceptance_length` (mean tokens per step, in [1, k + 1]) or
    `synthetic_acceptance_rates` (k non-increasing unconditional rates: entry i = P(the first
    i + 1 drafts are all accepted)). Both are normalised to `synthetic_acceptance_rates` here.

    `draft_lm_head` (dsaserve's key): the head the drafts' argmax reads. "fp8": a block-FP8
    copy of lm_head made at load (half the bytes a draft reads: GLM-5.3's 1.9 GB bf16 head →
    0.95 GB, at the cost of that much memory); "model": the checkpoint's lm_head; "auto" (the
    default): "fp8" where the engine keeps the checkpoint's FP8 weights, else "model". The
    target's logits always use lm_head, so output is unchanged; a draft can differ only where
    the MTP's top two logits lie within the quantization error (acceptance, not output).

    `draft_vocab` (dsaserve's key; SGLang's --speculative-token-map): a JSON file listing the
    token ids drafts may propose (`dsaserve draft-vocab` writes one of the N most frequent in
    a text); the drafts' head keeps only those rows (spec/draft_vocab.py). Held here as the
    ids, ascending; None: every token.
    """

    method: Literal["mtp"] = "mtp"
    num_speculative_tokens: int = 1
    rejection_sample_method: RejectionSampleMethod = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    draft_lm_head: DraftLmHead = "auto"
    draft_vocab: tuple[int, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        flag = "--speculative-config"
        if self.method != "mtp":
            raise ConfigError(f"{flag}: method must be 'mtp', got {self.method!r}")
        if self.draft_lm_head not in DRAFT_LM_HEADS:
            raise ConfigError(f"{flag}: draft_lm_head must be one of {list(DRAFT_LM_HEADS)}, "
                              f"got {self.draft_lm_head!r}")
        vocab = self.draft_vocab
        if vocab is not None and not (vocab and vocab[0] >= 0 and all(
                a < b for a, b in zip(vocab, vocab[1:], strict=False))):
            raise ConfigError(f"{flag}: draft_vocab must hold token ids, ascending, none twice")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"{flag}: num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.rejection_sample_method not in ("standard", "synthetic"):
            raise ConfigError(f"{flag}: rejection_sample_method must be 'standard' or "
                              f"'synthetic', got {self.rejection_sample_method!r}")
        rates = self.synthetic_acceptance_rates
        if (rates is not None) != (self.rejection_sample_method == "synthetic"):
            raise ConfigError(f"{flag}: synthetic acceptance rates go with (and only with) "
                              "rejection_sample_method 'synthetic'")
        if rates is not None:
            if len(rates) != k:
                raise ConfigError(f"{flag}: synthetic_acceptance_rates must have "
                                  f"num_speculative_tokens ({k}) entries, got {len(rates)}")
            if any(not 0.0 <= r <= 1.0 for r in rates):
                raise ConfigError(f"{flag}: synthetic_acceptance_rates must lie in [0, 1]")
            if any(b > a for a, b in zip(rates, rates[1:], strict=False)):
                raise ConfigError(f"{flag}: synthetic_acceptance_rates must be non-increasing "
                                  "(entry i is the chance that drafts 0..i are all accepted)")

    @property
    def synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    @property
    def conditional_rates(self) -> tuple[float, ...]:
        """P(draft i accepted | drafts 0..i−1 accepted) = p_i / p_{i−1} (p_{−1} = 1; 0 once a
        p is 0), as vLLM's unconditional_to_conditional_rates; synthetic mode only."""
        assert self.synthetic_acceptance_rates is not None
        out, prev = [], 1.0
        for p in self.synthetic_acceptance_rates:
            out.append(p / prev if prev > 0 else 0.0)
            prev = p
        return tuple(out)

    @staticmethod
    def acceptance_length_to_rates(length: float, k: int) -> tuple[float, ...]:
        """vLLM's minimum-variance schedule: d = length − 1 accepted drafts on average →
        [1]·floor(d) + [d − floor(d)] + [0]·rest, truncated to k (2.99, k = 3 → [1, .99, 0])."""
        d = length - 1.0
        whole = math.floor(d)
        rates = [1.0] * whole + [d - whole] + [0.0] * k
        return tuple(round(r, 12) for r in rates[:k])

    @staticmethod
    def from_json(text: str | None) -> SpecConfig | None:
        """Parse `--speculative-config`; None when absent. Errors name the flag."""
        flag = "--speculative-config"
        if not text:
            return None
        raw = json_object(text, flag)
        known = {"method", "num_speculative_tokens", "rejection_sample_method",
                 "synthetic_acceptance_length", "synthetic_acceptance_rates", "draft_lm_head",
                 "draft_vocab"}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"{flag}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ConfigError(f"{flag}: 'method' and 'num_speculative_tokens' are required")
        k = raw["num_speculative_tokens"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"{flag}: num_speculative_tokens must be an integer >= 1, got {k!r}")
        length = raw.get("synthetic_acceptance_length")
        rates = raw.get("synthetic_acceptance_rates")
        if length is not None and rates is not None:
            raise ConfigError(f"{flag}: give synthetic_acceptance_length or "
                              "synthetic_acceptance_rates, not both")
        if length is not None:
            if (not isinstance(length, (int, float)) or isinstance(length, bool)
                    or not 1.0 <= length <= k + 1):
                raise ConfigError(f"{flag}: synthetic_acceptance_length must be a number in "
                                  f"[1, num_speculative_tokens + 1 = {k + 1}], got {length!r}")
            rates = SpecConfig.acceptance_length_to_rates(float(length), k)
        elif rates is not None:
            if not isinstance(rates, list) or not all(
                    isinstance(r, (int, float)) and not isinstance(r, bool) for r in rates):
                raise ConfigError(f"{flag}: synthetic_acceptance_rates must be a list of numbers")
            rates = tuple(float(r) for r in rates)
        method = raw.get("rejection_sample_method", "standard")
        if method == "synthetic" and rates is None:
            raise ConfigError(f"{flag}: rejection_sample_method 'synthetic' needs "
                              "synthetic_acceptance_length or synthetic_acceptance_rates")
        vocab = raw.get("draft_vocab")
        if vocab is not None:
            if not isinstance(vocab, str):
                raise ConfigError(f"{flag}: draft_vocab must be the path of a JSON list of "
                                  f"token ids, got {vocab!r}")
            try:
                vocab = draft_vocab.read(vocab)
            except draft_vocab.DraftVocabError as e:
                raise ConfigError(f"{flag}: draft_vocab {e}") from e
        return SpecConfig(method=raw["method"], num_speculative_tokens=k,
                          rejection_sample_method=method, synthetic_acceptance_rates=rates,
                          draft_lm_head=raw.get("draft_lm_head", "auto"), draft_vocab=vocab)


def check_divisible(cfg: ModelConfig, p: ParallelConfig) -> None:
    """The layout cuts the model into equal parts: TP its heads and intermediates (and its
    vocabulary into parts of at least one row), EP its routed experts (over every replica's
    ranks with DP + EP)."""
    tp, ep = p.tensor_parallel_size, p.expert_parallel_size
    if tp > cfg.vocab_size:
        raise ConfigError(f"--tensor-parallel-size: {tp} ranks for a vocabulary of "
                          f"{cfg.vocab_size} tokens")
    if tp > 1:
        for name in ("num_attention_heads", "intermediate_size", "moe_intermediate_size"):
            if getattr(cfg, name) % tp:
                raise ConfigError(f"--tensor-parallel-size: {tp} does not divide {name} "
                                  f"({getattr(cfg, name)})")
    if p.enable_expert_parallel and cfg.n_routed_experts % ep:
        ranks = (f"{ep} ranks ({p.data_parallel_size} replicas × {p.world_size})"
                 if p.ep_spans_replicas else f"{ep} ranks")
        raise ConfigError(f"--enable-expert-parallel: {ranks} do not divide "
                          f"n_routed_experts ({cfg.n_routed_experts})")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; built once by the CLI or the tests."""

    model_path: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpecConfig | None = None  # None: no speculative decoding
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    offload: OffloadConfig = field(default_factory=lambda: OffloadConfig())
    hisparse: HiSparseConfig | None = None  # None: the MLA KV stays in GPU pages only
    disagg: DisaggConfig | None = None  # P/D: --kv-transfer-config with NixlConnector
    dtype: str = "auto"  # auto | bfloat16 | float32 (auto: the checkpoint's dtype)
    device: str = "cpu"
    seed: int = 0
    # FP8 checkpoints: keep the matrices in FP8 (model/fp8.py) or dequantize them at load. None:
    # keep them on CUDA, where the FP8 kernels read one byte per weight; dequantize elsewhere,
    # where the reference would dequantize every matrix at every step (tests pass True to run it).
    keep_fp8_weights: bool | None = None
    # --step-log: a file the engine appends one JSON line per step to (engine/step_log.py)
    step_log: str | None = None

    def __post_init__(self) -> None:
        interleave = self.parallel.cp_kv_cache_interleave_size
        if self.cache.block_size % interleave:
            raise ConfigError(
                f"--cp-kv-cache-interleave-size: {interleave} must divide --block-size "
                f"{self.cache.block_size}"
            )
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ConfigError(
                f"--dtype: expected auto, bfloat16, float16 or float32, got {self.dtype!r}"
            )
        self._check_host_memory()
        if self.offload.enabled and not self.cache.enable_prefix_caching:
            # The host tier finds blocks by the prefix cache's keys.
            raise ConfigError(f"{self.offload.flag}: needs --enable-prefix-caching")
        if self.scheduler.max_model_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len: {self.scheduler.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model.max_position_embeddings}"
            )
        self._validate_hisparse()
        check_divisible(self.model, self.parallel)
        if self.speculative is not None and not self.model.has_mtp:
            raise ConfigError(
                "--speculative-config: method 'mtp' needs a model with an MTP layer "
                "(num_nextn_predict_layers is 0 in its config.json)"
            )
        if self.speculative is not None and self.speculative.draft_vocab is not None:
            try:
                draft_vocab.check(self.speculative.draft_vocab, self.model.vocab_size,
                                  "draft_vocab")
            except draft_vocab.DraftVocabError as e:
                raise ConfigError(f"--speculative-config: {e}") from e

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per step (0 without speculative decoding)."""
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0

    @property
    def hisparse_buffer_rows(self) -> int:
        """Hot-buffer rows per request and layer: hisparse_config.device_buffer_size, by default
        (query rows + 1) × index_topk as vLLM (the union of every verify row's top-k plus one
        top-k of LRU slack)."""
        given = self.attention.hisparse_device_buffer_size
        if given is not None:
            return given
        return default_hot_rows(self.num_speculative_tokens, self.model.index_topk)

    def _check_host_memory(self) -> None:
        """Every host-memory tier of every data-parallel engine together (the host KV tier and
        the HiSparse pool are separate allocations) must fit the machine."""
        ram = physical_memory_bytes()
        tiers = [(self.offload.flag, self.offload.cpu_bytes_to_use, "host KV tier")]
        if self.hisparse is not None:
            tiers.append(("--kv-transfer-config", self.hisparse.host_pool_bytes,
                          "HiSparse host pool"))
        tiers = [t for t in tiers if t[1] > 0]
        replicas = self.parallel.data_parallel_size
        total = replicas * sum(nbytes for _, nbytes, _ in tiers)
        if ram is None or total <= ram:
            return
        flags = "/".join(dict.fromkeys(flag for flag, _, _ in tiers))
        what = " + ".join(f"{nbytes / 2**30:.1f} GiB of {name}" for _, nbytes, name in tiers)
        raise ConfigError(f"{flags}: {replicas} data-parallel engines × ({what}) exceed the "
                          f"machine's {ram / 2**30:.1f} GiB")

    def _validate_hisparse(self) -> None:
        flag = "--kv-transfer-config"
        if self.hisparse is None:
            if self.attention.hisparse_config_given:
                raise ConfigError("--attention-config: hisparse_config needs --kv-transfer-config "
                                  f"with kv_connector {HISPARSE_CONNECTOR!r}")
            return
        m = self.model
        if m.index_topk < 1 or not any(m.has_indexer(i) for i in range(m.num_hidden_layers)):
            raise ConfigError(f"{flag}: {HISPARSE_CONNECTOR} needs a model with an indexer "
                              "(index_topk): it selects which rows the hot buffer holds")
        if self.parallel.decode_context_parallel_size > 1:
            raise ConfigError(f"{flag}: {HISPARSE_CONNECTOR} does not run with "
                              "--decode-context-parallel-size > 1 (as in vLLM)")
        if self.parallel.prefill_context_parallel_size > 1:
            raise ConfigError(f"{flag}: {HISPARSE_CONNECTOR} is for decode engines; it does not "
                              "run with --prefill-context-parallel-size > 1")
        if self.attention.hisparse_device_mla_pages is not None:
            # The host tier's copies and a P/D producer's cache regions address MLA rows by
            # block id (not built yet); a consumer reads into MLA pages or the host pool.
            pages = "--attention-config: hisparse_config.device_mla_pages"
            if self.offload.enabled:
                raise ConfigError(f"{pages} does not run with the host KV tier "
                                  f"({self.offload.flag}) yet")
            if self.disagg is not None and self.disagg.kv_role != "kv_consumer":
                raise ConfigError(f"{pages} runs in a P/D engine only with kv_role "
                                  f"'kv_consumer' ({self.disagg.flag} has kv_role "
                                  f"{self.disagg.kv_role!r}): a producer's peers read its MLA "
                                  "rows by block id")
        rows = 1 + self.num_speculative_tokens
        need = rows * m.index_topk
        size = self.hisparse_buffer_rows
        if size < need:
            raise ConfigError(
                f"--attention-config: hisparse_config.device_buffer_size {size} is smaller than "
                f"the top-k union of one step ({rows} query rows × index_topk {m.index_topk} = "
                f"{need})")
        if size > HISPARSE_MAX_BUFFER_ROWS:
            raise ConfigError(
                f"--attention-config: hisparse_config.device_buffer_size {size} exceeds "
                f"{HISPARSE_MAX_BUFFER_ROWS} (give a smaller one explicitly)")


# ------------------------------------------------------------------------------------------------
# The host-memory KV tier (docs/offload.md)
# ------------------------------------------------------------------------------------------------
OFFLOAD_SIZE_FLAG = "--kv-offloading-size"
OFFLOAD_CONNECTOR = "OffloadingConnector"
HISPARSE_CONNECTOR = "HiSparseConnector"
MULTI_CONNECTOR = "MultiConnector"


def default_hot_rows(num_speculative_tokens: int, index_topk: int) -> int:
    """HiSparse hot-buffer rows per request and layer by default: (query rows + 1) × top-k, as
    vLLM (the union of every verify row's top-k plus one top-k of LRU slack); the engine's and
    the simulator's default alike."""
    return (1 + num_speculative_tokens + 1) * index_topk


def physical_memory_bytes() -> int | None:
    """The machine's RAM (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class OffloadConfig:
    """CPU KV offload with prefix reuse. `cpu_bytes_to_use` is the engine's total host memory for
    KV (0 = off), split evenly over its ranks; each rank keeps its own shard of every block.
    `flag` is how the user gave the size, so that errors name what they typed."""

    cpu_bytes_to_use: int = 0
    flag: str = OFFLOAD_SIZE_FLAG

    def __post_init__(self) -> None:
        if self.cpu_bytes_to_use < 0:
            raise ConfigError(f"{self.flag}: must be >= 0, got {self.cpu_bytes_to_use} bytes")
        ram = physical_memory_bytes()
        if ram is not None and self.cpu_bytes_to_use > ram:
            raise ConfigError(
                f"{self.flag}: {self.cpu_bytes_to_use / 2**30:.1f} GiB of pinned host memory "
                f"asked for, but the machine has {ram / 2**30:.1f} GiB"
            )

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes_to_use > 0

    @staticmethod
    def from_flags(size_gib: float | None, backend: str | None,
                   transfer_json: str | None) -> OffloadConfig:
        """From `--kv-offloading-size GIB --kv-offloading-backend native` or the equivalent
        `--kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
        "kv_connector_extra_config":{"cpu_bytes_to_use":N}}'` (vLLM's spellings)."""
        if transfer_json is not None:
            offload = [c for c in transfer_connectors(transfer_json)
                       if c["kv_connector"] == OFFLOAD_CONNECTOR]
            if offload:
                if size_gib is not None:
                    raise ConfigError(f"{OFFLOAD_SIZE_FLAG}: give it or an {OFFLOAD_CONNECTOR} "
                                      "in --kv-transfer-config, not both")
                return OffloadConfig(cpu_bytes_to_use=_transfer_config_bytes(offload[0]),
                                     flag="--kv-transfer-config")
            # Other connectors only (P/D, HiSparse): --kv-offloading-size may add the host tier.
        if size_gib is None:
            if backend is not None:
                raise ConfigError(f"--kv-offloading-backend: needs {OFFLOAD_SIZE_FLAG}")
            return OffloadConfig()
        if backend not in (None, "native"):
            raise ConfigError(f"--kv-offloading-backend: only 'native' is built, got {backend!r}")
        if not size_gib > 0:
            raise ConfigError(f"{OFFLOAD_SIZE_FLAG}: must be > 0 GiB, got {size_gib}")
        return OffloadConfig(cpu_bytes_to_use=int(size_gib * 2**30))


def transfer_connectors(text: str) -> list[dict[str, Any]]:
    """The connectors of `--kv-transfer-config`: one, or the list inside a MultiConnector
    (`"kv_connector_extra_config":{"connectors":[...]}`, vLLM's composition), each checked for a
    known name, at most once; the host-memory connectors take role kv_both only (the P/D one's
    role is DisaggConfig's to check)."""
    flag = "--kv-transfer-config"
    raw = json_object(text, flag)
    if raw.get("kv_connector") == MULTI_CONNECTOR:
        extra = raw.get("kv_connector_extra_config") or {}
        items = extra.get("connectors") if isinstance(extra, dict) else None
        if not isinstance(items, list) or not items or not all(isinstance(c, dict)
                                                               for c in items):
            raise ConfigError(f"{flag}: {MULTI_CONNECTOR} needs kv_connector_extra_config."
                              "connectors, a non-empty list of connector objects")
    else:
        items = [raw]
    known = (OFFLOAD_CONNECTOR, HISPARSE_CONNECTOR, NIXL_CONNECTOR)
    names = []
    for c in items:
        if c.get("kv_connector") not in known:
            raise ConfigError(f"{flag}: kv_connector must be one of {list(known)} (or "
                              f"{MULTI_CONNECTOR} of them), got {c.get('kv_connector')!r}")
        if c["kv_connector"] != NIXL_CONNECTOR and c.get("kv_role", "kv_both") != "kv_both":
            raise ConfigError(f"{flag}: kv_role of {c['kv_connector']} must be 'kv_both', got "
                              f"{c.get('kv_role')!r}")
        names.append(c["kv_connector"])
    if len(set(names)) != len(names):
        raise ConfigError(f"{flag}: each connector at most once, got {names}")
    return items


def _transfer_config_bytes(raw: dict[str, Any]) -> int:
    flag = "--kv-transfer-config"
    extra = raw.get("kv_connector_extra_config") or {}
    size = extra.get("cpu_bytes_to_use") if isinstance(extra, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(
            f"{flag}: kv_connector_extra_config.cpu_bytes_to_use must be a positive integer, "
            f"got {size!r}"
        )
    return size


# ------------------------------------------------------------------------------------------------
# Hybrid HiSparse decode (docs/hisparse.md)
# ------------------------------------------------------------------------------------------------
HISPARSE_MAX_BUFFER_ROWS = 32768  # vLLM's bound (int16 slot indices)


@dataclass(frozen=True)
class HiSparseConfig:
    """HiSparseConnector: the MLA KV of every request mirrored in a host pool of
    `host_pool_bytes` per engine (vLLM: per DP replica), read through a per-request hot buffer of
    `EngineConfig.hisparse_buffer_rows` rows. The buffer size lives in `--attention-config`
    (`AttentionConfig.hisparse_device_buffer_size`), as in vLLM."""

    host_pool_bytes: int

    def __post_init__(self) -> None:
        if self.host_pool_bytes <= 0:
            raise ConfigError("--kv-transfer-config: kv_connector_extra_config.host_pool_gib "
                              "must be > 0")

    @staticmethod
    def from_transfer_json(text: str | None) -> HiSparseConfig | None:
        """The HiSparseConnector of `--kv-transfer-config`, alone or inside a MultiConnector
        (`"kv_connector_extra_config":{"host_pool_gib":48}`); None when it has none."""
        if text is None:
            return None
        found = [c for c in transfer_connectors(text) if c["kv_connector"] == HISPARSE_CONNECTOR]
        if not found:
            return None
        extra = found[0].get("kv_connector_extra_config") or {}
        gib = extra.get("host_pool_gib") if isinstance(extra, dict) else None
        if isinstance(gib, bool) or not isinstance(gib, int | float) or not gib > 0:
            raise ConfigError("--kv-transfer-config: HiSparseConnector needs "
                              "kv_connector_extra_config.host_pool_gib > 0, got "
                              f"{gib!r}")
        return HiSparseConfig(host_pool_bytes=int(gib * 2**30))

# ------------------------------------------------------------------------------------------------
# Prefill/decode disaggregation (docs/disagg.md)
# ------------------------------------------------------------------------------------------------
NIXL_CONNECTOR = "NixlConnector"
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
ABORT_TIMEOUT_ENV = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"  # vLLM's, seconds
DEFAULT_ABORT_TIMEOUT_S = 480.0  # vLLM's default
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
DEFAULT_SIDE_CHANNEL_PORT = 5600  # vLLM's default


@dataclass(frozen=True)
class DisaggConfig:
    """The P/D KV connector (`--kv-transfer-config` with kv_connector NixlConnector).

    A producer (kv_producer / kv_both) holds a finished prefill's blocks until every consumer
    has read them or `abort_timeout_s` passed, and serves its transport metadata on
    `side_channel_host:side_channel_port` (+ the DP rank); a consumer (kv_consumer / kv_both)
    reads a prompt's KV from there. `backend`: "nixl", "shm" or "auto" (NIXL when importable)."""

    kv_role: str = "kv_both"
    backend: str = "auto"
    engine_id: str = ""  # "" → a fresh uuid at start-up
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT  # 0: any free port (tests)
    abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S
    transfer_timeout_s: float = 30.0  # a consumer's reads and metadata fetch
    # a consumer rank's staging buffers for READs whose zero-copy segments would be per row
    # (disagg/staging.py); a request's READ that does not fit goes zero-copy
    staging_mb: int = 1024
    flag: str = "--kv-transfer-config"

    def __post_init__(self) -> None:
        f = self.flag
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"{f}: kv_role must be one of {list(KV_ROLES)}, got "
                              f"{self.kv_role!r}")
        if self.backend not in ("auto", "nixl", "shm"):
            raise ConfigError(f"{f}: kv_connector_extra_config.backend must be 'auto', 'nixl' or "
                              f"'shm', got {self.backend!r}")
        if self.side_channel_host in ("", "0.0.0.0", "::", "*"):
            raise ConfigError(f"{f}: the side channel binds one address, not a wildcard "
                              f"({self.side_channel_host!r})")
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(f"{f}: side channel port {self.side_channel_port} out of range")
        if not self.abort_timeout_s > 0:
            raise ConfigError(f"{ABORT_TIMEOUT_ENV}: must be > 0 seconds, got "
                              f"{self.abort_timeout_s}")
        if not self.transfer_timeout_s > 0:
            raise ConfigError(f"{f}: transfer_timeout_s must be > 0, got "
                              f"{self.transfer_timeout_s}")
        if self.staging_mb < 0:
            raise ConfigError(f"{f}: kv_connector_extra_config.staging_mb must be >= 0 "
                              f"(0: never staged), got {self.staging_mb}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    @property
    def is_decode_engine(self) -> bool:
        """A P/D decode engine alone (kv_consumer): its long prompts arrive from the prefill
        engine, so HiSparse's MLA pages need hold only the short ones it prefills itself."""
        return self.kv_role == "kv_consumer"

    @staticmethod
    def from_json(text: str | None, env: dict[str, str] | None = None) -> DisaggConfig | None:
        """From `--kv-transfer-config` (None when it names no NixlConnector). The timeout, side
        channel host and port come from vLLM's environment variables unless
        kv_connector_extra_config gives `abort_timeout_s`, `side_channel_host`,
        `side_channel_port`."""
        if text is None:
            return None
        flag = "--kv-transfer-config"
        nixl = [c for c in transfer_connectors(text) if c.get("kv_connector") == NIXL_CONNECTOR]
        if not nixl:
            return None
        raw = nixl[0]
        if "kv_role" not in raw:
            raise ConfigError(f"{flag}: {NIXL_CONNECTOR} needs kv_role (one of "
                              f"{list(KV_ROLES)})")
        extra = raw.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ConfigError(f"{flag}: kv_connector_extra_config must be an object")
        env = dict(os.environ) if env is None else env

        def number(key: str, env_key: str | None, default: float, kind: type) -> Any:
            value: Any = extra.get(key)
            where = f"{flag}: kv_connector_extra_config.{key}"
            if value is None and env_key is not None and env.get(env_key):
                value, where = env[env_key], env_key
                try:
                    value = kind(value)
                except ValueError:
                    raise ConfigError(f"{where}: expected a number, got {value!r}") from None
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where}: expected a number, got {value!r}")
            return kind(value)

        engine_id = raw.get("engine_id", extra.get("engine_id", ""))
        if not isinstance(engine_id, str):
            raise ConfigError(f"{flag}: engine_id must be a string, got {engine_id!r}")
        return DisaggConfig(
            kv_role=raw["kv_role"],
            backend=extra.get("backend", "auto"),
            engine_id=engine_id,
            side_channel_host=extra.get("side_channel_host",
                                        env.get(SIDE_CHANNEL_HOST_ENV) or "127.0.0.1"),
            side_channel_port=number("side_channel_port", SIDE_CHANNEL_PORT_ENV,
                                     DEFAULT_SIDE_CHANNEL_PORT, int),
            abort_timeout_s=number("abort_timeout_s", ABORT_TIMEOUT_ENV,
                                   DEFAULT_ABORT_TIMEOUT_S, float),
            transfer_timeout_s=number("transfer_timeout_s", None, 30.0, float),
            staging_mb=number("staging_mb", None, 1024, int),
        )
