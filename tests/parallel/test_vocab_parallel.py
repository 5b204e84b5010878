"""The vocabulary cut over TP ranks (parallel/vocab.py): its ranges, and each collective piece
against the replicated computation, bit for bit, in gloo processes: 2, 3 and 4 ranks, vocabularies
that divide and that do not, argmax ties across and within parts, a draft vocabulary cut in equal
parts whatever ranges its ids fall in. Each rank's logits are its
columns of the replicated product (a narrower GEMM may round otherwise: the engine tests under TP
compare within a tolerance)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsaserve.parallel.groups import Group
from dsaserve.parallel.vocab import VocabShard, vocab_ranges


@pytest.mark.parametrize("vocab,parts", [(8, 2), (10, 4), (7, 3), (5, 5), (154880, 8)])
def test_ranges_cover_the_vocabulary_in_order(vocab, parts) -> None:
    ranges = vocab_ranges(vocab, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [stop - start for start, stop in ranges]
    longer = vocab % parts
    assert sizes == [-(-vocab // parts)] * longer + [vocab // parts] * (parts - longer)


def test_a_vocabulary_smaller_than_the_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be cut"):
        vocab_ranges(3, 4)


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same on every rank: embedding [V, 6], ids [9], head [V, 6], hidden [5, 6] with ties."""
    g = torch.Generator().manual_seed(vocab)
    embed = torch.randn(vocab, 6, generator=g)
    ids = torch.randint(0, vocab, (9,), generator=g)
    head = torch.randn(vocab, 6, generator=g)
    head[vocab - 1] = head[0]  # row 0's maximum tied by the last id (another part)
    head[1] = head[0]  # and by id 1 (the same part as id 0)
    hidden = torch.randn(5, 6, generator=g)
    hidden[0] = head[0] * 10  # row 0: ids 0, 1 and V − 1 tie for the maximum
    return embed, ids, head, hidden


def _draft_vocabs(vocab: int) -> dict[str, list[int]]:
    return {"crowded": [0, 1, 2, 3, vocab - 1], "few": [1]}


def _worker(rank: int, world: int, init_file: str, vocab: int, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        group = Group("tp", tuple(range(world)), rank, dist.group.WORLD)
        shard = VocabShard.of(group, vocab)
        embed, ids, head, hidden = _inputs(vocab)
        local = (hidden @ head.T)[:, shard.start : shard.stop]  # the replicated products'
        # a draft vocabulary crowded into the first rank's range, and one of fewer ids than ranks
        drafts = {}
        for name, subset in _draft_vocabs(vocab).items():
            rows, part = shard.balanced_rows(head[shard.start : shard.stop], subset)
            columns = [subset.index(t) for t in part.tolist()]  # of the replicated products
            drafts[name] = (rows, part, shard.argmax((hidden @ head[subset].T)[:, columns], part))
        torch.save({"embed": shard.embed(embed[shard.start : shard.stop], ids),
                    "logits": shard.gather_logits(local), "argmax": shard.argmax(local),
                    "drafts": drafts}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("vocab,world", [(8, 2), (10, 4), (7, 3)])
def test_vocab_parallel_pieces_equal_the_replicated_ones(vocab, world) -> None:
    embed, ids, head, hidden = _inputs(vocab)
    logits = hidden @ head.T  # [5, V]
    assert logits[0, 0] == logits[0, 1] == logits[0, vocab - 1] == logits[0].max()
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "rdzv"), os.path.join(tmp, "out")
        mp.start_processes(_worker, args=(world, init, vocab, out), nprocs=world,
                           start_method="spawn", join=True)
        results = [torch.load(f"{out}.{r}") for r in range(world)]
    for name, subset in _draft_vocabs(vocab).items():  # equal parts in rank order, exact rows
        parts = [res["drafts"][name] for res in results]
        assert torch.cat([p[1] for p in parts]).tolist() == subset
        assert max(len(p[1]) for p in parts) - min(len(p[1]) for p in parts) <= 1
        assert torch.equal(torch.cat([p[0] for p in parts]), head[subset])
        want = torch.tensor(subset)[(hidden @ head[subset].T).argmax(-1)]
        assert all(torch.equal(p[2], want) for p in parts)
    for res in results:
        assert torch.equal(res["embed"], embed[ids])
        assert torch.equal(res["logits"], logits)
        assert torch.equal(res["argmax"], logits.argmax(-1))
        assert res["argmax"][0] == 0  # the lowest id among the tied maxima
