"""SGLang's prefill rank table, one per namespace, kept in the registry store.

Ranks land in one table ``[dp][cp][tp][pp]`` per namespace (one prefill instance). Decisions
beyond the engines' own behaviour:

* Rank entries may carry a lease (``rank_ttl``): a registering process keeps its rank alive by
  re-sending the same ``PUT /route`` (a heartbeat) more often than the ttl. ``None`` (the default,
  like the engines' in-memory table) keeps ranks until the table is replaced.
* One namespace holds one ``ParallelConfig`` (sizes, page size, kv dtype, ...). A registration
  with a different one replaces the table (a new generation; old ranks are dropped) when the
  current table is complete or empty: a restarted, re-configured prefill. While it is partly
  registered, the mismatch is ``Conflict`` (400): two differently configured processes fight over
  one namespace.
* ``SglangParallelInfo.complete`` only once every dp x cp x tp x pp rank is registered; the routes
  answer the parallel-info query 503 until then.
* The 0.5.10+ parallel info carries the version-specific ``PrefillServerInfo`` fields only when
  the prefill sent them (``SglangParallelInfo.extras``). Early 0.5.10+ releases have no
  decode-side ``target_*`` fields: serve those with ``server_info_decode_fields=False``.
* The store seam has no transactions: routers sharing one store resolve concurrent configuration
  changes by last writer wins; ordinary registrations touch disjoint keys.
* Store outages (``registry.engine_api.last_good``): the reads (parallel info, rank addresses,
  ``query_dp_ranks``) answer from the last table read or written here while the store is
  unavailable. Rank registrations (``PUT /route``) answer ``RegistryUnavailable`` (503: engines
  retry). A ``register_dp_rank`` the store refuses is kept in this process for ``room_ttl`` and
  answered by ``query_dp_ranks`` (a room is short-lived and its decode asks this same port); it
  is never written back. Meanwhile ``query_dp_ranks`` leaves out rooms this process never saw
  (as for rooms not registered yet) instead of failing the rooms it knows.

Store keys, under ``bootstrap/sglang/<namespace>/`` (kept as older routers wrote them):
``layout`` (the generation and its parallel configuration),
``ranks/<generation>/<dp>/<cp>/<tp>/<pp>`` and ``rooms/<room>``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from pydantic import JsonValue

from registry.backends.base import RegistryStore
from registry.engine_api.last_good import LastGoodStore
from registry.engine_api.namespaces import DEFAULT_NAMESPACE, check_namespace
from registry.engine_api.sglang_payloads import (
    Coords,
    ParallelConfig,
    RankAddress,
    RankRegistration,
    parse_route_payload,
)
from registry.errors import Conflict, RegistryUnavailable

__all__ = ["KEY_ROOT", "LAYOUT_KEYS", "ROOM_TTL_S", "SglangParallelInfo", "SglangRankTable"]

logger = logging.getLogger(__name__)

KEY_ROOT = "bootstrap/sglang/"
_CONFIG_KEY, _RANKS = "layout", "ranks/"  # under a namespace (the names older routers wrote)
LAYOUT_KEYS = (_CONFIG_KEY, _RANKS)  # what a namespace's layout is read from (not its rooms)
ROOM_TTL_S = 120.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SglangParallelInfo:
    """A namespace's parallel configuration as registered; ``complete`` once all ranks are in."""

    dp_size: int
    tp_size: int  # attention TP size per DP group
    pp_size: int
    cp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    registered: int
    complete: bool
    extras: Mapping[str, JsonValue] = field(default_factory=dict)


class _ParallelConfigRecord(msgspec.Struct, frozen=True):
    """The current generation and its configuration; the JSON name ``layout`` is the stored one."""

    generation: int
    config: ParallelConfig | None = msgspec.field(default=None, name="layout")  # None: reset()


class _RankRecord(msgspec.Struct, frozen=True):
    rank_ip: str
    rank_port: int


