"""A fast fake vLLM / SGLang prefill or decode engine (no model) for tests and benchmarks.

It speaks the engines' OpenAI-compatible HTTP surface and the PD wire contract of
docs/concepts/protocols.md, and fails a request loudly (HTTP 400 / 500 with an OpenAI error
JSON) when the router sent a PD field wrong. Modules:

* `testkit/fake_engine.py`: `FakeEngine` (routes, knobs, records) and the CLI;
* `testkit/fake_protocols.py`: the per-(protocol, role) PD checks and KV rendezvous;
* `testkit/fake_wire.py`: raw ASGI plumbing and the OpenAI response format;
* `testkit/fake_base.py`: `FakeConfig`, `Received`, the handler seam, rendezvous primitives.

In tests (a real socket, see testkit/servers.py)::

    prefill = FakeEngine("prefill", "vllm-mooncake", dp_size=2)
    with run_servers(prefill.app, prefill.bootstrap_app) as (http_port, bootstrap_port):
        ...

Standalone (benchmark, demo)::

    python -m testkit.fake_engine --role prefill --protocol sglang --port 30000 \
        --bootstrap-port 8998

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
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Literal

import httpx
import uvicorn

from testkit.fake_base import (
    EOS_TOKEN_ID,
    FIRST_TOKEN_ID,
    Admission,
    Call,
    EngineError,
    FakeConfig,
    Received,
    Reply,
    RouteRequest,
    Routes,
    request_shape,
)
from testkit.fake_formats import (
    FORMAT_PATHS,
    MESSAGES_PATH,
    format_events,
    format_full_body,
    format_shape,
    messages_error_body,
    sampling_view,
)
from testkit.fake_passthrough import passthrough_routes
from testkit.fake_protocols import build_handler
from testkit.fake_wire import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    SSE_TYPE,
    AsgiApp,
    Output,
    Receive,
    Scope,
    Send,
    decode_object,
    error_body,
    full_body,
    header_dict,
    plan_completion,
    race_disconnect,
    read_body,
    routes_handler,
    serve_routes,
    server_address,
    sse_events,
)

__all__ = [
    "EOS_TOKEN_ID",
    "FIRST_TOKEN_ID",
    "FakeConfig",
    "FakeEngine",
    "Received",
    "main",
    "serve",
]

logger = logging.getLogger(__name__)

EngineRole = Literal["prefill", "decode"]
EngineProtocol = Literal["vllm-mooncake", "vllm-nixl", "sglang"]


def _describe(predicate: Callable[..., object]) -> str:
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)


def _errors(path: str) -> Callable[[int, str], bytes]:
    """The error envelope of an endpoint: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    return messages_error_body if path == MESSAGES_PATH else error_body


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
        self.health_checks = 0  # GET /health requests received
        self.passthrough_calls: list[str] = []  # /tokenize, /detokenize, /v1/embeddings
        self.dead = False  # kill() was called
        # Called by kill(): each stops some of this engine's servers (see fake_cluster.serve_engine)
        self.killers: list[Callable[[], None]] = []
        self._engine_id = engine_id or str(uuid.uuid4())
        self._created = int(time.time())
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self.handler = build_handler(protocol, role, self)
        self._routes: Routes = {
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            **self.handler.routes(),
            **passthrough_routes(protocol, lambda: self.config, self.passthrough_calls),
        }
        self.app = AsgiApp(self._serve_http, self.aclose)
        bootstrap = self.handler.bootstrap_routes()
        self.bootstrap_app = (
            None if bootstrap is None else AsgiApp(routes_handler(bootstrap), self.aclose)
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

    def kill(self) -> None:
        """Die as a killed process would: from now on every port of this engine refuses
        connections and open connections drop (through `killers`; without any, only `dead`)."""
        self.dead = True
        for killer in self.killers:
            killer()

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
        if self._unauthorized(scope):
            await Output(send, None, errors=_errors(scope["path"])).error(401, "Unauthorized")
        elif scope["path"] not in (COMPLETIONS_PATH, CHAT_PATH, *FORMAT_PATHS):
            await serve_routes(self._routes, scope, receive, send)
        elif scope["method"] != "POST":
            request_id = header_dict(scope).get("x-request-id")
            await Output(send, request_id, errors=_errors(scope["path"])).error(
                405, "Method Not Allowed"
            )
        else:
            await self._serve_completion(scope, receive, send)

    def _unauthorized(self, scope: Scope) -> bool:
        """A /v1/* request without the `FakeConfig.api_key` bearer (vLLM's --api-key)."""
        key = self.config.api_key
        if key is None or not scope["path"].startswith("/v1"):
            return False
        return header_dict(scope).get("authorization") != f"Bearer {key}"

    async def _health(self, _: RouteRequest) -> Reply:
        """Real engines answer /health slowly when busy (NIXL on a small machine: > 2 s)."""
        self.health_checks += 1
        config = self.config
        delay = config.health_delay + (config.health_delay_under_load if self.inflight else 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        return Reply(config.health_status, b"")

    async def _models(self, _: RouteRequest) -> Reply:
        base = self.config.model
        card = {"object": "model", "created": self._created, "owned_by": "fake"}
        adapters = [{**card, "id": name, "parent": base} for name in self.config.adapters]
        return Reply(200, {"object": "list", "data": [{**card, "id": base}, *adapters]})

    async def _serve_completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        if raw is None:
            return
        headers = header_dict(scope)
        body, problem = decode_object(raw)
        record = self._keep(Received(path=scope["path"], headers=headers, body=body))
        out = Output(send, headers.get("x-request-id"), record, _errors(record.path))
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
            if self.config.headers_delay > 0:  # an error answer has headers too
                await asyncio.sleep(self.config.headers_delay)
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
        if model != self.config.model and model not in self.config.adapters:
            raise EngineError(404, f"The model `{model}` does not exist.")
        path, server = record.path, server_address(scope)
        if path in FORMAT_PATHS:  # Responses / Messages: a chat turn with its own fields
            shape = format_shape(path, body)
            return Call(
                True, body, record.headers, record, server, shape, sampling_view(path, body)
            )
        chat = path == CHAT_PATH
        return Call(chat, body, record.headers, record, server, request_shape(chat, body))

    async def _answer(self, call: Call, admission: Admission, out: Output) -> None:
        # read when the request arrives: a knob set after the answer has left (the client saw
        # it, the handler has not yet resumed) belongs to the next request, not to this one
        die_after_answer = self.config.die_after_answer
        if self.config.headers_delay > 0:
            await asyncio.sleep(self.config.headers_delay)
        completion = plan_completion(call, admission, self.config)
        path = call.record.path
        if call.shape.stream:
            events = (
                format_events(path, completion, call.body)
                if path in FORMAT_PATHS
                else sse_events(completion)
            )
            await self._stream(events, out, call.record)
        elif path in FORMAT_PATHS:
            await out.whole(200, format_full_body(path, completion, call.body))
        else:
            await out.whole(200, full_body(completion))
        if self.role == "prefill" and die_after_answer and out.complete:
            self.kill()  # right after the answer left: the KV it promised never will

    async def _stream(self, events: Iterator[bytes], out: Output, record: Received) -> None:
        await out.start(200, SSE_TYPE)
        for sent, event in enumerate(events):
            fail_after = self.config.fail_after_events
            if fail_after is not None and sent >= fail_after:
                record.aborted = True
                return  # a crash: no terminating chunk, uvicorn drops the connection
            if sent and self.config.token_delay > 0:
                await asyncio.sleep(self.config.token_delay)
            elif sent:  # yield per token as an engine does: others run, a dead client is seen
                await asyncio.sleep(0)
            await out.chunk(event)
        await out.finish()


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
        proxy_headers=False,
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
        prog="python -m testkit.fake_engine",
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
