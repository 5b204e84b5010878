"""Every parallel mode against the single-rank runner, on gloo processes (CPU).

One fixed teacher-forced schedule mixes a chunked prefill continuation, a prompt shorter than 2N, a
one-token prompt, decode rows next to prefill rows and a long prefill whose queries need top-k; the
logits of every scheduled token must match the single rank within fp32 tolerance."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsaserve.config import ParallelConfig
from dsaserve.core import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from dsaserve.engine.runner import ModelRunner
from dsaserve.kv.layout import dcp_local_seq_len
from dsaserve.parallel.groups import ParallelGroups

pytestmark = pytest.mark.parallel

BLOCKS_PER_REQ = 8  # of 16 tokens: enough for 100 tokens even without DCP


def _schedule(vocab: int) -> tuple[dict[str, list[int]], list[dict[str, int]]]:
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(4, vocab, (30,), generator=g).tolist()
    tokens = {
        "a": prefix + torch.randint(4, vocab, (40,), generator=g).tolist(),  # 70
        "b": torch.randint(4, vocab, (3,), generator=g).tolist() + [7] * 3,  # 6
        "c": [9] + torch.randint(4, vocab, (4,), generator=g).tolist(),  # 5
        "d": prefix[:20] + torch.randint(4, vocab, (45,), generator=g).tolist(),  # 65
    }
    steps = [
        {"a": 37, "b": 3},  # chunked prefill + a prompt shorter than 2N
        {"a": 25, "b": 1, "c": 1},  # continuation, decode row, one-token prompt
        {"a": 8, "b": 1, "c": 1, "d": 50},  # mixed: decode rows next to long prefill rows
        {"b": 1, "c": 3, "d": 15},
    ]
    return tokens, steps


def run_schedule(runner: ModelRunner, tokens, steps
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The target's logits of every scheduled token, and the MTP layer's (its step 0 over the
    same rows, reading the next token of the schedule: the MTP follows the PCP partition)."""
    done = dict.fromkeys(tokens, 0)
    blocks = {rid: tuple(range(i * BLOCKS_PER_REQ, (i + 1) * BLOCKS_PER_REQ))
              for i, rid in enumerate(tokens)}
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in tokens}
    mtp_logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in tokens}
    seen: set[str] = set()
    for step in steps:
        new, cached = [], []
        for rid in step:
            if rid not in seen:
                new.append(
                    NewRequestData(rid, tuple(tokens[rid]), SamplingParams(), blocks[rid], 0)
                )
                seen.add(rid)
            else:
                cached.append(CachedRequestData(rid, (), (), done[rid]))
        so = SchedulerOutput(tuple(new), tuple(cached), dict(step), ())
        # the token after each row (0 after a request's last token: any id, the same everywhere)
        nxt = {rid: (tokens[rid][done[rid] + 1 : done[rid] + n + 1] + [0])[:n]
               for rid, n in step.items()}
        out, mtp = runner.execute_all_logits_mtp(so, nxt)
        for rid, n in step.items():
            logits[rid].append(out[rid].cpu())
            mtp_logits[rid].append(mtp[rid].cpu())
            done[rid] += n
    return ({rid: torch.cat(v) for rid, v in logits.items() if v},
            {rid: torch.cat(v) for rid, v in mtp_logits.items() if v})


