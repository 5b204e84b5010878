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

Drafts are greedy (the argmax of the MTP logits: vLLM's default draft_sample_method).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.model.dsa import DsaForCausalLM, LayerCache


@dataclass(frozen=True)
class DraftRequest:
    """One request's part of the step, as the drafter needs it."""

    request_id: str
    row_start: int  # first row of the request in the step's global batch
    next_token_ids: tuple[int, ...]  # per row: the token after the row's input (step 0 input)
    last_row: int | None  # row (within the request) of its last accepted position; None: no draft
    last_position: int  # position of that row


# (request ids, one position each) → metadata for one token per request; built by the runner so
# that slot maps, DCP ownership and the PCP view are the target's.
MetadataBuilder = Callable[[list[str], list[int]], AttentionMetadata]


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
        requests: list[DraftRequest],  # in batch order, covering all N rows
    ) -> dict[str, list[int]]:
        """Write the MTP layer's KV for every row of the step; k drafts per drafting request."""
        device = hidden.device
        # 1. step 0 over the step's rows (prefill chunks included: it fills the MTP cache)
        next_ids = torch.tensor([t for r in requests for t in r.next_token_ids],
                                dtype=torch.int64, device=device)  # [N]
        h = self.model.forward_mtp(next_ids, hidden, meta, self.caches)  # [N, hidden]
        drafting = [r for r in requests if r.last_row is not None]
        if not drafting:
            return {}
        rows = torch.tensor([r.row_start + r.last_row for r in drafting], device=device)
        h = h[rows]  # [D, hidden]
        token = self.model.compute_logits(h).argmax(-1)  # [D] d1
        drafts = [token]
        # 2. steps 1..k−1: one token per drafting request, one position further each time
        ids = [r.request_id for r in drafting]
        for j in range(1, self.k):
            step_meta = self.metadata_for(ids, [r.last_position + j for r in drafting])
            h = self.model.forward_mtp(token, h, step_meta, self.caches)  # [D, hidden]
            token = self.model.compute_logits(h).argmax(-1)
            drafts.append(token)
        table = torch.stack(drafts, dim=1).tolist()  # [D, k]
        return {rid: row for rid, row in zip(ids, table, strict=True)}
