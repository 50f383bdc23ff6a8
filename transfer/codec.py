"""Messages <-> zmq multipart frames: the only module that knows the control plane's byte layout.

Every message is ``[header, *body]``. The header is ASCII ``PDKV/<version>/<TYPE>``, for example
``b"PDKV/1/TRANSFER_INFO"``. Body frames are ASCII decimal for scalars, UTF-8 for strings, packed
little-endian u64 for pointer arrays and packed little-endian int32 for page indices; an empty
frame stands for "none" (the aux index of a dummy, a status without a reason).

Protocol version 1:

=================  ==========================================================================
type               frames after the header
=================  ==========================================================================
REGISTER_KV_ARGS   ip, port, session_id, kv_data_ptrs (u64[]), aux_data_ptrs (u64[]),
                   dst_tp_rank, dst_tp_size, kv_item_len, kv_num_pages
TRANSFER_INFO      room, ip, port, session_id, dst_kv_indices (int32[]; empty for a dummy),
                   dst_aux_index (empty for a dummy), required_dst_info_num
TRANSFER_STATUS    room, status (KVPoll value), prefill_rank, reason (UTF-8; empty for none)
ABORT              room
=================  ==========================================================================

Where and why this differs from SGLang 0.4.10's Mooncake frames (docs/concepts/protocols.md
6.3-6.5):

* A versioned header comes first. SGLang's frames carry no version, and its message kind is
  implied by frame 0 (``b"None"`` for a registration, a room number otherwise) or, in 0.5.x, by
  ad-hoc tags (``b"ABORT"``, ``b"KV_STATUS"``) with optional trailing frames. A peer speaking
  another version or another protocol is refused with a ``ProtocolMismatch`` naming both, instead
  of being misparsed. Under the header the SGLang 0.4.10 frames follow in SGLang's order
  (registration drops the ``b"None"`` the header replaces).
* One typed message per type, with an exact frame count: no optional trailing frames; a new
  field is a new protocol version.
* Packed arrays are little-endian by definition (SGLang packs in native order).
* Additions: ``kv_num_pages`` ends REGISTER_KV_ARGS (the prefill bounds-checks destination
  pages), ``reason`` ends TRANSFER_STATUS (as NIXL's status does) and ABORT exists (0.5.x's
  ``ABORT`` without the ip/port/generation).

So our frames are not wire-compatible with SGLang's; a peer that sends SGLang frames gets a
``ProtocolMismatch`` that says so.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Final, TypeAlias, assert_never

from transfer.errors import ProtocolMismatch
from transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Message,
    RegisterKVArgs,
    TransferInfo,
    TransferStatus,
)
from transfer.state import KVPoll

__all__ = ["MAGIC", "PROTOCOL_VERSION", "Frame", "decode", "encode", "header"]

Frame: TypeAlias = bytes | bytearray | memoryview

MAGIC: Final = b"PDKV"
_MAX_HEADER = 64  # longer frame 0 is not ours; also bounds what error messages quote
_MAX_DIGITS = 20  # a u64 in decimal

_TAGS: Final[dict[type[Message], bytes]] = {
    RegisterKVArgs: b"REGISTER_KV_ARGS",
    TransferInfo: b"TRANSFER_INFO",
    TransferStatus: b"TRANSFER_STATUS",
    Abort: b"ABORT",
}


def header(msg_type: type[Message], version: int = PROTOCOL_VERSION) -> bytes:
    """Frame 0 for ``msg_type`` (``version`` is a parameter for tests of mismatches)."""
    return b"%s/%d/%s" % (MAGIC, version, _TAGS[msg_type])


# --- encoding --------------------------------------------------------------------------------


def _int(value: int) -> bytes:
    return b"%d" % value


def _u64s(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def _i32s(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _optional_int(value: int | None) -> bytes:
    return b"" if value is None else _int(value)


def encode(msg: Message) -> list[bytes]:
    """The multipart frames of ``msg``, header first. Never fails for a constructed message."""
    body: list[bytes]
    match msg:
        case RegisterKVArgs():
            body = [
                msg.ip.encode(),
                _int(msg.port),
                msg.session_id.encode(),
                _u64s(msg.kv_data_ptrs),
                _u64s(msg.aux_data_ptrs),
                _int(msg.dst_tp_rank),
                _int(msg.dst_tp_size),
                _int(msg.kv_item_len),
                _int(msg.kv_num_pages),
            ]
        case TransferInfo():
            body = [
                _int(msg.room),
                msg.ip.encode(),
                _int(msg.port),
                msg.session_id.encode(),
                _i32s(msg.dst_kv_indices),
                _optional_int(msg.dst_aux_index),
                _int(msg.required_dst_info_num),
            ]
        case TransferStatus():
            reason = b"" if msg.reason is None else msg.reason.encode()
            body = [_int(msg.room), _int(msg.status), _int(msg.prefill_rank), reason]
        case Abort():
            body = [_int(msg.room)]
        case _:
            assert_never(msg)
    return [header(type(msg)), *body]


# --- decoding --------------------------------------------------------------------------------


class _Reader:
    """Reads one message's body frames by name, turning every defect into ``ProtocolMismatch``."""

    def __init__(self, tag: str, frames: Sequence[Frame]) -> None:
        self.tag = tag
        self.frames = frames
        self.index = 0

    def fail(self, name: str, problem: str) -> ProtocolMismatch:
        return ProtocolMismatch(f"{self.tag} frame {self.index} ({name}): {problem}")

    def _next(self) -> bytes:
        self.index += 1
        return bytes(self.frames[self.index])

    def number(self, name: str) -> int:
        raw = self._next()
        if not raw or len(raw) > _MAX_DIGITS or not raw.isdigit():
            raise self.fail(name, f"expected an ASCII decimal, got {_quote(raw)}")
        return int(raw)

    def optional_number(self, name: str) -> int | None:
        if not self.frames[self.index + 1]:
            self.index += 1
            return None
        return self.number(name)

    def text(self, name: str, *, optional: bool = False) -> str:
        raw = self._next()
        if not raw and not optional:
            raise self.fail(name, "empty")
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise self.fail(name, f"not UTF-8: {_quote(raw)}") from None

    def array(self, name: str, fmt: str) -> tuple[int, ...]:
        raw = self._next()
        size = struct.calcsize("<" + fmt)
        if len(raw) % size:
            raise self.fail(name, f"{len(raw)} bytes is not a whole number of {size}-byte items")
        values: tuple[int, ...] = struct.unpack(f"<{len(raw) // size}{fmt}", raw)
        return values


