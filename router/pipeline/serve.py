"""Per-request orchestration: pick a pair, run an attempt, retry when safe, fill the receipt.

Retried on other workers, and only before any byte reached the client (docs/concepts/protocols.md
3.3, 5.7): connect errors, an engine saying it is full (429/503: not a fault), a prefill lost or
failing to deliver the KV (``worker_lost``, ``kv_lost``, ``kv_failed``: on another prefill), and
any worker fault of an attempt that carried a half-open breaker's trial (trials are real requests
that fail without hurting their client).

Choosing the workers (and whether to skip the prefill leg) is
``router.scheduling.chooser.RouteChooser``; one attempt's legs are ``router.pipeline.attempt``
(``pd_attempt`` for both legs); what each outcome means for the circuit breakers and the pair
ledger is ``router.pipeline.verdicts``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from router.adapters import PDAdapter
from router.errors import NoWorkerAvailable, UpstreamError, WorkersBusy
from router.fleet.circuit_breaker import Circuits, build_circuits
from router.observability.agreement import AgreementBoard
from router.observability.metrics import RouterMetrics
from router.observability.pair_ledger import PairLedger
from router.observability.receipt import RoutingReceipt
from router.observability.tracing import TraceSpan
from router.pipeline.admission_queue import NORMAL, Urgency
from router.pipeline.attempt import Attempt, AttemptKit
from router.pipeline.pd_attempt import PDAttempt
from router.pipeline.responder import Responder
from router.pipeline.sample_split import SampleSplit
from router.pipeline.verdicts import Verdicts, retryable
from router.pipeline.worker_queue import queue_at_caps
from router.scheduling.chooser import Route, RouteChooser
from router.scheduling.features import Featurizer
from router.scheduling.model_pools import ModelPools
from router.scheduling.policies import Policy
from router.scheduling.session_affinity import SessionAffinity
from router.scheduling.session_pins import SessionAsk
from router.schemas import ParsedRequest
from router.settings import (
    AdmissionSettings,
    CacheAwareSettings,
    CircuitBreakerSettings,
    HealthSettings,
    ObservabilitySettings,
    SessionSettings,
    UpstreamSettings,
)
from router.upstream.base import UpstreamPool, is_worker_fault
from router.workers import Worker

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)


def _describe_route(span: TraceSpan, route: Route, attempt: int) -> None:
    span.set("pdr.attempt", attempt)
    span.set("pdr.decode", route.decode.public_url)
    if route.prefill is not None:
        span.set("pdr.prefill", route.prefill.public_url)
        span.set("pdr.dp_rank", route.rank)
    else:
        span.set("pdr.prefill_skipped", route.reason or "")


class Pipeline:
    """Routes one parsed request through a prefill and a decode worker."""

    def __init__(
        self,
        pool: UpstreamPool,
        adapter: PDAdapter,
        policies: Callable[[str | None], tuple[Policy, Policy]],
        upstream_settings: UpstreamSettings,
        health_settings: HealthSettings,
        on_stale_layout: Callable[[Worker], None],
        metrics: RouterMetrics | None = None,
        *,
        cache_settings: CacheAwareSettings | None = None,
        featurizer: Featurizer | None = None,
        pairs: PairLedger | None = None,
        observability: ObservabilitySettings | None = None,
        circuits: Circuits | None = None,
        receipts: bool = True,
        session_settings: SessionSettings | None = None,
        model_aliases: Mapping[str, str] | None = None,
        agreement: AgreementBoard | None = None,
        admission: AdmissionSettings | None = None,
    ) -> None:
        """``policies(model)``: a fresh (prefill, decode) policy pair, for the fleet (None) and
        for each model's pool (``router.scheduling.model_pools``); ``session_settings``: session
        affinity (default: on, with the default header; an empty header: off); ``agreement``:
        where the prefill legs' predicted and actual cached tokens go (None: nowhere);
        ``admission``: with ``queue_at_worker_caps``, requests wait for a worker below its
        in-flight cap (``router.pipeline.worker_queue``) instead of 429."""
        self._receipts = receipts  # the x-pdr-* response headers
        self.circuits = circuits or build_circuits(health_settings, CircuitBreakerSettings())
        self._adapter = adapter
        self._metrics = metrics = metrics or RouterMetrics()
        sessions = session_settings or SessionSettings()
        self.sessions = (
            SessionAffinity(sessions, pool, metrics, self.circuits) if sessions.header else None
        )
        cache, featurizer = cache_settings or CacheAwareSettings(), featurizer or Featurizer(None)

        def chooser(model: str | None) -> RouteChooser:
            prefill_policy, decode_policy = policies(model)
            return RouteChooser(
                pool, adapter.decode_can_prefill, prefill_policy, decode_policy, metrics, cache,
                featurizer, self.circuits, self.sessions, model,
            )  # fmt: skip

        self.chooser = chooser(None)  # the whole fleet's
        self.models = ModelPools(pool, self.chooser, chooser, model_aliases or {})
        recompute_min_ratio = (observability or ObservabilitySettings()).recompute_min_ratio
        self._verdicts = Verdicts(
            pool, adapter, self.circuits, metrics, pairs or PairLedger(), recompute_min_ratio,
            on_stale_layout,
        )  # fmt: skip
        self._settings = upstream_settings
        self._kit = AttemptKit(pool, adapter, upstream_settings, self._verdicts, metrics, agreement)
        self.worker_queue = queue_at_caps(pool, admission, metrics) if admission else None

    async def handle(
        self,
        request: ParsedRequest,
        headers: dict[str, str],
        responder: Responder,
        disconnected: asyncio.Future[Any],
        receipt: RoutingReceipt | None = None,
        trace: TraceSpan | None = None,
        session: SessionAsk | None = None,
        urgency: Callable[[], Urgency] | None = None,
    ) -> None:
        """Serve ``request``; raises RouterError for the caller to render, or ClientDisconnected.

        ``receipt`` gets where the request went and how long each stage took (also sent as
        ``x-pdr-*`` response headers); ``trace``: the request's span, when tracing is on;
        ``session``: the session the request names (its pin is followed and refreshed);
        ``urgency``: its place in the worker queue, worked out when it must wait there."""
        self._adapter.check(request)
        chooser = self.models.chooser_for(request)
        receipt = receipt if receipt is not None else RoutingReceipt()
        if chooser.model is not None and self.models.several:  # counted by pool, in the receipt
            receipt.model = chooser.model or "any"
            self._metrics.count(self._metrics.model_requests, receipt.model)
        queue = self.worker_queue
        held = None
        if queue is not None and queue.reserve:  # its tenant's requests in flight, counted
            held = NORMAL if urgency is None else urgency()
            queue.hold(held)
        try:
            if request.n > 1 and self._adapter.splits_samples:
                split = SampleSplit(request, responder, self._settings.max_answer_bytes)
                await split.run(
                    lambda part, sink: self._serve(
                        chooser, part, headers, sink, disconnected, receipt, trace, session, urgency
                    )
                )
                return
            await self._serve(
                chooser, request, headers, responder, disconnected, receipt, trace, session, urgency
            )
        finally:
            if queue is not None and held is not None:
                queue.release(held)

    async def _serve(
        self,
        chooser: RouteChooser,
        request: ParsedRequest,
        headers: dict[str, str],
        responder: Responder,
        disconnected: asyncio.Future[Any],
        receipt: RoutingReceipt,
        trace: TraceSpan | None,
        session: SessionAsk | None = None,
        urgency: Callable[[], Urgency] | None = None,
    ) -> None:
        attempts = self._settings.max_retries + 1
        failed: set[str] = set()
        last_error: UpstreamError | None = None
        started = time.perf_counter()
        span = trace.child("pdr.route") if trace is not None else None
        features = await chooser.features(request)
        for attempt in range(1, attempts + 1):
            try:
                if self.worker_queue is None:
                    route = chooser.route(failed, features, count=attempt == 1, session=session)
                else:
                    asked = (failed, features, attempt == 1, session, disconnected, urgency)
                    route = await self._route_in_turn(chooser, *asked)
            except NoWorkerAvailable as exc:
                if span is not None:
                    span.fail(exc)
                    span.end()
                if last_error is None:
                    raise
                raise last_error from None  # retries used up every healthy worker
            self._routed(receipt, route, attempt, time.perf_counter() - started, responder)
            if span is not None:
                _describe_route(span, route, attempt)
                span.end()
            shape = Attempt if route.prefill is None else PDAttempt
            try:
                await shape(
                    self._kit, request, headers, responder, disconnected, receipt, trace, route
                ).run()
                return
            except UpstreamError as exc:
                self._verdicts.upstream_failed(route, exc)
                # a half-open breaker's trial may fail without hurting its client: retried
                may_retry = retryable(exc) or bool(route.trials) and is_worker_fault(exc)
                if not may_retry or responder.started or attempt == attempts:
                    raise
                last_error = self._retrying(exc, route, failed, attempt)
            finally:
                for breaker in route.trials:  # a trial without a verdict frees its permit
                    breaker.end_trial()
            started = time.perf_counter()
            span = trace.child("pdr.route") if trace is not None else None

    def _retrying(
        self, exc: UpstreamError, route: Route, failed: set[str], attempt: int
    ) -> UpstreamError:
        """Note a failed attempt that will be retried (its culprit avoided); returns ``exc``."""
        culprit = route.prefill if exc.role == "prefill" else route.decode
        failed.add((culprit or route.decode).id)
        self._metrics.count(self._metrics.retries, exc.role)
        logger.warning(
            "attempt %d failed before any byte was sent, retrying: %s", attempt, exc.message
        )
        return exc

    async def _route_in_turn(
        self,
        chooser: RouteChooser,
        failed: set[str],
        features: Any,
        first: bool,
        session: SessionAsk | None,
        disconnected: asyncio.Future[Any],
        urgency: Callable[[], Urgency] | None,
    ) -> Route:
        """The route choice, waiting in the worker queue (most urgent first) while every
        candidate is at its in-flight cap or others wait before it; within the queue timeout
        over all its waits."""
        queue = self.worker_queue
        assert queue is not None
        model = chooser.model
        busy = False
        ends = 0.0
        while True:
            handed = busy or queue.must_wait(model, urgency)
            if handed:
                now = time.monotonic()
                ends = ends or now + queue.timeout_s
                place = NORMAL if urgency is None else urgency()
                await queue.wait(model, place, disconnected, ends - now)
            try:
                route = chooser.route(failed, features, count=first, session=session)
            except WorkersBusy:  # at the caps (or taken meanwhile: another process)
                busy = True
                continue
            finally:
                if handed:
                    queue.routed(model)
            queue.chosen(route.prefill, route.decode)
            return route

    def _routed(
        self,
        receipt: RoutingReceipt,
        route: Route,
        attempt: int,
        route_s: float,
        responder: Responder,
    ) -> None:
        """Note the attempt's route in the receipt and the response's ``x-pdr-*`` headers."""
        receipt.prefill = route.prefill.public_url if route.prefill is not None else None
        receipt.dp_rank = route.rank
        receipt.decode = route.decode.public_url
        receipt.skipped = route.reason
        receipt.outcome = self.chooser.outcome(route)
        receipt.attempts = attempt
        receipt.route_s = route_s
        receipt.prefill_s = receipt.kv_wait_s = receipt.decode_error = None
        receipt.recomputed = False
        choice = route.choice
        predicted = route.prefill is not None and choice is not None and choice.predicted
        receipt.predicted_cached_tokens = choice.cached_tokens if predicted and choice else None
        receipt.cached_tokens = None
        if self._receipts:
            responder.receipt_headers = receipt.headers()
