"""P/D: where the decode engine's posting step (the step that posts a long prompt's READs into
its KV pages) spends its host time, by part, on the CPU.

    python benchmarks/pd_post_profile.py                       # 32K and 128K, shm and NIXL
    python benchmarks/pd_post_profile.py --tokens 131072 --transports nixl --top 30
    python benchmarks/pd_post_profile.py --smoke               # CI: tiny sizes, shm
    python benchmarks/pd_post_profile.py --tables phases --tokens 8192,32768,131072

The READ's descriptors depend on the layers, the blocks and the caches' byte layout, not on the
hidden size, so the model is tiny-glm5 with GLM-5.3's row widths (656-byte fp8_ds_mla rows,
132-byte FP8 indexer keys) and GLM-5.3-shaped 4 layers + MTP (indexer caches on layers 0-2 and
the MTP layer), block 64: the shapes of `pd_overlap.py`'s H100 rows. The prefill engine is a
stand-in: a producer connector (its scheduler and worker halves, in this process) holding a
request whose blocks are pages of caches shaped as the decode engine's, never computed, since
only their addresses matter to the posting step (a CPU prefill of 128K tokens would take
hours). B requests decode on the decode engine; then the held request is added and the next
step, which posts its READs, runs under cProfile. Per row: the posting step, an idle step, the
connector's "posting" timer (`ConnectorWorker.read_times`), the transport READs and their
segments (descriptors), the profile's parts, and when within the posting step the running
requests' forward was launched and the READs were posted (`Stamps`: ms from the step's start;
the order the runner establishes is the forward first, so that on a GPU the step's kernels are
queued before the host spends its time posting).

Rows run in order in one engine (a 256-token warm-up, then `--tokens`), so a row's READ lands
partly in blocks the row before freed, as in a serving engine. Shared memory's copy thread is
held until the posting step ends (`--free-copies` lets it run): the step's host work alone.
NIXL over DRAM (both agents in this process, host memory only) has no progress thread and
copies inside `transfer`: its READ time is mostly the bytes. CPU only: on a GPU, use
`pd_overlap.py` (the engines in two processes).

`--tables phases`: the decode request's whole path, from `add_request` to its first decoded
token (what `pd_e2e.py`'s "first decoded token" spans), by phase: wall clock per call of the
functions in `PHASES` (a nested phase's time is also in its caller's), per stage: the
`add_request` call (the side channel's check, the prompt's hashes), the posting step, the poll
steps until the READs landed, and the step that computes the last prompt token and samples.
Shared memory's copies run freely there. The model forward is the CPU reference's (at 128K
the new request's indexer over its context is ~0.4 s of CPU, a kernel on a GPU): the row
"host, less the forwards" is what a GPU host would also spend. Each prompt runs `--repeats`
times, prompts alternating, the median per phase kept; with the profile on, one more run of
the longest prompt is profiled (cProfile, the engine's and connector's functions).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsaserve.bench.argtypes import positive_ints
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.core import KVTransferParams, Request, SamplingParams
from dsaserve.disagg.connector import ConnectorScheduler, ConnectorWorker, EngineLayout
from dsaserve.disagg.transport import KVTransport, nixl_available
from dsaserve.engine.engine import LLMEngine
from dsaserve.model.dsa import LayerCache
from dsaserve.model.make_model import make_model


def glm53_layers(n: int) -> dict:
    """GLM-5.3 cut to `n` layers (+ MTP), its indexer schedule kept (make_model's rule:
    index_skip_topk_offset 3, index_topk_freq 4: full on layers 0-2, then every 4th)."""
    return {"num_hidden_layers": n, "num_nextn_predict_layers": 1,
            "indexer_types": ["full" if max(i - 2, 0) % 4 == 0 else "shared" for i in range(n)],
            "max_position_embeddings": 1 << 20}


GLM53_4_LAYERS = glm53_layers(4)  # full, full, full, shared

# the profile's parts: (label, substrings of "file:function" that start it), first match wins
PARTS = [
    ("plans (plan_transfer)", ("relayout.py:plan_transfer",)),
    ("segments (plan_segments)", ("descriptors.py:plan_segments",)),
    ("segments → lists (for_read)", ("descriptors.py:for_read",)),
    ("transport READs (read)", ("transport.py:read", "transport.py:read_regions")),
    ("connector posting (start_receives)", ("connector.py:start_receives",)),
    ("prefix hashes (extend_block_hashes)", ("prefix_cache.py:extend_block_hashes",)),
    ("scheduler (schedule)", ("scheduler.py:schedule",)),
    ("model forward (runner.execute)", ("runner.py:execute", "runner.py:submit")),
]


@dataclasses.dataclass(frozen=True)
class Row:
    transport: str
    tokens: int
    post_ms: float  # the whole posting step (host clock around LLMEngine.step)
    idle_ms: float  # median idle step, the same B requests
    timer_ms: float  # ConnectorWorker.read_times.post_s of the request
    reads: int  # transfers posted (transport.read and read_regions calls)
    segments: int  # their segments (NIXL: descriptors per side)
    nbytes: int
    parts: dict[str, float]  # label → cumulative ms in the profiled step
    profile: str  # the profile's top functions
    forward_at_ms: float  # step start → the running requests' forward called
    post_from_ms: float  # step start → the connector's posting (start_receives) began
    post_to_ms: float  # step start → it returned


class CountingReads:
    """Wraps a transport's `read` (one region pair) and `read_regions` (several, one transfer)
    to count transfers, segments and bytes."""

    def __init__(self, transport: KVTransport) -> None:
        self.reads = self.segments = self.nbytes = 0
        read = transport.read

        def counted_read(peer, local, remote, segments=None, notify=b""):
            self._count([(local, remote, segments)])
            return read(peer, local, remote, segments, notify)
        transport.read = counted_read  # type: ignore[method-assign]
        if hasattr(transport, "read_regions"):  # absent before one transfer per peer
            regions = transport.read_regions

            def counted_regions(peer, items, notify=b""):
                self._count(items)
                return regions(peer, items, notify)
            transport.read_regions = counted_regions  # type: ignore[method-assign]

    def _count(self, items) -> None:
        self.reads += 1
        for _, _, segments in items:
            self.segments += len(segments or ())
            self.nbytes += sum(n for _, _, n in segments or ())


class Stamps:
    """When, within a step, the runner calls the model forward and the connector posts its
    READs (host clock, first call of each since `reset`)."""

    def __init__(self, runner, connector: ConnectorWorker) -> None:
        self.at: dict[str, float] = {}
        forward, post = runner._forward, connector.start_receives

        def timed_forward(*a, **k):
            self.at.setdefault("forward", time.perf_counter())
            return forward(*a, **k)

        def timed_post(*a, **k):
            self.at.setdefault("post_from", time.perf_counter())
            try:
                return post(*a, **k)
            finally:
                self.at.setdefault("post_to", time.perf_counter())
        runner._forward = timed_forward
        connector.start_receives = timed_post  # type: ignore[method-assign]

    def reset(self) -> None:
        self.at.clear()

    def ms(self, key: str, t0: float) -> float:
        """ms from t0 to the stamp; NaN if it did not happen."""
        return (self.at[key] - t0) * 1e3 if key in self.at else float("nan")


class HeldCopies:
    """Shared memory: the consumer's copy thread starts a READ's bytes only once `release`d, so
    that the posting step is timed without the copy sharing the cores (NIXL over DRAM copies
    inside its post, with no progress thread: that cannot be held)."""

    def __init__(self, transport: KVTransport) -> None:
        self.go = threading.Event()
        copies = transport.copies  # type: ignore[attr-defined]
        inner = copies._copy

        def held(job) -> bool:
            self.go.wait()
            return inner(job)
        copies._copy = held

    def hold(self) -> None:
        self.go.clear()

    def release(self) -> None:
        self.go.set()


class HeldPrefill:
    """A prefill engine's connector holding requests in caches shaped as `caches` (one rank):
    what a decode engine's READs need, without computing anything."""

    def __init__(self, backend: str, caches: list[LayerCache], block_size: int) -> None:
        config = DisaggConfig(kv_role="kv_producer", backend=backend, side_channel_port=0)
        self.worker = ConnectorWorker(config, rank=0, dcp_rank=0, world_size=1,
                                      block_size=block_size, dcp_size=1, interleave=1)
        mine = [LayerCache(kv=torch.zeros_like(c.kv),
                           index=None if c.index is None else torch.zeros_like(c.index))
                for c in caches]
        self.worker.register(mine)
        self.scheduler = ConnectorScheduler(config, "held-prefill",
                                            EngineLayout(block_size, 1, 1, 1),
                                            [self.worker.metadata()])
        self.num_blocks = caches[0].kv.shape[0]
        self.block_size = block_size

    def hold(self, rid: str, prompt: list[int]) -> KVTransferParams:
        blocks = -(-len(prompt) // self.block_size)
        assert blocks <= self.num_blocks, "the stand-in's caches are too small"
        req = Request(rid, prompt, SamplingParams(max_tokens=1), block_ids=list(range(blocks)))
        return self.scheduler.hold(req)

    def drain(self) -> None:
        """The decode engine's notifications read; the held requests it read freed."""
        self.scheduler.release(self.worker.poll_sends())

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


def config(args: argparse.Namespace, model_dir: Path, backend: str) -> EngineConfig:
    max_len = max(args.tokens) + args.block_size
    # each decoder's tokens: its prompt, then one per step (idle steps, the posting step and
    # the few until the READ landed, per row and the warm-up row)
    decoded = (len(args.tokens) + 1) * (args.steps + 16)
    blocks = (-(-max_len // args.block_size)
              + args.batch * -(-(args.context + decoded) // args.block_size) + 4)
    return EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                          num_gpu_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=args.batch + 1, max_num_batched_tokens=4096,
                                  max_model_len=max(max_len, args.context + decoded + 1),
                                  async_scheduling=args.async_scheduling),
        attention=AttentionConfig(backend="reference", sparse_mla_force_mqa=True),
        dtype=args.dtype, device="cpu",
        disagg=DisaggConfig(kv_role="kv_consumer", backend=backend, side_channel_port=0))


def _step(d: LLMEngine, t0: float | None = None) -> float:
    t0 = time.perf_counter() if t0 is None else t0
    for o in d.step():
        if o.error is not None:
            raise RuntimeError(f"request {o.request_id}: {o.error}")
    return (time.perf_counter() - t0) * 1e3


def _parts(stats: pstats.Stats) -> dict[str, float]:
    out = {}
    for label, keys in PARTS:
        ms = 0.0
        for (file, _, func), (_, _, _, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
            name = f"{Path(file).name}:{func}"
            if any(name == k for k in keys):
                ms = max(ms, ct * 1e3)  # cumulative: recursion and wrappers counted once
        out[label] = ms
    return out


def _decode_engine(args: argparse.Namespace, model_dir: Path, backend: str,
                   g: torch.Generator) -> tuple[LLMEngine, HeldPrefill]:
    """The decode engine with `--batch` requests decoding, and the stand-in prefill engine."""
    d = LLMEngine.from_config(config(args, model_dir, backend))
    assert isinstance(d, LLMEngine)
    p = HeldPrefill(backend, d.executor.runner.caches, args.block_size)  # in-process: one rank
    params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    vocab = d.config.model.vocab_size
    for i in range(args.batch):
        d.add_request(f"dec{i}", torch.randint(4, vocab, (args.context,),
                                               generator=g).tolist(), params)
    for _ in range(3):  # their prefills, then decode steps
        _step(d)
    return d, p


def _close(args: argparse.Namespace, d: LLMEngine, p: HeldPrefill) -> None:
    """The decoders aborted, the engine's invariants checked (the held requests all read)."""
    for i in range(args.batch):
        d.abort_request(f"dec{i}")
    _step(d)
    p.drain()
    d.check_integrity()


def measure(args: argparse.Namespace, model_dir: Path, backend: str) -> list[Row]:
    g = torch.Generator().manual_seed(0)
    d, p = _decode_engine(args, model_dir, backend, g)
    runner = d.executor.runner
    connector = runner.connector
    counts = CountingReads(connector.transport)
    stamps = Stamps(runner, connector)
    held = HeldCopies(connector.transport) if backend == "shm" and args.hold_copies else None
    vocab = d.config.model.vocab_size
    rows = []
    try:
        for n, tokens in enumerate([args.block_size * 4, *args.tokens]):  # first: warm-up
            idle = sorted(_step(d) for _ in range(args.steps))[args.steps // 2]
            rid, prompt = f"read{n}", torch.randint(4, vocab, (tokens,), generator=g).tolist()
            d.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                          kv_transfer_params=p.hold(rid, prompt))
            before = dataclasses.replace(connector.read_times)
            reads, segments, nbytes = counts.reads, counts.segments, counts.nbytes
            if held is not None:
                held.hold()
            prof = cProfile.Profile()
            stamps.reset()
            if args.profile:
                prof.enable()
            t0 = time.perf_counter()
            post_ms = _step(d, t0)
            prof.disable()
            at = {k: stamps.ms(k, t0) for k in ("forward", "post_from", "post_to")}
            if held is not None:
                held.release()
            while rid in d.scheduler.requests:  # READs land; its first token
                _step(d)
                p.drain()
            # the timer is added up when the request's READs landed (`poll_receives`)
            timer_ms = (connector.read_times.post_s - before.post_s) * 1e3
            parts, text = {label: float("nan") for label, _ in PARTS}, io.StringIO()
            if args.profile:
                parts = _parts(pstats.Stats(prof))
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.top)
            if n:
                rows.append(Row(backend, tokens, post_ms, idle, timer_ms,
                                counts.reads - reads, counts.segments - segments,
                                counts.nbytes - nbytes, parts, text.getvalue(),
                                at["forward"], at["post_from"], at["post_to"]))
                print(row_line(rows[-1]), file=sys.stderr)
        _close(args, d, p)
    finally:
        if held is not None:
            held.release()
        d.shutdown()
        p.close()
    return rows


def row_line(r: Row) -> str:
    parts = " | ".join(f"{ms:.1f}" for ms in r.parts.values())
    return (f"| {r.transport} | {r.tokens:,} | {r.idle_ms:.1f} | {r.post_ms:.1f} | "
            f"{r.forward_at_ms:.1f} | {r.post_from_ms:.1f}–{r.post_to_ms:.1f} | "
            f"{r.timer_ms:.1f} | {r.reads} | {r.segments:,} | {r.nbytes / 2**20:.1f} | {parts} |")


def table(rows: list[Row]) -> list[str]:
    labels = [label for label, _ in PARTS]
    return ["| transport | prompt | idle step ms | post step ms | forward at ms | posting ms | "
            "posting timer ms | READs | segments | MiB | "
            + " | ".join(f"{x} ms" for x in labels) + " |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(labels),
            *map(row_line, rows)]


# ---- --tables phases: add_request → the first decoded token ------------------------------------
# (label, owner, method): each call's wall clock added to the label; a phase nested in another
# (marked "·") is also in its caller's time ("prefix hashes" too, within update_from_output).
# Owners: the engine, its scheduler and KV manager, the scheduler half of the connector, the
# runner and its connector half.
PHASES = [
    ("check (side channel)", "connector", "check_request"),
    ("prefix hashes (update_hashes)", "kv", "update_hashes"),
    ("schedule", "scheduler", "schedule"),
    ("· allocate + KVRecv (_start_recv)", "scheduler", "_start_recv"),
    ("· new request data", "scheduler", "_new_request_data"),
    ("runner execute", "runner", "execute"),
    ("· diff (_apply_diff)", "runner", "_apply_diff"),
    ("· inputs + metadata (_prepare)", "runner", "_prepare"),
    ("· forward", "runner", "_forward"),
    ("· sample", "runner", "_sample"),
    ("· posting (start_receives)", "worker", "start_receives"),
    ("· poll (_poll_transfers)", "runner", "_poll_transfers"),
    ("update_from_output", "scheduler", "update_from_output"),
    ("· READs landed → running (_finish_remote)", "scheduler", "_finish_remote"),
    ("· prefix hashes registered (cache_full_blocks)", "kv", "cache_full_blocks"),
]
# the stages of the path: the add_request call, then its steps
STAGES = ("add_request", "posting step", "poll steps", "first-token step")
WHOLE = "whole"  # a stage's wall clock (its steps': LLMEngine.step)
REST = "(the rest)"  # of WHOLE, outside its top-level phases (`TOP`)
TOP = {"add_request": ("check (side channel)", "prefix hashes (update_hashes)")} | {
    s: ("schedule", "runner execute", "update_from_output") for s in STAGES[1:]}


@dataclasses.dataclass(frozen=True)
class PhaseRow:
    transport: str
    tokens: int
    polls: int  # poll steps after the posting step until the READs landed (that run's)
    ms: dict[tuple[str, str], float]  # (stage, phase or WHOLE) → ms (median of the repeats)


class PhaseClock:
    """Wall clock per phase: wraps the `PHASES` methods of one engine (instance attributes
    over the bound methods) and adds each call's time to its label."""

    def __init__(self, d: LLMEngine) -> None:
        self.ms: dict[str, float] = {}
        self.ended: dict[str, float] = {}  # label → when its last call returned
        runner = d.executor.runner
        owners = {"engine": d, "scheduler": d.scheduler, "kv": d.scheduler.kv,
                  "connector": d.connector, "runner": runner, "worker": runner.connector}
        for label, owner, method in PHASES:
            obj = owners[owner]
            setattr(obj, method, self._timed(label, getattr(obj, method)))

    def _timed(self, label: str, f: Callable) -> Callable:
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.ended[label] = t1 = time.perf_counter()
                self.ms[label] = self.ms.get(label, 0.0) + (t1 - t0) * 1e3
        return timed

    def take(self) -> dict[str, float]:
        """The phases' times since the last `take`, every label present."""
        out = {label: self.ms.get(label, 0.0) for label, _, _ in PHASES}
        self.ms.clear()
        return out


def _path(d: LLMEngine, p: HeldPrefill, clock: PhaseClock, rid: str, prompt: list[int],
          profiler: cProfile.Profile | None = None) -> tuple[int, dict[tuple[str, str], float]]:
    """One decode request from `add_request` to its first decoded token, by stage and phase
    → (poll steps, (stage, phase) → ms)."""
    params = p.hold(rid, prompt)
    clock.take()
    out: dict[tuple[str, str], float] = {}

    def stage(name: str, whole_ms: float) -> None:
        for label, ms in clock.take().items():
            out[(name, label)] = out.get((name, label), 0.0) + ms
        out[(name, WHOLE)] = out.get((name, WHOLE), 0.0) + whole_ms

    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    d.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                  kv_transfer_params=params)
    stage("add_request", (time.perf_counter() - t0) * 1e3)
    polls, first, landed = 0, False, None
    while not first:
        t1 = time.perf_counter()
        outs = d.step()
        ms = (time.perf_counter() - t1) * 1e3
        if landed is None and rid not in d.scheduler.receiving:
            landed = time.perf_counter()  # pd_e2e.py's "READ step" ends
        first = any(o.request_id == rid and o.new_token_ids for o in outs)
        if any(o.error is not None for o in outs):
            raise RuntimeError(next(o.error for o in outs if o.error is not None))
        if (STAGES[1], WHOLE) not in out:
            stage(STAGES[1], ms)  # posting: READs of a short prompt may land in it too
        elif first:
            stage(STAGES[3], ms)
        else:
            polls += 1
            stage(STAGES[2], ms)
    total = (time.perf_counter() - t0) * 1e3
    if profiler is not None:
        profiler.disable()
    p.drain()  # the producer frees the blocks read
    assert landed is not None
    # the host's time until the transfer starts (the running requests' forward is before the
    # posting in the step, and a GPU's kernels, not the host's time)
    out[("total", "READs posted (→ start_receives returned), less the forward")] = (
        clock.ended["· posting (start_receives)"] - t0) * 1e3 - out[(STAGES[1], "· forward")]
    out[("total", "READ step (→ the step that found them landed)")] = (landed - t0) * 1e3
    out[("total", "to the first decoded token")] = total
    forwards = sum(ms for (_, label), ms in out.items() if label == "· forward")
    out[("total", "host, less the forwards")] = total - forwards
    for name in STAGES:  # every key in every run (a short prompt's READ may need no poll)
        for label, _, _ in PHASES:
            out.setdefault((name, label), 0.0)
        whole = out.setdefault((name, WHOLE), 0.0)
        out[(name, REST)] = whole - sum(out.get((name, label), 0.0) for label in TOP[name])
    return polls, out


def measure_phases(args: argparse.Namespace, model_dir: Path, backend: str
                   ) -> tuple[list[PhaseRow], str]:
    """`--tables phases`: each prompt of `--tokens` `--repeats` times, alternating → a row per
    prompt (medians), and the profile of one more run of the longest (empty without it)."""
    g = torch.Generator().manual_seed(1)
    d, p = _decode_engine(args, model_dir, backend, g)
    clock = PhaseClock(d)
    vocab = d.config.model.vocab_size
    runs: dict[int, list[tuple[int, dict[tuple[str, str], float]]]] = {}
    text = io.StringIO()
    try:
        _path(d, p, clock, "warm", torch.randint(4, vocab, (args.block_size * 4,),
                                                 generator=g).tolist())
        for r in range(args.repeats):
            for n in args.tokens:
                prompt = torch.randint(4, vocab, (n,), generator=g).tolist()
                runs.setdefault(n, []).append(_path(d, p, clock, f"p{n}-{r}", prompt))
        if args.profile:
            prof = cProfile.Profile()
            n = max(args.tokens)
            _path(d, p, clock, f"p{n}-profiled",
                  torch.randint(4, vocab, (n,), generator=g).tolist(), prof)
            stats = pstats.Stats(prof, stream=text).sort_stats("cumulative")
            # the host's own functions (the model's and kernels' are the CPU forward's)
            stats.print_stats(r"dsaserve/(engine|kv|disagg|core)", args.top)
        _close(args, d, p)
    finally:
        d.shutdown()
        p.close()
    rows = []
    for n, got in runs.items():
        keys = got[0][1].keys()
        rows.append(PhaseRow(backend, n, got[len(got) // 2][0],
                             {k: statistics.median(o[k] for _, o in got) for k in keys}))
    return rows, text.getvalue()


def phase_table(rows: list[PhaseRow]) -> list[str]:
    """Stages and phases down, (transport, prompt) across."""
    keys = list(dict.fromkeys(k for r in rows for k in r.ms))
    order = {s: i for i, s in enumerate((*STAGES, "total"))}
    # stable: per stage its whole, then the phases in `PHASES` order, then the rest
    keys.sort(key=lambda k: (order[k[0]], (k[1] != WHOLE) + (k[1] == REST)))
    out = ["| stage | phase | " + " | ".join(f"{r.transport} {r.tokens:,} ms" for r in rows)
           + " |", "|---|---|" + "---:|" * len(rows),
           "| poll steps | count | " + " | ".join(str(r.polls) for r in rows) + " |"]
    for k in keys:
        if any(r.ms.get(k, 0.0) >= 0.05 for r in rows) or k[1] == WHOLE:
            out.append(f"| {k[0]} | {k[1]} | "
                       + " | ".join(f"{r.ms.get(k, 0.0):.1f}" for r in rows) + " |")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, shm (CI: it runs)")
    ap.add_argument("--transports", default=None,
                    help="comma-separated: shm, nixl (default: both where nixl imports)")
    ap.add_argument("--tokens", type=positive_ints, default=[32768, 131072],
                    help="the READ request's prompt tokens (comma-separated)")
    ap.add_argument("--batch", type=int, default=16, help="requests decoding meanwhile")
    ap.add_argument("--context", type=int, default=128, help="their prompts' tokens")
    ap.add_argument("--steps", type=int, default=5, help="idle steps (their median)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4,
                    help="GLM-5.3's layers kept (+ MTP; its indexer schedule): the READs' parts")
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--free-copies", dest="hold_copies", action="store_false",
                    help="shm: let the copy thread run during the posting step (default: held "
                         "until it ends, so the step's host work is timed alone)")
    ap.add_argument("--top", type=int, default=25, help="profile lines printed per row")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the decode engine schedules one step ahead (as the GPU runs measured)")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="time the posting step without cProfile (its parts then NaN)")
    ap.add_argument("--tables", default="posting",
                    help="comma-separated: posting (the posting step by part), phases "
                         "(add_request → the first decoded token, by phase)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="phases: runs per prompt, alternating (the median kept)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    if ap.parse_args(argv).smoke:
        ap.set_defaults(transports="shm", tokens=[1024], batch=2, context=16, steps=1, top=5)
    args = ap.parse_args(argv)
    args.transports = (args.transports.split(",") if args.transports
                       else ["shm"] + (["nixl"] if nixl_available() else []))
    args.tables = args.tables.split(",")
    if not set(args.tables) <= {"posting", "phases"}:
        ap.error(f"--tables: expected posting and/or phases, got {args.tables}")
    bad = [t for t in args.transports if t not in ("shm", "nixl")]
    if bad:
        ap.error(f"--transports: unknown {bad[0]!r}; expected shm or nixl")
    if "nixl" in args.transports and not nixl_available():
        ap.error("--transports nixl: nixl does not import here")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as the benchmark's decode process on a 2-core host
    rows: list[Row] = []
    phases: list[PhaseRow] = []
    profiles: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model("tiny-glm5", Path(tmp) / "tiny", with_mtp=True,
                               overrides=glm53_layers(args.layers))
        for backend in args.transports:
            if "posting" in args.tables:
                rows += measure(args, model_dir, backend)
            if "phases" in args.tables:
                got, profile = measure_phases(args, model_dir, backend)
                phases += got
                if profile:
                    profiles.append(f"\n## {backend}, {max(args.tokens):,} tokens: "
                                    f"add_request → first token, host functions\n{profile}")
    for r in rows:
        print(f"\n## {r.transport}, {r.tokens:,} tokens: the posting step's profile\n{r.profile}")
    print("".join(profiles))
    text = ""
    if rows:
        text += "\n".join(table(rows)) + "\n"
    if phases:
        text += ("\n" if rows else "") + "\n".join(phase_table(phases)) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0

if __name__ == "__main__":
    sys.exit(main())
