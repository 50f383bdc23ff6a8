"""bench.load.loadgen: the HTTP/1.1 response parser and the closed loop against raw asyncio
servers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from bench.common.stats import percentiles
from bench.load.loadgen import (
    LoadResult,
    ProtocolError,
    ResponseParser,
    build_request,
    check_loopback,
    completion_body,
    run_load,
)

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
EVENTS = [b'data: {"t":%d}\n\n' % i for i in range(16)] + [b"data: [DONE]\n\n"]


def chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


def feed_in_steps(parser: ResponseParser, data: bytes, step: int) -> tuple[bool, int]:
    """Feed ``data`` ``step`` bytes at a time; (complete, offset of the first output)."""
    done, first_at = False, -1
    for offset in range(0, len(data), step):
        assert not done
        done = parser.feed(data[offset : offset + step])
        if first_at < 0 and parser.first_output:
            first_at = offset
    return done, first_at


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 64, 10_000])
def test_sse_chunked_in_any_read_sizes(step: int) -> None:
    data = SSE_HEAD + chunked(EVENTS)
    parser = ResponseParser()
    done, first_at = feed_in_steps(parser, data, step)
    assert done and parser.status == 200 and parser.sse and parser.keep_alive
    assert parser.events == 16 and parser.done_marker
    assert first_at + step > len(SSE_HEAD) + 4  # first event only after the head


@pytest.mark.parametrize("split", [1, 2, 3, 4, 5, 6, 7, 11])
@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_events_split_across_http_chunks(split: int, step: int) -> None:
    stream = b"".join(EVENTS)
    data = SSE_HEAD + chunked([stream[i : i + split] for i in range(0, len(stream), split)])
    parser = ResponseParser()
    assert feed_in_steps(parser, data, step)[0]
    assert parser.events == 16 and parser.done_marker


def test_chunk_extension_and_trailer() -> None:
    body = b"".join(EVENTS)
    data = SSE_HEAD + b"%x;ext=1\r\n" % len(body) + body + b"\r\n0\r\nX-T: 1\r\n\r\n"
    parser = ResponseParser()
    assert parser.feed(data) and parser.events == 16


def test_reset_reuses_the_parser() -> None:
    parser = ResponseParser()
    assert parser.feed(SSE_HEAD + chunked(EVENTS[:3]))
    assert parser.events == 3 and not parser.done_marker
    parser.reset()
    assert parser.feed(SSE_HEAD + chunked(EVENTS)) and parser.events == 16


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_content_length(step: int) -> None:
    body = b'{"x": 1}'
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: application/json\r\n\r\n"
    parser = ResponseParser()
    assert feed_in_steps(parser, head % len(body) + body, step)[0]
    assert not parser.sse and parser.events == 0 and parser.body_started


def test_interim_response_then_error_with_close() -> None:
    data = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 4\r\n\r\nnope"
    )
    parser = ResponseParser()
    assert parser.feed(data) and parser.status == 404 and not parser.keep_alive
    assert parser.error_body == b"nope"


def test_body_until_close() -> None:
    parser = ResponseParser()
    assert not parser.feed(b"HTTP/1.0 200 OK\r\n\r\nhello")
    assert parser.feed_eof() and not parser.keep_alive and parser.body_started


def test_http10_keep_alive() -> None:
    parser = ResponseParser()
    data = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n"
    assert parser.feed(data) and parser.keep_alive


@pytest.mark.parametrize(
    "data",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nnocolon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nabc",
    ],
)
def test_bad_framing_raises(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        ResponseParser().feed(data)


def test_percentiles_interpolate_like_numpy() -> None:
    p = percentiles([i / 1000 for i in range(1, 101)])
    assert p.p50 == pytest.approx(50.5) and p.p99 == pytest.approx(99.01)
    assert percentiles([]).p50 == 0.0


def test_request_bytes_and_loopback_guard() -> None:
    request = build_request("::1", 80, "/v1/completions", b"{}")
    assert b"Host: [::1]:80\r\n" in request and b"Content-Length: 2\r\n" in request
    assert request.endswith(b"\r\n\r\n{}")
    assert b'"bootstrap_room":1' in completion_body(extra={"bootstrap_room": 1})
    check_loopback("localhost")
    with pytest.raises(ValueError, match="non-loopback"):
        check_loopback("10.0.0.1")


# -- the closed loop against a raw asyncio server -------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)


async def _load(reply: Handler, **overrides: float) -> tuple[LoadResult, int]:
    """Serve ``reply`` per request (False closes the connection); (result, requests served)."""
    served = 0
    handlers: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        try:
            while True:
                await _read_request(reader)
                served += 1
                if not await reply(reader, writer, served):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        await serve(reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    args: dict[str, float] = {"concurrency": 4, "requests": 60, "duration": 10, "warmup": 0}
    args.update(overrides)
    try:
        result = await run_load(
            "127.0.0.1",
            port,
            concurrency=int(args["concurrency"]),
            requests=int(args["requests"]),
            duration=args["duration"],
            warmup=int(args["warmup"]),
            body=completion_body(),
            request_timeout=args.get("request_timeout", 30.0),
        )
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
    return result, served


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


async def test_keep_alive_loop_counts_every_request() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> bool:
        await _send(w, OK)
        return True

    result, served = await _load(reply)
    assert result.completed == 60 and result.errors == 0 and served == 60
    assert result.rps > 0 and result.latency_ms.p50 > 0


async def test_connection_close_reconnects() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> bool:
        await _send(w, b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        return False

    result, _ = await _load(reply)
    assert result.completed == 60 and result.errors == 0


async def test_sse_events_over_http10_until_close() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> bool:
        head = b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
        await _send(w, head + b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n")
        return False

    result, _ = await _load(reply)
    assert result.completed == 60 and result.events_per_request == 2.0


async def test_truncated_response_is_an_error() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if n % 3:
            await _send(w, OK)
            return True
        await _send(w, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        return False

    result, _ = await _load(reply)
    assert result.completed + result.errors == 60 and result.errors > 0


async def test_status_errors_keep_the_body_start() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        await _send(w, OK if n % 2 else b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\nboom")
        return True

    result, _ = await _load(reply)
    assert result.errors == 30 and result.statuses == {"200": 30, "500": 30}
    assert result.error_samples[0] == "HTTP 500: boom"


async def test_hung_request_times_out() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if n % 5 == 0:
            await asyncio.sleep(3600)
        await _send(w, OK)
        return True

    result, _ = await _load(reply, requests=20, request_timeout=0.2)
    assert result.completed + result.errors == 20 and result.errors > 0
    assert result.error_samples[0].startswith("TimeoutError")


async def test_warmup_is_not_counted_and_duration_bounds_the_run() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> bool:
        await _send(w, OK)
        return True

    result, served = await _load(reply, warmup=3, requests=10**9, duration=0.3)
    assert result.completed == served - 12 > 0
    assert 0.25 < result.wall_s < 1.5


async def test_refused_connections_are_errors() -> None:
    result = await run_load(
        "127.0.0.1", 1, concurrency=2, requests=10, duration=5, warmup=0, body=b"{}"
    )
    assert result.errors == 10 and result.completed == 0


async def test_non_loopback_target_is_refused() -> None:
    with pytest.raises(ValueError, match="non-loopback"):
        await run_load("8.8.8.8", 80, concurrency=1, requests=1, duration=1, warmup=0, body=b"")
