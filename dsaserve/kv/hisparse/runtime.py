"""One rank's HiSparse state (in the runner): the host pool holding every tracked request's MLA
rows (the durable copy), one hot buffer per request and layer on the device, their slot tables,
and the per-step description the attention backend reads (`HiSparseStep`).

    GPU pages  kv[l]  [G, B, row]      written by the model; still read for fresh rows (G: the
                                       blocks, or fewer MLA pages under spilling: mla_pages.py)
        │ mirror (end of each step: the rows the step wrote; at admission: a prefix hit)
        ▼                              (P/D into a spilling rank: the rows of spilled blocks
                                       are READ here directly, disagg/hostplan.py)
    host pool  host[l] [H, B, row]     request r's position p: host_table[r, p // B]·B + p % B
        │                              (a spilled cached block of an ended request: its host
        │                              block is kept, `kept`, and a prefix hit restores it)
        │ miss fetch (residency.resolve → fetch_misses)
        ▼
    hot buffer hot[l]  [C·P/B, B, row] region c's slot s: flat row c·P + s (s = S: trash),
                                       P = S + 1 rounded up to whole pages of B rows

Rows at positions the request has computed before this step come from the host pool; rows
written during this step (the step's own rows, MTP drafts) are not mirrored yet and come from
their GPU pages, which are still resident (vLLM keeps the write tail resident for the same
reason). The hot buffer is laid out as a paged cache with the engine's page size, so any
backend's sparse MLA reads it as it reads the paged cache. On the CPU the host pool is ordinary
memory and a fetch is an index_select (the documented fallback); on CUDA the pool is pinned and
mapped, and one Triton launch reads the missed rows in place (`fetch.py`), with no host sync.
A layer's step on CUDA is then two launches besides invalidation: the residency step, which
updates the layer's slot tables in place, and the fetch, which derives each row's source and
destination itself and counts the misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsaserve.kernels import staging
from dsaserve.kv.hisparse.admission import hot_region_rows
from dsaserve.kv.hisparse.fetch import fetch_misses, mirror_rows
from dsaserve.kv.hisparse.mla_pages import reads_through_buffer
from dsaserve.kv.hisparse.residency import Residency, resolve_tables
from dsaserve.kv.host_pool import pin_host_memory

if TYPE_CHECKING:
    from dsaserve.kernels.metadata import AttentionMetadata
    from dsaserve.model.dsa import LayerCache


@dataclass(frozen=True)
class HiSparseStep:
    """What one forward's attention needs to route rows through hot buffers (built by the
    runner with the step's metadata; host lists, device tensors)."""

    tracked_regions: torch.Tensor  # [Rt] regions of the call's tracked requests
    tracked_requests: torch.Tensor  # [Rt] their rows in the call's batch
    tracked_from: torch.Tensor  # [Rt] first position the call writes for each (stale above)
    hot_regions: torch.Tensor  # [Rh] regions of the requests read through their hot buffer
    hot_requests: torch.Tensor  # [Rh] their rows in meta.block_table
    mirrored_upto: torch.Tensor  # [Rh] positions below are in the host pool
    row_region: torch.Tensor  # [T] index into hot_regions (−1: the row reads GPU pages)
    row_rank: torch.Tensor  # [T] the row's index among its request's rows
    row_hot: torch.Tensor  # [T] bool
    max_rows: int
    num_hot: int  # requests read through hot buffers
    num_reqs: int
    # a padded step's (kv/hisparse/padded.py): every request slot is tracked and resolved
    # (slots of page-reading requests and padding in the trash region), and both the hot and
    # the page path run, row_hot picking per row, whatever the batch (shapes fixed per size)
    padded: bool = False


@dataclass
class _Entry:
    region: int
    host_blocks: list[int]
    arriving: bool = False  # reserved for a P/D read into the pool; `add` has not run yet


