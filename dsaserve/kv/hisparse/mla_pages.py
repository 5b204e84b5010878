"""Which GPU MLA page holds each block's MLA rows, or none: spilled (in the scheduler).

With `hisparse_config.device_mla_pages` the MLA cache has fewer pages than there are blocks. The
indexer keys keep one page per block id (what selects the rows must stay on the GPU); a block's
MLA rows live in a page of the smaller MLA cache while HBM allows, and otherwise only in the
HiSparse host pool, which holds every computed row already (mirrored as rows are written), so
spilling a page moves no data:

    block id   b0   b1   b2   b3   b4  (b5)       indexer pages: one per block id
    MLA page   -    -    7    2    5              "-": spilled, read through the hot buffer
                    ▲         └────┴── write tail: the block of num_computed_tokens onwards
                    └── a long decoder's block below its write tail, held by it alone

Rules (checked by `check_integrity`):
- A block a step writes (the write tail, MTP lookahead included) has a page.
- A request that reads its GPU pages directly (a prefill chunk, or a context within the hot
  buffer) has a page for every block. Only a long decoder (`reads_through_buffer` for any step
  it can take) reads through its hot buffer, and only its blocks below the write tail, held by
  it alone, are spilled, least recently scheduled request first.
- A spilled block stays in the prefix cache: its MLA rows are in the host pool and its indexer
  keys in its GPU page. While a request holds it, the rows are in that request's host window;
  once it is free ("host-kept"), the runtime keeps the host block that held them. A free cached
  block with a page keeps it until a page is needed (idle pages are taken before anything is
  spilled); an idle block whose page is taken leaves the prefix cache (no host copy is kept).
- A prefix hit on a block without a page gives it a page again, which the runner fills from
  the block's host rows (a restore: a host → GPU copy instead of a recomputation or a P/D
  transfer), since a prefill reads its GPU pages. A kept host block is given back then, or when
  its block leaves the prefix cache (allocation reuses the id, or host-pool pressure:
  `evict_host_kept`, least recently freed first).

Pure bookkeeping on the host, no torch. The runner learns the map through
`SchedulerOutput.mla_pages` (the changes since the last step), and the kept host blocks through
`host_keep` / `host_restore` / `host_drop`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from dsaserve.core import Request
from dsaserve.kv.block_pool import BlockPool

SPILLED = -1  # the page of a block whose MLA rows are only in the host pool


def reads_through_buffer(start: int, num_rows: int, buffer_rows: int,
                         max_query_rows: int) -> bool:
    """Whether a request computing `num_rows` rows from position `start` reads its MLA rows
    through its hot buffer (decoding, context beyond the buffer) rather than its GPU pages. The
    runner's `HiSparseRuntime.step` and the page map decide with this one function."""
    return start + num_rows > buffer_rows and num_rows <= max_query_rows


def is_long_decoder(req: Request, buffer_rows: int) -> bool:
    """Every step `req` can take reads through its hot buffer: it decodes (one known token left,
    so at most 1 + k rows with k drafts) and its context is beyond the buffer already."""
    return req.num_tokens - req.num_computed_tokens == 1 and req.num_computed_tokens >= buffer_rows


def receives_spilled(num_prompt_tokens: int, buffer_rows: int) -> bool:
    """Whether a P/D request's received prompt starts spilled (its blocks below the write tail
    without MLA pages): its first step, from the last prompt token, reads through the hot
    buffer. The same test as `is_long_decoder` once it runs (computed = prompt − 1)."""
    return num_prompt_tokens - 1 >= buffer_rows


