"""Closed-loop HTTP/1.1 load generator for loopback targets.

Lean by construction: uvloop, one asyncio.Protocol per virtual user over a keep-alive TCP
connection (TCP_NODELAY), the request bytes built once, and a hand-written incremental response
parser that inspects body bytes only to time the first SSE event and count events. Run it in its
own process (``python -m bench.load.loadgen``) so its CPU is not charged to the system under test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import msgspec
import uvloop

from bench.common.cpu import cpu_delta, cpu_snapshot
from bench.common.stats import Percentiles, percentiles

__all__ = [
    "LOOPBACK_HOSTS",
    "LoadResult",
    "ProtocolError",
    "ResponseParser",
    "build_request",
    "completion_body",
    "run_load",
]

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_PATH = "/v1/completions"
_MAX_ERROR_SAMPLES = 5
_ERROR_BODY_BYTES = 300

# Parser states (indices into ResponseParser._steps).
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class ProtocolError(Exception):
    """The server sent something that is not a valid HTTP/1.1 response."""


# ---------------------------------------------------------------------------------------------
# Response parser
# ---------------------------------------------------------------------------------------------


class ResponseParser:
    """Incremental parser for one HTTP/1.1 response at a time.

    ``feed()`` returns True once the whole response (head and body) has been read. The body is
    not kept: for ``text/event-stream`` responses the ``data:`` fields are counted, otherwise
    only the arrival of the first body byte is noted. Raises ``ProtocolError`` on bad framing.
    """

    __slots__ = (
        "_buf",
        "_pos",
        "_remaining",
        "_state",
        "_steps",
        "_tail",
        "body_started",
        "data_fields",
        "done_marker",
        "error_body",
        "keep_alive",
        "sse",
        "status",
    )

    def __init__(self) -> None:
        self._buf = b""
        self._steps = (
            self._head,
            self._length,
            self._chunk_size,
            self._chunk_data,
            self._chunk_end,
            self._trailer,
            self._until_close,
        )
        self.reset()

    def reset(self) -> None:
        """Forget everything; ready for the next response on the same connection."""
        self._buf = b""
        self._pos = 0
        self._remaining = 0
        self._state = _HEAD
        self._tail = b""
        self.status = 0
        self.keep_alive = True
        self.sse = False
        self.body_started = False
        self.data_fields = 0
        self.done_marker = False
        self.error_body = b""

    @property
    def complete(self) -> bool:
        return self._state == _DONE

    @property
    def first_output(self) -> bool:
        """True once the first SSE event (or, for non-SSE, the first body byte) has arrived."""
        return self.data_fields > 0 if self.sse else self.body_started

    @property
    def events(self) -> int:
        """SSE ``data:`` events received, not counting the final ``[DONE]``."""
        return self.data_fields - 1 if self.done_marker else self.data_fields

    def feed(self, data: bytes) -> bool:
        """Consume bytes from the socket; True when the response is complete."""
        # Immutable bytes plus an offset: in the common case (a read holds whole chunks) nothing
        # is appended or shifted, and leftovers are rare and small.
        self._buf = self._buf[self._pos :] + data if self._pos < len(self._buf) else data
        self._pos = 0
        steps = self._steps
        while self._state != _DONE and steps[self._state]():
            pass
        return self._state == _DONE

    def feed_eof(self) -> bool:
        """The peer closed its side; True if that completes a read-until-close body."""
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
        return self._state == _DONE

    # -- states: each returns True if it made progress and parsing can go on -----------------

    def _head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n", self._pos)
        if end < 0:
            return False
        head = self._buf[self._pos : end]
        self._pos = end + 4
        self._apply_head(head)
        return True

    def _length(self) -> bool:
        return self._consume_body(_DONE)

    def _chunk_data(self) -> bool:
        return self._consume_body(_CHUNK_END)

    def _chunk_size(self) -> bool:
        buf = self._buf
        end = buf.find(b"\r\n", self._pos)
        if end < 0:
            return False
        size = _parse_chunk_size(buf[self._pos : end])
        start = end + 2
        stop = start + size
        if size == 0:
            self._pos = start
            self._state = _TRAILER
        elif buf[stop : stop + 2] == b"\r\n":
            # Fast path: the whole chunk (one SSE event, typically) is already here.
            self._on_body(buf[start:stop])
            self._pos = stop + 2
        else:
            self._pos = start
            self._remaining = size
            self._state = _CHUNK_DATA
        return True

    def _chunk_end(self) -> bool:
        if len(self._buf) - self._pos < 2:
            return False
        if self._buf[self._pos : self._pos + 2] != b"\r\n":
            raise ProtocolError("chunk not terminated by CRLF")
        self._pos += 2
        self._state = _CHUNK_SIZE
        return True

    def _trailer(self) -> bool:
        end = self._buf.find(b"\r\n", self._pos)
        if end < 0:
            return False
        empty = end == self._pos
        self._pos = end + 2
        if empty:
            self._state = _DONE
        return True

    def _until_close(self) -> bool:
        if len(self._buf) > self._pos:
            self._on_body(self._buf[self._pos :])
            self._pos = len(self._buf)
        return False

    # -- helpers -----------------------------------------------------------------------------

    def _consume_body(self, next_state: int) -> bool:
        available = len(self._buf) - self._pos
        if available == 0:
            return False
        take = min(available, self._remaining)
        self._on_body(self._buf[self._pos : self._pos + take])
        self._pos += take
        self._remaining -= take
        if self._remaining == 0:
            self._state = next_state
        return True

    def _on_body(self, chunk: bytes) -> None:
        self.body_started = True
        if self.status >= 400 and len(self.error_body) < _ERROR_BODY_BYTES:
            self.error_body += chunk[: _ERROR_BODY_BYTES - len(self.error_body)]
        if not self.sse:
            return
        self.data_fields += chunk.count(b"data:")
        if b"[DONE]" in chunk:
            self.done_marker = True
        tail = self._tail
        if tail:
            # A marker split across reads or chunks: look only at the seam, so none counts twice.
            self.data_fields += (tail[-4:] + chunk[:4]).count(b"data:")
            if b"[DONE]" in tail + chunk[:5]:
                self.done_marker = True
        # Neither marker contains a newline, so none can straddle a chunk that ends with one
        # (the usual case: one whole SSE event per chunk) and no tail needs to be kept.
        self._tail = b"" if chunk.endswith(b"\n") else (tail + chunk)[-5:]

    def _apply_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, status = _parse_status_line(lines[0])
        if 100 <= status < 200:
            return  # interim response (100 Continue): the real head follows
        headers = _parse_headers(lines[1:])
        self.status = status
        self.keep_alive = _keep_alive(version, headers.get(b"connection", b""))
        self.sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        self._state = self._body_state(status, headers)

    def _body_state(self, status: int, headers: Mapping[bytes, bytes]) -> int:
        if status in (204, 304):
            return _DONE
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            return _CHUNK_SIZE
        length = headers.get(b"content-length")
        if length is None:
            self.keep_alive = False
            return _UNTIL_CLOSE
        try:
            self._remaining = int(length)
        except ValueError as exc:
            raise ProtocolError(f"bad Content-Length {length!r}") from exc
        return _LENGTH if self._remaining > 0 else _DONE


def _parse_status_line(line: bytes) -> tuple[bytes, int]:
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ProtocolError(f"bad status line {line[:80]!r}")
    try:
        return parts[0], int(parts[1])
    except ValueError as exc:
        raise ProtocolError(f"bad status code in {line[:80]!r}") from exc


def _parse_headers(lines: Sequence[bytes]) -> dict[bytes, bytes]:
    headers: dict[bytes, bytes] = {}
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ProtocolError(f"bad header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return headers


def _keep_alive(version: bytes, connection: bytes) -> bool:
    tokens = {token.strip() for token in connection.lower().split(b",")}
    if version == b"HTTP/1.0":
        return b"keep-alive" in tokens
    return b"close" not in tokens


def _parse_chunk_size(line: bytes) -> int:
    try:
        return int(line, 16) if b";" not in line else int(line.split(b";", 1)[0], 16)
    except ValueError as exc:
        raise ProtocolError(f"bad chunk size line {line[:80]!r}") from exc


# ---------------------------------------------------------------------------------------------
# Request building
# ---------------------------------------------------------------------------------------------


def completion_body(
    *,
    model: str = "fake-model",
    prompt: str = "Hello, PD router!",
    max_tokens: int = 16,
    stream: bool = True,
    extra: Mapping[str, object] | None = None,
) -> bytes:
    """JSON body of an OpenAI ``/v1/completions`` request, plus ``extra`` fields."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    payload.update(extra or {})
    return json.dumps(payload, separators=(",", ":")).encode()


