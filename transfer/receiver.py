"""The decode role: expose this rank's KV pages and receive a request's KV from a prefill rank.

Flow (SGLang's Mooncake receiver, docs/concepts/protocols.md 6.3-6.5), per request ``room``::

    Bootstrapping    look up the prefill rank through the rendezvous client (the registry's
                     GET /route, cached) and, on first contact in this session, send it
                     RegisterKVArgs (our buffers and address)
    WaitingForInput  the destination pages are the caller's (already allocated)
    Transferring     TransferInfo sent: from now on the prefill may write into those pages
    Success | Failed the prefill's TransferStatus, or a failure here (with a reason)

Every step runs under the request's deadline: a registry that does not answer, a prefill rank
that is unreachable or whose control connection drops, a missing registration (the prefill
answers Failed) and a prefill that never reports all end in ``ReceiveFailed`` with a reason.

Destination pages and failures (the rule that keeps KV memory sound): after a failure the
prefill may still be writing into the request's pages. ``ReceiveFailed.pages_safe`` says whether
the caller may reuse them: True when the prefill reported the room's end (its writes are over),
when TransferInfo never left, or when the prefill's connection is gone (its process died and its
writes with it); otherwise this side sends ``Abort`` and waits up to ``drain_timeout_s`` for the
prefill's acknowledgement. When ``pages_safe`` is False the caller must keep the pages (and the aux
slot) out of its free pool: never hand them to another request. A ``request`` that is cancelled
sends ``Abort`` in the background and its pages count as unsafe. The rooms' bookkeeping is
``transfer.receive_ledger.ReceiveLedger``; finding and registering with prefill ranks is
``transfer.prefill_peers.PrefillPeers``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Self

import zmq.asyncio

from transfer.closing import AsyncClosing, cancel_and_wait
from transfer.config import ReceiverConfig
from transfer.control import Peer, PeerUnreachable
from transfer.endpoint import RankEndpoint
from transfer.engine.base import TransferEngine
from transfer.errors import ProtocolMismatch, TransferError, TransferFailed
from transfer.messages import Abort, TransferInfo, TransferStatus
from transfer.page_layout import KVPageLayout
from transfer.prefill_peers import PrefillPeers
from transfer.receive_ledger import PendingRoom, ReceiveLedger
from transfer.rendezvous import RendezvousClient, RendezvousError, bootstrap_url
from transfer.state import Clock, KVPoll
from transfer.stats import ReceiverStats

__all__ = ["KVReceiver", "ReceiveFailed", "ReceiveResult", "ReceiverConfig", "ReceiverStats"]

logger = logging.getLogger(__name__)


class ReceiveFailed(TransferFailed):
    """A request's KV did not arrive; ``pages_safe`` says whether its pages may be reused."""

    def __init__(self, room: int, reason: str, *, pages_safe: bool) -> None:
        super().__init__(room, reason)
        self.pages_safe = pages_safe


@dataclass(frozen=True, slots=True)
class ReceiveResult:
    """A request whose KV arrived: its bytes, its aux slot's contents and the time it took."""

    room: int
    kv_bytes: int
    aux: bytes
    elapsed_s: float


