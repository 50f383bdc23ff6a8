"""SGLang PD: the same body to P and D, concurrently, with bootstrap host/port/room.

docs/concepts/protocols.md sections 5.1 and 5.5. Rooms are random in [1, 2**63-1] (0 means "not
ready" on the
decode side); batched prompts and n > 1 get one room per sequence. With a DP prefill every room
satisfies ``room % dp_size == rank``, and P gets ``routed_dp_rank`` while D gets
``disagg_prefill_dp_rank``. ``n > 1`` reaches this adapter only as n requests with ``n: 1``
(``splits_samples``, ``router/pipeline/sample_split.py``): SGLang's n > 1 prefix warm-up reuses the
rooms
and its decode then waits for a transfer that never comes.
"""

from __future__ import annotations

import random
from typing import Any

from router.adapters.base import LegPlan, says_any
from router.schemas import ParsedRequest
from router.workers import Worker

__all__ = ["KV_FAILURES", "MAX_ROOM", "SglangAdapter", "aligned_room"]

MAX_ROOM = 2**63 - 1
# A decode's error texts when the KV did not come from its prefill (lower case; all 500s from
# ``prepare_abort``, protocols.md 5.7): its heartbeat's "Lost connection with prefill instance",
# a failed transfer or handshake ("... transfer failed ...", "... handshake failed ..."), the
# simulated engine's "KV transfer failed: ..." and the fake engine's "KV not received within".
KV_FAILURES = (
    b"lost connection with prefill",
    b"transfer failed",
    b"handshake failed",
    b"kv not received",
)


def aligned_room(rng: random.Random, dp_size: int, rank: int) -> int:
    """A random room in [1, MAX_ROOM] with ``room % dp_size == rank``."""
    while True:
        value = rng.getrandbits(63)
        room = value - value % dp_size + rank
        if room > MAX_ROOM:
            room -= dp_size
        if room >= 1:
            return room


class SglangAdapter:
    name = "sglang"
    sequential = False
    needs_engine_ids = False
    splits_samples = True
    decode_reports_own_cache = False  # the decode reports the prefill's cached_tokens
    decode_can_prefill = False  # the decode takes its KV from a prefill (bootstrap room)

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def check(self, request: ParsedRequest) -> None:
        return None

    def plan(self, request: ParsedRequest, prefill: Worker, rank: int, decode: Worker) -> LegPlan:
        count = request.sample_count
        rooms = [aligned_room(self._rng, prefill.dp_size, rank) for _ in range(count)]
        body = dict(request.body)
        if request.batch is None and request.n == 1:
            body["bootstrap_host"] = prefill.bootstrap_host
            body["bootstrap_port"] = prefill.bootstrap_port
            body["bootstrap_room"] = rooms[0]
        else:
            body["bootstrap_host"] = [prefill.bootstrap_host] * count
            body["bootstrap_port"] = [prefill.bootstrap_port] * count
            body["bootstrap_room"] = rooms
        ref = f"bootstrap_room={rooms[0] if count == 1 else rooms}"
        if prefill.dp_size == 1:
            return LegPlan(prefill_body=body, decode_body=body, transfer_ref=ref)
        prefill_body = dict(body)
        prefill_body["routed_dp_rank"] = rank
        decode_body = dict(body)
        decode_body["disagg_prefill_dp_rank"] = rank
        return LegPlan(prefill_body=prefill_body, decode_body=decode_body, transfer_ref=ref)

    def decode_after_prefill(self, request: ParsedRequest, prefill_answer: Any) -> dict[str, Any]:
        raise NotImplementedError("sglang dispatches prefill and decode concurrently")

    def completed_by_prefill(self, prefill_answer: Any) -> bool:
        return False  # the prefill answers after it sent the KV

    def is_stale_layout(self, decode_error_body: bytes) -> bool:
        return False

    def is_kv_failure(self, decode_error_body: bytes) -> bool:
        return says_any(decode_error_body, KV_FAILURES)
