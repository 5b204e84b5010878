"""P/D re-layout: which rows of which prefill rank go to which slots of which decode rank.

The prefill engine stores a request's KV sharded over its DCP ranks (N_s, interleave I_s, page
B_s); a decode rank needs the same tokens in its own layout (N_t, I_t, B_t; N_t = 1 for a DP
rank). Both sides address a token the one way `dsaserve.kv.layout` defines:

    owner(t) = (t // I) % N        slot(t) = table[local(t) // B]·B + local(t) % B

so for every position t in the range to move (the decode side's cached prefix is skipped) the
row at slot_s(t) on rank owner_s(t) is copied to slot_t(t) on rank owner_t(t). A plan groups
those copies by (source rank → target rank) and coalesces them into maximal runs in which the
source and the target slot both advance by one.

Example: N_s = 2, I_s = 2, B_s = 4, source table [7, 3] → N_t = 1, B_t = 4, target table
[5, 0, 9, 2]; the decode side holds t < 4 already, so [4, 16) moves:

    position t    :  4  5  6  7 |  8  9 10 11 | 12 13 14 15
    source rank   :  0  0  1  1 |  0  0  1  1 |  0  0  1  1
    source slot   : 30 31 30 31 | 12 13 12 13 | 14 15 14 15    (page 7 = slots 28-31, 3 = 12-15)
    target slot   :  0  1  2  3 | 36 37 38 39 |  8  9 10 11    (page 0, 9, 2)

    rank 0 → 0 : (30 → 0, 2 rows)  (12 → 36, 2)  (14 → 8, 2)
    rank 1 → 0 : (30 → 2, 2 rows)  (12 → 38, 2)  (14 → 10, 2)

With I_s = B_s = B_t (vLLM's forced choice) the same request moves whole pages: position page p
lives whole on source rank p % N_s, in its block table entry p // N_s, and lands whole in the
target's entry p, so every run is one page or more (a partial page only at the ends of the range).
Any other interleave degrades to shorter runs, never to a wrong row.

Ranks here are DCP ranks. Ranks that replicate a cache (TP without DCP) hold identical rows: on
the source side any one of them can send; on the target side each needs the rows (N_t = 1 each).
"""

from __future__ import annotations

import array
import functools
from dataclasses import dataclass, field

import torch

from dsaserve.kv import layout


@dataclass(frozen=True)
class KVLayout:
    """Where one engine keeps one request's KV: its scheduler block table and the paging rule."""

    block_ids: tuple[int, ...]  # the request's scheduler (virtual) block ids, B·N tokens each
    block_size: int  # B: tokens per physical page on a rank
    dcp_size: int = 1  # N
    interleave: int = 1  # I

    def __post_init__(self) -> None:
        layout.check_interleave(self.block_size, self.interleave)
        if self.dcp_size < 1:
            raise ValueError(f"dcp_size: must be >= 1, got {self.dcp_size}")
        # the ids through an int64 buffer, at C speed (a 128K prompt's 2,048 ids by a Python
        # loop took ~0.3 ms of the posting step's host time, twice per READ request); the
        # buffer is the table's too
        try:
            ids = array.array("q", self.block_ids)
        except TypeError:  # ids that are not integers but convert to them (`int(b)`)
            ids = array.array("q", [int(b) for b in self.block_ids])
        object.__setattr__(self, "block_ids", tuple(ids.tolist()))
        object.__setattr__(self, "_ids", ids)

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.dcp_size

    @functools.cached_property
    def table(self) -> torch.Tensor:  # [num_blocks] int64, block_ids as a tensor
        """Built once per layout, from the int64 buffer: torch.tensor(tuple) takes ~1 ms per
        16K ids, more than a 1M-token plan's own work."""
        if not self.block_ids:
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(self._ids, dtype=torch.int64)


