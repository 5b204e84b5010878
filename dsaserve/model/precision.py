"""The parameters the engine holds in float32 whatever the model dtype, by name. The model's
construction casts them so (`DsaForCausalLM.build`) and the plan counts their bytes from the same
list (`plan/costmodel.py`), so memory and step reads are priced as the engine holds them. No
torch here: the plan imports it."""

from __future__ import annotations

# names relative to a decoder layer (`model.layers.{i}.` + name); MTP layers are decoder layers
FP32_PARAMS: frozenset[str] = frozenset({
    "mlp.gate.weight",  # the MoE router: sigmoid scores computed in fp32
    "mlp.gate.e_score_correction_bias",  # its noaux_tc bias, fp32 in the checkpoints
    "self_attn.indexer.weights_proj.weight",  # the indexer's per-head weights, as the reference
    "self_attn.indexer.k_norm.weight",  # the indexer's key LayerNorm, computed in fp32
    "self_attn.indexer.k_norm.bias",
})


def held_in_fp32(name: str) -> bool:
    """Whether the parameter `name` (a full name, `model.layers.3.mlp.gate.weight`) is held in
    float32."""
    return any(name == p or name.endswith("." + p) for p in FP32_PARAMS)
