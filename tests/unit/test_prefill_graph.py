"""Piecewise graphs for prefill and mixed steps (engine/prefill_graph.py) on the CPU: with
cudagraph_mode FULL_AND_PIECEWISE set, those steps run padded to a piecewise size through
static buffers, the pieces between the attention calls eager (graphs are captured and replayed
on a GPU: tests/gpu/test_cudagraph_gpu.py). The engine's greedy output equals
--enforce-eager's, with requests joining while others decode (mixed steps), chunked prompts,
steps larger than the largest size (run as they are), MTP3, bf16 and fp8_ds_mla KV; the KV
written is eager's (padding rows wrote nowhere), and the padding rows end where the step's last
row does (they computed what it computes: the same experts); no block leaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.config import CompilationConfig, ConfigError, SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine import cudagraph
from dsaserve.engine.engine import LLMEngine

# (max_tokens, the step it joins at): later prompts arrive while earlier requests decode
_ARRIVALS = [(6, 0), (9, 0), (5, 1), (7, 3), (4, 5)]
_PIECES = CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE",
                            piecewise_capture_sizes=(16, 64, 160))


def _run(config, prompts, prepare=None) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine.from_config(config)
    if prepare is not None:
        prepare(engine)
    sizes: list[tuple[int, int]] = []  # (size, tokens) of every step through the pieces
    pieces = engine.runner.prefill_graphs
    if pieces is not None:
        forward = pieces.forward

        def spy(size, input_ids, meta):
            n = input_ids.shape[0]
            sizes.append((size, n))
            hidden = forward(size, input_ids, meta)
            # the padding rows computed what the last row computes (so they went to its
            # experts): its hidden state
            padded = pieces._buffers.out[:size]
            torch.testing.assert_close(padded[n:], padded[n - 1 : n].expand(size - n, -1),
                                       rtol=1e-5, atol=1e-5)
            return hidden

        pieces.forward = spy
    outputs: dict[str, list[int]] = {}
    for step in range(200):
        for i, (max_tokens, at) in enumerate(_ARRIVALS):
            if at == step:
                engine.add_request(f"r{i}", prompts[i], SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if step > max(at for _, at in _ARRIVALS) and not engine.has_unfinished_requests():
            break
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"
    engine.piece_steps = sizes
    return outputs, engine


@pytest.mark.parametrize("model,k,dtype,kv", [
    ("tiny-glm5", 0, "float32", "auto"), ("tiny-glm5", 3, "float32", "auto"),
    ("tiny-glm5", 0, "bfloat16", "fp8_ds_mla"), ("tiny-dsv32", 0, "float32", "fp8_ds_mla")],
    ids=["glm5-fp32", "glm5-fp32-mtp3", "glm5-bf16-fp8_ds_mla", "dsv32-fp8_ds_mla"])
def test_piecewise_steps_equal_eager(model_dirs, engine_config, mixed_prompts, model, k, dtype,
                                     kv):
    base = engine_config(model_dirs[model], kv_cache_dtype=kv, dtype=dtype, max_num_seqs=8,
                         num_blocks=96, max_num_batched_tokens=96)
    if k:
        base = dataclasses.replace(base, speculative=SpecConfig(num_speculative_tokens=k))
    prompts = mixed_prompts(len(_ARRIVALS), seed=7)
    eager_out, eager = _run(dataclasses.replace(
        base, compilation=CompilationConfig(enforce_eager=True)), prompts)
    assert eager.runner.prefill_graphs is None
    out, engine = _run(dataclasses.replace(base, compilation=_PIECES), prompts)
    assert out == eager_out
    assert all(len(out[f"r{i}"]) == n for i, (n, _) in enumerate(_ARRIVALS))
    pieces = engine.runner.prefill_graphs
    steps = engine.piece_steps
    assert pieces.num_steps == len(steps) >= 3 and pieces.num_replays == 0
    assert any(n < size for size, n in steps), "no step was padded"
    assert {size for size, _ in steps} >= {64}, steps
    if dtype == "float32" and kv == "auto":  # the KV written is eager's, the MTP layer's too
        for a, b in zip(eager.runner.caches, engine.runner.caches, strict=True):
            torch.testing.assert_close(a.kv, b.kv, rtol=1e-5, atol=1e-5)
            if a.index is not None:
                torch.testing.assert_close(a.index, b.index, rtol=1e-5, atol=1e-5)


def test_steps_past_the_largest_size_and_decode_batches_take_their_own_paths(
        model_dirs, engine_config, mixed_prompts):
    """A chunk larger than the largest piecewise size runs as it is; decode-only steps keep
    the decode graphs' padded path; output unchanged."""
    base = engine_config(model_dirs["tiny-glm5"], max_num_seqs=8, num_blocks=96,
                         max_num_batched_tokens=96)
    prompts = mixed_prompts(len(_ARRIVALS), seed=8)
    eager_out, _ = _run(dataclasses.replace(
        base, compilation=CompilationConfig(enforce_eager=True)), prompts)
    small = CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE",
                              piecewise_capture_sizes=(48,), cudagraph_capture_sizes=(1, 2, 4, 8))
    out, engine = _run(dataclasses.replace(base, compilation=small), prompts)
    assert out == eager_out
    # the first step (r0 and r1 whole: 64 tokens) ran as it is
    assert engine.piece_steps and all(n <= 48 for _, n in engine.piece_steps)
    assert engine.runner.decode_graphs.num_steps > 0


