"""The vocabulary cut over the TP ranks: each holds a contiguous range of the embedding's rows and
of lm_head's (and of the drafts' FP8 copy of it), as vLLM's VocabParallelEmbedding and
ParallelLMHead do.

A draft vocabulary (SpecConfig.draft_vocab) is cut otherwise: into equal parts of its ids, so that
each rank's drafts read as many rows (`balanced_rows`).

Replicated, GLM-5.3's two 154,880 × 6,144 bf16 matrices are 3.8 GB on every rank, and every
decode step reads the whole 1.9 GB lm_head on every rank (an MTP3 step four times). Cut over
TP8, each rank holds and reads an eighth; the price is one all-reduce of the step's embedded
rows and one all-gather of its logits (or, for the drafts' argmax, of each rank's best (value,
id) per row).

The ranges are balanced (sizes differ by at most one row), so every vocabulary of at least TP
rows cuts, divisible or not; the logits' gather pads the shorter parts by one column and strips
it (fixed shapes: the gathers run inside decode CUDA graphs). Every result equals
the replicated model's bit for bit given equal products: a looked-up row is summed with zeros
only, the logits are the same columns put back in order, and the argmax takes the lowest id
among equal maxima as torch.argmax does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsaserve.parallel.groups import Group


def vocab_ranges(vocab_size: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each part, contiguous and in order: the first vocab_size % parts parts
    one row longer than the others (so the gathers strip one padded column from the others)."""
    if vocab_size < parts:
        raise ValueError(f"a vocabulary of {vocab_size} cannot be cut in {parts} parts")
    size, longer = divmod(vocab_size, parts)
    stops = [(r + 1) * size + min(r + 1, longer) for r in range(parts)]
    return list(zip([0, *stops[:-1]], stops, strict=True))


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of the vocabulary, and the group that holds the others."""

    group: Group
    vocab_size: int
    start: int
    stop: int

    @staticmethod
    def of(group: Group, vocab_size: int) -> VocabShard:
        if vocab_size >= 1 << 24:  # argmax gathers ids as fp32 beside their values
            raise ValueError(f"a vocabulary of {vocab_size} ids is over fp32's exact integers")
        start, stop = vocab_ranges(vocab_size, group.size)[group.rank_in_group]
        return VocabShard(group, vocab_size, start, stop)

    @property
    def width(self) -> int:
        """Columns every rank's part is padded to for the gathers (the largest part)."""
        return -(-self.vocab_size // self.group.size)

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """weight [stop − start, hidden] this rank's rows, ids [N] global → [N, hidden], the
        same rows on every rank: each rank looks up the ids it holds, zeros elsewhere, summed."""
        local = ids - self.start
        held = (local >= 0) & (local < weight.shape[0])  # [N]
        rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
        return self.group.all_reduce(rows.masked_fill(~held[:, None], 0))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """local [M, stop − start] this rank's columns → [M, vocab] every column in order."""
        m, width = local.shape[0], self.width
        if local.shape[1] < width:
            local = F.pad(local, (0, width - local.shape[1]))  # [M, width]
        every = self.group.all_gather(local)  # [parts, M, width]
        longer = self.vocab_size % self.group.size  # the parts of `width` columns come first
        if longer == 0:
            return every.permute(1, 0, 2).reshape(m, -1)
        return torch.cat((every[:longer].permute(1, 0, 2).reshape(m, -1),
                          every[longer:, :, : width - 1].permute(1, 0, 2).reshape(m, -1)), 1)

    def balanced_rows(self, weight: torch.Tensor, ids: Sequence[int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """weight [stop − start, hidden] this rank's rows of lm_head, `ids` ascending (a draft
        vocabulary) → (rows [n, hidden], their ids [n] int64) of this rank's equal part of
        `ids`: the parts are balanced over the ranks whatever ranges the ids fall in (the most
        frequent tokens crowd the low ids, one rank's range, which alone would read them all).
        Each rank's missing rows come from their holders in one all-reduce, once (each row is
        one rank's, zeros elsewhere: exact). The parts are in rank order, so `argmax` over them
        keeps its tie rule."""
        every_id = torch.tensor(ids, dtype=torch.int64, device=weight.device)
        held = (every_id >= self.start) & (every_id < self.stop)
        rows = torch.zeros(len(ids), weight.shape[1], dtype=weight.dtype, device=weight.device)
        rows[held] = weight[every_id[held] - self.start]
        self.group.all_reduce(rows)
        r, parts = self.group.rank_in_group, self.group.size
        lo, hi = r * len(ids) // parts, (r + 1) * len(ids) // parts
        return rows[lo:hi].clone(), every_id[lo:hi].clone()

    def argmax(self, local: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """local [M, C] this rank's logits: its columns in order, or those of `ids` [C] (global
        ids, ascending, each rank's above the last rank's: `balanced_rows`; C may be 0) → [M]
        int64 the global argmax (the lowest id among equal maxima, as over the whole row)."""
        if local.shape[1] == 0:  # no draft id in this rank's range: it never wins
            best = torch.full(local.shape[:1], float("-inf"), device=local.device)
            at = torch.zeros(local.shape[:1], dtype=torch.int64, device=local.device)
        else:
            best, at = local.max(-1)  # [M] each; max's index is the first maximum's
            at = at + self.start if ids is None else ids[at]
        pair = torch.stack((best.float(), at.float()))  # [2, M]: ids < 2^24 are exact
        every = self.group.all_gather(pair)  # [parts, 2, M], rank-major = id order
        winner = every[:, 0].argmax(0)  # [M] the first rank holding the maximum
        return every[:, 1].gather(0, winner[None])[0].long()
