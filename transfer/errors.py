"""The transfer library's exception tree.

TransferError              base; carries ``room``, ``op`` and ``code`` where they are known
├── ProtocolMismatch       a peer's frames are not our protocol version, or are malformed
├── EngineError            a native transfer engine call returned a code < 0 (``op``, ``code``)
├── HandshakeTimeout       a peer did not register or answer within its deadline
└── TransferFailed         a room ended in Failed (``room``, ``reason``)

Nothing in ``transfer/`` lets a ``-1`` or a ``None`` stand for a failure: the native adapter turns
return codes into ``EngineError`` and a room's Failed state becomes ``TransferFailed`` for callers
that wait on it. Invalid state-machine transitions raise the plain ``TransferError`` (a bug in the
caller, with the room and the attempted transition in the message).
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "HandshakeTimeout",
    "ProtocolMismatch",
    "TransferError",
    "TransferFailed",
]


class TransferError(Exception):
    """Base of every error the transfer package raises.

    ``room`` is the bootstrap room the error concerns, ``op`` the operation that failed (an engine
    call, a state transition) and ``code`` a native return code; each is ``None`` when unknown.
    """

    def __init__(
        self,
        message: str,
        *,
        room: int | None = None,
        op: str | None = None,
        code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.room = room
        self.op = op
        self.code = code


class ProtocolMismatch(TransferError):
    """A peer sent frames this side cannot read: wrong magic or version, bad count or contents."""


class EngineError(TransferError):
    """A native transfer engine call failed; ``code`` is what it returned (< 0)."""

    def __init__(
        self, op: str, code: int, *, room: int | None = None, detail: str | None = None
    ) -> None:
        message = f"transfer engine {op} failed with code {code}"
        if room is not None:
            message = f"room {room}: {message}"
        if detail:
            message = f"{message} ({detail})"
        super().__init__(message, room=room, op=op, code=code)


class HandshakeTimeout(TransferError):
    """A peer did not register its buffers or send its transfer info before the deadline."""

    def __init__(self, peer: str, timeout_s: float, *, room: int | None = None) -> None:
        message = f"no handshake from {peer} within {timeout_s:g} s"
        if room is not None:
            message = f"room {room}: {message}"
        super().__init__(message, room=room, op="handshake")
        self.peer = peer
        self.timeout_s = timeout_s


class TransferFailed(TransferError):
    """A room ended in Failed; ``reason`` says why (a timeout, a dead peer, an engine error)."""

    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"room {room}: transfer failed: {reason}", room=room)
        self.reason = reason
