"""The one place that knows the KV event byte layout (docs/concepts/protocols.md section 7).

Payloads: our encoder writes the current encoding (map-form events inside the array-form
:class:`EventBatch`); the decoder reads both that and the older array-like events, with an
EventBatch of 2 or 3 elements. Frames: live ``[topic, seq, payload]``; replay request
``[identity, b"", start_seq]`` at the ROUTER; replay replies in the new framing
``[topic, seq, payload]`` + ``[b"", END_SEQ, b""]`` (what we send) or the old framing
``[seq, payload]`` + ``[END_SEQ, b""]`` (also understood).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from .errors import KVEventDecodeError
from .models import EventBatch

__all__ = [
    "END_SEQ",
    "REPLAY_END",
    "LiveMessage",
    "ReplayEnd",
    "ReplayRequest",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "live_frames",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end_frames",
    "replay_reply_frames",
    "replay_request_frames",
]

logger = logging.getLogger(__name__)

END_SEQ: Final[bytes] = (-1).to_bytes(8, "big", signed=True)
"""Replay end marker: -1 as an 8-byte big-endian signed integer."""

# Positional field order of the array-like (old) encoding; later fields are ignored.
_POSITIONAL_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}

_encoder = msgspec.msgpack.Encoder()
_raw_decoder = msgspec.msgpack.Decoder()
_typed_decoder = msgspec.msgpack.Decoder(EventBatch)


class LiveMessage(msgspec.Struct, frozen=True):
    """One message as framed on the live PUB socket (or in a replay reply).

    ``topic`` is None for replies in the old framing, which carries no topic.
    """

    topic: str | None
    seq: int
    payload: bytes


class ReplayRequest(msgspec.Struct, frozen=True):
    """A well-formed replay request as seen by the ROUTER."""

    identity: bytes
    start_seq: int


class ReplayEnd(msgspec.Struct, frozen=True):
    """The end-of-replay marker (either framing)."""


REPLAY_END: Final = ReplayEnd()


def encode_seq(seq: int) -> bytes:
    """``seq`` as 8 bytes big-endian unsigned; raises OverflowError outside 0..2**64-1."""
    return seq.to_bytes(8, "big", signed=False)


def decode_seq(frame: bytes) -> int:
    """Inverse of :func:`encode_seq`; raises KVEventDecodeError unless ``frame`` is 8 bytes."""
    if len(frame) != 8:
        raise KVEventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=False)


def encode_batch(batch: EventBatch) -> bytes:
    """Msgpack bytes of ``batch`` in the current encoding (map-form events)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode an EventBatch in either event encoding.

    Accepts map (new) and array-like (old) events, possibly mixed, a batch of 2 or 3 elements
    (later elements are ignored), and ``bytes`` block hashes (folded to the low 64 bits of the
    big-endian value, which is what vLLM's integer hashes are). Fields this model lacks are
    ignored, and so are events of an unknown type (logged). Raises KVEventDecodeError otherwise.
    """
    try:
        return _typed_decoder.decode(payload)  # the current encoding, in one pass
    except msgspec.ValidationError:
        pass  # valid msgpack of another shape: take the general path below
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"payload is not msgpack: {exc}") from exc
    raw = _raw_decoder.decode(payload)
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventDecodeError("EventBatch must be an array [ts, events(, rank)]")
    events = [event for item in raw[1] if (event := _normalise_event(item)) is not None]
    rank = raw[2] if len(raw) > 2 else None
    try:
        return msgspec.convert([raw[0], events, rank], EventBatch)
    except msgspec.ValidationError as exc:
        raise KVEventDecodeError(f"invalid EventBatch: {exc}") from exc


def _normalise_event(item: Any) -> dict[str, Any] | None:
    """One raw event as a map-form dict, or None for an event type we do not know."""
    event = _as_map(item)
    if event["type"] not in _POSITIONAL_FIELDS:
        logger.warning("skipping KV event of unknown type %r", event["type"])
        return None
    if isinstance(event.get("block_hashes"), list):
        event["block_hashes"] = [_fold_hash(h) for h in event["block_hashes"]]
    if "parent_block_hash" in event:
        event["parent_block_hash"] = _fold_hash(event["parent_block_hash"])
    return event


def _as_map(item: Any) -> dict[str, Any]:
    """A copy of a map-form event, or an array-like event keyed by its positional fields."""
    if isinstance(item, dict) and isinstance(item.get("type"), str):
        return dict(item)
    if isinstance(item, list) and item and isinstance(item[0], str):
        names = _POSITIONAL_FIELDS.get(item[0], ())
        return {"type": item[0], **dict(zip(names, item[1:], strict=False))}
    raise KVEventDecodeError(f"event is neither a tagged array nor a tagged map: {item!r:.80}")


def _fold_hash(value: Any) -> Any:
    """Bytes hashes become the int of their last 8 bytes (big-endian); others pass through."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value


def live_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """Frames of one live message: ``[topic utf-8, seq, payload]``."""
    return [topic.encode(), encode_seq(seq), payload]


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """Parse a live message; raises KVEventDecodeError unless it has the 3-frame shape."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"live message must have 3 frames, got {len(frames)}")
    try:
        topic = frames[0].decode()
    except UnicodeDecodeError as exc:
        raise KVEventDecodeError("topic frame is not utf-8") from exc
    return LiveMessage(topic, decode_seq(frames[1]), frames[2])


def replay_request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with ``seq >= start_seq``."""
    return [b"", encode_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> ReplayRequest | None:
    """The request as received by the ROUTER, or None unless it is exactly
    ``[identity, b"", start_seq(8 bytes)]``."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return ReplayRequest(frames[0], decode_seq(frames[2]))


def replay_reply_frames(identity: bytes, message: LiveMessage) -> list[bytes]:
    """One replayed batch in the new framing: ``[identity, b"", topic, seq, payload]``."""
    return [identity, b"", *live_frames(message.topic or "", message.seq, message.payload)]


def replay_end_frames(identity: bytes) -> list[bytes]:
    """The new-framing end marker: ``[identity, b"", b"", END_SEQ, b""]``."""
    return [identity, b"", b"", END_SEQ, b""]


def parse_replay_reply(frames: Sequence[bytes]) -> LiveMessage | ReplayEnd:
    """Parse one reply as received by a DEALER (``[b"", ...]``), in either framing.

    New: ``[b"", topic, seq, payload]`` and ``[b"", b"", END_SEQ, b""]``.
    Old: ``[b"", seq, payload]`` and ``[b"", END_SEQ, b""]``.
    Raises KVEventDecodeError for any other shape.
    """
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise KVEventDecodeError(f"replay reply has an unknown framing ({len(frames)} frames)")
    body = frames[1:]
    if body[-2] == END_SEQ:
        return REPLAY_END
    if len(body) == 2:
        return LiveMessage(None, decode_seq(body[0]), body[1])
    return parse_live(body)