def test_the_default_mode_runs_pieces_only_where_graphs_are_captured(model_dirs,
                                                                     engine_config):
    """FULL_AND_PIECEWISE by default, but on the CPU (nothing captured) padding would only
    cost: no piecewise path unless the mode is set; FULL_DECODE_ONLY and --enforce-eager keep
    it off everywhere."""
    base = engine_config(model_dirs["tiny-glm5"], num_blocks=32)
    assert CompilationConfig().mode == "FULL_AND_PIECEWISE"
    assert LLMEngine.from_config(base).runner.prefill_graphs is None
    for off in (CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY"),
                CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", enforce_eager=True)):
        runner = LLMEngine.from_config(dataclasses.replace(base, compilation=off)).runner
        assert runner.prefill_graphs is None
    none = CompilationConfig(cudagraph_mode="NONE")
    runner = LLMEngine.from_config(dataclasses.replace(base, compilation=none)).runner
    assert runner.prefill_graphs is None and runner.decode_graphs is None


def test_piecewise_sizes():
    assert cudagraph.piecewise_sizes(CompilationConfig(), 1024) == (256, 512, 768, 1024)
    assert cudagraph.piecewise_sizes(CompilationConfig(), 100) == ()
    assert cudagraph.piecewise_sizes(CompilationConfig(), 65536)[-1] == 8192
    assert cudagraph.piecewise_sizes(_PIECES, 8) == (16, 64, 160)
    decode_only = CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY")
    assert cudagraph.piecewise_sizes(decode_only, 4096) == ()


@pytest.mark.parametrize("text,message", [
    ('{"cudagraph_mode": "PIECEWISE"}', "cudagraph_mode must be one of"),
    ('{"cudagraph_mode": 3}', "cudagraph_mode must be one of"),
    ('{"piecewise_capture_sizes": [0, 16]}', "piecewise_capture_sizes must be a list"),
    ('{"piecewise_capture_sizes": 16}', "piecewise_capture_sizes must be a list")])
def test_bad_compilation_config_is_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        CompilationConfig.from_json(text)


def test_compilation_config_reads_the_piecewise_keys():
    cfg = CompilationConfig.from_json(
        '{"cudagraph_mode": "FULL_AND_PIECEWISE", "piecewise_capture_sizes": [512, 256, 512]}')
    assert cfg.mode == "FULL_AND_PIECEWISE" and cfg.piecewise_capture_sizes == (256, 512)
    assert CompilationConfig.from_json('{"cudagraph_mode": "FULL_AND_PIECEWISE"}',
                                       enforce_eager=True).mode == "NONE"


def test_a_piece_that_cannot_be_captured_leaves_the_engine_serving(
        model_dirs, engine_config, mixed_prompts, monkeypatch, caplog):
    """A capture that raises (a kernel CUDA cannot record): the step finishes eager, a warning
    says so once, later steps run without pieces, and the output is unchanged."""
    base = engine_config(model_dirs["tiny-glm5"], max_num_seqs=8, num_blocks=96,
                         max_num_batched_tokens=96)
    prompts = mixed_prompts(len(_ARRIVALS), seed=9)
    eager_out, _ = _run(dataclasses.replace(
        base, compilation=CompilationConfig(enforce_eager=True)), prompts)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cudagraph, "capture", refuse)

    def as_on_a_gpu(engine):  # a capturable backend on CUDA would capture
        engine.runner.prefill_graphs.capture = True

    out, engine = _run(dataclasses.replace(base, compilation=_PIECES), prompts,
                       prepare=as_on_a_gpu)
    assert out == eager_out
    pieces = engine.runner.prefill_graphs
    assert len(calls) == 1 and not pieces.capture and pieces.sizes == ()
    assert len(engine.piece_steps) == 1  # the step that tried
    assert "without piecewise graphs" in caplog.text
