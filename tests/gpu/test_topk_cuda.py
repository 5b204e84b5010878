"""The CUDA top-k kernel (dsaserve/kernels/cuda/topk_rows.cu) against an exact reference.

The reference ranks every visible key by (score, then smaller key index) as one int64 and takes
the k best with torch.topk, so the chosen set is unique even with ties and must match exactly:
same key indices, same scores. Inputs are fresh random every run (seed printed), and cover the
kernel's paths: the group-maxima threshold (the compaction reading the whole row, or only the
groups whose maximum clears it), rows short enough to list whole, rows too short for k groups,
rows whose list overflows (a band of high keys, few distinct scores, all equal) and rows with
at most k visible keys.
Run on the device machine: `pytest -m gpu tests/gpu/test_topk_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels.cuda import topk as cuda_topk

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if not cuda_topk.available():
    pytest.skip(f"CUDA top-k unavailable: {cuda_topk.unavailable_reason()}",
                allow_module_level=True)

DEV = "cuda"
GROUP = 8


def _masked(logits: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """−inf at j ≥ limits[t], as the logits kernel writes them."""
    cols = torch.arange(logits.shape[1], device=DEV)[None, :]
    return logits.masked_fill(cols >= limits[:, None], float("-inf"))


def _group_max(logits: torch.Tensor) -> torch.Tensor:
    num_rows, seq = logits.shape
    pad = -seq % GROUP
    padded = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    return padded.view(num_rows, -1, GROUP).amax(2)


def _reference(logits: torch.Tensor, limits: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Per row: the sorted key indices of the exact top-min(k, limit), ties to smaller index."""
    cols = torch.arange(logits.shape[1], device=DEV)
    bits = logits.contiguous().view(torch.int32).long()
    score = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (score << 32) | (0x7FFFFFFF - cols)
    key = torch.where(cols[None, :] < limits[:, None], key, torch.iinfo(torch.int64).min)
    pick = key.topk(k, dim=1).indices
    return [pick[t, : min(k, int(limits[t]))].sort().values for t in range(len(limits))]


def _check(logits: torch.Tensor, limits: torch.Tensor, k: int, **kw) -> None:
    logits = _masked(logits, limits)
    for gm in (_group_max(logits), None):
        values, indices = cuda_topk.topk_rows(logits, gm, limits, k, group=GROUP, **kw)
        ref = _reference(logits, limits, k)
        for t, want in enumerate(ref):
            n = len(want)
            got = indices[t, :n].long()
            assert torch.equal(got.sort().values, want), f"row {t} (limit {int(limits[t])})"
            assert torch.equal(values[t, :n], logits[t, got]), f"row {t}: values"
            assert bool((indices[t, n:] == -1).all()) and bool(values[t, n:].isneginf().all())


