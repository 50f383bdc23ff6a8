"""One view across the processes of ``router --workers N``: each serving process answers its
siblings on a Unix socket of the supervisor's run directory (``ProcessRole.socket_path``), and
the process a scrape or a status request reaches asks every other one and merges.

The socket speaks just enough HTTP/1.0 for two reads: ``GET /metrics`` (the process's own
exposition) and ``GET /process`` (its pid, index and live counts, JSON). Each ask has a deadline
(``ASK_TIMEOUT_S``) and a size cap (``MAX_ANSWER_BYTES``); a sibling that does not answer (being
restarted, say) is left out of the merge, and the merged exposition says how many answered
(``pdr_router_processes``). The run directory is the supervisor's (mode 0700), each socket
mode 0600: only the router's own user can read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from router.observability.metrics_merge import merge_expositions
from router.process_role import ProcessRole

__all__ = ["ASK_TIMEOUT_S", "MAX_ANSWER_BYTES", "Siblings"]

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 2.0
MAX_ANSWER_BYTES = 64 * 1024 * 1024
_MAX_HEAD_BYTES = 8192
_PROCESSES_HELP = (
    b"# HELP pdr_router_processes router processes of this host whose metrics are merged here\n"
    b"# TYPE pdr_router_processes gauge\n"
)


def _answer(status: str, content_type: bytes, body: bytes) -> bytes:
    head = f"HTTP/1.0 {status}\r\nContent-Length: {len(body)}\r\n".encode()
    return head + b"Content-Type: " + content_type + b"\r\nConnection: close\r\n\r\n" + body


def _mark_up(role: ProcessRole) -> None:
    """Tell the supervisor this process came up (``ProcessRole.up_path``)."""
    with open(role.up_path(role.index), "w"):
        pass


async def _read_to_end(reader: asyncio.StreamReader, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await reader.read(65536):
        size += len(chunk)
        if size > limit:
            raise ValueError("answer too large")
        chunks.append(chunk)
    return b"".join(chunks)


class Siblings:
    """This process's side of the shared view: it serves its own numbers to its siblings and
    merges theirs with its own."""

    def __init__(
        self,
        role: ProcessRole,
        own_metrics: Callable[[], bytes],
        own_process: Callable[[], dict[str, Any]],
    ) -> None:
        self.role = role
        self._own_metrics = own_metrics
        self._own_process = own_process

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Answer the siblings while the block runs."""
        path = self.role.socket_path(self.role.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the socket of this process's previous incarnation
        server = await asyncio.start_unix_server(self._serve_one, path=path)
        os.chmod(path, 0o600)
        _mark_up(self.role)
        try:
            yield
        finally:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > _MAX_HEAD_BYTES:
                raise ValueError("head too long")
            target = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            if head.startswith(b"GET ") and target == b"/metrics":
                writer.write(_answer("200 OK", b"text/plain", self._own_metrics()))
            elif head.startswith(b"GET ") and target == b"/process":
                body = msgspec.json.encode(self._own_process())
                writer.write(_answer("200 OK", b"application/json", body))
            else:
                writer.write(_answer("404 Not Found", b"text/plain", b"not found\n"))
            await writer.drain()
        except (
            TimeoutError,
            ValueError,
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass  # a sibling that asks wrongly gets nothing
        finally:
            writer.close()

    async def _ask(self, path: str, target: str) -> bytes | None:
        """A sibling's answer body, or None (gone, slow, malformed, too large)."""
        writer = None
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(path)
                writer.write(f"GET {target} HTTP/1.0\r\nHost: sibling\r\n\r\n".encode())
                answer = await _read_to_end(reader, MAX_ANSWER_BYTES + _MAX_HEAD_BYTES)
        except (OSError, TimeoutError, ValueError) as exc:
            logger.debug("sibling %s did not answer %s: %s", path, target, exc)
            return None
        finally:
            if writer is not None:
                writer.close()
        head, sep, body = answer.partition(b"\r\n\r\n")
        if not sep or not head.startswith(b"HTTP/1.0 200 "):
            return None
        return body

    async def _gather(self, target: str) -> list[bytes]:
        answers = await asyncio.gather(
            *(self._ask(path, target) for path in self.role.sibling_paths())
        )
        return [answer for answer in answers if answer is not None]

    async def metrics(self) -> bytes:
        """Every answering process's metrics merged (``router.observability.metrics_merge``)."""
        texts = [self._own_metrics(), *await self._gather("/metrics")]
        merged = merge_expositions([text.decode("utf-8", "replace") for text in texts])
        return merged + _PROCESSES_HELP + f"pdr_router_processes {len(texts)}.0\n".encode()

    async def processes(self) -> list[dict[str, Any]]:
        """Each answering process's own description, by index."""
        found = [self._own_process()]
        for body in await self._gather("/process"):
            with contextlib.suppress(msgspec.DecodeError):
                described = msgspec.json.decode(body)
                if isinstance(described, dict):
                    found.append(described)
        return sorted(found, key=lambda process: int(process.get("index", 0)))
