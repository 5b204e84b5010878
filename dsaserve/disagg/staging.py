"""P/D consumer: the staged READ, for pairs whose zero-copy segments are per row.

A zero-copy READ (`descriptors.plan_segments`) needs one segment wherever either side's slots
jump. With the prefill side's interleave below its page size (I_s = 1 under DCP), consecutive
positions alternate between source ranks, so every row of a pair is its own segment (two per
FP8 indexer key): 49,152 segments for one DCP rank's share of a 32K request over 4 layers, and
a READ 50-100x slower than whole pages on both transports (docs/disagg.md, "Measured").

The staged READ lets only the source's slots decide: the pair's rows are READ, sorted by source
slot, into a contiguous staging buffer of this rank (registered with the transport), so a
segment breaks only where the source's slots do, at page boundaries: one segment per source page
per tensor, as many as zero-copy needs when pages line up. The rows are then scattered from the
buffer into their target slots (one index copy per tensor, `kvio.put_rows`). Same rows, same
bytes (`plan.nbytes`); the producer does nothing more than hold its blocks, as in vLLM's pull
protocol. Buffer, per pair, tensor-major (the order of `kvio.part_views`):

    | layer 0: kv rows [n, kv_0] | index: rows [n, 2D] or values [n, D], scales [n, 4] | layer 1 ...
      row j = the pair's row with the j-th smallest source slot

    source page 7 (B = 4)       staging buffer              target slots (their own order)
    slots 28 29 30 31  ──1 segment──►  rows 0 1 2 3  ──scatter──►  5  9  13  17

Chosen per (source rank, target) pair from `segments / (rows × layers)` of both READs against
`STAGE_SEGMENTS_PER_ROW` (`worth_staging`: zero-copy at or above it, staged below). Buffers come
from a `StagingPool` of this rank's registered regions (at most `DisaggConfig.staging_mb`; a
request whose staged pairs do not fit READs them zero-copy). A rank with a HiSparse host pool
keeps a second pool in host memory for the pairs whose rows go there, so that their buffer and
their scatter stay on the host (the caches' pool is on their device):

    pairs into the caches     ── READ ──► S{k}  (the caches' device) ──scatter──► L{i}.kv / index
    pairs into the host pool  ── READ ──► SH{k} (host memory)        ──scatter──► H{i}.kv
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dsaserve.disagg import kvio
from dsaserve.disagg.descriptors import LayerFormat, check_formats, coalesce
from dsaserve.disagg.relayout import CopyRuns
from dsaserve.disagg.transport import KVTransport

# Zero-copy segments per row and layer from which a pair is staged. Measured (docs/disagg.md,
# CPU, both transports, 4 fp8 layers): 3 per row and layer (I = 1) READ at 0.01-0.02 GB/s,
# 1/32 (I = B = 64: one per page per tensor) at the bulk rate; a segment cost ~10 us, where
# staging adds one scatter of the rows (~1 us per 788-byte layer row at the measured 0.77 GB/s).
# At 1, every layout in which some tensor needs a segment per row (I = 1; I = 2 with FP8 keys)
# is staged, and I = B (vLLM's choice: one segment per page per tensor) stays zero-copy for
# every page of > 2 tokens, where staging would not cut the count (it splits FP8 pages into
# their values and scales).
STAGE_SEGMENTS_PER_ROW = 1.0


def segments_per_row(layers: Sequence[dict[str, torch.Tensor]], num_rows: int) -> float:
    """A zero-copy plan's segments (`descriptors.plan_segments`) per row and layer moved: a
    layer with nothing to move (no indexer keys under IndexShare, for a plan of keys alone)
    does not count, or it would dilute the layers that do."""
    num_segments = sum(int(seg.shape[0]) for layer in layers for seg in layer.values())
    return num_segments / max(1, num_rows * _num_moved(layers))


def _num_moved(layers: Sequence[dict[str, torch.Tensor]]) -> int:
    return sum(1 for layer in layers if layer)


def worth_staging(zero_copy: Sequence[dict[str, torch.Tensor]], staged: StagedPair) -> bool:
    """Stage a pair where its zero-copy READ is per row and the staged one is not (a target
    that takes every other row of a source page, DCP on both sides at other interleaves, gains
    nothing from staging: its source slots are not contiguous either)."""
    return (segments_per_row(zero_copy, staged.num_rows) >= STAGE_SEGMENTS_PER_ROW
            > segments_per_row(staged.reads, staged.num_rows))


@dataclass(frozen=True)
class Piece:
    """One tensor's rows of one layer in the staging buffer: bytes [offset, offset + n·width)."""

    layer: int
    part: str  # "kv" or "index": the cache tensor (region L{layer}.{part}) read from
    sub: int  # which of `kvio.part_views`' index views (0; FP8 keys: 0 values, 1 scales)
    offset: int  # byte offset in the pair's share of the buffer
    width: int  # bytes per row


@dataclass(frozen=True)
class StagedPair:
    """A pair's staged READ: the segments per layer and tensor, and where each row goes."""

    reads: list[dict[str, torch.Tensor]]  # per layer, part → [K, 3] (source byte, buffer byte, n)
    pieces: tuple[Piece, ...]
    dst_slots: torch.Tensor  # [n] int64, target slot of buffer row j
    nbytes: int  # the pair's share of the buffer: n × bytes per token of the parts moved

    @property
    def num_rows(self) -> int:
        return int(self.dst_slots.numel())

    @property
    def num_segments(self) -> int:
        return sum(int(seg.shape[0]) for layer in self.reads for seg in layer.values())


