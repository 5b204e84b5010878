"""The model runner: one per rank. It owns the weights, the paged caches and the per-request token
state, applies the scheduler's typed diff, runs the model on the flattened batch and samples."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dsaserve.config import ConfigError, EngineConfig, ModelConfig, physical_memory_bytes
from dsaserve.core import (
    PLACEHOLDER_TOKEN_ID,
    KVRecv,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    StepGpuTime,
    StepStats,
)
from dsaserve.disagg.connector import ConnectorWorker
from dsaserve.disagg.hostplan import HostDest
from dsaserve.disagg.receiving import ReadTimes
from dsaserve.engine import cudagraph, step_results
from dsaserve.engine.block_table import BlockTable, MirroredArray
from dsaserve.engine.decode_graph import DecodeGraphs
from dsaserve.engine.sampler import chosen_logprobs, sample_on_device, top_logprobs
from dsaserve.engine.sampling_table import SamplingTable
from dsaserve.engine.step_timer import StepTimer
from dsaserve.kernels import formats, staging
from dsaserve.kernels.metadata import AttentionMetadata, PcpMetadata, dense_allowed
from dsaserve.kernels.registry import get_backend
from dsaserve.kv import layout
from dsaserve.kv.copier import KVCopier
from dsaserve.kv.hisparse.admission import (
    HiSparseAdmission,
    check_admits_one,
    hisparse_admission,
    hot_region_rows,
    pd_decode_prefill_tokens,
    size_mla_pages,
    write_tail_pages,
)
from dsaserve.kv.hisparse.backend import HiSparseBackend
from dsaserve.kv.hisparse.runtime import HiSparseRuntime, HiSparseStep
from dsaserve.kv.host_pool import (
    HostKVPool,
    bytes_per_host_block,
    cache_regions,
    num_host_blocks,
)
from dsaserve.model.dsa import DsaForCausalLM, LayerCache, MoE
from dsaserve.model.fused import fuse_model
from dsaserve.model.loader import checkpoint_has_mtp, load_weights
from dsaserve.parallel import pcp
from dsaserve.parallel.groups import ParallelGroups
from dsaserve.parallel.lockstep import lockstep_for
from dsaserve.parallel.tp import checkpoint_narrower, first_expert, shard_model
from dsaserve.spec.mtp import DraftInputs, MtpDrafter
from dsaserve.spec.rejection import emitted_tokens, rejection_sample_on_device

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CPU_KV_BUDGET_BYTES = 2 << 30  # CPU has no "free HBM"; cap the default pool at 2 GiB


def resolve_dtype(requested: str, model: ModelConfig) -> torch.dtype:
    name = model.torch_dtype if requested == "auto" else requested
    if name not in _DTYPES:
        raise ValueError(f"--dtype: unsupported dtype {name!r}")
    return _DTYPES[name]


def cache_page_bytes(model: ModelConfig, num_layers: int, block_size: int, fp8: bool,
                     dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one physical page over every cache layer: (MLA rows, indexer keys where
    owned). HiSparse spilling sizes the two caches apart."""
    elem = torch.empty((), dtype=dtype).element_size()
    if fp8:
        mla = formats.mla_row_bytes(model.kv_lora_rank, model.qk_rope_head_dim)
        index = model.index_head_dim + 4
    else:
        mla = model.kv_cache_width * elem
        index = model.index_head_dim * elem
    n_index = sum(model.has_indexer(i) for i in range(num_layers))
    return block_size * num_layers * mla, block_size * n_index * index


def cache_bytes_per_block(model: ModelConfig, num_layers: int, block_size: int, fp8: bool,
                          dtype: torch.dtype) -> int:
    """Bytes of one physical page over every cache layer (MLA rows + indexer keys where owned)."""
    return sum(cache_page_bytes(model, num_layers, block_size, fp8, dtype))


def check_fits(flag: str, what: str, nbytes: int, device: torch.device) -> None:
    """`nbytes` more fit on `device` (a CUDA device's free memory, the machine's RAM on the CPU):
    else a ConfigError naming `flag`, where allocating them would be an out-of-memory traceback.
    On the CPU the RAM is the bound: a lower bound on what fails, never a false alarm."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        where = f"{device} has {free / 2**30:.1f} GiB free"
    else:
        free = physical_memory_bytes()
        where = f"the machine has {(free or 0) / 2**30:.1f} GiB of RAM"
    if free is not None and nbytes > free:
        raise ConfigError(f"{flag}: {what} need {nbytes / 2**30:.1f} GiB but {where}")


def _flat_ids(seqs: Sequence[Sequence[int]], counts: Sequence[int]) -> torch.Tensor:
    """The first counts[r] ids of each seqs[r], flattened → [N] int64 on the CPU: one
    conversion of the Python ints into the tensor's buffer, with no list of all N ids in
    between (a 16K-token prompt: half the time of joining the lists and converting that;
    benchmarks/prefill_prep.py)."""
    ids = itertools.chain.from_iterable(
        itertools.islice(s, n) for s, n in zip(seqs, counts, strict=True))
    return torch.from_numpy(np.fromiter(ids, dtype=np.int64, count=sum(counts)))


def _positions(starts: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Request r computes counts[r] tokens from position starts[r] → (positions [N], request
    index [N]) int64, flattened request by request. In numpy: torch's CPU repeat_interleave
    took 0.5 ms for 64 requests and 3.8 ms with MTP3's 256 rows per decode step (H100 host,
    benchmarks/decode.py --host-profile), numpy's repeat a few microseconds."""
    n = np.asarray(counts, dtype=np.int64)  # [R]
    req = np.repeat(np.arange(len(counts), dtype=np.int64), n)  # [N]
    first = np.cumsum(n) - n  # [R] each request's first row
    offset = np.asarray(starts, dtype=np.int64) - first  # [R] position of row i: offset + i
    positions = offset[req] + np.arange(len(req), dtype=np.int64)
    return torch.from_numpy(positions), torch.from_numpy(req)


@dataclass(frozen=True)
class _Batch:
    """One step's flattened batch. Rows are in the global order (request by request); under PCP
    `input_ids` and `meta` hold only this rank's rows, the model's output all of them."""

    input_ids: torch.Tensor  # [n_local] int64 on the device
    meta: AttentionMetadata
    query_start_loc: list[int]  # [R+1] global rows
    starts: list[int]  # [R] position of each request's first row
    step_tokens: list[list[int]]  # [R] the rows' tokens (known, then drafts) and the next known
    num_drafts: list[int]  # [R] drafts each request verifies this step
    samples: list[bool]  # [R] whether the step reaches the request's last known token
    continues: bool = False  # async: some rows are the last step's outputs, on the device
    # async: [N] the continuing rows' inputs taken on the device, in the global order (other
    # rows: their host values, or anything under PCP, where input_ids holds only local rows)
    device_ids: torch.Tensor | None = None
    # async with drafts: [R] how far each request's rows moved back on the device (≤ 0)
    moved: torch.Tensor | None = None


@dataclass(frozen=True)
class _LastStep:
    """--async-scheduling: what the last step left on the device for the step launched after
    it, per sampling request (row `index[request id]`): the last token it emitted, the drafts
    it proposed and how many of its verified drafts it rejected. A request that continues
    takes them as its inputs and moves its rows back by the rejected count (the host
    scheduled it as if every draft were accepted)."""

    tokens: torch.Tensor  # [D] int64
    drafts: torch.Tensor | None  # [D, k] int64; None without MTP
    rejected: torch.Tensor  # [D] int64: verified drafts − accepted (0 for a plain sample)
    index: dict[str, int]

    @staticmethod
    def empty(device: torch.device) -> _LastStep:
        none = torch.zeros(0, dtype=torch.int64, device=device)
        return _LastStep(none, None, none, {})


@dataclass
class _ReqState:
    """A request's host state; its block ids are its row of the runner's BlockTable."""

    token_ids: list[int]
    params: SamplingParams
    num_computed_tokens: int = 0


