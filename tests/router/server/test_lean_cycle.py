"""A response's head leaves in the same write as its first body bytes (one system call fewer
per answer), through uvicorn's own cycle with all its checks."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl

from router.server.http_limits import HttpLimits, limited_http_protocol
from router.server.lean_cycle import LeanCycle
from router.types import CLIENT_GONE, Receive, Scope, Send
from testkit.polling import wait_until
from testkit.servers import TestServer, serving


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def _cycle(transport: _Transport, *, keep_alive: bool = True) -> LeanCycle:
    scope = {"type": "http", "method": "POST", "path": "/", "http_version": "1.1"}
    return LeanCycle(
        scope=scope,  # type: ignore[arg-type]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=[],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )


async def test_a_whole_answer_is_one_write() -> None:
    transport = _Transport()
    cycle = _cycle(transport)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
    await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
    assert transport.writes == []
    await cycle.send({"type": "http.response.body", "body": b"{}", "more_body": False})
    (write,) = transport.writes
    assert write.startswith(b"HTTP/1.1 200 OK\r\n") and write.endswith(b"\r\n\r\n{}")
    assert cycle.response_complete


async def test_a_stream_head_goes_with_its_first_chunk_then_each_chunk_alone() -> None:
    transport = _Transport()
    cycle = _cycle(transport)
    start = {"type": "http.response.start", "status": 200, "headers": []}
    await cycle.send(start)
    await cycle.send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await cycle.send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
    await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
    first, second, last = transport.writes
    assert b"transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n" in first
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert second == b"9\r\ndata: 2\n\n\r\n" and last == b"0\r\n\r\n"


async def test_a_closing_connection_still_gets_the_head_before_it_closes() -> None:
    transport = _Transport()
    cycle = _cycle(transport, keep_alive=False)
    headers = [(b"content-length", b"0")]
    await cycle.send({"type": "http.response.start", "status": 204, "headers": headers})
    await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
    assert b"".join(transport.writes).startswith(b"HTTP/1.1 204 No Content\r\n")
    assert transport.closed


async def test_uvicorns_checks_still_apply_to_the_head() -> None:
    cycle = _cycle(_Transport())
    bad = [(b"x-bad", b"a\r\nb")]
    with pytest.raises(RuntimeError, match="Invalid HTTP header value"):
        await cycle.send({"type": "http.response.start", "status": 200, "headers": bad})


def test_the_client_leaving_resolves_the_scope_future_on_the_routers_server() -> None:
    """Served with the router's protocol: a request learns that its client left from a future
    in its scope, without a task blocked in ``receive()``."""
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        gone = scope[CLIENT_GONE]
        seen.append("waiting")
        await asyncio.wait_for(gone, 5.0)
        seen.append("gone")

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=limited_http_protocol(HttpLimits()),
        lifespan="off",
        log_config=None,
        access_log=False,
    )
    with serving([TestServer(config)], 10.0) as (port,):
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            wait_until(lambda: seen == ["waiting"], 5, "the request waiting")
        wait_until(lambda: seen == ["waiting", "gone"], 5, "the client's leaving seen")
