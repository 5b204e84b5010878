"""A tiny checkpoint whose MTP layer drafts well (for tests of the acceptance path).

Random tiny weights make the MTP layer's drafts almost never right, so nothing past the first
draft would be exercised. Here the target is made *mostly* context-free and the MTP layer is made
to predict what that context-free part says:

  * every MLP / MoE output is zeroed and attention outputs are scaled by `attn_scale`, so the
    target's hidden state at q is embed(token[q]) plus a small context term, and its next token is
    lm_head(norm(...)) — usually the same as without context, sometimes not;
  * the MTP layer's attention and MoE outputs are zeroed, its norms are 1 and
    eh_proj = [I | mix·I], so h_mtp ≈ norm(embed(token[q+1])) (+ a little of H[q]) and its logits
    are the context-free target logits one position ahead: the draft is the target's next token
    whenever the context term does not change the argmax.

Drafts are then accepted at a high but not perfect rate, with the target still depending on the
context (KV rollback mistakes change its output) and the MTP KV depending on both its inputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def draftable_checkpoint(src: Path, dst: Path, attn_scale: float = 0.3,
                         mix: float = 0.05) -> Path:
    if dst.is_dir():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    mtp = f"model.layers.{n}."
    for shard in sorted(src.glob("*.safetensors")):
        w = load_file(shard)
        for name, t in w.items():
            if "down_proj" in name:
                w[name] = torch.zeros_like(t)
            elif name.endswith("self_attn.o_proj.weight"):
                w[name] = torch.zeros_like(t) if name.startswith(mtp) else t * attn_scale
            elif name == "model.norm.weight" or name.startswith(mtp) and name.endswith(
                    ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")):
                w[name] = torch.ones_like(t)
            elif name == mtp + "eh_proj.weight":
                hidden = t.shape[0]
                eye = torch.eye(hidden, dtype=t.dtype)
                w[name] = torch.cat((eye, mix * eye), dim=1)
        save_file(w, tmp / shard.name, metadata={"format": "pt"})
    tmp.rename(dst)
    return dst
