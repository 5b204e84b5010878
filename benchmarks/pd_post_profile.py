"""P/D: where the decode engine's posting step (the step that posts a long prompt's READs into
its KV pages) spends its host time, by part, on the CPU.

    python benchmarks/pd_post_profile.py                       # 32K and 128K, shm and NIXL
    python benchmarks/pd_post_profile.py --tokens 131072 --transports nixl --top 30
    python benchmarks/pd_post_profile.py --smoke               # CI: tiny sizes, shm

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
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import tempfile
import threading
import time
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


def measure(args: argparse.Namespace, model_dir: Path, backend: str) -> list[Row]:
    d = LLMEngine.from_config(config(args, model_dir, backend))
    assert isinstance(d, LLMEngine)
    runner = d.executor.runner  # in-process: the one rank
    connector = runner.connector
    p = HeldPrefill(backend, runner.caches, args.block_size)
    counts = CountingReads(connector.transport)
    stamps = Stamps(runner, connector)
    held = HeldCopies(connector.transport) if backend == "shm" and args.hold_copies else None
    g = torch.Generator().manual_seed(0)
    vocab = d.config.model.vocab_size
    rows = []
    try:
        params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
        for i in range(args.batch):
            d.add_request(f"dec{i}", torch.randint(4, vocab, (args.context,),
                                                   generator=g).tolist(), params)
        for _ in range(3):  # their prefills, then decode steps
            _step(d)
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
        for i in range(args.batch):
            d.abort_request(f"dec{i}")
        _step(d)
        p.drain()
        d.check_integrity()
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
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    if ap.parse_args(argv).smoke:
        ap.set_defaults(transports="shm", tokens=[1024], batch=2, context=16, steps=1, top=5)
    args = ap.parse_args(argv)
    args.transports = (args.transports.split(",") if args.transports
                       else ["shm"] + (["nixl"] if nixl_available() else []))
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
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model("tiny-glm5", Path(tmp) / "tiny", with_mtp=True,
                               overrides=glm53_layers(args.layers))
        for backend in args.transports:
            rows += measure(args, model_dir, backend)
    for r in rows:
        print(f"\n## {r.transport}, {r.tokens:,} tokens: the posting step's profile\n{r.profile}")
    text = "\n".join(table(rows)) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
