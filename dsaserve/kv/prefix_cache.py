"""Prefix-cache block hashes: the identity of a full block of tokens *and everything before it*.

    block i covers tokens [i·S, (i+1)·S)    (S = scheduler block = page size B · DCP size N)

    h0 = H(None, tokens[0:S],   (("cache_salt", salt),))     salt only in the first block
    h1 = H(h0,   tokens[S:2S],  ())
    h2 = H(h1,   tokens[2S:3S], ())      a partial tail block has no hash

Chaining makes equal hashes mean equal prefixes. H is SHA-256 over a canonical, length-prefixed
encoding (never Python's `hash` or pickle), so engines, the router and the offload tier agree on
hashes across processes and restarts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_DOMAIN = b"dsaserve.block.v1"
_SALT_TAG = "cache_salt"


def _encode(value: object, out: bytearray) -> None:
    """Append a self-delimiting encoding: one type tag, then a length or a fixed-width value."""
    if isinstance(value, bool) or value is None:
        out += b"n" if value is None else (b"T" if value else b"F")
    elif isinstance(value, int):
        out += b"i" + value.to_bytes(16, "big", signed=True)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += b"s" + struct.pack(">Q", len(data)) + data
    elif isinstance(value, bytes):
        out += b"b" + struct.pack(">Q", len(value)) + value
    elif isinstance(value, tuple):
        out += b"t" + struct.pack(">Q", len(value))
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(
            f"extras: cannot hash a {type(value).__name__}; use str, int, bytes, bool, None, tuple"
        )


def hash_block(
    parent: bytes | None, token_ids: Sequence[int], extras: tuple = ()
) -> bytes:
    """SHA-256 of (parent hash, token ids, tagged extras).

    `extras` is a tuple of (tag, value) pairs, e.g. (("cache_salt", "tenant-a"),); the tag keeps
    different kinds of extra from colliding with each other.
    """
    for extra in extras:
        if not (isinstance(extra, tuple) and len(extra) == 2 and isinstance(extra[0], str)):
            raise TypeError(f"extras: expected (tag: str, value) pairs, got {extra!r}")
    out = bytearray(_DOMAIN)
    _encode(parent, out)
    out += b"k" + struct.pack(f">Q{len(token_ids)}q", len(token_ids), *token_ids)
    _encode(extras, out)
    return hashlib.sha256(out).digest()


def _first_block_extras(cache_salt: str | None) -> tuple:
    return ((_SALT_TAG, cache_salt),) if cache_salt is not None else ()


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
) -> int:
    """Append to `block_hashes` the hashes of blocks of `token_ids` that became full since the list
    was last extended; return how many were added. Called as a request's tokens grow.

    Invariant: `block_hashes` holds the hashes of blocks 0 .. len(block_hashes)−1 of `token_ids`.
    """
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    start = len(block_hashes)
    num_full = len(token_ids) // block_size
    for i in range(start, num_full):
        parent = block_hashes[i - 1] if i > 0 else None
        extras = _first_block_extras(cache_salt) if i == 0 else ()
        block_hashes.append(
            hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extras)
        )
    return max(num_full - start, 0)


def request_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> list[bytes]:
    """The hashes of every full block of `token_ids` (block_size is the scheduler block B·N)."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, cache_salt)
    return hashes
