"""One engine of a simulated deployment: its replicas' real Schedulers on the simulated clock,
each step priced by the step-time model (plan/steptime.py).

    kick(replica) ──► a step of the replica's group: schedule() per replica, copies and KV reads
          ▲           started, the step priced (lock-step: the slowest rank's time)
          │                    │ "step" event at now + duration
          └── next step ◄──────┴── update_from_output(modelled runner output) → on_output(...)

A step with nothing to compute (only copies or P/D reads in flight, or held blocks waiting to be
read) is applied at once, as the engine's busy loop would, and the group sleeps until the next
landing ("wake") or a new request.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsaserve.config import (
    CacheConfig,
    ConfigError,
    ModelConfig,
    SchedulerConfig,
    default_hot_rows,
)
from dsaserve.core import ModelRunnerOutput, Request, RequestOutput, SchedulerOutput
from dsaserve.engine.scheduler import Scheduler
from dsaserve.kv.hisparse.admission import HiSparseAdmission, hisparse_admission
from dsaserve.kv.prefix_cache import request_block_hashes
from dsaserve.plan import costmodel as cm
from dsaserve.plan.deployment import Deployment
from dsaserve.plan.hosttime import H200_HOST, HostFits
from dsaserve.plan.parts import Parts
from dsaserve.plan.steptime import HiSparseReads, StepTime, StepTimeModel
from dsaserve.router.scoring import Candidate, ScoringWeights, longest_prefix_match, pick
from dsaserve.spec.rejection import num_accepted_drafts

if TYPE_CHECKING:  # simpd imports this module
    from dsaserve.disagg.connector import ConnectorScheduler
    from dsaserve.plan.simpd import KVLink

# Calibration: (replica index, its step's SchedulerOutput) → (wall seconds, the runner's output).
MeasureStep = Callable[[int, SchedulerOutput], tuple[float, ModelRunnerOutput]]
Push = Callable[[float, str, object], None]  # (time, event kind, payload) into the event queue
SAMPLED_TOKEN = 1  # what the simulated runner "samples" (requests ignore EOS, as AgentX's do)


@dataclass(frozen=True)
class EngineCapacity:
    """What one replica of an engine holds."""

    kv_blocks: int  # scheduler blocks of block_size × dcp tokens
    max_context: int  # the longest context one request can have (memory, max-model-len=)
    max_model_len: int  # the scheduler's limit: max_context, the model's and the spec's
    max_num_seqs: int  # requests at once (HiSparse: what the host pool admits, as the engine)


@dataclass(frozen=True)
class MlaSpilling:
    """HiSparse spilling as an engine runs it (`hisparse_config.device_mla_pages`): fewer GPU
    MLA pages than blocks, which each replica's scheduler hands out (kv/hisparse/mla_pages.py)
    as the engine's does. A calibration's real runner spills only through such a scheduler; the
    model itself assumes every page spilled (engine_capacity)."""

    num_mla_pages: int
    buffer_rows: int  # hot-buffer rows per request and layer (the runner's)
    host: HiSparseAdmission  # the runner's host pool: its blocks and one request's window


def engine_capacity(model: ModelConfig, d: Deployment, parts: Parts,
                    num_blocks: int | None = None) -> EngineCapacity:
    """From the GPU's memory: HBM × utilisation − weights per GPU − activation reserve, in pages
    of block_size tokens of the whole per-token record (DESIGN §2); a scheduler block is one page
    on each DCP rank. `num_blocks` overrides the blocks (vLLM's --num-gpu-blocks-override).

    HiSparse (as designed, docs/simulate.md): the GPU keeps every token's indexer keys and, per
    admitted request, a hot buffer plus the write tail of every MLA layer; the MLA rows live in
    the host pool, whose admission (kv/hisparse/admission.py) caps the requests at once."""
    par = d.parallel
    kv = cm.kv_bytes_per_token(model, d.kv_dtype)
    weights = cm.weight_bytes_per_gpu(cm.weight_bytes(model, d.weight_dtype), par)
    room = cm.MemoryBudget(parts.hbm_bytes, d.gpu_memory_utilization, weights,
                           int(cm.DEFAULT_ACTIVATION_RESERVE_GIB * 2**30)).kv_room
    block_tokens = d.block_size * par.decode_context_parallel_size
    lookahead = _lookahead(d)
    limit = min(model.max_position_embeddings, d.max_model_len or model.max_position_embeddings)
    if not d.hisparse:
        if num_blocks is not None:
            blocks, max_context = num_blocks, num_blocks * block_tokens
        else:
            blocks = room // (d.block_size * kv.total) if room > 0 else 0
            if blocks < 1:
                raise ConfigError(f"--deployment {d.spec!r}: the weights ({weights / 2**30:.1f} "
                                  f"GiB per GPU) leave no room for KV on a {parts.name}")
            max_context = cm.max_context_tokens(room, kv, par.decode_context_parallel_size)
        return EngineCapacity(blocks, min(max_context, d.max_model_len or max_context),
                              min(blocks * block_tokens - lookahead, limit), d.max_num_seqs)
    topk = model.index_topk
    hot_rows = d.hot_rows or default_hot_rows(_num_drafts(d), topk)
    hot_bytes = ((hot_rows + cm.HISPARSE_TAIL_PAGES * cm.PAGE_TOKENS)
                 * (kv.num_layers + kv.num_mtp_layers) * kv.mla_row)
    host_tokens = d.hisparse_host_bytes // (d.block_size * kv.mla_all_layers) * d.block_size
    if num_blocks is not None:
        max_context = num_blocks * block_tokens
    else:  # one request's indexer keys beside its own hot buffer
        max_context = max(room - hot_bytes, 0) // (d.block_size * kv.indexer_all_layers) \
            * d.block_size
    max_len = min(max_context, host_tokens, limit) - lookahead
    if max_len < 1:
        raise ConfigError(f"--deployment {d.spec!r}: HiSparse holds no request (host pool "
                          f"{host_tokens:,} tokens, GPU {max_context:,} tokens of indexer keys)")
    adm = hisparse_admission(d.hisparse_host_bytes, kv.mla_all_layers, max_len + lookahead,
                             d.block_size)
    seqs = min(adm.max_requests, d.max_num_seqs)
    longest = min(max_context, host_tokens, d.max_model_len or host_tokens)
    if num_blocks is not None:
        return EngineCapacity(num_blocks, longest, max_len, seqs)
    # Hot buffers are reserved for every admitted request; the rest holds indexer-key pages,
    # at least one request of max_len.
    need = -(-(max_len + lookahead) // d.block_size) * d.block_size * kv.indexer_all_layers
    seqs = max(min(seqs, (room - need) // hot_bytes), 1)
    blocks = (room - seqs * hot_bytes) // (d.block_size * kv.indexer_all_layers)
    return EngineCapacity(blocks, longest, max_len, seqs)


def _num_drafts(d: Deployment) -> int:
    return d.speculative.num_speculative_tokens if d.speculative is not None else 0


def _lookahead(d: Deployment) -> int:
    """The MTP draft steps write k − 1 slots past a request's last token."""
    return max(_num_drafts(d) - 1, 0)


class Replica:
    """One engine replica: the real scheduler; its host-tier copies on the host link (each
    direction one copy stream, jobs in order; every rank copies its shard over its own link);
    its P/D reads (consumer) or reads of its held blocks (producer) on the network."""

    def __init__(self, engine: str, index: int, scheduler: Scheduler,
                 copy_seconds_per_block: float) -> None:
        self.engine, self.index = engine, index
        self.engine_id = f"{engine}-{index}"  # the P/D connector's engine id
        self.scheduler = scheduler
        self.num_routed = 0  # requests the router sent here
        self.copy_seconds_per_block = copy_seconds_per_block
        # Per direction: landing times of the jobs in flight (in job order), jobs landed so far.
        self._in_flight: dict[str, deque[float]] = {"load": deque(), "store": deque()}
        self._num_landed = {"load": 0, "store": 0}
        # P/D: (landing time, request id) of reads into this replica / out of its held blocks
        self._reads: dict[str, list[tuple[float, str]]] = {"recv": [], "send": []}
        self.nic_free = 0.0  # when this replica's NICs finish the transfers queued on them
        self.num_retired = 0  # copies and reads reported to the scheduler so far

    @property
    def connector(self) -> ConnectorScheduler | None:
        return self.scheduler.connector

    def start_copies(self, so: SchedulerOutput, now: float) -> None:
        for kind, jobs in (("load", so.kv_loads), ("store", so.kv_stores)):
            times = self._in_flight[kind]
            for job in jobs:  # one stream per direction: a job starts when the last one landed
                start = max(now, times[-1]) if times else now
                times.append(start + len(job.gpu_block_ids) * self.copy_seconds_per_block)

    def copies_done(self, kind: str, now: float) -> int:
        """Jobs of `kind` landed by `now` (what the runner reports: a count since the start)."""
        times = self._in_flight[kind]
        while times and times[0] <= now:
            times.popleft()
            self._num_landed[kind] += 1
            self.num_retired += 1
        return self._num_landed[kind]

    def add_read(self, kind: str, land: float, request_id: str) -> None:
        heapq.heappush(self._reads[kind], (land, request_id))

    def reads_done(self, kind: str, now: float) -> tuple[str, ...]:
        """Request ids whose read (`recv` into this replica, `send` out of it) landed by now."""
        reads, done = self._reads[kind], []
        while reads and reads[0][0] <= now:
            done.append(heapq.heappop(reads)[1])
        self.num_retired += len(done)
        return tuple(done)

    def next_landing(self) -> float | None:
        """When the next copy or read in flight lands (None: none is)."""
        times = [t[0] for t in self._in_flight.values() if t]
        times += [r[0][0] for r in self._reads.values() if r]
        return min(times, default=None)


class SimEngine:
    """An engine of `d.replicas` replicas. `push` schedules events in the simulator's queue
    ("step" and "wake" with this engine in the payload); `on_output` gets every RequestOutput."""

    def __init__(self, name: str, model: ModelConfig, d: Deployment, parts: Parts, push: Push,
                 on_output: Callable[[SimEngine, Replica, RequestOutput, float], None], *,
                 num_blocks: int | None = None,
                 connector: Callable[[str], ConnectorScheduler] | None = None,
                 record_steps: bool = False, measure: MeasureStep | None = None,
                 host_fits: HostFits = H200_HOST, spilling: MlaSpilling | None = None) -> None:
        """`connector(engine_id)`: each replica's P/D connector (None: not a P/D engine);
        `host_fits`: the host time per step (plan/hosttime.py); `spilling`: each replica's
        scheduler hands out MLA pages as the engine's (HiSparse only)."""
        self.name, self.model, self.deployment, self.parts = name, model, d, parts
        self.push, self.on_output = push, on_output
        par = d.parallel
        spec = d.speculative
        self.num_drafts = _num_drafts(d)
        self.times = StepTimeModel(model, par, parts, d.kv_dtype, self.num_drafts,
                                   HiSparseReads(d.hot_rows or default_hot_rows(
                                       self.num_drafts, model.index_topk), d.overlap)
                                   if d.hisparse else None, graphs=not d.enforce_eager,
                                   async_scheduling=d.async_scheduling, block_size=d.block_size,
                                   weight_dtype=d.weight_dtype, host_fits=host_fits,
                                   draft_vocab=d.draft_vocab)
        # Synthetic acceptance: dsaserve's own verification rule, fixed conditional rates.
        self._rates = torch.tensor(spec.conditional_rates) if spec is not None else None
        self._uniforms = torch.Generator().manual_seed(0)
        self.capacity = engine_capacity(model, d, parts, num_blocks)
        block_tokens = d.block_size * par.decode_context_parallel_size
        self.max_model_len = self.capacity.max_model_len
        cache = CacheConfig(block_size=d.block_size,
                            kv_cache_dtype="fp8_ds_mla" if d.kv_dtype == "fp8_ds_mla" else "auto",
                            enable_prefix_caching=True)
        sched = SchedulerConfig(max_num_seqs=self.capacity.max_num_seqs,
                                max_num_batched_tokens=d.max_num_batched_tokens,
                                max_model_len=self.max_model_len)
        # The host KV tier: each rank holds offload_bytes / ranks, in pages of its own shard.
        kv = cm.kv_bytes_per_token(model, d.kv_dtype)
        rank_block = d.block_size * kv.total
        num_host_blocks = d.offload_bytes // par.world_size // rank_block
        if d.offload_bytes and num_host_blocks * block_tokens < self.max_model_len:
            raise ConfigError(f"--deployment {d.spec!r}: offload holds "
                              f"{num_host_blocks * block_tokens} tokens, less than one request "
                              f"of {self.max_model_len}")
        if spilling is not None and not d.hisparse:
            raise ConfigError(f"--deployment {d.spec!r}: MLA pages spill only with hisparse")
        self.replicas = []
        for i in range(d.replicas):
            conn = connector(f"{name}-{i}") if connector is not None else None
            scheduler = Scheduler(sched, cache, self.capacity.kv_blocks,
                                  dcp_size=par.decode_context_parallel_size,
                                  num_speculative_tokens=self.num_drafts,
                                  num_host_blocks=num_host_blocks,
                                  host_block_bytes=rank_block * par.world_size, connector=conn,
                                  num_mla_pages=spilling.num_mla_pages if spilling else 0,
                                  hisparse_buffer_rows=spilling.buffer_rows if spilling else 0,
                                  hisparse_host=spilling.host if spilling else None)
            self.replicas.append(Replica(name, i, scheduler,
                                         rank_block / (parts.host_gbps.value * 1e9)))
        # Lock-step replicas form one group; otherwise each replica steps on its own.
        self.groups = [self.replicas] if d.lockstep else [[r] for r in self.replicas]
        self._group_of = {r.index: g for g, group in enumerate(self.groups) for r in group}
        self._busy = [False] * len(self.groups)
        self._rr = 0
        self.link: KVLink | None = None  # P/D consumer: where its reads go (set by the simulator)
        self.busy = StepTime()
        self.num_steps = 0
        self.step_log: list[tuple[int, dict[str, int], int]] | None = [] if record_steps else None
        self.measure = measure
        self.step_times: list[tuple[float, float]] = []
        # beside step_times: each measured step's batch per replica ((new tokens, context) per
        # request) and the model's parts for it (StepTime), for a calibration's records
        self.step_batches: list[tuple[list[list[tuple[int, int]]], list[StepTime]]] = []
        self._priced: tuple[list[list[tuple[int, int]]], list[StepTime]] = ([], [])

    # ---- steps ----------------------------------------------------------------------------------
    def kick(self, replica: Replica, now: float) -> None:
        """Start the replica's group stepping if it is idle."""
        g = self._group_of[replica.index]
        if not self._busy[g]:
            self.start_step(g, now)

    def wake_at(self, replica: Replica, t: float) -> None:
        self.push(t, "wake", (self, self._group_of[replica.index]))

    def start_step(self, g: int, now: float) -> None:
        group = self.groups[g]
        while True:
            if not any(r.scheduler.has_unfinished_requests() for r in group):
                self._busy[g] = False
                return
            outputs = [self._schedule(r, now) for r in group]
            if any(so.num_scheduled_tokens for so in outputs) or self.measure is not None:
                break
            # Nothing to compute: apply the diff now (copies and reads landed by now retire);
            # if nothing retired, sleep until the next landing or a new request.
            retired = sum(r.num_retired for r in group)
            self._apply(group, outputs, [None] * len(group), now)
            if sum(r.num_retired for r in group) == retired:
                self._busy[g] = False
                landing = [t for r in group if (t := r.next_landing()) is not None]
                if landing:
                    self.push(min(landing), "wake", (self, g))
                return
        duration = self._price(outputs, group)
        ran: list[ModelRunnerOutput | None] = [None] * len(group)
        if self.measure is not None:  # calibration: real runners, the wall clock
            results = [self.measure(r.index, so) for r, so in zip(group, outputs, strict=True)]
            ran = [out for _, out in results]
            measured = max(seconds for seconds, _ in results)
            self.step_times.append((measured, duration))
            self.step_batches.append(self._priced)
            duration = measured
        self.num_steps += 1
        self._busy[g] = True
        self.push(now + duration, "step", (self, g, outputs, ran))

    def step_kind(self, batches: list[list[tuple[int, int]]]) -> str:
        """A recorded step's kind (`step_batches`): decode rows only, prefill rows only, or
        both."""
        decode = [n <= self.times.decode_rows for batch in batches for n, _ in batch]
        return "decode" if all(decode) else "prefill" if not any(decode) else "mixed"

    def finish_step(self, g: int, outputs: list[SchedulerOutput],
                    ran: list[ModelRunnerOutput | None], now: float) -> None:
        self._apply(self.groups[g], outputs, ran, now)
        self.start_step(g, now)

    def wake(self, g: int, now: float) -> None:
        if not self._busy[g]:
            self.start_step(g, now)

    def _schedule(self, replica: Replica, now: float) -> SchedulerOutput:
        so = replica.scheduler.schedule()
        replica.start_copies(so, now)
        for recv in so.kv_recvs:
            assert self.link is not None, "a KV read on an engine without a P/D link"
            self.link.start(replica, recv, now)
        if self.step_log is not None and so.num_scheduled_tokens:
            self.step_log.append((replica.index, dict(so.num_scheduled_tokens),
                                  replica.scheduler.kv.num_free_blocks))
        return so

    def _price(self, outputs: list[SchedulerOutput], group: list[Replica]) -> float:
        """The step's duration: each replica's batch priced, the slowest rank's time."""
        batches, drafting = [], []
        for replica, so in zip(group, outputs, strict=True):
            batch, contexts = [], []
            for rid, n in so.num_scheduled_tokens.items():
                req = replica.scheduler.requests[rid]
                known = n - len(so.scheduled_spec_token_ids.get(rid, ()))
                batch.append((n, req.num_computed_tokens + n))
                if req.num_computed_tokens + known == req.num_tokens:  # samples, then drafts
                    contexts.append(req.num_tokens)
            batches.append(batch)
            drafting.append(contexts)
        engine_tokens = sum(n for batch in batches for n, _ in batch)
        times = [self.times.step(b, engine_tokens=engine_tokens if self.deployment.lockstep
                                 else None, drafting=d)
                 for b, d in zip(batches, drafting, strict=True)]
        for t in times:
            self.busy = self.busy + t
        self._priced = (batches, times)
        return max(t.total for t in times)

    def _apply(self, group: list[Replica], outputs: list[SchedulerOutput],
               ran: list[ModelRunnerOutput | None], now: float) -> None:
        for replica, so, out in zip(group, outputs, ran, strict=True):
            if out is None:
                out = self._modelled_output(replica, so, now)
            for request_output in replica.scheduler.update_from_output(so, out):
                self.on_output(self, replica, request_output, now)

    def _modelled_output(self, replica: Replica, so: SchedulerOutput,
                         now: float) -> ModelRunnerOutput:
        """What the real runner would return, but for token identity: a token wherever it samples
        one; with MTP, the drafts accepted at the synthetic rates (spec/rejection.py's rule),
        then the target's token, and k new drafts; the copies and P/D reads landed by now."""
        sched = replica.scheduler
        sampled: dict[str, list[int]] = {}
        drafts: dict[str, list[int]] = {}
        verify = [rid for rid in so.num_scheduled_tokens if so.scheduled_spec_token_ids.get(rid)]
        accepted: dict[str, int] = {}
        if verify:
            k = self.num_drafts
            num = torch.tensor([len(so.scheduled_spec_token_ids[rid]) for rid in verify])
            ids = torch.full((len(verify), k), SAMPLED_TOKEN)
            uniforms = torch.rand(len(verify), k, generator=self._uniforms)
            counts = num_accepted_drafts(torch.empty(0), ids, num, uniforms, self._rates)
            accepted = dict(zip(verify, counts.tolist(), strict=True))
        for rid, n in so.num_scheduled_tokens.items():
            req = sched.requests.get(rid)
            spec = so.scheduled_spec_token_ids.get(rid, ())
            if req is None or req.num_computed_tokens + n - len(spec) != req.num_tokens:
                sampled[rid] = []
                continue
            sampled[rid] = list(spec[: accepted.get(rid, 0)]) + [SAMPLED_TOKEN]
            if self.num_drafts:
                drafts[rid] = [SAMPLED_TOKEN] * self.num_drafts
        return ModelRunnerOutput(sampled_token_ids=sampled, draft_token_ids=drafts,
                                 num_kv_loads_done=replica.copies_done("load", now),
                                 num_kv_stores_done=replica.copies_done("store", now),
                                 kv_recvs_done=replica.reads_done("recv", now),
                                 kv_sends_done=replica.reads_done("send", now))

    # ---- routing --------------------------------------------------------------------------------
    def route(self, request: Request) -> Replica:
        """The engine's router policy over its replicas. `prefix` is `dsaserve router`'s own pick
        (router/scoring.py: llm-d's weights) with the precise view: each replica's real block
        pool, looked up with the hashes the engines compute."""
        replicas = self.replicas
        if len(replicas) == 1:
            return replicas[0]
        policy = self.deployment.router
        if policy == "round-robin":
            self._rr += 1
            return replicas[(self._rr - 1) % len(replicas)]
        loads = [r.scheduler.num_running + r.scheduler.num_waiting
                 + len(r.scheduler.receiving) for r in replicas]
        if policy == "load":
            return replicas[loads.index(min(loads))]
        hashes = request_block_hashes(request.prompt_token_ids, replicas[0].scheduler.block_size,
                                      request.cache_salt)
        candidates = [
            Candidate(matched_blocks=longest_prefix_match(hashes, lambda h, r=r:
                                                          r.scheduler.kv.pool.lookup(h)
                                                          is not None),
                      num_waiting=r.scheduler.num_waiting, kv_usage=r.scheduler.kv.usage,
                      num_active=load, num_routed=r.num_routed)
            for r, load in zip(replicas, loads, strict=True)]
        best = replicas[pick(candidates, len(hashes), ScoringWeights())]
        best.num_routed += 1
        return best
