"""One build's measurement for ``bench.load.pipeline_cost``: run as a script, not imported.

The router's ASGI app (whatever tree ``router`` is imported from: PYTHONPATH) serves completions
called in process, its workers' upstream clients replaced by stubs that answer from memory after
one event-loop turn. Every other part is the router's own, started as it starts (settings from
its command line, the lifespan: health probes and bootstrap queries go to the real fake engines
named on this command line). It prints JSON: the CPU µs per request of each measured batch.

    PYTHONPATH=TREE python -P pipeline_cost_child.py --engine E --prefill URL PORT --decode URL
        [--stream] [--requests N] [--concurrency C] [--batches B] [--tokens T] [--keys K,...]

With ``--keys``, caller ``i`` presents key ``i % len(keys)`` (``Authorization: Bearer``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

_CHAT_ID = b'"id":"cmpl-stub","object":"text_completion","model":"fake-model"'
_PREFILL = (
    b"{" + _CHAT_ID + b',"choices":[{"index":0,"text":" a","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6},'
    b'"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false}}'
)
_EVENT = b"data: {" + _CHAT_ID + b',"choices":[{"index":0,"text":" a"}]}\n\n'
_USAGE = b'"usage":{"prompt_tokens":5,"completion_tokens":%d,"total_tokens":%d}'


def _decode_answer(tokens: int) -> bytes:
    text = b" a" * tokens
    usage = _USAGE % (tokens, tokens + 5)
    return b'{%s,"choices":[{"index":0,"text":"%s","finish_reason":"length"}],%s}' % (
        _CHAT_ID,
        text,
        usage,
    )


class _Whole:
    """A ``send_whole`` call answered from memory."""

    def __init__(self, body: bytes) -> None:
        self.status = 200
        self._body = body

    def take_whole(self) -> bytes:
        return self._body

    def abandon(self) -> None:
        pass


class _Answer:
    """An answer from memory: whole, or a stream of three chunks (the first event; the other
    events; the usage event and the end), each after one event-loop turn."""

    def __init__(self, body: bytes, stream: bool, tokens: int) -> None:
        self.status = 200
        self.content_type = b"text/event-stream" if stream else b"application/json"
        self._body = body
        self._tokens = tokens

    async def read(self) -> bytes:
        return self._body

    async def chunks(self) -> AsyncIterator[bytes]:
        usage = (
            b"data: {"
            + _CHAT_ID
            + b',"choices":[],'
            + _USAGE
            % (
                self._tokens,
                self._tokens + 5,
            )
            + b"}\n\n"
        )
        for chunk in (_EVENT, _EVENT * (self._tokens - 1), usage + b"data: [DONE]\n\n"):
            await asyncio.sleep(0)
            yield chunk

    def at_eof(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


class _Stub:
    """A worker's upstream client answering from memory (the seam of any build of ours)."""

    def __init__(self, worker: Any, body: bytes, tokens: int) -> None:
        self.worker = worker
        self._body = body
        self._tokens = tokens

    def send_whole(
        self, path: str, body: bytes, headers: dict[str, str], done: Callable[[Any], None]
    ) -> _Whole:
        call = _Whole(self._body)
        asyncio.get_running_loop().call_soon(done, call)
        return call

    async def open(
        self, path: str, body: bytes, headers: dict[str, str], *, whole: bool = False, **_: Any
    ) -> _Answer:
        await asyncio.sleep(0)
        return _Answer(self._body, not whole, self._tokens)

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        return 200, b"{}"

    async def aclose(self) -> None:
        pass


def _import(*candidates: str) -> Any:
    """The first of ``module:name`` that imports (older trees keep things elsewhere)."""
    for candidate in candidates:
        module, _, name = candidate.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


class _Lifespan:
    """The app's lifespan, driven as a server drives it."""

    def __init__(self, app: Any) -> None:
        self.state: dict[str, Any] = {}
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        scope = {"type": "lifespan", "state": self.state, "asgi": {"version": "3.0"}}
        self._task = asyncio.ensure_future(app(scope, self._inbox.get, self._outbox.put))

    async def start(self) -> None:
        await self._inbox.put({"type": "lifespan.startup"})
        started = await self._outbox.get()
        if started["type"] != "lifespan.startup.complete":
            raise SystemExit(f"the router did not start: {started}")

    async def stop(self) -> None:
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._outbox.get()
        await self._task


