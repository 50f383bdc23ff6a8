"""The decode sessions a prefill rank knows: ``DecodeSessions``.

A decode rank sends ``RegisterKVArgs`` once per engine session; the prefill keeps where to report
and the geometry of the decode's pool, checked against its own (a mismatch refuses the session,
and its transfer info then fails with that reason). A session whose control connection dropped
is forgotten. No I/O here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transfer.control import Peer
from transfer.errors import TransferError
from transfer.messages import RegisterKVArgs, TransferInfo
from transfer.page_layout import KVPageLayout

__all__ = ["DecodeSession", "DecodeSessions"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeSession:
    """A registered decode rank: where to report and the geometry of its pool."""

    peer: Peer
    layout: KVPageLayout
    aux_ptr: int | None


class DecodeSessions:
    """The sessions registered with one prefill rank (``layout`` is its own pool's)."""

    def __init__(self, layout: KVPageLayout, unique_rank: int) -> None:
        self._layout = layout
        self._rank = unique_rank
        self._sessions: dict[str, DecodeSession] = {}
        self._refused: dict[str, str] = {}

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def register(self, args: RegisterKVArgs) -> DecodeSession | None:
        """Record (or replace) ``args``' session; None when refused (the reason is logged).

        A session is refused when its page size in bytes or region count differs from this rank's
        pool, or when it names more than one aux buffer.
        """
        sid = args.session_id
        try:
            layout = self._layout.peer(
                args.kv_data_ptrs, page_bytes=args.kv_item_len, num_pages=args.kv_num_pages
            )
            if len(args.aux_data_ptrs) > 1:
                raise ValueError(f"{len(args.aux_data_ptrs)} aux buffers, this rank writes one")
        except ValueError as exc:
            self._sessions.pop(sid, None)
            self._refused[sid] = f"decode session {sid} registration refused: {exc}"
            logger.warning("%s", self._refused[sid])
            return None
        self._refused.pop(sid, None)
        aux_ptr = args.aux_data_ptrs[0] if args.aux_data_ptrs else None
        session = self._sessions[sid] = DecodeSession(Peer(args.ip, args.port), layout, aux_ptr)
        return session

    def get(self, info: TransferInfo) -> DecodeSession:
        """The session ``info`` came from; ``TransferError`` (op ``session``) if not registered."""
        session = self._sessions.get(info.session_id)
        if session is None:
            raise TransferError(self.unregistered(info), room=info.room, op="session")
        return session

    def unregistered(self, info: TransferInfo) -> str:
        """Why ``info``'s session is not usable: its refusal, or that it never registered."""
        return self._refused.get(info.session_id) or (
            f"decode session {info.session_id} is not registered with prefill rank "
            f"{self._rank} (or its connection was lost)"
        )

    def drop_peer(self, peer: Peer) -> set[str]:
        """Forget the sessions registered from ``peer``; returns their ids."""
        lost = {sid for sid, session in self._sessions.items() if session.peer == peer}
        for sid in lost:
            del self._sessions[sid]
        return lost
