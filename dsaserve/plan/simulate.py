"""A discrete-event simulation of a deployment: dsaserve's own scheduler and KV manager on a
simulated clock, the model runner replaced by the step-time model (plan/steptime.py).

    session slots (concurrency c) ──► router ──► engine replica: Scheduler.schedule()
          ▲   turn k+1 after think time            │ step priced by StepTimeModel (lock-step
          │                                        ▼ replicas: the slowest rank's time)
          └──────── request finished ◄── Scheduler.update_from_output(sampled tokens)

P/D (`prefill=…; decode=…`): the router sends each turn to a prefill replica as a one-token
request whose blocks the engine's connector then holds, and, once it finished, to a decode
replica with the returned kv_transfer_params; the decode request waits for its KV
(WAITING_FOR_REMOTE_KVS) while the read crosses the network (plan/simpd.py).

What is real: admission, chunked prefill, the token budget, preemption, prefix-cache hits and
evictions (the KVCacheManager and BlockPool, with the KV blocks a GPU of the layout holds), the
host KV tier's OffloadManager, MTP's draft scheduling and synthetic acceptance rule, the P/D
connector's scheduler side, HiSparse admission by host capacity, and `dsaserve router`'s pick
over the replicas' real block pools. What is modelled: each step's duration, each host copy's
(the host link) and each KV read's (the network). AgentX's concurrency semantics: c session
slots; a slot runs its session's turns in order, each after the previous one ends plus its think
time, then takes the next session.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsaserve.config import ConfigError, ModelConfig
from dsaserve.core import KVTransferParams, Request, RequestError, RequestOutput, SamplingParams
from dsaserve.engine.scheduler import Scheduler
from dsaserve.plan.deployment import Deployment, PDDeployment
from dsaserve.plan.hosttime import H200_HOST, HostFits
from dsaserve.plan.parts import Parts
from dsaserve.plan.simengine import (
    MeasureStep,
    MlaSpilling,
    Replica,
    SimEngine,
    engine_capacity,
)
from dsaserve.plan.simpd import KVLink, make_connector, side_channel_payload
from dsaserve.plan.simtrace import TraceSession
from dsaserve.plan.steptime import StepTime


@dataclass
class RequestRecord:
    """One simulated turn's timeline (seconds of simulated time), as the client sees it."""

    request_id: str
    session: str
    replica: int  # the replica that prefilled it (P/D: of the prefill engine)
    arrival: float
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    first_token: float | None = None
    finish: float | None = None
    decode_replica: int | None = None  # P/D: the decode replica
    prefilled: float | None = None  # P/D: when the prefill engine finished (blocks held)
    kv_landed: float | None = None  # P/D: when its KV had reached the decode replica

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
class EngineSummary:
    """One engine of the run: its busy time by part and its capacity per replica."""

    busy: StepTime
    kv_blocks: int
    max_context: int
    max_num_seqs: int


