"""SGLang's bootstrap API payloads, every engine generation (docs/concepts/protocols.md 5.5, 5.6).

Told apart by their fields:

* ``PUT /route``: the 0.4.x payload (``role, tp_size, dp_size, rank_ip, rank_port, engine_rank``;
  ``dp = engine_rank // (tp_size / dp_size)``, ``tp = engine_rank % (tp_size / dp_size)``) or the
  0.5.x payload (``attn_tp_*, attn_dp_*, pp_*, system_dp_*, rank_ip, rank_port`` and, by version,
  ``role``, ``page_size``, ``attn_cp_*``, ``kv_cache_dtype``, ``load_balance_method``, ...).
  Both normalize to a ``RankRegistration``: the prefill's ``ParallelConfig`` plus the rank's
  coordinates ``(dp, cp, tp, pp)`` (cp and pp are 0 for 0.4.x). A ``role`` other than
  ``"Prefill"`` is acknowledged and ignored, as the engine does.
* ``GET /route``: the 0.4.x (``engine_rank, target_dp_group``), 0.5.1-0.5.9 (``+ target_pp_rank``)
  and 0.5.10+ (``prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank``) queries; all
  ``-1`` asks for the parallel info in that version's shape. Non-integer values are 400 (the
  engines raise, a 500).
* ``POST /register_dp_rank`` and ``POST /query_dp_ranks``: the DP-rank-per-room bodies.

Every invalid payload raises ``BadEngineApiRequest`` (answered 400) with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Annotated, Any, TypeVar

import msgspec
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

from registry.errors import BadEngineApiRequest

__all__ = [
    "SERVER_INFO_EXTRAS",
    "Coords",
    "DpRankQuery",
    "MAX_QUERY_ROOMS",
    "DpRankRegistration",
    "ParallelConfig",
    "QueryForm",
    "RankAddress",
    "RankRegistration",
    "RouteQuery",
    "check_room_count",
    "parse_route_payload",
    "parse_route_query",
    "validate_body",
]

# Version-specific PrefillServerInfo fields, in the dataclass's order; each is echoed only when
# the prefill registered it. kv_layout and dsv41_spec_layout are left out when null (0.5.23).
SERVER_INFO_EXTRAS = (
    "enable_dsa_cache_layer_split",
    "decode_allocation_policy",
    "enable_kv_cache_sharding",
    "kv_layout",
    "dsv41_spec_layout",
    "prefill_http_port",
)
_OMIT_WHEN_NULL = frozenset({"kv_layout", "dsv41_spec_layout"})

M = TypeVar("M", bound=BaseModel)
Port = Annotated[int, Field(ge=1, le=65535)]
Host = Annotated[str, Field(min_length=1)]
Coords = tuple[int, int, int, int]  # (dp, cp, tp, pp)


@dataclass(frozen=True, slots=True)
class RankAddress:
    """Where one prefill rank's KV manager listens (its ZMQ PULL socket)."""

    rank_ip: str
    rank_port: int


class ParallelConfig(msgspec.Struct, frozen=True):
    """A prefill's parallel configuration as its registrations state it (sizes, page size, ...).

    Every rank of one prefill sends the same one; the rank table stores it as it is.
    """

    dp_size: int
    cp_size: int
    tp_size: int  # attention TP size per DP group
    pp_size: int
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    follow_bootstrap_room: bool = True
    extras: dict[str, Any] = {}

    def expected(self) -> int:
        """How many ranks a complete registration has."""
        return self.dp_size * self.cp_size * self.tp_size * self.pp_size

    def describe(self) -> str:
        return (
            f"dp={self.dp_size} cp={self.cp_size} tp={self.tp_size} pp={self.pp_size} "
            f"page_size={self.page_size} kv_cache_dtype={self.kv_cache_dtype}"
        )


@dataclass(frozen=True, slots=True)
class RankRegistration:
    """One ``PUT /route`` body of any version, normalized."""

    config: ParallelConfig
    coords: Coords
    address: RankAddress


# --- PUT /route ------------------------------------------------------------------------------


