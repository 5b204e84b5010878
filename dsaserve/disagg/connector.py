"""The P/D KV connector: vLLM's NixlConnector protocol over our re-layout and transports.

Split as vLLM splits it: a scheduler-side half in the engine core (what to hold, what to read,
the side channel) and a worker-side half in each rank's runner (the caches in registered memory,
the READs, the notifications).

    client / proxy          prefill engine (producer)              decode engine (consumer)
    ──────────────          ─────────────────────────              ────────────────────────
    {do_remote_decode} ───► prefill, 1 token; blocks HELD
                 ◄───────── kv_transfer_params: do_remote_prefill, remote_engine_id,
                            remote_request_id, remote_block_ids, remote_host/port, layout
    {do_remote_prefill, …} ───────────────────────────────────────► fetch metadata (side channel):
                                                                     engine id, held request and
                                                                     its blocks checked (→ 400)
                                                                    allocate (own prefix skipped),
                                                                    WAITING_FOR_REMOTE_KVS
                                   rank r's caches ◄── READ ─────── each rank: plan_transfer →
                                                                    its pairs' byte segments
                            rank 0 ◄── notification {req, of} ───── every consumer rank, once read
                            blocks freed when `of` ranks notified
                            (or after VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
                                                                    computed = prompt − 1: the last
                                                                    prompt token is recomputed (its
                                                                    logits give the first token)

The consumer READs from the producer's cache tensors; the producer does no work per request
beyond holding blocks. Per (source rank, target) pair the consumer READs straight into its
caches (zero-copy segments, `descriptors.plan_segments`) where pages line up, or, where those
segments would be per row (the prefill side's interleave below its page size), into a staging
buffer of its own, one segment per source page, then scatters the rows (`staging.py`). A
consumer that is a spilling HiSparse rank READs a long prompt's MLA rows below its write tail
into its registered host pool (`hostplan.py`): no GPU MLA page is taken or written; those of
them that are staged go through a host-memory buffer, so they never touch the device.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dsaserve.config import ConfigError, DisaggConfig
from dsaserve.core import KVRecv, KVTransferParams, Request, RequestError, RequestStatus
from dsaserve.disagg import descriptors, kvio
from dsaserve.disagg.claims import Release, ReleaseSender
from dsaserve.disagg.hostplan import HostDest, plan_into_hisparse
from dsaserve.disagg.receiving import PostedRead, ReadTimes, StagedReads
from dsaserve.disagg.relayout import CopyRuns, KVLayout, TransferPlan, plan_transfer
from dsaserve.disagg.staging import (
    STAGE_SEGMENTS_PER_ROW,
    StagedPair,
    StagingPool,
    plan_staged,
    segments_per_row,
    worth_staging,
)
from dsaserve.disagg.transport import (
    Item,
    KVTransport,
    SideChannel,
    TransferError,
    fetch_metadata,
    make_transport,
)
from dsaserve.model.dsa import LayerCache

logger = logging.getLogger(__name__)

CLOSE_FLUSH_S = 2.0  # a consumer's shutdown waits this long at most for its releases to go


@dataclass(frozen=True)
class EngineLayout:
    """How an engine pages its KV (what a peer's re-layout needs) and its TP size."""

    block_size: int
    dcp_size: int
    interleave: int
    tp_size: int


# ================================================================================================
# Scheduler side (engine core)
# ================================================================================================
@dataclass
class _Held:
    request: Request
    deadline: float  # time.monotonic() after which the blocks are freed unread


@dataclass
class ConnectorScheduler:
    """The engine core's half. Producer: holds finished prefills' blocks and serves the side
    channel (transport metadata of every rank + the held requests, for the consumer's checks).
    Consumer: resolves a request's `kv_transfer_params` into a `KVRecv` for the runner."""

    config: DisaggConfig
    engine_id: str
    layout: EngineLayout
    rank_metadata: list[bytes]  # per rank, ConnectorWorker.metadata()
    dp_rank: int = 0
    held: dict[str, _Held] = field(default_factory=dict)
    side_channel: SideChannel | None = None
    # consumer: request id → the prefill ranks' transport metadata, one per DCP rank
    _remote: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    _snapshot: bytes = b""  # the side channel's payload (replaced whole: read by its thread)
    # the same, parsed, with each held request's block digest (`claim` answers from it);
    # replaced whole with `_snapshot`
    _view: tuple[dict, dict[str, str]] = field(default_factory=lambda: ({}, {}))
    # producer: held request id → the decode request that claimed it (its first check), so that
    # a replay of the same params from another decode request is refused before it READs;
    # written by the side channel's thread, forgotten when the blocks are freed
    _claims: dict[str, str] = field(default_factory=dict)
    _claims_lock: threading.Lock = field(default_factory=threading.Lock)
    # producer: held requests their claimant gave back unread (`_release_claim`), freed by the
    # next `release` on the engine core's thread
    _unread: set[str] = field(default_factory=set)
    # consumer: decode request id → the params it claimed, until its READs are posted
    # (`recv`), then until they settle (`_reading`); `forget` gives back what is left
    _claimed: dict[str, KVTransferParams] = field(default_factory=dict)
    _reading: dict[str, KVTransferParams] = field(default_factory=dict)
    # consumer: aborted while receiving, until the step that tells the ranks (each cancels its
    # READs, then notifies the producer) came back (`cancelled`); a shutdown before then gives
    # these claims back itself (`give_back_claims`)
    _cancelling: dict[str, KVTransferParams] = field(default_factory=dict)
    _releases: ReleaseSender | None = None

    def __post_init__(self) -> None:
        if self.config.is_producer:
            port = self.config.side_channel_port
            self.side_channel = SideChannel(
                self.payload, self.config.side_channel_host,
                port + self.dp_rank if port else 0, ask=self.claim)
        self._publish()

    # ---- producer --------------------------------------------------------------------------
    def should_hold(self, req: Request) -> bool:
        p = req.kv_transfer_params
        return (self.config.is_producer and p is not None and p.do_remote_decode
                and req.status != RequestStatus.FINISHED_ABORTED)

    def hold(self, req: Request) -> KVTransferParams:
        """Keep `req`'s blocks for its consumers; the params its response carries."""
        self.held[req.request_id] = _Held(req, time.monotonic() + self.config.abort_timeout_s)
        self._publish()
        assert self.side_channel is not None
        return KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id,
            remote_request_id=req.request_id, remote_block_ids=tuple(req.block_ids),
            remote_host=self.side_channel.host, remote_port=self.side_channel.port,
            tp_size=self.layout.tp_size, remote_block_size=self.layout.block_size,
            remote_dcp_size=self.layout.dcp_size, remote_interleave=self.layout.interleave,
            remote_num_tokens=req.num_prompt_tokens)

    def release(self, sent: Sequence[str], now: float | None = None) -> list[Request]:
        """Held requests to free: every consumer read them (`sent`), their claimant gave them
        back unread, or their time is up."""
        now = time.monotonic() if now is None else now
        with self._claims_lock:
            unread, self._unread = self._unread, set()
        out = []
        for rid in list(self.held):
            if rid in sent or rid in unread or self.held[rid].deadline <= now:
                if rid in unread and rid not in sent:
                    logger.info("P/D: request %s's decode request will not read it; its blocks "
                                "are freed", rid)
                elif rid not in sent:
                    logger.warning("P/D: request %s was not read within %.0f s; its blocks are "
                                   "freed", rid, self.config.abort_timeout_s)
                out.append(self.held.pop(rid).request)
        if out:
            with self._claims_lock:  # a claim sees the blocks held and unclaimed, or gone
                self._publish()
                for req in out:
                    self._claims.pop(req.request_id, None)
        return out

    def payload(self) -> bytes:
        """What the side channel serves now (JSON: engine id, ranks' metadata, held blocks)."""
        return self._snapshot

    def claim(self, question: bytes) -> bytes:
        """The side channel's answer to a consumer's check (its thread): the payload, and
        whether the held request it names is now that consumer's. The first decode request to
        check a held request's params claims it; the same one checking again still holds it;
        any other is refused (`claim.granted` false), so a replay racing the first READ never
        READs. Only an exact match (engine id, request, the block ids by their digest) claims
        anything. A question with "release" instead is a claimant giving its claim back
        (`_release_claim`)."""
        try:
            q = json.loads(question)
            if isinstance(q, dict) and "release" in q:
                return self._release_claim(q)
            rid, by = str(q["claim"]), str(q["by"])
            engine, digest = q.get("engine"), q.get("blocks_sha256")
        except (ValueError, KeyError, TypeError):
            return self._snapshot
        with self._claims_lock:
            snap, digests = self._view
            held = snap["held"].get(rid)
            granted = (engine == snap["engine_id"] and held is not None
                       and digests[rid] == digest
                       and self._claims.setdefault(rid, by) == by)
        # the named request's blocks only: a claim's answer (and its parse on the decode
        # side, in the time to its first token) does not grow with every request held here
        return json.dumps(dict(snap, held={} if held is None else {rid: held},
                               claim={"request": rid, "granted": granted})).encode()

    def _release_claim(self, q: dict) -> bytes:
        """A consumer gives back the claim of decode request `by` on held request `release`
        (disagg/claims.py; the side channel's thread). Only that claimant may, with this
        engine's id (as a claim is checked); anything else is refused and logged, and changes
        nothing. `free`: it will never READ the blocks and none of its READs is in flight
        (the consumer sends it only then: the claim kept every other decode request from
        READing them), so they are freed at the next step as if read; otherwise only the
        claim is dropped and the blocks stay held for another decode request (or the timeout).
        """
        rid, by, engine, free = q.get("release"), q.get("by"), q.get("engine"), q.get("free")
        with self._claims_lock:  # a claim lives while its blocks are held (`release`)
            ok = (isinstance(rid, str) and isinstance(by, str) and isinstance(free, bool)
                  and engine == self.engine_id and self._claims.get(rid) == by)
            if ok:
                del self._claims[rid]
                if free:
                    self._unread.add(rid)
        if not ok:
            logger.warning("P/D: refused a release of held request %r by %r for engine %r "
                           "(not its claimant, not held here, or malformed)",
                           str(rid)[:80], str(by)[:80], str(engine)[:80])
        return json.dumps({"release": rid, "released": ok}).encode()

    def _publish(self) -> None:
        snap = {
            "engine_id": self.engine_id,
            "ranks": [base64.b64encode(m).decode() for m in self.rank_metadata],
            "held": {rid: list(h.request.block_ids) for rid, h in self.held.items()},
        }
        # each held request's digest once, when it is first held (a 128K prompt's: ~0.3 ms),
        # not at every claim of it; taken again if the id is held with other blocks (freed and
        # prefilled again between two publishes)
        (old, known) = self._view
        before = old.get("held", {})
        digests = {rid: known[rid] if before.get(rid) == ids else blocks_digest(ids)
                   for rid, ids in snap["held"].items()}
        self._snapshot = json.dumps(snap).encode()
        self._view = (snap, digests)

    # ---- consumer --------------------------------------------------------------------------
    def check_request(self, request_id: str, params: KVTransferParams,
                      num_prompt_tokens: int, fetched: dict | None = None) -> None:
        """A decode request's params against the prefill engine's side channel: the engine id,
        the request still held, with these blocks. RequestError (→ 400) otherwise; nothing is
        allocated yet. `fetched`: the side channel's answer, read beforehand off the engine
        core's thread (fetch_remote); without it the core reads it here. A request refused
        after its fetch claimed the held request gives the claim back (`ReleaseSender`)."""
        try:
            self._check_fields(params, num_prompt_tokens)
            if fetched is None:
                fetched = fetch_remote(params, self.config.transfer_timeout_s, request_id)
            self._check_remote(request_id, params, fetched)
        except RequestError:
            if fetched is not None:
                self.refused(request_id, params, fetched)
            raise

    def refused(self, request_id: str, params: KVTransferParams, fetched: dict) -> None:
        """Decode request `request_id` was refused after its check's fetch (`fetched`): the
        claim that fetch took is given back, the blocks stay held. Not when a live request of
        the same id already holds that claim (a duplicate id: the claim is the live one's)."""
        if _granted(fetched, params) and not self._owns(request_id, params):
            self._give_back(request_id, params, free=False)

    def _owns(self, request_id: str, params: KVTransferParams) -> bool:
        mine = self._claimed.get(request_id) or self._reading.get(request_id)
        return mine is not None and (mine.remote_engine_id, mine.remote_request_id) == (
            params.remote_engine_id, params.remote_request_id)

    def _check_fields(self, params: KVTransferParams, num_prompt_tokens: int) -> None:
        if not self.config.is_consumer:
            raise RequestError("kv_transfer_params: do_remote_prefill on an engine whose "
                               f"kv_role is {self.config.kv_role!r}")
        missing = [n for n in ("remote_engine_id", "remote_request_id", "remote_host",
                               "remote_port") if getattr(params, n) is None]
        if missing or not params.remote_block_size:
            raise RequestError(f"kv_transfer_params: missing {missing or ['remote_block_size']}")
        if params.remote_num_tokens != num_prompt_tokens:
            raise RequestError(
                f"kv_transfer_params: the prefill held {params.remote_num_tokens} prompt tokens, "
                f"this prompt has {num_prompt_tokens}")

    def _check_remote(self, request_id: str, params: KVTransferParams, raw: dict) -> None:
        if raw.get("engine_id") != params.remote_engine_id:
            raise RequestError(f"kv_transfer_params: unknown remote_engine_id "
                               f"{params.remote_engine_id!r} (that address serves "
                               f"{raw.get('engine_id')!r})")
        held = raw.get("held", {}).get(params.remote_request_id)
        if held is None:
            raise RequestError(f"kv_transfer_params: request {params.remote_request_id!r} is not "
                               "held by the prefill engine (already consumed, expired or unknown)")
        if list(params.remote_block_ids) != held:
            raise RequestError("kv_transfer_params: remote_block_ids do not match the blocks "
                               f"the prefill engine holds for {params.remote_request_id!r}")
        claim = raw.get("claim")
        if claim is not None and not claim.get("granted"):
            raise RequestError(f"kv_transfer_params: request {params.remote_request_id!r} is "
                               "already being read by another decode request (replayed params)")
        ranks = [base64.b64decode(m) for m in raw["ranks"]]
        by_dcp: dict[int, bytes] = {}
        for m in ranks:
            by_dcp.setdefault(json.loads(m)["dcp_rank"], m)
        if sorted(by_dcp) != list(range(params.remote_dcp_size)):
            raise RequestError(f"kv_transfer_params: remote_dcp_size {params.remote_dcp_size} "
                               f"does not match the prefill engine's ranks {sorted(by_dcp)}")
        self._remote[request_id] = tuple(by_dcp[d] for d in range(params.remote_dcp_size))
        if claim is not None:
            self._claimed[request_id] = params

    def recv(self, req: Request, num_cached: int) -> KVRecv:
        """The runner's job for a consumer request whose blocks are allocated: every prompt
        position but the last past `num_cached` (the last is recomputed for its logits)."""
        assert req.kv_transfer_params is not None
        claimed = self._claimed.pop(req.request_id, None)
        if claimed is not None:  # from now on its READs' notifications (or cancels) free them
            self._reading[req.request_id] = claimed
        return KVRecv(request_id=req.request_id, block_ids=tuple(req.block_ids),
                      num_cached=num_cached, num_tokens=req.num_prompt_tokens - 1,
                      remote=req.kv_transfer_params,
                      remote_ranks=self._remote.pop(req.request_id))

    def forget(self, request_id: str, *, unread: bool = False) -> None:
        """Decode request `request_id` leaves this engine (refused after its check, finished,
        aborted, failed). A claim it still holds on a prefill engine's held request is given
        back off this thread (disagg/claims.py):

            its READs not posted (refused after the check)  → the claim dropped: the blocks
                                                              stay held for another request
            `unread`, READs not posted (aborted waiting)    → the blocks freed now
            `unread`, READs all settled (a failed READ)     → the blocks freed now
            READs posted, not `unread` (aborted while       → nothing yet: each rank cancels,
              receiving)                                      then notifies (frees them); kept
                                                              until that step came back

        `unread` says that none of its READs is or will be in flight: a READ in flight is never
        the reason blocks are freed under it. A request whose READs all landed is `received`
        first."""
        self._remote.pop(request_id, None)
        claimed = self._claimed.pop(request_id, None)
        reading = self._reading.pop(request_id, None)
        if claimed is not None:
            self._give_back(request_id, claimed, free=unread)
        elif reading is not None and unread:
            self._give_back(request_id, reading, free=True)
        elif reading is not None:
            self._cancelling[request_id] = reading

    def received(self, request_id: str) -> None:
        """Decode request `request_id`'s READs all landed on every rank, each notified the
        producer (which frees the blocks): its claim ends."""
        self._reading.pop(request_id, None)

    def cancelled(self, request_ids: Sequence[str]) -> None:
        """The step that told the ranks of these ended requests came back: each rank cancelled
        what of their READs was in flight and notified the producer (`cancel_receives`), so
        the claims of those aborted while receiving end."""
        for rid in request_ids:
            self._cancelling.pop(rid, None)

    def _give_back(self, request_id: str, params: KVTransferParams, free: bool) -> None:
        self._sender().send(Release(request_id, params, free))

    def _sender(self) -> ReleaseSender:
        if self._releases is None:  # no thread until the first release
            self._releases = ReleaseSender(self.config.transfer_timeout_s)
        return self._releases

    @property
    def num_claimed(self) -> int:
        """Consumer: claims held by requests whose READs are not posted or not settled, or that
        were aborted while receiving and whose ranks have not cancelled yet."""
        return len(self._claimed) + len(self._reading) + len(self._cancelling)

    def flush_releases(self, timeout_s: float) -> bool:
        """Wait until every claim given back so far was answered (or failed); False after
        `timeout_s`. For tests and shutdown: the engine core never waits on it."""
        return self._releases is None or self._releases.flush(timeout_s)

    def check_integrity(self, waiting: Sequence[str], receiving: Sequence[str]) -> None:
        """Consumer: a claim is held by a waiting request (READs not posted) or a receiving
        one (READs not settled), none other: every request that left gave its claim back."""
        if not set(self._claimed) <= set(waiting):
            raise AssertionError(f"P/D: claims {sorted(set(self._claimed) - set(waiting))} "
                                 "held by requests not waiting")
        if not set(self._reading) <= set(receiving):
            raise AssertionError(f"P/D: claims {sorted(set(self._reading) - set(receiving))} "
                                 "held by requests not receiving")

    @property
    def num_held(self) -> int:
        return len(self.held)

    def close(self) -> None:
        """Shutdown, first: a producer's side channel stops answering, so no consumer checks or
        claims blocks this engine is about to drop."""
        if self.side_channel is not None:
            self.side_channel.close()

    def give_back_claims(self, timeout_s: float = CLOSE_FLUSH_S) -> bool:
        """Shutdown, once every rank has stopped reading (`ConnectorWorker.close` cancels its
        READs without notifying; a rank's process may be gone): every claim still held — READs
        never posted, cancelled unread, or aborted while receiving with no step to tell the
        ranks — is given back free, as an abort's, so each producer frees those blocks at its
        next step instead of its abort timeout. Sent off this thread with the releases already
        queued, waited for at most `timeout_s`; a producer gone or silent costs a warning (its
        timeout frees them). The wait is `timeout_s` in all, the releases to each producer
        sent apart from the others'. Nothing is sent after it (a release queued then is dropped,
        logged); those already queued still go. False if some release was not answered in time.

            LLMEngine.shutdown: abort every request → close (side channel)
                                → executor.shutdown (every rank: cancel READs, close transport)
                                → give_back_claims ─► producers: freed at their next step
        """
        for claims in (self._claimed, self._reading, self._cancelling):
            for rid, params in claims.items():
                self._give_back(rid, params, free=True)
            claims.clear()
        self._remote.clear()
        sender = self._sender()
        sent = sender.flush(timeout_s)
        sender.close()
        if not sent:
            logger.warning("P/D: shutting down with %d claim release(s) unanswered after %.0f s; "
                           "those prefill engines free the blocks at their timeout",
                           sender.num_pending, timeout_s)
        return sent


