"""MTP speculative decoding under the parallel layouts (gloo worker processes, CPU): greedy output
with drafts equals the single-rank engine without drafts, on a checkpoint whose drafts are often
accepted (tests/conftest.py: draftable_dirs), with chunked prefills, prefix hits and — under PCP —
the MTP layer following the target's split prefill rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from dsaserve.config import SpecConfig
from dsaserve.engine.dp import DataParallelEngine
from dsaserve.engine.engine import LLMEngine

pytestmark = pytest.mark.parallel


LAYOUTS = {
    # The prefill node's layout: split prefill chunks (the MTP layer follows the partition and
    # attends over prefetched full copies of its context), decode rows replicated.
    "pcp2_dcp2_ep": dict(pcp=2, dcp=2, ep=True, interleave=16, max_num_batched_tokens=48),
    "tp2_dcp2": dict(tp=2, dcp=2, max_num_batched_tokens=33),
    "dp2": dict(dp=2, max_num_batched_tokens=48),
}
# The drafts' head per layout (SpecConfig.draft_lm_head; "auto" is lm_head on the CPU) and
# vocabulary: under TP each rank makes the FP8 copy of its rows, and a draft vocabulary of the
# lower half of the ids (tiny presets: 512), all in the first rank's range, is cut in equal parts
# (parallel/vocab.py's balanced_rows: the second rank's rows come from the first).
DRAFT_HEADS = {"tp2_dcp2": "fp8"}
DRAFT_VOCABS = {"tp2_dcp2": tuple(range(256))}


def _spec(layout: str) -> SpecConfig:
    return SpecConfig(num_speculative_tokens=3, draft_lm_head=DRAFT_HEADS.get(layout, "auto"),
                      draft_vocab=DRAFT_VOCABS.get(layout))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def spec_engine(request, draftable, parallel_config, assert_gone
                ) -> Iterator[LLMEngine | DataParallelEngine]:
    config = dataclasses.replace(parallel_config(**LAYOUTS[request.param]),
                                 model_path=str(draftable), speculative=_spec(request.param))
    engine = LLMEngine.from_config(config)
    yield engine
    replicas = engine.replicas if isinstance(engine, DataParallelEngine) else [engine]
    pids = tuple(p for r in replicas for p in r.executor.pids)
    engine.shutdown()
    assert_gone(pids)


def _spec_counters(stats) -> tuple:
    return (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens_per_pos)


def test_greedy_with_mtp_matches_single_rank(request, spec_engine, prompts, greedy,
                                             draftable_reference, draftable, parallel_config):
    for _ in range(2):  # the second round starts from prefix hits
        assert spec_engine.generate(prompts, greedy) == draftable_reference
        spec_engine.check_integrity()
    stats = spec_engine.stats()
    layout = request.node.callspec.params["spec_engine"]
    if layout != "dp2":  # one engine sees the same batches as a single rank would
        # The same drafts are proposed and accepted as on a single rank with MTP: the MTP
        # layer's cache and its draft steps are right under this layout, not only the target.
        kw = {k: v for k, v in LAYOUTS[layout].items() if k == "max_num_batched_tokens"}
        single = LLMEngine.from_config(dataclasses.replace(
            parallel_config(**kw), model_path=str(draftable), speculative=_spec(layout)))
        for _ in range(2):
            single.generate(prompts, greedy)
        assert _spec_counters(stats) == _spec_counters(single.stats())
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == 3 and sum(per_pos) == stats.spec_decode_num_accepted_tokens
