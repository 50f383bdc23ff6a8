"""Session affinity: a session's requests go where its last one went, while that is sound.

A request naming its session (``--session-header``, default ``X-Session-Id``) finds its pin in
the :class:`SessionPins` table: the prefill DP rank and the decode its session's last request
took. Each part of the pin is held on its own (a prefill's cache is worth keeping even when the
decode must change) while its worker is still a candidate: in the fleet, healthy, not draining,
its breaker letting requests through, below its in-flight cap, not failed on this request (a
retry re-pins), and, for a soft pin, not over the load bound (``--session-load-bound``: its load
score above ``bound * (least + 1)``, ``least`` the lowest among the candidates; the ``+ 1``
keeps one request's difference on an idle fleet from moving a session). A part that fails these
yields: the policy chooses again and the session re-pins to the new route. A hard pin
(``--session-affinity hard``, or ``X-Session-Affinity: hard`` on the request) never yields: the
request is answered 503 instead, unless the pinned worker left the fleet (then it re-pins:
nothing is left to wait for).

A policy that weighs the prompt (``cache_aware``) keeps its cost model: the pin is a strong
preference, worth the session's last prompt in tokens (what the pinned rank is expected to
hold, whether or not the cache prediction still sees it). The policy's own choice wins only
when it is predicted cheaper (queued prefill tokens plus uncached prompt tokens) by more than
that. The load policies simply take the pinned rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.errors import NoWorkerAvailable
from router.fleet.circuit_breaker import Circuits
from router.observability.metrics import RouterMetrics
from router.scheduling.features import RequestFeatures
from router.scheduling.policies import Policy, PrefillChoice
from router.scheduling.policies.base import LOAD
from router.scheduling.session_pins import Pin, SessionAsk, SessionPins
from router.settings import SessionSettings
from router.upstream.base import UpstreamPool
from router.workers import Worker

__all__ = ["PIN_OUTCOMES", "PIN_REASONS", "Held", "PinUnavailable", "SessionAffinity"]

HIT, NEW, REPINNED, REFUSED = "hit", "new", "repinned", "refused"
PIN_OUTCOMES = (HIT, NEW, REPINNED, REFUSED)
# why a pinned worker yields; "policy": cache_aware's cost model (or an open pair breaker)
# moved the session although the pinned workers were usable
PIN_REASONS = (
    "gone",
    "failed",
    "unhealthy",
    "draining",
    "broken",
    "busy",
    "overloaded",
    "policy",
)


class PinUnavailable(NoWorkerAvailable):
    """A hard pin's worker is in the fleet but not usable now: 503, the session is not moved.
    ``reason``: why the worker would have yielded (``PIN_REASONS``)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Held:
    """A session's pin as a request finds it: the pinned workers still usable (None: that part
    yields, or none is pinned) and why a part yields (the prefill's reason first)."""

    pin: Pin | None
    prefill: Worker | None = None
    rank: int = 0
    decode: Worker | None = None
    why: str | None = None


