"""transfer/codec.py and transfer/messages.py: round trips, the documented byte layout, refusals."""

from __future__ import annotations

import random
import struct

import msgspec
import pytest

from transfer.codec import MAGIC, decode, encode, header
from transfer.errors import ProtocolMismatch, TransferError
from transfer.messages import (
    MAX_PAGE_INDEX,
    MAX_U64,
    PROTOCOL_VERSION,
    Abort,
    Message,
    RegisterKVArgs,
    TransferInfo,
    TransferStatus,
)
from transfer.state import KVPoll

REGISTER = RegisterKVArgs(
    ip="10.0.0.2",
    port=7001,
    session_id="decode-0:15001",
    kv_data_ptrs=(0x7F00_0000_0000, 0x7F00_0010_0000),
    aux_data_ptrs=(0x7E00_0000_0000,),
    dst_tp_rank=1,
    dst_tp_size=2,
    kv_item_len=16 * 4096,
    kv_num_pages=512,
)
INFO = TransferInfo(
    room=42,
    ip="10.0.0.2",
    port=7001,
    session_id="decode-0:15001",
    dst_kv_indices=(5, 6, 9),
    dst_aux_index=3,
    required_dst_info_num=1,
)
DUMMY = msgspec.structs.replace(
    INFO, dst_kv_indices=(), dst_aux_index=None, required_dst_info_num=2
)

ROUND_TRIPS: list[tuple[str, Message]] = [
    ("register", REGISTER),
    ("register no aux, ipv6", msgspec.structs.replace(REGISTER, aux_data_ptrs=(), ip="::1")),
    (
        "register 10k pointers up to u64 max",
        msgspec.structs.replace(
            REGISTER,
            kv_data_ptrs=tuple(MAX_U64 - i * 4096 for i in range(10_000)),
            aux_data_ptrs=(0, 1, MAX_U64),
        ),
    ),
    ("transfer info", INFO),
    (
        "transfer info aux 0, page 0",
        msgspec.structs.replace(INFO, dst_kv_indices=(0,), dst_aux_index=0),
    ),
    (
        "transfer info 100k pages up to int32 max",
        msgspec.structs.replace(
            INFO, dst_kv_indices=tuple(range(MAX_PAGE_INDEX - 100_000, MAX_PAGE_INDEX + 1))
        ),
    ),
    ("transfer info max room", msgspec.structs.replace(INFO, room=MAX_U64)),
    ("dummy transfer info", DUMMY),
    *[
        (f"status {poll.name}", TransferStatus(room=7, status=poll, prefill_rank=3))
        for poll in KVPoll
    ],
    (
        "status with reason",
        TransferStatus(
            room=7, status=KVPoll.Failed, prefill_rank=0, reason="engine write -1: ünïcode"
        ),
    ),
    ("abort", Abort(room=0)),
    ("abort max room", Abort(room=MAX_U64)),
]


@pytest.mark.parametrize("msg", [m for _, m in ROUND_TRIPS], ids=[n for n, _ in ROUND_TRIPS])
def test_round_trip(msg: Message) -> None:
    frames = encode(msg)
    assert all(isinstance(f, bytes) for f in frames)
    decoded = decode(frames)
    assert type(decoded) is type(msg)
    assert decoded == msg


def test_dummy_is_recognised() -> None:
    assert DUMMY.is_dummy
    assert not INFO.is_dummy
    decoded = decode(encode(DUMMY))
    assert isinstance(decoded, TransferInfo) and decoded.is_dummy


def test_status_decodes_to_kvpoll() -> None:
    decoded = decode(encode(TransferStatus(room=1, status=KVPoll.Success, prefill_rank=0)))
    assert isinstance(decoded, TransferStatus)
    assert decoded.status is KVPoll.Success


# --- the documented byte layout (codec.py's table) -----------------------------------------------

LAYOUTS: list[tuple[str, Message, list[bytes]]] = [
    (
        "register",
        REGISTER,
        [
            b"PDKV/1/REGISTER_KV_ARGS",
            b"10.0.0.2",
            b"7001",
            b"decode-0:15001",
            (0x7F00_0000_0000).to_bytes(8, "little") + (0x7F00_0010_0000).to_bytes(8, "little"),
            (0x7E00_0000_0000).to_bytes(8, "little"),
            b"1",
            b"2",
            b"65536",
            b"512",
        ],
    ),
    (
        "transfer info",
        INFO,
        [
            b"PDKV/1/TRANSFER_INFO",
            b"42",
            b"10.0.0.2",
            b"7001",
            b"decode-0:15001",
            b"\x05\x00\x00\x00\x06\x00\x00\x00\x09\x00\x00\x00",
            b"3",
            b"1",
        ],
    ),
    (
        "dummy",
        DUMMY,
        [b"PDKV/1/TRANSFER_INFO", b"42", b"10.0.0.2", b"7001", b"decode-0:15001", b"", b"", b"2"],
    ),
    (
        "status",
        TransferStatus(room=42, status=KVPoll.Success, prefill_rank=1),
        [b"PDKV/1/TRANSFER_STATUS", b"42", b"4", b"1", b""],
    ),
    (
        "failed status",
        TransferStatus(room=42, status=KVPoll.Failed, prefill_rank=0, reason="timed out"),
        [b"PDKV/1/TRANSFER_STATUS", b"42", b"0", b"0", b"timed out"],
    ),
    ("abort", Abort(room=42), [b"PDKV/1/ABORT", b"42"]),
]


