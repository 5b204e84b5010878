"""Two runs' outputs compared up to near-ties (vLLM's `check_logprobs_close`, in our words).

Two engines that compute the same model in other batches (other GEMM shapes, other fp8
quantization boundaries) may round a near-tie the other way; from then on their sequences
differ for good reason, and comparing them further tests nothing. So two runs of one prompt
are *equal up to near-ties* when

    run a:  t0 t1 t2 | a3 ...        agree token for token up to a first divergence i = 3,
    run b:  t0 t1 t2 | b3 ...        where each run's token is among the other's top 2 and
                                     |lp(a3) - lp(b3)| < margin in run a and in run b

and after the divergence nothing is compared. Without a divergence, the runs must have the
same length. The runs need logprobs of at least 2 (SamplingParams.logprobs >= 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsaserve.core import Completion, TokenLogprob


@dataclass(frozen=True)
class Divergence:
    """Where two runs of one prompt part at a near-tie: the position, each run's token, and
    each run's gap between the two tokens' log-probabilities (nats)."""

    position: int
    token_a: int
    token_b: int
    gap_a: float
    gap_b: float


def _logprob_of(entry: TokenLogprob, token: int, top: int = 2) -> float | None:
    """`token`'s log-probability in `entry` if it is among the entry's `top` most likely."""
    return next((lp for t, lp in entry.top[:top] if t == token), None)


def compare_up_to_near_ties(a: Sequence[TokenLogprob], b: Sequence[TokenLogprob], *,
                            margin: float, name: str = "") -> Divergence | None:
    """Check that runs `a` and `b` of one prompt are equal up to near-ties (AssertionError
    saying where and why not); their divergence, or None when they agree throughout."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        assert len(x.top) >= 2 and len(y.top) >= 2, (
            f"{name} position {i}: the runs need logprobs >= 2 (got {len(x.top)}, {len(y.top)})")
        if x.token_id == y.token_id:
            continue
        where = f"{name} position {i}: run a chose {x.token_id}, run b {y.token_id}"
        b_in_a, a_in_b = _logprob_of(x, y.token_id), _logprob_of(y, x.token_id)
        assert b_in_a is not None, f"{where}, which is not among run a's top 2 {x.top[:2]}"
        assert a_in_b is not None, f"{where}, which is not among run b's top 2 {y.top[:2]}"
        gap_a, gap_b = abs(x.logprob - b_in_a), abs(y.logprob - a_in_b)
        assert gap_a < margin and gap_b < margin, (
            f"{where}: not a near-tie (gaps {gap_a:.4g} in a, {gap_b:.4g} in b; margin "
            f"{margin})")
        return Divergence(i, x.token_id, y.token_id, gap_a, gap_b)
    assert len(a) == len(b), f"{name}: the runs agree but have {len(a)} and {len(b)} tokens"
    return None


def check_outputs_close(a: Sequence[Completion], b: Sequence[Completion], *,
                        margin: float) -> list[Divergence | None]:
    """compare_up_to_near_ties for each prompt's two completions (run a's, run b's), whose
    entries must be those of their tokens; the divergence of each prompt."""
    assert len(a) == len(b), f"{len(a)} and {len(b)} completions"
    out = []
    for p, (x, y) in enumerate(zip(a, b, strict=True)):
        for run, c in (("a", x), ("b", y)):
            assert c.logprobs is not None, f"prompt {p}: run {run} has no logprobs"
            assert [e.token_id for e in c.logprobs] == list(c.token_ids), (
                f"prompt {p}: run {run}'s entries are not its tokens'")
        out.append(compare_up_to_near_ties(x.logprobs, y.logprobs, margin=margin,
                                           name=f"prompt {p}"))
    return out
