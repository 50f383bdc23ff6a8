"""Typed KV cache event model (docs/concepts/protocols.md section 7.2).

The events are msgspec Structs in a ``tag=True`` union whose tag is the class name, so each
encodes as a map ``{"type": "BlockStored", ...}``: the current encoding of vLLM >= 0.24 and
SGLang >= 0.5.20. :class:`EventBatch` is always a positional array ``[ts, events, rank]``.
Decoding the older array-like event encoding lives in :mod:`transfer.events.codec`.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEvent",
]

MEDIUM_GPU = "GPU"


class KVCacheEvent(msgspec.Struct, tag=True, frozen=True, gc=False):
    """Base of the event union; the wire tag is the subclass name.

    ``omit_defaults`` stays off: every field of ours is one that vLLM 0.33 declares without a
    default (``medium``, ``lora_name``), so it is written even when null, exactly as in
    docs/concepts/protocols.md's example. The engines' null-defaulted extras (``extra_keys``,
    ``group_idx``,
    ``cache_salt``, ...) are not part of this model: decoding ignores them, encoding never has them.
    """


class BlockStored(KVCacheEvent, frozen=True):
    """Blocks entered the prefix cache; ``block_hashes`` chain from ``parent_block_hash``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent, frozen=True):
    """Blocks were evicted from ``medium``."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """The engine dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """One published step: ``[ts, events, data_parallel_rank]``.

    Declared as vLLM declares it; msgspec writes a null rank as null (3 elements), and the
    decoder also accepts 2-element batches. SGLang calls the third element ``attn_dp_rank``.
    """

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
