"""The drafts' vocabulary: the tokens MTP drafts may propose, as SGLang's
`--speculative-token-map` and FR-Spec's frequency-ranked subset.

A draft's argmax reads the whole lm_head (GLM-5.3: 154,880 rows × 6,144; 0.95 GB even as the FP8
copy, more than the MTP layer's own weights at batch 1), three times an MTP3 step: work only the
speculative step does. Restricted to the N most frequent tokens, the drafts read N rows. The
target's logits keep every row and verify every draft, so output is unchanged (greedy: the same
tokens; sampled: the same distribution, since the rejection sampler never assumed which tokens a
draft may be); only acceptance can drop, where the right token is outside the N.

The vocabulary is a file: a JSON list of token ids. `dsaserve draft-vocab` writes one from text
(the N ids most frequent in it under the model's tokenizer); `--speculative-config`'s
`"draft_vocab"` reads it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path


class DraftVocabError(ValueError):
    """A draft vocabulary file that cannot be used (the message says why)."""


def most_frequent(token_ids: Iterable[Sequence[int]], size: int) -> list[int]:
    """The `size` ids most frequent over the sequences (ties: the lower id first), in id
    order."""
    if size < 1:
        raise DraftVocabError(f"a draft vocabulary needs at least one token, asked for {size}")
    counts: Counter[int] = Counter()
    for ids in token_ids:
        counts.update(ids)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    return sorted(ranked[:size])


def write(path: str | Path, ids: Sequence[int]) -> None:
    Path(path).write_text(json.dumps(list(ids)) + "\n")


def read(path: str | Path) -> tuple[int, ...]:
    """A draft vocabulary file → its ids, ascending (the argmax takes the lowest id among equal
    maxima, as over the whole vocabulary). Raises DraftVocabError."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise DraftVocabError(f"{path}: cannot be read ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise DraftVocabError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from e
    if not isinstance(raw, list) or not raw or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
        raise DraftVocabError(f"{path}: must be a non-empty JSON list of token ids (integers "
                              ">= 0)")
    if len(set(raw)) != len(raw):
        raise DraftVocabError(f"{path}: token ids repeat")
    return tuple(sorted(raw))


def check(ids: Sequence[int], vocab_size: int, source: str) -> None:
    """Every id is the model's."""
    if ids and ids[-1] >= vocab_size:  # (ascending: the last is the largest)
        raise DraftVocabError(f"{source}: token id {ids[-1]} is outside the model's vocabulary "
                              f"[0, {vocab_size})")
