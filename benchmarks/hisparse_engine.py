"""HiSparse at the engine level (docs/hisparse.md, "On the H200"): decode step time against the
all-GPU engine, concurrency at a fixed HBM budget, and one long request.

    python benchmarks/hisparse_engine.py --out docs/hisparse_engine_h200.md   # one H200
    python benchmarks/hisparse_engine.py --sections long --long 1M            # one table
    python benchmarks/hisparse_engine.py --sections long,long_pd              # 1M, and via P/D
    python benchmarks/hisparse_engine.py --smoke                              # CPU, tiny (CI)

A GLM-5.3-shaped checkpoint (64 heads, 576/512 latent, 32 × 128 indexer, top-2048; 2 layers,
8 experts, no MTP) runs through `LLMEngine` (fp8_ds_mla, the triton backend, CUDA graphs on as
the engine defaults). Every request is a real prompt prefilled by the engine, so the indexer's
selections and the misses between consecutive steps are the model's own. Three tables:

  1. step time: per context C and batch b, b requests of C tokens decode together; the median
     wall time of a decode step (every request decoding, the step synchronised) of the all-GPU
     engine and of the HiSparse engine, their ratio, and the HiSparse runtime's rows missed per
     step (every layer). The HiSparse engine has `device_mla_pages` = `mla_pages_for` its
     largest batch: one window for a prefill and each decoder's write tail, so the older pages
     of every long decoder spill (a lone request has nothing to spill against) and every
     request of a context beyond `device_buffer_size` decodes through its hot buffer. Target:
     ratio ≤ 1.15. The greedy tokens of the two engines are compared (the smoke asserts them);
  2. concurrency at a fixed KV budget of HBM bytes: requests of context L (`--max-model-len` L)
     submitted in excess; the most decoding at once (every prompt token computed, before the
     first finishes) in the all-GPU engine, whose blocks take the whole budget, and in the
     HiSparse engine with a host pool, whose MLA pages and blocks are what
     `device_mla_pages: "auto"` picks from that budget (`size_mla_pages`). Beside each, what
     `dsaserve plan`'s functions predict (plan/costmodel.hisparse_concurrency: `by_hbm_full`,
     and the sizing's concurrency, which is `hisparse_admission` bounded by the budget): the
     two must be equal. Target: HiSparse ≥ 4× all-GPU;
  3. one request of `--long` tokens (1M on CUDA) with HiSparse: prefill time, decode step
     time, peak GPU memory, the host pool it reserves and the GPU KV pool beside its KV;
  4. (`long_pd`) the same request through P/D, as the reference deployment serves it: an
     all-GPU prefill engine (`kv_producer`, in a process of its own) prefills it, a HiSparse
     decode engine
     (`kv_consumer`, NIXL on CUDA, shared memory on the CPU) with the fewest MLA pages it
     takes (a hot buffer's prompt beside one write tail: far below the request's window)
     READs its rows into the host pool and decodes it: the READ up to the first decoded
     token, the decode step, the decode engine's GPU KV pool against the request's KV, and
     whether its greedy tokens equal section 3's (when both ran).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import math
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsaserve.bench.profile import cprofile_top
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    DisaggConfig,
    EngineConfig,
    HiSparseConfig,
    ModelConfig,
    SchedulerConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.disagg.prefill_process import PrefillProcess
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.executor import cpu_threads_per_worker
from dsaserve.engine.runner import cache_page_bytes, resolve_dtype
from dsaserve.kv.hisparse.admission import (
    min_mla_pages,
    mla_pages_for,
    pd_decode_prefill_tokens,
    write_tail_pages,
)
from dsaserve.model.make_model import make_model
from dsaserve.model.presets import glm53_shaped
from dsaserve.plan import costmodel as cm

SECTIONS = ("step", "concurrency", "long", "long_pd")


def parse_tokens(text: str, flag: str) -> int:
    """"4096", "8K", "1M" → tokens (K = 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{flag}: {text!r} is not a token count (8K, 1M)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()]


