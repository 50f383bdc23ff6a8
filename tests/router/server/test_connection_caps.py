"""Connection caps (issue 21 item 6): one source cannot take every connection slot, and idle
keep-alive connections make room at the global cap.

One real ``router`` process with ``--max-connections 60`` (so 30 per source by default) in
front of fake engines, driven over raw sockets from several loopback addresses (Linux routes
all of 127/8 to ``lo``: 127.0.0.2 and 127.0.0.3 are distinct sources on this machine).
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from testkit.fake_engine import FakeEngine
from testkit.polling import wait_until
from testkit.servers import free_port, http_process, run_servers
from tests.router.pipeline.test_protocols import COMPLETION

MAX_CONNECTIONS = 60
PER_SOURCE = MAX_CONNECTIONS // 2  # the default
TIMEOUT_S = 2.0  # --header-timeout: the slowloris connections below hold for this long
HEALTH = b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n"


@dataclass
class Router:
    url: str
    port: int
    process: subprocess.Popen[str]

    def held_from(self, source: str) -> int:
        """The router's connections from ``source`` not closed on its side yet (established or
        waiting for the router to close), from ``/proc/net/tcp``."""
        port = f"{self.port:04X}"
        peer = socket.inet_aton(source)[::-1].hex().upper()  # little-endian, as the kernel has it
        held = 0
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            local, remote, state = line.split()[1:4]
            if local.endswith(":" + port) and remote.startswith(peer) and state in ("01", "08"):
                held += 1
        return held


@pytest.fixture(scope="module")
def router() -> Iterator[Router]:
    prefill = FakeEngine("prefill", "vllm-mooncake")
    decode = FakeEngine("decode", "vllm-mooncake")
    with run_servers(prefill.app, prefill.bootstrap_app, decode.app) as (p, b, d):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        flags = [
            *("--prefill", f"http://127.0.0.1:{p}", str(b), "--decode", f"http://127.0.0.1:{d}"),
            *("--port", str(port), "--health-interval", "0.2"),
            *("--header-timeout", str(TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)),
        ]
        argv = [sys.executable, "-m", "router", *flags]
        with http_process(argv, url, path="/ready", timeout=20) as process:
            yield Router(url, port, process)
            process.terminate()
            output, _ = process.communicate(timeout=15)
    assert "Traceback" not in output, output
    assert f"at most {MAX_CONNECTIONS} client connections, {PER_SOURCE} per source" in output


@contextlib.contextmanager
def connections(router: Router, source: str, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections to the router from ``source``; closed afterwards, and the router
    seen to have closed its side too."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection(
                ("127.0.0.1", router.port), timeout=5, source_address=(source, 0)
            )
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()
        wait_until(lambda: not router.held_from(source), 10, f"the router to close {source}'s")


def _read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes (a reset ends it too)."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, leaving the connection open."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def _completion(router: Router, source: str) -> int:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=5) as client:
        return client.post(router.url + "/v1/completions", json=COMPLETION).status_code


def test_one_source_at_its_cap_leaves_the_rest_to_others(router: Router) -> None:
    """127.0.0.2 opens the whole global cap of slowloris connections: it gets its half, the
    rest is refused at once, and 127.0.0.3 is served before the header timeout frees any."""
    with connections(router, "127.0.0.2", MAX_CONNECTIONS) as slow:
        for sock in slow:
            with contextlib.suppress(OSError):  # those refused may be closed already
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nx-slow: ")
        assert _completion(router, "127.0.0.3") == 200  # well within the header timeout
        answers = [_read_all(sock, timeout=TIMEOUT_S + 3) for sock in slow]
    refused = [raw for raw in answers if raw.startswith(b"HTTP/1.1 503 ")]
    timed_out = [raw for raw in answers if raw.startswith(b"HTTP/1.1 408 ")]
    assert len(refused) == MAX_CONNECTIONS - PER_SOURCE, [raw[:12] for raw in answers]
    assert len(timed_out) == PER_SOURCE
    error = json.loads(refused[0].partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == 503
    assert f"maximum of {PER_SOURCE} connections" in error["message"]


def test_at_the_cap_the_heaviest_sources_longest_idle_connection_makes_room(
    router: Router,
) -> None:
    """The global cap is held by idle keep-alive connections (from three sources, within their
    own caps): a new client is served, and the connection closed for it is the longest idle of
    the source holding the most, not the lone client's older one."""
    with (
        connections(router, "127.0.0.3", 1) as lone,
        connections(router, "127.0.0.2", PER_SOURCE) as heavy,
        connections(router, "127.0.0.5", PER_SOURCE - 1) as rest,
    ):
        idle = lone + heavy + rest
        for sock in idle:  # one request each, in order: lone[0] is the longest idle
            sock.sendall(HEALTH)
            assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        assert _completion(router, "127.0.0.4") == 200
        assert _read_all(heavy[0], timeout=5) == b""  # evicted: closed without a word
        others = [sock for sock in idle if sock is not heavy[0]]
        readable, _, _ = select.select(others, [], [], 0)
        assert not readable, "only the heaviest source's longest idle connection is closed"
        lone[0].sendall(HEALTH)  # the others still serve
        assert _read_response(lone[0]).startswith(b"HTTP/1.1 200 ")


def test_without_an_idle_connection_the_cap_still_refuses(router: Router) -> None:
    """Connections in the middle of a request are never evicted: at the cap with none idle,
    the new connection gets 503 (and a client served later, once they end, is fine)."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-length: 100\r\n\r\n{"
    with (
        connections(router, "127.0.0.2", PER_SOURCE) as first,
        connections(router, "127.0.0.3", PER_SOURCE) as second,
    ):
        for sock in first + second:  # each a body in progress
            sock.sendall(head)
        with connections(router, "127.0.0.4", 1) as (extra,):
            raw = _read_all(extra)
        assert raw.startswith(b"HTTP/1.1 503 "), raw[:100]
        assert b"maximum of 60 connections" in raw
        assert not select.select(first + second, [], [], 0)[0]  # none of them was touched
