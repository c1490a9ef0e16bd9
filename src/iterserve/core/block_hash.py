"""Prefix-cache block hashes: stable across processes and machines, collision-resistant.

Block ``i`` of a sequence is keyed by ``H(key of block i-1 || token ids of block i)``,
a chain, so equal keys mean equal prefixes, not just equal blocks. The first block's
parent is a root that mixes in the request's ``cache_salt``: requests with different
salts never share a block. ``H`` is sha256 (hashlib, the default) or xxhash's
128-bit XXH3 (``--prefix-caching-hash-algo xxhash``, needs the ``xxhash`` package).

Token ids are encoded as little-endian uint32 (every vocabulary fits), so a key
depends on nothing but the algorithm, the block size, the salt and the tokens: a
router computes the same chain as every replica. The KV cache manager and the
cluster router both call ``extend_block_hashes``; there is no other hashing path.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence

from iterserve.config import PREFIX_CACHING_HASH_ALGOS

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

# Versioned, so a change of encoding can never alias keys of the old one.
_ROOT_TAG = b"iterserve/prefix-cache/v1"

_NEEDS_SWAP = sys.byteorder != "little"
if array("I").itemsize != 4:  # pragma: no cover - no mainstream platform
    raise ImportError("iterserve needs a 4-byte array('I') to encode token ids")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def get_hash_fn(algo: str) -> HashFn:
    """The hash function named by ``--prefix-caching-hash-algo``."""
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError:
            raise ValueError(
                "prefix_caching_hash_algo 'xxhash' needs the xxhash package: "
                "pip install xxhash (or pip install 'iterserve[xxhash]')"
            ) from None
        fn: HashFn = xxhash.xxh3_128_digest
        return fn
    raise ValueError(
        f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}, "
        f"got {algo!r}"
    )


def root_hash(hash_fn: HashFn, cache_salt: str | None = None) -> BlockHash:
    """The parent of a sequence's first block: the salt is mixed in here."""
    if cache_salt is None:
        return hash_fn(_ROOT_TAG + b"\x00")
    return hash_fn(_ROOT_TAG + b"\x01" + cache_salt.encode("utf-8", "surrogatepass"))


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (ValueError for ids outside [0, 2**32))."""
    try:
        a = array("I", token_ids)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32) to be hashed") from None
    if _NEEDS_SWAP:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


def extend_block_hashes(
    hash_fn: HashFn,
    block_size: int,
    token_ids: Sequence[int],
    hashes: list[BlockHash],
    num_full_blocks: int,
    root: BlockHash,
) -> list[BlockHash]:
    """Append the keys of blocks ``len(hashes) .. num_full_blocks-1`` of ``token_ids``
    to ``hashes`` (the chain so far, starting from ``root``), and return it.

    One encode for the whole range, then one hash per block over (32 or 16 parent
    bytes + 4 bytes per token): the KV cache calls this once per filled block.
    """
    n = len(hashes)
    if n >= num_full_blocks:
        return hashes
    data = encode_token_ids(token_ids[n * block_size : num_full_blocks * block_size])
    parent = hashes[-1] if n else root
    step = 4 * block_size
    for start in range(0, len(data), step):
        parent = hash_fn(parent + data[start : start + step])
        hashes.append(parent)
    return hashes


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    hash_algo: str = "sha256",
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """The keys of every full block of ``token_ids``: what a replica's prefix cache
    would hold for this prompt (routers use it to predict hits)."""
    hash_fn = get_hash_fn(hash_algo)
    return extend_block_hashes(
        hash_fn, block_size, token_ids, [], len(token_ids) // block_size,
        root_hash(hash_fn, cache_salt),
    )