def human(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else \
        f"{n >> 10}K" if n >= 1024 and n % 1024 == 0 else str(n)


# ---- sizes ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Pages:
    """Bytes of one page of B tokens over every cache layer, as the runner allocates them."""

    block_size: int
    mla: int  # MLA rows (what the host pool mirrors)
    index: int  # indexer keys (always on the GPU)

    @property
    def mla_per_token(self) -> int:
        return self.mla // self.block_size

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def host_pool_for(self, requests: int, window: int) -> int:
        """Host pool bytes that admit exactly `requests` windows of `window` tokens."""
        return requests * self.blocks(window) * self.mla


def pages_of(model: ModelConfig, args: argparse.Namespace) -> Pages:
    # no MTP (no --speculative-config): the decoder layers own the caches
    mla, index = cache_page_bytes(model, model.num_hidden_layers, args.block_size,
                                  args.kv_cache_dtype == "fp8_ds_mla",
                                  resolve_dtype(args.dtype, model))
    return Pages(args.block_size, mla, index)


def engine_config(args: argparse.Namespace, model_dir: Path, *, max_len: int, max_seqs: int,
                  num_blocks: int, host_pool: int | None = None,
                  mla_pages: int | None = None) -> EngineConfig:
    """The all-GPU engine (host_pool None) or the HiSparse one (`--kv-transfer-config`
    HiSparseConnector with host_pool bytes; `hisparse_config.device_mla_pages` = mla_pages,
    None: one per block, no spilling)."""
    cfg = EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                          num_gpu_blocks=num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_model_len=max_len,
                                  max_num_batched_tokens=args.max_num_batched_tokens),
        attention=AttentionConfig(backend=args.attention_backend, sparse_mla_force_mqa=True),
        dtype=args.dtype, device=args.device,
        compilation=CompilationConfig(enforce_eager=args.enforce_eager),
    )
    if host_pool is None:
        return cfg
    att = dataclasses.replace(cfg.attention, hisparse_device_buffer_size=args.buffer,
                              hisparse_device_mla_pages=mla_pages or None,
                              hisparse_config_given=True)
    return dataclasses.replace(cfg, attention=att,
                               hisparse=HiSparseConfig(host_pool_bytes=host_pool))


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _decoding(engine: LLMEngine, ids: set[str]) -> int:
    """Requests of `ids` running with every prompt token computed."""
    return sum(r.request_id in ids and r.num_computed_tokens >= len(r.prompt_token_ids)
               for r in engine.scheduler.running)


def _rows_missed(engine: LLMEngine) -> int:
    rt = engine.runner.hisparse
    return 0 if rt is None else int(rt.rows_missed)  # a device counter: read after the steps


def _release(engine: LLMEngine, device: str) -> None:
    engine.shutdown()
    gc.collect()  # the engine's caches and host pool go before the next one is built
    if device == "cuda":
        torch.cuda.empty_cache()


def _spills(engine: LLMEngine) -> int:
    mla = engine.scheduler.mla
    return 0 if mla is None else mla.num_spills


def _timed_steps(engine: LLMEngine, step: Callable[[], object], args: argparse.Namespace
                 ) -> tuple[list[float], float]:
    """`args.warmup` steps, then `args.steps` timed ones, each synchronised → (seconds per timed
    step, HiSparse rows missed per timed step)."""
    for _ in range(args.warmup):
        step()
    missed, times = _rows_missed(engine), []
    for _ in range(args.steps):
        _sync(args.device)
        t0 = time.perf_counter()
        step()
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    return times, (_rows_missed(engine) - missed) / args.steps


def _end(engine: LLMEngine, ids: list[str], check: bool) -> None:
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # tells the runner which requests ended
    if check:
        engine.check_integrity()


TIES_TOP = 5  # --ties: the most likely tokens kept per step, to find where engines part

# ---- 1. step time -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Steps:
    wall_ms: float  # median decode step
    missed_per_step: float  # HiSparse rows missed per step, every layer (0: all-GPU)
    spills: int  # MLA blocks spilled while this batch ran (HiSparse with pages)
    tokens: list[list[int]]  # greedy tokens per request
    # per request, per token: the TIES_TOP most likely (token, log-probability) (--ties), else []
    top: list[list[tuple[tuple[int, float], ...]]] = dataclasses.field(default_factory=list)
    # per step, the batch's (request index, tokens computed), in batch order (--ties): two
    # engines give equal tokens for sure only from equal batches (a GEMM's rounding follows
    # its shape)
    batches: list[tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=list)


