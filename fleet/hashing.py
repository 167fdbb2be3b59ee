"""Chained block hashes, the way vLLM's prefix cache keys its blocks.

A block's hash depends on its parent's hash and its own tokens, so equal hashes mean equal
prefixes up to and including that block. vLLM uses SHA-256 (or xxHash) over CBOR; the exact
digest does not matter to prefixscope, only the chaining and the unsigned 64-bit range (vLLM
publishes the low 64 bits of its digest as the event hash), so a cheap blake2b is used here.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

# Parent bytes of the first block: vLLM seeds its chain with a fixed NONE_HASH as well.
_NONE_PARENT = b"prefixscope-none"[:8]
_SWAP = sys.byteorder != "little"  # pack tokens little-endian on every platform


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("q", tokens)
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Unsigned 64-bit hash of one block, chained on ``parent`` (None for the first block)."""
    h = blake2b(_NONE_PARENT if parent is None else parent.to_bytes(8, "big"), digest_size=8)
    h.update(_token_bytes(tokens))
    return int.from_bytes(h.digest(), "big")


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block has no hash)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out


def hash_to_bytes(h: int) -> bytes:
    """The 8-byte big-endian form (what a consumer reading byte hashes takes the last 8 bytes of)."""
    return h.to_bytes(8, "big")
