"""A decode step's host ops outside the model do not grow with the batch: sampling parameters
are rows of a device table gathered per step, sampling and verification are batched
(engine/sampler.py, engine/sampling_table.py, spec/rejection.py).

The triton backend's GPU path runs its host code on the CPU with launches counted, not run
(engine/host_ops.py). A plain step and an MTP3 step (synthetic and standard verification) at
b = 1 and b = 16 count no more ops at any site outside the decoder layers at b = 16, for
greedy requests, for a mix of temperature, top-k and top-p ones, and for that mix with
min_tokens masking stop ids; a seeded request may add a few ops (its own draws). Per site, so
that no growth hides behind a cut elsewhere."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from dsaserve.bench import steps as bench_steps
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
from dsaserve.engine.host_ops import OUTSIDE, OpCounter, gpu_branches

CONTEXT, BLOCK = 40, 64
GREEDY = (bench_steps.GREEDY,)
# b = 1 runs the first: temperature, top-k and top-p at once; b = 16 a mix of all
SAMPLED = (SamplingParams(max_tokens=1 << 20, temperature=0.8, top_k=5, top_p=0.9,
                          ignore_eos=True),
           SamplingParams(max_tokens=1 << 20, temperature=1.0, top_p=0.9, ignore_eos=True),
           SamplingParams(max_tokens=1 << 20, temperature=0.7, top_k=5, ignore_eos=True),
           SamplingParams(max_tokens=1 << 20, temperature=1.2, ignore_eos=True),
           bench_steps.GREEDY)
# the same requests, their min_tokens masking their stop ids at every step
MASKED = tuple(dataclasses.replace(p, min_tokens=1 << 10, stop_token_ids=(3, 9))
               for p in SAMPLED)
# one seeded request at b = 1, four at b = 16
SEEDED = (dataclasses.replace(SAMPLED[0], seed=3),) + SAMPLED[1:4]
OPS_PER_SEEDED = 6  # MTP: the row of uniforms (select, rand, copy) and of noise (select, draw)
SPECS = {
    "plain": None,
    "mtp3-synthetic": SpecConfig.from_json(
        '{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": '
        '"synthetic", "synthetic_acceptance_length": 2.99}'),
    "mtp3": SpecConfig(num_speculative_tokens=3),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("triton")
    from dsaserve.model.make_model import make_model

    return make_model("tiny-glm5", tmp_path_factory.mktemp("sampler_ops") / "tiny")


def _runner(model_dir, spec: SpecConfig | None):
    """A runner sized for 16 decoding requests of CONTEXT tokens."""
    from dsaserve.engine.runner import ModelRunner

    k = 0 if spec is None else spec.num_speculative_tokens
    per_request = bench_steps.blocks_per_request(CONTEXT + 2 * k + 2, BLOCK)
    return ModelRunner(EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=BLOCK, kv_cache_dtype="fp8_ds_mla",
                          num_gpu_blocks=per_request * 16 + 1, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=16 * (1 + k),
                                  max_model_len=per_request * BLOCK),
        attention=AttentionConfig(backend="triton", sparse_mla_force_mqa=True),
        dtype="float32", device="cpu", compilation=CompilationConfig(enforce_eager=True),
        speculative=spec))


def _outside_ops(runner, batch: int, params: tuple[SamplingParams, ...]) -> Counter[str]:
    """Ops + launches per site outside the decoder layers of a decode
    step of `batch` requests (those of the runner's last call end first)."""
    k = 0 if runner.config.speculative is None else runner.config.speculative.num_speculative_tokens
    first, again = bench_steps.decode(CONTEXT, batch, runner.model_cfg.vocab_size, BLOCK, k,
                                      params)
    first = dataclasses.replace(first, finished_request_ids=tuple(runner.requests))
    with gpu_branches():
        with OpCounter(runner.model.model.layers, stub_launches=True):
            runner.execute(first)
        with OpCounter(runner.model.model.layers, stub_launches=True) as ops:
            runner.execute(again)
    runner.check_block_table()
    return ops.sites(OUTSIDE, names=True)


@pytest.mark.parametrize("spec", SPECS)
def test_step_ops_do_not_grow_with_the_batch(model_dir, spec):
    runner = _runner(model_dir, SPECS[spec])
    for params in (GREEDY, SAMPLED, MASKED):
        one = _outside_ops(runner, 1, params)
        sixteen = _outside_ops(runner, 16, params)
        grown = sixteen - one  # the sites with more ops at b = 16
        assert not grown, f"{spec}, {params[0]}: grown from b = 1 to 16: {dict(grown)}"
        assert one == sixteen, f"{spec}, {params[0]}: fewer ops at b = 16: {dict(one - sixteen)}"
        assert bool(runner.sampling.num_masking) == (params is MASKED)
    one = _outside_ops(runner, 1, SEEDED)
    grown = _outside_ops(runner, 16, SEEDED) - one
    assert grown.total() <= 3 * OPS_PER_SEEDED, f"{spec} seeded: {dict(grown)}"
    assert all("sampler.py" in site or "rejection.py" in site for site in grown), dict(grown)