class HiSparseRuntime:
    def __init__(self, caches: list[LayerCache], *, num_host_blocks: int,
                 blocks_per_request: int, max_requests: int, buffer_rows: int,
                 max_query_rows: int, block_size: int, device: torch.device) -> None:
        self.caches = caches
        self.block_size = block_size
        self.buffer_rows = buffer_rows  # S
        self.max_query_rows = max_query_rows  # 1 + drafts: a step's rows of one decode
        self.blocks_per_request = blocks_per_request
        self.device = device
        shapes = [(c.kv.shape[2:], c.kv.dtype) for c in caches]
        # the durable copy: MLA rows only (indexer keys stay in GPU pages)
        self.host = [torch.zeros((num_host_blocks, block_size, *s), dtype=d) for s, d in shapes]
        if device.type == "cuda":
            for t in self.host:  # page-locked like the host KV tier (kv/host_pool.py)
                pin_host_memory(self, t.view(torch.uint8).view(-1), "--kv-transfer-config")
        self.region_rows = hot_region_rows(buffer_rows, block_size)  # P
        pages = max_requests * self.region_rows // block_size
        self.hot = [torch.zeros((pages, block_size, *s), dtype=d, device=device)
                    for s, d in shapes]
        self.max_requests = max_requests
        # region max_requests is the trash region, no request's: a padded step's slots that
        # read no hot buffer (kv/hisparse/padded.py) resolve there an empty union, so it has
        # table rows but no hot rows (a fetch into it is masked in `_fetch`)
        self.trash_region = max_requests
        # IndexShare: a layer without its own indexer attends over the top-k of the last layer
        # before it with one (its group's leader), so its residency is the leader's: resolved
        # once per group, the group's layers sharing the leader's tables (vLLM does the same)
        self.leader = [0] * len(caches)
        for i, c in enumerate(caches):
            self.leader[i] = i if c.index is not None or i == 0 else self.leader[i - 1]
        tables = {i: torch.full((max_requests + 1, buffer_rows), -1, dtype=torch.int64,
                                device=device) for i in set(self.leader)}
        self.slot_token = [tables[i] for i in self.leader]  # [C + 1, S] one tensor per group
        stamps = {i: torch.full_like(t, -1) for i, t in tables.items()}
        self.slot_stamp = [stamps[i] for i in self.leader]
        self.host_table = torch.zeros((max_requests + 1, blocks_per_request), dtype=torch.int64,
                                      device=device)  # region → its reserved host blocks
        # LRU clock, one tick per resolve: a device tensor, so a layer's step reads no host state
        self._stamp = torch.zeros((), dtype=torch.int64, device=device)
        self._layer_of = {c.kv.data_ptr(): i for i, c in enumerate(caches)}
        # leader layer → the positions it resolved in this forward and their residency
        self._resolved: dict[int, tuple[torch.Tensor, Residency]] = {}
        self.num_resolves = 0  # residency steps run (a host counter for tests)
        self.entries: dict[str, _Entry] = {}
        self._free_blocks = list(range(num_host_blocks))
        # block id → the host block keeping its MLA rows: a spilled block still in the prefix
        # cache after the request that held it ended (the scheduler's MlaPageMap.host_kept)
        self.kept: dict[int, int] = {}
        self._free_regions = list(range(max_requests))
        # (rows missed, of those read from the host pool), all layers and steps: metrics the
        # fetch adds to on the device (no launch of their own)
        self._counts = torch.zeros(2, dtype=torch.int64, device=device)

    @property
    def rows_missed(self) -> torch.Tensor:
        return self._counts[0]

    @property
    def rows_from_host(self) -> torch.Tensor:
        return self._counts[1]

    @property
    def num_host_blocks(self) -> int:
        return self.host[0].shape[0]

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_blocks)

    # ---- requests --------------------------------------------------------------------------
    def add(self, rid: str, num_computed: int, pages: list[int]) -> None:
        """Reserve the request's host window and a hot region (or keep those `reserve` took for
        its P/D read); mirror a prefix it starts with (GPU prefix hit, host-tier load, or the
        rows a P/D read put in GPU pages) from its resident MLA pages."""
        e = self.entries.get(rid)
        if e is not None and e.arriving:
            e.arriving = False
        else:
            # a fresh window has only what this mirror copies: every computed block must have
            # its page (the scheduler spills no block of a request the runner has not added)
            assert all(p >= 0 for p in pages[: -(-num_computed // self.block_size)]), (
                f"HiSparse: request {rid!r} arrives with a spilled block in its computed prefix")
            self.reserve(rid)
            self.entries[rid].arriving = False
        if num_computed:
            self.mirror({rid: (0, num_computed, pages)})

    def reserve(self, rid: str) -> list[int]:
        """The request's host window and hot region, taken before its rows arrive (a P/D read
        straight into the pool, disagg/hostplan.py); its host blocks in position order."""
        if rid in self.entries:
            self.remove(rid)
        if len(self._free_blocks) < self.blocks_per_request or not self._free_regions:
            raise RuntimeError("HiSparse: host pool full; the scheduler admitted too many requests")
        blocks = [self._free_blocks.pop() for _ in range(self.blocks_per_request)]
        region = self._free_regions.pop()
        self.entries[rid] = _Entry(region, blocks, arriving=True)
        self.host_table[region] = torch.tensor(blocks, dtype=torch.int64)
        for leader in set(self.leader):
            self.slot_token[leader][region] = -1
            self.slot_stamp[leader][region] = -1
        return blocks

    def remove(self, rid: str, keep: dict[int, int] | None = None) -> None:
        """The request ended: its window and region go back, except the host blocks of `keep`
        (block id → index in its table: spilled blocks still in the prefix cache), kept."""
        e = self.entries.pop(rid, None)
        if e is None:
            return
        kept = set()
        for block_id, i in (keep or {}).items():
            assert block_id not in self.kept, f"block {block_id} is kept twice"
            self.kept[block_id] = e.host_blocks[i]
            kept.add(i)
        self._free_blocks += [h for i, h in enumerate(e.host_blocks) if i not in kept]
        self._free_regions.append(e.region)

    def host_block(self, rid: str, index: int) -> int:
        """The host block holding the rows of block `index` of the request's table."""
        return self.entries[rid].host_blocks[index]

    def release_kept(self, block_id: int) -> None:
        """A kept block left the prefix cache or was restored: its host block goes back."""
        self._free_blocks.append(self.kept.pop(block_id))

    def restore(self, pages: list[int], host_blocks: list[int]) -> None:
        """Fill GPU MLA pages from host blocks, every layer: a prefix hit on spilled blocks (a
        prefill reads its GPU pages). One host → device copy per layer."""
        if not pages:
            return
        dst = torch.tensor(pages, dtype=torch.int64, device=self.device)
        src = torch.tensor(host_blocks, dtype=torch.int64)
        for cache, pool in zip(self.caches, self.host, strict=True):
            cache.kv.index_copy_(0, dst, pool.index_select(0, src).to(self.device))

    def mirror(self, ranges: dict[str, tuple[int, int, list[int]]]) -> None:
        """Copy positions [lo, hi) of each request from its GPU MLA pages to the host pool,
        every layer, on the device (`fetch.mirror_rows`: no host sync). Positions of spilled
        blocks (page −1) are skipped: their rows are in the pool already (mirrored before the
        spill, or read there directly by P/D)."""
        gpu, host = [], []
        b = self.block_size
        for rid, (lo, hi, pages) in ranges.items():
            runs = _resident_runs(lo, min(hi, len(pages) * b), pages, b)
            if not runs:
                continue
            # Tensor maths per run of resident blocks, not a Python loop per position: a
            # 1M-token prefix arrives at once.
            pos = torch.cat([torch.arange(first, end) for first, end in runs])  # [n]
            blk, off = pos // b, pos % b
            gpu.append(torch.tensor(pages, dtype=torch.int64)[blk] * b + off)
            host.append(torch.tensor(self.entries[rid].host_blocks, dtype=torch.int64)[blk] * b
                        + off)
        if not gpu:
            return
        g, h = staging.upload([torch.cat(gpu), torch.cat(host)], self.device)
        mirror_rows([(pool.flatten(0, 1), cache.kv.flatten(0, 1))
                     for cache, pool in zip(self.caches, self.host, strict=True)], h, g)

    # ---- the step ----------------------------------------------------------------------------
    def step(self, req_ids: list[str], starts: list[int], counts: list[int],
             computed: list[int]) -> HiSparseStep | None:
        """The description of one forward: request r computes counts[r] rows from starts[r];
        computed[r] rows of it were computed before this engine step (mirrored). A request
        reads through its hot buffer when its context outgrows the buffer and it decodes
        (at most 1 + drafts rows)."""
        dev = self.device
        t_regions, t_reqs, t_from, h_regions, h_reqs, h_upto = [], [], [], [], [], []
        row_region: list[int] = []
        row_rank: list[int] = []
        for r, rid in enumerate(req_ids):
            e = self.entries.get(rid)
            n = counts[r]
            hot = e is not None and reads_through_buffer(starts[r], n, self.buffer_rows,
                                                         self.max_query_rows)
            if e is not None:
                t_regions.append(e.region)
                t_reqs.append(r)
                t_from.append(starts[r])
            if hot:
                row_region += [len(h_regions)] * n
                h_regions.append(e.region)
                h_reqs.append(r)
                h_upto.append(computed[r])
            else:
                row_region += [-1] * n
            row_rank += range(n)
        if not t_regions:
            return None

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        rr = t(row_region)
        return HiSparseStep(
            tracked_regions=t(t_regions), tracked_requests=t(t_reqs), tracked_from=t(t_from),
            hot_regions=t(h_regions),
            hot_requests=t(h_reqs), mirrored_upto=t(h_upto), row_region=rr, row_rank=t(row_rank),
            row_hot=rr >= 0, max_rows=self.max_query_rows, num_hot=len(h_regions),
            num_reqs=len(req_ids))

    def layer_of(self, kv: torch.Tensor) -> int:
        return self._layer_of[kv.data_ptr()]

    def invalidate(self, layer: int, step: HiSparseStep) -> None:
        """Forget hot copies of positions this forward rewrites (rejected drafts, MTP rows).
        A group's tables are its leader's: invalidated there, before its residency step (a
        later layer of the group must not forget what that step put in)."""
        if self.leader[layer] != layer:
            return
        regions = step.tracked_regions
        tok = self.slot_token[layer][regions]  # [Rt, S]
        stale = tok >= step.tracked_from[:, None]
        self.slot_token[layer][regions] = torch.where(stale, -1, tok)
        st = self.slot_stamp[layer][regions]
        self.slot_stamp[layer][regions] = torch.where(stale, -1, st)

    def resolve(self, layer: int, positions: torch.Tensor, meta: AttentionMetadata,
                step: HiSparseStep) -> torch.Tensor:
        """positions [T, K] request-local (−1 pad) → [T, K] flat rows of hot[layer] (−1 for
        pads and rows not read through a hot buffer), after fetching the misses. Device work
        only (on CUDA two Triton launches and a few index ops; the stamp ticks on the device):
        capturable, given the step's tensors at fixed addresses."""
        s1 = self.region_rows
        regions = step.hot_regions
        leader = self.leader[layer]
        if leader == layer:
            # the group's tables, updated in place
            res = resolve_tables(positions, step.row_region, step.row_rank,
                                 self.slot_token[layer], self.slot_stamp[layer], regions,
                                 self._stamp, step.max_rows)
            self._stamp.add_(1)
            self.num_resolves += 1
            self._resolved[layer] = (positions, res)
        else:
            # the group's tables are the leader's and its positions are the same tensor (the
            # model hands a shared layer its leader's top-k), so its outcome is this layer's:
            # only the fetch is per layer (the rows differ)
            leader_positions, res = self._resolved[leader]
            assert leader_positions is positions, (
                f"layer {layer} shares layer {leader}'s indexer but got other positions")
        self._fetch(layer, res.miss_pos, res.miss_slot, meta, step)
        region_of_row = regions[step.row_region.clamp(min=0)]  # [T]
        return torch.where(res.hot_slots >= 0, region_of_row[:, None] * s1 + res.hot_slots, -1)

    def _fetch(self, layer: int, miss_pos: torch.Tensor, miss_slot: torch.Tensor,
               meta: AttentionMetadata, step: HiSparseStep) -> None:
        """Fill the missed slots [Rh, W]: from the host pool below mirrored_upto, else from the
        request's GPU page (`fetch.fetch_misses`: one zero-copy launch on CUDA; meta addresses
        the MLA pages, and the write tail is resident). Masked entries (the trash slot S)
        fetch nothing, nor does the trash region (it has no hot rows; its union is empty)."""
        fetch_misses(self.hot[layer].flatten(0, 1), self.host[layer].flatten(0, 1),
                     self.caches[layer].kv.flatten(0, 1), miss_pos, miss_slot, step.hot_regions,
                     step.hot_requests, step.mirrored_upto, self.host_table, meta.block_table,
                     self._counts, block_size=self.block_size, buffer_rows=self.buffer_rows,
                     region_rows=self.region_rows, trash_region=self.trash_region)

    # ---- invariants --------------------------------------------------------------------------
    def check_integrity(self, requests: dict[str, tuple[int, list[int]]]) -> None:
        """requests: the runner's (num_computed_tokens, MLA pages, −1 where spilled) per live
        request. Pools balance; only live requests hold state; the host copy equals the GPU
        pages for every computed position still resident; every hot slot holds the bytes of
        the token it records."""
        if self.device.type == "cuda":  # the mirror writes the pool from the device
            torch.cuda.synchronize(self.device)
        held = [h for e in self.entries.values() for h in e.host_blocks]
        owned = self._free_blocks + held + list(self.kept.values())
        assert len(owned) == self.num_host_blocks, "host blocks leak"
        assert len(set(owned)) == len(owned), "a host block is free, reserved or kept twice"
        assert len(self._free_regions) + len(self.entries) == self.max_requests
        for layer, leader in enumerate(self.leader):  # what lets a group resolve once
            assert self.slot_token[layer] is self.slot_token[leader] and (
                self.slot_stamp[layer] is self.slot_stamp[leader]), (
                f"layer {layer}'s hot tables are not its index group's ({leader})")
        arriving = {rid for rid, e in self.entries.items() if e.arriving}
        assert set(self.entries) - arriving == set(requests), "HiSparse state for unknown requests"
        b, s = self.block_size, self.buffer_rows
        for rid, e in self.entries.items():
            if e.arriving:  # a P/D read's reservation: nothing computed, no hot row yet
                assert all(bool((t[e.region] < 0).all()) for t in self.slot_token)
                continue
            computed, pages = requests[rid]
            pos = torch.arange(computed)
            page = torch.tensor(pages, dtype=torch.int64)[pos // b]
            pos = pos[page >= 0]  # spilled positions are only in the host pool
            host_rows = torch.tensor(e.host_blocks)[pos // b] * b + pos % b
            gpu_rows = page[page >= 0] * b + pos % b
            for layer, cache in enumerate(self.caches):
                host = self.host[layer].flatten(0, 1)
                gpu = cache.kv.flatten(0, 1).cpu()
                assert torch.equal(host[host_rows].view(torch.uint8),
                                   gpu[gpu_rows].view(torch.uint8)), (rid, layer, "mirror")
                tok = self.slot_token[layer][e.region].cpu()
                full = tok >= 0
                assert int(full.sum()) == len(set(tok[full].tolist())), "a token in two slots"
                regions = self.hot[layer].view(self.max_requests, self.region_rows,
                                               *self.hot[layer].shape[2:])
                hot = regions[e.region, :s].cpu()[full]
                p = tok[full]
                rows = host[torch.tensor(e.host_blocks)[p // b] * b + p % b]
                assert torch.equal(hot.view(torch.uint8), rows.view(torch.uint8)), (
                    rid, layer, "a hot slot does not hold its recorded token's row")


def _resident_runs(lo: int, hi: int, pages: list[int], block_size: int) -> list[tuple[int, int]]:
    """Positions [lo, hi) whose blocks have a GPU page, as runs [first, end) of consecutive
    resident blocks (host-side lists: no device data is read).

        block size 4, pages [3, -1, -1, 7, 2], lo 2, hi 19  →  [(2, 4), (12, 19)]
    """
    runs: list[tuple[int, int]] = []
    b = block_size
    for blk in range(lo // b, -(-hi // b) if hi > lo else 0):
        if pages[blk] < 0:
            continue
        first, end = max(lo, blk * b), min(hi, (blk + 1) * b)
        if runs and runs[-1][1] == first:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((first, end))
    return runs