def build_request(
    host: str, port: int, path: str, body: bytes, headers: Sequence[str] = ()
) -> bytes:
    """The complete bytes of a keep-alive ``POST`` with a JSON body (``headers``: more
    ``Name: value`` lines, e.g. an ``Authorization``)."""
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    more = "".join(f"{line}\r\n" for line in headers)
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: {authority}\r\n"
        "User-Agent: pd-router-bench\r\n"
        "Accept: */*\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{more}"
        "\r\n"
    )
    return head.encode("ascii") + body


def check_loopback(host: str) -> None:
    """Raise ``ValueError`` unless ``host`` is a loopback name this tool may load."""
    if host not in LOOPBACK_HOSTS:
        allowed = ", ".join(sorted(LOOPBACK_HOSTS))
        raise ValueError(f"refusing non-loopback target {host!r} (allowed: {allowed})")


# ---------------------------------------------------------------------------------------------
# Connection
# ---------------------------------------------------------------------------------------------


class Sample(NamedTuple):
    status: int
    ttft_s: float
    latency_s: float
    events: int
    detail: bytes = b""  # start of the body of an error response


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = ResponseParser()
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[Sample] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._t_start = 0.0
        self._t_first = 0.0
        self.usable = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport is not an asyncio.Transport subclass, hence a cast, not a check.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.usable = True

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            self._fail(ProtocolError("unsolicited data from server"))
            return
        now = time.perf_counter()
        try:
            done = self._parser.feed(data)
        except ProtocolError as exc:
            self._fail(exc)
            return
        if not self._t_first and self._parser.first_output:
            self._t_first = now
        if done:
            self._complete(now)

    def eof_received(self) -> bool:
        self.usable = False
        if self._waiter is not None and self._parser.feed_eof():
            self._complete(time.perf_counter())
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.usable = False
        self._transport = None
        self._settle(None, exc or ConnectionResetError("server closed the connection"))

    # -- API -------------------------------------------------------------------------------

    def request(self, payload: bytes, timeout: float) -> asyncio.Future[Sample]:
        """Write one request; the future resolves with its Sample or fails with an OSError."""
        transport = self._transport
        if transport is None or not self.usable:
            raise ConnectionResetError("connection is not usable")
        self._parser.reset()
        self._t_first = 0.0
        self._waiter = waiter = self._loop.create_future()
        self._timer = self._loop.call_later(timeout, self._on_timeout)
        self._t_start = time.perf_counter()
        transport.write(payload)
        return waiter

    def close(self) -> None:
        self.usable = False
        if self._transport is not None:
            self._transport.close()

    # -- internals -------------------------------------------------------------------------

    def _complete(self, now: float) -> None:
        parser = self._parser
        if not parser.keep_alive:
            self.close()
        first = self._t_first or now
        t0 = self._t_start
        sample = Sample(parser.status, first - t0, now - t0, parser.events, parser.error_body)
        self._settle(sample, None)

    def _on_timeout(self) -> None:
        self._timer = None
        self._fail(TimeoutError("request timed out"))

    def _fail(self, exc: Exception) -> None:
        self._settle(None, exc)
        if self._transport is not None:
            self._transport.abort()
        self.usable = False

    def _settle(self, sample: Sample | None, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.done():
            return
        if sample is not None:
            waiter.set_result(sample)
        else:
            waiter.set_exception(exc or ConnectionResetError("connection failed"))


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


class LoadResult(msgspec.Struct, frozen=True):
    """Outcome of one closed-loop measurement (warmup excluded)."""

    concurrency: int
    completed: int
    errors: int
    wall_s: float
    rps: float
    ttft_ms: Percentiles
    latency_ms: Percentiles
    events_per_request: float
    statuses: dict[str, int]
    error_samples: list[str]
    loadgen_cpu_s: float
    watched_cpu_s: dict[str, float]

    def summary(self) -> str:
        """One human-readable line."""
        t, lat = self.ttft_ms, self.latency_ms
        cpu_ms = 1000.0 * self.loadgen_cpu_s / max(self.completed + self.errors, 1)
        return (
            f"c={self.concurrency} ok={self.completed} err={self.errors} wall={self.wall_s:.2f}s "
            f"rps={self.rps:.1f} ttft p50/p90/p99={t.p50:.2f}/{t.p90:.2f}/{t.p99:.2f}ms "
            f"lat p50/p90/p99={lat.p50:.2f}/{lat.p90:.2f}/{lat.p99:.2f}ms "
            f"events/req={self.events_per_request:.1f} loadgen_cpu={cpu_ms:.3f}ms/req"
        )


@dataclass
class _Tally:
    """Per-run accumulators; owned by one _Run."""

    ttft: array[float] = field(default_factory=lambda: array("d"))
    latency: array[float] = field(default_factory=lambda: array("d"))
    events: int = 0
    errors: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)

    def add(self, sample: Sample) -> None:
        self.statuses[sample.status] += 1
        if 200 <= sample.status < 300:
            self.ttft.append(sample.ttft_s)
            self.latency.append(sample.latency_s)
            self.events += sample.events
        else:
            detail = sample.detail.decode(errors="replace")
            self.error(f"HTTP {sample.status}: {detail}".rstrip(": "))

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < _MAX_ERROR_SAMPLES:
            self.error_samples.append(what)