def decode_steps(engine: LLMEngine, batch: list[list[int]], args: argparse.Namespace,
                 max_tokens: int, tag: str) -> Steps:
    """Prefill `batch` (decoders emit tokens meanwhile), then time decode-only steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=TIES_TOP if args.ties else None)
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    top: dict[str, list[tuple[tuple[int, float], ...]]] = {rid: [] for rid in ids}
    spills = _spills(engine)
    index = {rid: i for i, rid in enumerate(ids)}
    batches: list[tuple[tuple[int, int], ...]] = []
    schedule = engine.scheduler.schedule

    def recorded():
        so = schedule()
        batches.append(tuple((index[r], n) for r, n in so.num_scheduled_tokens.items()
                             if r in index))
        return so

    if args.ties:
        engine.scheduler.schedule = recorded  # this engine's own, for its life here

    def step() -> None:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            top[o.request_id] += [e.top[:TIES_TOP] for e in o.logprobs or ()]
        if args.smoke:
            engine.check_integrity()

    # One prompt at a time, each added once the one before has prefilled: no step holds two
    # prompts' chunks, so both engines run the same batches. (Added at once, a spilling
    # engine admitted a prompt a step later than the all-GPU one where the step's leftover
    # budget would start it: other GEMM shapes from then on, other roundings, and greedy
    # tokens that part for no fault of either engine.)
    for i, (rid, p) in enumerate(zip(ids, batch, strict=True)):
        engine.add_request(rid, p, params)
        while _decoding(engine, set(ids[:i + 1])) < i + 1:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"{tag}: request {i} of {len(ids)} never decoded beside "
                                   "the others (admitted fewer at once?)")
            step()
    times, missed = _timed_steps(engine, step, args)
    spills = _spills(engine) - spills
    if _decoding(engine, set(ids)) < len(ids):
        raise RuntimeError(f"{tag}: a request stopped decoding while timed (max_tokens)")
    _end(engine, ids, args.smoke)
    if args.ties:
        del engine.scheduler.schedule
    return Steps(1e3 * statistics.median(times), missed, spills, [out[r] for r in ids],
                 [top[r] for r in ids] if args.ties else [], [b for b in batches if b])


@dataclasses.dataclass(frozen=True)
class StepRow:
    context: int
    batch: int
    all_gpu: Steps
    hisparse: Steps

    @property
    def ratio(self) -> float:
        return self.hisparse.wall_ms / self.all_gpu.wall_ms

    @property
    def tokens_equal(self) -> bool:
        """Greedy tokens equal over what both emitted (they may run a step or two apart)."""
        return all(a[:len(b)] == b[:len(a)] and min(len(a), len(b)) > 0
                   for a, b in zip(self.all_gpu.tokens, self.hisparse.tokens, strict=True))

    def parting_gaps(self) -> list[float]:
        """--ties: for each request whose greedy tokens part, the all-GPU engine's log-
        probability gap (nats) between its token and HiSparse's at the first parting (inf
        where HiSparse's is not among its TIES_TOP most likely): a near-tie, or a real
        difference."""
        gaps = []
        for a, b, top in zip(self.all_gpu.tokens, self.hisparse.tokens, self.all_gpu.top,
                             strict=True):
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False))
                      if x != y), None)
            if i is None:
                continue
            lp = dict(top[i])
            gaps.append(lp[a[i]] - lp[b[i]] if b[i] in lp else math.inf)
        return gaps

    def equal_note(self) -> str:
        """The table's exactness cell (with --ties: where the requests part, and whether
        the two engines ran the same batches)."""
        if not self.all_gpu.top:
            return "yes" if self.tokens_equal else "NO"
        same = self.all_gpu.batches == self.hisparse.batches
        batches = f"batches {'equal' if same else 'differ'}"
        if self.tokens_equal:
            return f"yes; {batches}"
        gaps = self.parting_gaps()
        return (f"{len(gaps)} of {self.batch} part, widest all-GPU gap at the parting "
                f"{max(gaps):.3g} nats; {batches}")


def step_section(args: argparse.Namespace, model_dir: Path, pages: Pages) -> list[StepRow]:
    model = ModelConfig.from_file(model_dir)
    n = max(args.batches)
    rows = []
    for context in args.contexts:
        # decoders emit a token per step while the later prompts prefill, then are timed
        chunks = -(-context // args.max_num_batched_tokens)
        max_tokens = n * chunks + args.warmup + args.steps + 4
        max_len = context + max_tokens
        blocks = n * pages.blocks(max_len) + 1
        tail = write_tail_pages(0, args.block_size)
        kinds = {
            "all-GPU": engine_config(args, model_dir, max_len=max_len, max_seqs=n,
                                     num_blocks=blocks),
            "HiSparse": engine_config(
                args, model_dir, max_len=max_len, max_seqs=n, num_blocks=blocks,
                host_pool=pages.host_pool_for(n, max_len),
                mla_pages=mla_pages_for(n, max_len, args.block_size, tail)),
        }
        batches = [prompts(model.vocab_size, b, context, seed=context + b) for b in args.batches]
        got: dict[str, list[Steps]] = {}
        for kind, cfg in kinds.items():
            engine = LLMEngine.from_config(cfg)
            try:
                if kind == "HiSparse" and context <= engine.config.hisparse_buffer_rows:
                    print(f"note: context {context} is within the hot buffer "
                          f"({engine.config.hisparse_buffer_rows} rows): the fast path",
                          file=sys.stderr)
                got[kind] = [decode_steps(engine, batch, args, max_tokens, f"{kind}-{i}")
                             for i, batch in enumerate(batches)]
            finally:
                _release(engine, args.device)
                del engine
        for b, a, h in zip(args.batches, got["all-GPU"], got["HiSparse"], strict=True):
            rows.append(StepRow(context, b, a, h))
            print(f"step: C={human(context)} b={b}: all-GPU {a.wall_ms:.2f} / HiSparse "
                  f"{h.wall_ms:.2f} ms, {h.missed_per_step:,.0f} rows missed per step, "
                  f"{h.spills} blocks spilled", file=sys.stderr)
    return rows


# ---- 2. concurrency at a fixed KV budget --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ConcurrencyRow:
    context: int
    kv_budget: int
    host_pool: int
    all_gpu: int  # most requests decoding at once, measured
    all_gpu_plan: int
    hisparse: int
    hisparse_plan: int
    by_host: int  # the plan's bound by host memory (hisparse_admission)
    mla_pages: int  # what "auto" picks for the budget (0: no spilling)
    num_blocks: int
    preemptions: tuple[int, int]  # (all-GPU, HiSparse)


def most_decoding(engine: LLMEngine, batch: list[list[int]], args: argparse.Namespace,
                  max_tokens: int) -> int:
    """Submit every prompt; step until the first request finishes, or until none waits and all
    decode → the most requests decoding at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"c{i}" for i in range(len(batch))]
    for rid, p in zip(ids, batch, strict=True):
        engine.add_request(rid, p, params)
    most = 0
    while engine.has_unfinished_requests():
        finished = any(o.finished for o in engine.step())
        if args.smoke:
            engine.check_integrity()
        now = _decoding(engine, set(ids))
        most = max(most, now)
        if finished or (not engine.scheduler.waiting and now == len(engine.scheduler.running)):
            break
    _end(engine, ids, args.smoke)
    return most


