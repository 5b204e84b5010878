"""On a CUDA machine: HiSparse decode replayed from CUDA graphs (engine/decode_graph.py with
kv/hisparse/padded.py; the triton backend, 64-token pages) gives the greedy tokens of
--enforce-eager and of the all-GPU engine, with misses served from the pinned host pool, a
batch mixing hot and page-reading requests, spilled MLA pages, MTP3 (the drafts replayed from
their own graph) and --async-scheduling; every invariant (hot-slot bytes included) is checked
after every step, and the graphs were captured and replayed. Run on the device machine with
`pytest -m gpu tests/gpu/test_hisparse_graph_gpu.py`.

In float32, as tests/gpu/test_hisparse_spill_gpu.py: in bf16 a GEMM's rounding depends on its
batch, and a padded step's batch is not eager's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsaserve.config import CompilationConfig, HiSparseConfig, SpecConfig
from dsaserve.core import SamplingParams
from dsaserve.engine.engine import LLMEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _config(engine_config, model_dir, *, kv: str, spec: int, spill: bool, async_on: bool,
            hisparse: bool, eager: bool):
    cfg = engine_config(model_dir, kv_cache_dtype=kv, block_size=64, num_blocks=64,
                        max_model_len=256, max_num_seqs=8, dtype="float32")
    sizes = (4, 8, 16, 32) if spec else (1, 2, 4, 8)
    cfg = replace(cfg, device="cuda", attention=replace(cfg.attention, backend="triton"),
                  compilation=CompilationConfig(enforce_eager=True) if eager
                  else CompilationConfig(cudagraph_capture_sizes=sizes),
                  scheduler=replace(cfg.scheduler, async_scheduling=async_on))
    if spec:
        cfg = replace(cfg, speculative=SpecConfig(num_speculative_tokens=spec))
    if not hisparse:
        return cfg
    # spilling: cdiv(max_model_len + lookahead, 64) MLA pages, one max-length request's
    pages = (5 if spec else 4) if spill else None
    att = replace(cfg.attention, hisparse_device_buffer_size=(1 + spec) * cfg.model.index_topk,
                  hisparse_device_mla_pages=pages, hisparse_config_given=True)
    return replace(cfg, attention=att, hisparse=HiSparseConfig(host_pool_bytes=64 << 20))


def _prompts(buffer: int) -> list[list[int]]:
    """Three requests (a padding slot), the last reading its GPU pages for a few steps; 8 to
    10 blocks at once, over the 4 or 5 MLA pages of a spilling engine."""
    g = torch.Generator().manual_seed(23)
    return [torch.randint(4, 512, (n,), generator=g).tolist()
            for n in (buffer + 140, buffer + 170, buffer - 4)]


@pytest.mark.parametrize(("preset", "kv", "spec", "spill", "async_on"), [
    ("tiny-glm5", "auto", 0, False, False),  # float32 KV (the model's dtype)
    ("tiny-dsv32", "fp8_ds_mla", 0, True, False),
    ("tiny-glm5", "auto", 3, False, False),
    ("tiny-glm5", "fp8_ds_mla", 3, True, False),
    ("tiny-glm5", "auto", 0, True, True),
    ("tiny-glm5", "fp8_ds_mla", 3, True, True)],
    ids=["plain", "fp8-spill", "mtp3", "fp8-spill-mtp3", "async-spill", "async-fp8-spill-mtp3"])
def test_hisparse_graphs_equal_eager(generate_checked, model_dirs, draftable_dirs,
                                     engine_config, preset, kv, spec, spill, async_on):
    model_dir = (draftable_dirs if spec else model_dirs)[preset]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def config(**kw):
        return _config(engine_config, model_dir, kv=kv, spec=spec, spill=spill,
                       async_on=async_on, **kw)

    topk = engine_config(model_dir).model.index_topk
    prompts = _prompts((1 + spec) * topk)
    all_gpu = generate_checked(LLMEngine.from_config(config(hisparse=False, eager=True)),
                               prompts, params)
    eager = generate_checked(LLMEngine.from_config(config(hisparse=True, eager=True)),
                             prompts, params)
    engine = LLMEngine.from_config(config(hisparse=True, eager=False))
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.capture and graphs.hisparse is not None
    got = generate_checked(engine, prompts, params)
    assert got == eager == all_gpu
    assert graphs.capture, "a capture failed: the steps ran eager"
    # every decode-only step ran through the static buffers and replayed its graph (captured at
    # its size's first step)
    assert graphs.num_steps > 0 and graphs.num_replays == graphs.num_steps
    if spec:
        assert graphs.num_draft_replays > 0
    rt = engine.runner.hisparse
    assert int(rt.rows_from_host) > 0
    if spill:
        assert engine.scheduler.mla.num_spills > 0


def test_fp8_spill_mtp3_sync_which_path_departs(generate_checked, draftable_dirs,
                                                engine_config, monkeypatch):
    """Diagnosis of the one case whose graphed tokens differed from eager's (fp8 + spilling +
    MTP3, sync scheduling): the same padded steps run eager (a capture that fails serves them
    eager over the same buffers) and the all-GPU engine graphed. Graphed = padded eager says
    the graph replays what it captured and the padding (a step's batch size and bounded
    seq_lens, not HiSparse) moves the tokens; all-GPU graphed = HiSparse graphed says HiSparse
    is exact at equal schedules."""
    from dsaserve.engine import cudagraph
    model_dir = draftable_dirs["tiny-glm5"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def config(**kw):
        return _config(engine_config, model_dir, kv="fp8_ds_mla", spec=3, spill=True,
                       async_on=False, **kw)

    prompts = _prompts(4 * engine_config(model_dir).model.index_topk)
    runs = {
        "eager": generate_checked(LLMEngine.from_config(config(hisparse=True, eager=True)),
                                  prompts, params),
        "graphed": generate_checked(LLMEngine.from_config(config(hisparse=True, eager=False)),
                                    prompts, params),
        "all-GPU eager": generate_checked(
            LLMEngine.from_config(config(hisparse=False, eager=True)), prompts, params),
        "all-GPU graphed": generate_checked(
            LLMEngine.from_config(config(hisparse=False, eager=False)), prompts, params),
    }

    def no_capture(fn, pool=None):
        raise RuntimeError("capture refused by the test: the padded steps run eager")

    monkeypatch.setattr(cudagraph, "capture", no_capture)
    engine = LLMEngine.from_config(config(hisparse=True, eager=False))
    runs["padded eager"] = generate_checked(engine, prompts, params)
    assert not engine.runner.decode_graphs.capture and engine.runner.decode_graphs.num_steps > 0
    for name, tokens in runs.items():
        print(f"fp8-spill-mtp3 sync {name}: {tokens}")
    names = list(runs)
    print("equal pairs:", [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
                           if runs[a] == runs[b]])
    assert runs["graphed"] == runs["padded eager"], "the graph does not replay its eager steps"