def _granted(raw: dict, params: KVTransferParams) -> bool:
    """Whether the side channel's answer `raw` says the held request of `params` was claimed."""
    claim = raw.get("claim")
    return (isinstance(claim, dict) and claim.get("granted") is True
            and claim.get("request") == params.remote_request_id)


def blocks_digest(block_ids: Sequence[int]) -> str:
    """What a claim names the held blocks by: a 1M-token request holds 16K+ block ids, more
    than a side-channel question may carry (`SideChannel.MAX_QUESTION`)."""
    return hashlib.sha256(",".join(map(str, block_ids)).encode()).hexdigest()


def fetch_remote(params: KVTransferParams, timeout_s: float, request_id: str) -> dict:
    """The side channel's answer for decode request `request_id`'s params, which claims the
    held request for it (`ConnectorScheduler.claim`; network I/O: callers off the engine core's
    thread do it first, so an unreachable prefill host stalls one request, not every step).
    RequestError (→ 400) when it cannot be read."""
    if params.remote_host is None or params.remote_port is None:
        raise RequestError("kv_transfer_params: missing remote_host / remote_port")
    question = json.dumps({"claim": params.remote_request_id, "by": request_id,
                           "engine": params.remote_engine_id,
                           "blocks_sha256": blocks_digest(params.remote_block_ids)}).encode()
    try:
        raw = json.loads(fetch_metadata(params.remote_port, params.remote_host, timeout_s,
                                        question))
    except (TransferError, ValueError) as e:
        raise RequestError(f"kv_transfer_params: the prefill engine at "
                           f"{params.remote_host}:{params.remote_port} cannot be reached "
                           f"({e})") from None
    if not isinstance(raw, dict):
        raise RequestError("kv_transfer_params: the prefill engine's side channel answered "
                           "something other than an object")
    return raw


