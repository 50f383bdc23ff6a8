"""A tiny real OTLP/HTTP trace collector for tests: ``POST /v1/traces`` on 127.0.0.1.

It decodes each protobuf ``ExportTraceServiceRequest`` (gzip ``Content-Encoding`` too) and
keeps every span as a ``CollectedSpan`` with hex ids, so tests assert on what an exporter
really sent over the wire::

    with serve_collector() as collector:
        ...  # export to collector.endpoint (the base URL; the exporter adds /v1/traces)
        await_until(lambda: collector.named("pdr.decode"), 5, "the decode span")

Needs ``opentelemetry-proto`` (a dependency of the ``otel`` extra's exporter).
"""

from __future__ import annotations

import contextlib
import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from testkit.servers import run_server

__all__ = ["CollectedSpan", "OTLPCollector", "serve_collector"]

PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class CollectedSpan:
    """One exported span. Ids are lower-case hex; ``parent_span_id`` is "" for a root span."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str  # "SERVER", "CLIENT", "INTERNAL", ...
    attributes: dict[str, Any]
    status: str  # "UNSET", "OK", "ERROR"
    status_message: str = ""
    events: list[str] = field(default_factory=list)  # event names, e.g. "exception"
    service_name: str = ""  # the exporting resource's service.name


class OTLPCollector:
    """An ASGI OTLP/HTTP trace receiver; ``spans`` is safe to read from any thread."""

    def __init__(self) -> None:
        self.endpoint = ""  # set by serve_collector once it listens
        self.requests = 0  # export requests accepted
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self.app = Starlette(routes=[Route("/v1/traces", self._export, methods=["POST"])])

    @property
    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)

    def named(self, name: str) -> list[CollectedSpan]:
        return [span for span in self.spans if span.name == name]

    def one(self, name: str) -> CollectedSpan:
        """The only span called ``name``; fails the test if there is not exactly one."""
        found = self.named(name)
        assert len(found) == 1, f"{len(found)} spans named {name!r}: {self.spans}"
        return found[0]

    async def _export(self, request: Request) -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip() != PROTOBUF:
            return Response("only protobuf is supported", status_code=415)
        body = await request.body()
        if request.headers.get("content-encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)  # junk raises: a 500, which fails the exporting test
        spans = list(_spans_of(message))
        with self._lock:
            self._spans.extend(spans)
            self.requests += 1
        answer = ExportTraceServiceResponse().SerializeToString()
        return Response(answer, media_type=PROTOBUF)


def _spans_of(message: ExportTraceServiceRequest) -> Iterator[CollectedSpan]:
    for resource_spans in message.resource_spans:
        service = _attributes(resource_spans.resource.attributes).get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield _collected(span, str(service))


def _collected(span: Span, service: str) -> CollectedSpan:
    return CollectedSpan(
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
        attributes=_attributes(span.attributes),
        status=Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_"),
        status_message=span.status.message,
        events=[event.name for event in span.events],
        service_name=service,
    )


def _attributes(pairs: Any) -> dict[str, Any]:
    items: list[KeyValue] = list(pairs)
    return {pair.key: _value(pair.value) for pair in items}


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(item) for item in value.array_value.values]
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, which)


@contextlib.contextmanager
def serve_collector() -> Iterator[OTLPCollector]:
    """A collector on 127.0.0.1 (OS-chosen port, own thread); ``endpoint`` is its base URL."""
    collector = OTLPCollector()
    with run_server(collector.app) as port:
        collector.endpoint = f"http://127.0.0.1:{port}"
        yield collector