def concurrency_section(args: argparse.Namespace, model_dir: Path, pages: Pages
                        ) -> ConcurrencyRow:
    model = ModelConfig.from_file(model_dir)
    ctx, budget, host = args.concurrency_context, args.kv_budget, args.host_pool
    plan_kv = cm.kv_bytes_per_token(
        model, "fp8_ds_mla" if args.kv_cache_dtype == "fp8_ds_mla" else "bf16")
    probe = engine_config(args, model_dir, max_len=ctx, max_seqs=1, num_blocks=1, host_pool=host)
    plan = cm.hisparse_concurrency(plan_kv, ctx, kv_room=budget, host_pool_bytes=host,
                                   hot_rows=probe.hisparse_buffer_rows,
                                   block_size=args.block_size)
    sizing = plan.mla_sizing
    if sizing is None:
        raise SystemExit("--kv-budget-gib / --host-pool-gib: not one request of "
                         f"--concurrency-context {ctx} fits")
    # Decoders must outlast the prefills of the most requests either engine holds, with their
    # prompt plus outputs inside the window, in whole blocks the all-GPU prediction counts.
    most = max(sizing.concurrency, plan.by_hbm_full) + 1
    max_tokens = most * -(-ctx // args.max_num_batched_tokens) + 4
    prompt_len = ctx - max_tokens
    if prompt_len < 1:
        raise SystemExit(f"--concurrency-context {ctx}: too short for {most} requests' "
                         f"prefills at --max-num-batched-tokens {args.max_num_batched_tokens}")
    batch = prompts(model.vocab_size, most + 2, prompt_len, seed=7)
    cfgs = {
        "all-GPU": engine_config(args, model_dir, max_len=ctx, max_seqs=len(batch),
                                 num_blocks=budget // (pages.mla + pages.index)),
        "HiSparse": engine_config(args, model_dir, max_len=ctx, max_seqs=len(batch),
                                  num_blocks=sizing.num_blocks, host_pool=host,
                                  mla_pages=sizing.num_mla_pages),
    }
    got, preempted = {}, {}
    for kind, cfg in cfgs.items():
        engine = LLMEngine.from_config(cfg)
        try:
            got[kind] = most_decoding(engine, batch, args, max_tokens)
            preempted[kind] = engine.scheduler.num_preemptions
        finally:
            _release(engine, args.device)
            del engine
    row = ConcurrencyRow(ctx, budget, host, got["all-GPU"], plan.by_hbm_full, got["HiSparse"],
                         sizing.concurrency, plan.by_host, sizing.num_mla_pages,
                         sizing.num_blocks, (preempted["all-GPU"], preempted["HiSparse"]))
    print(f"concurrency: {row}", file=sys.stderr)
    return row


# ---- 3. one long request ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LongRow:
    tokens: int
    prefill_s: float
    step_ms: float  # median decode step
    missed_per_step: float
    peak_bytes: int | None  # GPU (None on the CPU)
    host_reserved: int  # host pool bytes the request's window holds
    gpu_kv: int  # the GPU KV pool: MLA pages and indexer pages
    kv: int  # the request's KV at full length: MLA rows and indexer keys
    tokens_out: list[int]


def _long_request(args: argparse.Namespace, model_dir: Path
                  ) -> tuple[ModelConfig, int, int, int]:
    """(the model, the long request's prompt tokens (`--long` within the model's positions
    and the tokens it decodes), its max_model_len, one window of its MLA pages)."""
    model = ModelConfig.from_file(model_dir)
    n = min(args.long, model.max_position_embeddings - args.steps - args.warmup - 4)
    max_len = n + args.warmup + args.steps + 4
    return model, n, max_len, min_mla_pages(max_len, args.block_size)


def long_section(args: argparse.Namespace, model_dir: Path, pages: Pages) -> LongRow:
    # one window of MLA pages (a prefill reads its GPU pages) and of indexer pages
    model, n, max_len, window = _long_request(args, model_dir)
    cfg = engine_config(args, model_dir, max_len=max_len, max_seqs=1, num_blocks=window + 1,
                        host_pool=pages.host_pool_for(1, max_len), mla_pages=window)
    engine = LLMEngine.from_config(cfg)
    try:
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        params = SamplingParams(max_tokens=args.warmup + args.steps + 2, temperature=0.0,
                                ignore_eos=True)
        engine.add_request("long", prompts(model.vocab_size, 1, n, seed=11)[0], params)
        out: list[int] = []
        _sync(args.device)
        t0 = time.perf_counter()
        while not out:  # the prefill, up to its first token
            out += [t for o in engine.step() for t in o.new_token_ids]
        _sync(args.device)
        prefill = time.perf_counter() - t0
        rt = engine.runner.hisparse
        reserved = (rt.num_host_blocks - rt.num_free_host_blocks) * pages.mla
        times, missed = _timed_steps(
            engine, lambda: out.extend(t for o in engine.step() for t in o.new_token_ids), args)
        if args.smoke:
            engine.check_integrity()
        peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
        gpu_kv = engine.runner.num_mla_pages * pages.mla + engine.runner.num_blocks * pages.index
        _end(engine, ["long"], args.smoke)
    finally:
        _release(engine, args.device)
    row = LongRow(n, prefill, 1e3 * statistics.median(times), missed, peak, reserved, gpu_kv,
                  n * (pages.mla + pages.index) // args.block_size, out)
    print(f"long: {human(n)}: prefill {prefill:.2f} s, step {row.step_ms:.2f} ms",
          file=sys.stderr)
    return row


# ---- 4. the long request through P/D, into a decode engine below one window -----------------
@dataclasses.dataclass(frozen=True)
class LongPdRow:
    tokens: int
    prefill_s: float  # the prefill engine's prefill, to its one token
    read_s: float  # the decode engine: its READs (check, post, land) to its first token
    step_ms: float  # median decode step
    missed_per_step: float
    mla_pages: int  # the decode engine's MLA pages
    window_pages: int  # what one window of the request takes
    gpu_kv: int  # the decode engine's GPU KV pool: MLA pages and indexer pages
    kv: int  # the request's KV at full length: MLA rows and indexer keys
    tokens_out: list[int]


def long_pd_section(args: argparse.Namespace, model_dir: Path, pages: Pages) -> LongPdRow:
    model, n, max_len, window = _long_request(args, model_dir)
    backend = "nixl" if args.device == "cuda" else "shm"

    def role(cfg: EngineConfig, kv_role: str) -> EngineConfig:
        return dataclasses.replace(cfg, disagg=DisaggConfig(kv_role=kv_role, backend=backend,
                                                            side_channel_port=0))

    # the fewest MLA pages a decode engine takes: a prompt of the hot buffer's rows beside one
    # write tail (Scheduler._mla_page_map)
    least = mla_pages_for(1, pd_decode_prefill_tokens(args.buffer_rows, 0), args.block_size,
                          write_tail_pages(0, args.block_size))
    # The prefill engine in a process of its own, as deployed: within one process UCX has no
    # cuda_ipc between the two agents and emulates a GET in software (~0.6 GB/s, measured),
    # while two processes READ at 13-24 GB/s (pd_e2e.py). The cores are shared: each process
    # takes half (torch's spin-waiting threads, docs/disagg.md).
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads_per_worker(2))
    consumer = None
    try:
        with PrefillProcess(role(engine_config(args, model_dir, max_len=max_len, max_seqs=1,
                                               num_blocks=window + 1), "kv_producer")) as producer:
            consumer = LLMEngine.from_config(role(engine_config(
                args, model_dir, max_len=max_len, max_seqs=1, num_blocks=window + 1,
                host_pool=pages.host_pool_for(1, max_len), mla_pages=least), "kv_consumer"))
            assert consumer.scheduler.local_prefill_tokens is not None  # below one window
            out: list[int] = []

            def step() -> None:
                for o in consumer.step():
                    if o.error is not None:
                        raise RuntimeError(f"long_pd: {o.error}")
                    out.extend(o.new_token_ids)
                if args.smoke:
                    consumer.check_integrity()

            def send(rid: str, prompt: list[int], max_tokens: int) -> float:
                """Prefill `prompt` in the prefill process, hand it to the consumer: the
                prefill's seconds (the prompt's trip through the pipe included)."""
                t0 = time.perf_counter()
                params = producer.prefill(rid, prompt)
                seconds = time.perf_counter() - t0
                consumer.add_request(rid, prompt, SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                    kv_transfer_params=params)
                return seconds

            # Warm-up: a prompt just past the hot buffer takes the same path (READ into the
            # host pool, decode through the hot buffer), so both engines' kernels are compiled
            # and the rows below time a warm deployment's.
            send("warm", prompts(model.vocab_size, 1, args.buffer_rows + 2 * args.block_size,
                                 seed=12)[0], args.warmup)
            while consumer.has_unfinished_requests():
                step()
            producer.drain(tick=consumer.step)
            out.clear()
            prompt = prompts(model.vocab_size, 1, n, seed=11)[0]  # section 3's
            prefill = send("long", prompt, args.warmup + args.steps + 2)
            _sync(args.device)
            profiler = cProfile.Profile() if args.profile else None
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            while not out:
                step()
            _sync(args.device)
            read = time.perf_counter() - t0
            if profiler is not None:
                profiler.disable()
                print("long_pd: the READ to the first token's host work (cProfile):\n"
                      + cprofile_top(profiler, 40), file=sys.stderr)
            times, missed = _timed_steps(consumer, step, args)
            gpu_kv = (consumer.runner.num_mla_pages * pages.mla
                      + consumer.runner.num_blocks * pages.index)
            _end(consumer, ["long"], args.smoke)
            producer.drain(tick=consumer.step)  # its blocks were read and freed; its invariants
    finally:
        torch.set_num_threads(threads)
        if consumer is not None:
            _release(consumer, args.device)
    row = LongPdRow(n, prefill, read, 1e3 * statistics.median(times), missed, least, window,
                    gpu_kv, n * (pages.mla + pages.index) // args.block_size, out)
    print(f"long_pd: {human(n)}: prefill {prefill:.2f} s, READ to first token {read:.2f} s, "
          f"step {row.step_ms:.2f} ms", file=sys.stderr)
    return row


# ---- report -----------------------------------------------------------------------------------
def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def report(args: argparse.Namespace, shape: str, steps: list[StepRow],
           conc: ConcurrencyRow | None, long: LongRow | None,
           long_pd: LongPdRow | None = None) -> str:
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    graphs = "eager" if args.enforce_eager or args.device != "cuda" else "CUDA graphs"
    lines = [f"{shape}, {args.kv_cache_dtype} KV, {args.dtype}, {args.attention_backend} "
             f"backend, {graphs}, blocks of {args.block_size}, hot buffer "
             f"{args.buffer_rows} rows, {human(args.max_num_batched_tokens)}-token chunks, "
             f"{where}; median of {args.steps} steps"]
    if steps:
        lines += ["", "Decode step: all-GPU against HiSparse (requests decoding through their hot "
                  "buffers; older MLA pages spilled). Target: ratio ≤ 1.15", "",
                  "| context | batch | all-GPU (ms) | HiSparse (ms) | ratio | rows missed / step "
                  "| MLA blocks spilled (batch) | greedy tokens equal |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in steps:
            lines.append(f"| {human(r.context)} | {r.batch} | {r.all_gpu.wall_ms:.3f} | "
                         f"{r.hisparse.wall_ms:.3f} | {r.ratio:.2f} | "
                         f"{r.hisparse.missed_per_step:,.0f} | {r.hisparse.spills:,} | "
                         f"{r.equal_note()} |")
    if conc is not None:
        c = conc
        ratio = c.hisparse / c.all_gpu if c.all_gpu else math.inf
        lines += ["", f"Concurrency at a fixed KV budget of {_bytes(c.kv_budget)}, requests "
                  f"of {human(c.context)} tokens, host pool {_bytes(c.host_pool)} (HiSparse: "
                  f"{c.mla_pages:,} MLA pages beside {c.num_blocks:,} blocks, what \"auto\" "
                  "picks). Target: ≥ 4×", "",
                  "| engine | decoding at once (measured) | `dsaserve plan` | equal | "
                  "preemptions |", "|---|---:|---:|---|---:|",
                  f"| all-GPU | {c.all_gpu} | {c.all_gpu_plan} | "
                  f"{'yes' if c.all_gpu == c.all_gpu_plan else 'NO'} | {c.preemptions[0]} |",
                  f"| HiSparse | {c.hisparse} | {c.hisparse_plan} (host bound {c.by_host}) | "
                  f"{'yes' if c.hisparse == c.hisparse_plan else 'NO'} | {c.preemptions[1]} |",
                  "", f"HiSparse / all-GPU: {ratio:.2f}×"]
    if long is not None:
        lo = long
        peak = _bytes(lo.peak_bytes) if lo.peak_bytes is not None else "—"
        lines += ["", f"One request of {human(lo.tokens)} tokens with HiSparse", "",
                  "| prompt | prefill (s) | decode step (ms) | rows missed / step | peak GPU "
                  "memory | host pool reserved | GPU KV pool | its KV |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {human(lo.tokens)} | {lo.prefill_s:.2f} | {lo.step_ms:.3f} | "
                  f"{lo.missed_per_step:,.0f} | {peak} | {_bytes(lo.host_reserved)} | "
                  f"{_bytes(lo.gpu_kv)} | {_bytes(lo.kv)} |"]
    if long_pd is not None:
        pd = long_pd
        equal = "—" if long is None else ("yes" if _same_tokens(long.tokens_out,
                                                                 pd.tokens_out) else "NO")
        lines += ["", f"The same request through P/D: an all-GPU prefill engine in its own "
                  f"process, a HiSparse decode engine with {pd.mla_pages:,} MLA pages (one "
                  f"window of the request: {pd.window_pages:,})", "",
                  "| prompt | prefill (s) | READ to first token (s) | decode step (ms) | "
                  "rows missed / step | decode GPU KV pool | its KV | greedy tokens = "
                  "aggregated |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|",
                  f"| {human(pd.tokens)} | {pd.prefill_s:.2f} | {pd.read_s:.2f} | "
                  f"{pd.step_ms:.3f} | {pd.missed_per_step:,.0f} | {_bytes(pd.gpu_kv)} | "
                  f"{_bytes(pd.kv)} | {equal} |"]
    return "\n".join(lines)


def _same_tokens(a: list[int], b: list[int]) -> bool:
    """Equal over what both emitted."""
    return min(len(a), len(b)) > 0 and a[:len(b)] == b[:len(a)]


# ---- main -------------------------------------------------------------------------------------
def _list(flag: str):
    def parse(text: str) -> list[int]:
        values = [parse_tokens(v, flag) for v in text.split(",")]
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag}: expected counts >= 1, got {text!r}")
        return values
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--batches", type=_list("--batches"), default=[1, 16, 64])
    p.add_argument("--contexts", type=_list("--contexts"), default=[8192, 131072])
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per row")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before the timed ones")
    p.add_argument("--ties", action="store_true",
                   help="step rows: log-probabilities too, to say whether requests whose greedy "
                        "tokens part do so at near-ties (the steps then carry their host work)")
    p.add_argument("--buffer", type=int, default=None,
                   help="hisparse_config.device_buffer_size (default: the engine's, "
                        "(query rows + 1) × top-k)")
    p.add_argument("--concurrency-context", type=lambda t: parse_tokens(t, "--concurrency-"
                   "context"), default=131072, help="L: requests' --max-model-len")
    p.add_argument("--kv-budget-gib", type=float, default=1.75,
                   help="GPU bytes for KV, both engines (default: 8 all-GPU requests of 128K)")
    p.add_argument("--host-pool-gib", type=float, default=6.0,
                   help="the HiSparse engine's host pool in the concurrency table (default: "
                        "37 windows of 128K, below the 42 the budget holds: host-bound)")
    p.add_argument("--long", type=lambda t: parse_tokens(t, "--long"), default=1 << 20,
                   help="tokens of the long request (1M; cut to the model's positions)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("auto", "fp8_ds_mla"))
    p.add_argument("--attention-backend", default="triton" if cuda else "reference")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda" if cuda else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (the engine's flag; default: graphs, as it runs)")
    p.add_argument("--model", type=Path, default=None, help="an existing checkpoint (no MTP)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny-glm5, reference backend, float32, small contexts and a few "
                        "steps, every invariant checked after every step (what CI runs)")
    p.add_argument("--profile", action="store_true",
                   help="long_pd: print the host profile (cProfile) of its READ to the first "
                        "token")
    p.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = p.parse_args(argv)
    args.preset = "GLM-5.3-shaped"
    if args.smoke:
        args.device, args.attention_backend, args.dtype = "cpu", "reference", "float32"
        args.preset, args.block_size, args.max_num_batched_tokens = "tiny-glm5", 16, 128
        smoke = {"batches": [1, 3], "contexts": [48, 160], "steps": 3, "warmup": 1,
                 "buffer": 16,  # one top-k: every decode of these contexts misses
                 "concurrency_context": 512, "long": 384}
        for name, value in smoke.items():  # the sizes not given on the command line
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
        # the budget of two all-GPU requests; a host pool of eight windows (main)
        args.kv_budget_gib = args.host_pool_gib = None
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not args.sections or set(args.sections) - set(SECTIONS):
        p.error(f"--sections: expected some of {', '.join(SECTIONS)}, got {args.sections}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps: must be >= 1 (and --warmup >= 0)")
    if args.device == "cuda" and not cuda:
        p.error("--device cuda: no GPU here (--smoke runs on the CPU)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            model_dir, shape = args.model, args.model.name
        elif args.smoke:
            model_dir = make_model("tiny-glm5", Path(tmp) / "tiny", with_mtp=False)
            shape = "tiny-glm5"
        else:
            print(f"building a GLM-5.3-shaped checkpoint ({args.layers} layers) ...",
                  file=sys.stderr)
            model_dir = make_model("glm-5.3", Path(tmp) / "glm53", with_mtp=False,
                                   overrides=glm53_shaped(args.layers))
            shape = f"GLM-5.3-shaped, {args.layers} layers"
        model = ModelConfig.from_file(model_dir)
        pages = pages_of(model, args)
        probe = engine_config(args, model_dir, max_len=64, max_seqs=1, num_blocks=1,
                              host_pool=1 << 30)
        args.buffer_rows = probe.hisparse_buffer_rows
        if args.smoke:  # two all-GPU requests of L; eight HiSparse windows of L
            window = pages.blocks(args.concurrency_context)
            args.kv_budget = 2 * window * (pages.mla + pages.index)
            args.host_pool = pages.host_pool_for(8, args.concurrency_context)
        else:
            args.kv_budget = int(args.kv_budget_gib * 2**30)
            args.host_pool = int(args.host_pool_gib * 2**30)
        if args.device == "cpu":  # one thread: a shared CPU's contention swamps tiny steps
            torch.set_num_threads(1)
        failed: list[str] = []

        def run(section: str, fn, empty):
            """A section's table, or (on the GPU) its error noted so the others still run."""
            if section not in args.sections:
                return empty
            try:
                return fn(args, model_dir, pages)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                if args.smoke:
                    raise
                failed.append(f"{section}: failed: {e}"[:300])
                print(failed[-1], file=sys.stderr)
                return empty

        try:
            steps = run("step", step_section, [])
            conc = run("concurrency", concurrency_section, None)
            long = run("long", long_section, None)
            long_pd = run("long_pd", long_pd_section, None)
        finally:
            torch.set_num_threads(threads)
    text = report(args, shape, steps, conc, long, long_pd)
    if failed:
        text += "\n\n" + "\n".join(failed)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.smoke:  # exactness is the point; the plan's concurrency is the engine's
        assert all(r.tokens_equal for r in steps), "HiSparse greedy tokens differ from all-GPU"
        assert conc is None or (conc.all_gpu, conc.hisparse) == (conc.all_gpu_plan,
                                                                 conc.hisparse_plan), conc
        # HiSparse admits only what its pages and blocks hold: nothing admitted is preempted
        assert conc is None or conc.preemptions[1] == 0, conc
        # P/D into a decode engine below one window decodes what the aggregated engine does
        assert long is None or long_pd is None or _same_tokens(long.tokens_out,
                                                                long_pd.tokens_out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