def _source_bytes(slots: torch.Tensor, key: tuple) -> torch.Tensor:
    """[n] first byte of each slot's row in its source region: ("rows", width) of a row-major
    tensor, or ("values" | "scales", bytes per key D + 4, tokens per page B) of an FP8 page."""
    if key[0] == "rows":
        return slots * key[1]
    _, k, b = key
    page = (slots // b) * b * k  # [n] the page's first byte: B values of D bytes, B scales of 4
    if key[0] == "values":
        return page + (slots % b) * (k - 4)
    return page + b * (k - 4) + (slots % b) * 4


def plan_staged(pair: CopyRuns, src: Sequence[LayerFormat], dst: Sequence[LayerFormat],
                parts: tuple[str, ...] = ("kv", "index")) -> StagedPair:
    """The staged READ of `pair`'s rows, for the tensors in `parts` (as `plan_segments`)."""
    check_formats(src, dst)
    s = pair.src_slots()  # [n] source slots, position order
    order = torch.argsort(s, stable=True)  # buffer row j ← the row of the j-th smallest slot
    s, t = s[order], pair.dst_slots()[order]  # [n], [n]
    n = int(s.numel())
    j = torch.arange(n, dtype=torch.int64)  # [n] buffer rows
    reads: list[dict[str, torch.Tensor]] = []
    pieces: list[Piece] = []
    offset = 0
    memo: dict[tuple, torch.Tensor] = {}  # layers of one format share their segments

    def rows(layer: int, part: str, sub: int, width: int, key: tuple) -> torch.Tensor:
        """One piece's segments [K, 3] (source byte, buffer byte, n), placed at `offset`."""
        nonlocal offset
        if key not in memo:
            memo[key] = coalesce(torch.stack((_source_bytes(s, key), j * width,
                                              torch.full_like(j, width)), 1))
        pieces.append(Piece(layer, part, sub, offset, width))
        segs = memo[key] + torch.tensor([0, offset, 0])
        offset += n * width
        return segs

    for i, f in enumerate(src):
        layer: dict[str, torch.Tensor] = {}
        if "kv" in parts:
            layer["kv"] = rows(i, "kv", 0, f.kv_bytes, ("rows", f.kv_bytes))
        if "index" in parts and f.index_bytes and f.index_fp8:
            k, b = f.index_bytes, f.block_size
            layer["index"] = torch.cat((rows(i, "index", 0, k - 4, ("values", k, b)),
                                        rows(i, "index", 1, 4, ("scales", k, b))))
        elif "index" in parts and f.index_bytes:
            layer["index"] = rows(i, "index", 0, f.index_bytes, ("rows", f.index_bytes))
        reads.append(layer)
    return StagedPair(reads, tuple(pieces), t, offset)


def scatter_staged(staged: StagedPair, buf: torch.Tensor,
                   targets: Sequence[dict[str, list[torch.Tensor]]]) -> None:
    """Write the landed buffer `buf` ([nbytes] uint8, the pair's share) into the target: per
    layer, part → its byte views (`kvio.part_views` of the caches, or a host pool's rows)."""
    n = staged.num_rows
    slots = staged.dst_slots.to(buf.device)
    for p in staged.pieces:
        view = targets[p.layer][p.part][p.sub]
        rows = buf[p.offset: p.offset + n * p.width].view(n, p.width)  # [n, width]
        kvio.put_rows(view, slots.to(view.device), rows.to(view.device))


@dataclass
class StagingBuffer:
    name: str  # the transport region
    tensor: torch.Tensor  # [capacity] uint8, registered


@dataclass
class StagingPool:
    """One rank's staging buffers: transport regions allocated on demand (a transport cannot
    free a region, so they are kept and reused), `max_bytes` in all. A buffer is taken when a
    request's READs are posted and given back when they settle (landed and scattered, failed,
    timed out, or cancelled by an abort or shutdown)."""

    transport: KVTransport
    device: torch.device
    max_bytes: int
    prefix: str = "S"  # of its regions' names (a rank's pools must not share one)
    free: list[StagingBuffer] = field(default_factory=list)
    in_use: dict[str, StagingBuffer] = field(default_factory=dict)  # region name → buffer
    allocated: int = 0  # bytes of every region made

    MIN_BYTES = 1 << 20  # the smallest region made (rounded up to a power of two above it)

    def take(self, nbytes: int) -> StagingBuffer | None:
        """A buffer of >= `nbytes`; None when a new one would pass `max_bytes`."""
        fits = [b for b in self.free if b.tensor.numel() >= nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.tensor.numel())
            self.free.remove(buf)
        else:
            size = max(self.MIN_BYTES, 1 << (nbytes - 1).bit_length())
            if self.allocated + size > self.max_bytes:
                size = nbytes  # no rounding where the rounding alone would not fit
                if self.allocated + size > self.max_bytes:
                    return None
            name = f"{self.prefix}{len(self.free) + len(self.in_use)}"
            if self.device.type == "cpu":
                tensor = self.transport.allocate(name, size)
            else:  # NIXL registers device memory in place
                tensor = self.transport.register(
                    name, torch.empty(size, dtype=torch.uint8, device=self.device))
            self.allocated += size
            buf = StagingBuffer(name, tensor)
        self.in_use[buf.name] = buf
        return buf

    def give(self, buf: StagingBuffer) -> None:
        del self.in_use[buf.name]
        self.free.append(buf)

    def check_integrity(self, holders: int) -> None:
        """`holders`: requests with a buffer of this pool posted; each holds exactly one."""
        assert len(self.in_use) == holders, (
            f"{len(self.in_use)} staging buffers in use for {holders} requests")
        assert not set(self.in_use) & {b.name for b in self.free}
        assert sum(b.tensor.numel() for b in [*self.free, *self.in_use.values()]) == \
            self.allocated <= self.max_bytes