class _RoutePayload04(BaseModel):
    """SGLang 0.4.9-0.4.10 (and the common/NIXL server up to 0.5.1)."""

    model_config = ConfigDict(extra="ignore")

    role: str
    tp_size: PositiveInt
    dp_size: PositiveInt
    rank_ip: Host
    rank_port: Port
    engine_rank: NonNegativeInt

    @model_validator(mode="after")
    def _ranks_fit(self) -> _RoutePayload04:
        if self.tp_size % self.dp_size:
            raise ValueError(f"tp_size={self.tp_size} is not a multiple of dp_size={self.dp_size}")
        if self.engine_rank >= self.tp_size:
            raise ValueError(f"engine_rank={self.engine_rank} >= tp_size={self.tp_size}")
        return self

    def normalize(self) -> RankRegistration:
        per_group = self.tp_size // self.dp_size
        config = ParallelConfig(dp_size=self.dp_size, cp_size=1, tp_size=per_group, pp_size=1)
        coords = (self.engine_rank // per_group, 0, self.engine_rank % per_group, 0)
        return RankRegistration(config, coords, RankAddress(self.rank_ip, self.rank_port))


class _RoutePayload05(BaseModel):
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
    def _ranks_fit(self) -> _RoutePayload05:
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
        values = {name: getattr(self, name) for name in SERVER_INFO_EXTRAS if name in sent}
        return {k: v for k, v in values.items() if v is not None or k not in _OMIT_WHEN_NULL}

    def normalize(self) -> RankRegistration:
        config = ParallelConfig(
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
        return RankRegistration(config, coords, RankAddress(self.rank_ip, self.rank_port))


def _describe(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors()
    )


def validate_body(model: type[M], data: object, what: str) -> M:
    """``data`` as a ``model``; raises ``BadEngineApiRequest`` naming ``what`` and the reasons."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadEngineApiRequest(f"Invalid {what}: {_describe(exc)}") from exc


def parse_route_payload(data: object) -> RankRegistration | None:
    """A ``PUT /route`` body of any version, normalized; None for a non-prefill role.

    Raises ``BadEngineApiRequest`` for a body that is no version's valid payload.
    """
    if not isinstance(data, dict):
        raise BadEngineApiRequest("Invalid bootstrap registration: the body must be a JSON object")
    model: _RoutePayload04 | _RoutePayload05
    if "attn_tp_size" in data:
        model = validate_body(_RoutePayload05, data, "bootstrap registration (SGLang 0.5.x)")
    elif "tp_size" in data or "engine_rank" in data:
        model = validate_body(_RoutePayload04, data, "bootstrap registration (SGLang 0.4.x)")
    else:
        raise BadEngineApiRequest(
            "Invalid bootstrap registration: expected the SGLang 0.4.x fields (role, tp_size, "
            "dp_size, rank_ip, rank_port, engine_rank) or the 0.5.x fields (attn_tp_size, "
            "attn_tp_rank, attn_dp_size, attn_dp_rank, pp_size, pp_rank, system_dp_size, "
            "system_dp_rank, rank_ip, rank_port, ...)"
        )
    if model.role is not None and model.role != "Prefill":
        return None
    return model.normalize()


# --- /register_dp_rank, /query_dp_ranks ------------------------------------------------------


# Rooms are SGLang's 64-bit random ids. A decoder asks about the rooms of the requests it is
# admitting, a batch at a time: far fewer than this; more is 400 (each room is a store read).
MAX_QUERY_ROOMS = 4096
Room = Annotated[int, Field(ge=0, le=2**64 - 1)]


class DpRankRegistration(BaseModel):
    """``POST /register_dp_rank``: the prefill DP rank serving one bootstrap room."""

    bootstrap_room: Room
    dp_rank: NonNegativeInt


class DpRankQuery(BaseModel):
    """``POST /query_dp_ranks``: the rooms a decoder asks about (at most ``MAX_QUERY_ROOMS``)."""

    bootstrap_rooms: list[int] = Field(max_length=MAX_QUERY_ROOMS)


def check_room_count(data: object) -> None:
    """400 for a ``query_dp_ranks`` body naming too many rooms, before validating any of them."""
    rooms = data.get("bootstrap_rooms") if isinstance(data, dict) else None
    if isinstance(rooms, list) and len(rooms) > MAX_QUERY_ROOMS:
        raise BadEngineApiRequest(
            f"Invalid query_dp_ranks body: {len(rooms)} bootstrap_rooms, at most "
            f"{MAX_QUERY_ROOMS} per query"
        )


# --- GET /route ------------------------------------------------------------------------------


class QueryForm(Enum):
    """The ``GET /route`` query shapes, by the engine versions that send them."""

    V0_4 = "0.4.x"
    V0_5_1 = "0.5.1-0.5.9"
    V0_5_10 = "0.5.10+"


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
    """One ``GET /route`` query, normalized to rank coordinates."""

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
    """Tell the query's version by its parameters; raises ``BadEngineApiRequest``."""
    form = _form_of(query)
    raw = [query.get(name) for name in _QUERY_PARAMS[form]]
    if not all(raw):
        raise BadEngineApiRequest("Missing inputs for bootstrap server.")
    try:
        values = [int(value or "") for value in raw]
    except ValueError as exc:
        message = "Invalid inputs for bootstrap server: ranks must be integers."
        raise BadEngineApiRequest(message) from exc
    info = all(value == -1 for value in values)
    if form is QueryForm.V0_5_10:
        dp, cp, tp, pp = values
        return RouteQuery(form, dp, cp, tp, pp, info)
    tp, dp, pp = (*values, 0) if form is QueryForm.V0_4 else values
    return RouteQuery(form, dp, 0, tp, pp, info)