def _worker(rank: int, world: int, init_file: str, config, out_path: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        groups = ParallelGroups.build(config.parallel, rank)
        runner = ModelRunner(config, groups=groups)
        tokens, steps = _schedule(config.model.vocab_size)
        result, mtp_result = run_schedule(runner, tokens, steps)
        written = sum(
            int((c.kv.view(-1, c.kv.shape[-1]).abs().sum(-1) > 0).sum()) for c in runner.caches[:1]
        )
        torch.save(
            {
                "logits": result,
                "mtp_logits": mtp_result,
                "rows_written_layer0": written,
                "indexer_rows": runner.model.backend.indexer_rows_scored,
                "experts_held": runner.experts_held(),
                "q_rows_held": runner.model.model.layers[0].self_attn.q_b_proj.weight.shape[0],
                "vocab_rows_held": (runner.model.model.embed_tokens.weight.shape[0],
                                    runner.model.lm_head.weight.shape[0]),
            },
            f"{out_path}.{rank}",
        )
    finally:
        dist.destroy_process_group()


def run_parallel(config, world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out = os.path.join(tmp, "rdzv"), os.path.join(tmp, "out")
        mp.start_processes(
            _worker,
            args=(world, init_file, config, out),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        return [torch.load(f"{out}.{r}") for r in range(world)]


@pytest.fixture(scope="module")
def single(model_dirs, engine_config_module):
    out = {}
    for kv in ("auto", "fp8_ds_mla"):
        cfg = engine_config_module(model_dirs["tiny-glm5"], kv)
        tokens, steps = _schedule(cfg.model.vocab_size)
        logits, mtp = run_schedule(ModelRunner(cfg), tokens, steps)
        out[kv], out[f"{kv}/mtp"] = logits, mtp
    return out


@pytest.fixture(scope="module")
def engine_config_module():
    from dsaserve.config import (
        AttentionConfig,
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )

    def build(model_dir, kv="auto", **parallel):
        return EngineConfig(
            str(model_dir),
            ModelConfig.from_file(model_dir),
            cache=CacheConfig(block_size=16, kv_cache_dtype=kv, num_gpu_blocks=40),
            scheduler=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128
            ),
            attention=AttentionConfig(sparse_mla_force_mqa=True),
            parallel=ParallelConfig(**parallel),
        )

    return build


CASES = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "pcp2": dict(prefill_context_parallel_size=2),
    "pcp2-ep": dict(prefill_context_parallel_size=2, enable_expert_parallel=True),
    "pcp2-dcp2": dict(prefill_context_parallel_size=2, decode_context_parallel_size=2),
    "pcp2-dcp2-i16": dict(
        prefill_context_parallel_size=2,
        decode_context_parallel_size=2,
        cp_kv_cache_interleave_size=16,
    ),
    "tp2-dcp2-agrs": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
    "tp2-dcp2-a2a-i16": dict(
        tensor_parallel_size=2,
        decode_context_parallel_size=2,
        dcp_comm_backend="a2a",
        cp_kv_cache_interleave_size=16,
    ),
    # N = 4, and PCP × TP with EP over all four ranks
    "pcp4-dcp4-ep": dict(
        prefill_context_parallel_size=4, decode_context_parallel_size=4, enable_expert_parallel=True
    ),
    "tp4-dcp4-a2a": dict(
        tensor_parallel_size=4, decode_context_parallel_size=4, dcp_comm_backend="a2a"
    ),
    "pcp2-tp2-dcp2-ep": dict(
        prefill_context_parallel_size=2,
        tensor_parallel_size=2,
        decode_context_parallel_size=2,
        enable_expert_parallel=True,
    ),
}


def _check(results, ref, tol=1e-4, mtp_ref=None):
    for res in results:
        for rid, want in ref.items():
            got = res["logits"][rid]
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < tol, (rid, err)
        for rid, want in (mtp_ref or {}).items():  # the MTP layer under the same layout
            got = res["mtp_logits"][rid]
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < tol, ("mtp", rid, err)


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_mode_matches_single_rank(model_dirs, engine_config_module, single, case):
    kwargs = CASES[case]
    cfg = engine_config_module(model_dirs["tiny-glm5"], **kwargs)
    world = cfg.parallel.world_size
    results = run_parallel(cfg, world)
    _check(results, single["auto"], mtp_ref=single["auto/mtp"])
    # Each rank allocated and loaded only its share of the weights.
    m, p = cfg.model, cfg.parallel
    for res in results:
        assert res["experts_held"] == m.n_routed_experts // (world if p.enable_expert_parallel
                                                              else 1)
        assert res["q_rows_held"] == m.num_attention_heads // p.tensor_parallel_size * m.qk_head_dim
        assert res["vocab_rows_held"] == (m.vocab_size // p.tensor_parallel_size,) * 2
    # Each DCP rank stores exactly its own tokens: 1/N of every request, ± one interleave run.
    dcp = cfg.parallel.decode_context_parallel_size
    lengths = [len(t) for t in _schedule(cfg.model.vocab_size)[0].values()]
    inter = cfg.parallel.cp_kv_cache_interleave_size
    for rank, res in enumerate(results):
        # rank = pcp_rank · tp + tp_rank; the DCP group is the PCP group, else the TP group
        pcp = cfg.parallel.prefill_context_parallel_size
        if dcp == 1:
            dcp_rank = 0
        else:
            dcp_rank = rank // cfg.parallel.tensor_parallel_size if pcp > 1 else rank % dcp
        want = sum(dcp_local_seq_len(n, dcp, dcp_rank, inter) for n in lengths)
        assert res["rows_written_layer0"] == want
        assert abs(want - sum(lengths) / dcp) <= len(lengths) * inter


def test_pcp_ranks_score_only_their_own_query_rows(model_dirs, engine_config_module):
    """With PCP the indexer is never replicated: split rows are scored by one rank each, and only
    replicated (decode / short) rows by every rank."""
    from dsaserve.parallel.pcp import partition

    n = 2
    cfg = engine_config_module(model_dirs["tiny-glm5"], prefill_context_parallel_size=n)
    tokens, steps = _schedule(cfg.model.vocab_size)
    # run_schedule runs the MTP layer too: its own indexer also scores only this rank's rows
    layers = len(cfg.model.full_indexer_layers) + 1
    want = [0] * n
    for step in steps:
        part = partition(list(step.values()), n)
        for r in range(n):
            want[r] += layers * len(part.local_indices[r])
    results = run_parallel(cfg, n)
    assert [res["indexer_rows"] for res in results] == want
    total_rows = sum(sum(s.values()) for s in steps)
    assert sum(want) < n * layers * total_rows  # strictly less work than replicating the indexer


def test_pcp_dcp_with_fp8_cache(model_dirs, engine_config_module, single):
    cfg = engine_config_module(
        model_dirs["tiny-glm5"],
        "fp8_ds_mla",
        prefill_context_parallel_size=2,
        decode_context_parallel_size=2,
    )
    # Ranks compute a token's latent in a different batch than the single rank does, so fp32
    # results differ in the last bit and an e4m3 rounding can flip: one fp8 ulp, not a layout bug
    # (a misplaced row or scale gives errors of order 1).
    _check(run_parallel(cfg, 2), single["fp8_ds_mla"], tol=5e-3, mtp_ref=single["fp8_ds_mla/mtp"])


@pytest.fixture(scope="module")
def fp8_glm(tmp_path_factory):
    from dsaserve.model.make_model import make_model

    return make_model("tiny-glm5", tmp_path_factory.mktemp("fp8") / "tiny-glm5", fp8=True)


@pytest.mark.parametrize("case", ["tp2", "tp2-ep", "tp4-dcp4-a2a"])
def test_fp8_weights_sharded_match_single_rank(fp8_glm, engine_config_module, case):
    """Matrices kept in FP8 (model/fp8.py), cut by TP mid-block (rank 1's q_b rows start 64 rows
    into a 128-row block; its experts' 32 rows at 32, its o_proj columns at 64) or by EP: each
    rank keeps the scale blocks covering its part, and the logits are the single rank's."""
    import dataclasses

    ref_cfg = dataclasses.replace(engine_config_module(fp8_glm), keep_fp8_weights=True)
    tokens, steps = _schedule(ref_cfg.model.vocab_size)
    ref, mtp_ref = run_schedule(ModelRunner(ref_cfg), tokens, steps)
    cfg = dataclasses.replace(engine_config_module(fp8_glm, **CASES[case]), keep_fp8_weights=True)
    _check(run_parallel(cfg, cfg.parallel.world_size), ref, mtp_ref=mtp_ref)
