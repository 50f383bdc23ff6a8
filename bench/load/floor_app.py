"""The floors under the router's CPU per request, measured by ``bench.load.peers --floors``.

Two stand-ins for the router, each on the router's own parts and nothing else:

- ``server``: the router's HTTP server (uvicorn on uvloop with the router's httptools protocol
  and its whole-answer extension) answering every completion itself: a fixed answer, or a fixed
  stream of as many events as the request's ``max_tokens``. What serving a client costs.
- ``proxy``: the same server plus the router's upstream client (``LeanUpstream``) and the
  engine adapter's plan: the request parsed, the prefill leg in a task beside the decode leg,
  the decode's answer relayed (whole, or its SSE chunks as they come), the prefill waited for.
  No admission, routing policy, breakers, receipts, metrics, accounting or retries: what PD
  proxying costs on these parts before any of the router's own work.

The router's CPU per request minus ``proxy``'s is what its pipeline and features cost; a peer's
CPU per request minus ``proxy``'s is what the router's pipeline may cost to match the peer.

    python -m bench.load.floor_app --shape proxy --engine vllm-mooncake \
        --prefill URL BOOTSTRAP_PORT --decode URL --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
import uvicorn

from router.adapters import PDAdapter, build_adapter
from router.schemas import Endpoint, parse_request
from router.server.gc_schedule import tune_gc
from router.server.http_limits import HttpLimits, limited_http_protocol
from router.settings import EngineProtocol, UpstreamSettings
from router.types import WHOLE_RESPONSE, Receive, Scope, Send
from router.upstream.lean_client import LeanUpstream
from router.workers import Role, Worker

__all__ = ["SHAPES", "FloorApp", "main"]

SHAPES = ("server", "proxy")
_JSON = b"application/json"
_SSE = b"text/event-stream"
_ANSWER = msgspec.json.encode(
    {
        "id": "cmpl-floor",
        "object": "text_completion",
        "model": "fake-model",
        "choices": [{"index": 0, "text": " tok" * 16, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
    }
)
_EVENT = (
    b'data: {"id":"cmpl-floor","object":"text_completion","choices":[{"index":0,"text":" tok"}]}'
    b"\n\n"
)
_DONE = b"data: [DONE]\n\n"
_PREFILL_WAIT_S = 1.0  # the router's default prefill grace
_HOT = {endpoint.value: endpoint for endpoint in Endpoint}


class FloorApp:
    """The ASGI app of one shape; ``proxy`` needs the engine pair."""

    def __init__(self, shape: str, engine: EngineProtocol, prefill: Worker, decode: Worker) -> None:
        self._shape = shape
        self._adapter: PDAdapter = build_adapter(engine)
        self._prefill, self._decode = prefill, decode
        self._clients: tuple[LeanUpstream, LeanUpstream] | None = None
        self._ids = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        endpoint = _HOT.get(scope["path"])
        if scope["path"] == "/ready":
            await _answer(scope, send, 200, _JSON, b"{}")
            return
        if scope["type"] != "http" or endpoint is None:
            await _answer(scope, send, 404, _JSON, b'{"error":"not found"}')
            return
        raw = await _body(receive)
        if self._shape == "server":
            await self._canned(scope, send, raw)
        else:
            await self._proxy(scope, send, endpoint, raw)

    async def _canned(self, scope: Scope, send: Send, raw: bytes) -> None:
        body = msgspec.json.decode(raw)
        if not body.get("stream"):
            await _answer(scope, send, 200, _JSON, _ANSWER)
            return
        await _start(send, 200, _SSE)
        for _ in range(int(body.get("max_tokens", 16))):
            await send({"type": "http.response.body", "body": _EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})

    async def _proxy(self, scope: Scope, send: Send, endpoint: Endpoint, raw: bytes) -> None:
        request = parse_request(endpoint, raw)
        prefill_client, decode_client = self._upstreams()
        plan = self._adapter.plan(request, self._prefill, 0, self._decode)
        headers = {"content-type": "application/json", "x-request-id": f"floor-{next(self._ids)}"}
        prefill_headers = {**headers, **plan.prefill_headers}
        path = endpoint.value

        async def prefill_leg() -> bytes:
            answer = await prefill_client.open(
                path, msgspec.json.encode(plan.prefill_body), prefill_headers, whole=True
            )
            return await answer.read()

        prefill = asyncio.get_running_loop().create_task(prefill_leg())
        try:
            decode_body = msgspec.json.encode(plan.decode_body or plan.prefill_body)
            answer = await decode_client.open(path, decode_body, headers, whole=not request.stream)
            if request.stream:
                await _start(send, answer.status, answer.content_type)
                async for chunk in answer.chunks():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                content = await answer.read()
                await _answer(scope, send, answer.status, answer.content_type, content)
            await asyncio.wait([prefill], timeout=_PREFILL_WAIT_S)
        finally:
            prefill.cancel()

    def _upstreams(self) -> tuple[LeanUpstream, LeanUpstream]:
        if self._clients is None:
            settings = UpstreamSettings()
            self._clients = (
                LeanUpstream(self._prefill, settings),
                LeanUpstream(self._decode, settings),
            )
        return self._clients


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    more = True
    while more:
        message = await receive()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


async def _start(send: Send, status: int, content_type: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type)],
        }
    )


async def _answer(scope: Scope, send: Send, status: int, content_type: bytes, body: bytes) -> None:
    """A whole answer: one message where the router's server takes it, as the router sends."""
    headers: list[tuple[bytes, bytes]] = [(b"content-type", content_type)]
    if WHOLE_RESPONSE in scope.get("extensions", ()):
        message: dict[str, Any] = {"type": WHOLE_RESPONSE, "status": status, "headers": headers}
        await send({**message, "body": body})
        return
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _workers(args: argparse.Namespace) -> tuple[Worker, Worker]:
    prefill_url, *bootstrap = args.prefill
    prefill = Worker(Role.PREFILL, prefill_url, int(bootstrap[0]) if bootstrap else None)
    prefill.set_layout(1, ("floor-engine",))  # a --no-check-kv fake takes any engine id
    return prefill, Worker(Role.DECODE, args.decode)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.load.floor_app", description=__doc__)
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--engine", default="vllm-mooncake")
    parser.add_argument("--prefill", nargs="+", metavar=("URL", "BOOTSTRAP_PORT"), required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    prefill, decode = _workers(args)
    app = FloorApp(args.shape, EngineProtocol(args.engine), prefill, decode)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http=limited_http_protocol(HttpLimits()),
        lifespan="on",
        access_log=False,
        server_header=False,
        log_config=None,
        log_level="warning",
    )
    tune_gc()  # as the router does
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