# ================================================================================================
# Worker side (one per rank, in the runner)
# ================================================================================================
_NOTIFY_PREFIX = b"pd-read:"


def _same_name(layer: int, name: str) -> str:
    return name


@dataclass(frozen=True)
class _Job:
    """One plan of a received request and where its rows land."""

    plan: TransferPlan
    parts: tuple[str, ...]  # the cache tensors it moves ("kv", "index")
    local_name: Callable[[int, str], str]  # zero-copy: the local region of layer i's part
    targets: list[dict[str, list[torch.Tensor]]]  # staged: per layer, part → byte views
    into_host: bool = False  # its rows go to the host pool (staged: through `host_staging`)


class ConnectorWorker:
    """One rank's half: its caches in transport-registered memory, the READs of `KVRecv`s
    (posted in one step, polled in the following ones: disagg/receiving.py), and (on a
    producer's rank 0) counting the consumers' notifications."""

    def __init__(self, config: DisaggConfig, *, rank: int, dcp_rank: int, world_size: int,
                 block_size: int, dcp_size: int, interleave: int) -> None:
        self.config = config
        self.rank, self.dcp_rank, self.world_size = rank, dcp_rank, world_size
        self.layout = (block_size, dcp_size, interleave)
        self.transport: KVTransport = make_transport(
            config.backend, f"dsaserve-{uuid.uuid4().hex[:12]}-r{rank}")
        self.formats: list[descriptors.LayerFormat] = []
        self._peers: dict[str, str] = {}  # metadata agent name → transport peer name
        self._counts: dict[str, int] = {}  # producer: notifications per held request
        self._receiving: dict[str, PostedRead] = {}  # consumer: READs posted, not reported
        self.bytes_received = 0  # consumer: bytes READ so far (all requests)
        self.read_times = ReadTimes()  # consumer: where the landed requests' READs took time
        # consumer into a spilling HiSparse rank (hostplan.py): of those, the MLA rows READ
        # straight into the host pool, and those READ into GPU MLA pages
        self.mla_rows_to_host = 0
        self.mla_rows_to_gpu = 0
        self.has_host_pool = False
        # consumer: (source rank, target) pairs READ each way so far (staging.py chooses)
        self.pairs_staged = 0
        self.pairs_zero_copy = 0
        self.staging: StagingPool | None = None  # staged pairs into the caches
        self.host_staging: StagingPool | None = None  # staged pairs into the host pool
        self._caches: list[LayerCache] = []  # the registered caches (staged rows land here)
        self._host: list[torch.Tensor] = []  # a HiSparse host pool ([H, B, row] per layer)

    def register(self, caches: list[LayerCache]) -> list[LayerCache]:
        """The caches peers read from or into: NIXL registers them in place (host or GPU memory);
        shared memory needs its own files, so the caches move there."""
        self.formats = descriptors.layer_formats(caches)
        if self.transport.backend != "nixl" and caches[0].kv.device.type != "cpu":
            # shm can only move host memory it allocated: the caches would leave the GPU
            self.transport.close()
            raise ConfigError(f"{self.config.flag}: backend {self.transport.backend!r} cannot "
                              f"move {caches[0].kv.device.type} caches; use 'nixl'")
        if self.transport.backend == "nixl":
            for name, region in descriptors.cache_regions(caches).items():
                self.transport.register(name, region)
        else:
            caches = descriptors.register_caches(self.transport, caches)
        self._caches = caches
        self.staging = StagingPool(self.transport, caches[0].kv.device,
                                   self.config.staging_mb << 20)
        return caches

    def register_host_pool(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """A HiSparse host pool the READs land in directly (P/D into a spilling decode rank);
        the tensors to use from now on (moved into shared memory, or registered in place)."""
        self.has_host_pool = True
        self._host = descriptors.register_host_pool(self.transport, host)
        # host memory (`allocate` on both transports), its own `staging_mb`: the staged rows
        # of spilled blocks land there and are scattered into the pool by a CPU copy
        self.host_staging = StagingPool(self.transport, torch.device("cpu"),
                                        self.config.staging_mb << 20, prefix="SH")
        return self._host

    def metadata(self) -> bytes:
        return json.dumps({
            "rank": self.rank, "dcp_rank": self.dcp_rank,
            "transport": base64.b64encode(self.transport.metadata()).decode(),
            "formats": [vars(f) for f in self.formats],
        }).encode()

    # ---- consumer --------------------------------------------------------------------------
    def start_receives(self, recvs: Sequence[KVRecv],
                       dests: Mapping[str, HostDest] | None = None) -> None:
        """Post the READs of each request's rows this rank needs; `poll_receives` settles
        them in this step or later ones. A request in `dests` goes into a spilling HiSparse
        rank: its MLA rows to its GPU pages or straight into the host pool."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        for recv in recvs:
            posted = PostedRead(recv.request_id, deadline)
            self._receiving[recv.request_id] = posted
            started = time.perf_counter()
            try:
                self._post(recv, (dests or {}).get(recv.request_id), posted)
            except (TransferError, ValueError, KeyError) as e:
                posted.fail(str(e))  # the READs already posted are still polled
            posted.posted_at = time.perf_counter()
            posted.post_s = posted.posted_at - started

    def poll_receives(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """Poll every posted READ once, without blocking; the requests whose READs all landed
        (the producer's rank 0 notified) and the failed ones with the reason, each reported
        once, when none of its READs is in flight any more."""
        done: list[str] = []
        failed: dict[str, str] = {}
        now = time.monotonic()
        for rid, posted in list(self._receiving.items()):
            if not posted.poll(self.transport, now):
                continue
            del self._receiving[rid]
            self._settle(posted, landed=posted.error is None)
            if posted.error is None:
                try:
                    self.transport.send_notification(posted.producer, posted.notify)
                except TransferError as e:
                    posted.fail(str(e))
            if posted.error is None:
                done.append(rid)
                t = self.read_times
                t.requests += 1
                t.post_s += posted.post_s
                t.in_flight_s += time.perf_counter() - posted.posted_at
                t.polls += posted.polls
            else:
                logger.warning("P/D: reading request %s's KV failed: %s", rid, posted.error)
                failed[rid] = ("reading the prompt's KV from the prefill engine failed: "
                               f"{posted.error}")
        return tuple(done), failed

    def cancel_receives(self, request_ids: Sequence[str]) -> None:
        """Requests that ended while their READs were in flight (aborted): the READs cancelled
        (on return none of them lands, so their blocks may be another request's in this very
        step) and the producer notified, which frees its blocks now rather than at its
        timeout. Ids not receiving here are ignored."""
        for rid in request_ids:
            posted = self._receiving.pop(rid, None)
            if posted is None:
                continue
            posted.cancel(self.transport)
            self._settle(posted, landed=False)
            if posted.producer:
                try:
                    self.transport.send_notification(posted.producer, posted.notify)
                except TransferError as e:  # the producer's timeout frees them instead
                    logger.warning("P/D: cannot tell the prefill engine that request %s was "
                                   "dropped: %s", rid, e)

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)

    def _post(self, recv: KVRecv, dest: HostDest | None, posted: PostedRead) -> None:
        remote = recv.remote
        metas = [json.loads(m) for m in recv.remote_ranks]  # [src DCP rank]
        peers = [self._peer(m) for m in metas]
        block_size, dcp_size, interleave = self.layout
        src = KVLayout(remote.remote_block_ids, remote.remote_block_size,
                       remote.remote_dcp_size, remote.remote_interleave)
        dst = KVLayout(recv.block_ids, block_size, dcp_size, interleave)
        caches = self._targets(self._caches)
        jobs: list[_Job]
        if dest is None:
            jobs = [_Job(plan_transfer(src, dst, recv.num_cached, recv.num_tokens),
                         ("kv", "index"), _same_name, caches)]
        else:
            if not self.has_host_pool:
                raise ValueError("a HiSparse destination but no host pool registered")
            hp = plan_into_hisparse(src, dst, dest, recv.num_cached, recv.num_tokens)
            host = [{"kv": [kvio.kv_rows(h)]} for h in self._host]
            jobs = [_Job(hp.index, ("index",), _same_name, caches),
                    _Job(hp.gpu, ("kv",), _same_name, caches),
                    _Job(hp.host, ("kv",), lambda i, _: descriptors.host_region_name(i), host,
                         into_host=True)]
            self.mla_rows_to_gpu += hp.gpu.num_rows
            self.mla_rows_to_host += hp.host.num_rows
        msg = {"req": remote.remote_request_id, "of": self.world_size}
        posted.producer, posted.notify = peers[0], _NOTIFY_PREFIX + json.dumps(msg).encode()
        # 1. per pair: zero-copy segments, or staged where they would be per row
        zero: list[tuple[_Job, CopyRuns, list[dict[str, torch.Tensor]]]] = []
        staged: list[tuple[_Job, CopyRuns, list[dict[str, torch.Tensor]], StagedPair]] = []
        for job in jobs:
            for pair in job.plan.to_target(self.dcp_rank):
                src_formats = [descriptors.LayerFormat(**f)
                               for f in metas[pair.src_rank]["formats"]]
                layers = descriptors.plan_segments(pair, src_formats, self.formats, job.parts)
                sp = None
                if segments_per_row(layers, pair.num_rows) >= STAGE_SEGMENTS_PER_ROW:
                    sp = plan_staged(pair, src_formats, self.formats, job.parts)
                if sp is not None and worth_staging(layers, sp):
                    staged.append((job, pair, layers, sp))
                else:
                    zero.append((job, pair, layers))
        # 2. per staging pool (the caches', the host pool's), one buffer for the request's
        #    staged pairs into it; zero-copy where it does not fit
        buffers: list[tuple[StagedReads, list[tuple[_Job, CopyRuns, StagedPair]]]] = []
        for into_host, pool in ((False, self.staging), (True, self.host_staging)):
            pairs = [(job, pair, sp) for job, pair, _, sp in staged if job.into_host == into_host]
            if not pairs:
                continue
            assert pool is not None
            buf = pool.take(sum(sp.nbytes for *_, sp in pairs))
            if buf is None:
                logger.info("P/D: request %s's staged READs into the %s do not fit the staging "
                            "buffers (staging_mb %d); READ zero-copy", recv.request_id,
                            "host pool" if into_host else "caches", self.config.staging_mb)
                zero += [(job, pair, layers) for job, pair, layers, _ in staged
                         if job.into_host == into_host]
                continue
            posted.staged.append(StagedReads(pool, buf))  # given back when the READs settle
            buffers.append((posted.staged[-1], pairs))
        # 3. the READs: gathered per (peer, local memory kind), each group posted as one
        #    transfer; a posting has a fixed cost (NIXL: the descriptor lists, initialize_xfer,
        #    transfer), paid once per peer rather than per layer and part
        reads: dict[tuple[str, str], list[Item]] = {}
        for job, pair, layers in zero:
            self.pairs_zero_copy += 1
            for i, layer in enumerate(layers):
                for part, segs in layer.items():
                    name = f"L{i}.{part}"
                    self._gather(reads, peers[pair.src_rank], job.local_name(i, name), name,
                                 descriptors.for_read(segs))
        for into, pairs in buffers:
            base = 0
            for job, pair, sp in pairs:
                self.pairs_staged += 1
                for i, layer in enumerate(sp.reads):
                    for part, segs in layer.items():
                        segs = segs + torch.tensor([0, base, 0])  # the pair's share
                        self._gather(reads, peers[pair.src_rank], into.buffer.name,
                                     f"L{i}.{part}", descriptors.for_read(segs))
                into.scatters.append((sp, base, job.targets))
                base += sp.nbytes
        for (peer, _), items in reads.items():
            posted.transfers.append(self.transport.read_regions(peer, items))
            self.bytes_received += sum(n for _, _, segs in items for _, _, n in segs)

    def _gather(self, reads: dict[tuple[str, str], list[Item]], peer: str, local: str,
                remote: str, segments: list[tuple[int, int, int]]) -> None:
        """One READ item into the group of its peer and local memory kind: the host pool's
        READs land in DRAM while the caches are VRAM on a GPU, and one NIXL transfer's
        descriptors share one kind (the producer's caches are all of one)."""
        mem = self.transport.regions[local].mem
        reads.setdefault((peer, mem), []).append((local, remote, segments))

    @staticmethod
    def _targets(caches: Sequence[LayerCache]) -> list[dict[str, list[torch.Tensor]]]:
        """Per layer, the byte views staged rows are scattered into (`kvio.part_views`)."""
        out = []
        for cache in caches:
            views = kvio.part_views(cache)
            out.append({"kv": views[:1], "index": views[1:]})
        return out

    @staticmethod
    def _settle(posted: PostedRead, landed: bool) -> None:
        """None of its READs is in flight any more: staged rows scattered into their slots if
        they all `landed`, then each staging buffer given back (failed or cancelled: unused)."""
        for into in posted.staged:
            into.settle(landed)
        posted.staged = []

    def check_integrity(self) -> None:
        """Staging buffers, per pool: one in use per request receiving with staged pairs into
        it, none other; no request holds two of one pool."""
        posted = [s for p in self._receiving.values() for s in p.staged]
        assert all(s.pool is self.staging or s.pool is self.host_staging for s in posted)
        for pool in (self.staging, self.host_staging):
            if pool is None:
                continue
            held = [sum(s.pool is pool for s in p.staged) for p in self._receiving.values()]
            assert max(held, default=0) <= 1, f"a request holds {max(held)} {pool.prefix} buffers"
            assert {s.buffer.name for s in posted if s.pool is pool} == set(pool.in_use)
            pool.check_integrity(sum(held))

    def _peer(self, meta: dict) -> str:
        blob = base64.b64decode(meta["transport"])
        agent = json.loads(blob)["agent"]
        if agent not in self._peers:
            self._peers[agent] = self.transport.add_peer(blob)
        return self._peers[agent]

    # ---- producer --------------------------------------------------------------------------
    def poll_sends(self) -> tuple[str, ...]:
        """Held requests every consumer rank has read (rank 0 counts; others see none)."""
        out = []
        for msgs in self.transport.take_notifications().values():
            for raw in msgs:
                if not raw.startswith(_NOTIFY_PREFIX):
                    continue
                try:
                    msg = json.loads(raw[len(_NOTIFY_PREFIX):])
                    rid, of = str(msg["req"]), int(msg["of"])
                except (ValueError, KeyError, TypeError):
                    logger.warning("P/D: ignoring a malformed notification %r", raw[:80])
                    continue
                self._counts[rid] = self._counts.get(rid, 0) + 1
                if self._counts[rid] >= of:
                    del self._counts[rid]
                    out.append(rid)
        return tuple(out)

    def close(self) -> None:
        """Cancel every READ in flight (none writes into the caches after this), then release
        the transport. The producer is not notified from here: once every rank closed, the
        engine core gives back the claims (`ConnectorScheduler.give_back_claims`), one message
        per request however many ranks read it."""
        for posted in self._receiving.values():
            posted.cancel(self.transport)
            self._settle(posted, landed=False)
        self._receiving.clear()
        self.transport.close()
