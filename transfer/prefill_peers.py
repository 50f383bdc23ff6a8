"""The prefill ranks a decode rank receives from: ``PrefillPeers``.

Before a room's transfer info can go, ``KVReceiver`` needs the room's prefill rank and that rank
must know this one. This is that half of the receiver (docs/concepts/protocols.md 6.3-6.4): find
the rank
through the rendezvous client (an SGLang prefill by DP rank after checking its parallel info, a
vLLM MooncakeConnector engine by engine id), and send it ``RegisterKVArgs`` (this rank's buffers
and address) on first contact in the session. A rank that failed a room, was unreachable or whose
connection dropped is registered with again on next contact, and looked up again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from transfer.config import ReceiverConfig
from transfer.control import Peer
from transfer.endpoint import RankEndpoint
from transfer.errors import TransferError
from transfer.messages import RegisterKVArgs
from transfer.page_layout import KVPageLayout
from transfer.rendezvous import PrefillInfo, RendezvousError
from transfer.stats import ReceiverStats

__all__ = ["Remaining", "PrefillPeers"]

logger = logging.getLogger(__name__)

Remaining = Callable[[], float]
"""Seconds left before the room's deadline, read at each step."""


class PrefillPeers:
    """Lookup of, and registration with, the prefill ranks that ``endpoint``'s rank receives from.

    ``layout`` and ``config`` describe this rank (what a prefill must match, what it is told);
    registrations sent are counted in ``stats``. Every step is bounded by the room's ``remaining``
    time (a send also by the control plane's send timeout).
    """

    def __init__(
        self,
        endpoint: RankEndpoint,
        layout: KVPageLayout,
        config: ReceiverConfig,
        stats: ReceiverStats,
    ) -> None:
        self._endpoint = endpoint
        self._rendezvous = endpoint.rendezvous
        self._layout = layout
        self._config = config
        self._stats = stats
        self._registered: set[Peer] = set()
        self._peer_urls: dict[Peer, set[str]] = {}

    def send_budget(self, remaining: Remaining) -> float:
        """The timeout of one control send for a room with ``remaining`` time."""
        return max(min(self._endpoint.control.send_timeout_s, remaining()), 0.001)

    async def locate(
        self,
        room: int,
        base_url: str,
        dp_rank: int | None,
        engine_id: str | None,
        remaining: Remaining,
    ) -> Peer:
        """The prefill rank serving ``room`` at ``base_url``: by ``engine_id`` (vLLM), else by DP
        rank (``dp_rank`` or ``room % dp_size``, SGLang's ``follow_bootstrap_room``)."""
        if engine_id is None:
            return await self._resolve(room, base_url, dp_rank, remaining)
        peer = await self._rendezvous.engine_address(
            base_url, engine_id, tp=self._config.tp_rank, timeout_s=remaining()
        )
        self._peer_urls.setdefault(peer, set()).add(base_url)
        return peer

    async def _resolve(
        self, room: int, base_url: str, dp_rank: int | None, remaining: Remaining
    ) -> Peer:
        info = await self._rendezvous.prefill_info(base_url, timeout_s=remaining())
        self._check_prefill(info, base_url)
        if dp_rank is None:
            if not info.follow_bootstrap_room:
                raise RendezvousError(
                    f"the prefill at {base_url} does not place rooms by bootstrap_room; "
                    "pass its dp_rank"
                )
            dp_rank = room % info.dp_size
        peer = await self._rendezvous.rank_address(
            base_url, dp=dp_rank, tp=self._config.tp_rank, timeout_s=remaining()
        )
        self._peer_urls.setdefault(peer, set()).add(base_url)
        return peer

    def _check_prefill(self, info: PrefillInfo, base_url: str) -> None:
        """``RendezvousError`` when the prefill's parallel info does not match this rank's."""
        problems = info.mismatches(
            page_size=self._layout.page_size_tokens,
            kv_cache_dtype=self._config.kv_cache_dtype,
            tp_size=self._config.tp_size,
        )
        if problems:
            self._rendezvous.invalidate(base_url)
            raise RendezvousError(f"prefill at {base_url} does not match: {'; '.join(problems)}")

    async def ensure_registered(self, peer: Peer, remaining: Remaining) -> None:
        """Send RegisterKVArgs to ``peer`` once per session (again after a failure or loss)."""
        if peer in self._registered:
            return
        self._registered.add(peer)  # concurrent requests queue behind this message, in order
        address = self._endpoint.address
        args = RegisterKVArgs(
            ip=address.host,
            port=address.port,
            session_id=self._endpoint.session_id,
            kv_data_ptrs=self._layout.base_ptrs,
            aux_data_ptrs=(self._endpoint.aux_ptr,) if self._endpoint.aux_slots else (),
            dst_tp_rank=self._config.tp_rank,
            dst_tp_size=self._config.tp_size,
            kv_item_len=self._layout.page_bytes,
            kv_num_pages=self._layout.num_pages,
        )
        try:
            await self._endpoint.control.send(peer, args, timeout_s=self.send_budget(remaining))
        except TransferError:
            self.forget(peer)
            raise
        self._stats.registrations_sent += 1
        logger.info("registered KV buffers with prefill rank %s", peer)

    def register_again(self, peer: Peer) -> None:
        """Send ``peer`` RegisterKVArgs again on next contact (it failed a room: it may have
        lost this rank)."""
        self._registered.discard(peer)

    def forget(self, peer: Peer) -> None:
        """Register again on next contact and look the rank up again."""
        self._registered.discard(peer)
        for base_url in self._peer_urls.pop(peer, set()):
            self._rendezvous.invalidate(base_url)
