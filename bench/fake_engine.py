"""A fast fake vLLM / SGLang prefill or decode engine (no model) for tests and benchmarks.

It speaks the engines' OpenAI-compatible HTTP surface and the PD wire contract of
/work/shared/PROTOCOLS.md, and fails a request loudly (HTTP 400 / 500 with an OpenAI error
JSON) when the router sent a PD field wrong; the checks live in `bench/fake_protocols.py`.

In tests (a real socket, see tests/servers.py)::

    prefill = FakeEngine("prefill", "vllm-mooncake", dp_size=2)
    with run_servers(prefill.app, prefill.bootstrap_app) as (http_port, bootstrap_port):
        ...

Standalone (benchmark, demo)::

    python -m bench.fake_engine --role prefill --protocol sglang --port 30000 --bootstrap-port 8998

The apps are raw ASGI (no framework) and encode JSON with msgspec, to stay out of the way of
the router being measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import parse_qsl

import httpx
import msgspec
import uvicorn

from bench.fake_protocols import (
    Admission,
    Call,
    EngineError,
    Reply,
    RouteRequest,
    Routes,
    build_handler,
    request_shape,
)

__all__ = ["FakeConfig", "FakeEngine", "Received", "main"]

logger = logging.getLogger(__name__)

EngineRole = Literal["prefill", "decode"]
EngineProtocol = Literal["vllm-mooncake", "vllm-nixl", "sglang"]
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


@dataclass
class FakeConfig:
    """Runtime knobs; tests may change them while the engine serves."""

    model: str = "fake-model"
    tokens: int = 16  # output tokens per choice, capped by max_tokens / max_completion_tokens
    token_delay: float = 0.0  # seconds between SSE events
    fail_status: int | None = None  # completions answer this status (an OpenAI error JSON)
    fail_after_events: int | None = None  # streaming: drop the connection after N events
    hang: bool = False  # completions never answer until the client disconnects
    headers_delay: float = 0.0  # sleep before sending the response headers
    kv_timeout: float = 60.0  # how long a KV rendezvous waits
    check_kv: bool = True  # False: validate PD fields but skip the P<->D rendezvous
    default_bootstrap_port: int = 8998  # sglang decode: used when bootstrap_port is null
    max_records: int | None = None  # keep only the newest N records (long benchmark runs)


@dataclass
class Received:
    """One completions request as the fake saw it."""

    path: str
    headers: dict[str, str]  # lower-cased names
    body: dict[str, Any]
    status: int | None = None  # the status the fake answered (None while in progress)
    disconnected: bool = False  # the client went away before the fake finished
    done: bool = False  # the fake finished handling (answered, failed, or saw a disconnect)
    aborted: bool = False  # fail_after_events dropped the connection mid-stream
    dp_ranks: list[int] = field(default_factory=list)  # DP rank(s) a prefill served


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

    def __init__(self, send: Send, request_id: str | None, record: Received | None = None) -> None:
        self._send = send
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
        await self.whole(status, error_body(status, message))

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


def token_text(step: int) -> str:
    return f" tok{step}"


@dataclass(frozen=True)
class Completion:
    """Everything needed to render one answer."""

    chat: bool
    model: str
    choices: int
    tokens: int
    finish_reason: str
    prompt_tokens: int
    include_usage: bool
    admission: Admission
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}"

    def usage(self) -> dict[str, int]:
        completion = self.tokens * self.choices
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


def plan_completion(call: Call, admission: Admission, config: FakeConfig) -> Completion:
    caps = [cap for cap in (call.shape.max_tokens, admission.max_tokens) if cap is not None]
    tokens = min([max(config.tokens, 0), *caps])
    finish = "length" if caps and tokens >= min(caps) else "stop"
    return Completion(
        chat=call.chat,
        model=config.model,
        choices=call.shape.choices,
        tokens=tokens,
        finish_reason=finish,
        prompt_tokens=call.shape.prompt_tokens,
        include_usage=call.shape.include_usage,
        admission=admission,
    )


def _chunk_head(c: Completion) -> bytes:
    kind = b"chat.completion.chunk" if c.chat else b"text_completion"
    return (
        b'data: {"id":'
        + _encode(c.object_id)
        + b',"object":"'
        + kind
        + b'","created":'
        + str(c.created).encode()
        + b',"model":'
        + _encode(c.model)
        + b',"choices":['
    )


def _stream_choice(c: Completion, index: int, text: str, finish: str | None) -> bytes:
    if c.chat:
        choice = {
            "index": index,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
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
    steps = max(c.tokens, 1)
    for step in range(steps):
        text = token_text(step) if step < c.tokens else ""
        finish = c.finish_reason if step == steps - 1 else None
        for index in range(c.choices):
            yield head + _stream_choice(c, index, text, finish) + CHUNK_TAIL
    if c.include_usage:
        yield b"data: " + _encode(_usage_chunk(c)) + b"\n\n"
    yield SSE_DONE


def full_body(c: Completion) -> bytes:
    """A non-stream answer; vLLM ones carry top-level `kv_transfer_params`."""
    text = "".join(token_text(step) for step in range(c.tokens))
    choices: list[dict[str, Any]] = []
    for index in range(c.choices):
        if c.chat:
            message = {"role": "assistant", "content": text}
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
            )
        else:
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": None,
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


def _describe(predicate: Callable[..., object]) -> str:
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)


# --------------------------------------------------------------------------- the engine


class FakeEngine:
    """One fake prefill or decode engine: `app` is its HTTP port, `bootstrap_app` the P's
    bootstrap port (vllm-mooncake and sglang prefill; None otherwise)."""

    def __init__(
        self,
        role: EngineRole,
        protocol: EngineProtocol,
        *,
        dp_size: int = 1,
        config: FakeConfig | None = None,
        engine_id: str | None = None,
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.role: EngineRole = role
        self.protocol: EngineProtocol = protocol
        self.dp_size = dp_size
        self.config = config if config is not None else FakeConfig()
        self.records: list[Received] = []
        self.inflight = 0
        self._engine_id = engine_id or str(uuid.uuid4())
        self._created = int(time.time())
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self.handler = build_handler(protocol, role, self)
        self._routes: Routes = {
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            **self.handler.routes(),
        }
        self.app = AsgiApp(self._serve_http, self.aclose)
        bootstrap = self.handler.bootstrap_routes()
        self.bootstrap_app = (
            None if bootstrap is None else AsgiApp(_route_handler(bootstrap), self.aclose)
        )

    def __repr__(self) -> str:
        return f"FakeEngine({self.role!r}, {self.protocol!r}, engine_id={self._engine_id!r})"

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def engine_ids(self) -> list[str]:
        """The engine id of each DP rank (vLLM appends `_dp{rank}` when dp_size > 1)."""
        if self.dp_size == 1:
            return [self._engine_id]
        return [f"{self._engine_id}_dp{rank}" for rank in range(self.dp_size)]

    def restart(self) -> None:
        """Simulate an engine restart: a new random engine id and no KV state."""
        self._engine_id = str(uuid.uuid4())
        self.handler.reset()

    def http_client(self) -> httpx.AsyncClient:
        """The engine's outbound client for the running event loop (closed at shutdown)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            timeout = httpx.Timeout(None, connect=5.0)
            client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
            self._clients[loop] = client
        return client

    async def aclose(self) -> None:
        """Close the outbound client of the running event loop."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def wait_for(  # noqa: ASYNC109 - the timeout is this helper's contract
        self, predicate: Callable[[FakeEngine], bool], timeout: float = 5.0
    ) -> None:
        """Poll `predicate(self)` every 10 ms; TimeoutError naming it after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self!r}: not true after {timeout}s: {_describe(predicate)}")
            await asyncio.sleep(0.01)

    # -- HTTP port --------------------------------------------------------------------------

    async def _serve_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] not in (COMPLETIONS_PATH, CHAT_PATH):
            await serve_routes(self._routes, scope, receive, send)
        elif scope["method"] != "POST":
            await Output(send, None).error(405, "Method Not Allowed")
        else:
            await self._serve_completion(scope, receive, send)

    async def _health(self, _: RouteRequest) -> Reply:
        return Reply(200, b"")

    async def _models(self, _: RouteRequest) -> Reply:
        model = {
            "id": self.config.model,
            "object": "model",
            "created": self._created,
            "owned_by": "fake",
        }
        return Reply(200, {"object": "list", "data": [model]})

    async def _serve_completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        if raw is None:
            return
        headers = header_dict(scope)
        body, problem = decode_object(raw)
        record = self._keep(Received(path=scope["path"], headers=headers, body=body))
        out = Output(send, headers.get("x-request-id"), record)
        self.inflight += 1
        try:
            work = self._complete(scope, record, problem, out)
            record.disconnected = await race_disconnect(receive, work)
        finally:
            self.inflight -= 1
            record.done = True

    def _keep(self, record: Received) -> Received:
        self.records.append(record)
        cap = self.config.max_records
        if cap is not None and len(self.records) > cap:
            del self.records[: len(self.records) - cap]
        return record

    async def _complete(
        self, scope: Scope, record: Received, problem: str | None, out: Output
    ) -> None:
        try:
            await self._misbehave(problem)
            call = self._make_call(scope, record)
            admission = await self.handler.admit(call)
            await self._answer(call, admission, out)
        except EngineError as exc:
            logger.info("fake %s %s: %d %s", self.protocol, self.role, exc.status, exc.message)
            if not out.started:
                await out.error(exc.status, exc.message)
        except Exception:
            logger.exception("fake %s %s: unexpected error", self.protocol, self.role)
            if not out.started:
                await out.error(500, "fake engine internal error")

    async def _misbehave(self, problem: str | None) -> None:
        if self.config.fail_status is not None:
            status = self.config.fail_status
            raise EngineError(status, f"fake engine configured to fail with HTTP {status}")
        if self.config.hang:
            await asyncio.get_running_loop().create_future()  # until the client disconnects
        if problem is not None:
            raise EngineError(400, problem)

    def _make_call(self, scope: Scope, record: Received) -> Call:
        body = record.body
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise EngineError(400, "'model' is required and must be a string")
        if model != self.config.model:
            raise EngineError(404, f"The model `{model}` does not exist.")
        chat = record.path == CHAT_PATH
        shape = request_shape(chat, body)
        return Call(chat, body, record.headers, record, server_address(scope), shape)

    async def _answer(self, call: Call, admission: Admission, out: Output) -> None:
        if self.config.headers_delay > 0:
            await asyncio.sleep(self.config.headers_delay)
        completion = plan_completion(call, admission, self.config)
        if call.shape.stream:
            await self._stream(completion, out, call.record)
        else:
            await out.whole(200, full_body(completion))

    async def _stream(self, completion: Completion, out: Output, record: Received) -> None:
        await out.start(200, SSE_TYPE)
        for sent, event in enumerate(sse_events(completion)):
            fail_after = self.config.fail_after_events
            if fail_after is not None and sent >= fail_after:
                record.aborted = True
                return  # a crash: no terminating chunk, uvicorn drops the connection
            if sent and self.config.token_delay > 0:
                await asyncio.sleep(self.config.token_delay)
            await out.chunk(event)
        await out.finish()


