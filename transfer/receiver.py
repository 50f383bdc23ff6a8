"""The decode role: expose this rank's KV pages and receive a request's KV from a prefill rank.

Flow (SGLang's Mooncake receiver, PROTOCOLS.md 6.3-6.5), per request ``room``::

    Bootstrapping    look up the prefill rank in the registry (GET /route, cached) and, on first
                     contact in this session, send it RegisterKVArgs (our buffers and address)
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
sends ``Abort`` in the background and its pages count as unsafe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Self

import zmq.asyncio

from transfer.bootstrap import BootstrapClient, BootstrapError, PrefillInfo, bootstrap_url
from transfer.closing import AsyncClosing, cancel_and_wait
from transfer.control import ControlPlane, Peer, PeerUnreachable
from transfer.engine.base import TransferEngine
from transfer.errors import ProtocolMismatch, TransferError, TransferFailed
from transfer.layout import KVLayout
from transfer.memory import RegisteredBuffers
from transfer.messages import Abort, RegisterKVArgs, TransferInfo, TransferStatus
from transfer.state import Clock, KVPoll, RoomTable

__all__ = ["KVReceiver", "ReceiveFailed", "ReceiveResult", "ReceiverStats"]

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


@dataclass(slots=True)
class ReceiverStats:
    registrations_sent: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    kv_bytes: int = 0


class _Pending:
    """What this side knows about one room's prefill while the request runs."""

    __slots__ = ("base_url", "info_sent", "lost", "peer", "settled", "status")

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.peer: Peer | None = None
        self.info_sent = False
        self.lost = False
        self.status: TransferStatus | None = None
        self.settled = asyncio.Event()  # the prefill reported the room's end, or is gone