@dataclass(frozen=True)
class CopyRuns:
    """The rows one source rank sends one target rank: run k copies `length[k]` rows from source
    slots [src_start[k], +length[k]) to target slots [dst_start[k], +length[k]). Runs are in
    position order, so the expanded slot lists pair row for row."""

    src_rank: int
    dst_rank: int
    src_start: torch.Tensor  # [R] int64, first source slot of each run
    dst_start: torch.Tensor  # [R] int64, first target slot of each run
    length: torch.Tensor  # [R] int64, rows per run (>= 1)

    @property
    def num_runs(self) -> int:
        return int(self.length.numel())

    @property
    def num_rows(self) -> int:
        return int(self.length.sum())

    def src_slots(self) -> torch.Tensor:  # [num_rows] int64, source slots in position order
        return self._slots[0]

    def dst_slots(self) -> torch.Tensor:  # [num_rows] int64, target slots in the same order
        return self._slots[1]

    @functools.cached_property
    def _slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Expanded once: the staged plan and the row copies (`kvio`) of a pair need them."""
        return expand_runs(self.src_start, self.length), expand_runs(self.dst_start, self.length)


@dataclass(frozen=True)
class RowBytes:
    """Bytes one token takes in each cache layer (the MTP layer is one more layer): the MLA row
    and the indexer key, 0 on IndexShare layers that keep no keys."""

    kv: tuple[int, ...]  # [num_layers]
    index: tuple[int, ...]  # [num_layers]

    def __post_init__(self) -> None:
        if len(self.kv) != len(self.index):
            raise ValueError(f"RowBytes: {len(self.kv)} kv layers but {len(self.index)} index")

    @property
    def per_token(self) -> int:
        return sum(self.kv) + sum(self.index)


@dataclass(frozen=True)
class TransferPlan:
    """Every copy one request needs, grouped by (source rank, target rank); pairs with nothing
    to move are absent (both sides compute the same plan, so neither waits for them)."""

    start: int  # first position moved (the decode side's cached prefix ends here)
    end: int  # one past the last position moved
    src_dcp_size: int
    dst_dcp_size: int
    pairs: tuple[CopyRuns, ...] = field(default_factory=tuple)  # sorted by (src, dst) rank

    @property
    def num_rows(self) -> int:
        """Rows moved per cache layer: end − start, each token once."""
        return sum(p.num_rows for p in self.pairs)

    def pair(self, src_rank: int, dst_rank: int) -> CopyRuns | None:
        for p in self.pairs:
            if (p.src_rank, p.dst_rank) == (src_rank, dst_rank):
                return p
        return None

    def from_source(self, src_rank: int) -> list[CopyRuns]:
        """What source rank `src_rank` sends (to each target rank that needs its rows)."""
        return [p for p in self.pairs if p.src_rank == src_rank]

    def to_target(self, dst_rank: int) -> list[CopyRuns]:
        """What target rank `dst_rank` receives (from each source rank holding its rows)."""
        return [p for p in self.pairs if p.dst_rank == dst_rank]

    def nbytes(self, row_bytes: RowBytes) -> int:
        """Bytes the plan moves over all layers: rows × bytes per token."""
        return self.num_rows * row_bytes.per_token


def expand_runs(start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Runs → the slots they cover:  (start [5, 20], length [3, 2]) → [5, 6, 7, 20, 21]."""
    start = start.to(torch.int64)
    ends = torch.cumsum(length.to(torch.int64), 0)  # [R] one past each run's last row
    rows = torch.arange(int(ends[-1]) if ends.numel() else 0, dtype=torch.int64)  # [total]
    run = torch.searchsorted(ends, rows, right=True)  # [total] run of each row
    # (searchsorted, not repeat_interleave: the latter is ~100x slower on CPU for short inputs)
    return start[run] + rows - (ends - length)[run]


