"""Per-request orchestration: pick a pair, rewrite, call both legs, relay, retry when safe.

Failure rules (PROTOCOLS.md 3.3, 5.7): if the prefill leg fails, the decode leg is cancelled at
once and the client gets the prefill's error; if the client goes away, both legs are cancelled.
Only connect errors and an engine saying it is full (429/503: not a fault) are retried, on other
workers, and only before any byte reached the client.

Choosing the workers (and whether to skip the prefill leg) is ``route_choice.RouteChooser``.

Real engines never give up on a KV that does not come before 480-540 s, so the router does:
- the prefill's answer ends the generation (a stop token; ``completed_by_prefill``): the client
  gets that answer and the decode leg is cancelled;
- the prefill is lost (marked down, restarted) while the decode may still wait for its KV: the
  decode leg is cancelled with an error;
- a streaming decode's first byte has not come ``kv_arrival_timeout_s`` after the prefill
  answered (``LegClock``): the decode leg is cancelled with a 504.

Circuit breakers (``router.fleet.circuit_breaker``) hear every outcome. A worker's: its leg
succeeded,
or failed by its own fault (transport errors, timeouts, 5xx; not 429/503 "full", not a KV that
did not come). A pair's: the decode leg of a PD attempt failed (5xx, timeout, ``kv_timeout``,
dropped stream) or recomputed the prompt, while the prefill leg did not fail. An open breaker
never marks a worker down by itself: a worker that may be alive keeps its pending KV transfers.
Only a breaker opened by a refused connection (nothing listens: the engine is gone, as a refused
probe says) marks the worker down too, which tells the requests waiting for its KV
(``Worker.signal_loss``); health probes bring it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec

from router.adapters import LegPlan, PDAdapter
from router.errors import (
    CAPACITY_STATUSES,
    NoWorkerAvailable,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from router.fleet.circuit_breaker import Circuits, build_circuits
from router.fleet.health import connection_refused
from router.interrupt import ClientDisconnected, Interrupt, failure_of, reap
from router.observability.metrics import RouterMetrics
from router.observability.pair_ledger import PairLedger
from router.observability.receipt import RoutingReceipt
from router.observability.tracing import TraceSpan
from router.pipeline.decode_usage import PromptUsage, prompt_usage, prompt_usage_in_sse
from router.pipeline.leg_clock import LegClock
from router.pipeline.prefill_answer import prefill_answer_body, prefill_answer_events
from router.pipeline.responder import Responder
from router.pipeline.sample_split import SampleSplit
from router.scheduling.chooser import Route, RouteChooser
from router.scheduling.features import Featurizer
from router.scheduling.policies import Policy
from router.schemas import ParsedRequest
from router.settings import (
    CacheAwareSettings,
    CircuitBreakerSettings,
    HealthSettings,
    ObservabilitySettings,
    UpstreamSettings,
)
from router.upstream.base import UpstreamClient, UpstreamPool, UpstreamResponse, is_worker_fault
from router.workers import Worker

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_JSON = b"application/json"
_USAGE = b'"usage"'
_RETRYABLE_KINDS = frozenset({"capacity", "stale_connection", "worker_lost"})
# failures that say nothing against the worker whose leg saw them: the KV did not come (the
# pair's), or the prefill was lost (marked down already)
_NOT_THE_WORKERS = frozenset({"kv_timeout", "kv_lost", "worker_lost"})


class _PrefillCompleted(Exception):
    """The prefill's answer already ends the generation; the decode leg is cancelled."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__("the prefill's answer ends the generation")
        self.answer = answer


