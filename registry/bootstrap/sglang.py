"""SGLang's prefill bootstrap server API, answered from the registry store (PROTOCOLS.md 5.5, 5.6).

Engines call these paths on ``bootstrap_host:bootstrap_port`` and cannot add a path prefix, so the
plain paths (``/route``, ``/register_dp_rank``, ``/query_dp_ranks``) belong to namespace
``"default"``, and each further prefill instance needs a port of its own (``app.namespace_app``).
The same routes under ``/bootstrap/{namespace}/...`` (plus ``/bootstrap/{namespace}/health``) let
the router and operators reach any namespace on the shared port.

Every engine generation is accepted and answered, told apart by its fields:

* ``PUT /route``: the 0.4.x payload (``role, tp_size, dp_size, rank_ip, rank_port, engine_rank``;
  ``dp = engine_rank // (tp_size / dp_size)``, ``tp = engine_rank % (tp_size / dp_size)``) or the
  0.5.x payload (``attn_tp_*, attn_dp_*, pp_*, system_dp_*, rank_ip, rank_port`` and, by version,
  ``role``, ``page_size``, ``attn_cp_*``, ``kv_cache_dtype``, ``load_balance_method``, ...).
  Ranks land in one table ``[dp][cp][tp][pp]`` (cp and pp are 0 for 0.4.x). A ``role`` other than
  ``"Prefill"`` is acknowledged and ignored, as the engine does.
* ``GET /route``: the 0.4.x (``engine_rank, target_dp_group``), 0.5.1-0.5.9 (``+ target_pp_rank``)
  and 0.5.10+ (``prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank``) queries; all
  ``-1`` asks for the parallel info in that version's shape.

Decisions beyond the engines' own behaviour:

* Rank entries may carry a lease (``rank_ttl``): a registering process keeps its rank alive by
  re-sending the same ``PUT /route`` (a heartbeat) more often than the ttl. ``None`` (the default,
  like the engines' in-memory table) keeps ranks until the table is replaced.
* The parallel-info query answers 503 until every dp x cp x tp x pp rank is registered in *every*
  form (the engines before 0.5.10 answer at once, with nulls while empty); decoders of every
  version treat a non-200 answer as "not available yet".
* Unknown ranks are 404 "Bootstrap info not found ..." in every form (0.4.x raised a KeyError,
  a 500); non-integer query values are 400 (the engines raise, a 500).
* One namespace holds one *layout* (sizes, page size, kv dtype, ...). A registration with a
  different layout replaces the table (a new generation; old ranks are dropped) when the current
  table is complete or empty: a restarted, re-configured prefill. While it is partly registered,
  the mismatch is refused with 400: two differently configured processes fight over one namespace.
* The 0.5.10+ parallel info carries the fields of the registering engine's ``PrefillServerInfo``:
  the version-specific ones (``prefill_http_port``, ``enable_dsa_cache_layer_split``, ...) only
  when the prefill sent them, because decoders build the dataclass with ``PrefillServerInfo(**d)``
  and fail on unknown keys. Early 0.5.10+ releases have no decode-side ``target_*`` fields: serve
  those with ``server_info_decode_fields=False``.
* The store seam has no transactions: routers sharing one store resolve concurrent layout changes
  by last writer wins; ordinary registrations touch disjoint keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from fastapi.routing import APIRoute
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    model_validator,
)

from registry.backends.base import RegistryStore
from registry.errors import Conflict, NotFound, RegistryError, RegistryUnavailable
from registry.models import NAMESPACE_RE

__all__ = [
    "DEFAULT_NAMESPACE",
    "KEY_ROOT",
    "ROOM_TTL_S",
    "BadBootstrapRequest",
    "QueryForm",
    "RankAddress",
    "RouteQuery",
    "SglangBootstrap",
    "SglangParallelInfo",
    "answer_route_query",
    "parse_route_query",
    "render_parallel_info",
    "sglang_routes",
]

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "default"
KEY_ROOT = "bootstrap/sglang/"
ROOM_TTL_S = 120.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL
NAMESPACE_PREFIX = "/bootstrap/{namespace}"
_JSON = "application/json; charset=utf-8"  # what aiohttp's json_response sends
# Version-specific PrefillServerInfo fields, in the dataclass's order; each is echoed only when
# the prefill registered it. kv_layout and dsv41_spec_layout are left out when null (0.5.23).
_EXTRA_FIELDS = (
    "enable_dsa_cache_layer_split",
    "decode_allocation_policy",
    "enable_kv_cache_sharding",
    "kv_layout",
    "dsv41_spec_layout",
    "prefill_http_port",
)
_OMIT_WHEN_NULL = frozenset({"kv_layout", "dsv41_spec_layout"})
_DECODE_SIDE_FIELDS = (
    "target_tp_rank",
    "target_tp_ranks",
    "target_cp_ranks",
    "target_pp_ranks",
    "required_dst_info_num",
    "required_prefill_response_num",
)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
Port = Annotated[int, Field(ge=1, le=65535)]
Host = Annotated[str, Field(min_length=1)]


class BadBootstrapRequest(RegistryError):
    """A bootstrap call with missing or invalid fields (answered 400)."""


class QueryForm(Enum):
    """The ``GET /route`` query shapes, by the engine versions that send them."""

    V0_4 = "0.4.x"
    V0_5_1 = "0.5.1-0.5.9"
    V0_5_10 = "0.5.10+"


@dataclass(frozen=True, slots=True)
class RankAddress:
    """Where one prefill rank's KV manager listens (its ZMQ PULL socket)."""

    rank_ip: str
    rank_port: int


