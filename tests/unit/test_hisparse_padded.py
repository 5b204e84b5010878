"""HiSparse decode through the padded path (engine/decode_graph.py with kv/hisparse/padded.py)
on the CPU: decode-only steps run at a capture size over static buffers, every request slot
tracked, padding and page-reading slots in the trash region. Greedy output equals
--enforce-eager's and the all-GPU engine's with misses (contexts beyond the hot buffer), with
batches mixing hot and page-reading requests, with spilled MLA pages, bf16 and fp8_ds_mla,
plain and MTP3 (drafts through the padded path too), sync and --async-scheduling. Every
invariant (host pool, hot-slot bytes, index groups' tables, page map) is checked after every
step. Replays of captured graphs are checked on a GPU (tests/gpu/test_hisparse_graph_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from test_decode_graph import warm_up_at

from dsaserve.config import CompilationConfig, HiSparseConfig, SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine

HOST = HiSparseConfig(host_pool_bytes=16 << 20)


@dataclass(frozen=True)
class Case:
    preset: str
    kv: str = "auto"
    dtype: str = "float32"
    spec: int = 0
    spill: bool = False  # HiSparse spilling: 4-token blocks, fewer MLA pages than blocks
    async_scheduling: bool = False


_CASES = {
    "bf16-misses": Case("tiny-glm5", dtype="bfloat16"),
    "fp8-misses": Case("tiny-dsv32", kv="fp8_ds_mla"),
    "spill": Case("tiny-glm5", spill=True),
    "fp8-spill": Case("tiny-dsv32", kv="fp8_ds_mla", spill=True),
    "mtp3": Case("tiny-glm5", spec=3),
    "fp8-mtp3": Case("tiny-glm5", kv="fp8_ds_mla", spec=3),
    "spill-mtp3": Case("tiny-glm5", spec=3, spill=True),
    "fp8-spill-mtp3": Case("tiny-glm5", kv="fp8_ds_mla", spec=3, spill=True),
    "async": Case("tiny-glm5", async_scheduling=True),
    "async-spill": Case("tiny-dsv32", kv="fp8_ds_mla", spill=True, async_scheduling=True),
    "async-mtp3": Case("tiny-glm5", spec=3, async_scheduling=True),
    "async-spill-mtp3": Case("tiny-glm5", kv="fp8_ds_mla", spec=3, spill=True,
                             async_scheduling=True),
}


def _prompts(case: Case, topk: int) -> list[list[int]]:
    """Three requests (no capture size: a padding slot), the last short, so that it reads
    its GPU pages while the others read their hot buffers and turns hot later (mixed slots)."""
    g = torch.Generator().manual_seed(17)
    buffer = (1 + case.spec) * topk
    lens = [buffer + 14, buffer + 29, buffer - (4 if case.spec else 2)]
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in lens]


def _config(engine_config, model_dir, case: Case, *, hisparse: bool, eager: bool):
    b = 4 if case.spill else 16
    max_model_len = 128 if case.spill and case.spec else 64 if case.spill else 160
    cfg = engine_config(model_dir, kv_cache_dtype=case.kv, dtype=case.dtype, block_size=b,
                        num_blocks=100 if case.spill else 64, max_model_len=max_model_len,
                        max_num_seqs=8)
    sizes = (4, 8, 16, 32) if case.spec else (1, 2, 4, 8)
    cfg = replace(cfg, compilation=CompilationConfig(enforce_eager=True) if eager
                  else CompilationConfig(cudagraph_capture_sizes=sizes))
    if case.spec:
        cfg = replace(cfg, speculative=SpecConfig(num_speculative_tokens=case.spec))
    if case.async_scheduling:
        cfg = replace(cfg, scheduler=replace(cfg.scheduler, async_scheduling=True))
    if not hisparse:
        return cfg
    topk = cfg.model.index_topk
    # the smallest hot buffer (top-k per query row): misses at every step of a long decoder;
    # spilling: cdiv(max_model_len + lookahead, B) MLA pages, the least the engine accepts
    pages = -(-(max_model_len + max(case.spec - 1, 0)) // b) if case.spill else None
    att = replace(cfg.attention, hisparse_device_buffer_size=(1 + case.spec) * topk,
                  hisparse_device_mla_pages=pages, hisparse_config_given=True)
    return replace(cfg, attention=att, hisparse=HOST)


@pytest.fixture
def run(generate_checked):
    """run(engine, prompts, params) → (outputs, each padded step's (size, rows per request,
    which requests read through their hot buffer)); every invariant checked after each step."""
    def go(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
           ) -> tuple[list[list[int]], list[tuple[int, tuple[int, ...], tuple[bool, ...]]]]:
        graphs = engine.runner.decode_graphs
        padded: list[tuple[int, tuple[int, ...], tuple[bool, ...]]] = []
        if graphs is not None:
            forward = graphs.forward

            def spy(size, counts, *args):
                hidden = forward(size, counts, *args)
                hot = graphs.hisparse.slot_hot[: len(counts)].tolist() if graphs.hisparse else []
                padded.append((size, tuple(counts), tuple(hot)))
                return hidden

            graphs.forward = spy
        out = generate_checked(engine, prompts, params)
        rt = engine.runner.hisparse
        if rt is not None:
            assert not rt.entries and len(rt._free_blocks) + len(rt.kept) == rt.num_host_blocks
        return out, padded

    return go


@pytest.mark.parametrize("name", list(_CASES))
def test_padded_hisparse_equals_eager_and_all_gpu(run, model_dirs, draftable_dirs,
                                                  engine_config, name):
    case = _CASES[name]
    model_dir = (draftable_dirs if case.spec else model_dirs)[case.preset]
    params = SamplingParams(max_tokens=16 if case.spec else 12, temperature=0.0,
                            ignore_eos=True)
    topk = engine_config(model_dir).model.index_topk
    prompts = _prompts(case, topk)
    all_gpu, _ = run(LLMEngine.from_config(_config(engine_config, model_dir, case,
                                                    hisparse=False, eager=True)),
                      prompts, params)
    eager_engine = LLMEngine.from_config(_config(engine_config, model_dir, case, hisparse=True,
                                                 eager=True))
    assert eager_engine.runner.decode_graphs is None
    eager, _ = run(eager_engine, prompts, params)
    engine = LLMEngine.from_config(_config(engine_config, model_dir, case, hisparse=True,
                                           eager=False))
    got, steps = run(engine, prompts, params)
    assert got == eager == all_gpu
    assert all(len(o) == params.max_tokens for o in got)
    graphs, rt = engine.runner.decode_graphs, engine.runner.hisparse
    assert graphs.hisparse is not None
    assert graphs.num_steps == len(steps) > 2
    assert graphs.num_replays == graphs.num_draft_replays == 0  # no graphs on the CPU
    assert graphs.num_draft_steps == (len(steps) if case.spec else 0)
    q = 1 + case.spec
    assert any(len(c) * q < size for size, c, _ in steps), "no padding slot"
    assert any(any(hot) for *_, hot in steps), "no padded step read a hot buffer"
    assert any(any(hot) and not all(hot) for *_, hot in steps), "no padded step was mixed"
    assert 0 < int(rt.rows_from_host) <= int(rt.rows_missed)  # misses, most from the pool
    if case.spill:
        assert engine.scheduler.mla.num_spills > 0


@torch.inference_mode()  # as DecodeGraphs.forward runs it
def test_fill_maps_slots_to_their_regions_and_the_rest_to_the_trash():
    """The module's picture: slot 0 hot (region 5), slot 1 tracked but reading its pages
    (region 3), slot 2 hot (region 1), slot 3 padding; q = 2, trash region 7. A second,
    smaller step over the same buffers leaves nothing of the first in its slots."""
    from dsaserve.kv.hisparse.padded import PaddedHiSparse
    from dsaserve.kv.hisparse.runtime import HiSparseStep

    def t(x):
        return torch.tensor(x, dtype=torch.int64)

    padded = PaddedHiSparse(7, max_size=8, q=2, device=torch.device("cpu"))
    step = HiSparseStep(
        tracked_regions=t([5, 3, 1]), tracked_requests=t([0, 1, 2]), tracked_from=t([40, 9, 70]),
        hot_regions=t([5, 1]), hot_requests=t([0, 2]), mirrored_upto=t([40, 70]),
        row_region=t([0, 0, -1, 1, 1]), row_rank=t([0, 1, 0, 0, 1]),
        row_hot=t([0, 0, -1, 1, 1]) >= 0, max_rows=2, num_hot=2, num_reqs=3)
    padded.fill(step, 4)
    s = padded.step(4)
    assert s.padded and s.num_hot == s.num_reqs == 4 and s.max_rows == 2
    assert s.tracked_regions.tolist() == [5, 3, 1, 7]
    assert s.tracked_requests.tolist() == s.hot_requests.tolist() == [0, 1, 2, 3]
    assert s.tracked_from.tolist()[:3] == [40, 9, 70]
    assert s.hot_regions.tolist() == [5, 7, 1, 7]
    assert s.mirrored_upto.tolist() == [40, 0, 70, 0]
    assert s.row_region.tolist() == [0, 0, -1, -1, 2, 2, -1, -1]
    assert s.row_rank.tolist() == [0, 1] * 4
    assert s.row_hot.tolist() == [True, True, False, False, True, True, False, False]
    draft = padded.draft_step(4, t([44, 10, 72, 0]))
    assert draft.row_region.tolist() == [0, -1, 2, -1] and draft.row_rank.tolist() == [0] * 4
    assert draft.row_hot.tolist() == [True, False, True, False]
    assert draft.tracked_from.tolist() == [44, 10, 72, 0]
    assert draft.hot_regions.tolist() == [5, 7, 1, 7]
    # a step with one request reading its pages, then a step with none tracked
    padded.fill(replace(step, tracked_regions=t([2]), tracked_requests=t([0]),
                        tracked_from=t([3]), hot_regions=t([]), hot_requests=t([]),
                        mirrored_upto=t([]), row_region=t([-1]), row_rank=t([0]),
                        row_hot=t([-1]) >= 0, num_hot=0, num_reqs=1), 1)
    s = padded.step(1)
    assert (s.tracked_regions.tolist(), s.hot_regions.tolist()) == ([2], [7])
    assert s.row_region.tolist() == [-1, -1] and not s.row_hot.any()
    padded.fill(None, 2)
    s = padded.step(2)
    assert s.tracked_regions.tolist() == s.hot_regions.tolist() == [7, 7]
    assert not s.row_hot.any() and (s.row_region < 0).all()


@pytest.mark.parametrize("name", ["fp8-misses", "spill-mtp3", "fp8-spill-mtp3"])
def test_warm_up_with_hisparse_writes_nothing_a_step_reads(run, model_dirs, draftable_dirs,
                                                           engine_config, name):
    """HiSparse on (spilling too): the all-padding warm-up of every size, at start-up and
    between steps of requests reading hot buffers with misses, writes no cache, hot buffer,
    request region's residency tables or miss counter; the output is --enforce-eager's."""
    case = _CASES[name]
    model_dir = (draftable_dirs if case.spec else model_dirs)[case.preset]
    params = SamplingParams(max_tokens=16 if case.spec else 12, temperature=0.0,
                            ignore_eos=True)
    prompts = _prompts(case, engine_config(model_dir).model.index_topk)
    eager, _ = run(LLMEngine.from_config(_config(engine_config, model_dir, case, hisparse=True,
                                                 eager=True)), prompts, params)
    engine = LLMEngine.from_config(_config(engine_config, model_dir, case, hisparse=True,
                                           eager=False))
    warmed = warm_up_at(engine, (0, 3))  # step 3: decoding through the hot buffers
    got, steps = run(engine, prompts, params)
    assert got == eager
    sizes = engine.runner.decode_graphs.sizes
    assert warmed == [*reversed(sizes)] * 2 and len(steps) > 3
    assert engine.runner.decode_graphs.num_steps == len(steps)
