"""Choosing where one request goes: a prefill (and DP rank) and a decode, or the decode alone.

The prefill policy picks a prefill and its DP rank (``choose_prefill``, the same for every
policy; ``cache_aware`` weighs the request's prompt features), the decode policy a decode; the
choice is timed and counted in the router's metrics. When the protocol's decode can prefill by
itself (the vLLM protocols: the adapter's ``decode_can_prefill``) the prefill leg may be skipped
(``_few_uncached``, ``saturated``): the decode alone gets the client's body and prefills locally,
when few prompt tokens are predicted uncached or every prefill is saturated. No I/O here except
tokenizing through a render endpoint (``features``).

Circuit breakers (``router.fleet.circuit_breaker``): a worker whose breaker is open is no candidate
(when every healthy one of a role is open: 503). A chosen prefill -> decode pair whose breaker
is open is avoided: another decode for that prefill if one's pair is not open, else another
prefill; when every pair is open the policies' choice goes through anyway (best effort: both
workers are healthy, only their pairing failed lately). A half-open breaker on the route gives
the attempt its trial permit (``Route.trials``), handed back when the attempt ends.

Session affinity (``router.scheduling.session_affinity``): a request naming its session takes
the pinned prefill rank and decode while they hold; every route taken re-pins the session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from router.errors import NoWorkerAvailable, WorkersBusy
from router.fleet.circuit_breaker import CircuitBreaker, Circuits
from router.observability.metrics import RouterMetrics
from router.scheduling.features import Featurizer, RequestFeatures
from router.scheduling.policies import Policy, PrefillChoice
from router.scheduling.session_affinity import Held, PinUnavailable, SessionAffinity
from router.scheduling.session_pins import SessionAsk
from router.schemas import ParsedRequest
from router.settings import CacheAwareSettings
from router.upstream.base import UpstreamPool
from router.workers import Worker

__all__ = ["SKIPPED", "Route", "RouteChooser"]

SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class Route:
    """One attempt's choice: the prefill (None: skipped, for ``reason``) and the decode."""

    prefill: Worker | None
    rank: int
    decode: Worker
    # the prefill policy's choice (cache_aware's with its prediction); None: skipped, saturated
    choice: PrefillChoice | None = None
    reason: str | None = None  # why the prefill leg is skipped
    # prompt tokens the prefill is predicted to compute (pending at its rank meanwhile); 0 unknown
    prefill_tokens: int = 0
    # half-open breakers whose trial permit this attempt holds (``end_trial`` when it ends)
    trials: tuple[CircuitBreaker, ...] = ()
    # the prompt's exact token count (its token ids were computed), None: not known exactly
    exact_prompt_tokens: int | None = None


