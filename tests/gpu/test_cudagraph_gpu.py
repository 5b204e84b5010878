"""On a CUDA machine: graph replay equals eager (engine/cudagraph.py). Run on the device machine
with `pytest -m gpu tests/gpu/test_cudagraph_gpu.py`.

* GraphPool over a small function, replayed with fresh inputs at every capture size;
* the tiny model's decode forward (triton backend, fp8_ds_mla, with and without MTP3 verify
  rows) captured for one step's metadata: every kernel of the decode path is capturable and the
  replay gives eager's hidden states and argmax tokens;
* a decode step of the engine, under torch.cuda.set_sync_debug_mode("warn"), copies device data
  to the host no more often than the CPU counter says (the one copy of the results);
* the engine with graphs on (the runner's own padded decode path, engine/decode_graph.py) gives
  the greedy tokens of --enforce-eager, replaying captured graphs, with and without MTP3 (with
  MTP3 the drafts of every padded step replayed from their own graph too);
* every size's graph (and with MTP3 its drafts') is captured at start-up, largest first;
  decode steps at every batch size then replay and capture nothing;
* with --async-scheduling (graphs on), without and with MTP3: the same greedy tokens, the graphs
  replayed, and the launch of a decode step reads nothing on the host (its inputs, and with
  MTP3 its drafts and positions, gathered on the device)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from staggered import run_staggered, trained_config

from dsaserve.bench import steplog
from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.engine import cudagraph
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.syncs import SyncCounter
from dsaserve.model.presets import trained_model_dir
from dsaserve.tokenizer import Tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_graph_pool_replays_like_eager():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(64, 64, device="cuda", generator=g)
    pool = cudagraph.GraphPool(lambda x, idx: (x @ w).relu()[idx].sum(-1))
    sizes = (1, 2, 4, 8)
    for size in reversed(sizes):
        pool.capture(size, {"x": torch.zeros(size, 64, device="cuda"),
                            "idx": torch.zeros(size, dtype=torch.int64, device="cuda")})
    for n in (1, 3, 5, 8):
        size = cudagraph.padded_size(n, sizes)
        x = torch.randn(n, 64, device="cuda", generator=g)
        idx = torch.randperm(n, device="cuda", generator=g)
        got = pool.replay(size, {"x": cudagraph.pad_to(x, size, 0.0),
                                 "idx": cudagraph.pad_to(idx, size, 0)})[:n]
        torch.testing.assert_close(got, (x @ w).relu()[idx].sum(-1))


def _engine(model_dirs, k):
    d = model_dirs["tiny-glm5"]
    cfg = EngineConfig(str(d), ModelConfig.from_file(d),
                       cache=CacheConfig(block_size=64, num_gpu_blocks=64,
                                         kv_cache_dtype="fp8_ds_mla"),
                       scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512),
                       attention=AttentionConfig(backend="triton", sparse_mla_force_mqa=True),
                       dtype="bfloat16", device="cuda")
    if k:
        cfg = dataclasses.replace(cfg, speculative=SpecConfig(num_speculative_tokens=k))
    engine = LLMEngine.from_config(cfg)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8] * (20 + 5 * i),
                           SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    return engine


@pytest.mark.parametrize("k", [0, 3])
def test_decode_forward_replays_like_eager(model_dirs, k):
    engine = _engine(model_dirs, k)
    runner = engine.runner
    so = engine.scheduler.schedule()
    runner._apply_diff(so)
    req_ids = list(so.num_scheduled_tokens)
    batch = runner._prepare(req_ids, so.num_scheduled_tokens, so.scheduled_spec_token_ids)
    eager = runner.model(batch.input_ids, batch.meta, runner.caches).clone()
    pool = cudagraph.GraphPool(lambda ids: runner.model(ids, batch.meta, runner.caches))
    size = batch.input_ids.shape[0]
    pool.capture(size, {"ids": batch.input_ids})
    replayed = pool.replay(size, {"ids": batch.input_ids})
    torch.testing.assert_close(replayed.float(), eager.float(), rtol=1e-2, atol=1e-2)
    logits = runner.model.compute_logits
    assert torch.equal(logits(replayed).argmax(-1), logits(eager).argmax(-1))


@pytest.mark.parametrize("k", [0, 3])
def test_decode_step_device_to_host_copies(model_dirs, k):
    engine = _engine(model_dirs, k)
    so = engine.scheduler.schedule()
    with SyncCounter(exclude=("kernels/",)) as syncs:
        out = engine.runner.execute(so)
    assert syncs.count == 1, syncs.report()
    engine.scheduler.update_from_output(so, out)
    # what CUDA itself reports (host → device copies of the metadata included: a device block
    # table kept from the scheduler's diff would remove those, docs/decode.md); printed for
    # the record
    so = engine.scheduler.schedule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.runner.execute(so)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    print(f"k={k}: {len(caught)} synchronizing CUDA calls in one decode step")


def _generate(compilation: CompilationConfig, k: int, *, async_scheduling: bool = False,
              step_log: str | None = None) -> tuple[dict[str, list[int]], LLMEngine]:
    """The trained tiny model (confident logits: bf16 batch-shape differences do not flip its
    argmax) on the triton backend, fp8_ds_mla KV; five requests of different lengths joining
    at three steps and leaving at different ones: running batches of 1 to 5 requests, padded
    (3 → 4, 5 → 8 requests; with MTP3 each request's slot holds 4 rows)."""
    cfg = trained_config(compilation, k, async_scheduling, step_log=step_log)
    engine = LLMEngine.from_config(cfg)
    return run_staggered(engine, Tokenizer.from_pretrained(cfg.model_path)), engine


@pytest.mark.parametrize("k", [0, 3])
def test_engine_graphs_give_eager_tokens(k):
    eager_out, eager = _generate(CompilationConfig(enforce_eager=True), k)
    assert eager.runner.decode_graphs is None
    graph_out, engine = _generate(CompilationConfig(), k)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.capture
    assert graphs.num_replays > 0 and graphs.num_replays == graphs.num_steps
    # with MTP3 every padded step's drafts replay their graph; none without
    assert graphs.num_draft_replays == graphs.num_draft_steps == (graphs.num_steps if k else 0)
    print(f"k={k}: {graphs.num_replays} replays ({graphs.num_draft_replays} of drafts) over "
          f"sizes {sorted(graphs._graphs)}")
    assert graph_out == eager_out


@pytest.mark.parametrize("k", [0, 3])
def test_every_graph_is_captured_at_start_up(k, monkeypatch):
    """The runner captures every size (with MTP3 the drafts too) when it is built, largest
    first, in one pool; the decode steps of 1 to 5 requests then replay and capture none."""
    captures: list[int] = []
    capture = cudagraph.capture

    def counted(fn, pool=None, warmup=2):
        captures.append(1)
        return capture(fn, pool, warmup)

    monkeypatch.setattr(cudagraph, "capture", counted)
    at_start_up: list[tuple[list[int], list[int], int]] = []
    build = LLMEngine.from_config

    def built(config):
        engine = build(config)
        graphs = engine.runner.decode_graphs
        at_start_up.append((list(graphs._graphs), list(graphs._draft_graphs), len(captures)))
        return engine

    monkeypatch.setattr(LLMEngine, "from_config", built)
    _, engine = _generate(CompilationConfig(), k)
    graphs = engine.runner.decode_graphs
    largest_first = sorted(graphs.sizes, reverse=True)
    assert graphs.capture and len(largest_first) > 2
    assert at_start_up == [(largest_first, largest_first if k else [], len(captures))]
    assert list(graphs._graphs) == largest_first  # no step added a size
    assert graphs.num_steps > 0 and graphs.num_replays == graphs.num_steps
    assert graphs.num_draft_replays == (graphs.num_steps if k else 0)


@pytest.mark.parametrize("k", [0, 3])
def test_async_scheduling_gives_sync_tokens_with_graphs(k):
    """With MTP3 the step after a verifying one takes its token and drafts on the device and
    moves its rows back by the drafts rejected: the same greedy tokens, graphs replayed
    (drafts' graphs too)."""
    sync_out, _ = _generate(CompilationConfig(), k)
    async_out, engine = _generate(CompilationConfig(), k, async_scheduling=True)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.num_replays > 0
    assert graphs.num_draft_replays > 0 if k else graphs.num_draft_replays == 0
    assert async_out == sync_out


@pytest.mark.parametrize("k", [0, 3])
def test_async_decode_launch_does_not_sync(k):
    d = trained_model_dir()
    cfg = EngineConfig(str(d), ModelConfig.from_file(d),
                       cache=CacheConfig(block_size=64, num_gpu_blocks=64,
                                         kv_cache_dtype="fp8_ds_mla"),
                       scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512,
                                                 async_scheduling=True),
                       attention=AttentionConfig(backend="triton", sparse_mla_force_mqa=True),
                       dtype="bfloat16", device="cuda")
    if k:
        cfg = dataclasses.replace(cfg, speculative=SpecConfig(num_speculative_tokens=k))
    engine = LLMEngine.from_config(cfg)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(5, 40 + 9 * i)),
                           SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # prefill, decode steps (graphs captured), one in flight
        engine.step()
    so = engine.scheduler.schedule()
    with SyncCounter(exclude=("kernels/",)) as launch:
        pending = engine.executor.submit(so)
    assert launch.count == 0, launch.report()
    engine._in_flight.append((so, pending))
    prev_so, prev = engine._in_flight.popleft()
    engine.scheduler.update_from_output(prev_so, prev.result())
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [0, 3])
def test_step_log_times_the_gpu(tmp_path, k, async_scheduling):
    """--step-log on a GPU: every line has its forward's and its step's GPU time from CUDA
    events (read once passed, or at shutdown), decode steps replay their graph (and with MTP3
    the drafts' graph), and the tokens are those of the engine without the log."""
    plain, _ = _generate(CompilationConfig(), k, async_scheduling=async_scheduling)
    path = tmp_path / "steps.jsonl"
    logged, engine = _generate(CompilationConfig(), k, async_scheduling=async_scheduling,
                               step_log=str(path))
    engine.shutdown()
    assert logged == plain
    lines = [json.loads(t) for t in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(len(lines)))
    for line in lines:
        assert 0 < line["gpu_forward_ms"] <= line["gpu_step_ms"], line
    # every padded step replays its graph (captured at start-up)
    padded = [line for line in lines if line["padded_size"] is not None]
    assert padded and all(line["graph"] for line in padded)
    assert all(line["draft_graph"] == bool(k) for line in padded)
    assert not any(line["graph"] for line in lines if line["padded_size"] is None)
    print(steplog.table(steplog.summarise(lines), f"k={k}, async {async_scheduling}"))