@pytest.mark.parametrize(("threads", "cluster"), [(512, 1), (1024, 1), (1024, None)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_random_rows(g: torch.Generator, threads: int, cluster: int | None,
                     index_dtype: torch.dtype) -> None:
    """Irregular lengths: ≤ k keys, a whole-row list, too few groups, the threshold path (with
    1024 threads on Hopper: rows longer than the shared-memory stage, read partly from memory;
    cluster None: 14 rows take 8 blocks each)."""
    seq, k = 70001, 2048
    lengths = [0, 1, 2047, 2048, 2049, 4096, 4097, 9000, 16383, 16384, 16385, 40000, 65536,
               70001]
    limits = torch.tensor(lengths, device=DEV)
    logits = torch.randn(len(lengths), seq, device=DEV, generator=g)
    _check(logits, limits, k, threads=threads, cluster=cluster, index_dtype=index_dtype)


@pytest.mark.parametrize("cluster", [2, 4, 8])
def test_cluster(g: torch.Generator, cluster: int) -> None:
    """Blocks of a cluster sharing each row's compaction (the decode choice for few rows): every
    path, with the threshold path's rows long enough that each block has steps to take, an
    overflowing row whose list the blocks fill together, and a row whose later blocks hold no
    group above the threshold; each block reading only its groups above the threshold, or its
    whole share of the row, staged in shared memory (Hopper) or read from memory."""
    seq, k = 70001, 2048
    lengths = [0, 2047, 2049, 4097, 16384, 16385, 40000, 65536, 70001]
    limits = torch.tensor(lengths, device=DEV)
    logits = torch.randn(len(lengths), seq, device=DEV, generator=g)
    logits[5, 100:3600] += 100.0  # 3500 keys above every other: the list overflows
    logits[7, 20000:] -= 100.0  # τ among the first 2,500 groups: the rest list none
    for index_dtype, group_list, stage in ((torch.int32, True, True), (torch.int64, True, True),
                                           (torch.int32, False, True),
                                           (torch.int32, False, False)):
        _check(logits, limits, k, threads=1024, cluster=cluster, index_dtype=index_dtype,
               group_list=group_list, stage=stage)


@pytest.mark.parametrize("k", [1, 100, 2048, 4096])
def test_k(g: torch.Generator, k: int) -> None:
    limits = torch.randint(1, 50000, (24,), device=DEV, generator=g)
    logits = torch.rand(24, 50000, device=DEV, generator=g) * 3 - 1
    _check(logits, limits, k)


# Launches whose compaction differs: the default for few rows (clusters, the groups above the
# threshold), one block per row (512 threads, the prefill choice; 1024), clusters reading their
# whole shares of the rows, staged in shared memory.
LAUNCHES = [{}, {"threads": 512, "cluster": 1}, {"threads": 1024, "cluster": 1},
            {"group_list": False}]
LAUNCH_IDS = ["default", "512", "1024", "whole-rows"]


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
def test_ties_and_overflow(g: torch.Generator, launch: dict) -> None:
    """The exact path: a band of high keys overflows the list; few distinct scores and all-equal
    rows cut through a tie, which goes to the smaller key indices (with one block per row, more
    groups clear the threshold than fit the group list: the whole row is compacted)."""
    seq, k = 65536, 2048
    logits = torch.randn(6, seq, device=DEV, generator=g)
    logits[0, 1000:4000] += 100.0  # 3000 keys above every other: > the 4096-entry list of τ
    logits[1] = torch.randint(0, 4, (seq,), device=DEV, generator=g).float()
    logits[2] = 0.0
    logits[3] = torch.randint(0, 1000, (seq,), device=DEV, generator=g).float()
    logits[4, ::7] = 50.0  # 9363 equal keys on top
    logits[5] = -logits[5].abs()  # negative scores only
    limits = torch.tensor([seq, seq, seq, 60000, seq, 30000], device=DEV)
    _check(logits, limits, k, **launch)


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
def test_large_rows_and_strided(g: torch.Generator, launch: dict) -> None:
    """Rows longer than the cached group maxima (re-read from memory; 131,072 keys is the
    longest cached row), up to a 1M-key window, and a row stride that is not a multiple of four
    floats (no 16-byte loads)."""
    k = 2048
    logits = torch.randn(4, 300001, device=DEV, generator=g)
    limits = torch.tensor([300001, 200000, 131073, 131072], device=DEV)
    _check(logits, limits, k, **launch)
    longest = torch.randn(2, 1 << 20, device=DEV, generator=g)
    _check(longest, torch.tensor([1 << 20, 524297], device=DEV), k, **launch)
    wide = torch.randn(5, 40003, device=DEV, generator=g)[:, 1:40002]  # stride 40003
    _check(wide, torch.tensor([40001, 30000, 5000, 2000, 0], device=DEV), k, **launch)


def test_prefill_batch(g: torch.Generator) -> None:
    """A long prefill step's shape: 4,096 rows of 131,072 keys, every key visible (one
    512-thread block per row, maxima cached, the group list), the chosen scores against
    torch.topk."""
    rows, keys, k = 4096, 1 << 17, 2048
    logits = torch.randn(rows, keys, device=DEV, generator=g)
    limits = torch.full((rows,), keys, device=DEV, dtype=torch.int32)
    values, indices = cuda_topk.topk_rows(logits, _group_max(logits), limits, k)
    want = logits.topk(k, dim=1).values
    assert torch.equal(values.sort(dim=1, descending=True).values, want)
    assert torch.equal(logits.gather(1, indices), values)


def test_cuda_graph(g: torch.Generator) -> None:
    """Capturable: replaying a graph gives the eager result for new data in the same buffers
    (64 rows: two-block clusters on an H100 / H200)."""
    logits = torch.randn(64, 65536, device=DEV, generator=g)
    gm = _group_max(logits)
    limits = torch.full((64,), 65536, device=DEV, dtype=torch.int32)
    cuda_topk.topk_rows(logits, gm, limits, 2048)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, indices = cuda_topk.topk_rows(logits, gm, limits, 2048)
    logits.copy_(torch.randn(64, 65536, device=DEV, generator=g))
    gm.copy_(_group_max(logits))
    graph.replay()
    want = cuda_topk.topk_rows(logits, gm, limits, 2048)
    assert torch.equal(indices.sort(1).values, want[1].sort(1).values)
    assert torch.equal(values.sort(1).values, want[0].sort(1).values)


def test_bad_input() -> None:
    logits = torch.zeros(2, 100, device=DEV)
    limits = torch.tensor([100, 50], device=DEV)
    with pytest.raises(ValueError, match="k="):
        cuda_topk.topk_rows(logits, None, limits, 101)
    with pytest.raises(ValueError, match="group_max"):
        cuda_topk.topk_rows(logits, torch.zeros(2, 3, device=DEV), limits, 10)
    with pytest.raises(ValueError, match="limits"):
        cuda_topk.topk_rows(logits, None, limits.float(), 10)
    with pytest.raises(ValueError, match="cluster=3"):
        cuda_topk.topk_rows(logits, None, limits, 10, cluster=3)
    with pytest.raises(ValueError, match="cluster=2"):
        cuda_topk.topk_rows(logits, None, limits, 10, threads=512, cluster=2)
    with pytest.raises(ValueError, match="threads must be one of"):
        cuda_topk.topk_rows(logits, None, limits, 10, threads=256)
