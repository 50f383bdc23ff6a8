"""The prefill role: write a request's KV pages into the decode's memory and report the outcome.

Flow (SGLang's Mooncake sender, PROTOCOLS.md 6.3-6.7). Once open, the rank announces its control
address to the registry (``PUT /route``). Decode ranks send ``RegisterKVArgs`` once per session
and ``TransferInfo`` per request; per request ``room``::

    Bootstrapping    until the decode's TransferInfo arrived (``bootstrap``, or the first ``send``)
    WaitingForInput  until the forward pass produced the first chunk's KV
    Transferring     ``send`` per chunk: full pages go as chunks arrive, the partial last page
                     waits for the next chunk (``layout.ready_pages``); pages contiguous on both
                     sides are coalesced into one engine entry, in batches of at most 1024
                     (the engine keeps <= 1024 in flight per peer); aux rides in the last batch
    Success | Failed after the last chunk and the aux slot, the status is pushed to the decode

Every wait has a deadline (``bootstrap_timeout_s`` for the transfer info, ``transfer_timeout_s``
per chunk and for an idle room between chunks). A failed engine call, a decode that is not
registered or whose connection dropped, an ``Abort`` from the decode and a timeout all end the
room in Failed with a reason, pushed to the decode, and raise ``TransferFailed`` from the call
that was running (or the next one). Every path releases the room.

Destination pages: the status this side pushes means "no write of mine will land in your pages
any more". So it goes out only after the last engine call for the room returned; a write that
outlived its deadline (or a cancelled call) is left to drain in the background and the status
follows when it has. An engine error with entries still in flight (Mooncake's ``CODE_UNDRAINED``)
sends no status at all: the decode fails the room at its deadline, gets no answer to its
``Abort`` and keeps those pages out of use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self

import zmq.asyncio

from transfer.bootstrap import BootstrapClient, PrefillRank, bootstrap_url
from transfer.closing import AsyncClosing, cancel_and_wait
from transfer.control import ControlPlane, Peer
from transfer.engine.base import TransferEngine
from transfer.engine.mooncake import CODE_UNDRAINED
from transfer.errors import EngineError, ProtocolMismatch, TransferError, TransferFailed
from transfer.layout import (
    Entry,
    KVLayout,
    aux_entries,
    batches,
    ready_pages,
    total_bytes,
    transfer_entries,
)
from transfer.memory import RegisteredBuffers
from transfer.messages import Abort, RegisterKVArgs, TransferInfo, TransferStatus
from transfer.state import Clock, KVPoll, RoomTable

__all__ = ["KVSender", "SenderStats"]

logger = logging.getLogger(__name__)

_TOMBSTONES = 4096  # finished rooms remembered, to answer late calls and aborts


@dataclass(slots=True)
class SenderStats:
    registrations: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    batches: int = 0
    entries: int = 0
    bytes_written: int = 0  # KV and aux


@dataclass(frozen=True, slots=True)
class _Session:
    """A registered decode rank: where to report and the geometry of its pool."""

    peer: Peer
    layout: KVLayout
    aux_ptr: int | None


class _Room:
    __slots__ = ("aux_slot", "busy", "changed", "infos", "room", "sent_pages", "undrained", "write")

    def __init__(self, room: int, infos: Iterable[TransferInfo]) -> None:
        self.room = room
        self.infos = list(infos)
        self.sent_pages = 0
        self.busy = False
        self.changed = asyncio.Event()  # an info arrived or the room failed
        self.aux_slot: int | None = None
        self.write: asyncio.Task[None] | None = None  # a write left running past its deadline
        self.undrained = False  # the engine gave up on a failed write with entries in flight

    @property
    def complete(self) -> bool:
        need = max((info.required_dst_info_num for info in self.infos), default=1)
        return len({info.session_id for info in self.infos}) >= need if self.infos else False


@dataclass(slots=True)
class _Early:
    """Transfer info for a room this rank has not started yet."""

    since: float
    infos: list[TransferInfo] = field(default_factory=list)


class _Closed(NamedTuple):
    """A released room, still to be reported to its decode ranks."""

    room: int
    status: KVPoll
    reason: str | None
    targets: tuple[Peer, ...]
    write: asyncio.Task[None] | None
    aux_slot: int | None
    quiet: bool = True  # False: writes may still land in the decode's pages, for good


def _targets(infos: Iterable[TransferInfo]) -> tuple[Peer, ...]:
    return tuple(dict.fromkeys(Peer(info.ip, info.port) for info in infos))


def _reason(exc: Exception) -> str:
    return exc.message if isinstance(exc, TransferError) else str(exc)


class KVSender(AsyncClosing):
    """A prefill rank's sending side: one per rank, used as ``async with``.

    The caller allocates the KV pool that ``layout`` describes and keeps it alive; this class
    registers it (and an aux staging buffer of ``aux_slots`` slots of ``aux_item_len`` bytes, which
    must equal the decode's) with ``engine`` while open, binds the control socket on
    ``host:port``, announces ``rank`` to the bootstrap API at ``registry`` (optionally under
    ``namespace``) and undoes all of it on exit. It does not close ``engine`` or ``context``.
    Calls for one room must not overlap (``TransferError``); different rooms run concurrently.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        engine: TransferEngine,
        layout: KVLayout,
        rank: PrefillRank,
        *,
        registry: str | None = None,
        namespace: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        bootstrap: BootstrapClient | None = None,
        aux_item_len: int = 0,
        aux_slots: int = 64,
        bootstrap_timeout_s: float = 300.0,
        transfer_timeout_s: float = 300.0,
        send_timeout_s: float = 1.0,
        refresh_s: float | None = None,
        reap_interval_s: float = 0.05,
        clock: Clock = time.monotonic,
    ) -> None:
        if rank.page_size != layout.page_size_tokens:
            raise ValueError(f"rank page_size {rank.page_size} != layout {layout.page_size_tokens}")
        self._engine = engine
        self._layout = layout
        self._rank = rank
        self._registry = None if registry is None else bootstrap_url(registry, namespace)
        self._control = ControlPlane(
            context,
            host=host,
            port=port,
            advertise_host=advertise_host,
            send_timeout_s=send_timeout_s,
            on_peer_lost=self._on_peer_lost,
        )
        self._own_bootstrap = bootstrap is None
        self._bootstrap = bootstrap or BootstrapClient()
        self._bootstrap_timeout = bootstrap_timeout_s
        self._transfer_timeout = transfer_timeout_s
        self._refresh = refresh_s
        self._reap_interval = reap_interval_s
        self._clock = clock
        self._rooms = RoomTable(clock)
        self._recs: dict[int, _Room] = {}
        self._early: dict[int, _Early] = {}
        self._tombs: OrderedDict[int, _Closed] = OrderedDict()
        self._draining: dict[int, asyncio.Task[None]] = {}  # room -> write left running
        self._closing = False
        self._sessions: dict[str, _Session] = {}
        self._refused: dict[str, str] = {}
        self._aux_item_len = aux_item_len if aux_slots > 0 else 0
        self._aux = bytearray(self._aux_item_len * aux_slots)
        self._aux_ptr = 0
        self._aux_free = list(range(aux_slots if self._aux_item_len else 0))
        self._buffers = RegisteredBuffers(engine, layout, self._aux)
        self._loops: list[asyncio.Task[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.stats = SenderStats()

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            self._buffers.open()
            self._aux_ptr = self._buffers.aux_ptr
            await self._control.__aenter__()
            self._loops.append(asyncio.create_task(self._serve(), name="kv-sender-control"))
            self._loops.append(asyncio.create_task(self._reap(), name="kv-sender-reaper"))
            if self._registry is not None:
                await self._bootstrap.register(self._registry, self._rank, self.address)
                if self._refresh:
                    self._loops.append(asyncio.create_task(self._keep_registered(self._refresh)))
        except BaseException:
            await self.aclose()
            raise
        logger.info("prefill rank %s listening on %s", self._rank.unique_rank, self.address)
        return self

    async def aclose(self) -> None:
        """Fail the rooms still open (reporting them), close the control plane, unregister."""
        await cancel_and_wait(self._loops)
        self._loops.clear()
        for room in list(self._recs):
            self._fail(room, "prefill rank shutting down")
        for room in list(self._early):
            self._drop_early(room, "prefill rank shutting down")
        waits = set(self._tasks) | set(self._draining.values())
        if waits:  # reports (and writes still draining) get one send timeout, plus slack
            await asyncio.wait(waits, timeout=self._control.send_timeout_s + 0.5)
        self._closing = True
        if self._draining:
            logger.error("%d engine write(s) still running at close", len(self._draining))
        await cancel_and_wait(list(self._tasks))
        await self._control.aclose()
        self._buffers.close()
        if self._own_bootstrap:
            await self._bootstrap.aclose()

    # --- public --------------------------------------------------------------------------------

    @property
    def address(self) -> Peer:
        """This rank's control address, as registered with the bootstrap API."""
        return self._control.address

    @property
    def open_rooms(self) -> int:
        """Rooms started and not yet released (0 when idle)."""
        return len(self._rooms)

    @property
    def unclaimed_infos(self) -> int:
        """Rooms whose transfer info arrived before this rank started them."""
        return len(self._early)

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

        async def step(rec: _Room) -> None:
            await self._send_chunk(rec, src_pages, num_tokens, is_last_chunk, aux)

        return await self._call(room, None, step)

    def abort(self, room: int, reason: str) -> bool:
        """Fail ``room`` (the prefill gave up on it: a client left, a forward failed).

        The decode is told; a call running for the room raises ``TransferFailed``. Returns
        whether the room was open.
        """
        if room in self._recs:
            return self._fail(room, reason)
        if room in self._early:
            self._drop_early(room, reason)
            return True
        return False

    # --- room calls ----------------------------------------------------------------------------

    async def _call(
        self, room: int, timeout_s: float | None, step: Callable[[_Room], Awaitable[None]]
    ) -> KVPoll:
        rec = self._open(room, timeout_s)
        if rec.busy:
            raise TransferError(
                f"room {room}: another call for it is running", room=room, op="send"
            )
        rec.busy = True
        try:
            await step(rec)
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            self._rooms.fail(room, "cancelled on the prefill" if cancelled else f"error: {exc!r}")
            rec.busy = False
            self._finish_later(room)
            raise
        rec.busy = False
        state = self._rooms.get(room)
        if not state.done:
            return state.poll
        closed = self._finish(room)
        if closed is not None:
            await self._report(closed)
        state.raise_if_failed()
        return state.poll

    def _open(self, room: int, timeout_s: float | None) -> _Room:
        rec = self._recs.get(room)
        if rec is not None:
            return rec
        tomb = self._tombs.get(room)
        if tomb is not None:
            if tomb.status is KVPoll.Failed:
                raise TransferFailed(room, tomb.reason or "failed")
            raise TransferError(f"room {room} already finished", room=room, op="send")
        self._rooms.create(room, self._bootstrap_timeout if timeout_s is None else timeout_s)
        early = self._early.pop(room, None)
        rec = self._recs[room] = _Room(room, early.infos if early else ())
        self._check_infos(room, rec)
        return rec

    async def _wait_infos(self, rec: _Room) -> None:
        room = rec.room
        state = self._rooms.get(room)
        while state.poll is KVPoll.Bootstrapping:
            remaining = state.deadline - self._clock()
            if remaining <= 0:
                self._rooms.fail(
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
        rec: _Room,
        src_pages: Sequence[int],
        num_tokens: int,
        is_last_chunk: bool,
        aux: bytes | None,
    ) -> None:
        await self._wait_infos(rec)
        room = rec.room
        state = self._rooms.get(room)
        if state.done:
            return
        state.deadline = self._clock() + self._transfer_timeout
        if state.poll is KVPoll.WaitingForInput:
            self._rooms.advance(room, KVPoll.Transferring)
        try:
            plan = ready_pages(
                num_tokens, self._layout.page_size_tokens, rec.sent_pages, is_last_chunk
            )
            if len(src_pages) < plan.send.stop:
                raise ValueError(f"{len(src_pages)} source pages for {plan.send.stop} pages")
            src = [src_pages[i] for i in plan.send]
            with_aux = is_last_chunk and aux is not None
            if with_aux:
                self._stage_aux(rec, aux or b"")
            for info in rec.infos:
                if info.is_dummy:
                    continue
                entries = self._page_entries(info, plan.send, src)
                if with_aux:  # the aux slot rides in the last chunk's batch
                    entries += self._aux_entries(rec, info)
                await self._write_entries(room, info.session_id, entries)
            rec.sent_pages = plan.send.stop
            if is_last_chunk and not self._rooms.get(room).done:
                self._rooms.advance(room, KVPoll.Success)
        except (TransferError, ValueError) as exc:
            self._rooms.fail(room, _reason(exc))

    def _page_entries(
        self, info: TransferInfo, positions: range, src: Sequence[int]
    ) -> list[Entry]:
        session = self._session(info)
        if len(info.dst_kv_indices) < positions.stop:
            raise ValueError(
                f"decode allocated {len(info.dst_kv_indices)} pages, the prompt needs "
                f"{positions.stop}"
            )
        dst = [info.dst_kv_indices[i] for i in positions]
        return transfer_entries(self._layout, session.layout, src, dst)

    def _stage_aux(self, rec: _Room, aux: bytes) -> None:
        """Copy ``aux`` into a staging slot of this rank's registered aux buffer."""
        if len(aux) > self._aux_item_len:
            raise ValueError(f"aux of {len(aux)} bytes, slots hold {self._aux_item_len}")
        if rec.aux_slot is None:
            if not self._aux_free:
                raise TransferError(
                    f"room {rec.room}: no free aux staging slot", room=rec.room, op="aux"
                )
            rec.aux_slot = self._aux_free.pop()
        start = rec.aux_slot * self._aux_item_len
        self._aux[start : start + self._aux_item_len] = aux.ljust(self._aux_item_len, b"\0")

    def _aux_entries(self, rec: _Room, info: TransferInfo) -> list[Entry]:
        session = self._session(info)
        if session.aux_ptr is None or info.dst_aux_index is None or rec.aux_slot is None:
            raise TransferError(
                f"decode session {info.session_id} registered no aux buffer",
                room=rec.room,
                op="aux",
            )
        return aux_entries(
            [self._aux_ptr],
            [session.aux_ptr],
            [self._aux_item_len],
            rec.aux_slot,
            info.dst_aux_index,
        )

    async def _write_entries(self, room: int, session_id: str, entries: Sequence[Entry]) -> None:
        for batch in batches(entries):
            if self._rooms.get(room).done:
                return  # aborted, lost or timed out: stop writing into the decode's pages
            await self._write(room, session_id, batch)
            self.stats.batches += 1
            self.stats.entries += len(batch)
            self.stats.bytes_written += total_bytes(batch)

    async def _write(self, room: int, session_id: str, batch: Sequence[Entry]) -> None:
        """One engine write within the room's deadline.

        A write still running at the deadline (or when the call is cancelled) is left to drain:
        the room's status waits for it (``_finish``). An engine error that says entries may still
        be in flight (``CODE_UNDRAINED``) marks the room's pages as never quiet.
        """
        task = asyncio.create_task(self._engine.write(session_id, batch))
        remaining = max(self._rooms.get(room).deadline - self._clock(), 0.0)
        try:
            done, _ = await asyncio.wait({task}, timeout=remaining)
        except asyncio.CancelledError:
            self._recs[room].write = task
            raise
        if not done:
            self._recs[room].write = task
            raise TransferError(
                f"room {room}: engine write still running at the deadline", room=room, op="write"
            )
        try:
            task.result()
        except EngineError as exc:
            if exc.code == CODE_UNDRAINED:
                self._recs[room].undrained = True
            raise

    def _session(self, info: TransferInfo) -> _Session:
        session = self._sessions.get(info.session_id)
        if session is None:
            raise TransferError(self._unregistered(info), room=info.room, op="session")
        return session

    def _unregistered(self, info: TransferInfo) -> str:
        return self._refused.get(info.session_id) or (
            f"decode session {info.session_id} is not registered with prefill rank "
            f"{self._rank.unique_rank} (or its connection was lost)"
        )

    # --- ending rooms --------------------------------------------------------------------------

    def _fail(self, room: int, reason: str) -> bool:
        """Fail an open room; an idle one is released and reported now, a busy one by its call."""
        if not self._rooms.fail(room, reason):
            return False
        rec = self._recs[room]
        rec.changed.set()
        if not rec.busy:
            self._finish_later(room)
        return True

    def _close(self, room: int) -> _Closed:
        """Release ``room`` (it must be final or is failed) and remember how it ended."""
        rec = self._recs.pop(room)
        state = self._rooms.release(room)
        assert state is not None
        write = rec.write if rec.write is not None and not rec.write.done() else None
        closed = _Closed(
            room,
            state.poll,
            state.reason,
            _targets(rec.infos),
            write,
            rec.aux_slot,
            quiet=not rec.undrained,
        )
        self._remember(closed)
        if state.poll is KVPoll.Success:
            self.stats.rooms_succeeded += 1
        else:
            self.stats.rooms_failed += 1
            logger.warning("room %d failed: %s", room, state.reason)
        return closed

    def _finish(self, room: int) -> _Closed | None:
        """Release ``room``; its record when the status may go now, None while a write drains.

        A write left running past its deadline (or by a cancelled call) may still land in the
        decode's pages: the status, and the aux staging slot, wait for it to end.
        """
        closed = self._close(room)
        if not closed.quiet:
            # no status at all: the decode fails the room at its deadline and, unanswered,
            # keeps the pages out of use (the aux staging slot stays out of use here too)
            logger.error("room %d: engine writes may still be in flight; status withheld", room)
            return None
        if closed.write is None:
            return closed
        self._draining[room] = closed.write
        closed.write.add_done_callback(lambda _: self._drained(closed))
        return None

    def _finish_later(self, room: int) -> None:
        closed = self._finish(room)
        if closed is not None:
            self._spawn(self._report(closed))

    def _drained(self, closed: _Closed) -> None:
        self._draining.pop(closed.room, None)
        logger.info(
            "room %d: late engine write ended; reporting %s", closed.room, closed.status.name
        )
        if not self._closing:
            self._spawn(self._report(closed))

    async def _report(self, closed: _Closed) -> None:
        """Push the room's status (no write of the room is running); free its aux slot."""
        if closed.aux_slot is not None:
            self._aux_free.append(closed.aux_slot)
        status = TransferStatus(
            room=closed.room,
            status=closed.status,
            prefill_rank=self._rank.unique_rank,
            reason=closed.reason,
        )
        await self._push(closed.targets, status)

    async def _push(self, targets: Iterable[Peer], status: TransferStatus) -> None:
        async def one(peer: Peer) -> None:
            try:
                await self._control.send(peer, status)
            except TransferError as exc:
                logger.warning(
                    "room %d: status not delivered to %s: %s", status.room, peer, exc.message
                )

        await asyncio.gather(*(one(peer) for peer in targets))

    def _failed_status(self, room: int, reason: str) -> TransferStatus:
        return TransferStatus(
            room=room, status=KVPoll.Failed, prefill_rank=self._rank.unique_rank, reason=reason
        )

    def _drop_early(self, room: int, reason: str, *, lost: Peer | None = None) -> None:
        """Drop transfer info no call claimed, telling its decode ranks (but ``lost``); a later
        call for the room fails at once."""
        early = self._early.pop(room)
        self._remember(_Closed(room, KVPoll.Failed, reason, (), None, None))
        targets = tuple(peer for peer in _targets(early.infos) if peer != lost)
        if targets:
            self._spawn(self._push(targets, self._failed_status(room, reason)))

    def _remember(self, closed: _Closed) -> None:
        self._tombs[closed.room] = closed._replace(write=None)
        self._tombs.move_to_end(closed.room)
        while len(self._tombs) > _TOMBSTONES:
            self._tombs.popitem(last=False)

    # --- control messages ----------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            try:
                msg = await self._control.recv()
            except ProtocolMismatch as exc:
                logger.warning("prefill control: dropped a message: %s", exc)
                continue
            match msg:
                case RegisterKVArgs():
                    self._on_register(msg)
                case TransferInfo():
                    self._on_info(msg)
                case Abort():
                    self._on_abort(msg.room)
                case _:
                    logger.warning("prefill control: unexpected %s ignored", type(msg).__name__)

    def _on_register(self, args: RegisterKVArgs) -> None:
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
            return
        peer = Peer(args.ip, args.port)
        self._refused.pop(sid, None)
        aux_ptr = args.aux_data_ptrs[0] if args.aux_data_ptrs else None
        self._sessions[sid] = _Session(peer, layout, aux_ptr)
        self._control.connect(peer)  # watched: a decode that goes away fails its rooms
        self.stats.registrations += 1
        logger.info("decode session %s registered from %s", sid, peer)

    def _on_info(self, info: TransferInfo) -> None:
        room = info.room
        known = info.session_id in self._sessions
        rec = self._recs.get(room)
        infos = rec.infos if rec is not None else self._early.get(room, _Early(0)).infos
        if any(known_info.session_id == info.session_id for known_info in infos):
            logger.warning(
                "room %d: duplicate transfer info from %s ignored", room, info.session_id
            )
            return
        if rec is not None:
            rec.infos.append(info)
            if known:
                self._check_infos(room, rec)
            else:
                self._fail(room, self._unregistered(info))
            return
        reason = None if known else self._unregistered(info)
        tomb = self._tombs.get(room)
        if reason is None and tomb is not None:
            reason = f"room {room} already ended ({tomb.status.name}) on this prefill rank"
        if reason is not None:
            self._spawn(self._push(_targets([info]), self._failed_status(room, reason)))
            return
        self._early.setdefault(room, _Early(self._clock())).infos.append(info)

    def _check_infos(self, room: int, rec: _Room) -> None:
        """Bootstrapping -> WaitingForInput once every expected decode rank sent its info."""
        if rec.complete and self._rooms.get(room).poll is KVPoll.Bootstrapping:
            self._rooms.advance(room, KVPoll.WaitingForInput, deadline_s=self._transfer_timeout)
            rec.changed.set()

    def _on_abort(self, room: int) -> None:
        if room in self._recs:
            self._fail(room, "aborted by the decode")
        elif room in self._early:
            self._drop_early(room, "aborted by the decode")
        elif room in self._tombs and room not in self._draining and self._tombs[room].quiet:
            # already over here (the status may have crossed the abort): say so again
            tomb = self._tombs[room]
            status = TransferStatus(
                room=room,
                status=tomb.status,
                prefill_rank=self._rank.unique_rank,
                reason=tomb.reason,
            )
            self._spawn(self._push(tomb.targets, status))

    def _on_peer_lost(self, peer: Peer) -> None:
        lost = {sid for sid, session in self._sessions.items() if session.peer == peer}
        for sid in lost:
            del self._sessions[sid]
        if not lost:
            return
        for room, rec in list(self._recs.items()):
            if any(info.session_id in lost for info in rec.infos):
                self._fail(room, f"lost connection to decode {peer}")
        for room, early in list(self._early.items()):
            if any(info.session_id in lost for info in early.infos):
                self._drop_early(room, f"lost connection to decode {peer}", lost=peer)

    # --- background ----------------------------------------------------------------------------

    async def _reap(self) -> None:
        """Fail rooms past their deadline and drop transfer info no request claimed."""
        while True:
            await asyncio.sleep(self._reap_interval)
            now = self._clock()
            for room in self._rooms.expire(now):
                rec = self._recs[room]
                rec.changed.set()
                if not rec.busy:
                    self._finish_later(room)
            for room, early in list(self._early.items()):
                if now - early.since >= self._bootstrap_timeout:
                    self._drop_early(
                        room,
                        f"prefill rank {self._rank.unique_rank} got no "
                        f"request for room {room} within "
                        f"{self._bootstrap_timeout:g} s",
                    )

    async def _keep_registered(self, every: float) -> None:
        assert self._registry is not None
        while True:
            await asyncio.sleep(every)
            try:
                await self._bootstrap.register(self._registry, self._rank, self.address, attempts=1)
            except TransferError as exc:
                logger.warning("bootstrap refresh failed: %s", exc.message)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
