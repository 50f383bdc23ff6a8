"""Typed control messages between decode and prefill ranks (protocol version ``PROTOCOL_VERSION``).

Decode -> prefill:

* ``RegisterKVArgs``: once per prefill rank and session, where the decode's KV and aux buffers are.
* ``TransferInfo``: once per request (room), which destination pages and aux slot to write.
* ``Abort``: the decode gave up on a room; the prefill stops writing into its pages.

Prefill -> decode:

* ``TransferStatus``: a room reached a state (Success or Failed, with a reason when Failed).

The fields follow SGLang 0.4.10's Mooncake messages (docs/concepts/protocols.md 6.3-6.5);
``transfer/codec.py``
turns them into frames and back and is the only module that knows the byte layout. Bump
``PROTOCOL_VERSION`` on any change to a message's fields or frames.

Messages are frozen and validate their values on construction (``ValueError``), so a message that
exists can be encoded and every decoded message is in range.
"""

from __future__ import annotations

from typing import Final, TypeAlias

import msgspec

from transfer.state import KVPoll

__all__ = [
    "MAX_PAGE_INDEX",
    "MAX_U64",
    "PROTOCOL_VERSION",
    "Abort",
    "Message",
    "RegisterKVArgs",
    "TransferInfo",
    "TransferStatus",
]

PROTOCOL_VERSION: Final = 1
MAX_U64: Final = 2**64 - 1
MAX_PAGE_INDEX: Final = 2**31 - 1  # page indices travel as int32, as in SGLang


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name}={value} is outside [{low}, {high}]")


def _check_all(name: str, values: tuple[int, ...], high: int) -> None:
    if values and (min(values) < 0 or max(values) > high):
        bad = next(v for v in values if not 0 <= v <= high)
        raise ValueError(f"{name} holds {bad}, outside [0, {high}]")


def _check_text(name: str, value: str) -> None:
    if not value:
        raise ValueError(f"{name} is empty")


class RegisterKVArgs(msgspec.Struct, frozen=True, kw_only=True):
    """Decode -> prefill, once per session: the decode rank's buffers and how to reach it.

    ``kv_data_ptrs`` has one base address per KV region in SGLang's order (K of every layer, then
    V of every layer); ``kv_item_len`` is the bytes of one page in one region; ``kv_num_pages`` the
    pages per region (not in SGLang: it lets the prefill refuse out-of-range destination pages).
    """

    ip: str
    port: int
    session_id: str
    kv_data_ptrs: tuple[int, ...]
    aux_data_ptrs: tuple[int, ...]
    dst_tp_rank: int
    dst_tp_size: int
    kv_item_len: int
    kv_num_pages: int

    def __post_init__(self) -> None:
        _check_text("ip", self.ip)
        _check_range("port", self.port, 1, 65535)
        _check_text("session_id", self.session_id)
        _check_all("kv_data_ptrs", self.kv_data_ptrs, MAX_U64)
        _check_all("aux_data_ptrs", self.aux_data_ptrs, MAX_U64)
        _check_range("dst_tp_size", self.dst_tp_size, 1, MAX_U64)
        _check_range("dst_tp_rank", self.dst_tp_rank, 0, self.dst_tp_size - 1)
        _check_range("kv_item_len", self.kv_item_len, 0, MAX_U64)
        _check_range("kv_num_pages", self.kv_num_pages, 0, MAX_PAGE_INDEX + 1)


class TransferInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Decode -> prefill, per request: where the room's KV and aux data go.

    A *dummy* (no pages and no aux index) comes from a decode rank that receives nothing for this
    request under the TP mapping; it still counts towards ``required_dst_info_num``.
    """

    room: int
    ip: str
    port: int
    session_id: str
    dst_kv_indices: tuple[int, ...]
    dst_aux_index: int | None
    required_dst_info_num: int

    def __post_init__(self) -> None:
        _check_range("room", self.room, 0, MAX_U64)
        _check_text("ip", self.ip)
        _check_range("port", self.port, 1, 65535)
        _check_text("session_id", self.session_id)
        _check_all("dst_kv_indices", self.dst_kv_indices, MAX_PAGE_INDEX)
        if (self.dst_aux_index is None) != (not self.dst_kv_indices):
            raise ValueError(
                "dst_kv_indices and dst_aux_index must be both empty (a dummy) or both set"
            )
        if self.dst_aux_index is not None:
            _check_range("dst_aux_index", self.dst_aux_index, 0, MAX_U64)
        _check_range("required_dst_info_num", self.required_dst_info_num, 1, MAX_U64)

    @property
    def is_dummy(self) -> bool:
        """True when this decode rank receives nothing for the room."""
        return self.dst_aux_index is None


class TransferStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill -> decode: ``room`` reached ``status`` on prefill rank ``prefill_rank``.

    ``reason`` says why a room Failed (``None`` otherwise, or when the prefill does not know).
    """

    room: int
    status: KVPoll
    prefill_rank: int
    reason: str | None = None

    def __post_init__(self) -> None:
        _check_range("room", self.room, 0, MAX_U64)
        if not isinstance(self.status, KVPoll):
            raise ValueError(f"status={self.status!r} is not a KVPoll")
        _check_range("prefill_rank", self.prefill_rank, 0, MAX_U64)
        if self.reason is not None:
            _check_text("reason", self.reason)


class Abort(msgspec.Struct, frozen=True, kw_only=True):
    """Decode -> prefill: stop working on ``room`` (the decode gave up or the client left)."""

    room: int

    def __post_init__(self) -> None:
        _check_range("room", self.room, 0, MAX_U64)


Message: TypeAlias = RegisterKVArgs | TransferInfo | TransferStatus | Abort
