"""``TransferEngine`` over the Mooncake transfer engine (``mooncake.engine``), P2PHANDSHAKE.

Setup: ``pip install mooncake-transfer-engine-non-cuda`` (x86_64 Linux; the project's dependency)
plus the Debian libraries it loads, ``libibverbs1 librdmacm1 libnuma1`` (``scripts/setup.sh``
installs them). The module is imported lazily, in ``MooncakeEngine.start``.

Transport. ``initialize(host, "P2PHANDSHAKE", protocol, device)`` needs no metadata server: a
peer's session id ``"host:rpc_port"`` is enough. In this wheel the engine *auto-discovers* its
transport: RDMA when it finds HCAs (``device`` filters them), TCP otherwise, and it does so
silently; ``protocol`` mostly picks the memory allocator. On a host with RDMA NICs, set
``MC_FORCE_TCP=1`` in the environment before ``start`` to get TCP anyway. Other knobs the wheel
reads: ``MC_TRANSFER_TIMEOUT`` (s, its own sync-call timeout),
``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` and ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` (see
below), ``MC_LOG_LEVEL``.

Data path: one-entry native batches, submitted in a worker thread and polled with sleeps.
* ``batch_transfer_async_write`` submits fine, but its only completion call,
  ``get_batch_transfer_status([id])``, is not a poll: it spins on a CPU (GIL released) until the
  whole batch completes, fails or times out (30 s + 1 ns/byte), frees the batch and returns ``0`` or
  ``-1``; after a failure it returns at once while the batch's other entries may still be in flight.
  Neither "poll with sleeps" nor "drain before reporting the failure" can be built on it.
* ``transfer_check_status(id)`` is a real non-blocking poll (``0`` pending, ``1`` done, ``-1``
  failed, ``-2`` timed out) but looks at entry 0 only and frees the batch once that entry ends, so
  it is only correct for one-entry batches (never on multi-entry ones).
* Hence each ``Entry`` is one ``transfer_submit_write`` (a one-entry batch), the entries of a batch
  of at most 1024 are submitted together in a worker thread (the first contact with a peer
  handshakes, and reconnecting to a dead one can block ~1 s), and the event loop polls them with
  ``transfer_check_status``: plain yields for the first 200 us, then sleeps of 50 us doubling to
  1 ms (``asyncio.sleep`` below ~1 ms lasts ~1.1 ms anyway: epoll's granularity). Each entry's own
  status is known, so after a failure ``write`` waits until no entry is pending before it raises.
  Measured on a 2-core VM over loopback (``bench/transfer/engine.py``), 64 MiB of 4 KiB pages one
  per entry: 0.16-0.19 GB/s at 31-36 us of process CPU per entry, against 0.13-0.15 GB/s and
  50-54 us for ``batch_transfer_sync_write`` (async submit + ``get_batch_transfer_status``: the
  same as sync); coalesced into 256 KiB or larger entries, 2.3-3.2 GB/s against 2.5-2.7 GB/s. A
  one-page ``write`` takes ~0.1 ms (p50).

Limits. The TCP transport queues transfers per peer; beyond ~2048 queued entries it rejects whole
submissions and can stay wedged (observed: 3000 entries submitted at once left 1024 pending forever
and every later write to that peer failed after 1 s, for minutes). ``MooncakeEngine`` therefore
keeps at most ``max_in_flight`` (default 1024) entries in flight per peer session, across
concurrent writes, in batches of at most ``MAX_ENTRIES_PER_BATCH``. To allow more, raise
``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` and ``max_in_flight`` together, deliberately. CPU cost is
~30 us per TCP entry: coalesce runs of pages (``page_layout``).

Errors. Every failure is an ``EngineError`` whose ``op`` is the ``TransferEngine`` method
(``start``, ``register``, ``unregister``, ``write``) and whose ``code`` is the native return code or
one of ``CODE_FAILED`` (-1), ``CODE_TIMEOUT`` (-2) and ``CODE_UNDRAINED`` (-3: the write failed and
some entries were still in flight when ``write`` gave up waiting, so the destination pages must
not be reused); each is logged at WARNING with its context. Native codes seen: register overlap
``-7``, zero length ``-1``; unregister of an unknown address ``-3``.

Other quirks of 0.3.13.post1: ``initialize`` returns 0 even for an unroutable host or an unknown
protocol; writes from an unregistered *local* source succeed over TCP (after ~1 s), so sources are
checked here against our own registrations; destroying an engine takes ~1 s *with the GIL held*,
so ``close`` stalls the whole process (event loop included) for that second even from a worker
thread: close engines at shutdown, not on a hot path; the native logs (glog) go to stderr; several
engines can live in one process.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from transfer.closing import AsyncClosing
from transfer.engine.mooncake_batch import (
    CODE_FAILED,
    CODE_TIMEOUT,
    CODE_UNDRAINED,
    NativeBatch,
    PeerBudget,
)
from transfer.engine.regions import RegionTable
from transfer.errors import EngineError
from transfer.page_layout import MAX_ENTRIES_PER_BATCH, Entry, batches, total_bytes

__all__ = ["CODE_FAILED", "CODE_TIMEOUT", "CODE_UNDRAINED", "MooncakeEngine"]

logger = logging.getLogger(__name__)

# transfer_submit_write returns batch id 0 when it cannot submit; older bindings returned -1, which
# pybind casts to 2**64 - 1. Both are sentinels, never pointers: never poll them.
_REFUSED_IDS = frozenset({0, 2**64 - 1})
_SPIN_S = 200e-6
_FIRST_SLEEP_S = 50e-6
_MAX_SLEEP_S = 1e-3
_REAP_SLEEP_S = 0.1
_SECONDS_PER_BYTE = 1e-9  # the deadline grows by 1 s per GB, as Mooncake's own sync calls do


class _Native(Protocol):
    """The part of ``mooncake.engine.TransferEngine`` (an untyped pybind11 class) used here."""

    def initialize(self, host: str, metadata: str, protocol: str, device: str, /) -> int: ...

    def get_rpc_port(self) -> int: ...

    def register_memory(self, ptr: int, length: int, /) -> int: ...

    def unregister_memory(self, ptr: int, /) -> int: ...

    def transfer_submit_write(self, session: str, src: int, dst: int, length: int, /) -> int: ...

    def transfer_check_status(self, batch_id: int, /) -> int: ...


def _load_native() -> Callable[[], _Native]:
    try:
        module = importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise ImportError(
            "the Mooncake transfer engine is missing: pip install "
            "mooncake-transfer-engine-non-cuda (it needs Debian's libibverbs1 librdmacm1 libnuma1)"
        ) from exc
    factory: Callable[[], _Native] = module.TransferEngine
    return factory


def _initialize(
    factory: Callable[[], _Native], host: str, protocol: str, device: str
) -> tuple[_Native, int]:
    native = factory()
    return native, native.initialize(host, "P2PHANDSHAKE", protocol, device)


def _submit(native: _Native, session: str, entries: Sequence[Entry]) -> list[int]:
    """Submit one one-entry batch per entry (worker thread); stop at the first refusal."""
    ids: list[int] = []
    for entry in entries:
        batch_id = native.transfer_submit_write(session, entry.src, entry.dst, entry.length)
        if batch_id in _REFUSED_IDS or batch_id < 0:
            break
        ids.append(batch_id)
    return ids


def _fail(op: str, code: int, detail: str) -> EngineError:
    error = EngineError(op, code, detail=detail)
    logger.warning("%s", error)
    return error


class MooncakeEngine(AsyncClosing):
    """A Mooncake ``TransferEngine`` behind the ``transfer.engine.base.TransferEngine`` contract.

    Build with ``await MooncakeEngine.start(...)``. ``write`` never blocks the event loop: native
    submissions run in the engine's worker threads, completions are polled with short sleeps. A
    cancelled ``write`` stops waiting, but its entries stay accounted for (and count against the
    peer's in-flight limit) until they end. Use ``async with`` or ``close()``.
    """

    def __init__(
        self,
        native: _Native,
        session_id: str,
        pool: ThreadPoolExecutor,
        *,
        write_timeout_s: float,
        drain_timeout_s: float,
        max_in_flight: int,
    ) -> None:
        self._native: _Native | None = native
        self._session_id = session_id
        self._pool = pool
        self._write_timeout_s = write_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self._max_in_flight = max_in_flight
        self._regions = RegionTable()
        self._budgets: dict[str, PeerBudget] = {}
        self._jobs: set[asyncio.Task[None]] = set()
        self._unaccounted = 0  # entries that may still be in flight after close gave up on them

    @classmethod
    async def start(
        cls,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        *,
        init_timeout_s: float = 60.0,
        write_timeout_s: float = 30.0,
        drain_timeout_s: float = 5.0,
        max_in_flight: int = MAX_ENTRIES_PER_BATCH,
        threads: int = 4,
    ) -> MooncakeEngine:
        """Create and initialise a native engine listening on ``host`` (in a worker thread).

        ``write_timeout_s`` bounds each batch of a ``write`` (plus 1 s per GB), ``drain_timeout_s``
        how long a failed batch may take to drain. Raises ``EngineError`` (op ``start``) when
        ``initialize`` fails or takes longer than ``init_timeout_s``, ``ImportError`` without the
        wheel.
        """
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        factory = _load_native()
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mooncake")
        loop = asyncio.get_running_loop()
        init = loop.run_in_executor(pool, _initialize, factory, host, protocol, device)
        try:
            native, rc = await asyncio.wait_for(init, init_timeout_s)
        except TimeoutError:
            pool.shutdown(wait=False)
            raise _fail(
                "start",
                CODE_TIMEOUT,
                f"initialize({host!r}, {protocol!r}, {device!r}) took over {init_timeout_s:g} s",
            ) from None
        if rc != 0:
            holder = [native]
            del native, init
            pool.submit(holder.clear)  # the native destructor takes ~1 s: not on the loop
            pool.shutdown(wait=False)
            raise _fail("start", rc, f"initialize({host!r}, {protocol!r}, {device!r})")
        return cls(
            native,
            f"{host}:{native.get_rpc_port()}",
            pool,
            write_timeout_s=write_timeout_s,
            drain_timeout_s=drain_timeout_s,
            max_in_flight=max_in_flight,
        )

    @property
    def session_id(self) -> str:
        return self._session_id

    def in_flight(self, session: str) -> int:
        """Entries this engine has in flight to ``session`` right now."""
        budget = self._budgets.get(session)
        return budget.in_flight if budget else 0

    def register(self, ptr: int, length: int) -> None:
        """Register ``[ptr, ptr + length)`` for transfers; ``EngineError`` on a non-zero code."""
        rc = self._open("register").register_memory(ptr, length)
        if rc != 0:
            raise _fail("register", rc, f"region [{ptr:#x}, +{length})")
        self._regions.add(ptr, length)

    def unregister(self, ptr: int) -> None:
        """Unregister the region starting at ``ptr``; ``EngineError`` on a non-zero code."""
        rc = self._open("unregister").unregister_memory(ptr)
        if rc != 0:
            raise _fail("unregister", rc, f"region at {ptr:#x}")
        self._regions.remove(ptr)

    async def write(self, session: str, entries: Sequence[Entry]) -> None:
        """Write ``entries`` into ``session``'s memory, batch by batch; see the module docstring.

        Raises ``ValueError`` for an entry shorter than 1 byte and ``EngineError`` (op ``write``)
        for an unregistered source, a refused submission, a failed entry or a deadline; a failed
        batch drains (bounded by ``drain_timeout_s``) before the error is raised.
        """
        native = self._open("write")
        self._check_sources(entries)
        budget = self._budgets.setdefault(session, PeerBudget(self._max_in_flight))
        size = min(self._max_in_flight, MAX_ENTRIES_PER_BATCH)
        for batch in batches(entries, size) if entries else ():
            await self._write_batch(native, session, NativeBatch(batch), budget)
            native = self._open("write")

    async def aclose(self) -> None:
        await self.close()

    async def close(self) -> None:
        """Release the native engine; later calls raise ``EngineError``. Idempotent.

        Waits up to ``drain_timeout_s`` for entries still in flight. If some never end, the native
        engine is deliberately leaked rather than destroyed under them.
        """
        native, self._native = self._native, None
        if native is None:
            return
        if self._jobs:
            _, stuck = await asyncio.wait(set(self._jobs), timeout=self._drain_timeout_s)
            for job in stuck:
                job.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        if self._unaccounted:
            logger.warning(
                "closing %s with %d entries possibly in flight: leaking the native engine",
                self._session_id,
                self._unaccounted,
            )
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(native))
        else:
            holder = [native]
            del native
            await asyncio.get_running_loop().run_in_executor(self._pool, holder.clear)
        self._pool.shutdown(wait=False)

    def _open(self, op: str) -> _Native:
        if self._native is None:
            raise _fail(op, CODE_FAILED, f"engine {self._session_id} is closed")
        return self._native

    def _check_sources(self, entries: Sequence[Entry]) -> None:
        for entry in entries:
            if entry.length < 1:
                raise ValueError(f"entry {entry} has length < 1")
            if not self._regions.contains(entry.src, entry.length):
                raise _fail(
                    "write",
                    CODE_FAILED,
                    f"source [{entry.src:#x}, +{entry.length}) is not inside a registered region",
                )

    async def _write_batch(
        self, native: _Native, session: str, batch: NativeBatch, budget: PeerBudget
    ) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self._write_timeout_s + total_bytes(batch.entries) * _SECONDS_PER_BYTE
        try:
            async with asyncio.timeout_at(deadline):
                await budget.acquire(len(batch.entries))
        except TimeoutError:
            raise _fail(
                "write",
                CODE_TIMEOUT,
                f"session {session}: {budget.in_flight} entries "
                f"still in flight after {loop.time() - start:.3f} s",
            ) from None
        if self._native is None:  # closed while this batch waited for room
            budget.release(len(batch.entries))
            native = self._open("write")
        settled: asyncio.Future[None] = loop.create_future()
        job = asyncio.create_task(self._run(native, session, batch, deadline, budget, settled))
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        await asyncio.shield(settled)
        if not batch.ok:
            raise _fail("write", batch.code(), batch.describe(session, loop.time() - start))

    async def _run(
        self,
        native: _Native,
        session: str,
        batch: NativeBatch,
        deadline: float,
        budget: PeerBudget,
        settled: asyncio.Future[None],
    ) -> None:
        """Submit, poll, drain on failure, then settle; keep reaping entries that never end."""
        loop = asyncio.get_running_loop()
        try:
            batch.ids = await loop.run_in_executor(
                self._pool, _submit, native, session, batch.entries
            )
            batch.codes = [0] * len(batch.ids)
            batch.submitted = True
            budget.release(len(batch.entries) - len(batch.ids))
            await self._poll(native, batch, budget, deadline, stop_on_failure=True)
            if batch.pending:  # failed or late: drain before reporting, so pages may be reused
                await self._poll(native, batch, budget, loop.time() + self._drain_timeout_s)
            settled.set_result(None)
            await self._poll(native, batch, budget, math.inf, max_sleep=_REAP_SLEEP_S)
        except asyncio.CancelledError:
            batch.interrupted = True
            self._unaccounted += batch.pending if batch.submitted else len(batch.entries)
            raise
        finally:
            if not settled.done():
                settled.set_result(None)

    async def _poll(
        self,
        native: _Native,
        batch: NativeBatch,
        budget: PeerBudget,
        deadline: float,
        *,
        stop_on_failure: bool = False,
        max_sleep: float = _MAX_SLEEP_S,
    ) -> None:
        """Poll till nothing is pending, ``deadline`` (loop time) passes or, if asked, a failure."""
        loop = asyncio.get_running_loop()
        spin_until = loop.time() + _SPIN_S
        sleep = _FIRST_SLEEP_S
        while True:
            budget.release(batch.sweep(native))
            now = loop.time()
            failed = stop_on_failure and (batch.failures or batch.refused)
            if not batch.pending or now >= deadline or failed:
                return
            if now < spin_until:
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(min(sleep, deadline - now))
                sleep = min(sleep * 2, max_sleep)
