"""P/D: the decode step of the requests already running while another request's KV READ is in
flight, against the same step with no READ (what the asynchronous READs are for).

    python benchmarks/pd_overlap.py                    # H200: GLM-5.3-shaped, fp8_ds_mla, NIXL
    python benchmarks/pd_overlap.py --out docs/pd_overlap_h200.md
    python benchmarks/pd_overlap.py --smoke            # CPU, tiny sizes, shared memory (CI)

The prefill engine runs in a spawned process (`disagg/prefill_process.py`), the decode engine in
this one, one transport agent each, as deployed: within one process UCX has no cuda_ipc between
two agents and emulates a GPU READ in software (~0.6 GB/s), which would be measured instead of
the READ. The two processes take half the cores each. B requests decode on the decode engine
(prompts of `--context` tokens, prefilled there). Per row:

  1. idle: `--steps` decode steps of the B requests, no READ anywhere (host clock around
     `LLMEngine.step`, the engine's stream synchronized, not the device: `_sync`);
  2. in flight: the prefill engine prefills `--inflight` prompts of N tokens and holds their
     blocks (the decode engine does not step meanwhile; the prefill engine keeps stepping while
     it holds them, as a prefill server does, polling for the READs' notifications); then they
     are added to the decode engine at once and it steps: the first step posts their READs
     (timed apart: "post"), every following step that starts with a READ still in flight is an
     in-flight step, until the last request leaves `receiving` (every READ landed). The B
     requests must decode one token in every one of those steps (checked), the received ones
     are then dropped.

Columns: the idle and in-flight step times (median, P90), their ratio (1.00 = a READ in flight
costs the running requests nothing), how many steps the READs spanned, the posting step, and
the READs' time (from the posting step's start to the end of the step whose poll found the last
one landed: quantised to steps) with their GB/s over the bytes READ.

Where the READ lands (`--into`): "pages", the decode engine's KV pages (GPU memory with NIXL on a
GPU: VRAM → VRAM; host memory on the CPU); "host-pool", a spilling HiSparse decode engine
(docs/hisparse.md): a long prompt's MLA rows below its write tail go straight into the pinned
host pool (VRAM → DRAM over NIXL on a GPU), its indexer keys and tail into GPU pages.
Shared memory moves only host memory: on a GPU only NIXL runs (`--transports nixl`).

`--profile-post DIR` profiles each measured row's posting step, not the warm-up's (what holds a
READ inside it): its host functions (cProfile, printed) and a torch-profiler trace of its CPU and
GPU activity, the READ's copies included (DIR/post_B<b>_<tokens>x<inflight>.json, for
chrome://tracing or Perfetto). The profilers' overhead is in that row's "post step ms".
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsaserve.bench.argtypes import positive_ints
from dsaserve.bench.profile import cprofile_top
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    HiSparseConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.disagg.prefill_process import PrefillProcess
from dsaserve.disagg.transport import nixl_available
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.executor import cpu_threads_per_worker
from dsaserve.engine.runner import resolve_dtype
from dsaserve.kernels import formats
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped

INTO = ("pages", "host-pool")


@dataclasses.dataclass(frozen=True)
class Row:
    transport: str
    into: str
    batch: int
    tokens: int  # each READ request's prompt
    inflight: int  # requests READ at once
    idle_ms: list[float]  # the B requests' step times, no READ
    busy_ms: list[float]  # the same while a READ is in flight
    post_ms: float  # the step that posted the READs
    read_ms: float  # posting step's start → the step that found the last READ landed
    nbytes: int  # READ by the decode engine

    @property
    def gbps(self) -> float:
        return self.nbytes / (self.read_ms / 1e3) / 1e9


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (NaN for no values)."""
    if not values:
        return math.nan
    v = sorted(values)
    x = q * (len(v) - 1)
    lo = math.floor(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


def _sync(device: torch.device) -> None:
    """The engine's own stream, not the device: a device-wide synchronise also waits for the
    READs' copies, which UCX's cuda_ipc issues on its own streams in this process, so it would
    hold every step in flight until they land (as a serving engine, which never synchronises
    the device, is not held)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# ---- engines -----------------------------------------------------------------------------------
def _blocks(tokens: int, block: int) -> int:
    return -(-tokens // block)


def configs(args: argparse.Namespace, model_dir: Path, device: torch.device, transport: str,
            into: str) -> tuple[EngineConfig, EngineConfig]:
    """(producer, consumer): room for B decoders of `context + decode_budget` tokens and the
    most READ requests at once on the consumer, for those on the producer."""
    model = ModelConfig.from_file(model_dir)
    max_len = max(max(args.tokens), args.context + args.decode_budget) + args.block_size
    held = max(args.inflight) * _blocks(max_len, args.block_size)
    decoders = max(args.batch) * _blocks(args.context + args.decode_budget, args.block_size)
    base = EngineConfig(
        model_path=str(model_dir), model=model,
        cache=CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                          num_gpu_blocks=held + 4),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch) + max(args.inflight),
                                  max_num_batched_tokens=args.chunk, max_model_len=max_len),
        attention=AttentionConfig(backend=args.backend, sparse_mla_force_mqa=True),
        dtype=args.dtype, device=str(device))

    def role(cfg: EngineConfig, r: str) -> EngineConfig:
        return dataclasses.replace(cfg, disagg=DisaggConfig(kv_role=r, backend=transport,
                                                            side_channel_port=0))

    num_blocks = held + decoders + 4
    consumer = dataclasses.replace(base, cache=dataclasses.replace(base.cache,
                                                                   num_gpu_blocks=num_blocks))
    if into == "host-pool":
        # Every block keeps a GPU MLA page (no spill pressure on the decoders): only the READ
        # prompts' rows below their write tail start spilled, and land in the host pool. The
        # pool admits a request only with room for a whole max_model_len window of its MLA rows
        # (fp8_ds_mla's 656 bytes or L + R wide, every layer and the MTP layer's): one window
        # per request that may run at once.
        width = model.kv_lora_rank + model.qk_rope_head_dim
        row = (formats.mla_row_bytes(model.kv_lora_rank, model.qk_rope_head_dim)
               if args.kv_cache_dtype == "fp8_ds_mla"
               else width * resolve_dtype(args.dtype, model).itemsize)
        layers = model.num_hidden_layers + model.num_nextn_predict_layers
        att = dataclasses.replace(consumer.attention, hisparse_device_mla_pages=num_blocks,
                                  hisparse_config_given=True)
        windows = max(args.batch) + max(args.inflight)
        pool = windows * _blocks(max_len, args.block_size) * args.block_size * layers * row
        consumer = dataclasses.replace(consumer, attention=att,
                                       hisparse=HiSparseConfig(host_pool_bytes=pool))
    return role(base, "kv_producer"), role(consumer, "kv_consumer")


# ---- measurement -------------------------------------------------------------------------------
class Overlap:
    """A producer (in its own process) and a consumer (here) with B requests decoding on the
    consumer."""

    def __init__(self, p: PrefillProcess, d: LLMEngine, device: torch.device, seed: int,
                 profile_post: Path | None = None) -> None:
        self.p, self.d, self.device = p, d, device
        self.profile_post = profile_post  # the posting steps' traces go here (None: no profile)
        self.g = torch.Generator().manual_seed(seed)
        self.vocab = d.config.model.vocab_size
        self.decoders: list[str] = []
        self.num_ids = 0

    def _prompt(self, n: int) -> list[int]:
        return torch.randint(4, self.vocab, (n,), generator=self.g).tolist()

    def _id(self, tag: str) -> str:
        self.num_ids += 1
        return f"{tag}{self.num_ids}"

    def start_decoders(self, batch: int, context: int, budget: int) -> None:
        """Drop the current decoders; start `batch` new ones and step until each decoded."""
        for rid in self.decoders:
            self.d.abort_request(rid)
        self.decoders = [self._id("dec") for _ in range(batch)]
        params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        for rid in self.decoders:
            self.d.add_request(rid, self._prompt(context), params)
        started: set[str] = set()
        while len(started) < batch:
            started |= {o.request_id for o in self.d.step() if o.new_token_ids}

    def step(self) -> tuple[float, list[str]]:
        """One timed decode-engine step → (ms, the requests that got a token)."""
        _sync(self.device)
        t0 = time.perf_counter()
        outs = self.d.step()
        _sync(self.device)
        ms = (time.perf_counter() - t0) * 1e3
        for o in outs:
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id}: {o.error}")
        return ms, [o.request_id for o in outs if o.new_token_ids]

    def _posting_step(self, name: str | None) -> tuple[float, list[str]]:
        """The step that posts every READ, under both profilers with --profile-post (`name`:
        its trace's; None: not profiled)."""
        if self.profile_post is None or name is None:
            return self.step()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        host = cProfile.Profile()
        with torch.profiler.profile(activities=activities) as trace:
            host.enable()
            out = self.step()
            host.disable()
            if self.device.type == "cuda":  # the READ's copies too: they are on UCX's streams
                torch.cuda.synchronize()
        self.profile_post.mkdir(parents=True, exist_ok=True)
        trace.export_chrome_trace(str(self.profile_post / f"post_{name}.json"))
        print(f"posting step {name}: {out[0]:.2f} ms under the profilers; its host functions:\n"
              + cprofile_top(host, 25, focus=r"connector|transport"), file=sys.stderr)
        return out

    def _decoded_all(self, got: list[str], what: str) -> None:
        missing = set(self.decoders) - set(got)
        if missing:
            raise RuntimeError(f"{what}: {len(missing)} of the {len(self.decoders)} running "
                               "requests decoded no token (finished? raise --decode-budget)")

    def measure(self, transport: str, into: str, tokens: int, inflight: int, steps: int,
                profile: bool = True) -> Row:
        idle = []
        for _ in range(steps):
            ms, got = self.step()
            self._decoded_all(got, "idle step")
            idle.append(ms)
        reads = [self._id(f"read{tokens}-") for _ in range(inflight)]
        prompts = {rid: self._prompt(tokens) for rid in reads}
        params = {rid: self.p.prefill(rid, prompts[rid]) for rid in reads}
        before = sum(self.d.executor.call("kv_bytes_received"))
        once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for rid in reads:  # checked over the side channel here, before the clock starts
            self.d.add_request(rid, prompts[rid], once, kv_transfer_params=params[rid])
        receiving = self.d.scheduler.receiving
        post_ms, got = self._posting_step(
            f"B{len(self.decoders)}_{tokens}x{inflight}" if profile else None)
        self._decoded_all(got, "posting step")
        read_ms, busy = post_ms, []
        while any(rid in receiving for rid in reads):
            ms, got = self.step()
            self._decoded_all(got, "step with a READ in flight")
            busy.append(ms)
            read_ms += ms
        nbytes = sum(self.d.executor.call("kv_bytes_received")) - before
        while any(rid in self.d.scheduler.requests for rid in reads):  # their first token
            self.step()
        self.p.drain(tick=self.d.step)  # the producer learnt they were read and freed them
        self.d.check_integrity()
        return Row(transport, into, len(self.decoders), tokens, inflight, idle, busy, post_ms,
                   read_ms, nbytes)


def run_pair(args: argparse.Namespace, model_dir: Path, device: torch.device, transport: str,
             into: str) -> list[Row]:
    pc, dc = configs(args, model_dir, device, transport, into)
    threads = torch.get_num_threads()
    # the prefill process takes as many threads: oversubscribed, torch's spin-waiting threads
    # slow both engines' host work many times over (docs/disagg.md)
    torch.set_num_threads(cpu_threads_per_worker(2))
    try:
        with PrefillProcess(pc) as p:
            d = LLMEngine.from_config(dc)
            assert isinstance(d, LLMEngine)
            try:
                return _measure_all(args, p, d, device, transport, into)
            finally:
                d.shutdown()
    finally:
        torch.set_num_threads(threads)


def _measure_all(args: argparse.Namespace, p: PrefillProcess, d: LLMEngine,
                 device: torch.device, transport: str, into: str) -> list[Row]:
    """Every row of one (transport, into) pair; then nothing left held on either side."""
    rows: list[Row] = []
    bench = Overlap(p, d, device, seed=0, profile_post=args.profile_post)
    for batch in args.batch:
        bench.start_decoders(batch, args.context, args.decode_budget)
        # warm-up (not reported): the first READ connects the agents and builds handles
        bench.measure(transport, into, 4 * args.block_size, 1, args.warmup, profile=False)
        for tokens in args.tokens:
            for inflight in args.inflight:
                row = bench.measure(transport, into, tokens, inflight, args.steps)
                print(row_line(row), file=sys.stderr)
                rows.append(row)
    for rid in bench.decoders:
        d.abort_request(rid)
    d.step()  # tells the runner which requests ended
    d.check_integrity()  # with no request live: every block free
    p.drain(tick=d.step)  # the same there
    return rows


# ---- the table ---------------------------------------------------------------------------------
HEADER = ["| transport | READ into | B | prompt READ | at once | idle step ms (median / P90) | "
          "in flight ms (median / P90) | ratio (median / P90) | steps in flight | post step ms "
          "| READ ms | MiB READ | GB/s |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def row_line(r: Row) -> str:
    i50, i90 = quantile(r.idle_ms, 0.5), quantile(r.idle_ms, 0.9)
    b50, b90 = quantile(r.busy_ms, 0.5), quantile(r.busy_ms, 0.9)
    ratio = f"{b50 / i50:.2f} / {b90 / i90:.2f}" if r.busy_ms else "— (landed in the post step)"
    busy = f"{b50:.2f} / {b90:.2f}" if r.busy_ms else "—"
    return (f"| {r.transport} | {r.into} | {r.batch} | {r.tokens:,} | {r.inflight} | "
            f"{i50:.2f} / {i90:.2f} | {busy} | {ratio} | {len(r.busy_ms)} | {r.post_ms:.2f} | "
            f"{r.read_ms:.1f} | {r.nbytes / 2**20:.1f} | {r.gbps:.2f} |")


def table(rows: list[Row], title: str) -> list[str]:
    return [title, "", *HEADER, *map(row_line, rows)]


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = text.split(",")
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad[0]!r}; expected some of {allowed}")
        return values
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny model and sizes, shared memory (CI: the script runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--transports", type=_names(("nixl", "shm")), default=None,
                    help="comma-separated (default: nixl on a GPU; shm and nixl where it "
                         "imports on the CPU)")
    ap.add_argument("--into", type=_names(INTO), default=list(INTO),
                    help="where the READ lands: the KV pages, or a spilling HiSparse decode "
                         "engine's host pool (comma-separated)")
    ap.add_argument("--batch", type=positive_ints, default=[16, 64],
                    help="requests decoding while the READs run (comma-separated)")
    ap.add_argument("--context", type=int, default=4096, help="their prompts' tokens")
    ap.add_argument("--tokens", type=positive_ints, default=[32768, 131072],
                    help="each READ request's prompt tokens (comma-separated)")
    ap.add_argument("--inflight", type=positive_ints, default=[1, 4],
                    help="requests whose READs run at once (comma-separated)")
    ap.add_argument("--steps", type=int, default=30, help="idle steps timed per row")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--decode-budget", type=int, default=4096,
                    help="tokens each running request may decode over the whole run")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16384, help="--max-num-batched-tokens")
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    ap.add_argument("--backend", default=None, choices=("reference", "triton"),
                    help="attention backend (default: triton on a GPU, reference on the CPU)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    ap.add_argument("--profile-post", type=Path, default=None, metavar="DIR",
                    help="profile each row's posting step (host functions printed, traces "
                         "written to DIR)")
    if ap.parse_args(argv).smoke:  # the smoke's sizes as defaults: flags given still win
        ap.set_defaults(device="cpu", batch=[2], context=24, tokens=[2048], inflight=[2],
                        steps=3, warmup=1, decode_budget=64, block_size=16, chunk=256,
                        dtype="auto", kv_cache_dtype="auto", transports=["shm"])
    args = ap.parse_args(argv)
    on_gpu = args.device == "cuda"
    args.backend = args.backend or ("triton" if on_gpu else "reference")
    if args.transports is None:
        args.transports = ["nixl"] if on_gpu else ["shm"] + (["nixl"] if nixl_available()
                                                               else [])
    if on_gpu and "shm" in args.transports:
        ap.error("--transports shm: shared memory moves only host memory, not GPU caches "
                 "(use nixl on a GPU)")
    if "nixl" in args.transports and not nixl_available():
        ap.error("--transports nixl: nixl does not import here")
    if min(args.steps, args.context, args.decode_budget) < 1:
        ap.error("--steps, --context and --decode-budget must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            model_dir, shape = make_model("tiny-glm5", Path(tmp) / "tiny"), "tiny-glm5"
        else:
            model_dir = make_model("glm-5.3", Path(tmp) / "glm53", with_mtp=True,
                                   overrides=glm53_shaped(args.layers, mtp=True))
            shape = f"GLM-5.3-shaped, {args.layers} layers + MTP"
        for transport in args.transports:
            for into in args.into:
                rows += run_pair(args, model_dir, device, transport, into)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = table(rows, f"P/D READs in flight vs the running requests' decode step: {shape}, "
                        f"{args.kv_cache_dtype} KV, block {args.block_size}, context "
                        f"{args.context}, {name}; {args.steps} idle steps per row")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
