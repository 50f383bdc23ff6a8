"""What one rank needs to take part in transfers, for either role: ``RankEndpoint``.

A rank endpoint owns the rank's control plane (its bound PULL socket and the PUSH sockets to
peers), a rendezvous client (its own, or a shared one passed in) and the rank's memory as the
engine sees it: the caller's KV pool and an aux buffer of ``aux_slots`` slots that the endpoint
allocates. ``async with`` registers the memory and binds the control socket; leaving undoes both
and closes the rendezvous client if the endpoint built it. ``KVSender`` and ``KVReceiver`` each
hold one and add their role's protocol on top.
"""

from __future__ import annotations

from typing import Self

import zmq.asyncio

from transfer.closing import AsyncClosing
from transfer.config import EndpointConfig
from transfer.control import ControlPlane, Peer, PeerLost
from transfer.engine.base import TransferEngine
from transfer.memory import RegisteredBuffers
from transfer.page_layout import KVPageLayout
from transfer.rendezvous import RendezvousClient

__all__ = ["RankEndpoint"]


class RankEndpoint(AsyncClosing):
    """One rank's control plane, rendezvous client and registered KV and aux memory.

    ``layout`` describes the caller's KV pool, which the caller keeps alive while the endpoint is
    open. ``on_peer_lost`` runs when the control connection to a peer drops. The endpoint does
    not close ``engine`` or ``context``, nor a ``rendezvous`` client passed in. Opening raises what
    registering (``EngineError``) or binding (``TransferError``) raised, with everything already
    done undone; ``aclose`` is idempotent.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        engine: TransferEngine,
        layout: KVPageLayout,
        config: EndpointConfig,
        *,
        rendezvous: RendezvousClient | None = None,
        on_peer_lost: PeerLost | None = None,
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.control = ControlPlane(
            context,
            host=config.host,
            port=config.port,
            advertise_host=config.advertise_host,
            send_timeout_s=config.send_timeout_s,
            on_peer_lost=on_peer_lost,
        )
        self._own_rendezvous = rendezvous is None
        self.rendezvous = rendezvous or RendezvousClient()
        self.aux_item_len = config.aux_item_len if config.aux_slots else 0
        self.aux_slots = config.aux_slots if self.aux_item_len else 0
        self._aux = bytearray(self.aux_item_len * self.aux_slots)
        self._buffers = RegisteredBuffers(engine, layout, self._aux)
        self._closed = False

    async def __aenter__(self) -> Self:
        try:
            self._buffers.open()
            await self.control.__aenter__()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        """Close the control plane, unregister the memory, close an own rendezvous client."""
        await self.control.aclose()
        self._buffers.close()
        if self._own_rendezvous and not self._closed:
            await self.rendezvous.aclose()
        self._closed = True

    @property
    def address(self) -> Peer:
        """Where peers send to: the advertised host and bound port of the control socket."""
        return self.control.address

    @property
    def session_id(self) -> str:
        """The engine's session id: what a peer targets when it writes into this rank."""
        return self.engine.session_id

    @property
    def aux_ptr(self) -> int:
        """The address of the aux buffer once open (0 before, or without one)."""
        return self._buffers.aux_ptr

    def aux_slot(self, index: int) -> memoryview:
        """Aux slot ``index`` (``aux_item_len`` bytes); ``ValueError`` outside the buffer."""
        if not 0 <= index < self.aux_slots:
            raise ValueError(f"aux_index {index} outside [0, {self.aux_slots})")
        start = index * self.aux_item_len
        return memoryview(self._aux)[start : start + self.aux_item_len]