class SessionAffinity:
    """The session pin table and the rules by which a pin holds or yields."""

    def __init__(
        self,
        settings: SessionSettings,
        pool: UpstreamPool,
        metrics: RouterMetrics,
        circuits: Circuits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pins = SessionPins(settings.max_entries, settings.ttl_s, clock)
        self.header_name = settings.header.lower().encode("ascii")
        self.max_key_bytes = settings.max_key_bytes
        self._settings = settings
        self._hard = settings.mode == "hard"
        self._bound = settings.load_bound
        self._pool = pool
        self._metrics = metrics
        self._circuits = circuits

    def hold(
        self,
        ask: SessionAsk,
        prefills: list[Worker],
        decodes: list[Worker],
        failed: set[str],
        model: str | None = None,
    ) -> Held:
        """The session's pin and which of its workers still hold, for a request to ``model``'s
        pool (None: the whole fleet); raises PinUnavailable when a hard pin's worker is in that
        pool but not usable. A pinned worker that does not serve ``model`` is gone for it: a
        session that moves to another model re-pins there."""
        pin = self.pins.get(ask.key)
        if pin is None:
            return Held(None)
        hard = self._hard if ask.hard is None else ask.hard
        prefill, why_prefill = None, None
        if pin.prefill is not None:
            prefill, why_prefill = self._usable(
                pin.prefill, pin.rank, prefills, failed, hard, model
            )
        decode, why_decode = self._usable(pin.decode, None, decodes, failed, hard, model)
        why = why_prefill or why_decode
        if hard and why is not None and why != "gone":
            role, wid = ("prefill", pin.prefill) if why_prefill else ("decode", pin.decode)
            worker = self._pool.get(wid or "")
            url = worker.public_url if worker is not None else wid
            raise PinUnavailable(
                f"the session is pinned (hard) to {role} worker {url}, which is not available "
                f"now ({why})",
                reason=why,
            )
        return Held(pin, prefill, pin.rank, decode, why)

    def _usable(
        self,
        worker_id: str,
        rank: int | None,
        candidates: list[Worker],
        failed: set[str],
        hard: bool,
        model: str | None,
    ) -> tuple[Worker | None, str | None]:
        """The pinned worker if it still holds, else None and why it yields."""
        worker = self._pool.get(worker_id)
        if worker is None or rank is not None and rank >= max(worker.dp_size, 1):
            return None, "gone"  # removed, or its DP layout changed under the pin
        if model is not None and worker.models and model not in worker.models:
            return None, "gone"  # not in this model's pool
        why = None
        if worker.id in failed:
            why = "failed"
        elif not worker.healthy:
            why = "unhealthy"
        elif worker.draining:
            why = "draining"
        elif not any(candidate is worker for candidate in candidates):
            circuits = self._circuits
            broken = circuits is not None and not circuits.worker_allows(worker)
            why = "broken" if broken else "busy"
        elif not hard and self._overloaded(worker, rank, candidates):
            why = "overloaded"
        return (worker, None) if why is None else (None, why)

    def _overloaded(self, worker: Worker, rank: int | None, candidates: list[Worker]) -> bool:
        """Whether the pinned worker (prefill: its rank) is over the load bound."""
        bound = self._bound
        if not bound:
            return False
        if rank is None:
            least = min(candidate.load_score(None) for candidate in candidates)
            return worker.load_score(None) > bound * (least + 1)
        least = min(
            candidate.load_score(place)
            for candidate in candidates
            for place in range(max(candidate.dp_size, 1))
        )
        return worker.load_score(rank) > bound * (least + 1)

    def as_judged(
        self,
        policy: Policy,
        prefills: list[Worker],
        features: RequestFeatures,
        pinned: Worker,
        rank: int,
    ) -> PrefillChoice:
        """The pinned prefill rank as the policy judges it among all the candidates (one
        judgement for all: judged alone, a rank might be matched another way): its predicted
        cached prompt tokens, from the policy's ``scores``."""
        mode, rows = policy.scores(prefills, features)
        cached = next(
            (
                row["predicted_cached_tokens"] or 0
                for row in rows
                if row["worker"] == pinned.public_url and row["dp_rank"] == rank
            ),
            0,
        )
        how = mode if mode is not None and cached > 0 else LOAD
        return PrefillChoice(pinned, rank, how, cached, mode or LOAD, predicted=True)

    def weigh(
        self, held: Held, chosen: PrefillChoice, pinned: PrefillChoice, prompt_tokens: int | None
    ) -> PrefillChoice:
        """cache_aware: the pinned prefill, unless the policy's choice is predicted cheaper by
        more than the session's last prompt (the pin's worth in tokens). Without a prompt size
        there are no costs to compare: the pin holds."""
        if not prompt_tokens or held.pin is None:
            return pinned
        worth = min(held.pin.prompt_tokens, prompt_tokens)
        if _cost(pinned, prompt_tokens) - worth <= _cost(chosen, prompt_tokens):
            return pinned
        return chosen

    def record(
        self,
        ask: SessionAsk,
        held: Held,
        route: tuple[Worker | None, int, Worker],
        prompt_tokens: int | None,
    ) -> None:
        """Pin (refresh, or re-pin) the session to the route taken (``(prefill, rank,
        decode)``; a skipped prefill leg keeps the prefill pinned) and count the outcome."""
        prefill, rank, decode = route
        pin = held.pin
        if prefill is None and pin is not None:
            prefill_id, rank = pin.prefill, pin.rank
        else:
            prefill_id = None if prefill is None else prefill.id
        tokens = prompt_tokens or (pin.prompt_tokens if pin is not None else 0)
        self.pins.pin(ask.key, prefill_id, rank, decode.id, tokens)
        if pin is None:
            outcome, why = NEW, ""
        elif decode.id == pin.decode and (
            pin.prefill is None or (pin.prefill, pin.rank) == (prefill_id, rank)
        ):  # a pin without a prefill (its requests skipped the leg) gains one: still a hit
            outcome, why = HIT, ""
        else:
            outcome, why = REPINNED, held.why or "policy"
        self._metrics.count(self._metrics.session_pins, outcome, why)

    def refused(self, exc: PinUnavailable) -> None:
        """A hard pin's request answered 503 (counted)."""
        self._metrics.count(self._metrics.session_pins, REFUSED, exc.reason)

    def describe(self, ask: SessionAsk | None) -> dict[str, Any]:
        """The table's bounds and size and, for a request naming its session, its pin
        (``/admin/explain``)."""
        settings = self._settings
        described: dict[str, Any] = {
            "header": settings.header,
            "mode": settings.mode,
            "load_bound": settings.load_bound,
            "table": self.pins.stats(),
            "key": None if ask is None else ask.key,
            "pin": None,
        }
        pin = None if ask is None else self.pins.get(ask.key)
        if pin is not None:
            described["pin"] = {
                "prefill": self._shown(pin.prefill),
                "dp_rank": pin.rank if pin.prefill is not None else None,
                "decode": self._shown(pin.decode),
                "prompt_tokens": pin.prompt_tokens,
                "expires_in_s": round(pin.expires_at - self.pins.now(), 3),
            }
        return described

    def _shown(self, worker_id: str | None) -> str | None:
        """A pinned worker's public URL (credentials hidden); a worker gone: ``gone``."""
        if worker_id is None:
            return None
        worker = self._pool.get(worker_id)
        return "gone" if worker is None else worker.public_url


def _cost(choice: PrefillChoice, prompt_tokens: int) -> int:
    """The prefill tokens a request waits for at ``choice``: those queued there plus its own
    uncached ones (``cache_aware``'s cost)."""
    uncached = max(prompt_tokens - choice.cached_tokens, 0)
    return choice.worker.pending_tokens(choice.rank) + uncached
