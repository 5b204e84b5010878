"""A discrete-event simulation of a deployment: dsaserve's own scheduler and KV manager on a
simulated clock, the model runner replaced by the step-time model (plan/steptime.py).

    session slots (concurrency c) ──► router ──► replica r: Scheduler.schedule()
          ▲   turn k+1 after think time            │ step priced by StepTimeModel (lock-step
          │                                        ▼ replicas: the slowest rank's time)
          └──────── request finished ◄── Scheduler.update_from_output(sampled tokens)

What is real: admission, chunked prefill, the token budget, preemption, prefix-cache hits and
evictions (the KVCacheManager and BlockPool, with the KV blocks a GPU of the layout holds), the
host KV tier's OffloadManager, MTP's draft scheduling and synthetic acceptance rule, and
`dsaserve router`'s pick over the replicas' real block pools. What is modelled: each step's
duration, and each host copy's (the host link). AgentX's concurrency semantics: c session slots;
a slot runs its session's turns in order, each after the previous one ends plus its think time,
then takes the next session.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dsaserve.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from dsaserve.core import (
    ModelRunnerOutput,
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
)
from dsaserve.engine.scheduler import Scheduler
from dsaserve.kv.prefix_cache import request_block_hashes
from dsaserve.plan import costmodel as cm
from dsaserve.plan.deployment import Deployment
from dsaserve.plan.parts import Parts
from dsaserve.plan.simtrace import TraceSession
from dsaserve.plan.steptime import StepTime, StepTimeModel
from dsaserve.router.scoring import Candidate, ScoringWeights, longest_prefix_match, pick
from dsaserve.spec.rejection import num_accepted_drafts

# Calibration: (replica index, its step's SchedulerOutput) → (wall seconds, the runner's output).
MeasureStep = Callable[[int, SchedulerOutput], tuple[float, ModelRunnerOutput]]
SAMPLED_TOKEN = 1  # what the simulated runner "samples" (requests ignore EOS, as AgentX's do)


@dataclass
class RequestRecord:
    """One simulated request's timeline (seconds of simulated time)."""

    request_id: str
    session: str
    replica: int
    arrival: float
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    first_token: float | None = None
    finish: float | None = None

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.arrival

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency; None for a one-token request."""
        if self.finish is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass
class SimResult:
    deployment: Deployment
    concurrency: int
    records: list[RequestRecord]
    rejected: list[tuple[str, int, str]]  # (session, turn, why)
    busy: StepTime  # the replicas' step time by part, summed
    num_steps: int
    max_context: int  # the longest context one replica can hold
    kv_blocks: int  # KV blocks of one replica (scheduler blocks of block_size × dcp tokens)
    schedulers: list[Scheduler] = field(repr=False, default_factory=list)

    def summary(self) -> dict[str, float | int | str]:
        """AgentX's headline numbers (docs/agentx.md) over the finished requests."""
        done = [r for r in self.records if r.finish is not None]
        if not done:
            return {"requests": 0, "rejected": len(self.rejected)}
        start = min(r.arrival for r in done)
        window = max(r.finish for r in done) - start  # type: ignore[type-var]
        tokens = sum(r.prompt_tokens + r.output_tokens for r in done)
        itls = [r.itl for r in done if r.itl is not None]
        e2e = [(r.finish - r.arrival) / r.output_tokens for r in done]  # type: ignore[operator]
        ttft = [r.ttft for r in done]
        return {
            "requests": len(done),
            "rejected": len(self.rejected),
            "throughput_per_gpu": tokens / window / self.deployment.num_gpus if window else 0.0,
            "output_per_gpu": (sum(r.output_tokens for r in done) / window
                               / self.deployment.num_gpus) if window else 0.0,
            "p90_interactivity": 1 / _p90(itls) if itls else 0.0,
            "p90_e2e_interactivity": 1 / _p90(e2e),
            "ttft_median": statistics.median(ttft),
            "ttft_p90": _p90(ttft),
            "cache_hit_rate": sum(r.cached_tokens for r in done) / sum(r.prompt_tokens
                                                                        for r in done),
            "bottleneck": self.busy.bound,
            **self._acceptance(),
            **self._host_tier(sum(r.prompt_tokens for r in done)),
            "max_context": self.max_context,
            "steps": self.num_steps,
        }


    def _acceptance(self) -> dict[str, float]:
        """MTP's mean acceptance length over every replica (vLLM's: tokens per verify step)."""
        stats = [s.stats() for s in self.schedulers]
        drafts = sum(st.spec_decode_num_drafts for st in stats)
        if not drafts:
            return {}
        return {"acceptance_length":
                1 + sum(st.spec_decode_num_accepted_tokens for st in stats) / drafts}


    def _host_tier(self, prompt_tokens: int) -> dict[str, float]:
        """Of the prompt tokens, the share loaded from the host tier (in the hit rate too)."""
        stats = [s.stats() for s in self.schedulers]
        if not any(st.num_host_blocks for st in stats):
            return {}
        return {"host_hit_rate": sum(st.offload_hits for st in stats) / prompt_tokens}


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class Replica:
    """One engine replica: the real scheduler, and its host-tier copies on the host link (each
    direction one copy stream, jobs in order; every rank copies its shard over its own link)."""

    def __init__(self, index: int, scheduler: Scheduler, copy_seconds_per_block: float) -> None:
        self.index = index
        self.scheduler = scheduler
        self.num_routed = 0  # requests the router sent here
        self.copy_seconds_per_block = copy_seconds_per_block
        # Per direction: landing times of the jobs in flight (in job order), jobs landed so far.
        self._in_flight: dict[str, deque[float]] = {"load": deque(), "store": deque()}
        self._num_landed = {"load": 0, "store": 0}

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
        return self._num_landed[kind]

    def next_copy(self) -> float | None:
        """When the next copy in flight lands (None: none is)."""
        return min((t[0] for t in self._in_flight.values() if t), default=None)


