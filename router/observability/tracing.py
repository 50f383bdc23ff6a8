"""W3C trace context and optional OpenTelemetry spans for route, prefill and decode.

``build_tracer(settings.tracing)`` returns ``None`` unless an OTLP endpoint is configured *and*
the ``otel`` extra is installed: without it nothing from ``opentelemetry`` is imported (this
module imports it lazily), so tracing costs nothing. With it, each router owns its own
``TracerProvider`` (never the process-global one, so two routers in one process, as in the
tests, keep their spans apart) exporting in batches over OTLP/HTTP, sampled
``ParentBased(TraceIdRatioBased(sample_ratio))``: a client's sampling decision wins, the ratio
applies to traces the router starts.

Per request::

    span = tracer.request_span("/v1/completions", traceparent, tracestate)  # SERVER span
    leg = span.child(PREFILL_SPAN)                                          # CLIENT span
    headers.update(leg.headers())  # this leg's request carries a traceparent naming ``leg``
    ...
    leg.end(); span.end()

A span the sampler dropped records nothing and exports nothing, but still has its own span id
and yields a traceparent (flags ``00``), so the engines see one consistent trace either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanKind
    from opentelemetry.trace import Tracer as OtelTracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from router.settings import TracingSettings

__all__ = [
    "DECODE_SPAN",
    "NO_SPAN",
    "PREFILL_SPAN",
    "ROUTE_SPAN",
    "AttributeValue",
    "TraceSpan",
    "Tracer",
    "build_tracer",
]

_log = logging.getLogger(__name__)

ROUTE_SPAN = "pdr.route"  # choosing the prefill and decode workers (INTERNAL)
PREFILL_SPAN = "pdr.prefill"  # the prefill leg's upstream call (CLIENT)
DECODE_SPAN = "pdr.decode"  # the decode leg's upstream call (CLIENT)
_LEG_NAMES = frozenset({"prefill", "decode"})  # last dotted part of a CLIENT span's name

EXPORT_TIMEOUT_S = 5.0  # one OTLP export request, retries included
CLOSE_TIMEOUT_S = 10.0  # aclose waits this long for the last spans to go out

AttributeValue = str | int | float | bool
ChildKind = Literal["internal", "client"]


class TraceSpan(ABC):
    """One span of a request's trace. Methods never raise and never block."""

    @abstractmethod
    def child(self, name: str, *, kind: ChildKind | None = None) -> TraceSpan:
        """A span under this one. ``kind`` defaults to CLIENT for names ending in ``prefill``
        or ``decode`` (an upstream leg) and INTERNAL otherwise (e.g. ``pdr.route``)."""

    @abstractmethod
    def set(self, key: str, value: AttributeValue) -> None:
        """Set one attribute (OpenTelemetry semantic names where they exist)."""

    @abstractmethod
    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` as an exception event, set ``error.type`` and status ERROR."""

    @abstractmethod
    def end(self) -> None:
        """End the span; ending it again does nothing."""

    @abstractmethod
    def headers(self) -> dict[str, str]:
        """``traceparent`` (and ``tracestate`` when the trace has one) naming this span, for
        the request it stands for; empty when nothing is traced."""


class _NoSpan(TraceSpan):
    """The null span: every method does nothing, ``headers()`` is empty (stateless)."""

    def child(self, name: str, *, kind: ChildKind | None = None) -> TraceSpan:
        return self

    def set(self, key: str, value: AttributeValue) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        pass

    def end(self) -> None:
        pass

    def headers(self) -> dict[str, str]:
        return {}


NO_SPAN: TraceSpan = _NoSpan()  # for callers that would rather not branch on a missing tracer


class Tracer(ABC):
    """Starts a request's SERVER span; owned by the router's lifespan."""

    @abstractmethod
    def request_span(
        self, endpoint: str, traceparent: str | None, tracestate: str | None
    ) -> TraceSpan:
        """The SERVER span ``POST <endpoint>``: a child of the client's span when
        ``traceparent`` is a valid W3C header, else the root of a new trace."""

    @abstractmethod
    async def aclose(self) -> None:
        """Export the spans still buffered and shut down; returns within ``CLOSE_TIMEOUT_S``
        even when the collector does not answer (what is left then is dropped)."""


def build_tracer(settings: TracingSettings) -> Tracer | None:
    """The router's tracer, or ``None`` when no ``otlp_endpoint`` is configured (then nothing
    from ``opentelemetry`` is imported) or when the ``otel`` extra is not installed (one
    warning says how to install it)."""
    if settings.otlp_endpoint is None:
        return None
    try:
        return _OtelTracer(settings.otlp_endpoint, settings.service_name, settings.sample_ratio)
    except ImportError as exc:
        _log.warning(
            "tracing: --otlp-endpoint is set but OpenTelemetry is not installed (%s); "
            "no spans are exported. Install it with: pip install 'pd-router[otel]'",
            exc,
        )
        return None


class _OtelSpan(TraceSpan):
    """A ``TraceSpan`` over an OpenTelemetry span (recording or, if sampled out, not)."""

    def __init__(
        self, span: Span, tracer: OtelTracer, propagator: TraceContextTextMapPropagator
    ) -> None:
        self._span = span
        self._tracer = tracer
        self._propagator = propagator

    def child(self, name: str, *, kind: ChildKind | None = None) -> TraceSpan:
        from opentelemetry.trace import set_span_in_context

        parent = set_span_in_context(self._span)
        span = self._tracer.start_span(name, context=parent, kind=_span_kind(name, kind))
        return _OtelSpan(span, self._tracer, self._propagator)

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def fail(self, exc: BaseException) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.record_exception(exc)
        self._span.set_attribute("error.type", type(exc).__qualname__)
        self._span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))

    def end(self) -> None:
        if self._span.is_recording():  # an ended span stops recording; the SDK warns twice
            self._span.end()

    def headers(self) -> dict[str, str]:
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(self._span))
        return carrier


def _span_kind(name: str, kind: ChildKind | None) -> SpanKind:
    from opentelemetry.trace import SpanKind

    if kind is None:
        kind = "client" if name.rsplit(".", 1)[-1] in _LEG_NAMES else "internal"
    return SpanKind.CLIENT if kind == "client" else SpanKind.INTERNAL


class _OtelTracer(Tracer):
    """A per-router ``TracerProvider`` with a batch OTLP/HTTP exporter. Raises ImportError
    when the ``otel`` extra is missing."""

    def __init__(self, endpoint: str, service_name: str, sample_ratio: float) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        exporter = OTLPSpanExporter(
            endpoint=f"{endpoint.rstrip('/')}/v1/traces", timeout=EXPORT_TIMEOUT_S
        )
        self._provider: TracerProvider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
            resource=Resource.create({SERVICE_NAME: service_name}),
            shutdown_on_exit=False,  # aclose shuts it down; no atexit hook per router
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pd-router")
        self._propagator = TraceContextTextMapPropagator()

    def request_span(
        self, endpoint: str, traceparent: str | None, tracestate: str | None
    ) -> TraceSpan:
        from opentelemetry.context import Context
        from opentelemetry.trace import SpanKind

        carrier: dict[str, str] = {"traceparent": traceparent} if traceparent else {}
        if traceparent and tracestate:
            carrier["tracestate"] = tracestate
        # An explicit empty Context: the parent is the client's span or none, never whatever
        # span happens to be current in this task.
        parent = self._propagator.extract(carrier, context=Context())
        span = self._tracer.start_span(
            f"POST {endpoint}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "http.route": endpoint,
                "url.path": endpoint,
            },
        )
        return _OtelSpan(span, self._tracer, self._propagator)

    async def aclose(self) -> None:
        # The SDK's shutdown blocks (it joins the exporter thread, up to 30 s). It runs on a
        # daemon thread of its own, not the loop's executor, which asyncio.run would wait for.
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def shut_down() -> None:
            try:
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is already closed
                    loop.call_soon_threadsafe(_resolve, done)

        threading.Thread(target=shut_down, name="pdr-otel-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, CLOSE_TIMEOUT_S)
        except TimeoutError:
            _log.warning(
                "tracing: the collector took over %.0f s; unexported spans dropped",
                CLOSE_TIMEOUT_S,
            )


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