@dataclass(frozen=True, slots=True)
class SglangParallelInfo:
    """A namespace's prefill layout as registered; ``complete`` once every rank is present."""

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


Coords = tuple[int, int, int, int]  # (dp, cp, tp, pp)


class _Layout(msgspec.Struct, frozen=True):
    dp_size: int
    cp_size: int
    tp_size: int
    pp_size: int
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    follow_bootstrap_room: bool = True
    extras: dict[str, Any] = {}

    def expected(self) -> int:
        return self.dp_size * self.cp_size * self.tp_size * self.pp_size

    def describe(self) -> str:
        return (
            f"dp={self.dp_size} cp={self.cp_size} tp={self.tp_size} pp={self.pp_size} "
            f"page_size={self.page_size} kv_cache_dtype={self.kv_cache_dtype}"
        )


class _LayoutRecord(msgspec.Struct, frozen=True):
    generation: int
    layout: _Layout | None = None  # None after reset()


class _Rank(msgspec.Struct, frozen=True):
    rank_ip: str
    rank_port: int


@dataclass(frozen=True, slots=True)
class _Registration:
    layout: _Layout
    coords: Coords
    address: RankAddress


class _Registration04(BaseModel):
    """SGLang 0.4.9-0.4.10 (and the common/NIXL server up to 0.5.1)."""

    model_config = ConfigDict(extra="ignore")

    role: str
    tp_size: PositiveInt
    dp_size: PositiveInt
    rank_ip: Host
    rank_port: Port
    engine_rank: NonNegativeInt

    @model_validator(mode="after")
    def _ranks_fit(self) -> _Registration04:
        if self.tp_size % self.dp_size:
            raise ValueError(f"tp_size={self.tp_size} is not a multiple of dp_size={self.dp_size}")
        if self.engine_rank >= self.tp_size:
            raise ValueError(f"engine_rank={self.engine_rank} >= tp_size={self.tp_size}")
        return self

    def normalize(self) -> _Registration:
        per_group = self.tp_size // self.dp_size
        layout = _Layout(dp_size=self.dp_size, cp_size=1, tp_size=per_group, pp_size=1)
        coords = (self.engine_rank // per_group, 0, self.engine_rank % per_group, 0)
        return _Registration(layout, coords, RankAddress(self.rank_ip, self.rank_port))


class _Registration05(BaseModel):
    """SGLang 0.5.1 onwards; ``role`` until 0.5.9, CP and dtype fields from 0.5.10."""

    model_config = ConfigDict(extra="ignore")

    role: str | None = None
    attn_tp_size: PositiveInt
    attn_tp_rank: NonNegativeInt
    attn_cp_size: PositiveInt = 1
    attn_cp_rank: NonNegativeInt = 0
    attn_dp_size: PositiveInt
    attn_dp_rank: NonNegativeInt
    pp_size: PositiveInt
    pp_rank: NonNegativeInt
    system_dp_size: PositiveInt
    system_dp_rank: NonNegativeInt
    rank_ip: Host
    rank_port: Port
    page_size: PositiveInt | None = None
    kv_cache_dtype: str | None = None
    load_balance_method: str | None = None
    prefill_http_port: Port | None = None
    enable_dsa_cache_layer_split: bool = False
    enable_kv_cache_sharding: bool = False
    decode_allocation_policy: str | None = None
    kv_layout: JsonValue = None
    dsv41_spec_layout: JsonValue = None

    @property
    def dp_size(self) -> int:
        return self.attn_dp_size if self.system_dp_size == 1 else self.system_dp_size

    @property
    def dp_group(self) -> int:
        return self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank

    @model_validator(mode="after")
    def _ranks_fit(self) -> _Registration05:
        for name, rank, size in (
            ("attn_tp_rank", self.attn_tp_rank, self.attn_tp_size),
            ("attn_cp_rank", self.attn_cp_rank, self.attn_cp_size),
            ("pp_rank", self.pp_rank, self.pp_size),
            ("dp group", self.dp_group, self.dp_size),
        ):
            if rank >= size:
                raise ValueError(f"{name}={rank} is out of range for size {size}")
        return self

    def _follow_bootstrap_room(self) -> bool:
        if "load_balance_method" not in self.model_fields_set:
            return True  # the engine's default when the field is absent
        return self.load_balance_method == "follow_bootstrap_room"

    def _extras(self) -> dict[str, Any]:
        sent = self.model_fields_set
        values = {name: getattr(self, name) for name in _EXTRA_FIELDS if name in sent}
        return {k: v for k, v in values.items() if v is not None or k not in _OMIT_WHEN_NULL}

    def normalize(self) -> _Registration:
        layout = _Layout(
            dp_size=self.dp_size,
            cp_size=self.attn_cp_size,
            tp_size=self.attn_tp_size,
            pp_size=self.pp_size,
            page_size=self.page_size,
            kv_cache_dtype=self.kv_cache_dtype,
            follow_bootstrap_room=self._follow_bootstrap_room(),
            extras=self._extras(),
        )
        coords = (self.dp_group, self.attn_cp_rank, self.attn_tp_rank, self.pp_rank)
        return _Registration(layout, coords, RankAddress(self.rank_ip, self.rank_port))


class _DpRankRegistration(BaseModel):
    bootstrap_room: NonNegativeInt
    dp_rank: NonNegativeInt


class _DpRankQuery(BaseModel):
    bootstrap_rooms: list[int]


def _describe(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors()
    )


def _validate(model: type[M], data: object, what: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadBootstrapRequest(f"Invalid {what}: {_describe(exc)}") from exc


def _parse_registration(data: object) -> _Registration | None:
    """A ``PUT /route`` body of any version, normalized; None for a non-prefill role."""
    if not isinstance(data, dict):
        raise BadBootstrapRequest("Invalid bootstrap registration: the body must be a JSON object")
    model: _Registration04 | _Registration05
    if "attn_tp_size" in data:
        model = _validate(_Registration05, data, "bootstrap registration (SGLang 0.5.x)")
    elif "tp_size" in data or "engine_rank" in data:
        model = _validate(_Registration04, data, "bootstrap registration (SGLang 0.4.x)")
    else:
        raise BadBootstrapRequest(
            "Invalid bootstrap registration: expected the SGLang 0.4.x fields (role, tp_size, "
            "dp_size, rank_ip, rank_port, engine_rank) or the 0.5.x fields (attn_tp_size, "
            "attn_tp_rank, attn_dp_size, attn_dp_rank, pp_size, pp_rank, system_dp_size, "
            "system_dp_rank, rank_ip, rank_port, ...)"
        )
    if model.role is not None and model.role != "Prefill":
        return None
    return model.normalize()


def _check_namespace(namespace: str) -> str:
    if not NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(f"invalid bootstrap namespace {namespace!r}: use [A-Za-z0-9_.-], max 128")
    return namespace


class SglangBootstrap:
    """One namespace's SGLang bootstrap table (one prefill instance), kept in a store.

    Safe to use from several routers over one shared store (see the module notes on races).
    Store failures surface as ``RegistryUnavailable``.
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
        self._store = store
        self._namespace = _check_namespace(namespace)
        self._root = f"{KEY_ROOT}{namespace}/"
        self._rank_ttl = rank_ttl
        self._room_ttl = room_ttl
        self._decode_fields = server_info_decode_fields
        self._lock = asyncio.Lock()  # serializes this process's layout changes

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def server_info_decode_fields(self) -> bool:
        """Whether the 0.5.10+ parallel info carries the decode-side null fields."""
        return self._decode_fields

    async def register(self, payload: object) -> bool:
        """Store one ``PUT /route`` body; False when it was ignored (a non-prefill role).

        Raises ``BadBootstrapRequest`` for an invalid body and ``Conflict`` for a layout that
        contradicts a partly registered table. Re-sending the same body refreshes the rank's lease.
        """
        registration = _parse_registration(payload)
        if registration is None:
            logger.debug("sglang bootstrap %s: non-prefill registration ignored", self._namespace)
            return False
        async with self._lock:
            generation = await self._generation_for(registration.layout)
            rank = _Rank(registration.address.rank_ip, registration.address.rank_port)
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
        """The registered layout and how much of it is present; None before any registration."""
        record = await self._record()
        if record is None or record.layout is None:
            return None
        layout = record.layout
        present = _in_range(layout, await self._rank_coords(record.generation))
        return SglangParallelInfo(
            dp_size=layout.dp_size,
            tp_size=layout.tp_size,
            pp_size=layout.pp_size,
            cp_size=layout.cp_size,
            page_size=layout.page_size,
            kv_cache_dtype=layout.kv_cache_dtype,
            follow_bootstrap_room=layout.follow_bootstrap_room,
            registered=len(present),
            complete=len(present) == layout.expected(),
            extras=dict(layout.extras),
        )

    async def rank_address(self, dp: int, tp: int, pp: int, cp: int = 0) -> RankAddress | None:
        """One registered rank's address, or None."""
        record = await self._record()
        if record is None:
            return None
        raw = await self._store.get(self._rank_key(record.generation, (dp, cp, tp, pp)))
        rank = _decode(raw, _Rank)
        return None if rank is None else RankAddress(rank.rank_ip, rank.rank_port)

    async def register_dp_rank(self, room: int, dp_rank: int) -> None:
        """Remember which prefill DP rank serves ``room``, for ``room_ttl`` seconds."""
        await self._store.put(self._room_key(room), str(dp_rank).encode(), ttl=self._room_ttl)

    async def query_dp_ranks(self, rooms: Iterable[int]) -> dict[str, int]:
        """``{"<room>": dp_rank}`` for the rooms registered (and not expired)."""
        wanted = list(dict.fromkeys(rooms))
        values = await asyncio.gather(*(self._store.get(self._room_key(r)) for r in wanted))
        pairs = zip(wanted, values, strict=True)
        return {str(room): int(raw) for room, raw in pairs if raw is not None and raw.isdigit()}

    async def reset(self) -> None:
        """Forget the layout and every rank (an operator's way out of a stuck table)."""
        async with self._lock:
            record = await self._record()
            generation = 0 if record is None else record.generation + 1
            await self._store.put(self._layout_key(), _encode_record(_LayoutRecord(generation)))
            if record is not None:
                await self._drop(record.generation)

    async def _generation_for(self, layout: _Layout) -> int:
        record = await self._record()
        if record is None:
            return await self._start(_LayoutRecord(0, layout), drop=None)
        if record.layout is None:
            return await self._start(_LayoutRecord(record.generation, layout), drop=None)
        if record.layout == layout:
            return record.generation
        present = _in_range(record.layout, await self._rank_coords(record.generation))
        if present and len(present) < record.layout.expected():
            raise Conflict(
                f"Bootstrap registration ({layout.describe()}) does not match the layout being "
                f"registered in namespace {self._namespace!r} ({record.layout.describe()}; "
                f"{len(present)} of {record.layout.expected()} ranks registered)"
            )
        logger.warning(
            "sglang bootstrap %s: layout changed from (%s) to (%s); dropping old ranks",
            self._namespace,
            record.layout.describe(),
            layout.describe(),
        )
        return await self._start(_LayoutRecord(record.generation + 1, layout), record.generation)

    async def _start(self, record: _LayoutRecord, drop: int | None) -> int:
        await self._store.put(self._layout_key(), _encode_record(record))
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

    async def _record(self) -> _LayoutRecord | None:
        return _decode(await self._store.get(self._layout_key()), _LayoutRecord)

    async def _rank_coords(self, generation: int) -> set[Coords]:
        prefix = self._ranks_prefix(generation)
        keys = await self._store.list(prefix)
        return {c for c in (_parse_coords(k.removeprefix(prefix)) for k in keys) if c is not None}

    def _layout_key(self) -> str:
        return self._root + "layout"

    def _ranks_prefix(self, generation: int) -> str:
        return f"{self._root}ranks/{generation}/"

    def _rank_key(self, generation: int, coords: Coords) -> str:
        return self._ranks_prefix(generation) + "/".join(str(c) for c in coords)

    def _room_key(self, room: int) -> str:
        return f"{self._root}rooms/{room}"


def _encode_record(record: _LayoutRecord) -> bytes:
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


def _in_range(layout: _Layout, coords: set[Coords]) -> set[Coords]:
    sizes = (layout.dp_size, layout.cp_size, layout.tp_size, layout.pp_size)
    return {c for c in coords if all(r < s for r, s in zip(c, sizes, strict=True))}


# --- GET /route ------------------------------------------------------------------------------

_QUERY_PARAMS = MappingProxyType(
    {
        QueryForm.V0_4: ("engine_rank", "target_dp_group"),
        QueryForm.V0_5_1: ("engine_rank", "target_dp_group", "target_pp_rank"),
        QueryForm.V0_5_10: (
            "prefill_dp_rank",
            "prefill_cp_rank",
            "target_tp_rank",
            "target_pp_rank",
        ),
    }
)


@dataclass(frozen=True, slots=True)
class RouteQuery:
    form: QueryForm
    dp: int
    cp: int
    tp: int
    pp: int
    info: bool  # every rank given as -1: the parallel-info query


def _form_of(query: Mapping[str, str]) -> QueryForm:
    if any(name in query for name in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank")):
        return QueryForm.V0_5_10
    return QueryForm.V0_5_1 if "target_pp_rank" in query else QueryForm.V0_4


def parse_route_query(query: Mapping[str, str]) -> RouteQuery:
    """Tell the query's version by its parameters; raises ``BadBootstrapRequest``."""
    form = _form_of(query)
    raw = [query.get(name) for name in _QUERY_PARAMS[form]]
    if not all(raw):
        raise BadBootstrapRequest("Missing inputs for bootstrap server.")
    try:
        values = [int(value or "") for value in raw]
    except ValueError as exc:
        message = "Invalid inputs for bootstrap server: ranks must be integers."
        raise BadBootstrapRequest(message) from exc
    info = all(value == -1 for value in values)
    if form is QueryForm.V0_5_10:
        dp, cp, tp, pp = values
        return RouteQuery(form, dp, cp, tp, pp, info)
    tp, dp, pp = (*values, 0) if form is QueryForm.V0_4 else values
    return RouteQuery(form, dp, 0, tp, pp, info)


def render_parallel_info(
    form: QueryForm, info: SglangParallelInfo, decode_fields: bool = True
) -> dict[str, JsonValue]:
    """The parallel-info answer in the shape the querying engine version expects."""
    if form is QueryForm.V0_4:
        return {"prefill_tp_size": info.tp_size * info.dp_size, "prefill_dp_size": info.dp_size}
    if form is QueryForm.V0_5_1:
        answer: dict[str, JsonValue] = {
            "prefill_attn_tp_size": info.tp_size,
            "prefill_dp_size": info.dp_size,
            "prefill_pp_size": info.pp_size,
        }
        if info.page_size is not None:
            answer["prefill_page_size"] = info.page_size
        return answer
    return _server_info(info, decode_fields)


def _server_info(info: SglangParallelInfo, decode_fields: bool) -> dict[str, JsonValue]:
    answer: dict[str, JsonValue] = {
        "attn_tp_size": info.tp_size,
        "attn_cp_size": info.cp_size,
        "dp_size": info.dp_size,
        "pp_size": info.pp_size,
        "page_size": info.page_size,
        "kv_cache_dtype": info.kv_cache_dtype,
        "follow_bootstrap_room": info.follow_bootstrap_room,
    }
    answer.update({name: info.extras[name] for name in _EXTRA_FIELDS if name in info.extras})
    if decode_fields:
        answer.update(dict.fromkeys(_DECODE_SIDE_FIELDS))
    return answer


# --- HTTP ------------------------------------------------------------------------------------


def _text(text: str, status: int) -> Response:
    return PlainTextResponse(text, status_code=status)


def _json(content: object, status: int = 200) -> Response:
    # json.dumps' default separators, as aiohttp's json_response writes them
    return Response(json.dumps(content), status_code=status, media_type=_JSON)


def _not_ready(info: SglangParallelInfo | None) -> Response:
    registered = 0 if info is None else info.registered
    return _text(f"Prefill server not fully registered yet ({registered} workers registered).", 503)


class _SglangRoute(APIRoute):
    """Renders registry errors as the engine's plain-text answers, whatever app mounts it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                response: Response = await handler(request)
            except (BadBootstrapRequest, Conflict) as exc:
                return _text(str(exc), 400)
            except NotFound as exc:
                return _text(str(exc), 404)
            except RegistryUnavailable as exc:
                logger.warning("sglang bootstrap: store unavailable: %s", exc)
                return _text(f"Bootstrap registry unavailable: {exc}", 503)
            return response

        return guarded


async def _json_body(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise BadBootstrapRequest("Invalid request body: not JSON") from exc


async def answer_route_query(table: SglangBootstrap, query: RouteQuery) -> Response:
    """``GET /route``: parallel info (503 until complete) or one rank (404 when unknown)."""
    if query.info or query.form is QueryForm.V0_5_10:
        info = await table.parallel_info()
        if info is None or not info.complete:
            return _not_ready(info)
        if query.info:
            return _json(render_parallel_info(query.form, info, table.server_info_decode_fields))
    address = await table.rank_address(query.dp, query.tp, query.pp, query.cp)
    if address is None:
        return _text(
            f"Bootstrap info not found for dp_rank={query.dp} cp_rank={query.cp} "
            f"tp_rank={query.tp} pp_rank={query.pp}",
            404,
        )
    return _json({"rank_ip": address.rank_ip, "rank_port": address.rank_port})


def sglang_routes(resolve: Callable[[str], SglangBootstrap]) -> APIRouter:
    """The SGLang bootstrap paths: plain (namespace ``"default"``) and ``/bootstrap/{namespace}``.

    ``resolve`` maps a namespace name to its table and raises ``NotFound`` for an unknown one
    (answered 404). Plain ``/health`` is left to the hosting app (``app.namespace_app``).
    """

    def table_of(request: Request) -> SglangBootstrap:
        return resolve(request.path_params.get("namespace", DEFAULT_NAMESPACE))

    async def put_route(request: Request) -> Response:
        await table_of(request).register(await _json_body(request))
        return _text("OK", 200)

    async def get_route(request: Request) -> Response:
        query = parse_route_query(request.query_params)
        return await answer_route_query(table_of(request), query)

    async def other_route() -> Response:
        # the engine's answer, its odd JSON content type included
        return Response("Method not allowed", 405, {"Allow": "GET, PUT"}, media_type=_JSON)

    async def register_dp_rank(request: Request) -> Response:
        table = table_of(request)
        body = _validate(_DpRankRegistration, await _json_body(request), "register_dp_rank body")
        await table.register_dp_rank(body.bootstrap_room, body.dp_rank)
        return _text("OK", 200)

    async def query_dp_ranks(request: Request) -> Response:
        table = table_of(request)
        body = _validate(_DpRankQuery, await _json_body(request), "query_dp_ranks body")
        return _json(await table.query_dp_ranks(body.bootstrap_rooms))

    async def health(request: Request) -> Response:
        table_of(request)  # 404 for an unknown namespace
        return _text("OK", 200)

    router = APIRouter(route_class=_SglangRoute)
    for prefix in ("", NAMESPACE_PREFIX):
        add = _adder(router, prefix)
        add("/route", put_route, "PUT")
        add("/route", get_route, "GET")
        add("/route", other_route, "POST", "DELETE", "PATCH", "OPTIONS")
        add("/register_dp_rank", register_dp_rank, "POST")
        add("/query_dp_ranks", query_dp_ranks, "POST")
    _adder(router, NAMESPACE_PREFIX)("/health", health, "GET")
    return router


def _adder(router: APIRouter, prefix: str) -> Callable[..., None]:
    def add(path: str, endpoint: Callable[..., Any], *methods: str) -> None:
        router.add_api_route(
            prefix + path, endpoint, methods=list(methods), include_in_schema=False
        )

    return add
