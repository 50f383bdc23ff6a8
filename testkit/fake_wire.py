"""The fake engine's wire layer: raw ASGI plumbing (disconnect-aware, never raising) and
the OpenAI response format (SSE events and full JSON bodies), encoded with msgspec.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qsl

import msgspec

from testkit.fake_base import (
    Admission,
    Call,
    EngineError,
    FakeConfig,
    Generation,
    Received,
    Reply,
    RouteRequest,
    Routes,
    generate,
)

__all__ = [
    "ERROR_TYPES",
    "AsgiApp",
    "Completion",
    "Output",
    "decode_object",
    "error_body",
    "full_body",
    "header_dict",
    "plan_completion",
    "race_disconnect",
    "routes_handler",
    "read_body",
    "serve_routes",
    "server_address",
    "sse_events",
]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
HttpHandler = Callable[[Scope, Receive, Send], Awaitable[None]]

COMPLETIONS_PATH: Final = "/v1/completions"
CHAT_PATH: Final = "/v1/chat/completions"
JSON_TYPE: Final = b"application/json"
TEXT_TYPE: Final = b"text/plain; charset=utf-8"
SSE_TYPE: Final = b"text/event-stream"
SSE_DONE: Final = b"data: [DONE]\n\n"
CHUNK_TAIL: Final = b"]}\n\n"
ERROR_TYPES: Final = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}
_encode = msgspec.json.encode


# --------------------------------------------------------------------------- ASGI plumbing


def error_body(status: int, message: str) -> bytes:
    """The OpenAI error envelope vLLM and SGLang answer with."""
    fallback = "InternalServerError" if status >= 500 else "BadRequestError"
    err_type = ERROR_TYPES.get(status, fallback)
    return _encode({"error": {"message": message, "type": err_type, "param": None, "code": status}})


def header_dict(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def server_address(scope: Scope) -> tuple[str, int]:
    """The (host, port) the request arrived on; in-process transports may leave gaps."""
    host, port = scope.get("server") or (None, None)
    return (host or "127.0.0.1", port or 80)


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(receive: Receive, work: Awaitable[None]) -> bool:
    """Await `work` in this task, cancelling it if the client disconnects first.

    Returns True when the client went away before `work` finished. One watcher task per
    request (not two tasks and `asyncio.wait`): this is on every request's path.
    """
    task = asyncio.current_task()
    assert task is not None
    finished = left = False

    async def watch() -> None:
        nonlocal left
        await _wait_disconnect(receive)
        if not finished:  # uvicorn also reports "disconnect" once the response is complete
            left = True
            task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        await work
    except asyncio.CancelledError:
        if not left:
            raise  # cancelled from outside (server shutdown)
    finally:
        finished = True
        watcher.cancel()
    if left:
        task.uncancel()
    return left


class Output:
    """The response side of one exchange: wraps ASGI send and remembers what went out."""

    def __init__(
        self,
        send: Send,
        request_id: str | None,
        record: Received | None = None,
        errors: Callable[[int, str], bytes] = error_body,
    ) -> None:
        self._send = send
        self._errors = errors  # the error envelope of the endpoint
        self._headers = [(b"x-request-id", request_id.encode("latin-1"))] if request_id else []
        self._record = record
        self.started = False
        self.complete = False

    async def start(self, status: int, content_type: bytes, length: int | None = None) -> None:
        headers = [(b"content-type", content_type), *self._headers]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        self.started = True
        if self._record is not None:
            self._record.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes = b"") -> None:
        self.complete = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def whole(self, status: int, body: bytes, content_type: bytes = JSON_TYPE) -> None:
        await self.start(status, content_type, len(body))
        await self.finish(body)

    async def error(self, status: int, message: str) -> None:
        await self.whole(status, self._errors(status, message))

    async def reply(self, reply: Reply) -> None:
        if isinstance(reply.payload, bytes):
            await self.whole(reply.status, reply.payload, TEXT_TYPE)
        else:
            await self.whole(reply.status, _encode(reply.payload))


async def answer_route(
    fn: Callable[[RouteRequest], Awaitable[Reply]], request: RouteRequest, out: Output
) -> None:
    try:
        reply = await fn(request)
    except EngineError as exc:
        await out.error(exc.status, exc.message)
        return
    await out.reply(reply)


async def serve_routes(routes: Routes, scope: Scope, receive: Receive, send: Send) -> None:
    """Dispatch a small route table: 404 for an unknown path, 405 for a wrong method."""
    out = Output(send, header_dict(scope).get("x-request-id"))
    methods = routes.get(scope["path"])
    fn = None if methods is None else methods.get(scope["method"])
    if fn is None:
        status = 404 if methods is None else 405
        await out.error(status, "Not Found" if methods is None else "Method Not Allowed")
        return
    body = await read_body(receive)
    if body is None:
        return
    query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
    await race_disconnect(receive, answer_route(fn, RouteRequest(query, body), out))


class AsgiApp:
    """A raw ASGI 3 app around one HTTP handler; it answers lifespan and never raises."""

    def __init__(self, handle: HttpHandler, on_shutdown: Callable[[], Awaitable[None]]) -> None:
        self._handle = handle
        self._on_shutdown = on_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            try:
                await self._handle(scope, receive, send)
            except Exception:
                logger.exception("fake engine: unexpected error on %s", scope.get("path"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class Completion:
    """Everything needed to render one answer."""

    chat: bool
    model: str
    choices: int
    generation: Generation  # every choice generates the same
    prompt_tokens: int
    include_usage: bool
    admission: Admission
    # usage.prompt_tokens_details (None: not reported)
    prompt_details: dict[str, int] | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}"

    @property
    def tokens(self) -> int:
        return len(self.generation.token_ids)

    def usage(self) -> dict[str, Any]:
        completion = self.tokens * self.choices
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        if self.prompt_details is not None:
            usage["prompt_tokens_details"] = self.prompt_details
        return usage


def plan_completion(call: Call, admission: Admission, config: FakeConfig) -> Completion:
    caps = [cap for cap in (call.shape.max_tokens, admission.max_tokens) if cap is not None]
    limit = min([max(config.tokens, 0), *caps])
    return Completion(
        chat=call.chat,
        model=config.model,
        choices=call.shape.choices,
        generation=generate(call.sampling_body(), limit, bool(caps) and limit >= min(caps), config),
        prompt_tokens=call.shape.prompt_tokens,
        include_usage=call.shape.include_usage,
        admission=admission,
        prompt_details=_prompt_details(call.shape.prompt_tokens, call.chat, config),
    )


def _prompt_details(prompt_tokens: int, chat: bool, config: FakeConfig) -> dict[str, int] | None:
    """As vLLM 0.32 reports them: cached_tokens always, created_cache_tokens in chat answers."""
    if not config.prompt_tokens_details:
        return None
    computed = prompt_tokens if config.recompute_prompt else 0
    details = {"cached_tokens": prompt_tokens - computed}
    if chat:
        details["created_cache_tokens"] = computed
    return details


def _chunk_head(c: Completion) -> bytes:
    """The bytes every SSE chunk of one answer starts with, up to the choices array."""
    kind = b"chat.completion.chunk" if c.chat else b"text_completion"
    parts = [
        b'data: {"id":',
        _encode(c.object_id),
        b',"object":"',
        kind,
        b'","created":',
        str(c.created).encode(),
        b',"model":',
        _encode(c.model),
        b',"choices":[',
    ]
    return b"".join(parts)


def _stream_choice(c: Completion, index: int, text: str, finish: str | None) -> bytes:
    choice: dict[str, Any]
    if c.chat:
        choice = {
            "index": index,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    if finish is not None and c.generation.stop_reason is not None:
        choice["stop_reason"] = c.generation.stop_reason  # vLLM: only where it is set
    return _encode(choice)


def _usage_chunk(c: Completion) -> dict[str, Any]:
    return {
        "id": c.object_id,
        "object": "chat.completion.chunk" if c.chat else "text_completion",
        "created": c.created,
        "model": c.model,
        "choices": [],
        "usage": c.usage(),
    }


def sse_events(c: Completion) -> Iterator[bytes]:
    """The SSE events of a streamed answer, one `data:` event per item, `[DONE]` last."""
    head = _chunk_head(c)
    if c.chat:
        role = {"role": "assistant", "content": ""}
        for index in range(c.choices):
            choice = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
            yield head + _encode(choice) + CHUNK_TAIL
    texts = c.generation.texts
    steps = max(len(texts), 1)
    for step in range(steps):
        text = texts[step] if step < len(texts) else ""
        finish = c.generation.finish_reason if step == steps - 1 else None
        for index in range(c.choices):
            yield head + _stream_choice(c, index, text, finish) + CHUNK_TAIL
    if c.include_usage:
        yield b"data: " + _encode(_usage_chunk(c)) + b"\n\n"
    yield SSE_DONE


def full_body(c: Completion) -> bytes:
    """A non-stream answer; vLLM ones carry top-level `kv_transfer_params`."""
    text = c.generation.text
    finish, stop_reason = c.generation.finish_reason, c.generation.stop_reason
    choices: list[dict[str, Any]] = []
    for index in range(c.choices):
        content: dict[str, Any] = (
            {"message": {"role": "assistant", "content": text}} if c.chat else {"text": text}
        )
        choices.append(
            {
                "index": index,
                **content,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
            }
        )
    body: dict[str, Any] = {
        "id": c.object_id,
        "object": "chat.completion" if c.chat else "text_completion",
        "created": c.created,
        "model": c.model,
        "choices": choices,
        "usage": c.usage(),
    }
    if c.admission.echo_kv:
        body["kv_transfer_params"] = c.admission.kv_transfer_params
    return _encode(body)


def decode_object(raw: bytes) -> tuple[dict[str, Any], str | None]:
    """The JSON object body, or ({}, why it is not one)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return {}, f"invalid JSON body: {exc}"
    if not isinstance(body, dict):
        return {}, "the JSON body must be an object"
    return body, None


def routes_handler(routes: Routes) -> HttpHandler:
    """An HTTP handler serving only `routes` (the bootstrap port)."""

    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        await serve_routes(routes, scope, receive, send)

    return handle
