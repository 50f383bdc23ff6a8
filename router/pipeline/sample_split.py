"""``n > 1`` as n single-sequence requests, merged into the one answer the client asked for.

SGLang's PD engines hang on ``n > 1`` (the engine's n > 1 prefix warm-up request reuses the
bootstrap rooms, and the decode waits for a transfer that never comes), whatever the router.
So the router sends n requests with ``n: 1``, each with rooms of its own, and merges them as an
engine would have answered: choice ``i`` of part ``j`` becomes choice ``i * n + j`` (for a
batch of prompts, each prompt's n samples stay together), completion tokens are summed and the
prompt counted once, stream events carry their choice's index, and one ``[DONE]`` ends the
stream. Each part runs the whole pipeline (retries included) in a task of its own; the first to
fail cancels the others. What the parts hold at once (whole answers, SSE bytes not yet split
into events) is bounded by the answer limit (``--max-answer-bytes``) in all: beyond it the
request ends with a 502.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import msgspec

from router.errors import UpstreamUnavailable
from router.interrupt import reap
from router.pipeline.responder import Responder
from router.schemas import ParsedRequest
from router.types import Message
from router.upstream.base import ANSWER_TOO_LARGE

__all__ = ["SampleSplit"]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_JSON = b"application/json"
_SSE = b"text/event-stream"
_BOUNDARY = b"\n\n"
_DONE = b"data: [DONE]"

Serve = Callable[[ParsedRequest, Responder], Coroutine[Any, Any, None]]


class _Part:
    """What one part's pipeline wrote, captured from its ASGI messages."""

    def __init__(self, index: int, split: SampleSplit) -> None:
        self.index = index
        self.status = 0
        self.content_type = b""
        self.body = bytearray()  # a whole answer, or the SSE bytes not yet split into events
        self._split = split
        self.responder = Responder(self.send, [])

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.content_type = dict(message["headers"]).get(b"content-type", _JSON)
            return
        self.body += message.get("body", b"")
        self._split.held(len(message.get("body", b"")))
        if self.status < 400 and self.content_type.startswith(_SSE):
            await self._split.relay_events(self)


class SampleSplit:
    """Serves one ``n > 1`` request as ``n`` parts through ``serve`` and merges the answers."""

    def __init__(self, request: ParsedRequest, responder: Responder, max_bytes: int) -> None:
        self._request = request
        self._max_bytes = max_bytes
        self._held = 0  # bytes the parts hold now
        self._out = responder
        self._n = request.n
        body = dict(request.body)
        body["n"] = 1
        self._part_request = replace(request, body=body, n=1)
        self._usages: list[dict[str, Any]] = []
        self._usage_head: dict[str, Any] = {}

    async def run(self, serve: Serve) -> None:
        parts = [_Part(index, self) for index in range(self._n)]
        tasks = [asyncio.create_task(serve(self._part_request, part.responder)) for part in parts]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                failure = None if task.cancelled() else task.exception()
                if failure is not None:
                    raise failure
        finally:
            await asyncio.gather(*(reap(task) for task in tasks))
        failed = next((part for part in parts if part.status >= 400), None)
        if not self._out.started:
            self._out.receipt_headers = (failed or parts[0]).responder.receipt_headers
        if self._out.started:
            await self._end_stream(failed)
        elif failed is not None:
            await self._out.whole(failed.status, failed.content_type, bytes(failed.body))
        elif self._request.stream:
            await self._out.start(200, _SSE, sse=True)
            await self._end_stream(None)
        else:
            await self._out.whole(200, _JSON, self._merged_body(parts))

    def held(self, count: int) -> None:
        """The parts hold ``count`` more bytes; beyond the limit the request fails (502)."""
        self._held += count
        if self._held > self._max_bytes:
            raise UpstreamUnavailable(
                f"the answers of its {self._n} samples exceed the router's {self._max_bytes}-"
                "byte limit (--max-answer-bytes)",
                role="decode",
                url="",
                connect=False,
                kind=ANSWER_TOO_LARGE,
            )

    async def relay_events(self, part: _Part) -> None:
        """Forward ``part``'s complete SSE events with their choices re-indexed."""
        end = part.body.rfind(_BOUNDARY)
        if end < 0:
            return
        events = bytes(part.body[: end + 2]).split(_BOUNDARY)
        del part.body[: end + 2]
        self._held -= end + 2
        out = bytearray()
        for event in events:
            if event:
                out += self._event(event, part.index)
        if out:
            if not self._out.started:
                self._out.receipt_headers = part.responder.receipt_headers
                await self._out.start(200, _SSE, sse=True)
            await self._out.chunk(bytes(out))

    def _event(self, event: bytes, part: int) -> bytes:
        if event.startswith(_DONE):
            return b""  # one [DONE] ends the merged stream
        if not event.startswith(b"data: {"):
            return event + _BOUNDARY
        try:
            data = _decode(event[6:])
        except msgspec.DecodeError:
            return event + _BOUNDARY
        choices = data.get("choices") if isinstance(data, dict) else None
        if isinstance(choices, list) and not choices and isinstance(data.get("usage"), dict):
            self._usages.append(data["usage"])  # sent once, summed, before [DONE]
            self._usage_head = data
            return b""
        if not isinstance(choices, list):
            return event + _BOUNDARY
        for choice in choices:
            if isinstance(choice, dict):
                choice["index"] = self._index(choice.get("index", 0), part)
        return b"data: " + _encode(data) + _BOUNDARY

    def _index(self, index: Any, part: int) -> Any:
        return index * self._n + part if isinstance(index, int) else index

    async def _end_stream(self, failed: _Part | None) -> None:
        tail = bytearray()
        if failed is not None:  # a part failed after others streamed: its error, in-band
            tail += b"data: " + bytes(failed.body) + _BOUNDARY
        elif self._usages:
            usage = {**self._usage_head, "usage": _merged_usage(self._usages)}
            tail += b"data: " + _encode(usage) + _BOUNDARY
        if failed is None:
            tail += _DONE + _BOUNDARY
        await self._out.finish(bytes(tail))

    def _merged_body(self, parts: list[_Part]) -> bytes:
        answers = [_decode(bytes(part.body)) for part in parts]
        merged = dict(answers[0])
        choices = [
            {**choice, "index": self._index(choice.get("index", 0), part)}
            for part, answer in enumerate(answers)
            for choice in answer.get("choices", [])
        ]
        choices.sort(key=lambda choice: choice["index"])
        merged["choices"] = choices
        usages = [a["usage"] for a in answers if isinstance(a.get("usage"), dict)]
        if usages:
            merged["usage"] = _merged_usage(usages)
        return _encode(merged)


def _merged_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Completion tokens summed over the parts; the (same) prompt counted once."""
    merged = dict(usages[0])
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    merged["completion_tokens"] = completion
    merged["total_tokens"] = int(merged.get("prompt_tokens") or 0) + completion
    return merged
