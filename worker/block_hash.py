"""Chained block keys over token ids, as vLLM and SGLang compute their prefix-cache hashes.

A block is one full KV page (``page_size`` tokens). Each block's key chains the previous block's,
so a key names a whole prefix. What the engines put in KV events (docs/concepts/protocols.md 7.2,
11.2):

* SGLang: ``sha256(parent_digest + tokens as little-endian uint32)`` (no parent for the first
  page); the event id is the digest's high 64 bits as a signed int64.
* vLLM (``--prefix-caching-hash-algo sha256``): ``sha256(pickle((parent, tokens, extra_keys)))``
  with the first parent ``NONE_HASH``, itself ``sha256(pickle(PYTHONHASHSEED))`` or 32 random
  bytes when the seed is unset (here ``--hash-seed``); the event id is the low 64 bits
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

The router never recomputes these: it keys blocks by the ``token_ids`` each BlockStored carries.
What matters is that keys are stable for one engine run and differ between seeds.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["BlockHasher", "BlockKey", "block_hasher", "sglang_block_keys", "vllm_block_hasher"]


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One full block's chained key: ``digest`` indexes the cache, ``event_id`` goes on the wire."""

    digest: bytes
    event_id: int


BlockHasher = Callable[[Sequence[int], int], list[BlockKey]]
"""``(tokens, page_size) -> keys of every full page of tokens``, in order."""

_PICKLE = pickle.HIGHEST_PROTOCOL


def sglang_block_keys(tokens: Sequence[int], page_size: int) -> list[BlockKey]:
    """SGLang's chained page hashes (``get_hash_str``; ``hash_str_to_int64`` for the id)."""
    keys: list[BlockKey] = []
    parent = b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        digest = hashlib.sha256(parent + struct.pack(f"<{len(page)}I", *page)).digest()
        keys.append(BlockKey(digest, int.from_bytes(digest[:8], "big", signed=True)))
        parent = digest
    return keys


def vllm_block_hasher(seed: str | None) -> BlockHasher:
    """vLLM's ``sha256`` block hashes, rooted at ``NONE_HASH`` for ``seed`` (None: random)."""
    root = os.urandom(32) if seed is None else hashlib.sha256(pickle.dumps(seed, _PICKLE)).digest()

    def keys(tokens: Sequence[int], page_size: int) -> list[BlockKey]:
        out: list[BlockKey] = []
        parent = root
        for start in range(0, len(tokens) - page_size + 1, page_size):
            block = (parent, tuple(tokens[start : start + page_size]), None)
            digest = hashlib.sha256(pickle.dumps(block, _PICKLE)).digest()
            out.append(BlockKey(digest, int.from_bytes(digest[-8:], "big")))
            parent = digest
        return out

    return keys


def block_hasher(protocol: str, seed: str | None = None, *, rehash: bool = False) -> BlockHasher:
    """The hash function of the engine that speaks ``protocol`` (``sglang`` or ``vllm-*``);
    ``rehash``: a fresh seed per call instead (a fault: the cache never hits)."""
    if rehash:
        return lambda tokens, size: vllm_block_hasher(os.urandom(8).hex())(tokens, size)
    return sglang_block_keys if protocol == "sglang" else vllm_block_hasher(seed)