class KVReceiver(AsyncClosing):
    """A decode rank's receiving side: one per rank, used as ``async with``.

    The caller allocates the KV pool that ``layout`` describes and keeps it alive; while open,
    the rank's endpoint (``transfer.endpoint.RankEndpoint``) registers it, and its own aux buffer
    of ``config.aux_slots`` slots of ``config.aux_item_len`` bytes, with ``engine`` and binds the
    rank's control socket; everything is undone on exit. It does not close ``engine``,
    ``context`` or a ``rendezvous`` client passed in.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        engine: TransferEngine,
        layout: KVPageLayout,
        config: ReceiverConfig | None = None,
        *,
        rendezvous: RendezvousClient | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        config = config or ReceiverConfig()
        self._config = config
        self._layout = layout
        self._endpoint = RankEndpoint(
            context, engine, layout, config, rendezvous=rendezvous, on_peer_lost=self._on_peer_lost
        )
        self._rendezvous = self._endpoint.rendezvous
        self._clock = clock
        self._ledger = ReceiveLedger(clock)
        self._tasks: set[asyncio.Task[None]] = set()
        self._serving: asyncio.Task[None] | None = None
        self.stats = ReceiverStats()
        self._peers = PrefillPeers(self._endpoint, layout, config, self.stats)

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._endpoint.__aenter__()
        self._serving = asyncio.create_task(self._serve(), name="kv-receiver-control")
        return self

    async def aclose(self) -> None:
        """Fail the requests still running, close the endpoint (which unregisters the buffers)."""
        self._ledger.fail_all("decode rank shutting down")
        await cancel_and_wait([self._serving, *self._tasks])
        self._serving = None
        await self._endpoint.aclose()

    # --- public --------------------------------------------------------------------------------

    @property
    def address(self) -> Peer:
        """Where prefill ranks send statuses (this rank's control socket)."""
        return self._endpoint.address

    @property
    def open_rooms(self) -> int:
        """Requests in progress (0 when idle: every path releases its room)."""
        return len(self._ledger)

    @property
    def aux_ptr(self) -> int:
        """The address of this rank's aux buffer (0 without one)."""
        return self._endpoint.aux_ptr

    async def request(
        self,
        room: int,
        bootstrap_addr: str,
        dst_pages: Sequence[int],
        aux_index: int | None,
        timeout_s: float,
        *,
        dp_rank: int | None = None,
        engine_id: str | None = None,
    ) -> ReceiveResult:
        """Receive ``room``'s KV into ``dst_pages`` and aux slot ``aux_index`` within ``timeout_s``.

        ``bootstrap_addr`` is the prefill's bootstrap API ("host:port" or a URL, possibly under
        ``/bootstrap/{namespace}``). The prefill DP rank is ``dp_rank`` or ``room % dp_size``
        (SGLang's ``follow_bootstrap_room``); with ``engine_id`` the prefill is a vLLM
        MooncakeConnector engine, found by that id in the bootstrap API's ``GET /query``.
        Empty ``dst_pages`` (with ``aux_index=None``) is a dummy request that receives nothing
        but still waits for the prefill's status.

        Returns when the prefill reported Success. Raises ``ReceiveFailed`` (reason, and whether
        the pages may be reused: see the module notes) for every failure, within ``timeout_s``
        plus at most ``drain_timeout_s``; ``ValueError`` for bad arguments (nothing sent) and
        ``TransferError`` when ``room`` is already in progress.
        """
        self._check_request(dst_pages, aux_index)
        started = self._clock()
        pending = self._ledger.open(room, timeout_s, bootstrap_url(bootstrap_addr))
        try:
            if aux_index is not None and self._endpoint.aux_slots:
                self._endpoint.aux_slot(aux_index)[:] = bytes(self._endpoint.aux_item_len)
            await self._start(room, pending, dst_pages, aux_index, dp_rank, engine_id)
            state = await self._ledger.states.wait(room)
            if state.poll is KVPoll.Success:
                return self._received(room, dst_pages, aux_index, self._clock() - started)
            reason = state.reason or "unknown"
            self.stats.rooms_failed += 1
            pages_safe = await self._settle(room, pending)
            logger.warning(
                "room %d failed (pages %s): %s",
                room,
                "reusable" if pages_safe else "NOT reusable",
                reason,
            )
            raise ReceiveFailed(room, reason, pages_safe=pages_safe)
        except asyncio.CancelledError:
            if pending.info_sent and pending.peer is not None and not pending.settled.is_set():
                self._spawn(self._abort(pending.peer, room))
            raise
        finally:
            self._ledger.release(room)

    def cancel(self, room: int, reason: str) -> bool:
        """Fail a running ``request`` (a client went away); it then raises ``ReceiveFailed``.

        Returns whether the room was running. The failing ``request`` still settles its pages.
        """
        return self._ledger.cancel(room, reason)

    # --- request steps -------------------------------------------------------------------------

    def _check_request(self, dst_pages: Sequence[int], aux_index: int | None) -> None:
        self._layout.check_pages(dst_pages)
        if not dst_pages:
            if aux_index is not None:
                raise ValueError("a dummy request (no pages) takes no aux_index")
            return
        if aux_index is None:
            raise ValueError("a request with pages needs an aux_index")
        if self._endpoint.aux_slots:
            self._endpoint.aux_slot(aux_index)

    def _received(
        self, room: int, dst_pages: Sequence[int], aux_index: int | None, elapsed_s: float
    ) -> ReceiveResult:
        kv_bytes = len(dst_pages) * self._layout.page_bytes * self._layout.num_regions
        self.stats.rooms_succeeded += 1
        self.stats.kv_bytes += kv_bytes
        aux = b""
        if aux_index is not None and self._endpoint.aux_slots:
            aux = bytes(self._endpoint.aux_slot(aux_index))
        return ReceiveResult(room, kv_bytes, aux, elapsed_s)

    def _remaining(self, room: int) -> float:
        return self._ledger.states.get(room).deadline - self._clock()

    def _step(self, room: int, poll: KVPoll) -> bool:
        """Advance ``room`` unless something already ended it."""
        if self._ledger.states.get(room).done:
            return False
        self._ledger.states.advance(room, poll)
        return True

    async def _start(
        self,
        room: int,
        pending: PendingRoom,
        dst_pages: Sequence[int],
        aux_index: int | None,
        dp_rank: int | None,
        engine_id: str | None,
    ) -> None:
        """Bootstrapping -> Transferring; any failure fails the room (``request`` reports it)."""
        remaining = functools.partial(self._remaining, room)
        try:
            peer = await self._peers.locate(room, pending.base_url, dp_rank, engine_id, remaining)
            pending.peer = peer
            await self._peers.ensure_registered(peer, remaining)
        except TransferError as exc:
            if isinstance(exc, PeerUnreachable | RendezvousError):
                self._rendezvous.invalidate(pending.base_url)
            self._ledger.states.fail(room, exc.message)
            return
        if not (self._step(room, KVPoll.WaitingForInput) and self._step(room, KVPoll.Transferring)):
            return
        address = self._endpoint.address
        info = TransferInfo(
            room=room,
            ip=address.host,
            port=address.port,
            session_id=self._endpoint.session_id,
            dst_kv_indices=tuple(dst_pages),
            dst_aux_index=aux_index,
            required_dst_info_num=1,
        )
        pending.info_sent = True  # from here on the prefill may write into the pages
        try:
            await self._endpoint.control.send(
                peer, info, timeout_s=self._peers.send_budget(remaining)
            )
        except TransferError as exc:  # unreachable, or closing: not accepted, never delivered
            pending.info_sent = False
            self._peers.forget(peer)
            self._ledger.states.fail(room, f"transfer info not sent: {exc.message}")

    async def _settle(self, room: int, pending: PendingRoom) -> bool:
        """Whether the failed room's pages are safe to reuse (see the module notes)."""
        if not pending.info_sent or pending.settled.is_set() or pending.peer is None:
            return True
        if not await self._abort(pending.peer, room):
            return True  # no connection to the prefill: its process is gone
        try:
            async with asyncio.timeout(self._config.drain_timeout_s):
                await pending.settled.wait()
        except TimeoutError:
            return False
        return True

    async def _abort(self, peer: Peer, room: int) -> bool:
        """Ask ``peer`` to stop writing ``room``; False when it could not be reached."""
        try:
            await self._endpoint.control.send(peer, Abort(room=room))
        except TransferError:  # unreachable (or this side is closing)
            return False
        return True

    # --- control messages ----------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            try:
                msg = await self._endpoint.control.recv()
            except ProtocolMismatch as exc:
                logger.warning("decode control: dropped a message: %s", exc)
                continue
            if isinstance(msg, TransferStatus):
                failed_by = self._ledger.settle(msg)
                if failed_by is not None:
                    self._peers.register_again(failed_by)  # the prefill may have lost us
            else:
                logger.warning("decode control: unexpected %s ignored", type(msg).__name__)

    def _on_peer_lost(self, peer: Peer) -> None:
        self._peers.forget(peer)
        self._ledger.peer_lost(peer)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        async def run() -> None:
            await coro

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
