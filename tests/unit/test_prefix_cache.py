"""Prefix-cache block hashes: chained, canonical, salted in the first block only."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest

from dsaserve.kv.prefix_cache import extend_block_hashes, hash_block, request_block_hashes


def test_only_full_blocks_are_hashed() -> None:
    assert len(request_block_hashes(list(range(11)), 4, None)) == 2
    assert len(request_block_hashes(list(range(12)), 4, None)) == 3
    assert request_block_hashes([1, 2, 3], 4, None) == []


def test_hash_chains_on_the_parent() -> None:
    a = request_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, None)
    b = request_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4, None)
    assert a[1] != b[1], "same tokens after a different prefix must not share a hash"
    assert a[0] == hash_block(None, [1, 2, 3, 4])
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])


def test_equal_prefixes_share_hashes_then_diverge() -> None:
    a = request_block_hashes(list(range(16)), 4, None)
    b = request_block_hashes(list(range(12)) + [0, 0, 0, 0], 4, None)
    assert a[:3] == b[:3] and a[3] != b[3]


def test_salt_enters_the_first_block_only() -> None:
    tokens = list(range(8))
    plain = request_block_hashes(tokens, 4, None)
    salted = request_block_hashes(tokens, 4, "tenant-a")
    other = request_block_hashes(tokens, 4, "tenant-b")
    assert salted[0] == hash_block(None, tokens[:4], (("cache_salt", "tenant-a"),))
    assert len({plain[0], salted[0], other[0]}) == 3
    assert salted[1] == hash_block(salted[0], tokens[4:])  # no salt, only the chained parent
    assert request_block_hashes(tokens, 4, "") != plain, "an empty salt is still a salt"


def test_encoding_is_unambiguous() -> None:
    # Field boundaries are length-prefixed: moving a token between fields changes the hash.
    assert hash_block(None, [1, 2], (("x", (3,)),)) != hash_block(None, [1, 2, 3], (("x", ()),))
    assert hash_block(None, [1], (("t", 1),)) != hash_block(None, [1], (("t", "1"),))
    assert hash_block(None, [1], (("t", True),)) != hash_block(None, [1], (("t", 1),))
    assert hash_block(None, [0]) != hash_block(None, [])
    assert hash_block(b"\x00" * 32, [1]) != hash_block(None, [1])


def test_extras_are_validated() -> None:
    with pytest.raises(TypeError, match="extras"):
        hash_block(None, [1], ("salt",))
    with pytest.raises(TypeError, match="extras"):
        hash_block(None, [1], (("t", 1.5),))


def test_extend_matches_full_computation_as_tokens_grow() -> None:
    tokens: list[int] = []
    hashes: list[bytes] = []
    for t in range(37):
        tokens.append((t * 7) % 11)
        added = extend_block_hashes(hashes, tokens, 4, "s")
        assert added == (1 if len(tokens) % 4 == 0 else 0)
        assert hashes == request_block_hashes(tokens, 4, "s")


def test_hash_is_sha256_of_the_documented_encoding() -> None:
    """Pin the byte format: router, offload tier and engines in other processes must agree."""
    enc = bytearray(b"dsaserve.block.v1")
    enc += b"n"  # parent None
    enc += b"k" + struct.pack(">Q2q", 2, 5, 6)  # tokens
    enc += b"t" + struct.pack(">Q", 0)  # empty extras tuple
    assert hash_block(None, [5, 6]) == hashlib.sha256(enc).digest()


def test_hash_is_stable_across_processes() -> None:
    """Python's hash() is salted per process; ours must not be."""
    code = ("from dsaserve.kv.prefix_cache import request_block_hashes as r;"
            "print(r(list(range(8)), 4, 'x')[-1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == request_block_hashes(list(range(8)), 4, "x")[-1].hex()


def _reference_hash(parent: bytes | None, ids: list[int], salt: str | None) -> bytes:
    """The documented encoding written out, each block's ids packed alone by struct."""
    out = b"dsaserve.block.v1"
    out += b"n" if parent is None else b"b" + struct.pack(">Q", len(parent)) + parent
    out += b"k" + struct.pack(f">Q{len(ids)}q", len(ids), *ids)
    if salt is None:
        out += b"t" + struct.pack(">Q", 0)
    else:
        tag, value = b"cache_salt", salt.encode()
        out += (b"t" + struct.pack(">Q", 1) + b"t" + struct.pack(">Q", 2)
                + b"s" + struct.pack(">Q", len(tag)) + tag
                + b"s" + struct.pack(">Q", len(value)) + value)
    return hashlib.sha256(out).digest()


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_extended_hashes_match_the_encoding_block_by_block(salt) -> None:
    """Extending in uneven steps gives each block the hash of the encoding over its own ids
    and its parent (the blocks past the first are framed once per call), ids up to the int64
    range included; beyond it nothing is hashed."""
    ids = [(i * 7919) % 150000 for i in range(16 * 9 + 5)]
    ids[17], ids[40] = 2**63 - 1, 2**40
    hashes: list[bytes] = []
    for end in (3, 16, 17, 70, len(ids)):
        extend_block_hashes(hashes, ids[:end], 16, salt)
    assert len(hashes) == 9
    parent = None
    for i, h in enumerate(hashes):
        assert h == _reference_hash(parent, ids[16 * i: 16 * (i + 1)], salt if i == 0 else None)
        parent = h
    with pytest.raises(struct.error):
        extend_block_hashes(hashes, ids + [2**63] + [0] * 15, 16, salt)