# ---------------------------------------------------------------------------------------------
# Closed loop
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSpec:
    """What to send and for how long."""

    host: str
    port: int
    concurrency: int
    requests: int
    duration: float
    warmup: int
    payload: bytes
    timeout: float


class _Run:
    """State of one closed-loop run: request budget, deadline and tally."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.tally = _Tally()
        self._issued = 0
        self._deadline = 0.0
        self._warm_users = 0
        self.all_warm = asyncio.Event()
        self.go = asyncio.Event()

    def start(self) -> None:
        """Open the measured phase (call after ``all_warm``)."""
        self._deadline = time.perf_counter() + self.spec.duration
        self.go.set()

    def _take(self) -> bool:
        if self._issued >= self.spec.requests or time.perf_counter() >= self._deadline:
            return False
        self._issued += 1
        return True

    async def user(self) -> None:
        """One virtual user: warm up, wait for the start signal, then loop until the budget ends."""
        conn: _Connection | None = None
        try:
            for _ in range(self.spec.warmup):
                conn, _sample = await self._exchange(conn)
            self._warm_users += 1
            if self._warm_users == self.spec.concurrency:
                self.all_warm.set()
            await self.go.wait()
            while self._take():
                conn, sample = await self._exchange(conn)
                if sample is not None:
                    self.tally.add(sample)
        finally:
            if conn is not None:
                conn.close()

    async def _exchange(self, conn: _Connection | None) -> tuple[_Connection | None, Sample | None]:
        """One request; on failure record the error and return no connection (reconnect next)."""
        try:
            if conn is None or not conn.usable:
                conn = await self._connect()
            return conn, await conn.request(self.spec.payload, self.spec.timeout)
        except (OSError, ProtocolError) as exc:
            if self.go.is_set():
                self.tally.error(f"{type(exc).__name__}: {exc}")
            if conn is not None:
                conn.close()
            return None, None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        connect = loop.create_connection(lambda: _Connection(loop), self.spec.host, self.spec.port)
        _transport, conn = await asyncio.wait_for(connect, self.spec.timeout)
        return conn


async def run_load(
    host: str,
    port: int,
    *,
    concurrency: int,
    requests: int,
    duration: float,
    warmup: int,
    body: bytes,
    path: str = DEFAULT_PATH,
    request_timeout: float = 30.0,
    watch_pids: Mapping[str, int] | None = None,
    headers: Sequence[str] = (),
) -> LoadResult:
    """Run ``concurrency`` closed-loop users against ``host:port`` and measure.

    Each user first sends ``warmup`` uncounted requests; the measured phase then stops after
    ``requests`` requests in total or ``duration`` seconds, whichever comes first (requests in
    flight at the deadline are finished and counted); each request fails as an error after
    ``request_timeout`` seconds. CPU seconds of ``watch_pids`` (process
    trees) and of this process are sampled exactly at the measured phase's start and end.
    Raises ``ValueError`` for a non-loopback host or a non-positive budget.
    """
    check_loopback(host)
    if concurrency < 1 or requests < 1 or duration <= 0:
        raise ValueError("concurrency, requests and duration must be positive")
    spec = LoadSpec(
        host,
        port,
        concurrency,
        requests,
        duration,
        warmup,
        build_request(host, port, path, body, headers),
        request_timeout,
    )
    return await _measure(_Run(spec), dict(watch_pids or {}))


async def _measure(run: _Run, watch: dict[str, int]) -> LoadResult:
    users = [asyncio.create_task(run.user()) for _ in range(run.spec.concurrency)]
    try:
        await _wait_warm(run, users)
        cpu_before, own_before = cpu_snapshot(watch), time.process_time()
        t0 = time.perf_counter()
        run.start()
        await asyncio.gather(*users)
        wall = time.perf_counter() - t0
        watched = cpu_delta(cpu_before, cpu_snapshot(watch))
        return _result(run, wall, time.process_time() - own_before, watched)
    finally:
        for task in users:
            task.cancel()
        await asyncio.gather(*users, return_exceptions=True)


async def _wait_warm(run: _Run, users: Sequence[asyncio.Task[None]]) -> None:
    """Wait until every user has finished its warmup; re-raise if a user crashed."""
    warm = asyncio.ensure_future(run.all_warm.wait())
    try:
        await asyncio.wait([warm, *users], return_when=asyncio.FIRST_COMPLETED)
    finally:
        warm.cancel()
    for task in users:
        if task.done():
            task.result()  # a user can only end early by raising


def _result(run: _Run, wall: float, own_cpu: float, watched: dict[str, float]) -> LoadResult:
    tally = run.tally
    completed = len(tally.latency)
    return LoadResult(
        concurrency=run.spec.concurrency,
        completed=completed,
        errors=tally.errors,
        wall_s=wall,
        rps=completed / wall if wall > 0 else 0.0,
        ttft_ms=percentiles(tally.ttft),
        latency_ms=percentiles(tally.latency),
        events_per_request=tally.events / completed if completed else 0.0,
        statuses={str(code): count for code, count in sorted(tally.statuses.items())},
        error_samples=list(tally.error_samples),
        loadgen_cpu_s=own_cpu,
        watched_cpu_s=watched,
    )


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _parse_watch(items: Sequence[str]) -> dict[str, int]:
    watch: dict[str, int] = {}
    for item in items:
        name, sep, pid = item.partition("=")
        if not sep or not pid.isdigit():
            raise argparse.ArgumentTypeError(f"--watch expects NAME=PID, got {item!r}")
        watch[name] = int(pid)
    return watch


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--extra is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra must be a JSON object")
    return value


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load.loadgen", description="Closed-loop HTTP/1.1 load generator."
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="loopback base URL")
    parser.add_argument("--path", default=None, help=f"request path (default {DEFAULT_PATH})")
    parser.add_argument("-c", "--concurrency", type=int, default=32)
    parser.add_argument("-n", "--requests", type=int, default=2000, help="max measured requests")
    parser.add_argument("-d", "--duration", type=float, default=20.0, help="max measured seconds")
    parser.add_argument("--warmup", type=int, default=3, help="uncounted requests per user")
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--prompt", default="Hello, PD router!")
    parser.add_argument(
        "--extra",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="JSON object of extra fields merged into the request body",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request timeout (s)")
    parser.add_argument(
        "--watch",
        action="append",
        default=[],
        metavar="NAME=PID",
        help="report CPU seconds of this process tree over the measured phase (repeatable)",
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="one more request header (repeatable), e.g. an Authorization",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser.parse_args(argv)


def _header(line: str) -> str:
    name, sep, value = line.partition(":")
    if not sep or not name.strip() or any(c in line for c in "\r\n"):
        raise ValueError(f"--header expects 'NAME: VALUE' on one line, got {line!r}")
    return f"{name.strip()}: {value.strip()}"


def _target(url: str, path: str | None) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"expected an http:// URL, got {url!r}")
    return parts.hostname, parts.port or 80, path or parts.path.rstrip("/") or DEFAULT_PATH


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        host, port, path = _target(args.url, args.path)
        check_loopback(host)
        watch = _parse_watch(args.watch)
        headers = [_header(line) for line in args.header]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    body = completion_body(
        model=args.model,
        prompt=args.prompt,
        max_tokens=args.tokens,
        stream=args.stream,
        extra=args.extra,
    )
    result = uvloop.run(
        run_load(
            host,
            port,
            concurrency=args.concurrency,
            requests=args.requests,
            duration=args.duration,
            warmup=args.warmup,
            body=body,
            path=path,
            request_timeout=args.timeout,
            watch_pids=watch,
            headers=headers,
        )
    )
    print(msgspec.json.encode(result).decode() if args.json else result.summary())
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
