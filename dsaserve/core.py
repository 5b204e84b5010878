"""The vocabulary shared by the engine core, the workers and the server.

Everything that crosses a module or process boundary is one of these dataclasses; no ad-hoc dicts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestError(ValueError):
    """Bad input from a client; the message is safe to return as an HTTP 400. `param`: the
    request field it names, where one does (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine cannot continue (a worker died or raised, or it was shut down); every worker has
    been stopped and no request in flight can complete."""


_GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS
_GREEDY_TOP_P = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; validated on construction (a bad value raises RequestError)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # vLLM's: None = none; N >= 0 = each emitted token's log-probability and the N most
    # likely tokens' (the raw model distribution, whatever the temperature and top-p)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                               "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature!r}",
                               "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
                "top_k")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise RequestError(f"seed must be a 64-bit integer, got {self.seed!r}", "seed")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}",
                               "min_tokens")
        if self.logprobs is not None and (
                not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                or self.logprobs < 0):
            raise RequestError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}",
                               "logprobs")

    def min_tokens_stop_ids(self, eos_token_ids: tuple[int, ...],
                            vocab_size: int) -> tuple[int, ...]:
        """The ids kept from sampling while the output is shorter than min_tokens (vLLM's
        MinTokensLogitsProcessor): the request's EOS ids unless ignore_eos, and its
        stop_token_ids, sorted, those outside [0, vocab_size) left out (no row can sample
        them); () when min_tokens is 0."""
        if not self.min_tokens:
            return ()
        ids = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        return tuple(sorted(t for t in ids if 0 <= t < vocab_size))

    @property
    def greedy(self) -> bool:
        """Argmax decoding. Also below these values, where sampling is argmax in effect and its fp32
        maths breaks (a step would fail for the whole batch): logits / 1e-38 overflow to inf, and a
        top_p under fp32's smallest positive rounds to 0 and drops every token. With top_p < 1e-6
        the nucleus is the top token alone for any vocabulary under 10^6 (its mass is ≥ 1/V)."""
        return self.temperature < _GREEDY_TEMPERATURE or self.top_p < _GREEDY_TOP_P


@dataclass(frozen=True)
class KVTransferParams:
    """vLLM's `kv_transfer_params` of a request or a response (P/D disaggregation, NixlConnector
    field names), plus the source layout our re-layout needs (docs/disagg.md).

    A prefill request carries `do_remote_decode`; its response carries `do_remote_prefill` and
    where the KV is (`remote_*`), which the decode request then carries."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: tuple[int, ...] = ()
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1
    # ours: the prefill engine's KV layout and how many prompt tokens its blocks hold
    remote_block_size: int = 0
    remote_dcp_size: int = 1
    remote_interleave: int = 1
    remote_num_tokens: int = 0

    _FIELDS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_request_id",
               "remote_block_ids", "remote_host", "remote_port", "tp_size", "remote_block_size",
               "remote_dcp_size", "remote_interleave", "remote_num_tokens")

    @classmethod
    def from_json(cls, raw: object) -> KVTransferParams:
        """From a client's JSON object; RequestError (→ 400) naming the bad field. Unknown
        fields are ignored, as vLLM does (proxies add their own)."""
        if not isinstance(raw, dict):
            raise RequestError(f"kv_transfer_params: expected an object, got {raw!r}")
        kw: dict[str, object] = {}
        for name in ("do_remote_decode", "do_remote_prefill"):
            v = raw.get(name)
            v = False if v is None else v
            if not isinstance(v, bool):
                raise RequestError(f"kv_transfer_params.{name}: expected a boolean, got {v!r}")
            kw[name] = v
        for name in ("remote_engine_id", "remote_request_id", "remote_host"):
            v = raw.get(name)
            if v is not None and not isinstance(v, str):
                raise RequestError(f"kv_transfer_params.{name}: expected a string, got {v!r}")
            kw[name] = v
        for name, low in (("remote_port", 1), ("tp_size", 1), ("remote_block_size", 0),
                          ("remote_dcp_size", 1), ("remote_interleave", 1),
                          ("remote_num_tokens", 0)):
            v = raw.get(name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise RequestError(
                    f"kv_transfer_params.{name}: expected an integer >= {low}, got {v!r}")
            kw[name] = v
        ids = raw.get("remote_block_ids")
        ids = [] if ids is None else ids  # vLLM's proxy sends the remote_* fields as null
        if not isinstance(ids, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise RequestError("kv_transfer_params.remote_block_ids: expected a list of "
                               f"non-negative integers, got {ids!r}")
        kw["remote_block_ids"] = tuple(ids)
        params = cls(**kw)  # type: ignore[arg-type]
        if params.do_remote_decode and params.do_remote_prefill:
            raise RequestError("kv_transfer_params: do_remote_decode and do_remote_prefill "
                               "cannot both be true")
        return params

    def to_json(self) -> dict[str, object]:
        out = {name: getattr(self, name) for name in self._FIELDS}
        out["remote_block_ids"] = list(self.remote_block_ids)
        return out


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Its prefix is being copied from the host KV tier, or its prompt's KV read from a prefill
    # engine (P/D), into its GPU blocks (vLLM's name).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # A plain attribute fixed per member: read several times per request per step (a
        # property building a tuple of members cost ~0.6 µs a read).
        self.finished: bool = value in ("stop", "length", "abort")


PLACEHOLDER_TOKEN_ID = -1  # an output token sampled on the device, not yet read (async)


@dataclass
class Request:
    """A request as the engine core tracks it.

    The scheduler speaks tokens: `num_computed_tokens` catches up with `len(all_token_ids)`; a
    prefill, a chunk of one, a prefix hit and a decode step are all "how many tokens this step".
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    cache_salt: str | None = None
    eos_token_ids: tuple[int, ...] = ()  # the model's own EOS first (no stop_reason)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first scheduling; -1 = not yet
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    # Draft tokens (MTP) proposed after the last step, to be verified by the next one; they are
    # not part of the request's tokens until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: KVTransferParams | None = None  # P/D (disagg/connector.py)
    # --async-scheduling: output tokens the in-flight steps will sample, held in
    # output_token_ids as PLACEHOLDER_TOKEN_ID at its end until their step's results are read
    num_output_placeholders: int = 0
    # set when one of SamplingParams.stop_token_ids ended it (RequestOutput.stop_token_id)
    stop_token_id: int | None = None
    # time.monotonic() of its first scheduling (None: not yet). A preempted request's later
    # schedulings do not move it: as vLLM counts, the time it waits after a preemption is
    # part of its prefill or decode, not of its queueing.
    scheduled_time: float | None = None
    # SamplingParams.stop_token_ids as a set: every emitted token is looked up in it (a list of
    # a client's millions of ids scanned per token slowed every request of the engine)
    stop_ids: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.sampling_params.stop_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known on the host (placeholders of in-flight steps not counted)."""
        return len(self.output_token_ids) - self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status.finished


# ------------------------------------------------------------------------------------------------
# Engine core → model runner: a typed diff per step
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption): sent in full."""

    request_id: str
    token_ids: tuple[int, ...]  # every known token (prompt + outputs so far)
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    # the prompt's length (token_ids past it are outputs; None: every token is the prompt's)
    # and the request's EOS ids: what SamplingParams.min_tokens masks on the device
    num_prompt_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CachedRequestData:
    """A running request: only what changed since the last step."""

    request_id: str
    new_token_ids: tuple[int, ...]  # tokens sampled last step that the runner must now feed
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    # None: append new_block_ids to the runner's list; n: cut that list to its first n blocks
    # first (blocks that only rejected draft tokens used were given back).
    num_kept_blocks: int | None = None

    @classmethod
    def of(cls, request_id: str, new_token_ids: tuple[int, ...],
           new_block_ids: tuple[int, ...], num_computed_tokens: int,
           num_kept_blocks: int | None) -> CachedRequestData:
        """`CachedRequestData(...)` of every field, the same object, ~3x cheaper: one per
        running request per step (as `RequestOutput.of`)."""
        out = object.__new__(cls)
        out.__dict__.update(request_id=request_id, new_token_ids=new_token_ids,
                            new_block_ids=new_block_ids,
                            num_computed_tokens=num_computed_tokens,
                            num_kept_blocks=num_kept_blocks)
        return out


@dataclass(frozen=True)
class KVTransfer:
    """One copy job between the GPU KV pool and the host KV tier (every rank copies its own shard
    of each block). Jobs of one kind finish in `job_id` order on every rank."""

    job_id: int  # 0, 1, 2, ... per kind (loads and stores count separately)
    gpu_block_ids: tuple[int, ...]  # scheduler block ids (the GPU block table's numbering)
    host_block_ids: tuple[int, ...]  # same length: gpu_block_ids[i] ↔ host_block_ids[i]


@dataclass(frozen=True)
class KVRecv:
    """P/D, consumer side: read positions [num_cached, num_tokens) of a prompt from the prefill
    engine's blocks into this engine's `block_ids` (re-laid out, disagg/relayout.py)."""

    request_id: str
    block_ids: tuple[int, ...]  # this engine's scheduler blocks for the whole prompt
    num_cached: int  # the prefix this engine holds already (not moved)
    num_tokens: int  # one past the last position moved
    remote: KVTransferParams
    remote_ranks: tuple[bytes, ...]  # transport metadata of one prefill rank per DCP rank


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    num_scheduled_tokens: dict[str, int]  # request id → tokens computed this step
    finished_request_ids: tuple[str, ...]  # the runner drops their state
    # request id → draft tokens to verify this step (speculative decoding): they follow the
    # request's last token and are counted in num_scheduled_tokens.
    scheduled_spec_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kv_stores: tuple[KVTransfer, ...] = ()  # GPU → host, started before this step's forward
    kv_loads: tuple[KVTransfer, ...] = ()  # host → GPU, into blocks no scheduled request reads
    # P/D: prompts whose KV the runner reads from a prefill engine before this step's forward
    kv_recvs: tuple[KVRecv, ...] = ()
    # HiSparse with fewer MLA pages than blocks (kv/hisparse/mla_pages.py): (block id, MLA page
    # or −1: spilled) for every block whose page changed since the last step; applied first
    mla_pages: tuple[tuple[int, int], ...] = ()
    # HiSparse host blocks kept by prefix hash (kv/hisparse/mla_pages.py), applied after
    # mla_pages, in this order: the spilled blocks of finished_request_ids whose host rows the
    # runtime keeps (cached, no page); the kept or live blocks whose new page is filled from
    # their host rows (a prefix hit); the kept blocks evicted (their host rows given back)
    host_keep: tuple[int, ...] = ()
    host_restore: tuple[int, ...] = ()
    host_drop: tuple[int, ...] = ()
    # DP + EP (engine/dp_padding.py): the size every replica pads this decode step to (one
    # with no rows runs an all-padding batch of it); None: every replica runs it as it is
    dp_padded_size: int | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """No tokens to compute (copy jobs may still be there to start)."""
        return not self.num_scheduled_tokens

    @property
    def is_idle(self) -> bool:
        """Nothing for the ranks at all: no tokens, no request state to drop, no copy, read or
        page change (such a step need not reach them)."""
        return self.is_empty and not (
            self.new_requests or self.cached_requests or self.finished_request_ids
            or self.kv_stores or self.kv_loads or self.kv_recvs or self.mla_pages
            or self.host_keep or self.host_restore or self.host_drop)


@dataclass(frozen=True)
class StepStats:
    """What a runner (rank 0's) knows of a step it launched, for the engine's step log
    (--step-log, engine/step_log.py); host-known only: reading it syncs nothing."""

    index: int  # the runner's count of launched steps, from 0: the key of its GPU time
    num_decode_rows: int  # rows of requests computing their last token (and drafts)
    num_prefill_rows: int  # the other rows (prompt chunks, a resumed request's tokens)
    padded_size: int | None  # the padded path's size (engine/decode_graph.py); None: as it is
    graph: bool  # the target forward was replayed from a CUDA graph
    draft_graph: bool  # MTP's draft chain was replayed from a CUDA graph
    launch_ms: float  # host time of the runner's launch (the diff → drafts; not the copy)
    timed: bool  # CUDA events were recorded: its StepGpuTime comes with a later output


@dataclass(frozen=True)
class StepGpuTime:
    """A launched step's device time from CUDA events on its stream, read once they passed."""

    index: int  # StepStats.index
    forward_ms: float  # the target forward (a graph replay, or the eager forward's launches)
    step_ms: float  # forward start → the step's sampling and drafts done (not the copy)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per scheduled request: the tokens it emits this step, in order — none while a prefill
    chunk is still partial, one without drafts, 1..k+1 after verifying k drafts (the accepted
    drafts, then the target's own token) — and, with speculative decoding, the drafts proposed
    for the next step."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[float]] = field(default_factory=dict)  # one per emitted token
    # per emitted token, the step's top-W (id, log-probability), most likely first; W is the
    # largest `logprobs` of the live requests (absent when no live request asks)
    top_logprobs: dict[str, list[tuple[tuple[int, float], ...]]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Host-tier copy jobs finished so far, per kind (a prefix of the job ids on every rank; the
    # executor reports the minimum over ranks).
    num_kv_loads_done: int = 0
    num_kv_stores_done: int = 0
    # P/D: prompts whose remote KV arrived (consumer), failed reads with the reason, and held
    # prompts every consumer has read (producer: their blocks may go)
    kv_recvs_done: tuple[str, ...] = ()
    kv_recvs_failed: dict[str, str] = field(default_factory=dict)
    kv_sends_done: tuple[str, ...] = ()
    # --step-log: this step's stats (None: the log is off, or the step computed nothing) and
    # the GPU times of earlier steps whose events had passed when this one was launched
    step_stats: StepStats | None = None
    gpu_times: tuple[StepGpuTime, ...] = ()


# ------------------------------------------------------------------------------------------------
# Engine → client
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the raw model distribution, and the
    SamplingParams.logprobs most likely tokens' (id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    kv_transfer_params: KVTransferParams | None = None  # P/D: what the decode request needs
    error: str | None = None  # why the request failed (e.g. its remote KV could not be read)
    # one per new token when the request asked (SamplingParams.logprobs not None), else None
    logprobs: tuple[TokenLogprob, ...] | None = None
    # the SamplingParams.stop_token_ids entry that ended the request (its last token); None
    # for every other end, EOS included (vLLM's stop_reason)
    stop_token_id: int | None = None
    # The engine core's timestamps (time.monotonic(): the scheduler runs in the server's
    # process, a DP replica's too, so the server's clock): when the engine queued the request,
    # first scheduled it (None: never), and made this output (its new tokens' time)
    queued_time: float = 0.0
    scheduled_time: float | None = None
    output_time: float = 0.0

    @classmethod
    def of(cls, request_id: str, new_token_ids: tuple[int, ...], finished: bool,
           finish_reason: str | None, num_prompt_tokens: int, num_cached_tokens: int,
           num_output_tokens: int, kv_transfer_params: KVTransferParams | None,
           error: str | None, logprobs: tuple[TokenLogprob, ...] | None,
           stop_token_id: int | None,
           queued_time: float, scheduled_time: float | None, output_time: float
           ) -> RequestOutput:
        """`RequestOutput(...)` of every field, the same object, made as the scheduler makes
        one per request per step: a frozen dataclass's __init__ sets each field through
        object.__setattr__ (~2 µs for these 14 on a CPU, ~130 µs a decode step at b = 64);
        filling the new instance's __dict__ at once takes ~0.5 µs."""
        out = object.__new__(cls)
        out.__dict__.update(
            request_id=request_id, new_token_ids=new_token_ids, finished=finished,
            finish_reason=finish_reason, num_prompt_tokens=num_prompt_tokens,
            num_cached_tokens=num_cached_tokens, num_output_tokens=num_output_tokens,
            kv_transfer_params=kv_transfer_params, error=error, logprobs=logprobs,
            stop_token_id=stop_token_id, queued_time=queued_time,
            scheduled_time=scheduled_time, output_time=output_time)
        return out


@dataclass(frozen=True)
class Completion:
    """One prompt's whole output from the offline path (LLMEngine.generate_with_logprobs)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None  # one per token; None: logprobs not asked


@dataclass(frozen=True)
class CountHistogram:
    """Observations of a count in Prometheus's buckets: counts[i] of them are at most bounds[i]
    (and above bounds[i − 1]), counts[-1] above every bound; `total` is their sum."""

    bounds: tuple[int, ...] = ()
    counts: tuple[int, ...] = (0,)
    total: int = 0

    def __add__(self, other: CountHistogram) -> CountHistogram:
        """Both histograms' observations (DP replicas: the same bounds)."""
        if other.bounds != self.bounds:
            raise ValueError(f"histogram bounds differ: {self.bounds} != {other.bounds}")
        return CountHistogram(self.bounds, tuple(a + b for a, b in zip(
            self.counts, other.counts, strict=True)), self.total + other.total)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and tests (prefix-cache figures count tokens, not blocks)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found cached
    num_preemptions: int
    # Speculative decoding (vLLM's spec_decode counters); per_pos has one entry per draft
    # position, empty without speculative decoding.
    spec_decode_num_drafts: int = 0  # verification steps of a request with drafts
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    # The host KV tier (zeros when it is off): tokens looked up after the GPU hit, found there;
    # bytes copied (all ranks); host blocks holding KV of the total.
    offload_queries: int = 0
    offload_hits: int = 0
    offload_bytes_stored: int = 0
    offload_bytes_loaded: int = 0
    num_host_blocks_used: int = 0
    num_host_blocks: int = 0
    # HiSparse spilling (zeros when off): GPU MLA pages, those free, blocks spilled so far
    num_mla_pages: int = 0
    num_mla_pages_free: int = 0
    hisparse_mla_spills: int = 0
    # tokens scheduled per step (steps that schedule none left out): vllm:iteration_tokens_total
    iteration_tokens: CountHistogram = CountHistogram()

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: 1 + accepted drafts per step (vLLM's)."""
        if self.spec_decode_num_drafts == 0:
            return 0.0
        return 1.0 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts

    @property
    def kv_cache_usage(self) -> float:
        if self.num_total_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks
