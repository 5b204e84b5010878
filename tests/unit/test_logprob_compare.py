"""tests/logprob_compare.py: runs equal up to near-ties pass; a run that departs elsewhere than
at a near-tie fails, on hand-made entries and on a real run corrupted at one token."""

from __future__ import annotations

import dataclasses

import pytest
from logprob_compare import Divergence, check_outputs_close, compare_up_to_near_ties

from dsaserve.core import Completion, SamplingParams, TokenLogprob
from dsaserve.engine.engine import LLMEngine


def e(token: int, *top: tuple[int, float]) -> TokenLogprob:
    """An entry whose chosen token's logprob is its value in `top`."""
    return TokenLogprob(token, dict(top)[token], tuple(top))


SHARED = [e(1, (1, -0.1), (2, -3.0)), e(4, (4, -0.5), (5, -1.5))]
# position 2: a near-tie between 7 and 8, each run on its side of it
A = SHARED + [e(7, (7, -0.70), (8, -0.72)), e(9, (9, -0.2), (3, -2.0))]
B = SHARED + [e(8, (8, -0.69), (7, -0.71)), e(3, (3, -0.1), (9, -4.0))]


def test_equal_runs_have_no_divergence() -> None:
    assert compare_up_to_near_ties(A, A, margin=0.05) is None


def test_a_near_tie_divergence_passes_and_ends_the_comparison() -> None:
    d = compare_up_to_near_ties(A, B, margin=0.05)
    assert d == Divergence(2, 7, 8, pytest.approx(0.02), pytest.approx(0.02))
    # what follows the divergence is not compared: any tail, any length
    assert compare_up_to_near_ties(A, B[:3], margin=0.05).position == 2


def test_a_gap_at_or_above_the_margin_fails() -> None:
    with pytest.raises(AssertionError, match="not a near-tie"):
        compare_up_to_near_ties(A, B, margin=0.02)
    wide = B[:2] + [e(8, (8, -0.1), (7, -1.0))] + B[3:]  # run b's own gap is 0.9
    with pytest.raises(AssertionError, match=r"not a near-tie \(gaps 0.02 in a, 0.9 in b"):
        compare_up_to_near_ties(A, wide, margin=0.05)


def test_a_token_outside_the_others_top_2_fails() -> None:
    third = B[:2] + [e(6, (6, -0.70), (7, -0.71))] + B[3:]
    with pytest.raises(AssertionError, match="not among run a's top 2"):
        compare_up_to_near_ties(A, third, margin=0.05)
    with pytest.raises(AssertionError, match="not among run b's top 2"):
        compare_up_to_near_ties(third, A, margin=0.05)


def test_a_divergence_at_the_first_token_is_judged_the_same_way() -> None:
    assert compare_up_to_near_ties(A[2:], B[2:], margin=0.05).position == 0


def test_agreeing_runs_of_other_lengths_fail() -> None:
    with pytest.raises(AssertionError, match="agree but have 4 and 3 tokens"):
        compare_up_to_near_ties(A, A[:3], margin=0.05)


def test_runs_without_two_top_logprobs_fail() -> None:
    narrow = [dataclasses.replace(x, top=x.top[:1]) for x in A]
    with pytest.raises(AssertionError, match="logprobs >= 2"):
        compare_up_to_near_ties(narrow, narrow, margin=0.05)
    with pytest.raises(AssertionError, match="run b has no logprobs"):
        check_outputs_close([Completion((1,), (A[0],))], [Completion((1,), None)], margin=0.05)


def test_a_real_run_against_itself_and_broken(engine_config, model_dirs, mixed_prompts) -> None:
    """A tiny engine's greedy run passes against a rerun; the same run with one token
    replaced by the least likely of its top 4 (and that token's entry) fails."""
    engine = LLMEngine.from_config(engine_config(model_dirs["tiny-glm5"]))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=4)
    prompts = mixed_prompts(3)
    run, rerun = (engine.generate_with_logprobs(prompts, params) for _ in range(2))
    engine.check_integrity()
    assert check_outputs_close(run, rerun, margin=1e-3) == [None, None, None]
    c = run[1]
    at = c.logprobs[3]
    worst, lp = at.top[-1]
    broken_entry = dataclasses.replace(at, token_id=worst, logprob=lp)
    broken = Completion(c.token_ids[:3] + (worst,) + c.token_ids[4:],
                        c.logprobs[:3] + (broken_entry,) + c.logprobs[4:])
    with pytest.raises(AssertionError, match="prompt 1 position 3"):
        check_outputs_close(run, [run[0], broken, run[2]], margin=1e-3)
    # a divergence that is a real near-tie passes even at the tight margin: the runner's own
    # second choice where the two are (made) tied
    tied = dataclasses.replace(at, top=(at.top[0], (at.top[1][0], at.logprob)) + at.top[2:])
    other = dataclasses.replace(tied, token_id=tied.top[1][0], top=(tied.top[1], tied.top[0]))
    a = Completion(c.token_ids, c.logprobs[:3] + (tied,) + c.logprobs[4:])
    b = Completion(c.token_ids[:3] + (other.token_id,),
                   c.logprobs[:3] + (other,))
    assert check_outputs_close([a], [b], margin=1e-3)[0].position == 3
