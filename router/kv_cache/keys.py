"""The router's own block keys: ``chain_keys`` and the constants of the key space.

Engines' block hashes cannot be reproduced here (the seed, algorithm and extra keys differ per
engine, docs/concepts/protocols.md section 11.2), so the index keys blocks by keys chained from the
token ids
every ``BlockStored`` carries. Keys and folded engine hashes are 60-bit ints, which keeps each int
object at 32 bytes.

Standard library only: the hash-seed test loads this file alone, outside the ``router`` package.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["INT_BYTES", "KEY_BITS", "KEY_MASK", "ROOT_KEY", "adapter_root", "chain_keys"]

KEY_BITS = 60
KEY_MASK = (1 << KEY_BITS) - 1
ROOT_KEY = 0x0B5E55ED_C0FFEE1
"""The parent of a sequence's first block (an arbitrary fixed constant below 2**60)."""

INT_BYTES = 32  # a 60-bit int object


def adapter_root(adapter: str | None) -> int:
    """The parent of a sequence's first block computed through LoRA ``adapter`` (None: the
    base model, ``ROOT_KEY``). The engines key an adapter's blocks apart from the base model's
    (vLLM and SGLang add the adapter to the block hash's extra keys and name it in the events'
    ``lora_name``), so the same tokens under another adapter are other blocks. A digest, not
    ``hash(str)``, which ``PYTHONHASHSEED`` salts per process."""
    if adapter is None:
        return ROOT_KEY
    digest = int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8).digest(), "big")
    return hash((ROOT_KEY, digest)) & KEY_MASK


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """The router's chained keys of the full blocks of ``token_ids`` (a trailing partial block has
    none): ``key_i = hash((key_{i-1}, hash(tokens of block i))) mod 2**60``, ``key_{-1}`` being
    ``parent``.

    Python's hash of ints and of tuples of ints does not depend on ``PYTHONHASHSEED`` (only
    str/bytes hashing is salted), so keys agree across the router's processes (same CPython build).
    The blocks are cut and hashed in C; about 0.2 us a block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[int] = []
    append = keys.append
    key = parent
    # zip over one iterator taken block_size times: the full blocks as tuples, built in C
    for block in map(hash, zip(*[iter(token_ids)] * block_size, strict=False)):
        key = hash((key, block)) & KEY_MASK
        append(key)
    return keys
