"""The prefill role: write a request's KV pages into the decode's memory and report the outcome.

Flow (SGLang's Mooncake sender, docs/concepts/protocols.md 6.3-6.7). Once open, the rank publishes
its control
address through the rendezvous client (the registry's ``PUT /route``). Decode ranks send
``RegisterKVArgs`` once per session (``transfer.sessions``) and ``TransferInfo`` per request; per
request ``room``::

    Bootstrapping    until the decode's TransferInfo arrived (``bootstrap``, or the first ``send``)
    WaitingForInput  until the forward pass produced the first chunk's KV
    Transferring     ``send`` per chunk: full pages go as chunks arrive, the partial last page
                     waits for the next chunk (``page_layout.ready_pages``); pages contiguous on
                     both sides are coalesced into one engine entry, in batches of at most 1024
                     (the engine keeps <= 1024 in flight per peer); aux rides in the last batch
    Success | Failed after the last chunk and the aux slot, the status is pushed to the decode

Every wait has a deadline (``bootstrap_timeout_s`` for the transfer info, ``transfer_timeout_s``
per chunk and for an idle room between chunks). A failed engine call, a decode that is not
registered or whose connection dropped, an ``Abort`` from the decode and a timeout all end the
room in Failed with a reason, pushed to the decode, and raise ``TransferFailed`` from the call
that was running (or the next one). Every path releases the room. The status a call awaits
goes out even when the call is cancelled meanwhile (``DecodeLink.report_awaited``).

Destination pages: the status this side pushes means "no write of mine will land in your pages
any more". So it goes out only after the last engine call for the room returned; a write that
outlived its deadline (or a cancelled call) is left to drain in the background and the status
follows when it has. An engine error with entries still in flight (Mooncake's ``CODE_UNDRAINED``)
sends no status at all: the decode fails the room at its deadline, gets no answer to its
``Abort`` and keeps those pages out of use. The rooms' bookkeeping (early transfer info,
tombstones, draining writes) is ``transfer.room_ledger.RoomLedger``; the control messages from
decode ranks and the statuses pushed to them are ``transfer.decode_link.DecodeLink``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Self

import zmq.asyncio

from transfer.chunk_writer import ChunkWriter
from transfer.closing import AsyncClosing, cancel_and_wait
from transfer.config import SenderConfig
from transfer.control import Peer
from transfer.decode_link import DecodeLink
from transfer.endpoint import RankEndpoint
from transfer.engine.base import TransferEngine
from transfer.errors import TransferError
from transfer.page_layout import KVPageLayout, ready_pages
from transfer.rendezvous import PrefillRank, RendezvousClient, bootstrap_url
from transfer.room_ledger import ClosedRoom, OpenRoom, RoomLedger
from transfer.sessions import DecodeSessions
from transfer.state import Clock, KVPoll
from transfer.stats import SenderStats

__all__ = ["KVSender", "SenderConfig", "SenderStats"]

logger = logging.getLogger(__name__)


def _reason(exc: Exception) -> str:
    return exc.message if isinstance(exc, TransferError) else str(exc)


class KVSender(AsyncClosing):
    """A prefill rank's sending side: one per rank, used as ``async with``.

    The caller allocates the KV pool that ``layout`` describes and keeps it alive; while open,
    the rank's endpoint (``transfer.endpoint.RankEndpoint``) registers it, and an aux staging
    buffer of ``config.aux_slots`` slots of ``config.aux_item_len`` bytes (which must equal the
    decode's), with ``engine`` and binds the control socket; with ``config.registry`` the rank
    is published there as ``rank``. All of it is undone on exit. It does not close ``engine``,
    ``context`` or a ``rendezvous`` client passed in. Calls for one room must not overlap
    (``TransferError``); different rooms run concurrently.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        engine: TransferEngine,
        layout: KVPageLayout,
        rank: PrefillRank,
        config: SenderConfig | None = None,
        *,
        rendezvous: RendezvousClient | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        config = config or SenderConfig()
        if rank.page_size != layout.page_size_tokens:
            raise ValueError(f"rank page_size {rank.page_size} != layout {layout.page_size_tokens}")
        self._config = config
        self._layout = layout
        self._rank = rank
        self._registry = (
            None if config.registry is None else bootstrap_url(config.registry, config.namespace)
        )
        self._endpoint = RankEndpoint(
            context, engine, layout, config, rendezvous=rendezvous, on_peer_lost=self._on_peer_lost
        )
        self._clock = clock
        self.stats = SenderStats()
        self._ledger = RoomLedger(
            clock,
            rank.unique_rank,
            self._report_later,
            self.stats,
            bootstrap_timeout_s=config.bootstrap_timeout_s,
            transfer_timeout_s=config.transfer_timeout_s,
        )
        self._sessions = DecodeSessions(layout, rank.unique_rank)
        self._writer = ChunkWriter(
            self._endpoint, self._sessions, self._ledger.states, self.stats, clock
        )
        self._link = DecodeLink(
            self._endpoint, self._sessions, self._ledger, self._writer, self.stats, rank.unique_rank
        )
        self._loops: list[asyncio.Task[None]] = []

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            await self._endpoint.__aenter__()
            self._loops.append(asyncio.create_task(self._link.serve(), name="kv-sender-control"))
            self._loops.append(asyncio.create_task(self._reap(), name="kv-sender-reaper"))
            if self._registry is not None:
                await self._publish(self._registry)
                if self._config.refresh_s:
                    refresh = self._keep_published(self._registry, self._config.refresh_s)
                    self._loops.append(asyncio.create_task(refresh))
        except BaseException:
            await self.aclose()
            raise
        logger.info("prefill rank %s listening on %s", self._rank.unique_rank, self.address)
        return self

    async def aclose(self) -> None:
        """Fail the rooms still open (reporting them), close the endpoint (which unregisters)."""
        await cancel_and_wait(self._loops)
        self._loops.clear()
        self._ledger.fail_all("prefill rank shutting down")
        await self._link.aclose()
        await self._endpoint.aclose()

    # --- public --------------------------------------------------------------------------------

    @property
    def address(self) -> Peer:
        """This rank's control address, as published through the rendezvous."""
        return self._endpoint.address

    @property
    def open_rooms(self) -> int:
        """Rooms started and not yet released (0 when idle)."""
        return len(self._ledger)

    @property
    def unclaimed_infos(self) -> int:
        """Rooms whose transfer info arrived before this rank started them."""
        return self._ledger.unclaimed

    async def bootstrap(self, room: int, timeout_s: float | None = None) -> KVPoll:
        """Start ``room``, wait for the decode's transfer info (Bootstrapping -> WaitingForInput).

        ``timeout_s`` defaults to ``bootstrap_timeout_s``. Returns the room's state; raises
        ``TransferFailed`` when it failed (the decode has been told).
        """
        return await self._call(room, timeout_s, self._wait_infos)

    async def send(
        self,
        room: int,
        src_pages: Sequence[int],
        num_tokens: int,
        *,
        is_last_chunk: bool,
        aux: bytes | None = None,
    ) -> KVPoll:
        """Send what is ready of ``room``'s KV after a prefill chunk.

        ``src_pages`` is the room's page table so far (request-relative position -> page of this
        rank's pool) and ``num_tokens`` the prompt tokens whose KV exists now. Full pages not yet
        sent are written; a partial last page waits for the next chunk unless ``is_last_chunk``.
        On the last chunk ``aux`` (at most ``aux_item_len`` bytes, zero-padded; ignored before
        the last chunk) goes to the decode's aux slot and Success is pushed. Waits for the
        transfer info first if needed.

        Returns Transferring (more chunks expected) or Success; raises ``TransferFailed`` with
        the reason when the room failed (the decode has been told, the room is released).
        """

        async def step(rec: OpenRoom) -> None:
            await self._send_chunk(rec, src_pages, num_tokens, is_last_chunk, aux)

        return await self._call(room, None, step)

    def abort(self, room: int, reason: str) -> bool:
        """Fail ``room`` (the prefill gave up on it: a client left, a forward failed).

        The decode is told; a call running for the room raises ``TransferFailed``. Returns
        whether the room was open.
        """
        return self._ledger.abort(room, reason)

    # --- room calls ----------------------------------------------------------------------------

    async def _call(
        self, room: int, timeout_s: float | None, step: Callable[[OpenRoom], Awaitable[None]]
    ) -> KVPoll:
        rec = self._ledger.open(room, timeout_s)
        if rec.busy:
            raise TransferError(
                f"room {room}: another call for it is running", room=room, op="send"
            )
        rec.busy = True
        states = self._ledger.states
        try:
            await step(rec)
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            states.fail(room, "cancelled on the prefill" if cancelled else f"error: {exc!r}")
            rec.busy = False
            self._ledger.finish_later(room)
            raise
        rec.busy = False
        state = states.get(room)
        if not state.done:
            return state.poll
        closed = self._ledger.finish(room)
        if closed is not None:
            await self._link.report_awaited(closed)  # goes out even if this call is cancelled
        state.raise_if_failed()
        return state.poll

    async def _wait_infos(self, rec: OpenRoom) -> None:
        room = rec.room
        state = self._ledger.states.get(room)
        while state.poll is KVPoll.Bootstrapping:
            remaining = state.deadline - self._clock()
            if remaining <= 0:
                self._ledger.states.fail(
                    room,
                    f"timed out in Bootstrapping: transfer info from "
                    f"{len(rec.infos)} decode rank(s) before the deadline",
                )
                return
            rec.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await rec.changed.wait()

    async def _send_chunk(
        self,
        rec: OpenRoom,
        src_pages: Sequence[int],
        num_tokens: int,
        is_last_chunk: bool,
        aux: bytes | None,
    ) -> None:
        await self._wait_infos(rec)
        states, room = self._ledger.states, rec.room
        state = states.get(room)
        if state.done:
            return
        state.deadline = self._clock() + self._config.transfer_timeout_s
        if state.poll is KVPoll.WaitingForInput:
            states.advance(room, KVPoll.Transferring)
        try:
            plan = ready_pages(
                num_tokens, self._layout.page_size_tokens, rec.sent_pages, is_last_chunk
            )
            if len(src_pages) < plan.send.stop:
                raise ValueError(f"{len(src_pages)} source pages for {plan.send.stop} pages")
            src = [src_pages[i] for i in plan.send]
            with_aux = is_last_chunk and aux is not None
            await self._writer.write(rec, plan.send, src, (aux or b"") if with_aux else None)
            rec.sent_pages = plan.send.stop
            if is_last_chunk and not states.get(room).done:
                states.advance(room, KVPoll.Success)
        except (TransferError, ValueError) as exc:
            states.fail(room, _reason(exc))

    # --- the decode ranks (``DecodeLink``; the endpoint and the ledger call back) -----------

    def _report_later(self, closed: ClosedRoom) -> None:
        self._link.report_later(closed)

    def _on_peer_lost(self, peer: Peer) -> None:
        self._link.peer_lost(peer)

    # --- background ----------------------------------------------------------------------------

    async def _reap(self) -> None:
        """Fail rooms past their deadline and drop transfer info no request claimed."""
        while True:
            await asyncio.sleep(self._config.reap_interval_s)
            self._ledger.expire(self._clock())

    async def _publish(self, registry: str, attempts: int = 5) -> None:
        rendezvous = self._endpoint.rendezvous
        await rendezvous.register(registry, self._rank, self.address, attempts=attempts)

    async def _keep_published(self, registry: str, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self._publish(registry, attempts=1)
            except TransferError as exc:
                logger.warning("rendezvous refresh failed: %s", exc.message)