class RouteChooser:
    """Composes the prefill and decode policies, the skip rules and the decision metrics."""

    def __init__(
        self,
        pool: UpstreamPool,
        decode_can_prefill: bool,
        prefill_policy: Policy,
        decode_policy: Policy,
        metrics: RouterMetrics,
        cache_settings: CacheAwareSettings,
        featurizer: Featurizer,
        circuits: Circuits | None = None,
        sessions: SessionAffinity | None = None,
        model: str | None = None,
    ) -> None:
        """``decode_can_prefill``: the protocol adapter's word (``PDAdapter.decode_can_prefill``):
        whether the decode prefills a request without KV transfer fields by itself;
        ``sessions``: the session pins (None: no session affinity); ``model``: the candidates
        are the workers serving it (router.scheduling.model_pools; None: every worker)."""
        self._pool = pool
        self.model = model
        self.sessions = sessions
        self._circuits = circuits
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._metrics = metrics
        self._cache = cache_settings
        self._featurizer = featurizer
        self._may_skip = decode_can_prefill and (
            cache_settings.pd_min_uncached_tokens > 0
            or cache_settings.prefill_saturated_waiting is not None
        )
        self._wants_features = prefill_policy.reads_features or self._may_skip
        # the prompt's token ids: for precise matching, or to count uncached tokens exactly
        self._wants_tokens = prefill_policy.reads_tokens or (
            self._may_skip and cache_settings.pd_min_uncached_tokens > 0
        )

    async def features(self, request: ParsedRequest) -> RequestFeatures | None:
        """The prompt's text and (when a choice needs them) token ids; None when unused."""
        if not self._wants_features:
            return None
        features = await self._featurizer.features(request, tokens=self._wants_tokens)
        if self.model and self.model in self._pool.adapters:  # a LoRA adapter's own blocks
            features.adapter = self.model
        return features

    def route(
        self,
        failed: set[str],
        features: RequestFeatures | None,
        *,
        count: bool,
        session: SessionAsk | None = None,
    ) -> Route:
        """Choose (timed), decide whether to skip the prefill leg, and count the outcome;
        ``session``: the request's session, pinned (again) to the route chosen."""
        started = time.perf_counter()
        try:
            route, held = self._select(failed, features, session)
        except PinUnavailable as exc:
            if self.sessions is not None:
                self.sessions.refused(exc)
            raise
        if session is not None and held is not None and self.sessions is not None:
            prompt = None if features is None else features.prompt_tokens
            self.sessions.record(session, held, (route.prefill, route.rank, route.decode), prompt)
        if self._circuits is not None:
            trials = self._circuits.trials(route.prefill, route.decode)
            route = replace(route, trials=trials) if trials else route
        metrics = self._metrics
        policy = self._prefill_policy.name
        metrics.observe(metrics.decision_seconds, time.perf_counter() - started, policy)
        if route.reason is None and route.choice is not None and features is not None:
            self._prefill_policy.record(route.choice, features)
        if count:  # once per request, not per retry
            metrics.count(metrics.decisions, policy, self.outcome(route))
        return route

    def policy_names(self) -> dict[str, str]:
        """The prefill and decode policies in effect."""
        return {"prefill": self._prefill_policy.name, "decode": self._decode_policy.name}

    def outcome(self, route: Route) -> str:
        """How the prefill was chosen: skipped_<reason>, cache_aware's way, or the policy."""
        if route.reason is not None:
            return f"{SKIPPED}_{route.reason}"
        return route.choice.how if route.choice is not None else self._prefill_policy.name

    def explain(
        self, features: RequestFeatures | None, session: SessionAsk | None = None
    ) -> dict[str, Any]:
        """The candidates with what the policies weigh, the session's pin and the pin table,
        and the route this request would take now. Sends nothing, records no prediction and
        pins nothing; like a request, it moves the policies' round-robin cursors (ties,
        ``round_robin``)."""
        prefills, decodes = _explained_candidates(self._pool, self.model)
        mode: str | None = None
        candidates: list[dict[str, Any]] = []
        if prefills:
            mode, candidates = self._prefill_policy.scores(prefills, features or RequestFeatures())
        explained: dict[str, Any] = {
            "policy": self.policy_names(),
            "prompt_tokens": None if features is None else features.prompt_tokens,
            "cache_mode": mode,
            "prefill_candidates": candidates,
            "decode_candidates": [
                {"worker": w.public_url, "load": w.load_score(None), "inflight": w.inflight}
                for w in decodes
            ],
        }
        if self.sessions is not None:
            explained["session"] = self.sessions.describe(session)
        try:
            route, _ = self._select(set(), features, session)
        except NoWorkerAvailable as exc:
            explained["choice"] = None
            explained["error"] = exc.message
            return explained
        explained["choice"] = {
            "prefill": route.prefill.public_url if route.prefill is not None else None,
            "dp_rank": route.rank if route.prefill is not None else None,
            "decode": route.decode.public_url,
            "outcome": self.outcome(route),
            "predicted_cached_tokens": _predicted_cached_tokens(route.choice),
            "predicted_uncached_tokens": _uncached_tokens(route.choice, features),
        }
        return explained

    def _select(
        self, failed: set[str], features: RequestFeatures | None, session: SessionAsk | None
    ) -> tuple[Route, Held | None]:
        """The route, and the session's pin as found (None: no session)."""
        prefills = self._closed(self._pool.available_prefill(self.model), "prefill")
        decodes = self._closed(self._pool.available_decode(self.model), "decode")
        if failed:
            decodes = [w for w in decodes if w.id not in failed] or decodes
        held = None
        if session is not None and self.sessions is not None:
            held = self.sessions.hold(session, prefills, decodes, failed, self.model)
        pinned_decode = None if held is None else held.decode
        decode = pinned_decode or self._decode_policy.choose(decodes)
        if self._may_skip and self.saturated(prefills):
            return Route(None, 0, decode, None, "prefills_saturated"), held
        if failed:
            prefills = [w for w in prefills if w.id not in failed] or prefills
        route = self._prefill_route(prefills, decode, features, held)
        circuits = self._circuits
        if circuits is not None and circuits.any_pair_breaker():
            route = self._avoid_open_pair(route, prefills, decodes, features, circuits)
        if self._may_skip and self._few_uncached(route, features):
            return Route(None, 0, decode, route.choice, "few_uncached_tokens"), held
        return route, held

    def _closed(self, healthy: list[Worker], role: str) -> list[Worker]:
        """The healthy workers whose breaker lets a request through; raises NoWorkerAvailable
        when none is left."""
        if not healthy:
            raise NoWorkerAvailable(f"no healthy {role} worker is available")
        circuits = self._circuits
        if circuits is None or not circuits.any_worker_breaker():
            return healthy
        allowed = [w for w in healthy if circuits.worker_allows(w)]
        if not allowed:
            wait = circuits.next_trial_in(healthy)
            when = "" if wait is None else f"; the next trial in {wait:.1f}s"
            raise NoWorkerAvailable(
                f"no {role} worker is available: the circuit breaker of every healthy one is "
                f"open after failed requests{when}"
            )
        return allowed

    def _prefill_route(
        self,
        prefills: list[Worker],
        decode: Worker,
        features: RequestFeatures | None,
        held: Held | None = None,
    ) -> Route:
        if held is not None and held.prefill is not None:
            choice = self._pinned_prefill(held, held.prefill, prefills, features)
        else:
            choice = self._prefill_policy.choose_prefill(prefills, features or RequestFeatures())
        # the prompt tokens the prefill will compute, when the policy predicts its cache
        uncached = (_uncached_tokens(choice, features) or 0) if choice.predicted else 0
        return Route(
            choice.worker, choice.rank, decode, choice,
            prefill_tokens=uncached, exact_prompt_tokens=_exact_tokens(features),
        )  # fmt: skip

    def _pinned_prefill(
        self,
        held: Held,
        pinned: Worker,
        prefills: list[Worker],
        features: RequestFeatures | None,
    ) -> PrefillChoice:
        """The pinned prefill rank; a policy that weighs the prompt (cache_aware) chooses as
        usual and keeps the pinned prefill unless its own choice is much cheaper (``weigh``)."""
        policy = self._prefill_policy
        if not policy.reads_features:
            return PrefillChoice(pinned, held.rank, policy.name)
        features = features or RequestFeatures()
        chosen = policy.choose_prefill(prefills, features)
        if chosen.worker is pinned and chosen.rank == held.rank:
            return chosen
        assert self.sessions is not None
        own = self.sessions.as_judged(policy, prefills, features, pinned, held.rank)
        return self.sessions.weigh(held, chosen, own, features.prompt_tokens)

    def _avoid_open_pair(
        self,
        route: Route,
        prefills: list[Worker],
        decodes: list[Worker],
        features: RequestFeatures | None,
        circuits: Circuits,
    ) -> Route:
        """Another decode for the chosen prefill, else another prefill for the chosen decode,
        when the chosen pair's breaker is open; the route as chosen when every pair is open."""
        prefill, decode = route.prefill, route.decode
        if prefill is None or circuits.pair_allows(prefill, decode):
            return route
        others = [d for d in decodes if d is not decode and circuits.pair_allows(prefill, d)]
        if others:
            return replace(route, decode=self._decode_policy.choose(others))
        others = [p for p in prefills if p is not prefill and circuits.pair_allows(p, decode)]
        if others:
            return self._prefill_route(others, decode, features)
        return route

    def _few_uncached(self, route: Route, features: RequestFeatures | None) -> bool:
        """Whether the prompt tokens predicted uncached at the chosen prefill are too few to be
        worth a KV transfer (``pd_min_uncached_tokens``; 0 never)."""
        minimum = self._cache.pd_min_uncached_tokens
        uncached = _uncached_tokens(route.choice, features)
        return minimum > 0 and uncached is not None and uncached < minimum

    def saturated(self, prefills: list[Worker]) -> bool:
        """Whether every available prefill reports at least ``prefill_saturated_waiting``
        waiting requests (an unknown reading never counts as saturated)."""
        threshold = self._cache.prefill_saturated_waiting
        if threshold is None or not prefills:
            return False
        for worker in prefills:
            waiting = worker.engine_waiting(None)
            if waiting is None or waiting < threshold:
                return False
        return True


def _uncached_tokens(choice: PrefillChoice | None, features: RequestFeatures | None) -> int | None:
    """The prompt tokens predicted uncached at the chosen prefill (all of them without a cache
    prediction); None when the prompt's size is unknown."""
    total = None if features is None else features.prompt_tokens
    if total is None:
        return None
    return max(total - (choice.cached_tokens if choice is not None else 0), 0)


def _exact_tokens(features: RequestFeatures | None) -> int | None:
    """The prompt's token count when its token ids were computed (None: not exactly known)."""
    return None if features is None or features.tokens is None else len(features.tokens)


def _predicted_cached_tokens(choice: PrefillChoice | None) -> int | None:
    """The prompt tokens predicted cached at the chosen prefill; None without a prediction."""
    return choice.cached_tokens if choice is not None and choice.predicted else None


def _explained_candidates(pool: UpstreamPool, model: str | None) -> tuple[list[Worker], ...]:
    """The candidates ``explain`` shows: those of a route choice, or with every one of a role at
    its in-flight cap, the usable ones (the choice then says that they are all at it)."""
    try:
        return pool.available_prefill(model), pool.available_decode(model)
    except WorkersBusy:
        return pool.usable_prefill(model), pool.usable_decode(model)