@pytest.mark.parametrize(
    ("msg", "frames"), [(m, f) for _, m, f in LAYOUTS], ids=[n for n, _, _ in LAYOUTS]
)
def test_byte_layout(msg: Message, frames: list[bytes]) -> None:
    assert encode(msg) == frames
    assert decode(frames) == msg


def test_header_constants() -> None:
    assert MAGIC == b"PDKV"
    assert PROTOCOL_VERSION == 1
    assert header(Abort) == b"PDKV/1/ABORT"
    assert header(Abort, version=7) == b"PDKV/7/ABORT"


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_decode_accepts_bytes_like_frames(kind: type[bytearray] | type[memoryview]) -> None:
    for msg in (REGISTER, INFO, DUMMY):
        assert decode(tuple(kind(f) for f in encode(msg))) == msg


# --- refusals ---------------------------------------------------------------------------------


def _replace(frames: list[bytes], index: int, value: bytes) -> list[bytes]:
    out = list(frames)
    out[index] = value
    return out


INFO_FRAMES = encode(INFO)
REGISTER_FRAMES = encode(REGISTER)
STATUS_FRAMES = encode(TransferStatus(room=1, status=KVPoll.Failed, prefill_rank=0, reason="x"))

MISMATCHES: list[tuple[str, list[bytes], str]] = [
    ("no frames", [], "no frames"),
    (
        "newer version",
        _replace(INFO_FRAMES, 0, header(TransferInfo, version=2)),
        "peer speaks pd-router transfer protocol version 2, this side speaks version 1",
    ),
    ("older version", _replace(INFO_FRAMES, 0, header(TransferInfo, version=0)), "version 0"),
    ("garbled version", _replace(INFO_FRAMES, 0, b"PDKV/x/TRANSFER_INFO"), "version x"),
    (
        "unknown type",
        _replace(INFO_FRAMES, 0, b"PDKV/1/HEARTBEAT"),
        "unknown message type b'HEARTBEAT'",
    ),
    (
        "bad magic",
        _replace(INFO_FRAMES, 0, b"XXXX/1/TRANSFER_INFO"),
        "not a pd-router transfer header",
    ),
    ("header without type", _replace(INFO_FRAMES, 0, b"PDKV/1"), "not a pd-router transfer header"),
    ("huge frame 0", _replace(INFO_FRAMES, 0, b"PDKV/1/" + b"A" * 10_000), "..."),
    ("sglang registration", [b"None", *REGISTER_FRAMES[1:]], "looks like SGLang"),
    ("sglang transfer info", [b"42", *INFO_FRAMES[2:]], "looks like SGLang"),
    ("sglang status", [b"42", b"4", b"0"], "looks like SGLang"),
    (
        "truncated info",
        INFO_FRAMES[:-1],
        "TRANSFER_INFO has 7 frames, protocol version 1 expects 8",
    ),
    ("truncated register", REGISTER_FRAMES[:5], "REGISTER_KV_ARGS has 5 frames"),
    ("truncated status", STATUS_FRAMES[:-1], "TRANSFER_STATUS has 4 frames"),
    ("abort without room", [header(Abort)], "ABORT has 1 frames"),
    ("extra frame", [*INFO_FRAMES, b"1"], "TRANSFER_INFO has 9 frames"),
    (
        "room not decimal",
        _replace(INFO_FRAMES, 1, b"4x2"),
        "frame 1 (room): expected an ASCII decimal",
    ),
    ("negative room", _replace(INFO_FRAMES, 1, b"-1"), "frame 1 (room)"),
    ("room with spaces", _replace(INFO_FRAMES, 1, b" 42"), "frame 1 (room)"),
    ("room beyond u64", _replace(INFO_FRAMES, 1, b"%d" % 2**64), "room=18446744073709551616"),
    ("21-digit room", _replace(INFO_FRAMES, 1, b"1" * 21), "frame 1 (room)"),
    ("empty port", _replace(INFO_FRAMES, 3, b""), "frame 3 (port)"),
    ("port out of range", _replace(INFO_FRAMES, 3, b"70000"), "port=70000"),
    ("empty ip", _replace(INFO_FRAMES, 2, b""), "frame 2 (ip): empty"),
    ("ip not utf-8", _replace(INFO_FRAMES, 2, b"\xff\xfe"), "frame 2 (ip): not UTF-8"),
    (
        "indices not whole int32s",
        _replace(INFO_FRAMES, 5, b"\x01\x00\x00\x00\x02"),
        "frame 5 (dst_kv_indices): 5 bytes is not a whole number of 4-byte items",
    ),
    (
        "negative page index",
        _replace(INFO_FRAMES, 5, struct.pack("<2i", 1, -3)),
        "dst_kv_indices holds -3",
    ),
    ("pages without aux", _replace(INFO_FRAMES, 6, b""), "both empty (a dummy) or both set"),
    ("aux without pages", _replace(INFO_FRAMES, 5, b""), "both empty (a dummy) or both set"),
    ("zero required infos", _replace(INFO_FRAMES, 7, b"0"), "required_dst_info_num=0"),
    (
        "pointers not whole u64s",
        _replace(REGISTER_FRAMES, 4, b"\x00" * 12),
        "frame 4 (kv_data_ptrs): 12 bytes is not a whole number of 8-byte items",
    ),
    ("tp rank beyond size", _replace(REGISTER_FRAMES, 6, b"2"), "dst_tp_rank=2"),
    (
        "status not a KVPoll",
        _replace(STATUS_FRAMES, 2, b"9"),
        "frame 2 (status): 9 is not a KVPoll value",
    ),
    ("reason not utf-8", _replace(STATUS_FRAMES, 4, b"\xc3"), "frame 4 (reason): not UTF-8"),
]


