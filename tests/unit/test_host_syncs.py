"""Host syncs: the counter (engine/syncs.py) sees the reads that stall a GPU, and one decode step
of the tiny engine (plain, and verifying + drafting with MTP3, standard or synthetic) reads the
device once: the copy of its results (engine/step_results.py). The attention backend's own host
code is left out (on the CPU the reference backend serves; the GPU backend's is checked with
cuda_sync_debug)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.config import HiSparseConfig, SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine import step_results
from dsaserve.engine.engine import LLMEngine
from dsaserve.engine.syncs import SyncCounter

# MTP3 with synthetic acceptance (its stop-id drafts below min_tokens rejected on the device)
SYNTHETIC = SpecConfig(num_speculative_tokens=3, rejection_sample_method="synthetic",
                       synthetic_acceptance_rates=(0.9, 0.6, 0.3))


def test_counter_sees_host_reads_and_nothing_else():
    x = torch.arange(6.0)
    with SyncCounter() as syncs:
        y = (x * 2).sum()  # device work only
        _ = x[torch.tensor([0, 2])]  # integer index: no read
        assert syncs.count == 0
        y.item()
        x.tolist()
        x.nonzero()
        _ = x[x > 2]  # boolean mask: sized from the data
        if (x > 3).any():  # __bool__
            pass
        host = x.cpu()
        host.tolist()  # already on the host: free
    assert syncs.count == 6, syncs.report()
    assert "test_host_syncs.py" in syncs.report()


def test_counter_excludes_paths():
    with SyncCounter(exclude=("engine/",)) as syncs:
        step_results.read_back(step_results.DeviceSamples(
            [0], torch.tensor([5]), torch.tensor([-0.5]), [], torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1)), None)
    assert syncs.count == 0


def test_read_back_unpacks_every_part():
    samples = step_results.DeviceSamples(
        plain=[2], plain_tokens=torch.tensor([7]), plain_logprobs=torch.tensor([-0.25]),
        verify=[0, 1], accepted=torch.tensor([2, 0]),
        emitted=torch.tensor([[4, 5, 6, 0], [9, 0, 0, 0]]),
        emitted_logprobs=torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-4.0, 0.0, 0.0, 0.0]]))
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    with SyncCounter() as syncs:
        host = step_results.read_back(samples, drafts)
    assert syncs.count == 1
    assert host.tokens == {2: [7], 0: [4, 5, 6], 1: [9]}
    assert host.logprobs == {2: [-0.25], 0: [-1.0, -2.0, -3.0], 1: [-4.0]}
    assert host.drafts == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert host.top == {}
    # with a top-2: the plain row, then each verifying request's k + 1 = 4 rows
    rows = 1 + 2 * 4
    ids = torch.arange(rows * 2).view(rows, 2)
    top = dataclasses.replace(samples, top_ids=ids, top_logprobs=-ids.float() / 8)
    with SyncCounter() as syncs:
        host = step_results.read_back(top, drafts)
    assert syncs.count == 1
    assert host.drafts == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]

    def row(i: int) -> tuple[tuple[int, float], ...]:
        return ((2 * i, -2 * i / 8), (2 * i + 1, -(2 * i + 1) / 8))

    # request 0 emitted 3 tokens (rows 1-3), request 1 one (row 5)
    assert host.top == {2: [row(0)], 0: [row(1), row(2), row(3)], 1: [row(5)]}


# min_tokens 10: stop ids masked on the device; logprobs 3: the step's top-k in the same copy;
# step_log: --step-log on (the step's stats and events, nothing read)
@pytest.mark.parametrize(("min_tokens", "logprobs", "step_log"), [
    (0, None, False), (10, None, False), (0, 3, False), (10, 3, False),
    (0, None, True), (10, 3, True)])
@pytest.mark.parametrize("k", [None, 3, "synthetic"])
def test_decode_step_reads_the_device_once(engine_config, model_dirs, tmp_path, k, logprobs,
                                           min_tokens, step_log):
    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=4)
    if step_log:
        cfg = dataclasses.replace(cfg, step_log=str(tmp_path / "steps.jsonl"))
    if k is not None:
        cfg = dataclasses.replace(cfg, speculative=SYNTHETIC if k == "synthetic"
                                  else SpecConfig(num_speculative_tokens=k))
    engine = LLMEngine.from_config(cfg)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             logprobs=logprobs),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, top_k=5, ignore_eos=True)]
    # stop ids are what min_tokens masks; without it they would only end requests early
    # (synthetic acceptance takes drafts whatever they are: r0 could end before the step checked)
    params = [dataclasses.replace(p, min_tokens=min_tokens,
                                  stop_token_ids=(7, 8) if min_tokens else ())
              for p in params]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", list(range(5, 30 + 9 * i)), p)
    for _ in range(3):  # prefill, then decode steps (with MTP: drafts to verify)
        engine.step()
    so = engine.scheduler.schedule()
    assert len(so.num_scheduled_tokens) == len(params), "a request ended before the step checked"
    assert all(n == 1 + len(so.scheduled_spec_token_ids.get(rid, ()))
               for rid, n in so.num_scheduled_tokens.items()), "not a decode step"
    if k is not None:
        assert so.scheduled_spec_token_ids, "no drafts verified"
    with SyncCounter(exclude=("kernels/",)) as syncs:
        out = engine.runner.execute(so)
    assert syncs.count == 1, syncs.report()
    assert "step_results.py" in syncs.report()
    assert bool(engine.runner.sampling.num_masking) == bool(min_tokens)
    if logprobs is not None:
        assert all(len(top) == 3 for tops in out.top_logprobs.values() for top in tops)
        assert out.top_logprobs.keys() == out.sampled_token_ids.keys()
    engine.scheduler.update_from_output(so, out)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert bool(step_log) == (tmp_path / "steps.jsonl").exists()


@pytest.mark.parametrize(("min_tokens", "step_log"), [(0, False), (10, False), (0, True)])
@pytest.mark.parametrize("k", [None, 3, "synthetic"])
def test_async_decode_step_reads_the_device_once(engine_config, model_dirs, tmp_path, k,
                                                 min_tokens, step_log):
    """--async-scheduling: launching step k + 1 (its inputs gathered on the device from step k's
    samples; with MTP3 also its drafts, and its rows moved back by the drafts step k rejected)
    reads nothing; reading step k's results is the one sync, after the launch. The same with
    --step-log (its lines written from host-known values)."""
    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=4)
    if step_log:
        cfg = dataclasses.replace(cfg, step_log=str(tmp_path / "steps.jsonl"))
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler,
                                                                 async_scheduling=True))
    if k is not None:
        cfg = dataclasses.replace(cfg, speculative=SYNTHETIC if k == "synthetic"
                                  else SpecConfig(num_speculative_tokens=k))
    engine = LLMEngine.from_config(cfg)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(5, 30 + 9 * i)),
                           SamplingParams(max_tokens=12, temperature=0.7 * i, seed=i,
                                          ignore_eos=True, min_tokens=min_tokens,
                                          stop_token_ids=(7, 8)))
    for _ in range(3):  # prefill, then decode steps, one in flight
        engine.step()
    so = engine.scheduler.schedule()
    assert all(n == 1 + len(so.scheduled_spec_token_ids.get(rid, ()))
               for rid, n in so.num_scheduled_tokens.items()), "not a decode step"
    if k is not None:
        assert so.scheduled_spec_token_ids, "no drafts verified"
    with SyncCounter(exclude=("kernels/",)) as launch:
        pending = engine.executor.submit(so)
    assert launch.count == 0, launch.report()
    assert bool(engine.runner.sampling.num_masking) == bool(min_tokens)
    engine._in_flight.append((so, pending))
    prev_so, prev = engine._in_flight.popleft()
    with SyncCounter(exclude=("kernels/",)) as read:
        out = prev.result()
    assert read.count == 1, read.report()
    assert "step_results.py" in read.report()
    engine.scheduler.update_from_output(prev_so, out)
    with SyncCounter(exclude=("kernels/",)) as whole:  # a whole engine step: the same one
        engine.step()
    assert whole.count == 1, whole.report()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert bool(step_log) == (tmp_path / "steps.jsonl").exists()


@pytest.mark.parametrize("mla_pages", [None, 12])
def test_hisparse_decode_step_reads_the_device_once(engine_config, model_dirs, mla_pages):
    """A HiSparse decode step with misses (contexts beyond the hot buffer), its MLA pages
    spilling or not: the residency, the fetch and the mirror of the rows written into the host
    pool read nothing (on CUDA both moves are zero-copy kernels; kv/hisparse/fetch.py's CPU
    fallback sizes its gather from the data, excluded); the results' copy is the one sync."""
    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=4, max_model_len=160)
    topk = cfg.model.index_topk
    att = dataclasses.replace(cfg.attention, hisparse_device_buffer_size=topk,
                              hisparse_device_mla_pages=mla_pages, hisparse_config_given=True)
    engine = LLMEngine.from_config(dataclasses.replace(
        cfg, attention=att, hisparse=HiSparseConfig(host_pool_bytes=16 << 20)))
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        engine.add_request(f"r{i}", torch.randint(4, 512, (60 + 13 * i,), generator=g).tolist(),
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    so = engine.scheduler.schedule()
    assert set(so.num_scheduled_tokens.values()) == {1}, "not a decode step"
    missed = int(engine.runner.hisparse.rows_missed)
    with SyncCounter(exclude=("kernels/", "kv/hisparse/fetch.py")) as syncs:
        out = engine.runner.execute(so)
    assert syncs.count == 1, syncs.report()
    assert int(engine.runner.hisparse.rows_missed) > missed, "no row was fetched"
    engine.scheduler.update_from_output(so, out)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()


def test_residency_step_reads_nothing_from_the_device():
    """HiSparse's residency step with the LRU stamp as a device tensor (the runtime's): no read,
    so the step keeps no host state per layer."""
    from dsaserve.kv.hisparse.residency import resolve_step

    topk = torch.tensor([[4, 9, -1, 2], [7, 4, 1, -1], [3, 3, 3, 3]])
    region = torch.tensor([0, 0, -1])
    rank = torch.tensor([0, 1, 0])
    token = torch.tensor([[9, -1, 5, 1, -1, 8, 0, -1]])
    stamp = torch.tensor([[3, -1, 1, 2, -1, 1, 0, -1]])
    now = torch.tensor(4)
    with SyncCounter() as syncs:
        out = resolve_step(topk, region, rank, token, stamp, now, 2)
        now.add_(1)
    assert syncs.count == 0, syncs.report()
    # hits 9, 1; misses 2, 4, 7 into the empty slots 1, 4, 7 (empty before least recently used)
    assert out.slot_token.tolist() == [[9, 2, 5, 1, 4, 8, 0, 7]]
    assert out.hot_slots.tolist() == [[4, 0, -1, 1], [7, 4, 3, -1], [-1, -1, -1, -1]]
