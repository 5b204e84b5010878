"""Prefix-cache hashes as a property (hypothesis): block i of two requests hashes equal exactly when
their first (i+1)·S tokens and their salts are equal; growing a request block by block gives the
hashes of the whole; nothing else (a tail shorter than a block, the text around it) matters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dsaserve.kv.prefix_cache import extend_block_hashes, request_block_hashes

tokens = st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 3), max_size=40)
salts = st.sampled_from([None, "", "a", "b", "ü🙂", "None"])


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(shared=tokens, a=tokens, b=tokens, block=st.integers(1, 8), salt_a=salts, salt_b=salts)
def test_equal_hash_iff_equal_prefix_and_salt(shared, a, b, block, salt_a, salt_b) -> None:
    ta, tb = shared + a, shared + b
    ha = request_block_hashes(ta, block, salt_a)
    hb = request_block_hashes(tb, block, salt_b)
    assert len(ha) == len(ta) // block and len(hb) == len(tb) // block
    for i in range(min(len(ha), len(hb))):
        same = ta[:(i + 1) * block] == tb[:(i + 1) * block] and salt_a == salt_b
        assert (ha[i] == hb[i]) == same, (i, block)


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(ids=tokens, block=st.integers(1, 8), salt=salts,
       cuts=st.lists(st.integers(0, 40), max_size=6))
def test_growing_a_request_gives_the_hashes_of_the_whole(ids, block, salt, cuts) -> None:
    hashes: list[bytes] = []
    for cut in sorted(cuts) + [len(ids)]:
        extend_block_hashes(hashes, ids[:cut], block, salt)
    assert hashes == request_block_hashes(ids, block, salt)