@pytest.mark.parametrize(
    ("frames", "expected"), [(f, e) for _, f, e in MISMATCHES], ids=[n for n, _, _ in MISMATCHES]
)
def test_protocol_mismatch(frames: list[bytes], expected: str) -> None:
    with pytest.raises(ProtocolMismatch) as info:
        decode(frames)
    assert expected in str(info.value)
    assert isinstance(info.value, TransferError)
    assert len(str(info.value)) < 300  # garbage is quoted briefly


def test_mangled_frames_only_ever_raise_protocol_mismatch() -> None:
    """Random damage to valid frames decodes to a valid message or raises ProtocolMismatch."""
    rng = random.Random(15)
    valid = [encode(m) for _, m in ROUND_TRIPS[:8] + ROUND_TRIPS[-3:]]
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(3000):
        frames = list(rng.choice(valid))
        i = rng.randrange(len(frames))
        damage = rng.randrange(5)
        if damage == 0:
            frames[i] = bytes(rng.randrange(256) for _ in range(rng.randrange(12)))
        elif damage == 1:
            frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
        elif damage == 2:
            del frames[i]
        elif damage == 3:
            frames.insert(i, rng.choice([b"", b"7", b"\x00" * 8]))
        else:
            frames[i] = rng.choice([b"", b"0", b"1", b"%d" % MAX_U64, b"9" * 20, b"\xff"])
        try:
            decode(frames)
            outcomes["decoded"] += 1
        except ProtocolMismatch:
            outcomes["refused"] += 1
    assert outcomes["decoded"] > 0 and outcomes["refused"] > 0


# --- construction-time validation -------------------------------------------------------------

INVALID: list[tuple[str, dict[str, object], type[Message], str]] = [
    ("port 0", {"port": 0}, TransferInfo, "port=0"),
    ("empty session", {"session_id": ""}, TransferInfo, "session_id is empty"),
    ("half dummy", {"dst_kv_indices": ()}, TransferInfo, "both empty"),
    ("page beyond int32", {"dst_kv_indices": (2**31,)}, TransferInfo, "outside"),
    ("negative aux", {"dst_aux_index": -1}, TransferInfo, "dst_aux_index=-1"),
    ("negative room", {"room": -1}, TransferInfo, "room=-1"),
    ("pointer beyond u64", {"kv_data_ptrs": (2**64,)}, RegisterKVArgs, "kv_data_ptrs holds"),
    ("tp size 0", {"dst_tp_size": 0, "dst_tp_rank": 0}, RegisterKVArgs, "dst_tp_size=0"),
]


@pytest.mark.parametrize(
    ("changes", "cls", "expected"),
    [(c, k, e) for _, c, k, e in INVALID],
    ids=[n for n, _, _, _ in INVALID],
)
def test_invalid_messages_cannot_be_built(
    changes: dict[str, object], cls: type[Message], expected: str
) -> None:
    base = INFO if cls is TransferInfo else REGISTER
    with pytest.raises(ValueError, match=expected):
        msgspec.structs.replace(base, **changes)


def test_status_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="not a KVPoll"):
        TransferStatus(room=1, status=4, prefill_rank=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reason is empty"):
        TransferStatus(room=1, status=KVPoll.Failed, prefill_rank=0, reason="")


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        INFO.room = 1  # type: ignore[misc]
