"""DP + EP lock-step: the same EP collectives on every rank of every replica, every step.

Where EP spans the DP replicas (`ParallelConfig.ep_spans_replicas`), each MoE layer's dispatch
(parallel/ep.py) is a collective over every rank of every replica, while each replica schedules
its own requests. A step therefore has one fixed sequence of dispatches on every rank:

    every MoE layer of the target, in layer order        (one target forward)
    the MTP layer's MoE, k times                          (k = num_speculative_tokens; 0 without)

A replica with nothing to compute still steps (engine/dp.py sends it an empty step) and makes
the whole sequence with no rows of its own; its experts serve the other replicas' rows. A step
that ran fewer MTP forwards (a prefill chunk that samples nothing runs the MTP layer once, to
fill its cache; drafting runs it k times) makes the rest the same way. vLLM's DP + EP runs a
dummy batch on idle ranks for the same reason.

A decode step padded to one size on every replica (engine/dp.py picks it from all their
steps) makes the same sequence with the same row count on every rank, an idle replica's an
all-padding batch of that size: its dispatches are made `same_rows` (no row counts
exchanged, no host read), so they can be captured in CUDA graphs; a replayed step's
dispatches are inside its graphs, where no counter sees them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dsaserve.model.dsa import DsaForCausalLM, MoE


class ExpertLockstep:
    """Checks, and completes with row-less dispatches, each step's sequence of EP dispatches."""

    def __init__(self, model: DsaForCausalLM, num_speculative_tokens: int) -> None:
        layers = model.cfg.num_hidden_layers
        self.target = [layer.mlp for layer in model.model.layers[:layers]
                       if isinstance(layer.mlp, MoE)]
        mtp = model.model.layers[layers].mlp if model.with_mtp else None
        self.mtp = mtp if isinstance(mtp, MoE) else None
        self.mtp_forwards = num_speculative_tokens if self.mtp is not None else 0
        embed = model.model.embed_tokens.weight
        self.dtype, self.device = embed.dtype, embed.device
        if any(m.ep is None for m in self.layers):
            raise RuntimeError("DP + EP lock-step: a MoE layer has no EP group")

    @property
    def layers(self) -> list[MoE]:
        return self.target + ([self.mtp] if self.mtp is not None else [])

    @contextlib.contextmanager
    def same_rows(self) -> Iterator[None]:
        """Within: every EP rank dispatches as many rows as this one (a step padded to one
        size on every replica, or the start-up capture of every size in the same order), so
        no dispatch exchanges row counts."""
        for m in self.layers:
            m.same_rows = True
        try:
            yield
        finally:
            for m in self.layers:
                m.same_rows = False

    def finish_step(self, *, replayed: bool = False) -> None:
        """After a step's forwards: the dispatches it did not make, made without rows.
        `replayed`: its forwards (a padded step's, the drafts' included) were replayed from
        CUDA graphs, which hold the whole sequence."""
        if replayed:
            self.reset()
            return
        calls = {m.ep_calls for m in self.target}
        if len(calls) > 1 or calls - {0, 1}:
            raise RuntimeError(f"DP + EP lock-step: the target's MoE layers dispatched "
                               f"{sorted(m.ep_calls for m in self.target)} times this step "
                               "(one forward a step is the protocol)")
        if calls == {0}:
            for m in self.target:
                m.serve_peers(self.dtype, self.device)
        if self.mtp is not None:
            missing = self.mtp_forwards - self.mtp.ep_calls
            if missing < 0:
                raise RuntimeError(f"DP + EP lock-step: {self.mtp.ep_calls} MTP forwards this "
                                   f"step, more than the {self.mtp_forwards} of the protocol")
            for _ in range(missing):
                self.mtp.serve_peers(self.dtype, self.device)
        self.reset()

    def reset(self) -> None:
        """A new step begins: no dispatch counted (after the start-up capture, too)."""
        for m in self.layers:
            m.ep_calls = 0


def lockstep_for(model: DsaForCausalLM, spans_replicas: bool, num_speculative_tokens: int
                 ) -> ExpertLockstep | None:
    """The runner's lock-step keeper: only where EP spans the replicas."""
    return ExpertLockstep(model, num_speculative_tokens) if spans_replicas else None