def _error_detail(body: bytes) -> str:
    """The engine's error message if it sent an OpenAI/FastAPI error JSON, else the raw text."""
    try:
        data = _decode(body)
    except msgspec.DecodeError:
        return body[:500].decode(errors="replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(data.get("detail"), str):
            return str(data["detail"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
    return body[:500].decode(errors="replace")


def _prefill_json(answer: bytes, prefill: Worker) -> Any:
    try:
        return _decode(answer)
    except msgspec.DecodeError as exc:
        raise UpstreamUnavailable(
            f"answered invalid JSON: {answer[:200]!r}",
            role="prefill",
            url=prefill.public_url,
            connect=False,
            kind="invalid_answer",
        ) from exc


@dataclass(frozen=True, slots=True)
class _Legs:
    """One PD attempt: the pair, the prefill tokens predicted, its receipt and trace."""

    pair: tuple[Worker, int, Worker]
    prefill_tokens: int
    receipt: RoutingReceipt
    trace: TraceSpan | None


def _retryable(exc: UpstreamError) -> bool:
    """Nothing was sent (connect), the engine had closed the pooled connection before any
    answer (stale_connection), or it was full (capacity): another worker may serve the request
    (before any byte reached the client)."""
    if isinstance(exc, UpstreamUnavailable) and exc.connect:
        return True
    return exc.kind in _RETRYABLE_KINDS


def _lost_during_prefill(worker: Worker, signal: asyncio.Future[str]) -> BaseException:
    """The prefill was marked down while its leg waited: the request may go elsewhere, rather
    than wait out the prefill timeout on an engine that may never answer."""
    return UpstreamUnavailable(
        f"{signal.result()} while its prefill leg ran",
        role="prefill",
        url=worker.public_url,
        connect=False,
        kind="worker_lost",
    )


def _describe_route(span: TraceSpan, route: Route, attempt: int) -> None:
    span.set("pdr.attempt", attempt)
    span.set("pdr.decode", route.decode.public_url)
    if route.prefill is not None:
        span.set("pdr.prefill", route.prefill.public_url)
        span.set("pdr.dp_rank", route.rank)
    else:
        span.set("pdr.prefill_skipped", route.reason or "")


def _leg_span(trace: TraceSpan | None, name: str, worker: Worker) -> TraceSpan | None:
    if trace is None:
        return None
    span = trace.child(name)
    span.set("pdr.worker", worker.public_url)
    return span


class Pipeline:
    """Routes one parsed request through a prefill and a decode worker."""

    def __init__(
        self,
        pool: UpstreamPool,
        adapter: PDAdapter,
        prefill_policy: Policy,
        decode_policy: Policy,
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
    ) -> None:
        self._pool = pool
        self.circuits = circuits or build_circuits(health_settings, CircuitBreakerSettings())
        self._adapter = adapter
        self._metrics = metrics = metrics or RouterMetrics()
        self.chooser = RouteChooser(
            pool,
            adapter.name,
            prefill_policy,
            decode_policy,
            metrics,
            cache_settings or CacheAwareSettings(),
            featurizer or Featurizer(None),
            self.circuits,
        )
        self._pairs = pairs or PairLedger()
        self._recompute_ratio = (observability or ObservabilitySettings()).recompute_min_ratio
        self._settings = upstream_settings
        self._on_stale_layout = on_stale_layout

    async def handle(
        self,
        request: ParsedRequest,
        headers: dict[str, str],
        responder: Responder,
        disconnected: asyncio.Future[Any],
        receipt: RoutingReceipt | None = None,
        trace: TraceSpan | None = None,
    ) -> None:
        """Serve ``request``; raises RouterError for the caller to render, or ClientDisconnected.

        ``receipt`` gets where the request went and how long each stage took (also sent as
        ``x-pdr-*`` response headers); ``trace``: the request's span, when tracing is on."""
        self._adapter.check(request)
        receipt = receipt if receipt is not None else RoutingReceipt()
        if request.n > 1 and self._adapter.splits_samples:
            split = SampleSplit(request, responder)
            await split.run(
                lambda part, sink: self._serve(part, headers, sink, disconnected, receipt, trace)
            )
            return
        await self._serve(request, headers, responder, disconnected, receipt, trace)

    async def _serve(
        self,
        request: ParsedRequest,
        headers: dict[str, str],
        responder: Responder,
        disconnected: asyncio.Future[Any],
        receipt: RoutingReceipt,
        trace: TraceSpan | None,
    ) -> None:
        attempts = self._settings.max_retries + 1
        failed: set[str] = set()
        last_error: UpstreamError | None = None
        started = time.perf_counter()
        span = trace.child("pdr.route") if trace is not None else None
        features = await self.chooser.features(request)
        for attempt in range(1, attempts + 1):
            try:
                route = self.chooser.route(failed, features, count=attempt == 1)
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
            try:
                if route.prefill is None:
                    await self._direct(request, route, headers, responder, disconnected, trace)
                    return
                plan = self._adapter.plan(request, route.prefill, route.rank, route.decode)
                receipt.transfer_ref = plan.transfer_ref or None
                pair = (route.prefill, route.rank, route.decode)
                legs = _Legs(pair, route.prefill_tokens, receipt, trace)
                await self._attempt(request, plan, headers, legs, responder, disconnected)
                self._pd_served(pair, receipt)
                return
            except UpstreamError as exc:
                self._upstream_failed(route, exc)
                if not _retryable(exc) or responder.started or attempt == attempts:
                    raise
                last_error = exc
                culprit = route.prefill if exc.role == "prefill" else route.decode
                failed.add((culprit or route.decode).id)
                self._metrics.count(self._metrics.retries, exc.role)
                logger.warning(
                    "attempt %d failed before any byte was sent, retrying: %s",
                    attempt,
                    exc.message,
                )
            finally:
                for breaker in route.trials:  # a trial without a verdict frees its permit
                    breaker.end_trial()
            started = time.perf_counter()
            span = trace.child("pdr.route") if trace is not None else None

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
        responder.receipt_headers = receipt.headers()

    def _upstream_failed(self, route: Route, exc: UpstreamError) -> None:
        self._metrics.count(self._metrics.upstream_errors, exc.role, exc.kind)
        if route.prefill is not None:
            key = (route.prefill.id, route.decode.id)
            self._pairs.failed(key, route.prefill.public_url, route.decode.public_url, exc.message)
            if _transfer_failed(exc):
                self.circuits.pair_failure(route.prefill, route.decode, exc.message)

    def _pd_served(self, pair: tuple[Worker, int, Worker], receipt: RoutingReceipt) -> None:
        prefill, _, decode = pair
        key = (prefill.id, decode.id)
        if receipt.decode_error is not None:  # a 5xx counted against the pair already
            self._pairs.failed(key, prefill.public_url, decode.public_url, receipt.decode_error)
            return
        self._pairs.served(key, prefill.public_url, decode.public_url)
        if not receipt.recomputed:
            self.circuits.pair_success(prefill, decode)
        else:
            self._pairs.recomputed(key, prefill.public_url, decode.public_url)
            self.circuits.pair_failure(prefill, decode, "the decode recomputed the prompt")
            logger.warning(
                "PD did not happen: decode %s recomputed the prompt instead of using the KV "
                "from prefill %s (dp_rank %d); pair %s -> %s is suspect",
                decode.public_url,
                prefill.public_url,
                receipt.dp_rank,
                prefill.public_url,
                decode.public_url,
            )

    async def _direct(
        self,
        request: ParsedRequest,
        route: Route,
        headers: dict[str, str],
        responder: Responder,
        disconnected: asyncio.Future[Any],
        trace: TraceSpan | None,
    ) -> None:
        """The decode alone, with the client's body unchanged: it prefills locally (a vLLM
        request without kv_transfer_params). Same relay, errors and retries as a PD attempt."""
        clock = LegClock(self._settings.kv_arrival_timeout_s, watch_first_byte=False)
        call = self._decode(
            request, route.decode, _encode(request.body), headers, responder, None, clock, trace
        )
        interrupt = Interrupt()
        try:
            with interrupt.on_done(disconnected, lambda _: ClientDisconnected()):
                await interrupt.guard(call)
        finally:
            clock.close()

    async def _attempt(
        self,
        request: ParsedRequest,
        plan: LegPlan,
        headers: dict[str, str],
        legs: _Legs,
        responder: Responder,
        disconnected: asyncio.Future[Any],
    ) -> None:
        prefill, rank, decode = pair = legs.pair
        prefill_headers = {**headers, **plan.prefill_headers} if plan.prefill_headers else headers
        prefill_body = _encode(plan.prefill_body)
        prefill_call = self._prefill(request, legs, prefill_body, prefill_headers)
        clock = LegClock(self._settings.kv_arrival_timeout_s, watch_first_byte=request.stream)
        try:
            if plan.decode_body is None:
                await self._sequential(
                    request, legs, prefill_call, headers, responder, clock, disconnected
                )
            else:
                # SGLang sends the very same body to both legs: encode it once.
                same = plan.decode_body is plan.prefill_body
                decode_body = prefill_body if same else _encode(plan.decode_body)
                decode_call = self._decode(
                    request, decode, decode_body, headers, responder, legs, clock, legs.trace
                )
                await self._concurrent(
                    pair, prefill_call, decode_call, responder, clock, disconnected
                )
        except _PrefillCompleted as done:
            await self._answer_from_prefill(request, done.answer, responder)
        finally:
            clock.close()
        if request.stream and clock.prefill_done is not None and clock.first_byte is not None:
            # SGLang's decode may start before its prefill answers: the KV was there already
            legs.receipt.kv_wait_s = max(clock.first_byte - clock.prefill_done, 0.0)

    async def _sequential(
        self,
        request: ParsedRequest,
        legs: _Legs,
        prefill_call: Coroutine[Any, Any, bytes],
        headers: dict[str, str],
        responder: Responder,
        clock: LegClock,
        disconnected: asyncio.Future[Any],
    ) -> None:
        """Prefill first; then the decode, built from the prefill's answer."""
        prefill, _, decode = legs.pair
        interrupt = Interrupt()  # guards one leg at a time
        with interrupt.on_done(disconnected, lambda _: ClientDisconnected()):
            answer = _prefill_json(await interrupt.guard(prefill_call), prefill)
        clock.prefill_answered()
        if self._adapter.completed_by_prefill(answer):
            raise _PrefillCompleted(answer)
        body = self._adapter.decode_after_prefill(request, answer)
        decode_call = self._decode(
            request, decode, _encode(body), headers, responder, legs, clock, legs.trace
        )
        with self._kv_watch(interrupt, prefill, decode, clock, disconnected):
            await interrupt.guard(decode_call)

    async def _concurrent(
        self,
        pair: tuple[Worker, int, Worker],
        prefill_call: Coroutine[Any, Any, bytes],
        decode_call: Coroutine[Any, Any, None],
        responder: Responder,
        clock: LegClock,
        disconnected: asyncio.Future[Any],
    ) -> None:
        """Run both legs; a prefill failure or a disconnect cancels the decode at once.

        The decode leg runs in this task (it owns the client response); the prefill leg in a
        child task whose failure (or answer that ends the generation) interrupts this one.
        """

        def prefill_outcome(task: asyncio.Future[bytes]) -> BaseException | None:
            failure = failure_of(task)
            if failure is not None or task.cancelled():
                return failure
            clock.prefill_answered()
            answer = task.result()
            if b'"stop"' not in answer or responder.started:
                return None  # the common case: no stop at all, decoded by nobody
            try:
                data = _decode(answer)
            except msgspec.DecodeError:
                return None
            return _PrefillCompleted(data) if self._adapter.completed_by_prefill(data) else None

        prefill, _, decode = pair
        prefill_task = asyncio.create_task(prefill_call)
        interrupt = Interrupt()
        try:
            with (
                interrupt.on_done(prefill_task, prefill_outcome),
                self._kv_watch(interrupt, prefill, decode, clock, disconnected),
            ):
                await interrupt.guard(decode_call)
            try:
                await prefill_task
            except UpstreamError as exc:  # the client is served already
                self._metrics.count(self._metrics.upstream_errors, exc.role, exc.kind)
                logger.warning("prefill failed after the decode answered: %s", exc.message)
        finally:
            await reap(prefill_task)

    @contextlib.contextmanager
    def _kv_watch(
        self,
        interrupt: Interrupt,
        prefill: Worker,
        decode: Worker,
        clock: LegClock,
        disconnected: asyncio.Future[Any],
    ) -> Iterator[None]:
        """While the decode leg runs: the client leaving, the prefill being lost while the KV may
        still be on its way, or the KV-arrival deadline passing interrupt it."""

        def lost(signal: asyncio.Future[str]) -> BaseException | None:
            if not clock.kv_pending():
                return None  # the decode has the KV: it can finish without the prefill
            return UpstreamUnavailable(
                f"{signal.result()} before the decode received this request's KV cache",
                role="prefill",
                url=prefill.public_url,
                connect=False,
                kind="kv_lost",
            )

        def expired(deadline: asyncio.Future[float]) -> BaseException:
            return UpstreamTimeout(
                f"no first byte {deadline.result():g}s after prefill {prefill.public_url} "
                "answered: the KV cache did not arrive",
                role="decode",
                url=decode.public_url,
                kind="kv_timeout",
            )

        with (
            interrupt.on_done(disconnected, lambda _: ClientDisconnected()),
            interrupt.on_done(prefill.loss_signal(), lost),
            interrupt.on_done(clock.expired, expired),
        ):
            yield

    async def _answer_from_prefill(
        self, request: ParsedRequest, answer: dict[str, Any], responder: Responder
    ) -> None:
        logger.info("the prefill's one token ended the generation: answering with it")
        if request.stream:
            await responder.whole(200, b"text/event-stream", prefill_answer_events(request, answer))
        else:
            await responder.whole(200, _JSON, prefill_answer_body(answer))

    async def _prefill(
        self, request: ParsedRequest, legs: _Legs, body: bytes, headers: dict[str, str]
    ) -> bytes:
        worker, rank, _ = legs.pair
        upstream = self._pool.client(worker)
        span = _leg_span(legs.trace, "pdr.prefill", worker)
        if span is not None:
            span.set("pdr.dp_rank", rank)
            headers = {**headers, **span.headers()}
        started = time.perf_counter()
        with worker.load(rank, legs.prefill_tokens), self._leg(worker, span):
            interrupt = Interrupt()  # a prefill marked down (frozen, gone) ends its leg now
            with interrupt.on_done(worker.loss_signal(), partial(_lost_during_prefill, worker)):
                call = self._post_whole(upstream, request, body, headers)
                answer: tuple[int, bytes] = await interrupt.guard(call)
            status, content = answer
            if span is not None:
                span.set("http.response.status_code", status)
            if status >= 400:
                raise UpstreamStatusError(
                    status, _error_detail(content), role="prefill", url=worker.public_url
                )
        legs.receipt.prefill_s = time.perf_counter() - started
        self._record(worker, None)
        return content

    @contextlib.contextmanager
    def _leg(self, worker: Worker, span: TraceSpan | None) -> Iterator[None]:
        """One leg's call: a failure counts against its worker (when it is the worker's fault)
        and ends its span as failed; the span ends with the leg."""
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, UpstreamError):
                self._record(worker, exc)
            if span is not None:
                span.fail(exc)
                span.end()
            raise
        if span is not None:
            span.end()

    async def _post_whole(
        self,
        upstream: UpstreamClient,
        request: ParsedRequest,
        body: bytes,
        headers: dict[str, str],
    ) -> tuple[int, bytes]:
        """POST and read the whole answer within the prefill's total deadline."""
        try:
            async with asyncio.timeout(self._settings.prefill_timeout_s):
                response = await upstream.open(request.endpoint.value, body, headers)
                return response.status, await response.read()
        except TimeoutError as exc:
            worker = upstream.worker
            raise UpstreamTimeout(
                f"no complete answer within {self._settings.prefill_timeout_s:g}s",
                role=worker.role.value,
                url=worker.public_url,
            ) from exc

    async def _decode(
        self,
        request: ParsedRequest,
        worker: Worker,
        body: bytes,
        headers: dict[str, str],
        responder: Responder,
        legs: _Legs | None,
        clock: LegClock,
        trace: TraceSpan | None,
    ) -> None:
        """The decode leg (``legs``: the PD attempt it belongs to; None: it prefills alone)."""
        upstream = self._pool.client(worker)
        prefill = legs.pair[0] if legs is not None else None
        span = _leg_span(trace, "pdr.decode", worker)
        if span is not None:
            headers = {**headers, **span.headers()}
        with worker.load(), self._leg(worker, span):
            response = await upstream.open(request.endpoint.value, body, headers)
            if span is not None:
                span.set("http.response.status_code", response.status)
            if request.stream and response.status < 400:
                tail = await self._relay(worker, response, responder, prefill, clock)
                if legs is not None:
                    self._check_recompute(legs, prompt_usage_in_sse(tail))
            else:
                content = await response.read()
                clock.decode_answered()
                if response.status in CAPACITY_STATUSES:  # full: another decode may take it
                    raise UpstreamStatusError(
                        response.status,
                        _error_detail(content),
                        role="decode",
                        url=worker.public_url,
                    )
                self._check_decode_status(response.status, content, worker, prefill)
                if response.status >= 400:  # relayed to the client as the engine's answer
                    self._decode_refused(response.status, content, legs)
                elif legs is not None:
                    self._check_recompute(legs, prompt_usage(content))
                await responder.whole(response.status, response.content_type, content)

    def _decode_refused(self, status: int, content: bytes, legs: _Legs | None) -> None:
        """A decode's error answer goes to the client as is; count it like a failed leg."""
        kind = "http_4xx" if status < 500 else "http_5xx"
        self._metrics.count(self._metrics.upstream_errors, "decode", kind)
        if legs is not None:
            legs.receipt.decode_error = f"decode answered HTTP {status}: {_error_detail(content)}"
            if status >= 500:
                prefill, _, decode = legs.pair
                self.circuits.pair_failure(prefill, decode, legs.receipt.decode_error)

    def _check_recompute(self, legs: _Legs, usage: PromptUsage | None) -> None:
        """Whether the decode's usage shows it computed the prompt itself (PD did nothing)."""
        if usage is not None and usage.recomputed(
            self._recompute_ratio, trust_cached=self._adapter.decode_reports_own_cache
        ):
            legs.receipt.recomputed = True

    async def _relay(
        self,
        worker: Worker,
        response: UpstreamResponse,
        responder: Responder,
        prefill: Worker | None,
        clock: LegClock,
    ) -> bytes:
        """Move decode's SSE bytes to the client as they come; returns the last chunk that
        mentions ``usage`` and the final one (where the usage is, when the client asked for it).

        The client's response starts with the first body chunk, not with decode's headers: until
        then nothing has reached the client, so a failing prefill can still be retried.
        """
        usage = b""
        try:
            chunks = response.chunks()
            chunk = await anext(chunks, b"")
            clock.decode_answered()
            self._check_stale_layout(chunk, worker, prefill)
            await responder.start(response.status, response.content_type, sse=True)
            while chunk:
                if response.at_eof():  # the last chunk: send it with the end of the body
                    break
                await responder.chunk(chunk)
                if _USAGE in chunk:
                    usage = chunk
                chunk = await anext(chunks, b"")
            await responder.finish(chunk)
        finally:
            await response.aclose()
        self._record(worker, None)
        return usage + chunk

    def _check_decode_status(
        self, status: int, content: bytes, worker: Worker, prefill: Worker | None
    ) -> None:
        if status < 500:
            self._record(worker, None)
        elif not self._check_stale_layout(content, worker, prefill):  # else: the prefill's
            self.circuits.worker_failure(worker, f"HTTP {status}: {_error_detail(content)}")

    def _check_stale_layout(self, content: bytes, worker: Worker, prefill: Worker | None) -> bool:
        """A decode error naming an unknown engine id: re-read the prefill's layout now."""
        if prefill is None or not self._adapter.is_stale_layout(content):
            return False
        logger.warning(
            "decode %s does not know prefill %s's engine id; re-querying",
            worker.public_url,
            prefill.public_url,
        )
        self._on_stale_layout(prefill)
        return True

    def _record(self, worker: Worker, exc: UpstreamError | None) -> None:
        if exc is None:
            worker.record_success()
            self.circuits.worker_success(worker)
        elif is_worker_fault(exc):
            self._worker_failed(worker, exc)
        elif exc.kind == "capacity":  # full, not broken: avoid it for a moment
            self._pool.back_off(worker)

    def _worker_failed(self, worker: Worker, exc: UpstreamError) -> None:
        """A leg failed by the worker's fault: its breaker hears it. When that opens the breaker
        and the connection was refused (the engine is gone), the worker is marked down too, as
        a refused probe does: requests waiting for its KV give up, probes bring it back."""
        if exc.role != worker.role.value or exc.kind in _NOT_THE_WORKERS:
            return
        self.circuits.worker_failure(worker, exc.message)
        if worker.healthy and _refused(exc) and not self.circuits.worker_allows(worker):
            logger.warning(
                "%s worker %s is now unhealthy: its port refuses connections",
                worker.role.value,
                worker.public_url,
            )
            worker.mark_down("its port refuses connections")


def _refused(exc: UpstreamError) -> bool:
    """Nothing listens on the worker's port (not a connect timeout): the engine is gone."""
    return isinstance(exc, UpstreamUnavailable) and exc.connect and connection_refused(exc)


def _transfer_failed(exc: UpstreamError) -> bool:
    """A PD attempt's decode leg failed by a fault after it was sent (so the KV transfer may
    be what failed): evidence against the pair. Not a decode that could not be reached, nor
    one that was full."""
    if exc.role != "decode" or not is_worker_fault(exc):
        return False
    return not (isinstance(exc, UpstreamUnavailable) and exc.connect)