class KVReceiver(AsyncClosing):
    """A decode rank's receiving side: one per rank, used as ``async with``.

    The caller allocates the KV pool that ``layout`` describes and keeps it alive; this class
    registers it (and its own aux buffer of ``aux_slots`` slots of ``aux_item_len`` bytes) with
    ``engine`` while open, binds the rank's control socket on ``host:port`` and unregisters
    everything on exit. It does not close ``engine`` or ``context``.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        engine: TransferEngine,
        layout: KVLayout,
        *,
        aux_item_len: int = 0,
        aux_slots: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        bootstrap: BootstrapClient | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        kv_cache_dtype: str | None = None,
        send_timeout_s: float = 1.0,
        drain_timeout_s: float = 2.0,
        clock: Clock = time.monotonic,
    ) -> None:
        if aux_item_len < 0 or aux_slots < 0:
            raise ValueError("aux_item_len and aux_slots must be >= 0")
        self._engine = engine
        self._layout = layout
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
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._kv_dtype = kv_cache_dtype
        self._drain_timeout = drain_timeout_s
        self._clock = clock
        self._rooms = RoomTable(clock)
        self._pending: dict[int, _Pending] = {}
        self._registered: set[Peer] = set()
        self._peer_urls: dict[Peer, set[str]] = {}
        self._aux_item_len = aux_item_len if aux_slots else 0
        self._aux = bytearray(self._aux_item_len * aux_slots)
        self._aux_slots = aux_slots if self._aux_item_len else 0
        self._aux_ptr = 0
        self._buffers = RegisteredBuffers(engine, layout, self._aux)
        self._tasks: set[asyncio.Task[None]] = set()
        self._serving: asyncio.Task[None] | None = None
        self.stats = ReceiverStats()

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            self._buffers.open()
            self._aux_ptr = self._buffers.aux_ptr
            await self._control.__aenter__()
        except BaseException:
            await self.aclose()
            raise
        self._serving = asyncio.create_task(self._serve(), name="kv-receiver-control")
        return self

    async def aclose(self) -> None:
        """Fail the requests still running, close the control plane, unregister the buffers."""
        for room in list(self._pending):
            self._rooms.fail(room, "decode rank shutting down")
        await cancel_and_wait([self._serving, *self._tasks])
        self._serving = None
        await self._control.aclose()
        self._buffers.close()
        if self._own_bootstrap:
            await self._bootstrap.aclose()

    # --- public --------------------------------------------------------------------------------

    @property
    def address(self) -> Peer:
        """Where prefill ranks send statuses (this rank's control socket)."""
        return self._control.address

    @property
    def open_rooms(self) -> int:
        """Requests in progress (0 when idle: every path releases its room)."""
        return len(self._rooms)

    @property
    def aux_ptr(self) -> int:
        """The address of this rank's aux buffer (0 without one)."""
        return self._aux_ptr

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
        self._rooms.create(room, timeout_s)
        pending = self._pending[room] = _Pending(bootstrap_url(bootstrap_addr))
        try:
            if aux_index is not None and self._aux_slots:
                self._aux_slot(aux_index)[:] = bytes(self._aux_item_len)
            await self._start(room, pending, dst_pages, aux_index, dp_rank, engine_id)
            state = await self._rooms.wait(room)
            if state.poll is KVPoll.Success:
                kv_bytes = len(dst_pages) * self._layout.page_bytes * self._layout.num_regions
                self.stats.rooms_succeeded += 1
                self.stats.kv_bytes += kv_bytes
                aux = b""
                if aux_index is not None and self._aux_slots:
                    aux = bytes(self._aux_slot(aux_index))
                return ReceiveResult(room, kv_bytes, aux, self._clock() - started)
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
            del self._pending[room]
            self._rooms.release(room)

    def cancel(self, room: int, reason: str) -> bool:
        """Fail a running ``request`` (a client went away); it then raises ``ReceiveFailed``.

        Returns whether the room was running. The failing ``request`` still settles its pages.
        """
        if room not in self._pending:
            return False
        return self._rooms.fail(room, reason)

    # --- request steps -------------------------------------------------------------------------

    def _check_request(self, dst_pages: Sequence[int], aux_index: int | None) -> None:
        self._layout.check_pages(dst_pages)
        if not dst_pages:
            if aux_index is not None:
                raise ValueError("a dummy request (no pages) takes no aux_index")
            return
        if aux_index is None:
            raise ValueError("a request with pages needs an aux_index")
        if self._aux_slots:
            self._aux_slot(aux_index)

    def _aux_slot(self, index: int) -> memoryview:
        if not 0 <= index < self._aux_slots:
            raise ValueError(f"aux_index {index} outside [0, {self._aux_slots})")
        start = index * self._aux_item_len
        return memoryview(self._aux)[start : start + self._aux_item_len]

    def _remaining(self, room: int) -> float:
        return self._rooms.get(room).deadline - self._clock()

    def _step(self, room: int, poll: KVPoll) -> bool:
        """Advance ``room`` unless something already ended it."""
        if self._rooms.get(room).done:
            return False
        self._rooms.advance(room, poll)
        return True

    async def _start(
        self,
        room: int,
        pending: _Pending,
        dst_pages: Sequence[int],
        aux_index: int | None,
        dp_rank: int | None,
        engine_id: str | None,
    ) -> None:
        """Bootstrapping -> Transferring; any failure fails the room (``request`` reports it)."""
        try:
            if engine_id is None:
                peer = await self._resolve(room, pending.base_url, dp_rank)
            else:
                peer = await self._bootstrap.engine_address(
                    pending.base_url, engine_id, tp=self._tp_rank, timeout_s=self._remaining(room)
                )
                self._peer_urls.setdefault(peer, set()).add(pending.base_url)
            pending.peer = peer
            await self._ensure_registered(peer, room)
        except TransferError as exc:
            if isinstance(exc, PeerUnreachable | BootstrapError):
                self._bootstrap.invalidate(pending.base_url)
            self._rooms.fail(room, exc.message)
            return
        if not (self._step(room, KVPoll.WaitingForInput) and self._step(room, KVPoll.Transferring)):
            return
        address = self._control.address
        info = TransferInfo(
            room=room,
            ip=address.host,
            port=address.port,
            session_id=self._engine.session_id,
            dst_kv_indices=tuple(dst_pages),
            dst_aux_index=aux_index,
            required_dst_info_num=1,
        )
        pending.info_sent = True  # from here on the prefill may write into the pages
        try:
            await self._control.send(peer, info, timeout_s=self._send_budget(room))
        except TransferError as exc:  # unreachable, or closing: not accepted, never delivered
            pending.info_sent = False
            self._forget(peer)
            self._rooms.fail(room, f"transfer info not sent: {exc.message}")

    def _send_budget(self, room: int) -> float:
        return max(min(self._control.send_timeout_s, self._remaining(room)), 0.001)

    async def _resolve(self, room: int, base_url: str, dp_rank: int | None) -> Peer:
        timeout = self._remaining(room)
        info = await self._bootstrap.prefill_info(base_url, timeout_s=timeout)
        self._check_layout(info, base_url)
        if dp_rank is None:
            if not info.follow_bootstrap_room:
                raise BootstrapError(
                    f"the prefill at {base_url} does not place rooms by bootstrap_room; "
                    "pass its dp_rank"
                )
            dp_rank = room % info.dp_size
        peer = await self._bootstrap.rank_address(
            base_url, dp=dp_rank, tp=self._tp_rank, timeout_s=self._remaining(room)
        )
        self._peer_urls.setdefault(peer, set()).add(base_url)
        return peer

    def _check_layout(self, info: PrefillInfo, base_url: str) -> None:
        problems = []
        if info.page_size is not None and info.page_size != self._layout.page_size_tokens:
            problems.append(f"page_size {info.page_size} != {self._layout.page_size_tokens}")
        dtypes = (info.kv_cache_dtype, self._kv_dtype)
        if None not in dtypes and dtypes[0] != dtypes[1]:
            problems.append(f"kv_cache_dtype {dtypes[0]} != {dtypes[1]}")
        if info.tp_size != self._tp_size:
            problems.append(
                f"attn_tp_size {info.tp_size} != decode tp_size {self._tp_size} "
                "(TP resharding is not supported)"
            )
        if (info.pp_size, info.cp_size) != (1, 1):
            problems.append(f"pp_size={info.pp_size} cp_size={info.cp_size} (only 1 supported)")
        if problems:
            self._bootstrap.invalidate(base_url)
            raise BootstrapError(f"prefill at {base_url} does not match: {'; '.join(problems)}")

    async def _ensure_registered(self, peer: Peer, room: int) -> None:
        """Send RegisterKVArgs to ``peer`` once per session (again after a failure or loss)."""
        if peer in self._registered:
            return
        self._registered.add(peer)  # concurrent requests queue behind this message, in order
        address = self._control.address
        args = RegisterKVArgs(
            ip=address.host,
            port=address.port,
            session_id=self._engine.session_id,
            kv_data_ptrs=self._layout.base_ptrs,
            aux_data_ptrs=(self._aux_ptr,) if self._aux_slots else (),
            dst_tp_rank=self._tp_rank,
            dst_tp_size=self._tp_size,
            kv_item_len=self._layout.page_bytes,
            kv_num_pages=self._layout.num_pages,
        )
        try:
            await self._control.send(peer, args, timeout_s=self._send_budget(room))
        except TransferError:
            self._forget(peer)
            raise
        self.stats.registrations_sent += 1
        logger.info("registered KV buffers with prefill rank %s", peer)

    async def _settle(self, room: int, pending: _Pending) -> bool:
        """Whether the failed room's pages are safe to reuse (see the module notes)."""
        if not pending.info_sent or pending.settled.is_set() or pending.peer is None:
            return True
        if not await self._abort(pending.peer, room):
            return True  # no connection to the prefill: its process is gone
        try:
            async with asyncio.timeout(self._drain_timeout):
                await pending.settled.wait()
        except TimeoutError:
            return False
        return True

    async def _abort(self, peer: Peer, room: int) -> bool:
        """Ask ``peer`` to stop writing ``room``; False when it could not be reached."""
        try:
            await self._control.send(peer, Abort(room=room))
        except TransferError:  # unreachable (or this side is closing)
            return False
        return True

    # --- control messages ----------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            try:
                msg = await self._control.recv()
            except ProtocolMismatch as exc:
                logger.warning("decode control: dropped a message: %s", exc)
                continue
            if isinstance(msg, TransferStatus):
                self._on_status(msg)
            else:
                logger.warning("decode control: unexpected %s ignored", type(msg).__name__)

    def _on_status(self, status: TransferStatus) -> None:
        pending = self._pending.get(status.room)
        if pending is None:
            logger.debug("status %s for room %d that is not waiting", status.status, status.room)
            return
        if status.status not in (KVPoll.Success, KVPoll.Failed):
            return
        pending.status = status
        pending.settled.set()
        state = self._rooms.get(status.room)
        if status.status is KVPoll.Success and state.poll is KVPoll.Transferring:
            self._rooms.advance(status.room, KVPoll.Success)
            return
        if status.status is KVPoll.Failed:
            if pending.peer is not None:
                self._registered.discard(pending.peer)  # re-register: the prefill may have lost us
            reason = status.reason or "no reason given"
            self._rooms.fail(status.room, f"prefill rank {status.prefill_rank}: {reason}")

    def _on_peer_lost(self, peer: Peer) -> None:
        self._forget(peer)
        for room, pending in self._pending.items():
            if pending.peer == peer:
                pending.lost = True
                pending.settled.set()
                self._rooms.fail(room, f"lost connection to prefill rank {peer}")

    def _forget(self, peer: Peer) -> None:
        """Register again on next contact and look the rank up again."""
        self._registered.discard(peer)
        for base_url in self._peer_urls.pop(peer, set()):
            self._bootstrap.invalidate(base_url)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        async def run() -> None:
            await coro

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
