"""The batched sampler on a GPU (engine/sampler.py, engine/sampling_table.py): the parameter
table's rows read back as fp32 through the int32 mirror, the step draws without a host sync,
greedy rows are the argmax, sampled rows follow the per-request reference's distribution, and
a seeded request's CUDA generator gives the same tokens alone and batched. Run on the device
machine with `pytest -m gpu tests/gpu/test_sampler_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from dsaserve.core import SamplingParams
from dsaserve.engine.sampler import sample_on_device
from dsaserve.engine.sampling_table import SamplingTable
from dsaserve.kernels import staging
from dsaserve.spec.rejection import rejection_sample_on_device, target_probs_reference

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
MIX = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
       SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, top_k=3),
       SamplingParams(temperature=0.9, top_k=4, top_p=0.7, seed=11)]


def _table(params: list[SamplingParams], repeat: int = 1) -> tuple[SamplingTable, list[str]]:
    table = SamplingTable(len(params) * repeat, CUDA, seed=0)
    ids = [f"r{i}" for i in range(len(params) * repeat)]
    for i, rid in enumerate(ids):
        table.add(rid, i, params[i % len(params)])
    (pairs,) = staging.upload([table.pending()], CUDA)
    table.apply(pairs)
    table.check_integrity()
    return table, ids


def test_a_sampling_step_does_not_synchronise(g):
    table, ids = _table(MIX)
    (rows,) = staging.upload([torch.arange(len(ids))], CUDA)
    logits = torch.randn(len(MIX), 1000, device=CUDA, generator=g)
    verify = torch.randn(len(MIX), 4, 1000, device=CUDA, generator=g)
    drafts = torch.randint(0, 1000, (len(MIX), 3), device=CUDA, generator=g)
    num = torch.full((len(MIX),), 3, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, _ = sample_on_device(logits, table.batch(ids, rows))
        accepted, final = rejection_sample_on_device(verify, drafts, num, table.batch(ids, rows))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens[0].item() == logits[0].argmax().item()
    assert 0 <= accepted.min().item() and accepted.max().item() <= 3
    assert final.shape == (len(MIX),)


def test_sampled_rows_follow_the_reference(g):
    vocab, trials = 8, 20_000
    base = torch.randn(len(MIX), vocab, device=CUDA, generator=g) * 2
    exact = target_probs_reference(base[:, None].cpu(), MIX)[:, 0]
    table, ids = _table([p if p.seed is None else SamplingParams(temperature=p.temperature,
                                                                 top_k=p.top_k, top_p=p.top_p)
                         for p in MIX], trials)
    rows = torch.arange(len(ids), device=CUDA)
    tokens = sample_on_device(base.repeat(trials, 1), table.batch(ids, rows))[0].cpu()
    for r in range(len(MIX)):
        freq = torch.bincount(tokens[r :: len(MIX)], minlength=vocab).float() / trials
        assert 0.5 * (freq - exact[r]).abs().sum().item() < 0.02, MIX[r]


def test_seeded_request_alone_and_batched(g):
    logits = torch.randn(len(MIX), 256, device=CUDA, generator=g)
    alone_table, _ = _table([MIX[4]])
    batch_table, ids = _table(MIX)
    alone, batched = [], []
    for _ in range(3):
        rows = torch.tensor([0], device=CUDA)
        alone.append(sample_on_device(logits[4:5], alone_table.batch(["r0"], rows))[0].item())
        rows = torch.arange(len(ids), device=CUDA)
        batched.append(sample_on_device(logits, batch_table.batch(ids, rows))[0][4].item())
    assert alone == batched


@pytest.mark.parametrize("rows", [1, 64, 256])
def test_chosen_logprobs_equal_log_softmax_on_the_vocabulary(g, rows):
    """The emitted tokens' log-probabilities from each row's log-sum-exp (one read,
    kernels/triton/logsumexp.py) against log_softmax's, at GLM-5.3's vocabulary: masked (−inf)
    entries and logits of a trained model's spread."""
    from dsaserve.engine.sampler import chosen_logprobs

    logits = torch.randn(rows, 151552, device=CUDA, generator=g) * 6
    logits[:, -100:] = float("-inf")
    tokens = torch.randint(0, 151452, (rows,), device=CUDA, generator=g)
    want = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(chosen_logprobs(logits, tokens), want, rtol=1e-5, atol=1e-4)
