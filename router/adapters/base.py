"""What a PD adapter is: a pure rewrite of the client's body into the prefill and decode legs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from router.schemas import ParsedRequest
from router.workers import Worker

__all__ = ["LegPlan", "PDAdapter", "says_any"]


@dataclass(slots=True)
class LegPlan:
    """The two upstream requests for one attempt.

    ``decode_body`` is None for sequential protocols: it is built from the prefill's answer by
    ``PDAdapter.decode_after_prefill``.
    """

    prefill_body: dict[str, Any]
    decode_body: dict[str, Any] | None
    prefill_headers: dict[str, str] = field(default_factory=dict)
    transfer_ref: str = ""  # the KV hand-off's id (transfer_id, bootstrap room), for logs


class PDAdapter(Protocol):
    """One engine PD protocol. Pure: no I/O, no framework objects."""

    name: str
    sequential: bool  # True: prefill must finish before decode starts
    needs_engine_ids: bool  # True: a prefill is routable only once its engine ids are known
    splits_samples: bool  # True: n > 1 goes out as n single-sequence requests
    # True: the decode's usage.prompt_tokens_details.cached_tokens counts the KV it received
    # (its own count); False: the engine reports the prefill's cache hits there instead
    decode_reports_own_cache: bool
    # True: the decode alone serves the client's body, prefilling locally (no KV transfer), so
    # the router may skip the prefill leg (``RouteChooser``)
    decode_can_prefill: bool

    def check(self, request: ParsedRequest) -> None:
        """Raise InvalidRequest if this protocol cannot serve the request."""
        ...

    def plan(self, request: ParsedRequest, prefill: Worker, rank: int, decode: Worker) -> LegPlan:
        """The legs of one attempt, with fresh correlation ids (room / transfer_id)."""
        ...

    def decode_after_prefill(self, request: ParsedRequest, prefill_answer: Any) -> dict[str, Any]:
        """Sequential protocols: the decode body, given the prefill's decoded JSON answer."""
        ...

    def completed_by_prefill(self, prefill_answer: Any) -> bool:
        """Whether the prefill's decoded answer already ends the generation (no KV will come)."""
        ...

    def is_stale_layout(self, decode_error_body: bytes) -> bool:
        """Whether a decode error says the prefill's engine ids are out of date."""
        ...

    def is_kv_failure(self, decode_error_body: bytes) -> bool:
        """Whether a decode error says the KV cache from its prefill did not arrive (a frozen,
        dead or failing prefill, or the path between them: not the decode's own fault)."""
        ...


def says_any(body: bytes, phrases: tuple[bytes, ...]) -> bool:
    """Whether ``body`` contains one of the lower-case ``phrases``, in any case."""
    lowered = body.lower()
    return any(phrase in lowered for phrase in phrases)