class SglangRankTable:
    """One namespace's SGLang rank table (one prefill instance), kept in a store.

    Safe to use from several routers over one shared store (see the module notes on races).
    Reads answer from the last known table while the store is unavailable (see the module notes
    on outages); other store failures surface as ``RegistryUnavailable``.
    """

    def __init__(
        self,
        store: RegistryStore,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        rank_ttl: float | None = None,
        room_ttl: float = ROOM_TTL_S,
        server_info_decode_fields: bool = True,
    ) -> None:
        self._namespace = check_namespace(namespace)
        self._store = LastGoodStore(store, f"sglang namespace {namespace!r}")
        self._root = f"{KEY_ROOT}{namespace}/"
        self._rank_ttl = rank_ttl
        self._room_ttl = room_ttl
        self._decode_fields = server_info_decode_fields
        self._lock = asyncio.Lock()  # serializes this process's configuration changes

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def server_info_decode_fields(self) -> bool:
        """Whether the 0.5.10+ parallel info carries the decode-side null fields."""
        return self._decode_fields

    async def register(self, payload: object) -> bool:
        """Store one ``PUT /route`` body; False when it was ignored (a non-prefill role).

        Raises ``BadEngineApiRequest`` for an invalid body and ``Conflict`` for a configuration
        that contradicts a partly registered table. Re-sending the same body refreshes the rank's
        lease.
        """
        return await self.register_rank(parse_route_payload(payload))

    async def register_rank(
        self, registration: RankRegistration | None, *, replace: bool = False
    ) -> bool:
        """``register`` for a body already parsed (``parse_route_payload``; None: ignored).

        ``replace``: the registration guard found a squatter on this rank (``rank_checks``); a
        configuration that contradicts the partly registered table then starts a new
        generation instead of being a ``Conflict``."""
        if registration is None:
            logger.debug("sglang bootstrap %s: non-prefill registration ignored", self._namespace)
            return False
        async with self._lock:
            generation = await self._generation_for(registration.config, replace)
            rank = _RankRecord(registration.address.rank_ip, registration.address.rank_port)
            key = self._rank_key(generation, registration.coords)
            await self._store.put(key, msgspec.json.encode(rank), ttl=self._rank_ttl)
        logger.debug(
            "sglang bootstrap %s: rank %s at %s:%d",
            self._namespace,
            registration.coords,
            rank.rank_ip,
            rank.rank_port,
        )
        return True

    async def parallel_info(self) -> SglangParallelInfo | None:
        """The registered configuration and how much of it is present; None before any."""
        record = await self._record()
        if record is None or record.config is None:
            return None
        config = record.config
        present = _in_range(config, await self._rank_coords(record.generation))
        return SglangParallelInfo(
            dp_size=config.dp_size,
            tp_size=config.tp_size,
            pp_size=config.pp_size,
            cp_size=config.cp_size,
            page_size=config.page_size,
            kv_cache_dtype=config.kv_cache_dtype,
            follow_bootstrap_room=config.follow_bootstrap_room,
            registered=len(present),
            complete=len(present) == config.expected(),
            extras=dict(config.extras),
        )

    async def rank_address(self, dp: int, tp: int, pp: int, cp: int = 0) -> RankAddress | None:
        """One registered rank's address, or None."""
        record = await self._record()
        if record is None:
            return None
        raw = await self._store.get(self._rank_key(record.generation, (dp, cp, tp, pp)))
        rank = _decode(raw, _RankRecord)
        return None if rank is None else RankAddress(rank.rank_ip, rank.rank_port)

    async def dp_size(self) -> int | None:
        """The registered configuration's DP size; None before any."""
        record = await self._record()
        return None if record is None or record.config is None else record.config.dp_size

    async def register_dp_rank(self, room: int, dp_rank: int) -> None:
        """Remember which prefill DP rank serves ``room``, for ``room_ttl`` seconds."""
        key, value = self._room_key(room), str(dp_rank).encode()
        try:
            await self._store.put(key, value, ttl=self._room_ttl)
        except RegistryUnavailable:
            self._store.accept_locally(key, value, self._room_ttl)

    async def query_dp_ranks(self, rooms: Iterable[int]) -> dict[str, int]:
        """``{"<room>": dp_rank}`` for the rooms registered (and not expired)."""
        wanted = list(dict.fromkeys(rooms))
        values = await asyncio.gather(*(self._room(room) for room in wanted))
        pairs = zip(wanted, values, strict=True)
        return {str(room): int(raw) for room, raw in pairs if raw is not None and raw.isdigit()}

    async def _room(self, room: int) -> bytes | None:
        """A room's DP rank; None when unknown, also while the store is down and this process
        has not seen the room (the decode asks again, as for a room not registered yet)."""
        try:
            return await self._store.get(self._room_key(room), keep_s=self._room_ttl)
        except RegistryUnavailable:
            return None

    async def reset(self) -> None:
        """Forget the configuration and every rank (an operator's way out of a stuck table)."""
        async with self._lock:
            record = await self._record()
            generation = 0 if record is None else record.generation + 1
            await self._store.put(self._config_key(), _encode(_ParallelConfigRecord(generation)))
            if record is not None:
                await self._drop(record.generation)

    async def _generation_for(self, config: ParallelConfig, replace: bool = False) -> int:
        record = await self._record()
        if record is None:
            return await self._start(_ParallelConfigRecord(0, config), drop=None)
        if record.config is None:
            return await self._start(_ParallelConfigRecord(record.generation, config), drop=None)
        if record.config == config:
            return record.generation
        current = record.config
        present = _in_range(current, await self._rank_coords(record.generation))
        if present and len(present) < current.expected() and not replace:
            raise Conflict(
                f"Bootstrap registration ({config.describe()}) does not match the layout being "
                f"registered in namespace {self._namespace!r} ({current.describe()}; "
                f"{len(present)} of {current.expected()} ranks registered)"
            )
        logger.warning(
            "sglang bootstrap %s: layout changed from (%s) to (%s); dropping old ranks",
            self._namespace,
            current.describe(),
            config.describe(),
        )
        next_record = _ParallelConfigRecord(record.generation + 1, config)
        return await self._start(next_record, drop=record.generation)

    async def _start(self, record: _ParallelConfigRecord, drop: int | None) -> int:
        await self._store.put(self._config_key(), _encode(record))
        if drop is not None:
            await self._drop(drop)
        return record.generation

    async def _drop(self, generation: int) -> None:
        """Best effort: an old generation's keys are invisible anyway (and expire with a ttl)."""
        try:
            for key in await self._store.list(self._ranks_prefix(generation)):
                await self._store.delete(key)
        except RegistryUnavailable as exc:
            logger.warning("sglang bootstrap %s: old ranks left behind: %s", self._namespace, exc)

    async def _record(self) -> _ParallelConfigRecord | None:
        return _decode(await self._store.get(self._config_key()), _ParallelConfigRecord)

    async def _rank_coords(self, generation: int) -> set[Coords]:
        prefix = self._ranks_prefix(generation)
        keys = await self._store.list(prefix)
        return {c for c in (_parse_coords(k.removeprefix(prefix)) for k in keys) if c is not None}

    def _config_key(self) -> str:
        return self._root + _CONFIG_KEY

    def _ranks_prefix(self, generation: int) -> str:
        return f"{self._root}{_RANKS}{generation}/"

    def _rank_key(self, generation: int, coords: Coords) -> str:
        return self._ranks_prefix(generation) + "/".join(str(c) for c in coords)

    def _room_key(self, room: int) -> str:
        return f"{self._root}rooms/{room}"


def _encode(record: _ParallelConfigRecord) -> bytes:
    return msgspec.json.encode(record)


def _decode(raw: bytes | None, kind: type[T]) -> T | None:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.MsgspecError:
        logger.warning("sglang bootstrap: ignoring an unreadable %s record", kind.__name__)
        return None


def _parse_coords(suffix: str) -> Coords | None:
    parts = suffix.split("/")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return None
    dp, cp, tp, pp = (int(p) for p in parts)
    return dp, cp, tp, pp


def _in_range(config: ParallelConfig, coords: set[Coords]) -> set[Coords]:
    sizes = (config.dp_size, config.cp_size, config.tp_size, config.pp_size)
    return {c for c in coords if all(r < s for r, s in zip(c, sizes, strict=True))}
