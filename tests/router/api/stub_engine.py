"""A stand-in engine for the router's memory bounds: it never parses what it is sent (serve it
with ``lifespan="off"``).

``GET /health`` answers 200; a completion's body is drained (counted, not kept), then answered
as ``mode`` says: ``refuse`` (a small 400 error JSON), ``hang`` (nothing until the client leaves)
or ``flood`` (``status`` with ``answer_bytes`` of body in 1 MiB pieces, with a Content-Length or
chunked, until done or the client leaves). ``RouterProcess`` runs the router as a child process
(``python -m router``) in front of such engines, so that its RSS is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from testkit.servers import free_port, http_process

__all__ = ["RouterProcess", "StubEngine", "rss_bytes", "run_router"]

Message = MutableMapping[str, Any]
_PIECE = b"x" * (1 << 20)
_REFUSAL = b'{"error": {"message": "stub engine", "type": "BadRequestError", "code": 400}}'


@dataclass
class StubEngine:
    mode: Literal["refuse", "hang", "flood"] = "refuse"
    status: int = 200
    answer_bytes: int = 0
    chunked: bool = False
    received: int = 0  # completion requests whose body was drained
    sent: int = 0  # body bytes of flood answers that were sent
    done: bool = False  # the last flood answer ended (sent whole, or its client left)

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        if scope["method"] == "GET":
            await _answer(send, 200, b"{}")
            return
        while (await receive()).get("more_body", False):
            pass
        self.received += 1
        if self.mode == "refuse":
            await _answer(send, 400, _REFUSAL)
        elif self.mode == "hang":
            while (await receive())["type"] != "http.disconnect":
                pass
        else:
            await self._flood(receive, send)

    async def _flood(self, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"application/json")]
        if not self.chunked:
            headers.append((b"content-length", str(self.answer_bytes).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        self.done = False
        gone = asyncio.ensure_future(receive())  # resolves with http.disconnect
        try:
            while self.sent < self.answer_bytes and not gone.done():
                piece = _PIECE[: self.answer_bytes - self.sent]
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                self.sent += len(piece)
                await asyncio.sleep(0)  # a send after the client left returns at once: yield
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client closed the connection
            pass
        finally:
            gone.cancel()
            self.done = True


async def _answer(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory now (``VmHWM``: its peak so far), from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/{pid}/status")


@dataclass(frozen=True)
class RouterProcess:
    url: str
    pid: int


@contextlib.contextmanager
def run_router(prefill_url: str, decode_url: str, *flags: str) -> Iterator[RouterProcess]:
    """``python -m router`` (vllm-nixl) in front of these engines, until it is ready."""
    port = free_port()
    argv = [
        *(sys.executable, "-m", "router", "--engine", "vllm-nixl", "--port", str(port)),
        *("--prefill", prefill_url, "--decode", decode_url, "--health-interval", "0.2"),
        *("--log-level", "warning", *flags),
    ]
    url = f"http://127.0.0.1:{port}"
    with http_process(argv, url, path="/ready") as process:
        yield RouterProcess(url, process.pid)