class Simulator:
    def __init__(self, model: ModelConfig, deployment: Deployment, parts: Parts,
                 sessions: Sequence[TraceSession], concurrency: int,
                 duration: float | None = None, *, num_blocks: int | None = None,
                 record_steps: bool = False, measure: MeasureStep | None = None) -> None:
        """`num_blocks` overrides the KV blocks per replica that memory allows (as vLLM's
        --num-gpu-blocks-override); `record_steps` keeps `step_log`: per step and replica, the
        tokens scheduled per request and the free KV blocks after scheduling. `measure` runs
        each step on real model runners instead (calibration): it executes replica i's
        SchedulerOutput and returns (wall seconds, the runner's output); the model's
        prediction for every such step is kept in `step_times` as (measured, predicted)."""
        if concurrency < 1:
            raise ConfigError(f"--concurrency: must be >= 1, got {concurrency}")
        self.model, self.deployment, self.parts = model, deployment, parts
        self.sessions = list(sessions)
        self.concurrency = concurrency
        self.duration = duration
        par = deployment.parallel
        spec = deployment.speculative
        self.num_drafts = spec.num_speculative_tokens if spec is not None else 0
        self.times = StepTimeModel(model, par, parts, deployment.kv_dtype, self.num_drafts)
        # Synthetic acceptance: dsaserve's own verification rule, fixed conditional rates.
        self._rates = torch.tensor(spec.conditional_rates) if spec is not None else None
        self._uniforms = torch.Generator().manual_seed(0)
        self.kv_blocks, self.max_context = replica_kv_capacity(model, deployment, parts)
        block_tokens = deployment.block_size * par.decode_context_parallel_size
        if num_blocks is not None:
            self.kv_blocks, self.max_context = num_blocks, num_blocks * block_tokens
        # The MTP draft steps write k − 1 slots past a request's last token.
        lookahead = max(self.num_drafts - 1, 0)
        max_len = min(self.kv_blocks * block_tokens - lookahead, model.max_position_embeddings)
        cache = CacheConfig(block_size=deployment.block_size,
                            kv_cache_dtype="fp8_ds_mla" if deployment.kv_dtype == "fp8_ds_mla"
                            else "auto", enable_prefix_caching=True)
        sched = SchedulerConfig(max_num_seqs=deployment.max_num_seqs,
                                max_num_batched_tokens=deployment.max_num_batched_tokens,
                                max_model_len=max_len)
        # The host KV tier: each rank holds offload_bytes / ranks, in pages of its own shard.
        rank_block = deployment.block_size * cm.kv_bytes_per_token(model, deployment.kv_dtype).total
        num_host_blocks = deployment.offload_bytes // par.world_size // rank_block
        if deployment.offload_bytes and num_host_blocks * block_tokens < max_len:
            raise ConfigError(f"--deployment {deployment.spec!r}: offload holds "
                              f"{num_host_blocks * block_tokens} tokens, less than one request "
                              f"of {max_len}")
        self.replicas = [
            Replica(i, Scheduler(sched, cache, self.kv_blocks,
                                 dcp_size=par.decode_context_parallel_size,
                                 num_speculative_tokens=self.num_drafts,
                                 num_host_blocks=num_host_blocks,
                                 host_block_bytes=rank_block * par.world_size),
                    rank_block / (parts.host_gbps.value * 1e9))
            for i in range(deployment.replicas)]
        # Lock-step replicas form one group; otherwise each replica steps on its own.
        self.groups = ([self.replicas] if deployment.lockstep
                       else [[r] for r in self.replicas])
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._busy = [False] * len(self.groups)
        self._records: dict[str, RequestRecord] = {}
        self._turn_of: dict[str, tuple[int, int]] = {}  # request id → (slot, turn)
        self._rejected: list[tuple[str, int, str]] = []
        self._next_session = 0
        self._slot_session: dict[int, TraceSession] = {}
        self._rr = 0
        self._total = StepTime()
        self._num_steps = 0
        self.step_log: list[tuple[int, dict[str, int], int]] | None = [] if record_steps else None
        self.measure = measure
        self.step_times: list[tuple[float, float]] = []

    # ---- the event loop -------------------------------------------------------------------------
    def run(self) -> SimResult:
        for slot in range(self.concurrency):
            self._start_session(slot, 0.0)
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                slot, turn = payload  # type: ignore[misc]
                self._arrive(slot, turn, now)
            else:
                self._finish_step(payload, now)  # type: ignore[arg-type]
        for replica in self.replicas:
            replica.scheduler.check_integrity()
        return SimResult(deployment=self.deployment, concurrency=self.concurrency,
                         records=list(self._records.values()), rejected=self._rejected,
                         busy=self._total, num_steps=self._num_steps,
                         max_context=self.max_context, kv_blocks=self.kv_blocks,
                         schedulers=[r.scheduler for r in self.replicas])

    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _start_session(self, slot: int, now: float) -> None:
        if self._next_session >= len(self.sessions):
            return
        if self.duration is not None and now >= self.duration:
            return
        self._slot_session[slot] = self.sessions[self._next_session]
        self._next_session += 1
        self._push(now, "arrive", (slot, 0))

    def _arrive(self, slot: int, turn: int, now: float) -> None:
        session = self._slot_session[slot]
        t = session.turns[turn]
        rid = f"{session.id}/{turn}"
        request = Request(
            request_id=rid, prompt_token_ids=session.prompt(turn, self.model.vocab_size),
            sampling_params=SamplingParams(max_tokens=t.output_tokens, temperature=0.0,
                                           ignore_eos=True),
            arrival_time=now)
        replica = self._route(request)
        try:
            replica.scheduler.add_request(request)
        except RequestError as e:  # longer than a replica can hold: the session cannot go on
            self._rejected.append((session.id, turn, str(e)))
            self._start_session(slot, now)
            return
        self._records[rid] = RequestRecord(request_id=rid, session=session.id,
                                           replica=replica.index, arrival=now,
                                           prompt_tokens=t.input_tokens)
        self._turn_of[rid] = (slot, turn)
        self._kick(replica, now)

    def _kick(self, replica: Replica, now: float) -> None:
        g = next(i for i, group in enumerate(self.groups) if replica in group)
        if not self._busy[g]:
            self._start_step(g, now)

    def _start_step(self, g: int, now: float) -> None:
        group = self.groups[g]
        if not any(r.scheduler.has_unfinished_requests() for r in group):
            self._busy[g] = False
            return
        outputs, batches, drafting = [], [], []
        for replica in group:
            so = replica.scheduler.schedule()
            batch, contexts = [], []
            for rid, n in so.num_scheduled_tokens.items():
                req = replica.scheduler.requests[rid]
                known = n - len(so.scheduled_spec_token_ids.get(rid, ()))
                batch.append((n, req.num_computed_tokens + n))
                if req.num_computed_tokens + known == req.num_tokens:  # samples, then drafts
                    contexts.append(req.num_tokens)
            replica.start_copies(so, now)
            outputs.append(so)
            batches.append(batch)
            drafting.append(contexts)
            if self.step_log is not None and so.num_scheduled_tokens:
                self.step_log.append((replica.index, dict(so.num_scheduled_tokens),
                                      replica.scheduler.kv.num_free_blocks))
        engine_tokens = sum(n for batch in batches for n, _ in batch)
        times = [self.times.step(b, engine_tokens=engine_tokens if self.deployment.lockstep
                                 else None, drafting=d)
                 for b, d in zip(batches, drafting, strict=True)]
        duration = max(t.total for t in times)
        if not any(so.num_scheduled_tokens for so in outputs):  # only copies in flight: wait
            landing = [t for r in group if (t := r.next_copy()) is not None]
            duration = max(min(landing, default=now) - now, 0.0)
        ran: list[ModelRunnerOutput | None] = [None] * len(group)
        if self.measure is not None:  # calibration: real runners, the wall clock
            results = [self.measure(r.index, so) for r, so in zip(group, outputs, strict=True)]
            ran = [out for _, out in results]
            measured = max(seconds for seconds, _ in results)
            self.step_times.append((measured, duration))
            duration = measured
        for t in times:
            self._total = self._total + t
        self._num_steps += 1
        self._busy[g] = True
        self._push(now + duration, "step", (g, outputs, ran))

    def _finish_step(self, payload: tuple[int, list, list], now: float) -> None:
        g, outputs, ran = payload
        for replica, so, out in zip(self.groups[g], outputs, ran, strict=True):
            sched = replica.scheduler
            if out is None:
                out = self._modelled_output(replica, so, now)
            for request_output in sched.update_from_output(so, out):
                self._record(request_output, now)
        self._start_step(g, now)

    def _modelled_output(self, replica: Replica, so: SchedulerOutput,
                         now: float) -> ModelRunnerOutput:
        """What the real runner would return, but for token identity: a token wherever it samples
        one; with MTP, the drafts accepted at the synthetic rates (spec/rejection.py's rule),
        then the target's token, and k new drafts; the host-tier copies landed by now."""
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
                                 num_kv_stores_done=replica.copies_done("store", now))

    def _record(self, out: RequestOutput, now: float) -> None:
        record = self._records[out.request_id]
        if out.new_token_ids and record.first_token is None:
            record.first_token = now
            record.cached_tokens = out.num_cached_tokens
        record.output_tokens = out.num_output_tokens
        if not out.finished:
            return
        record.finish = now
        slot, turn = self._turn_of.pop(out.request_id)
        session = self._slot_session[slot]
        if turn + 1 < len(session.turns) and (self.duration is None or now < self.duration):
            self._push(now + session.turns[turn + 1].think_time_s, "arrive", (slot, turn + 1))
        else:
            self._start_session(slot, now)

    # ---- routing --------------------------------------------------------------------------------
    def _route(self, request: Request) -> Replica:
        """The deployment's router policy over the replicas. `prefix` is `dsaserve router`'s
        own pick (router/scoring.py: llm-d's weights) with the precise view: each replica's
        real block pool, looked up with the hashes the engines compute."""
        replicas = self.replicas
        if len(replicas) == 1:
            return replicas[0]
        policy = self.deployment.router
        if policy == "round-robin":
            self._rr += 1
            return replicas[(self._rr - 1) % len(replicas)]
        loads = [r.scheduler.num_running + r.scheduler.num_waiting for r in replicas]
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


def replica_kv_capacity(model: ModelConfig, deployment: Deployment,
                        parts: Parts) -> tuple[int, int]:
    """(KV blocks of one replica, longest context one request can have) from the GPU's memory:
    HBM × utilisation − weights per GPU − activation reserve, in pages of block_size tokens of
    the whole per-token record (DESIGN §2); a scheduler block is one page on each DCP rank."""
    par = deployment.parallel
    kv = cm.kv_bytes_per_token(model, deployment.kv_dtype)
    weights = cm.weight_bytes_per_gpu(cm.weight_bytes(model), par)
    budget = cm.MemoryBudget(parts.hbm_bytes, deployment.gpu_memory_utilization, weights,
                             int(cm.DEFAULT_ACTIVATION_RESERVE_GIB * 2**30))
    blocks = budget.kv_room // (deployment.block_size * kv.total) if budget.kv_room > 0 else 0
    if blocks < 1:
        raise ConfigError(f"--deployment {deployment.spec!r}: the weights ({weights / 2**30:.1f} "
                          f"GiB per GPU) leave no room for KV on a {parts.name}")
    return blocks, cm.max_context_tokens(budget.kv_room, kv, par.decode_context_parallel_size)
