"""The MTP layer loads and runs one step, matching an independent construction from HF parts:
u = eh_proj([enorm(embed(next)) | hnorm(h)]) fed to an HF decoder layer with the MTP weights,
then shared_head.norm and lm_head (MODEL_SPEC §5.1)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from dsaserve.config import ModelConfig
from dsaserve.core import NewRequestData, SamplingParams, SchedulerOutput
from dsaserve.engine.runner import ModelRunner
from dsaserve.model.loader import checkpoint_has_mtp
from dsaserve.model.make_model import make_model

T = 40


def _checkpoint(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _hf_mtp_logits(model_dir, preset, ids, next_ids) -> torch.Tensor:
    import transformers

    cfg = ModelConfig.from_file(model_dir)
    n = cfg.num_hidden_layers
    cls, cfg_cls = {
        "tiny-glm5": (transformers.GlmMoeDsaForCausalLM, transformers.GlmMoeDsaConfig),
        "tiny-dsv32": (transformers.DeepseekV32ForCausalLM, transformers.DeepseekV32Config),
    }[preset]
    target = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    w = _checkpoint(model_dir)
    with torch.no_grad():
        h = target.model(torch.tensor([ids])).last_hidden_state[0]  # post final norm [T, H]

        def rms(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

        e = target.model.embed_tokens(torch.tensor(next_ids))
        e[0] = 0.0  # position 0 carries no input
        p = f"model.layers.{n}."
        u = torch.cat((rms(e, w[p + "enorm.weight"]), rms(h, w[p + "hnorm.weight"])), -1)
        u = u @ w[p + "eh_proj.weight"].T
        # A one-layer HF model holding the MTP decoder layer; its final norm is shared_head.norm.
        raw = target.config.to_dict()
        raw.update(num_hidden_layers=1, mlp_layer_types=["sparse"], first_k_dense_replace=0,
                   layer_types=None)
        if "indexer_types" in raw:
            raw["indexer_types"] = ["full"]
        one = cls(cfg_cls(**raw)).eval()
        state = {k.replace(p, "model.layers.0."): v for k, v in w.items() if k.startswith(p)}
        state["model.norm.weight"] = w[p + "shared_head.norm.weight"]
        state["lm_head.weight"] = w["lm_head.weight"]
        state["model.embed_tokens.weight"] = w["model.embed_tokens.weight"]
        merged = {}
        for name in one.state_dict():
            if name in state:
                merged[name] = state[name]
            elif ".mlp.experts.gate_up_proj" in name:
                e_ = cfg.n_routed_experts
                merged[name] = torch.stack([torch.cat(
                    (state[f"model.layers.0.mlp.experts.{i}.gate_proj.weight"],
                     state[f"model.layers.0.mlp.experts.{i}.up_proj.weight"])) for i in range(e_)])
            elif ".mlp.experts.down_proj" in name:
                merged[name] = torch.stack(
                    [
                        state[f"model.layers.0.mlp.experts.{i}.down_proj.weight"]
                        for i in range(cfg.n_routed_experts)
                    ]
                )
        one.load_state_dict(merged, strict=False)
        missing = set(one.state_dict()) - set(merged)
        assert not {m for m in missing if "rotary" not in m}, missing
        return one(inputs_embeds=u[None]).logits[0]


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
def test_mtp_one_step_matches_hf_parts(model_dirs, engine_config, preset):
    model_dir = model_dirs[preset]
    cfg = ModelConfig.from_file(model_dir)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, cfg.vocab_size, (T + 1,), generator=g).tolist()
    runner = ModelRunner(engine_config(model_dir, block_size=16, num_blocks=8))
    assert runner.model.with_mtp
    rid = "r"
    so = SchedulerOutput(
        (NewRequestData(rid, tuple(ids[:T]), SamplingParams(), (0, 1, 2), 0),), (), {rid: T}, ()
    )
    runner._apply_diff(so)
    batch = runner._prepare([rid], {rid: T}, {})
    input_ids, meta = batch.input_ids, batch.meta
    hidden = runner.model(input_ids, meta, runner.caches)  # writes the target's caches
    # Draft step 0: at position p the MTP sees token p+1 and the target's hidden state at p.
    h_mtp = runner.model.forward_mtp(torch.tensor(ids[1 : T + 1]), hidden, meta, runner.caches)
    ours = runner.model.compute_logits(h_mtp)
    ref = _hf_mtp_logits(model_dir, preset, ids[:T], ids[1 : T + 1])
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_checkpoint_without_mtp_loads_and_says_so(tmp_path, engine_config):
    model_dir = make_model("tiny-glm5", tmp_path / "no-mtp", with_mtp=False)
    assert not checkpoint_has_mtp(model_dir, ModelConfig.from_file(model_dir))
    runner = ModelRunner(engine_config(model_dir))
    assert not runner.model.with_mtp and len(runner.caches) == 4
    with pytest.raises(RuntimeError, match="no MTP layer"):
        runner.model.forward_mtp(None, None, None, runner.caches)
