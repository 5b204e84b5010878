"""The padded decode path (engine/decode_graph.py) on the CPU: decode-only steps run at a capture
size through static buffers, padding rows copying live ones and writing nowhere. The engine's
greedy output with it equals --enforce-eager's (no padding) over many steps, with batches that
are not capture sizes, requests joining and leaving between steps, with MTP3 (drafts cut near
max_tokens: padding inside a request) and without, bf16 and fp8_ds_mla KV; no block leaks.
With MTP the drafts of every padded step run at its size too (spec/mtp.py: draft_chain over
the static buffers), drafts accepted or not, up to max_model_len; the MTP layer's KV is eager's.
Replays of captured graphs are checked on a GPU (tests/gpu/test_cudagraph_gpu.py)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from dsaserve.config import CompilationConfig, SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.decode_graph import pad_layout
from dsaserve.engine.engine import LLMEngine


def test_pad_layout_copies_live_rows_into_request_slots():
    # the module's picture: rows 4, 2, 4 in slots of 4, size 16
    lay = pad_layout([4, 2, 4], 4, 16)
    assert lay.src_rows == [0, 1, 2, 3, 4, 5, 5, 5, 6, 7, 8, 9, 3, 3, 3, 3]
    assert lay.writes == [True] * 6 + [False] * 2 + [True] * 4 + [False] * 4
    assert lay.src_reqs == [0, 1, 2, 0]
    assert lay.out_rows == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    one = pad_layout([1, 1, 1], 1, 4)  # no drafts: one padding request
    assert (one.src_rows, one.writes, one.out_rows) == ([0, 1, 2, 0], [True] * 3 + [False],
                                                         [0, 1, 2])


@pytest.mark.parametrize("counts,q,size", [([5], 4, 8), ([1, 1, 1], 4, 8), ([1], 4, 6),
                                           ([], 1, 4), ([0], 1, 1)])
def test_pad_layout_refuses_what_does_not_fit(counts, q, size):
    with pytest.raises(ValueError, match="pad_layout"):
        pad_layout(counts, q, size)


# (max_tokens, the step it joins at): requests join while others decode and leave at
# different steps; 3 or 5 running requests are no capture size (1, 2, 4, 8 of each q)
_ARRIVALS = [(7, 0), (10, 0), (4, 0), (8, 2), (6, 4), (9, 4)]


def _run(config, prompts, prepare=None) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine.from_config(config)
    if prepare is not None:
        prepare(engine)
    sizes: list[tuple[int, tuple[int, ...]]] = []
    graphs = engine.runner.decode_graphs
    if graphs is not None:  # record the (size, rows per request) of every padded step
        forward = graphs.forward

        def spy(size, counts, *args):
            sizes.append((size, tuple(counts)))
            return forward(size, counts, *args)

        graphs.forward = spy
    outputs: dict[str, list[int]] = {}
    step = 0
    while step < 200:
        for i, (max_tokens, at) in enumerate(_ARRIVALS):
            if at == step:
                engine.add_request(f"r{i}", prompts[i], SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
        if step > max(at for _, at in _ARRIVALS) and not engine.has_unfinished_requests():
            break
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"
    engine.padded_steps = sizes
    return outputs, engine


# synthetic acceptance (the same seeded draws in both engines): drafts are accepted whatever the
# target says, so drafting continues from every row of a slot and the drafts are the output
_ACCEPTING = SpecConfig(num_speculative_tokens=3, rejection_sample_method="synthetic",
                        synthetic_acceptance_rates=(0.9, 0.6, 0.3))


@pytest.mark.parametrize("k,dtype,kv,accepting", [
    (0, "float32", "auto", False), (3, "float32", "auto", False),
    (3, "bfloat16", "auto", False), (0, "float32", "fp8_ds_mla", False),
    (3, "float32", "fp8_ds_mla", False), (1, "float32", "auto", False),
    (3, "float32", "auto", True), (3, "float32", "fp8_ds_mla", True)],
    ids=["fp32", "fp32-mtp3", "bf16-mtp3", "fp8_ds_mla", "fp8_ds_mla-mtp3", "fp32-mtp1",
         "fp32-mtp3-accepting", "fp8_ds_mla-mtp3-accepting"])
def test_padded_decode_equals_eager(model_dirs, engine_config, mixed_prompts, k, dtype, kv,
                                    accepting):
    base = engine_config(model_dirs["tiny-glm5"], kv_cache_dtype=kv, dtype=dtype,
                         max_num_seqs=8, num_blocks=96)
    if k:
        spec = _ACCEPTING if accepting else SpecConfig(num_speculative_tokens=k)
        base = dataclasses.replace(base, speculative=spec)
    prompts = mixed_prompts(len(_ARRIVALS), seed=3)
    eager_out, eager = _run(dataclasses.replace(
        base, compilation=CompilationConfig(enforce_eager=True)), prompts)
    assert eager.runner.decode_graphs is None
    sizes = {0: (1, 2, 4, 8), 1: (2, 4, 8, 16), 3: (4, 8, 16, 32)}[k]
    padded_out, padded = _run(dataclasses.replace(
        base, compilation=CompilationConfig(cudagraph_capture_sizes=sizes)), prompts)
    assert padded_out == eager_out
    assert all(len(padded_out[f"r{i}"]) == n for i, (n, _) in enumerate(_ARRIVALS))
    steps = padded.padded_steps
    graphs = padded.runner.decode_graphs
    assert graphs.num_steps == len(steps) > (3 if accepting else 5)  # accepting: fewer steps
    assert graphs.num_replays == graphs.num_draft_replays == 0  # no graphs on the CPU
    # every padded step's drafts went through the padded path too (none without MTP)
    assert graphs.num_draft_steps == (len(steps) if k else 0)
    q = 1 + k
    assert any(len(c) * q < size for size, c in steps), "no step was padded with requests"
    if k:
        assert any(min(c) < q for _, c in steps), "no request was padded inside its slot"
    if accepting:  # drafting continued past a slot's first row
        accepted = padded.stats().spec_decode_num_accepted_tokens_per_pos
        assert accepted[0] > 0 and accepted[2] > 0, accepted
    if dtype == "float32" and kv == "auto":
        # the same KV everywhere (the MTP layer's last: its draft steps wrote only where eager
        # did): padding rows wrote nowhere live
        caches = padded.runner.caches
        assert not k or len(caches) == padded.runner.model.cfg.num_hidden_layers + 1
        for a, b in zip(eager.runner.caches, padded.runner.caches, strict=True):
            torch.testing.assert_close(a.kv, b.kv, rtol=1e-5, atol=1e-5)
            if a.index is not None:
                torch.testing.assert_close(a.index, b.index, rtol=1e-5, atol=1e-5)


def test_prefill_and_large_batches_run_as_they_are(model_dirs, engine_config, mixed_prompts):
    """Steps with prefill rows, and decode batches past the largest size, skip the padded
    path; output is unchanged."""
    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=8, num_blocks=96)
    prompts = mixed_prompts(len(_ARRIVALS), seed=4)
    eager_out, _ = _run(dataclasses.replace(
        cfg, compilation=CompilationConfig(enforce_eager=True)), prompts)
    small_out, small = _run(dataclasses.replace(
        cfg, compilation=CompilationConfig(cudagraph_capture_sizes=(2,))), prompts)
    assert small_out == eager_out
    assert small.padded_steps and all(len(c) <= 2 for _, c in small.padded_steps)


def test_a_batch_layout_is_uploaded_once_and_kept_bounded(model_dirs, engine_config,
                                                           monkeypatch):
    """The padded layout of a batch shape is built and uploaded at its first step and reused
    after (a decode batch repeats it every step); its values are pad_layout's; the kept
    layouts stay within MAX_CACHED_LAYOUTS, the oldest dropped first."""
    from dsaserve.engine import decode_graph

    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=8, num_blocks=96)
    graphs = LLMEngine.from_config(cfg).runner.decode_graphs
    cpu = torch.device("cpu")
    first = graphs._layout([1, 1, 1], 4, cpu)
    assert graphs._layout((1, 1, 1), 4, cpu) is first  # a list or a tuple: the same shape
    want = pad_layout([1, 1, 1], graphs.q, 4)
    assert first.src_rows.tolist() == want.src_rows
    assert first.writes.dtype == torch.bool and first.writes.tolist() == want.writes
    assert (first.src_reqs.tolist(), first.out_rows.tolist()) == (want.src_reqs, want.out_rows)
    assert graphs._layout([1, 1], 4, cpu) is not first
    monkeypatch.setattr(decode_graph, "MAX_CACHED_LAYOUTS", 2)
    graphs._layout([1], 4, cpu)  # a third shape: the oldest, [1, 1, 1], goes
    assert len(graphs._layouts) == 2 and ((1, 1, 1), 4) not in graphs._layouts
    assert graphs._layout([1, 1, 1], 4, cpu) is not first


def test_a_decode_forward_that_cannot_be_captured_runs_eager(model_dirs, engine_config,
                                                             mixed_prompts, monkeypatch, caplog):
    """A capture that raises (a kernel CUDA cannot record) leaves the engine serving: the step
    runs eager, a warning says so once, and the output is unchanged."""
    from dsaserve.engine import cudagraph

    cfg = engine_config(model_dirs["tiny-glm5"], max_num_seqs=8, num_blocks=96)
    prompts = mixed_prompts(len(_ARRIVALS), seed=5)
    eager_out, _ = _run(dataclasses.replace(
        cfg, compilation=CompilationConfig(enforce_eager=True)), prompts)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cudagraph, "capture", refuse)

    def as_on_a_gpu(engine):  # a capturable backend on CUDA would capture
        engine.runner.decode_graphs.capture = True

    outputs, engine = _run(dataclasses.replace(
        cfg, compilation=CompilationConfig(cudagraph_capture_sizes=(1, 2, 4, 8))), prompts,
        prepare=as_on_a_gpu)
    assert outputs == eager_out
    assert len(calls) == 1 and not engine.runner.decode_graphs.capture
    assert "run eager" in caplog.text


def test_drafts_reach_past_max_model_len(model_dirs, engine_config):
    """Requests run to max_model_len with MTP3 drafts accepted: the last steps' draft steps
    write their lookahead positions past max_model_len − 1 (blocks the scheduler reserved
    for them), through the padded path as eager does; same output, same KV."""
    cfg = dataclasses.replace(
        engine_config(model_dirs["tiny-glm5"], dtype="float32", max_model_len=64,
                      max_num_seqs=4, num_blocks=48),
        speculative=_ACCEPTING)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 500, (n,), generator=gen).tolist() for n in (30, 41, 47)]

    def run(compilation):
        engine = LLMEngine.from_config(dataclasses.replace(cfg, compilation=compilation))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=100, temperature=0.0,
                                                          ignore_eos=True))
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"
        return outputs, engine

    eager_out, eager = run(CompilationConfig(enforce_eager=True))
    padded_out, padded = run(CompilationConfig(cudagraph_capture_sizes=(4, 8, 16)))
    assert padded_out == eager_out
    assert all(len(p) + len(padded_out[f"r{i}"]) == 64 for i, p in enumerate(prompts))
    assert padded.runner.decode_graphs.num_draft_steps > 5
    for a, b in zip(eager.runner.caches, padded.runner.caches, strict=True):
        torch.testing.assert_close(a.kv, b.kv, rtol=1e-5, atol=1e-5)


class _Rerun:
    """A stand-in for a CUDA graph on the CPU: replay runs the recorded function again into
    its first output, which is what a graph's replay gives when the function reads only
    fixed addresses (the static buffers, another graph's static output)."""

    def __init__(self, fn):
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        self.out.copy_(self.fn())

    def pool(self):
        return None


@pytest.mark.parametrize("refuse_drafts", [False, True], ids=["replayed", "drafts-refused"])
def test_captured_drafts_read_the_target_graph_output(model_dirs, engine_config, mixed_prompts,
                                                      monkeypatch, caplog, refuse_drafts):
    """With graphs 'captured' (_Rerun), the drafts' graph reads the target graph's static
    output and the static buffers only: the output is eager's, every padded step replays
    both. A draft capture that raises leaves the engine serving eager, with a warning."""
    from dsaserve.engine import cudagraph

    cfg = dataclasses.replace(
        engine_config(model_dirs["tiny-glm5"], dtype="float32", max_num_seqs=8, num_blocks=96),
        speculative=_ACCEPTING)
    prompts = mixed_prompts(len(_ARRIVALS), seed=6)
    eager_out, _ = _run(dataclasses.replace(
        cfg, compilation=CompilationConfig(enforce_eager=True)), prompts)
    captured: list[int] = []

    def capture(fn, pool=None, warmup=2):
        captured.append(1)
        if refuse_drafts and len(captured) == 2:  # the first size's drafts
            raise RuntimeError("operation not permitted when stream is capturing")
        graph = _Rerun(fn)
        return graph, graph.out

    monkeypatch.setattr(cudagraph, "capture", capture)
    original = LLMEngine.from_config

    def with_graphs(config):
        engine = original(config)
        engine.runner.decode_graphs.capture = True  # as on a GPU with a capturable backend
        return engine

    monkeypatch.setattr(LLMEngine, "from_config", with_graphs)
    out, engine = _run(dataclasses.replace(
        cfg, compilation=CompilationConfig(cudagraph_capture_sizes=(4, 8, 16, 32))), prompts)
    assert out == eager_out
    graphs = engine.runner.decode_graphs
    assert graphs.num_draft_steps == graphs.num_steps > 3
    if refuse_drafts:
        assert len(captured) == 2 and not graphs.capture and "run eager" in caplog.text
        assert graphs.num_replays == 1 and graphs.num_draft_replays == 0
    else:
        assert len(captured) == 2 * len(graphs._graphs) == 2 * len(graphs._draft_graphs)
        assert graphs.num_graphs == len(captured)
        assert graphs.num_replays == graphs.num_draft_replays == graphs.num_steps


def warm_up_checked(engine: LLMEngine) -> None:
    """The engine's `DecodeGraphs.warm_up()`, asserting that it wrote no KV (no cache tensor
    changed; with HiSparse no hot buffer, no request region's residency tables, no miss
    counter) and left the step counters and the last step as they were."""
    runner = engine.runner
    graphs, rt = runner.decode_graphs, runner.hisparse

    def state() -> list[torch.Tensor]:
        tensors = [t for c in runner.caches for t in (c.kv, c.index) if t is not None]
        if rt is not None:  # the trash region is no request's: padding slots resolve there
            live = slice(0, rt.trash_region)
            tensors += [*rt.hot, *(t[live] for t in rt.slot_token + rt.slot_stamp), rt._counts]
        return [t.clone() for t in tensors]

    def counters() -> tuple[int, int, int, int]:
        return (graphs.num_steps, graphs.num_replays, graphs.num_draft_steps,
                graphs.num_draft_replays)

    before, counted, last = state(), counters(), graphs._last
    graphs.warm_up()
    assert all(torch.equal(a, b) for a, b in zip(before, state(), strict=True)), (
        "warm-up wrote into a cache")
    assert counters() == counted and graphs._last is last


def warm_up_at(engine: LLMEngine, steps: tuple[int, ...]) -> list[int]:
    """Make engine.step() warm the decode graphs up (checked) before its calls number `steps`
    (0: before the first) → the sizes warmed, in order, filled as the engine runs."""
    graphs, step = engine.runner.decode_graphs, engine.step
    sizes: list[int] = []
    fill = graphs._fill_padding

    def recorded(size: int) -> None:
        sizes.append(size)
        fill(size)

    graphs._fill_padding = recorded
    calls = itertools.count()

    def stepping():
        if next(calls) in steps:
            warm_up_checked(engine)
        return step()

    engine.step = stepping
    return sizes


@pytest.mark.parametrize("k,kv", [(0, "auto"), (3, "auto"), (3, "fp8_ds_mla")],
                         ids=["fp32", "fp32-mtp3", "fp8_ds_mla-mtp3"])
def test_warm_up_writes_nothing_a_step_reads(model_dirs, engine_config, mixed_prompts, k, kv):
    """Every size's forward (and with MTP3 its drafts) over an all-padding batch, largest first,
    at start-up and again between steps of running requests (their KV, the last step and the
    counters live): no cache changes, no step is counted, and the greedy output is that of
    the engine not warmed up, step for step."""
    base = engine_config(model_dirs["tiny-glm5"], kv_cache_dtype=kv, dtype="float32",
                         max_num_seqs=8, num_blocks=96)
    if k:
        base = dataclasses.replace(base, speculative=_ACCEPTING)
    sizes = (4, 8, 16, 32) if k else (1, 2, 4, 8)
    cfg = dataclasses.replace(base, compilation=CompilationConfig(cudagraph_capture_sizes=sizes))
    prompts = mixed_prompts(len(_ARRIVALS), seed=8)
    cold_out, cold = _run(cfg, prompts)
    warmed: list[list[int]] = []

    def warm(engine):
        warmed.append(warm_up_at(engine, (0, 4)))  # step 4: decoding, with joins to come

    warm_out, engine = _run(cfg, prompts, prepare=warm)
    assert warm_out == cold_out
    assert warmed == [[*reversed(sizes)] * 2]  # every size, largest first, at both steps
    assert engine.padded_steps == cold.padded_steps
    graphs, cold_graphs = engine.runner.decode_graphs, cold.runner.decode_graphs
    assert graphs.num_steps == cold_graphs.num_steps == len(engine.padded_steps)
    assert graphs.num_draft_steps == cold_graphs.num_draft_steps


def test_warm_up_captures_every_size_and_no_step_captures(model_dirs, engine_config,
                                                          mixed_prompts, monkeypatch):
    """With graphs 'captured' (_Rerun) and warmed up after start-up, as the runner does on a
    GPU: every size's forward and drafts are captured, largest first; the steps then replay
    them and capture nothing, and the output is eager's."""
    from dsaserve.engine import cudagraph

    cfg = dataclasses.replace(
        engine_config(model_dirs["tiny-glm5"], dtype="float32", max_num_seqs=8, num_blocks=96),
        speculative=_ACCEPTING)
    prompts = mixed_prompts(len(_ARRIVALS), seed=9)
    eager_out, _ = _run(dataclasses.replace(
        cfg, compilation=CompilationConfig(enforce_eager=True)), prompts)
    captured: list[int] = []

    def capture(fn, pool=None, warmup=2):
        captured.append(1)
        graph = _Rerun(fn)
        return graph, graph.out

    monkeypatch.setattr(cudagraph, "capture", capture)
    at_start_up: list[int] = []

    def warm(engine):
        graphs = engine.runner.decode_graphs
        graphs.capture = True  # as on a GPU with a capturable backend
        warm_up_checked(engine)
        at_start_up.append(len(captured))

    sizes = (4, 8, 16, 32)
    out, engine = _run(dataclasses.replace(
        cfg, compilation=CompilationConfig(cudagraph_capture_sizes=sizes)), prompts,
        prepare=warm)
    assert out == eager_out
    graphs = engine.runner.decode_graphs
    assert list(graphs._graphs) == list(graphs._draft_graphs) == [*reversed(sizes)]
    assert at_start_up == [len(captured)] == [2 * len(sizes)]  # none captured at a step
    assert graphs.capture and graphs.num_steps > 3
    assert graphs.num_replays == graphs.num_draft_replays == graphs.num_steps