@dataclass
class SimResult:
    deployment: Deployment | PDDeployment
    concurrency: int
    records: list[RequestRecord]
    rejected: list[tuple[str, int, str]]  # (session, turn, why)
    engines: dict[str, EngineSummary]  # "engine", or "prefill" and "decode"
    num_steps: int
    schedulers: list[Scheduler] = field(repr=False, default_factory=list)

    @property
    def max_context(self) -> int:
        """The longest context the deployment serves (P/D: both engines must hold it)."""
        return min(e.max_context for e in self.engines.values())

    @property
    def bottleneck(self) -> str:
        """The step part that takes the most time (P/D: per engine)."""
        if len(self.engines) == 1:
            return next(iter(self.engines.values())).busy.bound
        return " ".join(f"{name[0].upper()}:{e.busy.bound}" for name, e in self.engines.items())

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
        gpus = self.deployment.num_gpus
        return {
            "requests": len(done),
            "rejected": len(self.rejected),
            "throughput_per_gpu": tokens / window / gpus if window else 0.0,
            "output_per_gpu": (sum(r.output_tokens for r in done) / window / gpus
                               if window else 0.0),
            "p90_interactivity": 1 / _p90(itls) if itls else 0.0,
            "p90_e2e_interactivity": 1 / _p90(e2e),
            "ttft_median": statistics.median(ttft),
            "ttft_p90": _p90(ttft),
            "cache_hit_rate": sum(r.cached_tokens for r in done) / sum(r.prompt_tokens
                                                                        for r in done),
            "bottleneck": self.bottleneck,
            **self._acceptance(),
            **self._host_tier(sum(r.prompt_tokens for r in done)),
            **self._transfers(done),
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

    @staticmethod
    def _transfers(done: list[RequestRecord]) -> dict[str, float]:
        """P/D: median time from the end of the prefill to the KV on the decode replica (the
        decode replica's admission, the NIC queues, the bytes and the latency)."""
        waits = [r.kv_landed - r.prefilled for r in done
                 if r.kv_landed is not None and r.prefilled is not None]
        return {"kv_transfer_median": statistics.median(waits)} if waits else {}


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class Simulator:
    def __init__(self, model: ModelConfig, deployment: Deployment | PDDeployment, parts: Parts,
                 sessions: Sequence[TraceSession], concurrency: int,
                 duration: float | None = None, *, num_blocks: int | None = None,
                 record_steps: bool = False, measure: MeasureStep | None = None,
                 host_fits: HostFits = H200_HOST, spilling: MlaSpilling | None = None) -> None:
        """`num_blocks` overrides the KV blocks per replica that memory allows (as vLLM's
        --num-gpu-blocks-override; P/D: on both engines); `record_steps` keeps `step_log`: per
        step and replica, the tokens scheduled per request and the free KV blocks after
        scheduling. `measure` runs each step on real model runners instead (calibration, one
        engine only): it executes replica i's SchedulerOutput and returns (wall seconds, the
        runner's output); the model's prediction for every such step is kept in `step_times`
        as (measured, predicted). `host_fits`: the host time per step (plan/hosttime.py).
        `spilling`: the schedulers hand out HiSparse MLA pages as the engine's (one engine; what
        a measured runner that spills needs; the model prices every page as spilled either
        way)."""
        if concurrency < 1:
            raise ConfigError(f"--concurrency: must be >= 1, got {concurrency}")
        self.model, self.deployment, self.parts = model, deployment, parts
        self.sessions = list(sessions)
        self.concurrency = concurrency
        self.duration = duration
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        kw = dict(num_blocks=num_blocks, record_steps=record_steps, host_fits=host_fits)
        self.link: KVLink | None = None
        if isinstance(deployment, PDDeployment):
            if measure is not None or spilling is not None:
                raise ConfigError("calibration runs one engine, not P/D")
            pre, dec = deployment.prefill, deployment.decode
            self.engines = {
                "prefill": SimEngine("prefill", model, pre, parts, self._push, self._on_prefill,
                                     connector=lambda i: make_connector(pre, "kv_producer", i),
                                     **kw),  # type: ignore[arg-type]
                "decode": SimEngine("decode", model, dec, parts, self._push, self._on_output,
                                    connector=lambda i: make_connector(dec, "kv_consumer", i),
                                    **kw),  # type: ignore[arg-type]
            }
            self.link = KVLink(model, parts, self.engines["prefill"], self.engines["decode"])
            self.engines["decode"].link = self.link
        else:
            self.engines = {"engine": SimEngine("engine", model, deployment, parts, self._push,
                                                self._on_output, measure=measure,
                                                spilling=spilling, **kw)}  # type: ignore[arg-type]
        self.entry = next(iter(self.engines.values()))  # where a turn arrives
        self._records: dict[str, RequestRecord] = {}
        self._turn_of: dict[str, tuple[int, int]] = {}  # request id → (slot, turn)
        self._rejected: list[tuple[str, int, str]] = []
        self._next_session = 0
        self._slot_session: dict[int, TraceSession] = {}

    # ---- what tests and calibration read --------------------------------------------------------
    @property
    def replicas(self) -> list[Replica]:
        return [r for e in self.engines.values() for r in e.replicas]

    @property
    def step_log(self) -> list[tuple[int, dict[str, int], int]] | None:
        return self.entry.step_log

    @property
    def step_times(self) -> list[tuple[float, float]]:
        return self.entry.step_times

    @property
    def step_kinds(self) -> list[str]:
        """Beside `step_times`: each measured step's kind (decode, mixed, prefill)."""
        return [self.entry.step_kind(batches) for batches, _ in self.entry.step_batches]

    @property
    def step_batches(self) -> list[tuple[list[list[tuple[int, int]]], list[StepTime]]]:
        """Beside `step_times`: each measured step's batch per replica ((new tokens, context
        after the step) per request) and the model's parts for each replica."""
        return self.entry.step_batches

    # ---- the event loop -------------------------------------------------------------------------
    def run(self) -> SimResult:
        for slot in range(self.concurrency):
            self._start_session(slot, 0.0)
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                slot, turn = payload  # type: ignore[misc]
                self._arrive(slot, turn, now)
            elif kind == "step":
                engine, g, outputs, ran = payload  # type: ignore[misc]
                engine.finish_step(g, outputs, ran, now)
            else:  # "wake": a copy or read landed on an idle group
                engine, g = payload  # type: ignore[misc]
                engine.wake(g, now)
        for replica in self.replicas:
            replica.scheduler.check_integrity()
        return SimResult(
            deployment=self.deployment, concurrency=self.concurrency,
            records=list(self._records.values()), rejected=self._rejected,
            engines={name: EngineSummary(e.busy, e.capacity.kv_blocks, e.capacity.max_context,
                                         e.capacity.max_num_seqs)
                     for name, e in self.engines.items()},
            num_steps=sum(e.num_steps for e in self.engines.values()),
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
        prompt = session.prompt(turn, self.model.vocab_size)
        pd = self.link is not None
        # P/D: the prefill engine computes one token and holds the blocks for the decode engine.
        request = Request(
            request_id=rid, prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=1 if pd else t.output_tokens,
                                           temperature=0.0, ignore_eos=True),
            arrival_time=now,
            kv_transfer_params=KVTransferParams(do_remote_decode=True) if pd else None)
        replica = self.entry.route(request)
        try:
            if pd and len(prompt) >= self.engines["decode"].max_model_len:
                raise RequestError(f"prompt has {len(prompt)} tokens; max_model_len of the "
                                   f"decode engine is {self.engines['decode'].max_model_len}")
            replica.scheduler.add_request(request)
        except RequestError as e:  # longer than a replica can hold: the session cannot go on
            self._rejected.append((session.id, turn, str(e)))
            self._start_session(slot, now)
            return
        self._records[rid] = RequestRecord(request_id=rid, session=session.id,
                                           replica=replica.index, arrival=now,
                                           prompt_tokens=t.input_tokens)
        self._turn_of[rid] = (slot, turn)
        self.entry.kick(replica, now)

    def _on_prefill(self, engine: SimEngine, replica: Replica, out: RequestOutput,
                    now: float) -> None:
        """P/D: a prefill finished with its blocks held; the decode request goes to the decode
        engine with the returned params, checked against the producer's side channel."""
        if not out.finished:
            return
        params = out.kv_transfer_params
        if params is None:
            raise RuntimeError(f"P/D: prefill of {out.request_id!r} ended without "
                               f"kv_transfer_params ({out.finish_reason})")
        record = self._records[out.request_id]
        record.cached_tokens = out.num_cached_tokens
        record.prefilled = now
        slot, turn = self._turn_of[out.request_id]
        session = self._slot_session[slot]
        request = Request(
            request_id=out.request_id,
            prompt_token_ids=session.prompt(turn, self.model.vocab_size),
            sampling_params=SamplingParams(max_tokens=session.turns[turn].output_tokens,
                                           temperature=0.0, ignore_eos=True),
            arrival_time=now, kv_transfer_params=params)
        decode = self.engines["decode"]
        target = decode.route(request)
        assert target.connector is not None and params.remote_engine_id is not None
        producer = self.link.producers[params.remote_engine_id]  # type: ignore[union-attr]
        target.connector.check_request(out.request_id, params, request.num_prompt_tokens,
                                       fetched=side_channel_payload(producer))
        target.scheduler.add_request(request)  # its length was checked at arrival
        record.decode_replica = target.index
        decode.kick(target, now)

    def _on_output(self, engine: SimEngine, replica: Replica, out: RequestOutput,
                   now: float) -> None:
        record = self._records[out.request_id]
        if out.new_token_ids and record.first_token is None:
            record.first_token = now
            if self.link is None:
                record.cached_tokens = out.num_cached_tokens
            else:
                record.kv_landed = self.link.reads[out.request_id][1]
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


def replica_kv_capacity(model: ModelConfig, deployment: Deployment,
                        parts: Parts) -> tuple[int, int]:
    """(KV blocks of one replica, longest context one request can have) from the GPU's memory
    (simengine.engine_capacity)."""
    cap = engine_capacity(model, deployment, parts)
    return cap.kv_blocks, cap.max_context