async def _stub_workers(pool: Any, tokens: int) -> None:
    """Once a prefill and a decode are healthy: their clients answer from memory."""
    deadline = time.monotonic() + 30
    while not (pool.available_prefill() and pool.available_decode()):
        if time.monotonic() > deadline:
            raise SystemExit("no healthy prefill and decode within 30 s")
        await asyncio.sleep(0.05)
    decode_body = _decode_answer(tokens)
    for worker in (*pool.available_prefill(), *pool.available_decode()):
        body = _PREFILL if worker.role.value == "prefill" else decode_body
        pool._clients[worker.id] = _Stub(worker, body, tokens)


class _Caller:
    """Completion requests called straight into the app, as the router's server calls it."""

    def __init__(self, app: Any, state: dict[str, Any], args: argparse.Namespace) -> None:
        self._app, self._state = app, state
        self._client_gone = _import("router.types:CLIENT_GONE")
        self._whole = _import("router.types:WHOLE_RESPONSE")
        stream = b"true" if args.stream else b"false"
        body = b'{"model":"fake-model","prompt":"hello there","max_tokens":%d,"stream":%s}'
        self._body = body % (args.tokens, stream)
        self._headers = [
            (b"host", b"router"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self._body)).encode()),
        ]
        self._keys = [key for key in args.keys.split(",") if key]
        self.statuses: dict[int, int] = {}

    async def _send(self, message: dict[str, Any]) -> None:
        status = message.get("status")
        if status is not None:
            self.statuses[status] = self.statuses.get(status, 0) + 1

    def _receiver(self) -> Callable[[], Any]:
        """The body once, then nothing until the request ended (the client stays)."""
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.get_running_loop().create_future()  # (cancelled at the end)
            sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}

        return receive

    def headers(self, user: int) -> list[tuple[bytes, bytes]]:
        """Caller ``user``'s headers: with keys, its key's ``Authorization`` too."""
        if not self._keys:
            return self._headers
        key = self._keys[user % len(self._keys)]
        return [*self._headers, (b"authorization", b"Bearer " + key.encode())]

    def _scope(self, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        scope: dict[str, Any] = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": headers,
            "state": dict(self._state),
        }
        if self._whole is not None:
            scope["extensions"] = {self._whole: {}}
        if self._client_gone is not None:
            scope[self._client_gone] = asyncio.get_running_loop().create_future()
        return scope

    async def user(self, count: int, user: int = 0) -> None:
        headers = self.headers(user)
        for _ in range(count):
            await self._app(self._scope(headers), self._receiver(), self._send)


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import router

    create_app = _import("router.app:create_app")
    parse_args = _import("router.server.cli:parse_args", "router.cli:parse_args")
    argv = ["--engine", args.engine, "--prefill", *args.prefill, "--decode", args.decode]
    app = create_app(parse_args([*argv, "--policy", "round_robin", "--log-level", "warning"]))
    lifespan = _Lifespan(app)
    await lifespan.start()
    await _stub_workers(lifespan.state["ctx"].pool, args.tokens)
    caller = _Caller(app, lifespan.state, args)
    per_user = max(args.requests // args.concurrency, 1)
    await asyncio.gather(*(caller.user(20, i) for i in range(args.concurrency)))  # warm up
    batches = []
    for _ in range(args.batches):
        gc.collect()
        begun = time.process_time()
        await asyncio.gather(*(caller.user(per_user, i) for i in range(args.concurrency)))
        batches.append(1e6 * (time.process_time() - begun) / (per_user * args.concurrency))
    await lifespan.stop()
    return {"us": batches, "statuses": caller.statuses, "router": router.__file__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True)
    parser.add_argument("--prefill", nargs=2, required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--keys", default="", help="comma-separated API keys, one per caller")
    args = parser.parse_args()
    tune_gc = _import("router.server.gc_schedule:tune_gc")
    if tune_gc is not None:
        tune_gc()  # as the router does
    import uvloop

    result = uvloop.run(_measure(args))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
