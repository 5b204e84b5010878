"""The model runner: one per rank. It owns the weights, the paged caches and the per-request token
state, applies the scheduler's typed diff, runs the model on the flattened batch and samples."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dsaserve.config import EngineConfig, ModelConfig
from dsaserve.core import ModelRunnerOutput, SamplingParams, SchedulerOutput
from dsaserve.disagg.connector import ConnectorWorker
from dsaserve.engine.sampler import make_generator, sample
from dsaserve.kernels import formats
from dsaserve.kernels.metadata import AttentionMetadata, PcpMetadata
from dsaserve.kernels.registry import get_backend
from dsaserve.kv import layout
from dsaserve.kv.copier import KVCopier
from dsaserve.kv.host_pool import (
    HostKVPool,
    bytes_per_host_block,
    cache_regions,
    num_host_blocks,
)
from dsaserve.model.dsa import DsaForCausalLM, LayerCache
from dsaserve.model.loader import checkpoint_has_mtp, load_weights
from dsaserve.parallel import pcp
from dsaserve.parallel.groups import ParallelGroups
from dsaserve.parallel.tp import checkpoint_narrower, first_expert, shard_model
from dsaserve.spec.mtp import DraftRequest, MtpDrafter
from dsaserve.spec.rejection import rejection_sample

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CPU_KV_BUDGET_BYTES = 2 << 30  # CPU has no "free HBM"; cap the default pool at 2 GiB


def resolve_dtype(requested: str, model: ModelConfig) -> torch.dtype:
    name = model.torch_dtype if requested == "auto" else requested
    if name not in _DTYPES:
        raise ValueError(f"--dtype: unsupported dtype {name!r}")
    return _DTYPES[name]


def cache_bytes_per_block(model: ModelConfig, num_layers: int, block_size: int, fp8: bool,
                          dtype: torch.dtype) -> int:
    """Bytes of one physical page over every cache layer (MLA rows + indexer keys where owned)."""
    elem = torch.empty((), dtype=dtype).element_size()
    if fp8:
        mla = formats.mla_row_bytes(model.kv_lora_rank, model.qk_rope_head_dim)
        index = model.index_head_dim + 4
    else:
        mla = model.kv_cache_width * elem
        index = model.index_head_dim * elem
    n_index = sum(model.has_indexer(i) for i in range(num_layers))
    return block_size * (num_layers * mla + n_index * index)


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


@dataclass
class _ReqState:
    token_ids: list[int]
    block_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
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
        sharded = self.groups.world_size > 1
        backend = get_backend(config.attention.backend)
        backend.prepare(self.device)
        self.model = DsaForCausalLM.build(
            self.model_cfg, with_mtp=with_mtp, backend=backend,
            dtype=self.dtype, device=self.device,
            shard=(lambda m: shard_model(m, self.groups, config.parallel)) if sharded else None,
        )
        load_weights(
            self.model, path, self.model_cfg, self.dtype,
            narrow=checkpoint_narrower(self.model_cfg, self.groups, config.parallel),
            first_expert=first_expert(self.model_cfg, self.groups, config.parallel),
        )
        self.num_blocks = self._num_blocks()
        self.caches = self._allocate_caches(self.num_blocks)
        self.connector = self._kv_connector()  # None without a P/D --kv-transfer-config
        self.copier = self._host_tier()  # None without --kv-offloading-size
        self.requests: dict[str, _ReqState] = {}
        self._seed_counter = config.seed
        spec = config.speculative
        self.drafter = None if spec is None else MtpDrafter(
            self.model, self.caches, spec.num_speculative_tokens, self._decode_metadata)
        self._synthetic_rates = None if spec is None or not spec.synthetic else torch.tensor(
            spec.conditional_rates, dtype=torch.float32, device=self.device)

    # ---- set-up ---------------------------------------------------------------------------------
    def _num_blocks(self) -> int:
        cfg = self.config
        per_block = cache_bytes_per_block(self.model_cfg, self.model.num_cache_layers,
                                          self.block_size, cfg.cache.fp8, self.dtype)
        if cfg.cache.num_gpu_blocks is not None:
            return cfg.cache.num_gpu_blocks
        tokens_per_block = self.block_size * self.dcp_size
        blocks_per_seq = -(-cfg.scheduler.max_model_len // tokens_per_block)
        where = ""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - cfg.cache.gpu_memory_utilization)
            where = (f" ({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB on {self.device}, "
                     f"{cfg.cache.gpu_memory_utilization} of it usable)")
        else:
            need = per_block * blocks_per_seq * cfg.scheduler.max_num_seqs
            budget = min(_CPU_KV_BUDGET_BYTES, need)
        num = int(budget // per_block)
        if num < blocks_per_seq:
            raise ValueError(
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
        caches = []
        for i in range(self.model.num_cache_layers):
            if fp8:
                row = formats.mla_row_bytes(m.kv_lora_rank, m.qk_rope_head_dim)
                kv = torch.zeros(num_blocks, b, row, dtype=torch.uint8, device=self.device)
                index = torch.zeros(
                    num_blocks, b * (m.index_head_dim + 4), dtype=torch.uint8, device=self.device
                )
            else:
                kv = torch.zeros(
                    num_blocks, b, m.kv_cache_width, dtype=self.dtype, device=self.device
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

    def kv_row_bytes(self) -> int:
        """Bytes of one token over every cache layer of this rank (what P/D moves per row)."""
        from dsaserve.disagg.kvio import row_bytes

        return row_bytes(self.caches).per_token

    def kv_bytes_received(self) -> int:
        """Bytes this rank READ from prefill engines so far (P/D; tests check the layouts')."""
        return self.connector.bytes_received if self.connector is not None else 0

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
        # 0. P/D: prompts' KV read from prefill engines before anything reads it; held blocks
        #    their consumers have read (disagg/connector.py)
        if self.connector is not None:
            done, failed = self.connector.receive(so.kv_recvs)
            sent = self.connector.poll_sends()
            if so.is_empty and not so.kv_recvs and not sent:
                time.sleep(0.002)  # only held blocks or reads pending: do not spin empty steps
            return replace(self._execute_tiered(so), kv_recvs_done=done, kv_recvs_failed=failed,
                           kv_sends_done=sent)
        return self._execute_tiered(so)

    def _execute_tiered(self, so: SchedulerOutput) -> ModelRunnerOutput:
        # host-tier copies start first and overlap the forward (kv/copier.py)
        if self.copier is not None:
            self.copier.start(so)
            if so.is_empty:  # only copies in flight: wait for one rather than spin empty steps
                self.copier.wait_for_one()
            return self.copier.report(self._execute(so))
        return self._execute(so)

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        # 1. apply the diff
        self._apply_diff(so)
        if so.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})

        # 2. the flattened batch and its attention metadata
        req_ids = list(so.num_scheduled_tokens)
        batch = self._prepare(req_ids, so.num_scheduled_tokens, so.scheduled_spec_token_ids)

        # 3. forward; then sample (or verify drafts) for requests whose known tokens are done
        hidden = self.model(batch.input_ids, batch.meta, self.caches)  # [N, hidden]
        emitted, logprobs = self._sample(req_ids, batch, hidden)

        # 4. speculative decoding: the MTP layer drafts the next step's tokens
        drafts: dict[str, list[int]] = {}
        if self.drafter is not None:
            drafts = self.drafter.propose(hidden, batch.meta,
                                          self._draft_requests(req_ids, batch, emitted))
        return ModelRunnerOutput(sampled_token_ids=emitted, logprobs=logprobs,
                                 draft_token_ids=drafts)

    def _sample(self, req_ids: list[str], batch: _Batch, hidden: torch.Tensor
                ) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
        """Tokens emitted per request: one sampled at the last row, or (with drafts) the
        accepted drafts and one more token from the rejection sampler."""
        emitted: dict[str, list[int]] = {rid: [] for rid in req_ids}
        logprobs: dict[str, list[float]] = {}
        qsl = batch.query_start_loc
        plain = [r for r, rid in enumerate(req_ids) if batch.samples[r] and not batch.num_drafts[r]]
        if plain:
            logits = self.model.compute_logits(hidden[[qsl[r + 1] - 1 for r in plain]])  # [M, V]
            states = [self.requests[req_ids[r]] for r in plain]
            tokens, lps = sample(logits, [s.params for s in states], [s.generator for s in states])
            for r, tok, lp in zip(plain, tokens, lps, strict=True):
                emitted[req_ids[r]], logprobs[req_ids[r]] = [tok], [lp]
        verify = [r for r, rid in enumerate(req_ids) if batch.samples[r] and batch.num_drafts[r]]
        if verify:
            k = max(batch.num_drafts[r] for r in verify)
            # rows of each verifying request: its last token and its drafts ([M, k+1], padded
            # by repeating the last row; padded rows are never read)
            rows = [[min(qsl[r + 1] - 1 - batch.num_drafts[r] + i, qsl[r + 1] - 1)
                     for i in range(k + 1)] for r in verify]
            logits = self.model.compute_logits(hidden[torch.tensor(rows).flatten()])
            logits = logits.view(len(verify), k + 1, -1)  # [M, k+1, V]
            draft_ids = torch.tensor([self._drafts_of(batch, r, k) for r in verify],
                                     dtype=torch.int64, device=logits.device)  # [M, k]
            num_drafts = torch.tensor([batch.num_drafts[r] for r in verify], device=logits.device)
            states = [self.requests[req_ids[r]] for r in verify]
            runs = rejection_sample(logits, draft_ids, num_drafts, [s.params for s in states],
                                    [s.generator for s in states], self._synthetic_rates)
            # log-probabilities of the emitted tokens (token i of a run comes from row i)
            picked = torch.tensor([(run + [0] * (k + 1))[: k + 1] for run in runs],
                                  device=logits.device)  # [M, k+1]
            lps = logits.log_softmax(-1).gather(-1, picked[..., None])[..., 0].tolist()
            for m, (r, run) in enumerate(zip(verify, runs, strict=True)):
                emitted[req_ids[r]] = run
                logprobs[req_ids[r]] = lps[m][: len(run)]
        return emitted, logprobs

    @staticmethod
    def _drafts_of(batch: _Batch, r: int, k: int) -> list[int]:
        """Request r's drafts, padded with −1 to k."""
        d = batch.num_drafts[r]
        drafts = batch.step_tokens[r][len(batch.step_tokens[r]) - d:] if d else []
        return drafts + [-1] * (k - d)

    def _draft_requests(self, req_ids: list[str], batch: _Batch,
                        emitted: dict[str, list[int]]) -> list[DraftRequest]:
        """What MTP step 0 reads per request: the token after each row's input (for the last
        accepted row, the token emitted this step) and where drafting continues from."""
        out = []
        qsl = batch.query_start_loc
        for r, rid in enumerate(req_ids):
            n, start, seq = qsl[r + 1] - qsl[r], batch.starts[r], batch.step_tokens[r]
            run = emitted[rid]
            nxt = seq[1 : n + 1]
            nxt += [run[-1] if run else 0] * (n - len(nxt))  # rows past the known tokens
            last_row = None
            if run:  # run = accepted drafts + one token: the last accepted row is len(run) − 1
                last_row = n - 1 - batch.num_drafts[r] + len(run) - 1
                nxt[last_row] = run[-1]
            out.append(DraftRequest(rid, qsl[r], tuple(nxt), last_row,
                                    start + (last_row if last_row is not None else 0)))
        return out

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
        return per_request(self.model.compute_logits(hidden)), mtp

    def _apply_diff(self, so: SchedulerOutput) -> None:
        for rid in so.finished_request_ids:
            self.requests.pop(rid, None)
        for new in so.new_requests:
            self._seed_counter += 1
            self.requests[new.request_id] = _ReqState(
                token_ids=list(new.token_ids),
                block_ids=list(new.block_ids),
                params=new.sampling_params,
                generator=make_generator(new.sampling_params, self.device, self._seed_counter),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in so.cached_requests:
            st = self.requests[cached.request_id]
            st.token_ids.extend(cached.new_token_ids)
            if cached.num_kept_blocks is not None:  # blocks of rejected drafts were given back
                del st.block_ids[cached.num_kept_blocks :]
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    def _prepare(self, req_ids: list[str], num_scheduled: dict[str, int],
                 spec: dict[str, tuple[int, ...]]) -> _Batch:
        """The step's rows: request r computes num_scheduled[r] tokens from its computed length
        on (its known tokens, then the drafts it verifies)."""
        tokens: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        step_tokens: list[list[int]] = []
        samples: list[bool] = []
        num_drafts: list[int] = []
        for rid in req_ids:
            st = self.requests[rid]
            start, n, drafts = st.num_computed_tokens, num_scheduled[rid], spec.get(rid, ())
            # this step's inputs and the token after them: known tokens, then drafts (a request
            # with drafts has one known token left; a prefill chunk has no drafts)
            seq = st.token_ids[start : start + n + 1] + list(drafts)
            tokens += seq[:n]
            starts.append(start)
            counts.append(n)
            step_tokens.append(seq)
            samples.append(start + n - len(drafts) == len(st.token_ids))
            num_drafts.append(len(drafts))
        input_ids, meta, qsl = self._metadata(req_ids, starts, counts, tokens)
        return _Batch(input_ids, meta, qsl, starts, step_tokens, num_drafts, samples)

    def _decode_metadata(self, req_ids: list[str], positions: list[int]) -> AttentionMetadata:
        """Metadata for one token per request at the given positions (MTP draft steps)."""
        return self._metadata(req_ids, positions, [1] * len(req_ids), [0] * len(req_ids))[1]

    def _metadata(self, req_ids: list[str], starts: list[int], counts: list[int],
                  tokens: list[int]) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Request r computes counts[r] tokens at positions starts[r]..; `tokens` [N] are their
        ids in the global order → (this rank's input ids, metadata, global query_start_loc)."""
        positions: list[int] = []
        req_index: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for r, (start, n) in enumerate(zip(starts, counts, strict=True)):
            positions += range(start, start + n)
            req_index += [r] * n
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        global_qsl = list(qsl)
        width = max(len(self.requests[rid].block_ids) for rid in req_ids)
        table = torch.full((len(req_ids), width), -1, dtype=torch.int32)
        for r, rid in enumerate(req_ids):
            ids = self.requests[rid].block_ids
            table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.int64)
        req_t = torch.tensor(req_index, dtype=torch.int64)
        tok_t = torch.tensor(tokens, dtype=torch.int64)
        slots = layout.slot_mapping(
            pos_t, req_t, table, self.block_size, self.dcp_size, self.dcp_rank, self.interleave
        )
        # The dense path reads a request's whole context from the local cache: only without DCP.
        use_dense = (
            not self.config.attention.sparse_mla_force_mqa
            and self.dcp_size == 1
            and max(seq_lens) <= self.model_cfg.index_topk
        )
        pcp_meta = None
        if self.groups.pcp.size > 1:
            # This rank computes only its share of the rows (replicated requests: all of them).
            query_lens = [qsl[r + 1] - qsl[r] for r in range(len(req_ids))]
            part = pcp.partition(query_lens, self.groups.pcp.size)
            local = part.local_index_tensor(self.groups.pcp.rank_in_group)
            counts_local = torch.bincount(req_t[local], minlength=len(req_ids)).tolist()
            qsl = [0]
            for c in counts_local:
                qsl.append(qsl[-1] + c)
            pcp_meta = PcpMetadata(
                local_index=local.to(dev),
                restore_index=part.restore_index.to(dev),
                padded_len=part.padded_len,
                write_slots=slots.to(dev),
                replicated=part.replicated, query_lens=tuple(query_lens),
            )
            tok_t, pos_t, req_t, slots = tok_t[local], pos_t[local], req_t[local], slots[local]
        meta = AttentionMetadata(
            positions=pos_t.to(dev),
            req_indices=req_t.to(dev),
            slot_mapping=slots.to(dev),
            block_table=table.to(dev),
            query_start_loc=tuple(qsl),
            seq_lens=tuple(seq_lens),
            block_size=self.block_size,
            use_dense=use_dense,
            dcp_size=self.dcp_size,
            dcp_rank=self.dcp_rank,
            interleave=self.interleave,
            pcp=pcp_meta,
        )
        return tok_t.to(dev), meta, global_qsl
