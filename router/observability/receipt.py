"""A request's routing receipt: where it went, how often it was tried, how long each stage took.

The pipeline fills it in; the client gets it as response headers (``x-pdr-*``) and the request
accounting turns it into metrics, the status page's traffic and one debug log line.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RoutingReceipt"]


@dataclass(slots=True)
class RoutingReceipt:
    prefill: str | None = None  # the prefill's URL; None: not routed yet, or skipped
    dp_rank: int = 0
    decode: str | None = None
    skipped: str | None = None  # why the prefill leg was skipped (the decode prefilled)
    outcome: str | None = None  # how the prefill was chosen (pdr_routing_decisions_total)
    attempts: int = 0
    route_s: float = 0.0  # prompt features + choosing, for the attempt that answered
    prefill_s: float | None = None  # the prefill leg, sent to whole answer
    kv_wait_s: float | None = None  # prefill answered -> the decode's first byte
    transfer_ref: str | None = None  # the protocol's handle of the KV transfer (room, id)
    recomputed: bool = False  # the decode computed the prompt itself: PD did not happen
    decode_error: str | None = None  # the decode's error answer, relayed to the client as is
    model: str | None = None  # the pool the request went to (a served name; None: the fleet)
    wants_usage: bool = False  # a tenant's token limit: read the answer's usage
    used_tokens: int | None = None  # the tokens the answer's usage reports (when wanted)
    # prompt tokens the prefill policy predicted cached at the chosen rank (None: no prediction)
    predicted_cached_tokens: int | None = None
    # prompt tokens the prefill's answer reports cached (None: not reported, or no prefill leg)
    cached_tokens: int | None = None

    def headers(self) -> list[tuple[bytes, bytes]]:
        """``x-pdr-prefill`` (URL, or ``skipped:<reason>``), ``x-pdr-prefill-dp-rank``,
        ``x-pdr-decode``, ``x-pdr-attempts``, ``x-pdr-route-us`` and, with model pools,
        ``x-pdr-model``."""
        prefill = self.prefill or f"skipped:{self.skipped}"
        headers = [
            (b"x-pdr-prefill", prefill.encode()),
            (b"x-pdr-decode", (self.decode or "").encode()),
            (b"x-pdr-attempts", str(self.attempts).encode()),
            (b"x-pdr-route-us", str(round(self.route_s * 1e6)).encode()),
        ]
        if self.prefill is not None:
            headers.insert(1, (b"x-pdr-prefill-dp-rank", str(self.dp_rank).encode()))
        if self.model is not None:
            headers.append((b"x-pdr-model", self.model.encode()))
        return headers