def _read_register(r: _Reader) -> RegisterKVArgs:
    return RegisterKVArgs(
        ip=r.text("ip"),
        port=r.number("port"),
        session_id=r.text("session_id"),
        kv_data_ptrs=r.array("kv_data_ptrs", "Q"),
        aux_data_ptrs=r.array("aux_data_ptrs", "Q"),
        dst_tp_rank=r.number("dst_tp_rank"),
        dst_tp_size=r.number("dst_tp_size"),
        kv_item_len=r.number("kv_item_len"),
        kv_num_pages=r.number("kv_num_pages"),
    )


def _read_transfer_info(r: _Reader) -> TransferInfo:
    return TransferInfo(
        room=r.number("room"),
        ip=r.text("ip"),
        port=r.number("port"),
        session_id=r.text("session_id"),
        dst_kv_indices=r.array("dst_kv_indices", "i"),
        dst_aux_index=r.optional_number("dst_aux_index"),
        required_dst_info_num=r.number("required_dst_info_num"),
    )


def _read_status(r: _Reader) -> TransferStatus:
    room = r.number("room")
    value = r.number("status")
    try:
        status = KVPoll(value)
    except ValueError:
        raise r.fail("status", f"{value} is not a KVPoll value") from None
    prefill_rank = r.number("prefill_rank")
    reason = r.text("reason", optional=True) or None
    return TransferStatus(room=room, status=status, prefill_rank=prefill_rank, reason=reason)


def _read_abort(r: _Reader) -> Abort:
    return Abort(room=r.number("room"))


# type tag -> (body frame count, reader)
_READERS: Final[dict[bytes, tuple[int, Callable[[_Reader], Message]]]] = {
    _TAGS[RegisterKVArgs]: (9, _read_register),
    _TAGS[TransferInfo]: (7, _read_transfer_info),
    _TAGS[TransferStatus]: (4, _read_status),
    _TAGS[Abort]: (1, _read_abort),
}


def _quote(raw: bytes, limit: int = 40) -> str:
    return repr(raw[:limit]) + ("..." if len(raw) > limit else "")


def _parse_header(frame0: bytes) -> bytes:
    """The type tag of a frame 0 of our protocol version; ``ProtocolMismatch`` otherwise."""
    parts = frame0.split(b"/") if len(frame0) <= _MAX_HEADER else []
    if len(parts) != 3 or parts[0] != MAGIC:
        sglang = frame0 == b"None" or frame0.isdigit() or frame0.startswith(b"KV_STATUS")
        hint = " (it looks like SGLang's Mooncake frames)" if sglang else ""
        raise ProtocolMismatch(
            f"frame 0 is {_quote(frame0)}{hint}, not a pd-router transfer header "
            f"'{MAGIC.decode()}/{PROTOCOL_VERSION}/<TYPE>'"
        )
    version, tag = parts[1], parts[2]
    if version != b"%d" % PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"peer speaks pd-router transfer protocol version {version.decode(errors='replace')}, "
            f"this side speaks version {PROTOCOL_VERSION}"
        )
    if tag not in _READERS:
        raise ProtocolMismatch(
            f"unknown message type {_quote(tag)} in protocol version {PROTOCOL_VERSION}"
        )
    return tag


def decode(frames: Sequence[Frame]) -> Message:
    """The message in ``frames`` (as ``recv_multipart`` returns them; any bytes-like frames).

    Raises ``ProtocolMismatch`` for a foreign or other-version header, an unknown type, a wrong
    frame count, or frames whose contents do not parse or are out of range.
    """
    if not frames:
        raise ProtocolMismatch("empty message: no frames")
    tag = _parse_header(bytes(frames[0]))
    count, read = _READERS[tag]
    name = tag.decode()
    if len(frames) != count + 1:
        raise ProtocolMismatch(
            f"{name} has {len(frames)} frames, protocol version {PROTOCOL_VERSION} expects "
            f"{count + 1}"
        )
    try:
        return read(_Reader(name, frames))
    except ValueError as exc:  # a message's own validation: a value out of range
        raise ProtocolMismatch(f"{name}: {exc}") from None
