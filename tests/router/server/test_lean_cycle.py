"""A response's head leaves in the same write as its first body bytes (one system call fewer
per answer), through uvicorn's own cycle with all its checks; a whole answer sent as one
``WHOLE_RESPONSE`` message, and a stream's later chunks, are written by the cycle itself, but
never past uvicorn's write flow control."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from router.server.http_limits import HttpLimits, limited_http_protocol
from router.server.lean_cycle import LeanCycle
from router.types import CLIENT_GONE, WHOLE_RESPONSE, ASGIApp, Receive, Scope, Send
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


def _cycle(
    transport: _Transport,
    *,
    keep_alive: bool = True,
    method: str = "POST",
    on_response: list[int] | None = None,
    kind: type[RequestResponseCycle] = LeanCycle,
    default_headers: list[tuple[bytes, bytes]] | None = None,
) -> Any:  # a LeanCycle, or uvicorn's (whose send is typed for ASGI events, not test dicts)
    scope = {"type": "http", "method": method, "path": "/", "http_version": "1.1"}
    responses = on_response if on_response is not None else []
    return kind(
        scope=scope,  # type: ignore[arg-type]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=default_headers or [],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: responses.append(1),
    )


def _routers_server(app: ASGIApp) -> uvicorn.Config:
    """A real uvicorn server with the router's protocol, on a free loopback port."""
    return uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=limited_http_protocol(HttpLimits()),
        lifespan="off",
        log_config=None,
        access_log=False,
    )


def _whole(body: bytes, *headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"type": WHOLE_RESPONSE, "status": 200, "headers": list(headers), "body": body}


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


async def test_a_head_request_gets_its_head_though_no_body_bytes_carry_it() -> None:
    transport = _Transport()
    cycle = _cycle(transport, method="HEAD")
    headers = [(b"content-length", b"2")]
    await cycle.send({"type": "http.response.start", "status": 405, "headers": headers})
    await cycle.send({"type": "http.response.body", "body": b"{}", "more_body": False})
    (write,) = transport.writes
    assert write.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n")
    assert write.endswith(b"content-length: 2\r\n\r\n")


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ((b"x-bad", b"a\r\nb"), "Invalid HTTP header value"),
        ((b"x-request-id", b"a\r\nx-injected: 1"), "Invalid HTTP header value"),  # the router's
        ((b"x-ratelimit-reset-tokens", b"1s\x00"), "Invalid HTTP header value"),
        ((b"x bad", b"1"), "Invalid HTTP header name"),
    ],
)
async def test_uvicorns_checks_still_apply_to_the_head(
    bad: tuple[bytes, bytes], error: str
) -> None:
    for _ in range(2):  # the second time too (a name's check is remembered)
        cycle = _cycle(_Transport())
        with pytest.raises(RuntimeError, match=error):
            await cycle.send({"type": "http.response.start", "status": 200, "headers": [bad]})


async def test_a_whole_message_is_one_write_with_its_length_and_completes_the_response() -> None:
    transport, responses = _Transport(), list[int]()
    cycle = _cycle(transport, on_response=responses)
    await cycle.send(_whole(b'{"a":1}', (b"content-type", b"application/json")))
    (write,) = transport.writes
    head, body = write.split(b"\r\n\r\n")
    assert head.split(b"\r\n") == [
        b"HTTP/1.1 200 OK",
        b"content-type: application/json",
        b"content-length: 7",
    ]
    assert body == b'{"a":1}'
    assert cycle.response_complete and responses == [1] and not transport.closed


async def test_a_whole_message_on_a_closing_connection_says_so_and_closes() -> None:
    transport = _Transport()
    cycle = _cycle(transport, keep_alive=False)
    await cycle.send(_whole(b"{}"))
    assert b"\r\nconnection: close\r\n" in transport.writes[0] and transport.closed


async def test_a_whole_message_with_a_bad_header_gets_uvicorns_checks() -> None:
    cycle = _cycle(_Transport())
    with pytest.raises(RuntimeError, match="Invalid HTTP header value"):
        await cycle.send(_whole(b"{}", (b"content-type", b"a\r\nx-injected: 1")))


async def test_a_whole_message_to_a_head_request_has_no_body() -> None:
    transport = _Transport()
    await _cycle(transport, method="HEAD").send(_whole(b"{}"))
    assert b"".join(transport.writes).endswith(b"content-length: 2\r\n\r\n")


