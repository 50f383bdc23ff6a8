"""vLLM Mooncake's prefill rank table, one per namespace, kept in the registry store.

vLLM 0.32's semantics (docs/concepts/protocols.md 3.2): idempotent re-registration and the two
refusals
("Engine ID mismatch ..." and "Worker ... is already registered at ...", ``Conflict``, answered
400). One namespace is one prefill instance (docs/concepts/protocols.md 3.6).

Restart rule (our design; vLLM's own server dies with its prefill, ours outlives it): each
namespace holds an *epoch*, an int kept in the store. A registration bringing a new
``engine_id`` for a ``dp_rank`` while the current table is complete is a restarted prefill: the
epoch grows by one, the old table is dropped, and the registration is accepted. While the table is
incomplete, the same registration is vLLM's 400 mismatch (two engines fighting over one rank
during start-up). A new ``addr`` under the *same* ``engine_id`` stays vLLM's 400 even on a
complete table: decoders cache addresses per ``engine_id`` forever, so a prefill restarted with a
fixed engine id would be served stale addresses; let ``engine_id`` default to a uuid.
``reset()`` starts an empty epoch by hand (the way out of a table stuck half-registered).

Completeness: vLLM's ``/register`` carries no sizes. With the expected ``tp_size``/``pp_size``
given, a dp rank is complete once all tp x pp ranks registered; without them, once its (tp, pp)
pairs fill the rectangle [0..max_tp] x [0..max_pp] (a heuristic: a rank still starting up beyond
the maxima goes unnoticed). The table is complete when dp ranks 0..dp_size-1 (``dp_size``, or
max dp rank + 1) all are. ``query()`` lists only complete dp ranks, because decoders size the
remote TP from ``len(worker_addr)``. Ranks outside the given sizes, and negative ranks, are 400.

The store seam has no transactions: routers sharing one store may both accept registrations that
race for one dp rank; such a dp rank (two engine ids) never counts as complete.

Store outages (``registry.engine_api.last_good``): ``query``, ``snapshot`` and ``address_of``
answer from the last table read (or written) here while the store is unavailable;
``register`` and ``reset`` answer ``RegistryUnavailable`` (503: engines retry).

Store keys, under ``bootstrap/vllm/<namespace>/``: ``epoch`` and ``workers/<epoch>/<dp>/<tp>/<pp>``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgspec

from registry.backends.base import RegistryStore
from registry.engine_api.last_good import LastGoodStore
from registry.engine_api.namespaces import DEFAULT_NAMESPACE, check_namespace
from registry.engine_api.vllm_payloads import EngineEntry, RegisterWorkerPayload
from registry.errors import Conflict, RegistryUnavailable

__all__ = ["KEY_ROOT", "LAYOUT_KEYS", "VllmRankSnapshot", "VllmRankTable"]

logger = logging.getLogger(__name__)

KEY_ROOT = "bootstrap/vllm/"
_EPOCH_KEY, _WORKERS = "epoch", "workers/"  # under a namespace
LAYOUT_KEYS = (_EPOCH_KEY, _WORKERS)  # every key of a namespace's table


@dataclass(frozen=True, slots=True)
class VllmRankSnapshot:
    """What the router needs: ``engine_ids[dp]`` is dp rank ``dp``'s engine id once complete.

    ``dp_size`` is the configured size, else the highest registered dp rank + 1 (0 when empty).
    """

    dp_size: int
    engine_ids: tuple[str | None, ...]
    epoch: int
    complete: bool


class _WorkerRecord(msgspec.Struct, frozen=True):
    engine_id: str
    addr: str


@dataclass(slots=True)
class _DpEntry:
    engine_ids: set[str] = field(default_factory=set)
    workers: dict[tuple[int, int], str] = field(default_factory=dict)  # (tp, pp) -> addr

    def expected(self) -> str:
        return ", ".join(sorted(self.engine_ids))


class VllmRankTable:
    """One namespace's vLLM Mooncake rank table (one prefill instance), kept in a store.

    Sizes are optional (see the module notes on completeness). Reads answer from the last known
    table while the store is unavailable (``last_good``); a failure they cannot cover, and every
    failed write, surfaces as ``RegistryUnavailable``; refused registrations as ``Conflict``
    (answered 400).
    """

    def __init__(
        self,
        store: RegistryStore,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        tp_size: int | None = None,
        pp_size: int | None = None,
        dp_size: int | None = None,
    ) -> None:
        for name, size in (("tp_size", tp_size), ("pp_size", pp_size), ("dp_size", dp_size)):
            if size is not None and size < 1:
                raise ValueError(f"{name} must be >= 1, got {size}")
        self._namespace = check_namespace(namespace)
        self._store = LastGoodStore(store, f"vllm namespace {namespace!r}")
        self._root = f"{KEY_ROOT}{namespace}/"
        self._sizes = (dp_size, tp_size, pp_size)
        self._lock = asyncio.Lock()  # serializes this process's check-then-write

    @property
    def namespace(self) -> str:
        return self._namespace

    async def register(self, payload: RegisterWorkerPayload, *, replace: bool = False) -> None:
        """vLLM's ``register_worker`` plus the restart rule; raises ``Conflict`` when refused.

        ``replace``: the registration guard found a squatter on this rank (``rank_checks``):
        its dp rank's entries of another engine, and the entry at this rank, are dropped first.
        """
        self._check_ranges(payload)
        async with self._lock:
            epoch = await self.epoch()
            table = await self._table(epoch)
            if replace:
                table = await self._evict(epoch, table, payload)
            entry = table.get(payload.dp_rank)
            if entry is not None and payload.engine_id not in entry.engine_ids:
                if not self._complete(table):
                    raise Conflict(
                        f"Engine ID mismatch for dp_rank={payload.dp_rank}: "
                        f"expected {entry.expected()}, got {payload.engine_id}"
                    )
                epoch = await self._restart(epoch, payload)
                entry = None
            if entry is not None and self._known(entry, payload):
                return
            worker = _WorkerRecord(payload.engine_id, payload.addr)
            await self._store.put(self._worker_key(epoch, payload), msgspec.json.encode(worker))
        logger.debug(
            "vllm bootstrap %s: engine_id=%s dp=%d tp=%d pp=%d at %s",
            self._namespace,
            payload.engine_id,
            payload.dp_rank,
            payload.tp_rank,
            payload.pp_rank,
            payload.addr,
        )

    async def address_of(self, dp_rank: int, tp_rank: int, pp_rank: int) -> str | None:
        """The address registered for one rank in the current epoch, or None."""
        key = f"{self._workers_prefix(await self.epoch())}{dp_rank}/{tp_rank}/{pp_rank}"
        raw = await self._store.get(key)
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=_WorkerRecord).addr
        except msgspec.MsgspecError:
            return None

    async def query(self) -> dict[str, EngineEntry]:
        """``GET /query``: the complete dp ranks, ``{dp: {engine_id, worker_addr}}``."""
        table = await self._table(await self.epoch())
        return {
            str(dp): _engine_entry(entry)
            for dp, entry in sorted(table.items())
            if self._dp_complete(entry)
        }

    async def snapshot(self) -> VllmRankSnapshot:
        """The dp ranks for the router: engine ids by dp rank (None until a rank is complete)."""
        epoch = await self.epoch()
        table = await self._table(epoch)
        dp_size = self._dp_size(table)
        ids = tuple(
            _engine_id(table.get(dp)) if self._dp_complete(table.get(dp)) else None
            for dp in range(dp_size)
        )
        return VllmRankSnapshot(dp_size, ids, epoch, self._complete(table))

    async def epoch(self) -> int:
        """The namespace's current epoch (0 until the first restart)."""
        raw = await self._store.get(self._epoch_key())
        return int(raw) if raw is not None and raw.isdigit() else 0

    async def reset(self) -> None:
        """Start a new, empty epoch (drops the table)."""
        async with self._lock:
            await self._advance(await self.epoch())

    def _check_ranges(self, payload: RegisterWorkerPayload) -> None:
        ranks = (payload.dp_rank, payload.tp_rank, payload.pp_rank)
        for name, rank, size in zip(("dp", "tp", "pp"), ranks, self._sizes, strict=True):
            if rank < 0 or (size is not None and rank >= size):
                limit = "" if size is None else f" < {name}_size={size}"
                raise Conflict(f"Invalid {name}_rank={rank}: must be >= 0{limit}")

    async def _evict(
        self, epoch: int, table: dict[int, _DpEntry], payload: RegisterWorkerPayload
    ) -> dict[int, _DpEntry]:
        """Drop the squatter's entries in ``payload``'s dp rank; the table as it is then."""
        prefix = f"{self._workers_prefix(epoch)}{payload.dp_rank}/"
        for key, raw in (await self._store.list(prefix)).items():
            parsed = _parse_worker(key.removeprefix(self._workers_prefix(epoch)), raw)
            if parsed is None:
                continue
            (_, tp, pp), worker = parsed
            if worker.engine_id != payload.engine_id or (tp, pp) == (
                payload.tp_rank,
                payload.pp_rank,
            ):
                logger.warning(
                    "vllm bootstrap %s: dropping engine %s's rank dp=%d tp=%d pp=%d at %s "
                    "(a squatter)",
                    self._namespace,
                    worker.engine_id,
                    payload.dp_rank,
                    tp,
                    pp,
                    worker.addr,
                )
                await self._store.delete(key)
        return await self._table(epoch)

    def _known(self, entry: _DpEntry, payload: RegisterWorkerPayload) -> bool:
        """True for an idempotent retry; raises for the same rank at another address."""
        existing = entry.workers.get((payload.tp_rank, payload.pp_rank))
        if existing is None:
            return False
        if existing == payload.addr:
            return True
        raise Conflict(
            f"Worker with dp_rank={payload.dp_rank}, tp_rank={payload.tp_rank}, "
            f"pp_rank={payload.pp_rank} is already registered at {existing}, "
            f"but still want to register at {payload.addr}"
        )

    async def _restart(self, epoch: int, payload: RegisterWorkerPayload) -> int:
        logger.warning(
            "vllm bootstrap %s: dp_rank=%d re-registers as engine %s on a complete "
            "table: prefill restarted, epoch %d -> %d",
            self._namespace,
            payload.dp_rank,
            payload.engine_id,
            epoch,
            epoch + 1,
        )
        return await self._advance(epoch)

    async def _advance(self, epoch: int) -> int:
        """Make ``epoch + 1`` current and drop ``epoch``'s table."""
        await self._store.put(self._epoch_key(), str(epoch + 1).encode())
        await self._drop(epoch)
        return epoch + 1

    async def _drop(self, epoch: int) -> None:
        """Best effort: an old epoch's keys are invisible anyway."""
        try:
            for key in await self._store.list(self._workers_prefix(epoch)):
                await self._store.delete(key)
        except RegistryUnavailable as exc:
            logger.warning("vllm bootstrap %s: old workers left behind: %s", self._namespace, exc)

    async def _table(self, epoch: int) -> dict[int, _DpEntry]:
        prefix = self._workers_prefix(epoch)
        table: dict[int, _DpEntry] = {}
        for key, raw in (await self._store.list(prefix)).items():
            parsed = _parse_worker(key.removeprefix(prefix), raw)
            if parsed is None:
                logger.warning("vllm bootstrap %s: unreadable key %s", self._namespace, key)
                continue
            (dp, tp, pp), worker = parsed
            entry = table.setdefault(dp, _DpEntry())
            entry.engine_ids.add(worker.engine_id)
            entry.workers[tp, pp] = worker.addr
        return table

    def _dp_complete(self, entry: _DpEntry | None) -> bool:
        if entry is None or len(entry.engine_ids) != 1 or not entry.workers:
            return False
        _, tp_size, pp_size = self._sizes
        tp_n = tp_size or max(tp for tp, _ in entry.workers) + 1
        pp_n = pp_size or max(pp for _, pp in entry.workers) + 1
        return all((tp, pp) in entry.workers for tp in range(tp_n) for pp in range(pp_n))

    def _dp_size(self, table: dict[int, _DpEntry]) -> int:
        configured = self._sizes[0]
        if configured is not None:
            return configured
        return max(table) + 1 if table else 0

    def _complete(self, table: dict[int, _DpEntry]) -> bool:
        dp_size = self._dp_size(table)
        return dp_size > 0 and all(self._dp_complete(table.get(dp)) for dp in range(dp_size))

    def _epoch_key(self) -> str:
        return self._root + _EPOCH_KEY

    def _workers_prefix(self, epoch: int) -> str:
        return f"{self._root}{_WORKERS}{epoch}/"

    def _worker_key(self, epoch: int, payload: RegisterWorkerPayload) -> str:
        ranks = (payload.dp_rank, payload.tp_rank, payload.pp_rank)
        return self._workers_prefix(epoch) + "/".join(str(rank) for rank in ranks)


def _parse_worker(suffix: str, raw: bytes) -> tuple[tuple[int, int, int], _WorkerRecord] | None:
    parts = suffix.split("/")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    try:
        worker = msgspec.json.decode(raw, type=_WorkerRecord)
    except msgspec.MsgspecError:
        return None
    dp, tp, pp = (int(part) for part in parts)
    return (dp, tp, pp), worker


def _engine_id(entry: _DpEntry | None) -> str | None:
    return None if entry is None else next(iter(entry.engine_ids), None)


def _engine_entry(entry: _DpEntry) -> EngineEntry:
    worker_addr: dict[str, dict[str, str]] = {}
    for (tp, pp), addr in sorted(entry.workers.items()):
        worker_addr.setdefault(str(tp), {})[str(pp)] = addr
    return EngineEntry(engine_id=entry.expected(), worker_addr=worker_addr)
