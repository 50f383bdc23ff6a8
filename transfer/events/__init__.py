"""KV cache event feed (docs/concepts/protocols.md section 7): typed events, publisher, subscriber.

Engines publish with :class:`KVEventPublisher`; the router follows each engine (one per DP
rank) with :class:`KVEventSubscriber`, which decodes every encoding and framing that vLLM
and SGLang have shipped and recovers missed batches through replay.
"""

from __future__ import annotations

from .codec import END_SEQ, decode_batch, encode_batch
from .errors import EventGapError, KVEventDecodeError, KVEventError, ReplayTimeout
from .models import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEvent,
)
from .publisher import KVEventPublisher
from .subscriber import KVEventSubscriber, ReceivedBatch, SubscriberStats

__all__ = [
    "END_SEQ",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventGapError",
    "KVCacheEvent",
    "KVEvent",
    "KVEventDecodeError",
    "KVEventError",
    "KVEventPublisher",
    "KVEventSubscriber",
    "ReceivedBatch",
    "ReplayTimeout",
    "SubscriberStats",
    "decode_batch",
    "encode_batch",
]