_OWN = [(b"server", b"uvicorn"), (b"date", b"Sat, 28 Nov 2026 22:00:00 GMT")]
_HEADS = {
    "the router's": [
        (b"content-type", b"text/event-stream"),
        (b"x-request-id", b"req-1"),
        (b"x-ratelimit-reset-requests", b"59.5s"),
        (b"x-ratelimit-remaining-tokens", b"1990"),
        (b"x-pdr-prefill", b"http://127.0.0.1:8100"),
        (b"x-pdr-attempts", b"1"),
    ],
    "another's": [(b"x-upstream", b"abc123"), (b"x-note", b"")],
    "none": [],
    "a tab in a value": [(b"x-note", b"a\tb")],
    "connection": [(b"connection", b"keep-alive, close")],
    "a length": [(b"content-length", b"9")],
}


@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("headers", list(_HEADS.values()), ids=list(_HEADS))
async def test_a_response_is_written_byte_for_byte_as_uvicorn_writes_it(
    headers: list[tuple[bytes, bytes]], keep_alive: bool
) -> None:
    """A stream's head and a whole message, built here, are
    what uvicorn's own cycle writes for the same messages (its path takes the headers it
    reads)."""
    body = b"data: 1\n\n"
    written = {}
    for kind in (LeanCycle, RequestResponseCycle):
        transport = _Transport()
        cycle = _cycle(transport, keep_alive=keep_alive, kind=kind, default_headers=_OWN)
        await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
        await cycle.send({"type": "http.response.body", "body": body, "more_body": True})
        await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
        written[kind] = b"".join(transport.writes)
    assert written[LeanCycle] == written[RequestResponseCycle]
    if any(name == b"content-length" for name, _ in headers):
        return  # a whole message carries no length of its own
    transport = _Transport()
    whole = _cycle(transport, keep_alive=keep_alive, default_headers=_OWN)
    await whole.send(_whole(body, *headers))
    plain = _cycle(
        plain_transport := _Transport(),
        keep_alive=keep_alive,
        kind=RequestResponseCycle,
        default_headers=_OWN,
    )
    length = (b"content-length", b"%d" % len(body))
    await plain.send({"type": "http.response.start", "status": 200, "headers": [*headers, length]})
    await plain.send({"type": "http.response.body", "body": body, "more_body": False})
    assert b"".join(transport.writes) == b"".join(plain_transport.writes)


async def test_a_client_not_reading_holds_whole_answers_and_chunks_back() -> None:
    """Past the transport's high-water mark, nothing more is written until it drains."""
    transport = _Transport()
    cycle = _cycle(transport)
    cycle.flow.pause_writing()
    whole = asyncio.create_task(cycle.send(_whole(b"{}")))
    await asyncio.sleep(0)
    assert transport.writes == [] and not whole.done()
    cycle.flow.resume_writing()
    await asyncio.wait_for(whole, 5.0)
    assert transport.writes[0].endswith(b"\r\n\r\n{}")

    streaming = _cycle(transport := _Transport())
    await streaming.send({"type": "http.response.start", "status": 200, "headers": []})
    await streaming.send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    streaming.flow.pause_writing()
    chunk = {"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True}
    second = asyncio.create_task(streaming.send(chunk))
    await asyncio.sleep(0)
    assert len(transport.writes) == 1 and not second.done()
    streaming.flow.resume_writing()
    await asyncio.wait_for(second, 5.0)
    assert transport.writes[1] == b"9\r\ndata: 2\n\n\r\n"


def test_whole_messages_answer_requests_one_after_another_on_one_connection() -> None:
    """The router's server advertises the extension; a keep-alive connection goes on to its
    next request after a whole message."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert WHOLE_RESPONSE in scope["extensions"]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send(_whole(b"echo " + body, (b"content-type", b"text/plain")))

    with serving([TestServer(_routers_server(app))], 10.0) as (port,):
        _ask_three_times(port)


def _ask_three_times(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as client:
        for n in (1, 2, 3):
            client.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\n%d" % n)
            answer = b""
            while not answer.endswith(b"echo %d" % n):
                data = client.recv(4096)
                assert data, f"connection closed after {answer!r}"
                answer += data
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"content-length: 6\r\n" in answer


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

    with serving([TestServer(_routers_server(app))], 10.0) as (port,):
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            wait_until(lambda: seen == ["waiting"], 5, "the request waiting")
        wait_until(lambda: seen == ["waiting", "gone"], 5, "the client's leaving seen")
