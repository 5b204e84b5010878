"""The scheduler-side half of the host KV tier: which blocks the host holds, which copies to run.

One per engine, CPU only, shared by all ranks (every rank copies its own shard of each job). The
host tier's bookkeeping is a `BlockPool` — same states, same verbs as the GPU pool:

    host block state        ref   findable   how it got there
    being stored            1     no         allocate (evicts the LRU head's key)
    cached                  0     yes        store done: key registered, ref → 0 (LRU tail)
    being loaded            ≥ 1   yes        a load touches it; done → ref−−, back to the tail

Lookup continues the GPU prefix match in the host tier (same chained SHA-256 keys, `cache_salt`
in the root, so salted tenants never share either tier):

    request blocks   [ g0 | g1 | h2 | h3 | h4 | miss ... ]
                       GPU hits    host hits: GPU blocks allocated, load job issued

Every in-flight job holds one reference on its GPU blocks and on its host blocks: a block being
stored is never reallocated (so never rewritten) before its copy lands, and a block being loaded
stays allocated even if its request is aborted meanwhile. A dropped store (host tier full of
blocks in flight) is only a future miss.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from dsaserve.core import KVTransfer, ModelRunnerOutput, Request, RequestStatus
from dsaserve.kv.block_pool import BlockPool
from dsaserve.kv.manager import KVCacheManager


@dataclass
class _Load:
    job: KVTransfer
    request: Request
    num_tokens: int  # tokens the load adds to the request's computed prefix


@dataclass
class _Store:
    job: KVTransfer
    block_hashes: tuple[bytes, ...]  # registered in the host tier when the copy lands


class OffloadManager:
    def __init__(self, kv: KVCacheManager, num_host_blocks: int, host_block_bytes: int) -> None:
        self.kv = kv
        self.block_size = kv.block_size  # the scheduler block, B·N tokens
        self.host = BlockPool(num_host_blocks, enable_caching=True)
        self.host_block_bytes = host_block_bytes  # all ranks' shards of one block
        self._loads: deque[_Load] = deque()  # in flight, job-id order
        self._stores: deque[_Store] = deque()
        self._unsent: list[KVTransfer] = []  # created since the last schedule()
        self._unsent_loads: list[KVTransfer] = []
        self._next_load_id = 0
        self._next_store_id = 0
        self._storing: set[bytes] = set()  # keys with a store in flight
        self._num_offered: dict[str, int] = {}  # request id → leading blocks offered
        self._queried: set[str] = set()  # requests counted in the queries
        self._hit: set[str] = set()  # requests counted in the hits (at their load, not lookup)
        self.queries = 0  # tokens looked up (once per request)
        self.hits = 0  # tokens found in the host tier
        self.blocks_stored = 0
        self.blocks_loaded = 0

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_loading(self) -> int:
        return len(self._loads)

    @property
    def busy(self) -> bool:
        """A copy is in flight or waiting to be sent."""
        return bool(self._loads or self._stores)

    @property
    def num_used_blocks(self) -> int:
        """Host blocks holding KV or being filled."""
        return self.host.num_cached_blocks + sum(len(s.block_hashes) for s in self._stores)

    def loading_requests(self) -> list[Request]:
        return [load.request for load in self._loads
                if load.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS]

    # ---- loads: lookup → start_load → (runner) → finished ----------------------------------------
    def lookup(self, request: Request, num_gpu_hit_blocks: int) -> list[int]:
        """The host blocks that continue `request`'s GPU prefix hit (never its last token)."""
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[num_gpu_hit_blocks:max_hit_blocks]:
            host_id = self.host.lookup(block_hash)
            if host_id is None:
                break
            hits.append(host_id)
        if self.kv.drop_last_hit and hits:  # MTP: the chain's last block is recomputed (manager)
            hits.pop()
        if request.request_id not in self._queried:
            self._queried.add(request.request_id)
            self.queries += request.num_tokens
        return hits

    def start_load(self, request: Request, gpu_block_ids: list[int],
                   host_block_ids: list[int]) -> None:
        """Copy `host_block_ids` into `request`'s fresh `gpu_block_ids`; the request waits."""
        job = KVTransfer(self._next_load_id, tuple(gpu_block_ids), tuple(host_block_ids))
        self._next_load_id += 1
        self.host.touch(host_block_ids)
        self.kv.pool.touch(gpu_block_ids)
        self._loads.append(_Load(job, request, len(host_block_ids) * self.block_size))
        self._unsent_loads.append(job)
        self.blocks_loaded += len(host_block_ids)
        if request.request_id not in self._hit:  # a hit is what is loaded, once per request
            self._hit.add(request.request_id)
            self.hits += len(host_block_ids) * self.block_size
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    # ---- stores: offer → (runner) → finished -----------------------------------------------------
    def offer(self, request: Request) -> None:
        """Store the request's blocks that became full and computed (write-through). Keys the host
        already holds are only refreshed in its LRU."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids),
                       len(request.block_hashes))
        start = self._num_offered.get(request.request_id, 0)
        if num_full <= start:
            return
        gpu, host, keys = [], [], []
        for i in range(start, num_full):
            key = request.block_hashes[i]
            if key in self._storing:
                continue
            cached = self.host.lookup(key)
            if cached is not None:
                if self.host.ref_count(cached) == 0:  # refresh: to the LRU tail
                    self.host.touch([cached])
                    self.host.free([cached])
                continue
            if self.host.num_free_blocks == 0:
                break  # every host block is in flight: this store is dropped
            host.extend(self.host.allocate(1))
            gpu.append(request.block_ids[i])
            keys.append(key)
            self._storing.add(key)
        self._num_offered[request.request_id] = num_full
        if gpu:
            self.kv.pool.touch(gpu)
            job = KVTransfer(self._next_store_id, tuple(gpu), tuple(host))
            self._next_store_id += 1
            self._stores.append(_Store(job, tuple(keys)))
            self._unsent.append(job)
            self.blocks_stored += len(gpu)

    # ---- the step's two ends ---------------------------------------------------------------------
    def take_transfers(self) -> tuple[tuple[KVTransfer, ...], tuple[KVTransfer, ...]]:
        """(stores, loads) created since the last call: this step's SchedulerOutput carries them."""
        stores, loads = tuple(self._unsent), tuple(self._unsent_loads)
        self._unsent, self._unsent_loads = [], []
        return stores, loads

    def finish(self, output: ModelRunnerOutput) -> list[Request]:
        """Retire the jobs every rank has finished; returns the requests whose load landed, with
        their computed prefix advanced (aborted ones are only released)."""
        ready = []
        while self._loads and self._loads[0].job.job_id < output.num_kv_loads_done:
            load = self._loads.popleft()
            self.host.free(load.job.host_block_ids)
            self.kv.pool.free(load.job.gpu_block_ids)
            if load.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                load.request.num_computed_tokens += load.num_tokens
                ready.append(load.request)
        while self._stores and self._stores[0].job.job_id < output.num_kv_stores_done:
            store = self._stores.popleft()
            for key, host_id in zip(store.block_hashes, store.job.host_block_ids, strict=True):
                self._storing.discard(key)
                self.host.cache_block(host_id, key)
            self.host.free(store.job.host_block_ids)
            self.kv.pool.free(store.job.gpu_block_ids)
        return ready

    def forget(self, request: Request) -> None:
        """The request ended; its in-flight jobs keep their own references."""
        self._num_offered.pop(request.request_id, None)
        self._queried.discard(request.request_id)
        self._hit.discard(request.request_id)

    # ---- invariants -----------------------------------------------------------------------------
    def gpu_holds(self) -> Counter[int]:
        """References on GPU blocks held by in-flight jobs (not by requests)."""
        held: Counter[int] = Counter()
        for load in self._loads:
            held.update(load.job.gpu_block_ids)
        for store in self._stores:
            held.update(store.job.gpu_block_ids)
        return held

    def num_gpu_blocks_releasing(self) -> int:
        """GPU blocks that only copy jobs hold: free once those land."""
        holds = self.gpu_holds()
        return sum(1 for b, n in holds.items() if self.kv.pool.ref_count(b) == n)

    def check_integrity(self, live_ids: Iterable[str]) -> None:
        """Host pool bookkeeping; host references = exactly the in-flight jobs' holds; no state
        kept for ended requests."""
        self.host.check_integrity()
        held: Counter[int] = Counter()
        for load in self._loads:
            held.update(load.job.host_block_ids)
        for store in self._stores:
            held.update(store.job.host_block_ids)
        for host_id in range(self.host.num_blocks):
            if self.host.ref_count(host_id) != held[host_id]:
                raise AssertionError(
                    f"host tier: block {host_id} has ref {self.host.ref_count(host_id)} but "
                    f"{held[host_id]} copy jobs hold it"
                )
        if self._storing != {k for s in self._stores for k in s.block_hashes}:
            raise AssertionError("host tier: keys marked in flight differ from the store jobs")
        live = set(live_ids)
        stale = (self._num_offered.keys() | self._queried | self._hit) - live
        if stale:
            raise AssertionError(f"host tier: state kept for ended requests {sorted(stale)}")