def owned_slots(positions: torch.Tensor, kv: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner rank, slot on that rank) of each position [T] under `kv`, from `layout`'s rules.

    Raises if the block table does not cover a position (an unallocated or missing block)."""
    positions = positions.to(torch.int64)
    if positions.numel() == 0:
        return positions.clone(), positions.clone()
    needed = int(positions.max()) // kv.tokens_per_block + 1
    if needed > len(kv.block_ids):
        raise ValueError(
            f"block table: {len(kv.block_ids)} blocks of {kv.tokens_per_block} tokens cannot "
            f"hold position {int(positions.max())}"
        )
    if kv.dcp_size == 1:  # one rank: its local sequence is the positions
        owner, local = torch.zeros_like(positions), positions
    else:
        owner = layout.dcp_owner(positions, kv.dcp_size, kv.interleave)  # [T]
        local = layout.dcp_local_index(positions, kv.dcp_size, kv.interleave)  # [T]
    # every rank's local sequence is paged by the one table (`layout`), so one lookup serves all
    # owners, where `layout.slot_mapping` would map every position once per rank
    block = kv.table[local // kv.block_size]  # [T]
    if bool((block < 0).any()):
        bad = int(positions[block < 0][0])
        raise ValueError(f"block table: position {bad} falls in an unallocated (−1) block")
    return owner, block * kv.block_size + local % kv.block_size


def plan_transfer(src: KVLayout, dst: KVLayout, num_cached_on_dst: int,
                  num_tokens: int) -> TransferPlan:
    """The copies that move positions [num_cached_on_dst, num_tokens) from `src` to `dst`.

    Run k of a pair extends while the next token of the same (source, target) pair sits at the
    next source slot and the next target slot; runs are therefore maximal in position order.
    Computed from the pieces between the layouts' cuts (`_cut_step`), O(T / step) of them; where
    they would average ~4 tokens or fewer (an interleave of 1, 2 or 4), per token: O(T log T)
    for the grouping sort, T = num_tokens − num_cached_on_dst.
    """
    if not 0 <= num_cached_on_dst <= num_tokens:
        raise ValueError(
            f"num_cached_on_dst: {num_cached_on_dst} must be in [0, num_tokens = {num_tokens}]"
        )
    start, end = num_cached_on_dst, num_tokens
    num_cuts = sum((end - 1) // g - start // g for g in (_cut_step(src), _cut_step(dst)))
    if 4 * (num_cuts + 1) > end - start:  # pieces of ~4 tokens or fewer: per token costs as much
        pos = torch.arange(start, end, dtype=torch.int64)  # [T]
        return plan_positions(src, dst, pos, start, end)
    return plan_pieces(src, dst, start, end)


def _cut_step(kv: KVLayout) -> int:
    """Positions where a token's owner or slot may stop following its predecessor's are
    multiples of this step: I (a new interleave chunk; a page boundary of the local sequence,
    local % B == 0, falls on one too, since I divides B) or, on one rank, B (a page boundary).

        N = 2, I = 2, B = 4:  t      0 1 2 3 4 5 6 7 8 9 ...
                              owner  0 0 1 1 0 0 1 1 0 0        cuts at t = 0, 2, 4, 6, 8 ...
                              local  0 1 0 1 2 3 2 3 4 5        (page breaks at 0, 2, 8, 10 ...)
    """
    return kv.interleave if kv.dcp_size > 1 else kv.block_size


def plan_pieces(src: KVLayout, dst: KVLayout, start: int, end: int) -> TransferPlan:
    """`plan_transfer` of the range [start, end) from its pieces: the range cut at every multiple
    of either side's `_cut_step`. Inside a piece the owners stay and both slots advance by one,
    so a piece is one copy, found from its first position; pieces then coalesce as tokens do.

        src N = 2, I = 2; dst N = 1, B = 4; [3, 10):
        cuts    3 | 4 5 | 6 7 | 8 9          (src steps at 4, 6, 8; dst at 4, 8)
        pieces  [3, 4) [4, 6) [6, 8) [8, 10) → owners and slots at 3, 4, 6, 8; lengths 1 2 2 2
    """
    plan = TransferPlan(start, end, src.dcp_size, dst.dcp_size)
    if end <= start:
        return plan
    cuts = [torch.tensor([start], dtype=torch.int64)]
    for g in {_cut_step(src), _cut_step(dst)}:
        after = (start // g + 1) * g  # the first multiple of g past start
        cuts.append(torch.arange(after, max(after, end), g, dtype=torch.int64))
    first = torch.unique(torch.cat(cuts))  # [P] sorted first position of each piece
    length = torch.diff(first, append=torch.tensor([end]))  # [P]
    # the last position too, so that a table too short names it as the per-token plan does
    points = torch.cat([first, torch.tensor([end - 1])])  # [P + 1]
    s_rank, s_slot = (x[:-1] for x in owned_slots(points, src))  # [P], [P]
    d_rank, d_slot = (x[:-1] for x in owned_slots(points, dst))  # [P], [P]
    return _coalesce(src, dst, s_rank, s_slot, d_rank, d_slot, length, start, end)


def plan_positions(src: KVLayout, dst: KVLayout, pos: torch.Tensor, start: int,
                   end: int) -> TransferPlan:
    """The copies that move the positions `pos` ([T] int64, increasing, within [start, end)) from
    `src` to `dst`: `plan_transfer` over any subset of a range (e.g. only the positions whose
    target block has a page), per token. Only blocks holding one of `pos` need a valid id in
    `dst`."""
    if pos.numel() == 0:
        return TransferPlan(start, end, src.dcp_size, dst.dcp_size)
    s_rank, s_slot = owned_slots(pos, src)  # [T], [T]
    d_rank, d_slot = owned_slots(pos, dst)  # [T], [T]
    return _coalesce(src, dst, s_rank, s_slot, d_rank, d_slot, None, start, end)


def _coalesce(src: KVLayout, dst: KVLayout, s_rank: torch.Tensor, s_slot: torch.Tensor,
              d_rank: torch.Tensor, d_slot: torch.Tensor, length: torch.Tensor | None,
              start: int, end: int) -> TransferPlan:
    """Copies in position order ([P] each: ranks, first slots, `length` rows — None: one row
    each —, each copy's slots advancing by one on both sides) → the plan: grouped by (source,
    target) pair, position order inside, a run extended while the next copy of its pair
    continues both slots."""
    pair = s_rank * dst.dcp_size + d_rank  # [P] pair id
    if src.dcp_size * dst.dcp_size > 1:  # one pair: already grouped
        order = torch.sort(pair, stable=True).indices  # group by pair, position order inside
        pair, s_slot, d_slot = pair[order], s_slot[order], d_slot[order]
        length = None if length is None else length[order]
    step = 1 if length is None else length[:-1]  # [P − 1] rows of each copy but the last
    breaks = torch.ones_like(pair, dtype=torch.bool)  # [P] a run starts here
    breaks[1:] = ((pair[1:] != pair[:-1]) | (s_slot[1:] != s_slot[:-1] + step)
                  | (d_slot[1:] != d_slot[:-1] + step))
    first = torch.nonzero(breaks).squeeze(1)  # [R] index of each run's first copy
    if length is None:  # one row per copy: a run's rows are its copies
        run_len = torch.diff(first, append=torch.tensor([pair.numel()]))  # [R]
    else:
        ends = torch.cumsum(length, 0)  # [P] rows up to and including each copy
        run_end = torch.cat([ends[first[1:] - 1], ends[-1:]])  # [R] rows up to each run's end
        run_len = torch.diff(run_end, prepend=torch.zeros(1, dtype=torch.int64))  # [R]
    run_pair = pair[first]  # [R]
    pairs = []
    for p in torch.unique_consecutive(run_pair).tolist():
        sel = run_pair == p
        pairs.append(CopyRuns(
            src_rank=p // dst.dcp_size, dst_rank=p % dst.dcp_size,
            src_start=s_slot[first[sel]], dst_start=d_slot[first[sel]], length=run_len[sel],
        ))
    return TransferPlan(start, end, src.dcp_size, dst.dcp_size, tuple(pairs))