class MlaPageMap:
    def __init__(self, num_pages: int, pool: BlockPool, *, write_lag: int = 0) -> None:
        """`write_lag`: positions below num_computed_tokens a step may still write. With
        --async-scheduling and k drafts the host counts a step in flight as all accepted and
        the device moves the next step's rows back by the drafts it rejects (up to k), so the
        write tail of a request with a step in flight starts k positions lower; 0 otherwise."""
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.pool = pool
        self.write_lag = write_lag
        self.page_of: dict[int, int] = {}  # block id → its MLA page (resident blocks only)
        # pop() hands out the last page first: block ids (the pool hands out 0 first) and pages
        # differ from the start, so a block id used as a page shows up in any test
        self._free_pages = list(range(num_pages))
        # free (ref 0) cached blocks keeping their page, least recently freed first
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._changes: dict[int, int] = {}  # block id → page or SPILLED, since take_changes()
        self.num_spills = 0  # blocks spilled so far (a counter for tests and stats)
        self._spilled_prefix: dict[str, int] = {}  # request id → its leading blocks spilled
        # free (ref 0) cached blocks without a page, their MLA rows in a host block the runtime
        # keeps for them; least recently freed first (evicted first under host-pool pressure)
        self._host_kept: OrderedDict[int, None] = OrderedDict()
        # since take_host_changes(): blocks newly kept, restored (given a page filled from
        # their host rows), and kept ones evicted
        self._keep: list[int] = []
        self._restore: list[int] = []
        self._drop: list[int] = []
        self.num_restores = 0  # blocks hit without a page and restored (a counter)
        pool.on_evict = self._evicted

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_host_kept(self) -> int:
        return len(self._host_kept)

    def host_kept(self) -> list[int]:
        """Free cached blocks whose MLA rows only a kept host block holds, LRU first."""
        return list(self._host_kept)

    def take_host_changes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(kept, restored, dropped) block ids since the last call: `SchedulerOutput.host_*`."""
        out = tuple(self._keep), tuple(self._restore), tuple(self._drop)
        self._keep, self._restore, self._drop = [], [], []
        return out

    def pending_changes(self) -> dict[int, int]:
        """The changes the next `take_changes` hands out (the runner has not seen them)."""
        return dict(self._changes)

    def take_changes(self) -> tuple[tuple[int, int], ...]:
        """(block id, page or SPILLED) for every block whose page changed since the last call."""
        changes, self._changes = tuple(self._changes.items()), {}
        return changes

    # ---- paired verbs: make_resident / freed, spill ------------------------------------------
    def num_missing(self, block_ids: Iterable[int]) -> int:
        return sum(1 for b in block_ids if b not in self.page_of)

    def can_provide(self, num: int, victims: Iterable[int], keep: Sequence[int] = ()) -> bool:
        """Whether `num` more pages can be found: free, idle or spilled from `victims`, those of
        `keep` excepted (the caller's request is about to hold them)."""
        keep_set = set(keep)
        room = len(self._free_pages) + sum(1 for b in self._idle if b not in keep_set)
        if room >= num:
            return True
        spillable = (b for b in victims if b not in keep_set)
        return any(room + i + 1 >= num for i, _ in enumerate(spillable))

    def victims(self, running: Sequence[Request], last_scheduled: dict[str, int],
                block_size: int, buffer_rows: int) -> Iterator[int]:
        """Blocks that may spill, in spill order: the long decoders' resident blocks below
        their write tails, held by them alone; the least recently scheduled request first
        (ties: the older running one), and within a request its earliest positions first.
        Lazy: pages are taken one at a time. A request's spilled blocks are a prefix of its
        table (spills go earliest first), skipped in O(1) through a cursor per request."""
        decoders = [(last_scheduled.get(r.request_id, -1), i, r) for i, r in enumerate(running)
                    if is_long_decoder(r, buffer_rows)]
        for _, _, req in sorted(decoders, key=lambda t: t[:2]):
            blocks, end = req.block_ids, self.write_tail(req, block_size)
            i = self._spilled_prefix.get(req.request_id, 0)
            while i < end and blocks[i] not in self.page_of:
                i += 1
            self._spilled_prefix[req.request_id] = i
            for b in blocks[i:end]:
                if b in self.page_of and self.pool.ref_count(b) == 1:
                    yield b

    def write_tail(self, req: Request, block_size: int) -> int:
        """The index in req's block table of the first block its next step may write: lower by
        the drafts its step in flight verifies, which it may reject (--async-scheduling: that
        step holds 1 + those drafts placeholders)."""
        lag = min(self.write_lag, max(req.num_output_placeholders - 1, 0))
        return max(req.num_computed_tokens - lag, 0) // block_size

    def forget(self, request_id: str) -> None:
        """The request left the running set (finished, aborted or preempted)."""
        self._spilled_prefix.pop(request_id, None)

    def make_resident(self, block_ids: Sequence[int], victims: Iterable[int]) -> bool:
        """Give every block of `block_ids` (held by the caller's request) a page: a free page,
        else an idle cached block's (that block leaves the prefix cache), else one spilled from
        `victims` (blocks in spill order, none of `block_ids`). A cached block given a page is
        a prefix hit on a spilled block: it is listed for the runner to restore from its host
        rows. False when they run out; the pages found so far stay assigned (the caller
        preempts, which gives them back)."""
        for b in block_ids:  # the request holds these again: their pages are not idle
            self._idle.pop(b, None)
        it: Iterator[int] = iter(victims)
        for b in block_ids:
            if b in self.page_of:
                continue
            page = self._take_page(it)
            if page is None:
                return False
            self._map(b, page)
            if self.pool.block_hash(b) is not None:  # a prefix hit on a spilled block
                self._restore.append(b)
                self.num_restores += 1
                self._host_kept.pop(b, None)  # the runtime gives its host block back then
                # a live holder's spilled prefix may have a page again: cursors are a shortcut
                self._spilled_prefix.clear()
        return True

    def freed(self, block_ids: Sequence[int]) -> None:
        """Blocks a request let go of, in table order (the pool's references already dropped):
        one that became free keeps its page while it is findable in the prefix cache, else
        gives it back; a spilled one still findable becomes host-kept (the runtime keeps the
        host block of the ending request's window). Idle pages are taken tail blocks first, as
        the pool evicts blocks, so a shared prefix keeps its pages longest."""
        for b in reversed(block_ids):
            if self.pool.ref_count(b):
                continue
            if b not in self.page_of:  # spilled: a cached one's host rows are kept
                if self.pool.block_hash(b) is not None and b not in self._host_kept:
                    self._host_kept[b] = None
                    self._keep.append(b)
                continue
            if self.pool.block_hash(b) is not None:
                self._idle.pop(b, None)
                self._idle[b] = None
            else:
                self._idle.pop(b, None)
                self._unmap(b)

    def _take_page(self, victims: Iterator[int]) -> int | None:
        if self._free_pages:
            return self._free_pages.pop()
        if self._idle:
            b, _ = self._idle.popitem(last=False)
            self.pool.uncache(b)
            self._unmap(b)
            return self._free_pages.pop()
        for b in victims:
            if b in self.page_of:  # the iterator is lazy: pages may have moved meanwhile
                self.spill(b)
                return self._free_pages.pop()
        return None

    def start_spilled(self, block_ids: Sequence[int]) -> None:
        """Blocks a request just took whose MLA rows a P/D read puts straight into the host
        pool (disagg/hostplan.py): they get no page, and a reused block id that still maps one
        (an evicted idle block) gives it back. Not counted as spills: no page was ever used."""
        for b in block_ids:
            assert self.pool.ref_count(b) == 1, "only a block one request holds starts spilled"
            self._idle.pop(b, None)
            if b in self.page_of:
                self.pool.uncache(b)
                self._unmap(b)

    def spill(self, block_id: int) -> None:
        """Drop the block's page: its rows stay in the host pool, and it stays findable."""
        assert self.pool.ref_count(block_id) == 1, "only a block one request holds spills"
        self._unmap(block_id)
        self.num_spills += 1

    def evict_host_kept(self, num: int) -> None:
        """Give back `num` kept host blocks: the least recently freed kept blocks leave the
        prefix cache (`_evicted` records the drops)."""
        for b in list(self._host_kept)[:num]:
            self.pool.uncache(b)

    def _evicted(self, block_id: int) -> None:
        """The pool dropped the block's hash (allocation reuses the id, or `uncache`): the host
        block kept for it goes back."""
        if block_id in self._host_kept:
            del self._host_kept[block_id]
            self._drop.append(block_id)

    def _map(self, block_id: int, page: int) -> None:
        self.page_of[block_id] = page
        self._changes[block_id] = page

    def _unmap(self, block_id: int) -> None:
        self._free_pages.append(self.page_of.pop(block_id))
        self._changes[block_id] = SPILLED

    # ---- invariants --------------------------------------------------------------------------
    def check_integrity(self, running: Iterable[Request], block_size: int,
                        buffer_rows: int, receiving: Iterable[Request] = ()) -> None:
        """Pages balance (free + mapped = total, no page twice); idle pages are exactly the free
        blocks' pages, each findable in the prefix cache; a free cached block without a page is
        host-kept, and a host-kept block is free, cached and without a page; an in-use block
        without one is below the write tail of one long decoder holding it alone, or of a long
        request whose prompt a P/D read is putting into the host pool (`receiving`: its write
        tail is its last prompt token)."""
        pages = list(self.page_of.values())
        if len(self._free_pages) + len(pages) != self.num_pages:
            raise AssertionError(f"MLA pages: {len(self._free_pages)} free + {len(pages)} mapped "
                                 f"!= {self.num_pages}")
        if len(set(pages + self._free_pages)) != self.num_pages:
            raise AssertionError("MLA pages: a page is mapped twice or both mapped and free")
        idle = {b for b in self.page_of if self.pool.ref_count(b) == 0}
        if idle != set(self._idle):
            raise AssertionError(f"MLA pages: idle {sorted(self._idle)} != free blocks with a "
                                 f"page {sorted(idle)}")
        if any(self.pool.block_hash(b) is None for b in idle):
            raise AssertionError("MLA pages: a free block keeps a page but is not cached")
        kept = {b for b in range(self.pool.num_blocks) if self.pool.ref_count(b) == 0
                and self.pool.block_hash(b) is not None and b not in self.page_of}
        if kept != set(self._host_kept):
            raise AssertionError(f"MLA pages: host-kept {sorted(self._host_kept)} != free cached "
                                 f"blocks without a page {sorted(kept)}")
        running = list(running)
        by_id = {r.request_id: r for r in running}
        for rid, i in self._spilled_prefix.items():
            if rid not in by_id or any(b in self.page_of for b in by_id[rid].block_ids[:i]):
                raise AssertionError(f"MLA pages: stale spill cursor of {rid!r}")
        spillable: set[int] = set()
        for req in running:
            if is_long_decoder(req, buffer_rows):
                spillable.update(req.block_ids[: self.write_tail(req, block_size)])
        for req in receiving:
            if receives_spilled(req.num_tokens, buffer_rows):
                spillable.update(req.block_ids[: (req.num_tokens - 1) // block_size])
        for b in range(self.pool.num_blocks):
            if self.pool.ref_count(b) and b not in self.page_of:
                if b not in spillable or self.pool.ref_count(b) != 1:
                    raise AssertionError(f"MLA pages: block {b} is spilled but a request may "
                                         "read or write its GPU page")

