"""W3C trace context to both legs, and OpenTelemetry spans exported to a real OTLP collector.

Unit tests drive ``router.observability.tracing`` against ``testkit.otlp_collector``; the
end-to-end tests run
the router in front of fake engines and read what each leg received and what the collector got.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from router.observability.tracing import NO_SPAN, Tracer, build_tracer
from router.settings import TracingSettings
from testkit.fake_cluster import fake_cluster_factory
from testkit.otlp_collector import OTLPCollector, serve_collector
from testkit.polling import wait_until
from tests.router.pipeline.test_protocols import COMPLETION

ENGINES = ["vllm-mooncake", "vllm-nixl", "sglang"]
REPO = Path(__file__).resolve().parents[3]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
CLIENT_TRACESTATE = "vendor=opaque,other=1"
SERVER_SPAN = "POST /v1/completions"
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def _tracer(
    collector: OTLPCollector, *, service_name: str = "pd-router", sample_ratio: float = 1.0
) -> Tracer:
    settings = TracingSettings(
        otlp_endpoint=collector.endpoint, service_name=service_name, sample_ratio=sample_ratio
    )
    tracer = build_tracer(settings)
    assert tracer is not None
    return tracer


def _parts(traceparent: str) -> tuple[str, str, bool]:
    """Trace id, parent (span) id and the sampled flag of a W3C ``traceparent``. Other flag
    bits may be set: the SDK marks the trace ids it makes random (W3C level 2, ``0x02``)."""
    match = TRACEPARENT.match(traceparent)
    assert match, traceparent
    trace_id, span_id, flags = match.groups()
    return trace_id, span_id, bool(int(flags, 16) & 0x01)


# ------------------------------------------------------------------- router.observability.tracing


async def test_spans_continue_the_client_trace_with_parent_links_and_leg_headers() -> None:
    with serve_collector() as collector:
        tracer = _tracer(collector, service_name="pdr-under-test")
        server = tracer.request_span("/v1/completions", CLIENT_TRACEPARENT, CLIENT_TRACESTATE)
        route = server.child("pdr.route")
        route.set("pdr.prefill", "http://p1")
        route.set("pdr.dp_rank", 1)
        route.end()
        legs = {name: server.child(name) for name in ("pdr.prefill", "pdr.decode")}
        sent = {name: leg.headers() for name, leg in legs.items()}
        for leg in legs.values():
            leg.end()
        server.set("http.response.status_code", 200)
        server.end()
        await tracer.aclose()  # flushes: the spans are at the collector when it returns

        root = collector.one(SERVER_SPAN)
        assert (root.trace_id, root.parent_span_id, root.kind) == (
            CLIENT_TRACE,
            CLIENT_SPAN,
            "SERVER",
        )
        assert root.service_name == "pdr-under-test"
        assert root.attributes["http.response.status_code"] == 200
        assert root.attributes["http.route"] == "/v1/completions"
        route_span = collector.one("pdr.route")
        assert (route_span.parent_span_id, route_span.kind) == (root.span_id, "INTERNAL")
        assert route_span.attributes == {"pdr.prefill": "http://p1", "pdr.dp_rank": 1}
        for name, headers in sent.items():
            span = collector.one(name)
            assert (span.trace_id, span.parent_span_id, span.kind) == (
                CLIENT_TRACE,
                root.span_id,
                "CLIENT",
            )
            # the leg's request names the leg's own span, in the client's trace and state
            assert headers == {
                "traceparent": f"00-{CLIENT_TRACE}-{span.span_id}-01",
                "tracestate": CLIENT_TRACESTATE,
            }
        assert len(collector.spans) == 4


@pytest.mark.parametrize("traceparent", [None, "garbage", f"00-{'0' * 32}-{CLIENT_SPAN}-01"])
async def test_without_a_valid_client_traceparent_the_server_span_starts_a_trace(
    traceparent: str | None,
) -> None:
    with serve_collector() as collector:
        tracer = _tracer(collector)
        server = tracer.request_span("/v1/chat/completions", traceparent, "vendor=x")
        leg = server.child("pdr.decode")
        trace_id, span_id, sampled = _parts(leg.headers()["traceparent"])
        leg.end()
        server.end()
        await tracer.aclose()
        root = collector.one("POST /v1/chat/completions")
        assert root.parent_span_id == ""
        assert trace_id == root.trace_id != "0" * 32
        assert (span_id, sampled) == (collector.one("pdr.decode").span_id, True)


async def test_fail_records_the_exception_and_an_error_status() -> None:
    with serve_collector() as collector:
        tracer = _tracer(collector)
        server = tracer.request_span("/v1/completions", CLIENT_TRACEPARENT, None)
        leg = server.child("pdr.prefill")
        leg.fail(ConnectionResetError("prefill went away"))
        leg.end()
        leg.end()  # a second end changes nothing
        server.end()
        await tracer.aclose()
        span = collector.one("pdr.prefill")
        assert span.status == "ERROR"
        assert "prefill went away" in span.status_message
        assert span.events == ["exception"]
        assert span.attributes["error.type"] == "ConnectionResetError"
        assert collector.one(SERVER_SPAN).status == "UNSET"


async def test_sampled_out_traces_export_nothing_but_still_propagate() -> None:
    with serve_collector() as collector:
        tracer = _tracer(collector, sample_ratio=0.0)
        # a trace the router starts: the ratio (0) drops it
        dropped = tracer.request_span("/v1/completions", None, None)
        dropped_leg = dropped.child("pdr.prefill")
        own_trace, own_span, own_sampled = _parts(dropped_leg.headers()["traceparent"])
        # a client that did not sample: its decision wins
        unsampled = tracer.request_span(
            "/v1/completions", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00", None
        )
        unsampled_leg = unsampled.child("pdr.decode")
        client_trace, client_leg_span, client_sampled = _parts(
            unsampled_leg.headers()["traceparent"]
        )
        # a client that sampled: exported in spite of the ratio (ParentBased)
        sampled = tracer.request_span("/v1/completions", CLIENT_TRACEPARENT, None)
        for span in (dropped_leg, dropped, unsampled_leg, unsampled, sampled):
            span.end()
        await tracer.aclose()

        assert not own_sampled and not client_sampled
        assert own_trace != "0" * 32 and own_span != "0" * 16
        assert client_trace == CLIENT_TRACE and client_leg_span != CLIENT_SPAN
        assert [(s.name, s.trace_id) for s in collector.spans] == [(SERVER_SPAN, CLIENT_TRACE)]


def test_no_endpoint_no_tracer() -> None:
    assert build_tracer(TracingSettings()) is None
    assert NO_SPAN.child("pdr.route") is NO_SPAN
    assert NO_SPAN.headers() == {}


def test_endpoint_without_the_otel_extra_warns_once_and_runs_untraced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # ``None`` in sys.modules makes the import raise ImportError, as if never installed
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with caplog.at_level(logging.WARNING, logger="router.observability.tracing"):
        tracer = build_tracer(TracingSettings(otlp_endpoint="http://127.0.0.1:4318"))
    assert tracer is None
    warnings = [r for r in caplog.records if r.name == "router.observability.tracing"]
    assert len(warnings) == 1
    assert "pip install 'pd-router[otel]'" in warnings[0].getMessage()


# FastAPI itself imports the OpenTelemetry *API* (a dependency of fastapi >= 0.16x, whose native
# telemetry is a no-op without a global provider), so "zero cost" means:
# router.observability.tracing imports
# nothing from opentelemetry, and a router with tracing off loads none of the extra's parts
# (the SDK, the OTLP exporter, protobuf).
EXTRA_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto", "google")
ZERO_COST = textwrap.dedent(
    f"""
    import asyncio, importlib.util, sys, types

    def loaded(prefixes):
        return sorted(m for m in sys.modules if m == prefixes or m.startswith(prefixes))

    # router/observability/tracing.py alone (importing the router package would import fastapi)
    spec = importlib.util.spec_from_file_location("pdr_tracing", "router/observability/tracing.py")
    tracing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tracing)
    assert tracing.build_tracer(types.SimpleNamespace(otlp_endpoint=None)) is None
    print("module", loaded(("opentelemetry",)))

    from router import RouterSettings
    from router.app import create_app
    from router.observability.tracing import build_tracer

    settings = RouterSettings(
        engine="sglang",
        prefill=[{{"url": "http://127.0.0.1:9", "bootstrap_port": 9}}],
        decode=[{{"url": "http://127.0.0.1:9"}}],
    )
    assert settings.tracing.otlp_endpoint is None
    app = create_app(settings)

    async def main():
        async with app.api.router.lifespan_context(app.api):
            pass

    asyncio.run(main())
    assert build_tracer(settings.tracing) is None
    print("app", loaded({EXTRA_MODULES!r}))
    """
)


def test_tracing_off_imports_nothing_of_the_otel_extra() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}  # no PDR_* from the caller
    result = subprocess.run(
        [sys.executable, "-c", ZERO_COST],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-2:] == ["module []", "app []"], result.stdout


def test_collector_accepts_gzip_bodies() -> None:
    message = ExportTraceServiceRequest()
    span = message.resource_spans.add().scope_spans.add().spans.add()
    span.name = "gzipped"
    span.trace_id = bytes.fromhex(CLIENT_TRACE)
    span.span_id = bytes.fromhex(CLIENT_SPAN)
    with serve_collector() as collector:
        response = httpx.post(
            f"{collector.endpoint}/v1/traces",
            content=gzip.compress(message.SerializeToString()),
            headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
            timeout=5,
        )
        assert response.status_code == 200
        got = collector.one("gzipped")
        assert (got.trace_id, got.span_id, got.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN, "")


# --------------------------------------------------------------------------- through the router

CLIENT_HEADERS = {"traceparent": CLIENT_TRACEPARENT, "tracestate": CLIENT_TRACESTATE}


@pytest.mark.parametrize("engine", ENGINES)
def test_without_tracing_both_legs_get_the_clients_trace_context(engine: str) -> None:
    with contextlib.ExitStack() as stack:
        cluster = fake_cluster_factory(stack)(engine)
        with cluster.client(headers=CLIENT_HEADERS) as client:
            response = client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 200, response.text
        for fake in (cluster.prefills[0], cluster.decodes[0]):
            headers = fake.records[0].headers
            assert headers.get("traceparent") == CLIENT_TRACEPARENT, (fake.role, headers)
            assert headers.get("tracestate") == CLIENT_TRACESTATE, (fake.role, headers)


def _traced_request(
    collector: OTLPCollector, engine: str, headers: dict[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """One streamed completion through a traced router; the headers each leg received. The
    router is stopped on return, which flushes its spans."""
    with contextlib.ExitStack() as stack:
        make = fake_cluster_factory(stack)
        cluster = make(engine, tracing={"otlp_endpoint": collector.endpoint})
        with cluster.client(headers=headers) as client:
            response = client.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert response.status_code == 200, response.text
        assert response.text.rstrip().endswith("data: [DONE]")
        return cluster.prefills[0].records[0].headers, cluster.decodes[0].records[0].headers


def _wait_for_request_spans(collector: OTLPCollector) -> None:
    wanted = {SERVER_SPAN, "pdr.route", "pdr.prefill", "pdr.decode"}
    wait_until(
        lambda: wanted <= {span.name for span in collector.spans},
        10,
        f"spans {sorted(wanted)} at the collector",
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_traced_router_exports_route_prefill_decode_in_the_clients_trace(engine: str) -> None:
    with serve_collector() as collector:
        prefill_headers, decode_headers = _traced_request(collector, engine, CLIENT_HEADERS)
        _wait_for_request_spans(collector)
        assert {span.trace_id for span in collector.spans} == {CLIENT_TRACE}
        server = collector.one(SERVER_SPAN)
        assert (server.parent_span_id, server.kind) == (CLIENT_SPAN, "SERVER")
        for name, kind in [
            ("pdr.route", "INTERNAL"),
            ("pdr.prefill", "CLIENT"),
            ("pdr.decode", "CLIENT"),
        ]:
            span = collector.one(name)
            assert (span.parent_span_id, span.kind) == (server.span_id, kind), span
        for name, received in [("pdr.prefill", prefill_headers), ("pdr.decode", decode_headers)]:
            # each leg's parent is its own leg span, not the client's span
            span_id = collector.one(name).span_id
            assert received.get("traceparent") == f"00-{CLIENT_TRACE}-{span_id}-01", received
            assert received.get("tracestate") == CLIENT_TRACESTATE, received


def test_traced_router_starts_a_trace_when_the_client_sends_none() -> None:
    with serve_collector() as collector:
        prefill_headers, decode_headers = _traced_request(collector, "sglang", {})
        _wait_for_request_spans(collector)
        server = collector.one(SERVER_SPAN)
        assert server.parent_span_id == ""
        for name, received in [("pdr.prefill", prefill_headers), ("pdr.decode", decode_headers)]:
            span = collector.one(name)
            assert _parts(received["traceparent"]) == (server.trace_id, span.span_id, True)
            assert "tracestate" not in received