def _route_handler(routes: Routes) -> HttpHandler:
    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        await serve_routes(routes, scope, receive, send)

    return handle


# --------------------------------------------------------------------------- CLI


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to `serve` (several share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _server(app: AsgiApp, host: str, port: int) -> _Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        ws="none",
        lifespan="on",
        log_level="warning",
        access_log=False,
        backlog=4096,
        timeout_graceful_shutdown=5,
    )
    return _Server(config)


def _request_exit(servers: Sequence[_Server]) -> None:
    for server in servers:
        server.force_exit = server.should_exit  # a second signal stops waiting for requests
        server.should_exit = True


async def _serve_one(server: _Server, group: Sequence[_Server]) -> bool:
    try:
        await server.serve()
    except SystemExit:  # uvicorn could not start (e.g. port in use) and logged why
        _request_exit(group)
        return False
    return True


async def serve(engine: FakeEngine, host: str, port: int, bootstrap_port: int) -> bool:
    """Serve `engine.app` (and a prefill's bootstrap app) until SIGINT or SIGTERM.

    Returns False when a server could not start; the others are then stopped too.
    """
    servers = [_server(engine.app, host, port)]
    if engine.bootstrap_app is not None:
        servers.append(_server(engine.bootstrap_app, host, bootstrap_port))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _request_exit, servers)
    results = await asyncio.gather(*(_serve_one(server, servers) for server in servers))
    return all(results)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fake_engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument(
        "--protocol", choices=["vllm-mooncake", "vllm-nixl", "sglang"], required=True
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--bootstrap-port",
        type=int,
        default=8998,
        help="prefill bootstrap port; sglang decode: default for a null port",
    )
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument(
        "--no-check-kv",
        action="store_true",
        help="skip the P<->D KV rendezvous (PD fields are still validated)",
    )
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--engine-id", default=None)
    parser.add_argument(
        "--max-records", type=int, default=1000, help="requests kept in memory for inspection"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = FakeConfig(
        model=args.model,
        tokens=args.tokens,
        token_delay=args.token_delay,
        check_kv=not args.no_check_kv,
        default_bootstrap_port=args.bootstrap_port,
        max_records=args.max_records,
    )
    engine = FakeEngine(
        args.role, args.protocol, dp_size=args.dp_size, config=config, engine_id=args.engine_id
    )
    import uvloop  # uvicorn[standard] installs it

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        started = runner.run(serve(engine, args.host, args.port, args.bootstrap_port))
    if not started:
        sys.exit(1)


if __name__ == "__main__":
    main()
