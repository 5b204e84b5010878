"""MTP drafting: the model's one MTP layer reused autoregressively for k draft tokens
(MODEL_SPEC.md §5.2, VLLM_NOTES §5.1).

After the target ran on a step's tokens (positions s..e−1 of each request, hidden states H):

    step 0   over the SAME rows as the target, with the same metadata (same PCP partition, same
             slots): at position q the MTP reads (token[q+1], H[q]) and writes its own KV at q.
             token[q+1] is the next prompt token, an accepted draft, or — at the last accepted
             position p — the token emitted this step. Its output at p gives draft d1.
    step j   (1 ≤ j < k) one row per drafting request at position p + j: input d_j with the MTP's
             own previous hidden state; writes the MTP KV at p + j (the scheduler reserved those
             k − 1 lookahead slots) and gives d_{j+1}.

Why the MTP cache stays exact: at every position q below the request's computed length, step 0
of the step that computed q wrote the MTP key from (token[q+1], H[q]), exactly what a
non-speculative run writes, because token[q+1] is known (a prompt token, an accepted draft or the
emitted token) by the end of that step. Rows after the accepted run (rejected drafts) and the
draft steps' lookahead rows write keys past the computed length; the next step overwrites them
before anything reads them. A prefix hit is safe because the KV manager recomputes the last
matched block (the key at a block's last position depends on the next block's first token).

Drafts are greedy (the argmax of the MTP logits: vLLM's default draft_sample_method), over
lm_head or its FP8 copy (`draft_lm_head`, config.SpecConfig; DsaForCausalLM.draft_tokens), over
every token or the ids of a draft vocabulary (`draft_vocab`, spec/draft_vocab.py).

Nothing here reads device data on the host: how many drafts a request accepted decides which row
drafting continues from and at which position, and both stay on the device. The draft steps'
metadata takes the positions as a device tensor and, for what must be host-known (context
lengths that size loops and grids), the bound reached when every draft is accepted; keys past a
row's true position are masked by the causal limit that every backend derives from positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.model.dsa import DsaForCausalLM, LayerCache


@dataclass(frozen=True)
class DraftInputs:
    """What the drafter needs from the step, on the device except the host-known bounds."""

    next_token_ids: torch.Tensor  # [N] int64: the token after each row's input (step 0 input);
    # at each drafting request's last accepted row it is overwritten with `tokens`
    rows: torch.Tensor  # [D] int64: global row of each drafting request's last accepted position
    tokens: torch.Tensor  # [D] int64: the token emitted at that row this step
    positions: torch.Tensor  # [D] int64: the position of that row
    request_ids: list[str]  # [D] the drafting requests, in batch order
    max_positions: list[int]  # [D] host: the largest position `positions` can hold


# (request ids, positions [D] on the device, the bound of each on the host) → metadata for one
# token per request; built by the runner so that slot maps, DCP ownership and the PCP view are
# the target's.
MetadataBuilder = Callable[[list[str], torch.Tensor, list[int]], AttentionMetadata]


class MtpDrafter:
    def __init__(self, model: DsaForCausalLM, caches: list[LayerCache],
                 num_speculative_tokens: int, metadata_for: MetadataBuilder) -> None:
        if not model.with_mtp:
            raise RuntimeError("MTP drafting needs a model built with its MTP layer")
        self.model = model
        self.caches = caches
        self.k = num_speculative_tokens
        self.metadata_for = metadata_for

    @torch.inference_mode()
    def propose(
        self,
        hidden: torch.Tensor,  # [N, hidden] the target's post-norm states, global batch order
        meta: AttentionMetadata,  # the target's metadata for this step
        inputs: DraftInputs,
    ) -> torch.Tensor | None:
        """Write the MTP layer's KV for every row of the step → drafts [D, k] int64 on the
        device (None when no request drafts)."""
        next_ids = inputs.next_token_ids.index_put((inputs.rows,), inputs.tokens)  # [N]
        if not inputs.request_ids:  # step 0 still fills the MTP cache (prefill chunks)
            self.model.forward_mtp(next_ids, hidden, meta, self.caches)
            return None
        return draft_chain(
            self.model, self.caches, self.k, next_ids, hidden, meta, inputs.rows,
            lambda j: self.metadata_for(inputs.request_ids, inputs.positions + j,
                                        [p + j for p in inputs.max_positions]))


def draft_chain(
    model: DsaForCausalLM,
    caches: list[LayerCache],
    k: int,
    next_ids: torch.Tensor,  # [N] int64 step 0's input: the token after each row's
    hidden: torch.Tensor,  # [N, hidden] the target's post-norm states
    meta: AttentionMetadata,  # the target's metadata over the N rows
    rows: torch.Tensor,  # [D] int64 the row each drafting request continues from
    step_metadata: Callable[[int], AttentionMetadata],  # j → draft step j's, one row per request
) -> torch.Tensor:  # [D, k] int64 drafts
    """The MTP steps of one engine step (the module's story), device work only: the eager
    drafter and the padded decode path (engine/decode_graph.py, which captures it) share it."""
    # 1. step 0 over the step's rows (prefill chunks included: it fills the MTP cache)
    h = model.forward_mtp(next_ids, hidden, meta, caches)  # [N, hidden]
    h = h[rows]  # [D, hidden]
    token = model.draft_tokens(h)  # [D] d1
    drafts = [token]
    # 2. steps 1..k−1: one token per drafting request, one position further each time
    for j in range(1, k):
        h = model.forward_mtp(token, h, step_metadata(j), caches)  # [D, hidden]
        token = model.draft_tokens(h)
        drafts.append(token)
    return torch.stack(drafts, dim=1)  # [D, k]