class ModelRunner:
    """One rank's runner. `groups` are this rank's process groups (single-rank when None); `device`
    overrides config.device (each worker process passes its own GPU)."""

    def __init__(self, config: EngineConfig, *, groups: ParallelGroups | None = None,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self.model_cfg = config.model
        self.groups = groups or ParallelGroups.single()
        self.device = torch.device(device if device is not None else config.device)
        self.dtype = resolve_dtype(config.dtype, config.model)
        self.block_size = config.cache.block_size
        self.dcp_size = self.groups.dcp.size
        self.dcp_rank = self.groups.dcp.rank_in_group
        self.interleave = config.parallel.cp_kv_cache_interleave_size
        torch.manual_seed(config.seed)
        path = Path(config.model_path)
        with_mtp = checkpoint_has_mtp(path, self.model_cfg)
        # Cut to this rank's part before anything is allocated or read (parallel/tp.py).
        sharded = self.groups.world_size > 1 or self.groups.ep.size > 1  # DP + EP: experts
        backend = get_backend(config.attention.backend)
        if config.hisparse is not None:  # decode through hot buffers (kv/hisparse/)
            backend = HiSparseBackend(backend)
        backend.prepare(self.device)
        keep_fp8 = config.keep_fp8_weights
        keep_fp8 = self.device.type == "cuda" if keep_fp8 is None else keep_fp8
        # A model built without the FP8 layout holds the model dtype: the loader dequantizes.
        build_cfg = (self.model_cfg if keep_fp8
                     else replace(self.model_cfg, fp8_weights=None))
        self.model = DsaForCausalLM.build(
            build_cfg, with_mtp=with_mtp, backend=backend,
            dtype=self.dtype, device=self.device,
            shard=(lambda m: shard_model(m, self.groups, config.parallel)) if sharded else None,
        )
        load_weights(
            self.model, path, self.model_cfg, self.dtype,
            narrow=checkpoint_narrower(self.model_cfg, self.groups, config.parallel),
            first_expert=first_expert(self.model_cfg, self.groups, config.parallel),
        )
        # projections of one input as one matrix: one GEMM (and quantization) per group
        fused_groups = fuse_model(self.model)
        spec = config.speculative
        vocab = None if spec is None or not self.model.with_mtp else spec.draft_vocab
        quantize = self._drafts_read_fp8_head(keep_fp8)
        if quantize or vocab is not None:  # before the KV blocks are counted: its memory
            self.model.make_draft_head(vocab, quantize)
        kept = sum(p.numel() for p in self.model.parameters() if p.dtype == torch.float8_e4m3fn)
        logger.info("weights: %.2f GiB on this rank (%s; %d projection groups fused)", sum(
            p.numel() * p.element_size() for p in self.model.parameters()) / 2**30,
            f"FP8 kept: {kept / 1e6:.1f}M values" if kept else self.dtype, fused_groups)
        # HiSparse spilling: the MLA cache has its own, smaller page count (0: one per block)
        self.num_mla_pages, sized_blocks = self._mla_page_count()
        self.num_blocks = sized_blocks or self._num_blocks()
        self.caches = self._allocate_caches(self.num_blocks)
        # block id → MLA page (−1: spilled), as the scheduler's diffs say; None: the block id.
        # Host bookkeeping (numpy: reading it is never a device read), mirrored on the device
        # by the block table's diffs (engine/block_table.py) for the step's MLA page table
        self.mla_page_of = (MirroredArray(np.full(self.num_blocks, -1, dtype=np.int32),
                                          self.device) if self.num_mla_pages else None)
        self.connector = self._kv_connector()  # None without a P/D --kv-transfer-config
        self.copier = self._host_tier()  # None without --kv-offloading-size
        self.hisparse = self._hisparse()  # None without the HiSparseConnector
        if self.hisparse is not None:
            backend.runtime = self.hisparse
            if (self.connector is not None and self.mla_page_of is not None
                    and config.disagg is not None and config.disagg.is_consumer):
                # P/D reads land in the host pool directly (disagg/hostplan.py)
                self.hisparse.host = self.connector.register_host_pool(self.hisparse.host)
        self.requests: dict[str, _ReqState] = {}
        self._check_request_tables()
        # each request's block ids: a row from its first step to its end, on the device
        # across steps and updated from the diffs (engine/block_table.py)
        self.block_table = BlockTable(config.scheduler.max_num_seqs,
                                      self._max_blocks_per_request(), self.device)
        # P/D into spilling HiSparse: block ids of requests whose read was started, not added
        self._recv_blocks: dict[str, list[int]] = {}
        # each request's sampling parameters at its block-table row, on the device across
        # steps and updated from the diffs (engine/sampling_table.py)
        self.sampling = SamplingTable(self.block_table.max_rows, self.device, config.seed,
                                      self.model_cfg.vocab_size)
        spec = config.speculative
        self.drafter = None if spec is None else MtpDrafter(
            self.model, self.caches, spec.num_speculative_tokens, self._draft_metadata)
        self._synthetic_rates = None if spec is None or not spec.synthetic else torch.tensor(
            spec.conditional_rates, dtype=torch.float32, device=self.device)
        # DP + EP: each step's EP dispatches completed to the protocol's (parallel/lockstep.py)
        self.lockstep = lockstep_for(self.model, config.parallel.ep_spans_replicas,
                                     config.num_speculative_tokens)
        self.decode_graphs = self._decode_graphs(backend)  # None: every step runs as it is
        if self.decode_graphs is not None and self.decode_graphs.capture:
            # every size captured now, none inside a step; under DP + EP every rank captures
            # the same sizes in the same order (one config), each dispatching as many rows as
            # every other rank: the same collectives everywhere, no row counts exchanged
            with self._dispatch_rows(True):
                self.decode_graphs.warm_up()
            if self.lockstep is not None:
                self.lockstep.reset()
        # what the last step left on the device for a next step that continues from it
        self._last = _LastStep.empty(self.device)
        # [D] the first position each drafting request's rows wrote this step (_draft_inputs)
        self._drafts_written_from: torch.Tensor | None = None
        # --step-log: rank 0 reports each step's stats and GPU time (the engine's output is
        # rank 0's); None: off, no events recorded
        self.step_timer = (StepTimer(self.device)
                           if config.step_log is not None and self.groups.rank == 0 else None)
        self._num_timed_steps = 0

    # ---- set-up ---------------------------------------------------------------------------------
    def _max_blocks_per_request(self) -> int:
        """Blocks of the longest request with its MTP lookahead: the block table's width
        (it grows past it if a request ever needs more)."""
        tokens = self.config.scheduler.max_model_len + self.config.num_speculative_tokens
        return -(-tokens // (self.block_size * self.dcp_size))

    def _check_request_tables(self) -> None:
        """--max-num-seqs sizes a row per request up front, each the longest request's block
        ids: the block table's host mirror and its device copy (and the padded decode path a
        static copy more). A value whose rows cannot fit is a usage error, not an allocation
        traceback (a lower bound: the other per-request buffers are smaller)."""
        seqs = self.config.scheduler.max_num_seqs
        width = self._max_blocks_per_request()
        table = 4 * seqs * width  # [max_num_seqs, width] int32
        what = (f"{seqs} requests' block-table rows of {width} block ids (each running request "
                f"also holds at least one of the {self.num_blocks} KV blocks)")
        if self.device.type == "cuda":
            check_fits("--max-num-seqs", what, table, torch.device("cpu"))  # the host mirror
            check_fits("--max-num-seqs", what, table, self.device)
        else:
            check_fits("--max-num-seqs", what, 2 * table, self.device)

    def _mla_page_count(self) -> tuple[int, int | None]:
        """(MLA pages, KV blocks beside them, None: as `_num_blocks` says): the flag's pages,
        or for "auto" those `size_mla_pages` derives from the host-admitted concurrency and
        this rank's KV budget (the function `dsaserve plan` suggests the flag with)."""
        cfg = self.config
        given = cfg.attention.hisparse_device_mla_pages
        if given != "auto":
            return given or 0, None
        mla_page, index_page = cache_page_bytes(self.model_cfg, self.model.num_cache_layers,
                                                self.block_size, cfg.cache.fp8, self.dtype)
        per_token = mla_page // self.block_size  # MLA rows of every cache layer
        k = cfg.num_speculative_tokens
        lookahead = max(k - 1, 0)
        window = cfg.scheduler.max_model_len + lookahead
        # a P/D decode engine prefills only short prompts itself (Scheduler._mla_page_map)
        prefill = (pd_decode_prefill_tokens(cfg.hisparse_buffer_rows, lookahead)
                   if cfg.disagg is not None and cfg.disagg.is_decode_engine else None)
        adm = hisparse_admission(cfg.hisparse.host_pool_bytes, per_token, window,
                                 self.block_size)
        check_admits_one(adm, per_token, self.block_size)
        kv_bytes = None
        if cfg.cache.num_gpu_blocks is None:  # the budget one MLA page per block would get
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                kv_bytes = int(free - total * (1.0 - cfg.cache.gpu_memory_utilization))
            else:
                blocks_per_seq = -(-cfg.scheduler.max_model_len // self.block_size)
                kv_bytes = min(_CPU_KV_BUDGET_BYTES, (mla_page + index_page) * blocks_per_seq
                               * cfg.scheduler.max_num_seqs)
        sizing = size_mla_pages(
            max_requests=min(adm.max_requests, cfg.scheduler.max_num_seqs),
            window_tokens=window, block_size=self.block_size,
            tail_pages=write_tail_pages(k, self.block_size), mla_page_bytes=mla_page,
            index_page_bytes=index_page,
            hot_bytes_per_request=hot_region_rows(cfg.hisparse_buffer_rows, self.block_size)
            * per_token, kv_bytes=kv_bytes, num_blocks=cfg.cache.num_gpu_blocks,
            prefill_tokens=prefill)
        logger.info("HiSparse: device_mla_pages auto: %d MLA pages beside %d KV blocks, for %d "
                    "requests decoding at once", sizing.num_mla_pages, sizing.num_blocks,
                    sizing.concurrency)
        return sizing.num_mla_pages, None if kv_bytes is None else sizing.num_blocks

    def _num_blocks(self) -> int:
        cfg = self.config
        mla_page, index_page = cache_page_bytes(self.model_cfg, self.model.num_cache_layers,
                                                self.block_size, cfg.cache.fp8, self.dtype)
        # Spilling: the MLA pages are set apart first, the blocks (indexer pages) get the rest.
        per_block = index_page if self.num_mla_pages else mla_page + index_page
        mla_bytes = self.num_mla_pages * mla_page
        if cfg.cache.num_gpu_blocks is not None:
            num = cfg.cache.num_gpu_blocks
            check_fits("--num-gpu-blocks-override", f"{num} KV blocks",
                       num * per_block + mla_bytes, self.device)
            return num
        tokens_per_block = self.block_size * self.dcp_size
        blocks_per_seq = -(-cfg.scheduler.max_model_len // tokens_per_block)
        where = ""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - cfg.cache.gpu_memory_utilization) - mla_bytes
            where = (f" ({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB on {self.device}, "
                     f"{cfg.cache.gpu_memory_utilization} of it usable)")
        else:
            need = per_block * blocks_per_seq * cfg.scheduler.max_num_seqs
            budget = min(_CPU_KV_BUDGET_BYTES - mla_bytes, need)
        num = int(budget // per_block)
        if num < blocks_per_seq:  # a usage error, not a traceback
            raise ConfigError(
                f"--gpu-memory-utilization: room for {max(num, 0)} KV blocks{where} but one "
                f"request of --max-model-len {cfg.scheduler.max_model_len} needs {blocks_per_seq}"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num,
            tokens_per_block,
            num * per_block / 2**20,
        )
        return num

    def _allocate_caches(self, num_blocks: int) -> list[LayerCache]:
        m, b, fp8 = self.model_cfg, self.block_size, self.config.cache.fp8
        pages = self.num_mla_pages or num_blocks  # MLA pages; indexer pages: one per block
        caches = []
        for i in range(self.model.num_cache_layers):
            if fp8:
                row = formats.mla_row_bytes(m.kv_lora_rank, m.qk_rope_head_dim)
                kv = torch.zeros(pages, b, row, dtype=torch.uint8, device=self.device)
                index = torch.zeros(
                    num_blocks, b * (m.index_head_dim + 4), dtype=torch.uint8, device=self.device
                )
            else:
                kv = torch.zeros(
                    pages, b, m.kv_cache_width, dtype=self.dtype, device=self.device
                )
                index = torch.zeros(
                    num_blocks, b, m.index_head_dim, dtype=self.dtype, device=self.device
                )
            caches.append(LayerCache(kv=kv, index=index if m.has_indexer(i) else None))
        return caches

    def _host_tier(self) -> KVCopier | None:
        """This rank's share of the host KV tier: --kv-offloading-size split over the ranks."""
        cfg = self.config.offload
        if not cfg.enabled:
            return None
        block_bytes = bytes_per_host_block(self.caches)
        per_request = -(-self.config.scheduler.max_model_len // (self.block_size * self.dcp_size))
        num = num_host_blocks(cfg.cpu_bytes_to_use, self.config.parallel.world_size, block_bytes,
                              per_request, cfg.flag)
        pool = HostKVPool(self.caches, num, pin=self.device.type == "cuda", flag=cfg.flag)
        logger.info("host KV tier: %d blocks, %.2f GiB on this rank", num, pool.nbytes / 2**30)
        return KVCopier(pool, self.device)

    def _hisparse(self) -> HiSparseRuntime | None:
        """This rank's HiSparse host pool and hot buffers; admission reserves each request's
        whole window (max_model_len and the MTP lookahead) in the pool."""
        cfg = self.config
        if cfg.hisparse is None:
            return None
        per_token = sum(c.kv[0, 0].numel() * c.kv.element_size() for c in self.caches)
        window = cfg.scheduler.max_model_len + max(cfg.num_speculative_tokens - 1, 0)
        adm = hisparse_admission(cfg.hisparse.host_pool_bytes, per_token, window,
                                 self.block_size)
        check_admits_one(adm, per_token, self.block_size)
        requests = min(adm.max_requests, cfg.scheduler.max_num_seqs)
        logger.info("HiSparse: host pool of %d blocks (%.2f GiB), %d requests, %d hot rows",
                    adm.num_host_blocks, adm.num_host_blocks * self.block_size * per_token
                    / 2**30, requests, cfg.hisparse_buffer_rows)
        return HiSparseRuntime(
            self.caches, num_host_blocks=adm.num_host_blocks,
            blocks_per_request=adm.blocks_per_request, max_requests=requests,
            buffer_rows=cfg.hisparse_buffer_rows, max_query_rows=1 + cfg.num_speculative_tokens,
            block_size=self.block_size, device=self.device)

    def hisparse_spec(self) -> int:
        """Requests the HiSparse host pool admits at once on this rank (0: HiSparse off)."""
        return 0 if self.hisparse is None else self.hisparse.max_requests

    def hisparse_host_spec(self) -> HiSparseAdmission | None:
        """This rank's host pool: its blocks and one request's window (None: HiSparse off)."""
        rt = self.hisparse
        return None if rt is None else HiSparseAdmission(
            num_host_blocks=rt.num_host_blocks, blocks_per_request=rt.blocks_per_request,
            max_requests=rt.max_requests)

    def hisparse_block_rows(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Per layer, the host pool's MLA rows of spilled blocks ([n, B, row] uint8 views):
        kept ones', or a live holder's window. For tests, through `executor.call`."""
        assert self.hisparse is not None
        sources = self._host_sources(block_ids)
        src = torch.tensor([sources[b] for b in block_ids], dtype=torch.int64)
        return [pool.index_select(0, src).view(torch.uint8) for pool in self.hisparse.host]

    def hisparse_mla_pages(self) -> int:
        """Pages of this rank's MLA cache when they are fewer than the blocks (0: no spilling)."""
        return self.num_mla_pages

    def hisparse_counters(self) -> tuple[int, int, int, int]:
        """(rows missed, of those read from the host pool, requests holding a window, host
        blocks kept by prefix hash) on this rank; for tests through `executor.call`."""
        rt = self.hisparse
        assert rt is not None
        return int(rt.rows_missed), int(rt.rows_from_host), len(rt.entries), len(rt.kept)

    def check_hisparse(self, mla_pages: tuple[dict[int, int], dict[int, int]] | None = None
                       ) -> None:
        """HiSparse invariants (kv/hisparse/runtime.py), for tests through `executor.call`.
        With spilling, `mla_pages` is the scheduler's page map (block id → page) and the changes
        it has not sent yet: ours with those applied is the same map; no page is mapped twice;
        every resident page of a live request holds the host pool's rows."""
        if self.hisparse is None:
            return
        if self.mla_page_of is not None:
            assert mla_pages is not None
            expected, pending = mla_pages
            ours = dict(enumerate(self.mla_page_of.host.tolist()))
            assert len({p for p in ours.values() if p >= 0}) == sum(
                p >= 0 for p in ours.values()), "an MLA page mapped twice"
            ours.update(pending)
            assert {b: p for b, p in ours.items() if p >= 0} == expected, (
                "the runner's MLA page map is not the scheduler's")
        self.hisparse.check_integrity({rid: (st.num_computed_tokens, self._mla_pages(rid))
                                       for rid, st in self.requests.items()})

    def check_block_table(self) -> None:
        """Block-table invariants (engine/block_table.py): a row for each live request and no
        other; for tests through `executor.call`."""
        assert self.block_table.row_of.keys() == self.requests.keys(), (
            "block-table rows are not the live requests'")
        self.block_table.check_integrity()
        assert self.sampling.row_of() == self.block_table.row_of, (
            "sampling-parameter rows are not the block table's")
        self.sampling.check_integrity()
        if self.mla_page_of is not None:
            self.mla_page_of.check_integrity()

    def _mla_pages(self, request_id: str) -> list[int]:
        """The request's MLA pages in block order (−1: spilled); its block ids without
        spilling."""
        blocks = self.block_table.blocks(request_id)
        return (blocks if self.mla_page_of is None else self.mla_page_of.host[blocks]).tolist()

    def _drafts_read_fp8_head(self, keep_fp8: bool) -> bool:
        """Whether MTP drafts read an FP8 copy of lm_head (SpecConfig.draft_lm_head; "auto":
        where the checkpoint's FP8 weights are kept, the bytes that mode is for)."""
        spec = self.config.speculative
        if spec is None or not self.model.with_mtp:
            return False
        if spec.draft_lm_head == "auto":
            return keep_fp8 and self.model_cfg.fp8_weights is not None
        return spec.draft_lm_head == "fp8"

    def _decode_graphs(self, backend) -> DecodeGraphs | None:
        """Decode steps padded to capture sizes through static buffers (engine/decode_graph.py),
        unless --enforce-eager or a step's rows are not whole on this rank (PCP, DCP).
        Graphs are captured on CUDA with a capturable backend, and only on a replica of one
        rank: alone, or under DP + EP, whose decode steps pad to one size on every replica
        (engine/dp_padding.py) so that the EP dispatches exchange no row counts (unverified on
        GPUs: a 2-GPU machine is needed). TP > 1 stays eager (TP all-reduces inside a graph
        are untested); an EP group within one replica of TP ranks is TP > 1 too."""
        cfg = self.config
        k = cfg.num_speculative_tokens
        sizes = cudagraph.decode_sizes(cfg.compilation, cfg.scheduler.max_num_seqs, k)
        if not sizes or self.groups.pcp.size > 1 or self.dcp_size > 1:
            return None
        capture = (self.device.type == "cuda" and backend.capturable
                   and self.groups.world_size == 1)
        return DecodeGraphs(self.model, self.caches, sizes, k, cfg.scheduler.max_model_len,
                            self.block_size, self.device, capture, hisparse=self.hisparse,
                            mla_pages=self.mla_page_of is not None,
                            must_capture=self.lockstep is not None)

    def _kv_connector(self) -> ConnectorWorker | None:
        """P/D: this rank's transport, with the caches moved into (or registered as) memory
        peers can READ; must run before anything else holds the cache tensors."""
        if self.config.disagg is None:
            return None
        connector = ConnectorWorker(
            self.config.disagg, rank=self.groups.rank, dcp_rank=self.dcp_rank,
            world_size=self.groups.world_size, block_size=self.block_size,
            dcp_size=self.dcp_size, interleave=self.interleave)
        self.caches = connector.register(self.caches)
        return connector

    def kv_connector_metadata(self) -> bytes:
        """This rank's transport metadata for the engine's side channel (P/D)."""
        assert self.connector is not None, "no P/D connector"
        return self.connector.metadata()

    def close(self) -> None:
        """Release what outlives the process otherwise: the P/D transport's shared memory files
        and NIXL registrations (idempotent)."""
        if self.connector is not None:
            self.connector.close()

    def experts_held(self) -> int:
        """Routed experts this rank holds per MoE layer (EP: its share; tests check it)."""
        held = {layer.mlp.experts.w13.shape[0] for layer in self.model.model.layers
                if isinstance(layer.mlp, MoE)}
        assert len(held) == 1, f"MoE layers hold {sorted(held)} experts"
        return held.pop()

    def kv_row_bytes(self) -> int:
        """Bytes of one token over every cache layer of this rank (what P/D moves per row)."""
        from dsaserve.disagg.kvio import row_bytes

        return row_bytes(self.caches).per_token

    def kv_bytes_received(self) -> int:
        """Bytes this rank READ from prefill engines so far (P/D; tests check the layouts')."""
        return self.connector.bytes_received if self.connector is not None else 0

    def kv_read_times(self) -> ReadTimes:
        """This rank's READ timings so far, a copy (P/D consumer; benchmarks/pd_e2e.py's
        columns)."""
        return replace(self.connector.read_times) if self.connector is not None \
            else ReadTimes()

    def kv_read_paths(self) -> tuple[int, int]:
        """(source → this rank pairs READ staged, READ zero-copy) so far (P/D; tests and the
        benchmarks check which path disagg/staging.py chose)."""
        if self.connector is None:
            return 0, 0
        return self.connector.pairs_staged, self.connector.pairs_zero_copy

    def check_connector(self) -> None:
        """P/D invariants of this rank (staging buffers: one per request receiving staged)."""
        if self.connector is not None:
            self.connector.check_integrity()

    def host_tier_spec(self) -> tuple[int, int]:
        """(host blocks, bytes of one block on this rank); (0, 0) without a host tier."""
        if self.copier is None:
            return 0, 0
        return self.copier.pool.num_blocks, self.copier.pool.block_bytes

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The bytes this rank holds for `block_ids`, per cache tensor (layer order, MLA rows then
        indexer keys, the MTP layer last): [n, page_bytes] uint8 on the CPU. For tests and
        checks of the host tier, through `executor.call`."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return [region.index_select(0, ids).cpu() for region in cache_regions(self.caches)]

    # ---- the step --------------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        # 0. P/D: ended requests' READs cancelled and their parts released; the step launched;
        #    only then the new prompts' KV READs posted, so that the running requests' kernels
        #    are queued before the host spends its time on the READs' plans and posts (their
        #    requests are not scheduled until the READs land, polled after the forward;
        #    held blocks their consumers have read: disagg/connector.py)
        if self.connector is not None:
            so, dests = self._release_receives(so)
            if self.copier is not None:
                self._start_copies(so)
            pending = self._launch(so, non_blocking=True)  # waited for after the posting
            self._post_receives(so, dests)
            out = pending.result()
            if self.copier is not None:
                out = self.copier.report(out)
            return self._poll_transfers(so, out)
        return self._execute_tiered(so)

    def _release_receives(self, so: SchedulerOutput
                          ) -> tuple[SchedulerOutput, dict[str, HostDest]]:
        """P/D, before the step is launched: ended requests' READs still in flight (aborted
        while receiving) cancelled before anything else (their blocks and host window may be
        another request's this step); then MLA pages and ended requests (a read into a
        spilling HiSparse rank needs the request's pages and a host window the ended ones give
        back); then the new READs' host windows reserved → the step with those parts applied,
        and the windows (`_post_receives` posts the READs into them after the launch)."""
        assert self.connector is not None
        self.connector.cancel_receives(so.finished_request_ids)
        self._apply_releases(so)
        so = replace(so, mla_pages=(), finished_request_ids=(), host_keep=(),
                     host_restore=(), host_drop=())
        return so, self._host_dests(so.kv_recvs)

    def _post_receives(self, so: SchedulerOutput, dests: dict[str, HostDest]) -> None:
        """P/D, once the step is launched: the step's READs posted. Their destination blocks
        were allocated by the scheduler and are written by no request of this step (a
        receiving request is scheduled only once its READs landed)."""
        assert self.connector is not None
        if so.kv_recvs:
            self.connector.start_receives(so.kv_recvs, dests)

    def _poll_transfers(self, so: SchedulerOutput, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """P/D, after the forward is launched: READs landed or failed, held blocks read."""
        assert self.connector is not None
        done, failed = self.connector.poll_receives()
        sent = self.connector.poll_sends()
        if so.is_empty and not (done or failed or sent):
            time.sleep(0.002)  # only held blocks or reads pending: do not spin empty steps
        return replace(out, kv_recvs_done=done, kv_recvs_failed=failed, kv_sends_done=sent)

    def _execute_tiered(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.copier is not None:
            self._start_copies(so)
            return self.copier.report(self._execute(so))
        return self._execute(so)

    def _start_copies(self, so: SchedulerOutput) -> None:
        """Host-tier copies start first and overlap the forward (kv/copier.py)."""
        assert self.copier is not None
        self.copier.start(so)
        if so.is_empty:  # only copies in flight: wait for one rather than spin empty steps
            self.copier.wait_for_one()

    def submit(self, so: SchedulerOutput) -> step_results.PendingStep:
        """--async-scheduling: launch the step and return at once; its results come through
        a non-blocking copy that `PendingOutput.result()` waits for (engine/async_scheduler.py).
        Requests that continue from the previous step take its samples (and drafts) on the
        device. Transfers beside the step start around the launch (host-tier copies before it, P/D
        READs of a consumer after it) and are polled after it; what landed comes with the
        step's output."""
        if self.connector is None and self.copier is None:
            return self._launch(so, non_blocking=True)
        dests: dict[str, HostDest] = {}
        if self.connector is not None:
            so, dests = self._release_receives(so)
        if self.copier is not None:
            self._start_copies(so)
        pending = self._launch(so, non_blocking=True)
        if self.connector is not None:  # the READs posted behind the step's kernels (execute)
            self._post_receives(so, dests)
        landed = ModelRunnerOutput(sampled_token_ids={})
        if self.copier is not None:
            landed = self.copier.report(landed)
        if self.connector is not None:
            landed = self._poll_transfers(so, landed)
        return step_results.WithTransfers(pending, landed)

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self._launch(so, non_blocking=False).result()

    def _launch(self, so: SchedulerOutput, *, non_blocking: bool) -> step_results.PendingOutput:
        # 1. apply the diff
        launched_at = time.perf_counter()
        self._apply_diff(so)
        if so.is_empty:
            if self.lockstep is not None:  # DP + EP: the experts serve the other replicas
                self._serve_peers(so.dp_padded_size)
            return step_results.PendingOutput([], [], None)

        # 2. the flattened batch and its attention metadata
        req_ids = list(so.num_scheduled_tokens)
        batch = self._prepare(req_ids, so.num_scheduled_tokens, so.scheduled_spec_token_ids)

        # 3. forward (a decode-only step: padded, through static buffers, replayed from a CUDA
        #    graph where graphs are on; under DP + EP to the size of every replica, its EP
        #    dispatches exchanging no row counts); then sample (or verify drafts) for requests
        #    whose known tokens are done, the results left on the device
        padded = self._padded_size(batch, so.dp_padded_size)  # None: the step runs as it is
        replays = (0, 0)  # --step-log: graph replays before this step's
        if self.step_timer is not None:
            replays = self._graph_replays()
            self.step_timer.record_start()
        with self._dispatch_rows(padded is not None):
            hidden = self._forward(batch, padded)  # [N, hidden]
        if self.step_timer is not None:
            self.step_timer.record_forward_end()
        samples = self._sample(req_ids, batch, hidden)

        # 4. speculative decoding: the MTP layer drafts the next step's tokens (at the padded
        #    size after a padded forward)
        drafts, drafting = None, []
        last = _LastStep(samples.plain_tokens, None, torch.zeros_like(samples.plain_tokens),
                         {req_ids[r]: i for i, r in enumerate(samples.plain)})
        if self.drafter is not None:
            inputs = self._draft_inputs(req_ids, batch, samples)
            if padded is None:
                drafts = self.drafter.propose(hidden, batch.meta, inputs)
            else:
                with self._dispatch_rows(True):
                    drafts = self.decode_graphs.propose(inputs)
            drafting = inputs.request_ids
            last = _LastStep(inputs.tokens, drafts,
                             torch.cat((last.rejected, samples.rejected)),
                             {rid: i for i, rid in enumerate(drafting)})

        if self.lockstep is not None:  # DP + EP: the MTP forwards this step did not run
            self.lockstep.finish_step(replayed=padded is not None and self.decode_graphs.capture)

        # 5. HiSparse: the rows this step wrote join the durable host copy
        self._mirror(req_ids, batch)

        # 6. the step's one host sync: everything sampled, copied at once (async: started
        #    here, waited for after the next step is launched); the sampled tokens and drafts
        #    stay on the device for a next step that continues from them
        self._last = last
        # --step-log: the step's work launched (its last event recorded), its stats
        stats = (None if self.step_timer is None
                 else self._step_stats(batch, padded, replays, launched_at))
        pending = step_results.PendingOutput(
            req_ids, drafting,
            step_results.start_read_back(samples, drafts, non_blocking=non_blocking))
        if stats is None:
            return pending
        # with the GPU times of earlier steps whose events have passed by now
        return replace(pending, stats=stats, gpu_times=self.step_timer.poll())

    def _graph_replays(self) -> tuple[int, int]:
        """(target, draft chain) graph replays so far."""
        graphs = self.decode_graphs
        return (0, 0) if graphs is None else (graphs.num_replays, graphs.num_draft_replays)

    def _step_stats(self, batch: _Batch, padded: int | None, replays_before: tuple[int, int],
                    launched_at: float) -> StepStats:
        """--step-log, once the step's forward, sampling and drafts are launched: its last
        event, and what the step was (host-known values only)."""
        assert self.step_timer is not None
        launch_ms = 1e3 * (time.perf_counter() - launched_at)
        index = self._num_timed_steps
        self._num_timed_steps += 1
        self.step_timer.record_end(index)
        qsl = batch.query_start_loc
        decode_rows = sum(qsl[r + 1] - qsl[r] for r in range(len(batch.samples))
                          if batch.samples[r] and qsl[r + 1] - qsl[r] == 1 + batch.num_drafts[r])
        target, drafts = (now - before for now, before in zip(
            self._graph_replays(), replays_before, strict=True))
        return StepStats(index=index, num_decode_rows=decode_rows,
                         num_prefill_rows=qsl[-1] - decode_rows, padded_size=padded,
                         graph=target > 0, draft_graph=drafts > 0, launch_ms=launch_ms,
                         timed=self.step_timer.timed)

    def drain_step_times(self) -> tuple[StepGpuTime, ...]:
        """--step-log at shutdown: the GPU times not reported yet (waits for the device)."""
        return () if self.step_timer is None else self.step_timer.drain()

    def _padded_size(self, batch: _Batch, common: int | None) -> int | None:
        """The size a decode-only step (each request: its last known token and its drafts)
        runs at through the padded path; None: the step runs as it is. Under DP + EP the size
        is `common`, the one engine/dp.py chose for every replica (None: no replica pads)."""
        qsl = batch.query_start_loc
        counts = [qsl[r + 1] - qsl[r] for r in range(len(batch.samples))]
        decode_only = all(batch.samples) and all(
            n == 1 + d for n, d in zip(counts, batch.num_drafts, strict=True))
        own = None
        if self.decode_graphs is not None and decode_only and not batch.meta.use_dense:
            own = self.decode_graphs.size_for(counts)
        if self.lockstep is None:
            return own
        if common is not None and (own is None or own > common
                                   or common not in self.decode_graphs.sizes):
            # engine/dp_padding.py and this runner disagree on the step: a bug, and padding to
            # another size than the other replicas would desynchronise the dispatches
            raise RuntimeError(f"DP + EP: the step was padded to {common} for every replica, "
                               f"but this replica's ({counts} rows per request, decode-only "
                               f"{decode_only}, dense {batch.meta.use_dense}) pads to {own}")
        return common

    def _dispatch_rows(self, same: bool) -> contextlib.AbstractContextManager[None]:
        """DP + EP, `same`: a padded step's (or the start-up capture's) forwards, whose every
        EP dispatch has as many rows on every rank (parallel/lockstep.py)."""
        if self.lockstep is None or not same:
            return contextlib.nullcontext()
        return self.lockstep.same_rows()

    def _serve_peers(self, size: int | None) -> None:
        """DP + EP, a step with no rows on this replica: its experts serve the other replicas'
        rows, through the all-padding batch of `size` where they pad their decode steps to it
        (the same dispatches as theirs, the drafts' included; replayed where graphs are on),
        else through row-less dispatches (parallel/lockstep.py)."""
        if size is not None:
            if self.decode_graphs is None or size not in self.decode_graphs.sizes:
                raise RuntimeError(f"DP + EP: the step was padded to {size} for every replica, "
                                   "which this replica's padded path cannot run")
            with self._dispatch_rows(True):
                self.decode_graphs.run_padding(size)
        self.lockstep.finish_step(replayed=size is not None and self.decode_graphs.capture)

    def dp_ep_counts(self) -> tuple[int, int, int, int]:
        """(steps padded to a size so far, of them all-padding steps of no rows, EP dispatches
        that exchanged row counts so far, padded steps replayed from CUDA graphs so far), for
        tests through `executor.call`."""
        graphs = self.decode_graphs
        if graphs is None:
            padding = steps = replays = 0
        else:
            padding = graphs.num_padding_steps
            steps = padding + graphs.num_steps
            replays = graphs.num_padding_replays + graphs.num_replays
        layers = [] if self.lockstep is None else self.lockstep.layers
        return steps, padding, sum(m.size_exchanges for m in layers), replays

    def _forward(self, batch: _Batch, size: int | None) -> torch.Tensor:
        """The target forward → hidden [N, hidden], at `size` through the padded path."""
        if size is None:
            return self.model(batch.input_ids, batch.meta, self.caches)
        qsl = batch.query_start_loc
        counts = [qsl[r + 1] - qsl[r] for r in range(len(batch.samples))]
        return self.decode_graphs.forward(size, counts, batch.input_ids, batch.meta)

    def _sample(self, req_ids: list[str], batch: _Batch, hidden: torch.Tensor
                ) -> step_results.DeviceSamples:
        """Per sampling request: one token sampled at its last row, or (with drafts) the
        accepted drafts and one more token from the rejection sampler; on the device."""
        qsl = batch.query_start_loc
        dev = hidden.device
        plain = [r for r in range(len(req_ids)) if batch.samples[r] and not batch.num_drafts[r]]
        verify = [r for r in range(len(req_ids)) if batch.samples[r] and batch.num_drafts[r]]
        # the sampling requests' rows of the parameter table (plain ones, then verifying ones)
        sampled_ids = [req_ids[r] for r in plain + verify]
        param_rows = self.block_table.rows(sampled_ids)
        tokens = lps = torch.zeros(0, dtype=torch.int64, device=dev)
        # The emitted tokens' log-probabilities: from each row's log-sum-exp alone
        # (sampler.chosen_logprobs), or, while some live request asks for top-W log-probs,
        # from one log_softmax per row that serves both.
        width = self.sampling.top_logprobs_width  # host-known: no read of the device
        emitted_from: list[torch.Tensor] = []  # [rows, V] log-probabilities, kept for the top-W
        # min_tokens: some live request masks its stop ids (host-known); the positions of the
        # rows' tokens then go up too
        masking = self.sampling.num_masking > 0
        if plain:
            last_rows, rows_d, *at = staging.upload(
                [torch.tensor([qsl[r + 1] - 1 for r in plain]),
                 torch.from_numpy(param_rows[: len(plain)]),
                 *(self._token_positions(batch, plain) if masking else ())], dev)
            logits = self.model.compute_logits(hidden[last_rows])  # [M, V]
            logprobs = logits.log_softmax(-1) if width else None  # [M, V]
            params = self.sampling.batch(sampled_ids[: len(plain)], rows_d,
                                         self._moved_positions(batch, *at) if at else None)
            tokens, lps = sample_on_device(logits, params, logprobs)
            if logprobs is not None:
                emitted_from.append(logprobs)
        accepted = torch.zeros(0, dtype=torch.int64, device=dev)
        emitted = emitted_lps = torch.zeros(0, 1, dtype=torch.int64, device=dev)
        if verify:
            k = max(batch.num_drafts[r] for r in verify)
            # rows of each verifying request: its last token and its drafts ([M, k+1], padded
            # by repeating the last row; padded rows are never read)
            # (numpy: a Python min per row was ~1 µs a request at b = 64)
            last = np.array([qsl[r + 1] - 1 for r in verify])  # [M] each one's last row
            num_drafts_h = np.array([batch.num_drafts[r] for r in verify])  # [M]
            rows = np.minimum((last - num_drafts_h)[:, None] + np.arange(k + 1),
                              last[:, None])  # [M, k+1]
            rows_d, draft_ids, num_drafts, param_rows_d, *at = staging.upload([
                torch.from_numpy(rows).flatten(),
                torch.tensor([self._drafts_of(batch, r, k) for r in verify]),  # [M, k]
                torch.from_numpy(num_drafts_h),  # [M]
                torch.from_numpy(param_rows[len(plain):]),  # [M]
                *(self._token_positions(batch, verify) if masking else ())], dev)
            if batch.device_ids is not None:  # async: drafts proposed on the device (their
                # host values are placeholders) are this step's inputs
                on_device = batch.device_ids[rows_d].view(len(verify), k + 1)[:, 1:]
                draft_ids = torch.where(draft_ids == PLACEHOLDER_TOKEN_ID, on_device, draft_ids)
            logits = self.model.compute_logits(hidden[rows_d])
            logits = logits.view(len(verify), k + 1, -1)  # [M, k+1, V]
            accepted, final = rejection_sample_on_device(
                logits, draft_ids, num_drafts,
                self.sampling.batch(sampled_ids[len(plain):], param_rows_d,
                                    self._moved_positions(batch, *at) if at else None),
                self._synthetic_rates)
            # token i of a run comes from row i: its log-probability there
            emitted = emitted_tokens(draft_ids, accepted, final)  # [M, k+1]
            if width:
                logprobs = logits.log_softmax(-1)  # [M, k+1, V]
                emitted_lps = logprobs.gather(-1, emitted[..., None])[..., 0]
                emitted_from.append(logprobs.flatten(0, 1))
            else:
                emitted_lps = chosen_logprobs(logits, emitted)  # [M, k+1]
        # some live request asked for logprobs: the top-W of every row (plain rows, then the
        # verifying ones), a topk per group: the [rows, V] log-probabilities are never copied
        top_ids = top_lps = None
        if emitted_from:
            tops = [top_logprobs(lp, width) for lp in emitted_from]  # ([rows, W], [rows, W])
            top_ids = torch.cat([ids for ids, _ in tops])  # [M + V·(k+1), W]
            top_lps = torch.cat([lp for _, lp in tops])
        return step_results.DeviceSamples(plain, tokens, lps, verify, accepted, emitted,
                                          emitted_lps, num_drafts if verify else None,
                                          top_ids, top_lps)

    @staticmethod
    def _token_positions(batch: _Batch, reqs: list[int]) -> list[torch.Tensor]:
        """min_tokens: for the sampling requests at `reqs` (batch indices), the host's
        position of the token each samples (a verifying request's first: the one after its
        last known token) and the indices, for the upload → [positions [M], reqs [M]]."""
        qsl = batch.query_start_loc
        return [torch.tensor([batch.starts[r] + qsl[r + 1] - qsl[r] - batch.num_drafts[r]
                              for r in reqs]), torch.tensor(reqs)]

    @staticmethod
    def _moved_positions(batch: _Batch, positions: torch.Tensor,
                         reqs: torch.Tensor) -> torch.Tensor:
        """The uploaded `_token_positions` [M] where the tokens really are: async rows that
        continue from a verifying step moved back on the device by its rejected drafts (the
        host placed them as if all were accepted). No host count of tokens enters."""
        return positions if batch.moved is None else positions + batch.moved[reqs]

    @staticmethod
    def _drafts_of(batch: _Batch, r: int, k: int) -> list[int]:
        """Request r's drafts, padded with −1 to k."""
        d = batch.num_drafts[r]
        drafts = batch.step_tokens[r][len(batch.step_tokens[r]) - d:] if d else []
        return drafts + [-1] * (k - d)

    def _draft_inputs(self, req_ids: list[str], batch: _Batch,
                      samples: step_results.DeviceSamples) -> DraftInputs:
        """What MTP step 0 reads: the token after each row's input (host-known: the next prompt
        token or draft; the emitted token is put in on the device at the last accepted row) and
        where each sampling request's drafting continues from (device rows and positions)."""
        qsl = batch.query_start_loc
        next_ids: list[int] = []
        for r in range(len(req_ids)):
            n, seq = qsl[r + 1] - qsl[r], batch.step_tokens[r]
            nxt = seq[1 : n + 1]
            next_ids += nxt + [0] * (n - len(nxt))  # rows past the known tokens: overwritten
        # the last row before the drafts (plain requests: the last row), then + accepted
        drafting = samples.plain + samples.verify
        base_rows = [qsl[r + 1] - 1 - batch.num_drafts[r] for r in drafting]
        base_pos = [batch.starts[r] + qsl[r + 1] - qsl[r] - 1 - batch.num_drafts[r]
                    for r in drafting]
        dev = self.device
        plus = torch.cat((torch.zeros(len(samples.plain), dtype=torch.int64, device=dev),
                          samples.accepted))  # [D]
        starts = [batch.starts[r] for r in drafting]
        next_d, rows_d, pos_d, drafting_d, start_d = staging.upload_lists(
            [next_ids, base_rows, base_pos, drafting, starts], dev)
        rows_d, pos_d = rows_d + plus, pos_d + plus
        # HiSparse: the draft steps trust the host pool only below the first position the
        # step's rows wrote (engine/runner.py _draft_metadata)
        self._drafts_written_from = start_d
        if batch.device_ids is not None:  # async: the inputs taken on the device
            following = batch.device_ids.roll(-1)  # [N] the next row's input
            next_d = torch.where(next_d == PLACEHOLDER_TOKEN_ID, following, next_d)
        if batch.moved is not None:  # async with drafts: rows moved back on the device
            moved = batch.moved[drafting_d]  # [D]
            pos_d = pos_d + moved
            self._drafts_written_from = start_d + moved
        return DraftInputs(
            next_token_ids=next_d,
            rows=rows_d,
            tokens=torch.cat((samples.plain_tokens, samples.emitted.gather(
                1, samples.accepted[:, None])[:, 0])),
            positions=pos_d,
            request_ids=[req_ids[r] for r in drafting],
            max_positions=[p + batch.num_drafts[r] for p, r in zip(base_pos, drafting,
                                                                    strict=True)],
        )

    def execute_all_logits(self, so: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Like execute, but returns the logits of every scheduled token ([n, V] per request) and
        samples nothing: what reference comparisons need."""
        return self.execute_all_logits_mtp(so)[0]

    def execute_all_logits_mtp(
        self, so: SchedulerOutput, next_token_ids: dict[str, list[int]] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """execute_all_logits, and with `next_token_ids` (request id → the token after each
        scheduled row) also MTP step 0 over the same rows: its logits [n, V] per request (it
        writes the MTP layer's cache as drafting does). For reference comparisons."""
        self._apply_diff(so)
        req_ids = list(so.num_scheduled_tokens)
        batch = self._prepare(req_ids, so.num_scheduled_tokens, so.scheduled_spec_token_ids)
        hidden = self.model(batch.input_ids, batch.meta, self.caches)  # [N, hidden], global order

        def per_request(logits: torch.Tensor) -> dict[str, torch.Tensor]:
            q = batch.query_start_loc
            return {rid: logits[q[r] : q[r + 1]] for r, rid in enumerate(req_ids)}

        mtp: dict[str, torch.Tensor] = {}
        if next_token_ids is not None:
            ids = torch.tensor([t for rid in req_ids for t in next_token_ids[rid]],
                               dtype=torch.int64, device=self.device)
            h_mtp = self.model.forward_mtp(ids, hidden, batch.meta, self.caches)
            mtp = per_request(self.model.compute_logits(h_mtp))
        self._mirror(req_ids, batch)
        return per_request(self.model.compute_logits(hidden)), mtp

    def _mirror(self, req_ids: list[str], batch: _Batch) -> None:
        """Copy the positions the step may have written (its rows, then the MTP drafts') of
        every request to the HiSparse host pool."""
        if self.hisparse is None:
            return
        reach = self.config.num_speculative_tokens
        # async with drafts: rows moved back on the device rewrite up to k positions below
        # the host's start (engine/async_scheduler.py)
        back = reach if batch.continues else 0
        qsl = batch.query_start_loc
        self.hisparse.mirror({
            rid: (max(batch.starts[r] - back, 0), batch.starts[r] + qsl[r + 1] - qsl[r] + reach,
                  self._mla_pages(rid))
            for r, rid in enumerate(req_ids)})

    def _hisparse_step(self, req_ids: list[str], starts: list[int],
                       counts: list[int]) -> HiSparseStep | None:
        if self.hisparse is None:
            return None
        return self.hisparse.step(req_ids, starts, counts,
                                  [self.requests[rid].num_computed_tokens for rid in req_ids])

    def _host_dests(self, recvs: tuple[KVRecv, ...]) -> dict[str, HostDest]:
        """P/D into a spilling HiSparse rank (disagg/hostplan.py): each request's host window,
        reserved now, and its MLA pages (−1: spilled, its rows READ straight into the pool)."""
        if self.hisparse is None or self.mla_page_of is None:
            return {}
        for r in recvs:  # a later prefix hit may restore a block from this window
            self._recv_blocks[r.request_id] = list(r.block_ids)
        return {r.request_id: HostDest(
            host_blocks=tuple(self.hisparse.reserve(r.request_id)),
            mla_pages=tuple(self.mla_page_of.host[list(r.block_ids)].tolist())) for r in recvs}

    def _apply_releases(self, so: SchedulerOutput) -> None:
        if so.mla_pages:  # HiSparse spilling: pages given, taken or spilled since the last step
            blocks, pages = zip(*so.mla_pages, strict=True)
            self.mla_page_of.write(np.array(blocks, dtype=np.int64), pages)
        keep = set(so.host_keep)
        for rid in so.finished_request_ids:
            st = self.requests.pop(rid, None)
            received = self._recv_blocks.pop(rid, None)  # P/D: a read started, not added
            if self.hisparse is not None:  # its spilled cached blocks' host rows are kept
                blocks = (received if received is not None
                          else self.block_table.blocks(rid).tolist() if st is not None else [])
                self.hisparse.remove(rid, {b: i for i, b in enumerate(blocks) if b in keep})
            self.block_table.remove(rid)
            self.sampling.remove(rid)
        if self.hisparse is not None:
            assert keep <= self.hisparse.kept.keys(), "a kept block's request did not end"
            self._restore_host_blocks(so.host_restore)
            for b in so.host_drop:
                self.hisparse.release_kept(b)

    def _restore_host_blocks(self, block_ids: tuple[int, ...]) -> None:
        """HiSparse: prefix hits on spilled blocks got MLA pages again: fill them from the
        host rows (a kept host block, given back after, or a live holder's window). A block
        whose page was taken again within the same diff is only given back."""
        assert self.hisparse is not None and self.mla_page_of is not None or not block_ids
        restored = [b for b in block_ids if self.mla_page_of.host[b] >= 0]
        sources = self._host_sources(restored)
        self.hisparse.restore([int(self.mla_page_of.host[b]) for b in restored],
                              [sources[b] for b in restored])
        for b in block_ids:
            if b in self.hisparse.kept:
                self.hisparse.release_kept(b)

    def _host_sources(self, block_ids: list[int]) -> dict[int, int]:
        """The host block holding each block's MLA rows: kept for it, or in the window of a
        live request holding it (which computed it, had it restored, or received it). One pass
        over the holders' tables for all of them."""
        assert self.hisparse is not None
        kept = self.hisparse.kept
        found = {b: kept[b] for b in block_ids if b in kept}
        wanted = set(block_ids) - found.keys()
        holders = [(rid, None) for rid in self.requests] + list(self._recv_blocks.items())
        for rid, blocks in holders:
            if not wanted:
                break
            if rid not in self.hisparse.entries:
                continue
            if blocks is None:  # a live request's: its row of the block table
                blocks = self.block_table.blocks(rid).tolist()
            for i, b in enumerate(blocks):
                if b in wanted:
                    found[b] = self.hisparse.host_block(rid, i)
                    wanted.discard(b)
        if wanted:
            raise RuntimeError(f"HiSparse: no host rows for block {min(wanted)}")
        return found

    def _apply_diff(self, so: SchedulerOutput) -> None:
        self._apply_releases(so)
        for new in so.new_requests:
            self.requests[new.request_id] = _ReqState(
                token_ids=list(new.token_ids),
                params=new.sampling_params,
                num_computed_tokens=new.num_computed_tokens,
            )
            self.block_table.add(new.request_id, new.block_ids)
            num_prompt = (len(new.token_ids) if new.num_prompt_tokens is None
                          else new.num_prompt_tokens)
            self.sampling.add(new.request_id, self.block_table.row_of[new.request_id],
                              new.sampling_params, num_prompt, new.eos_token_ids,
                              len(new.token_ids))
            self._recv_blocks.pop(new.request_id, None)
            if self.hisparse is not None:
                self.hisparse.add(new.request_id, new.num_computed_tokens,
                                  self._mla_pages(new.request_id))
        for cached in so.cached_requests:
            st = self.requests[cached.request_id]
            st.token_ids.extend(cached.new_token_ids)
            if self.sampling.num_masking:  # min_tokens reached by the known tokens: unmasked
                self.sampling.tokens_known(cached.request_id, len(st.token_ids))
            if cached.num_kept_blocks is not None:  # blocks of rejected drafts were given back
                self.block_table.truncate(cached.request_id, cached.num_kept_blocks)
            if cached.new_block_ids:
                self.block_table.append(cached.request_id, cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    def _prepare(self, req_ids: list[str], num_scheduled: dict[str, int],
                 spec: dict[str, tuple[int, ...]]) -> _Batch:
        """The step's rows: request r computes num_scheduled[r] tokens from its computed length
        on (its known tokens, then the drafts it verifies). Under --async-scheduling a request
        whose computed length reaches past the tokens the host knows continues from the last
        step: its rows are that step's last token and drafts, taken on the device."""
        starts: list[int] = []
        counts: list[int] = []
        step_tokens: list[list[int]] = []
        samples: list[bool] = []
        num_drafts: list[int] = []
        continuing: list[int] = []
        for r, rid in enumerate(req_ids):
            st = self.requests[rid]
            start, n, drafts = st.num_computed_tokens, num_scheduled[rid], spec.get(rid, ())
            continues = start >= len(st.token_ids)  # async: its inputs are on the device
            if continues:
                continuing.append(r)
                seq = [PLACEHOLDER_TOKEN_ID] * n
            else:
                # this step's inputs and the token after them: known tokens, then drafts (a
                # request with drafts has one known token left; a prefill chunk has no drafts)
                seq = st.token_ids[start : start + n + 1]
                seq += drafts
            starts.append(start)
            counts.append(n)
            step_tokens.append(seq)
            samples.append(continues or start + n - len(drafts) == len(st.token_ids))
            num_drafts.append(len(drafts))
        # async under PCP: continuing rows are replicated, so every rank holds them (its own
        # copy of the last step's samples) and their local rows are their global rows' order
        input_ids, meta, qsl = self._metadata(req_ids, starts, counts,
                                              _flat_ids(step_tokens, counts),
                                              replicate=set(continuing))
        batch = _Batch(input_ids, meta, qsl, starts, step_tokens, num_drafts, samples)
        return self._continue_on_device(batch, req_ids, continuing) if continuing else batch

    def _continue_on_device(self, batch: _Batch, req_ids: list[str],
                            continuing: list[int]) -> _Batch:
        """--async-scheduling: the rows of the requests at `continuing` (batch indices) take the
        last step's emitted token and drafts on the device (input_ids is written in place), and
        with MTP move back by the drafts that step rejected: the host placed them as if all were
        accepted. Each rank takes its own samples: every rank sampled the same tokens from the
        same logits and per-request generators. Under PCP the continuing requests are
        replicated: their rows are on every rank, at the local offsets of the rank's rows
        (`meta.query_start_loc`), and their write slots in the global order are moved too.
        The positions and write slots are then the device's; seq_lens stay the host's bound,
        keys past a row's position masked by its causal limit, as for the draft steps. → the
        batch to run."""
        last = self._last
        missing = [req_ids[r] for r in continuing if req_ids[r] not in last.index]
        if missing:
            raise RuntimeError(f"async scheduling: request {missing[0]!r} continues from a "
                               "step that did not sample it")
        width = 1 if last.drafts is None else 1 + last.drafts.shape[1]
        qsl, local_qsl = batch.query_start_loc, batch.meta.query_start_loc
        rows: list[int] = []  # global rows
        local_rows: list[int] = []  # the same rows among this rank's (= rows without PCP)
        src: list[int] = []  # into [D, width] = (token, drafts) of the last step, flattened
        src_req: list[int] = []
        cont_req: list[int] = []  # [C] into the last step's requests
        for r in continuing:
            rid = req_ids[r]
            i, n = last.index[rid], qsl[r + 1] - qsl[r]
            if n > width:
                raise RuntimeError(f"async scheduling: request {rid!r} verifies {n - 1} drafts; "
                                   f"the last step proposed {width - 1}")
            assert local_qsl[r + 1] - local_qsl[r] == n, "a continuing request was split"
            rows += range(qsl[r], qsl[r + 1])
            local_rows += range(local_qsl[r], local_qsl[r + 1])
            src += range(i * width, i * width + n)
            src_req += [i] * n
            cont_req.append(i)
        rows_d, local_d, src_d, req_d, cont_d, cont_r_d, starts_d = staging.upload_lists(
            [rows, local_rows, src, src_req, cont_req, continuing, batch.starts], self.device)
        inputs = last.tokens[:, None]  # [D, width]
        if last.drafts is not None:
            inputs = torch.cat((inputs, last.drafts), 1)
        values = inputs.flatten()[src_d]  # [n_continuing rows]
        batch.input_ids[local_d] = values
        meta = batch.meta
        device_ids = batch.input_ids
        if meta.pcp is not None:  # [N] global: the continuing rows' values, the rest unused
            device_ids = torch.full((qsl[-1],), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                                    device=self.device).index_put((rows_d,), values)
        moved = None
        if last.drafts is not None:  # plain decode: the host's positions are exact
            moved = torch.zeros(len(req_ids), dtype=torch.int64, device=self.device).index_put(
                (cont_r_d,), -last.rejected[cont_d])  # [R]
            positions = meta.positions.index_put((local_d,), -last.rejected[req_d],
                                                 accumulate=True)
            meta = self._moved_rows(meta, positions, starts_d + moved,
                                    pcp_rows=(rows_d, local_d))
        return replace(batch, meta=meta, continues=True, device_ids=device_ids, moved=moved)

    def _moved_rows(self, meta: AttentionMetadata, positions: torch.Tensor, first: torch.Tensor,
                    written_from: torch.Tensor | None = None,
                    pcp_rows: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> AttentionMetadata:
        """`meta` with its rows at device-side `positions` [N] (each request's first row at
        first [R]): the slots they write are found from them, and HiSparse's hot copies are
        trusted only below `first`, its host rows only below `written_from` [R] (default
        `first`): the first position the step wrote (a row moved back rewrites positions the
        host counted as computed, and the mirror runs at the end of the step). Under PCP the
        global write slots of the moved rows `pcp_rows` = (global rows, their local rows) are
        replaced; without them every row is replicated (local rows = global rows)."""
        slots = layout.slot_mapping(positions, meta.req_indices, meta.block_table,
                                    self.block_size, self.dcp_size, self.dcp_rank,
                                    self.interleave)
        mla_slots = meta.mla_slot_mapping
        if meta.mla_block_table is not None:
            mla_slots = layout.slot_mapping(positions, meta.req_indices, meta.mla_block_table,
                                            self.block_size, self.dcp_size, self.dcp_rank,
                                            self.interleave)
        pcp_meta = meta.pcp
        if pcp_meta is not None:
            write_slots = slots  # one row per request: replicated, local rows = global rows
            if pcp_rows is not None:
                rows, local = pcp_rows
                write_slots = pcp_meta.write_slots.index_put((rows,), slots[local])
            pcp_meta = dataclasses.replace(pcp_meta, write_slots=write_slots)
        hs = meta.hisparse
        if hs is not None:
            written_from = first if written_from is None else written_from
            hs = dataclasses.replace(
                hs, tracked_from=first[hs.tracked_requests],
                mirrored_upto=torch.minimum(hs.mirrored_upto, written_from[hs.hot_requests]))
        return dataclasses.replace(meta, positions=positions, slot_mapping=slots, pcp=pcp_meta,
                                   hisparse=hs, mla_slot_mapping=mla_slots)

    def _draft_metadata(self, req_ids: list[str], positions: torch.Tensor,
                        max_positions: list[int]) -> AttentionMetadata:
        """Metadata for one token per request at device-side `positions` [D] (MTP draft steps),
        each at most max_positions[r]: the host-side parts (context lengths, the PCP view of
        rows that are all replicated) are built at the bound, the positions and the slots they
        write from the device values. Keys between a row's position and the bound are masked
        by the causal limit (positions)."""
        meta = self._metadata(req_ids, max_positions, [1] * len(req_ids),
                              torch.zeros(len(req_ids), dtype=torch.int64))[1]
        return self._moved_rows(meta, positions, positions, self._drafts_written_from)

    def _metadata(self, req_ids: list[str], starts: list[int], counts: list[int],
                  tok_t: torch.Tensor, replicate: Collection[int] = ()
                  ) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Request r computes counts[r] tokens at positions starts[r]..; `tok_t` [N] int64
        (host) are their ids in the global order → (this rank's input ids, metadata, global
        query_start_loc). Under PCP the requests at `replicate` are computed by every rank
        whatever their length."""
        qsl = [0]
        seq_lens: list[int] = []
        for start, n in zip(starts, counts, strict=True):
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        global_qsl = list(qsl)
        # Host tensors built without Python loops over tokens or blocks (a 16K-token chunk of
        # a 1M-token prompt: 16K positions and 16K block ids per step; docs/long_prefill.md).
        pos_t, req_t = _positions(starts, counts)  # [N], [N] int64
        # The block table is the device's (engine/block_table.py): only the entries changed
        # since the last step and the step's rows go up; the write slots are read from the
        # host mirror (its rows, shared, not copied)
        table = self.block_table
        rows = table.rows(req_ids)  # [R] int64 the requests' rows
        width = int(table.num_blocks[rows].max())
        rows_t = torch.from_numpy(rows)
        dev = self.device
        # [N] the rows' write slots, per block of the mirror (not per token)
        slots = torch.from_numpy(layout.run_slots(starts, counts, rows, table.host,
                                                  self.block_size, self.dcp_size,
                                                  self.dcp_rank, self.interleave))
        # [2, n] each: (flat index, value) changed since last step
        diffs = [table.pending(), self.sampling.pending()]
        mla_slots: list[torch.Tensor] = []
        if self.mla_page_of is not None:  # HiSparse spilling: MLA pages apart from block ids
            diffs.append(self.mla_page_of.pending())
            # [N] the same rows in the MLA pages (−1: spilled)
            mla_slots = [layout.page_slots(slots, torch.from_numpy(self.mla_page_of.host),
                                           self.block_size)]
        use_dense = dense_allowed(max(seq_lens), self.model_cfg.index_topk, self.dcp_size,
                                  self.config.attention.sparse_mla_force_mqa)
        pcp_host: list[torch.Tensor] = []
        if self.groups.pcp.size > 1:
            # This rank computes only its share of the rows (replicated requests: all of them).
            query_lens = [qsl[r + 1] - qsl[r] for r in range(len(req_ids))]
            part = pcp.partition(query_lens, self.groups.pcp.size, replicate)
            local = part.local_index_tensor(self.groups.pcp.rank_in_group)
            counts_local = torch.bincount(req_t[local], minlength=len(req_ids)).tolist()
            qsl = [0]
            for c in counts_local:
                qsl.append(qsl[-1] + c)
            pcp_host = [local, part.restore_index, slots]
            tok_t, pos_t, req_t, slots = tok_t[local], pos_t[local], req_t[local], slots[local]
        # one asynchronous host → device copy for all of it (kernels/staging.py)
        pos_d, req_d, slots_d, rows_d, tok_d, *rest = staging.upload(
            [pos_t, req_t, slots, rows_t, tok_t, *diffs, *mla_slots, *pcp_host], dev)
        diffs_d, rest = rest[: len(diffs)], rest[len(diffs) :]
        mla_d, pcp_d = rest[: len(mla_slots)], rest[len(mla_slots) :]
        # the device table brought up to date, then the step's rows of it
        table.apply(diffs_d[0])
        self.sampling.apply(diffs_d[1])
        table_d = table.gather(rows_d, width)  # [R, width] int32
        mla_table_d = None
        if self.mla_page_of is not None:
            self.mla_page_of.apply(diffs_d[2])
            page_of_d = self.mla_page_of.device_array  # [num_blocks] int32
            # [R, width] MLA pages (−1: none or spilled)
            mla_table_d = torch.where(table_d >= 0, page_of_d[table_d.clamp(min=0).long()], -1)
        pcp_meta = None
        if pcp_d:
            pcp_meta = PcpMetadata(
                local_index=pcp_d[0], restore_index=pcp_d[1], padded_len=part.padded_len,
                write_slots=pcp_d[2], replicated=part.replicated, query_lens=tuple(query_lens),
            )
        meta = AttentionMetadata(
            positions=pos_d,
            req_indices=req_d,
            slot_mapping=slots_d,
            block_table=table_d,
            query_start_loc=tuple(qsl),
            seq_lens=tuple(seq_lens),
            block_size=self.block_size,
            use_dense=use_dense,
            dcp_size=self.dcp_size,
            dcp_rank=self.dcp_rank,
            interleave=self.interleave,
            pcp=pcp_meta,
            hisparse=self._hisparse_step(req_ids, starts, counts),
            mla_block_table=mla_table_d,
            mla_slot_mapping=mla_d[0] if mla_d else None,
        )
        return tok_d, meta, global_qsl
