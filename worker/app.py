"""The simulated engine's HTTP app: OpenAI endpoints over the SGLang and vLLM PD request fields.

``create_app(worker)`` serves one ``worker.sim.SimWorker``: ``/v1/completions`` and
``/v1/chat/completions`` (JSON, or SSE with one event per generated token; ``usage`` carries
``prompt_tokens_details.cached_tokens`` as vLLM and SGLang report it), ``/v1/models``,
``/health`` (pages, open rooms, prefill queues, requests waiting for KV pages, KV bytes sent, KV
event endpoints, and with a tiered cache ``hicache``: pages per tier, whether L3's start-up scan
is done),
``/metrics`` (``worker.metrics``), ``/v1/loads`` (``worker.loads``) and
``POST /reset_prefix_cache`` (vLLM) / ``/flush_cache`` (SGLang), which empty the prefix cache.
Opt-in only (``create_app(worker, fault_api=True)``, ``pd-worker --fault-api``), for soak
tests (``bench/soak/main.py``): ``POST /debug/fault`` injects a fault for a while (``{"http_5xx_s":
5}``:
completion requests answer 500; ``{"slow_s": 10, "slow_s_per_token": 0.1}``: that much more
time per generated token), ``GET /debug/fault`` reads the injected state and the count of
completions answered 200 by this process. Without the flag these routes do not exist.
Request parsing is ``worker.protocol``; what a sequence does per role is ``worker.serving``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from worker.loads import loads_report, parse_include
from worker.metrics import CONTENT_TYPE
from worker.protocol import Seq, WorkerError, max_tokens, sequences
from worker.sim import Completion, EngineFactory, SimWorker, WorkerConfig

__all__ = ["EngineFactory", "SimWorker", "WorkerConfig", "WorkerError", "create_app"]


@dataclass
class _Faults:
    """Faults injected through ``/debug/fault`` (monotonic deadlines) and a served count."""

    http_5xx_until: float = 0.0
    slow_until: float = 0.0
    slow_s_per_token: float = 0.0
    served_ok: int = 0
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def failing(self) -> bool:
        return time.monotonic() < self.http_5xx_until

    def extra_s_per_token(self) -> float:
        return self.slow_s_per_token if time.monotonic() < self.slow_until else 0.0

    def inject(self, spec: dict[str, Any]) -> None:
        """``http_5xx_s``, ``slow_s`` with ``slow_s_per_token``; ValueError when malformed."""
        now = time.monotonic()
        values = {k: float(spec.get(k, 0.0)) for k in ("http_5xx_s", "slow_s", "slow_s_per_token")}
        if min(values.values()) < 0 or set(spec) - set(values):
            raise ValueError(f"expected non-negative {sorted(values)}, got {spec}")
        if values["http_5xx_s"]:
            self.http_5xx_until = now + values["http_5xx_s"]
        if values["slow_s"]:
            self.slow_until = now + values["slow_s"]
            self.slow_s_per_token = values["slow_s_per_token"]

    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "boot_id": self.boot_id,
            "served_ok": self.served_ok,
            "http_5xx_left_s": max(self.http_5xx_until - now, 0.0),
            "slow_left_s": max(self.slow_until - now, 0.0),
        }


def _usage(results: list[Completion], chat: bool) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": _prompt_details(results, chat),
        "kv_bytes_received": sum(r.kv_bytes for r in results),
        "kv_transfer_s": max((r.transfer_s for r in results), default=0.0),
    }


def _prompt_details(results: list[Completion], chat: bool) -> dict[str, int]:
    details = {"cached_tokens": sum(r.cached_tokens for r in results)}
    computed = [r.computed_tokens for r in results if r.computed_tokens is not None]
    if computed and chat:  # vLLM 0.32 --enable-prompt-tokens-details: chat answers only
        details["created_cache_tokens"] = sum(computed)
    return details


def _choice(index: int, result: Completion, chat: bool) -> dict[str, Any]:
    if chat:
        return {
            "index": index,
            "finish_reason": "length",
            "message": {"role": "assistant", "content": result.text},
        }
    return {"index": index, "text": result.text, "finish_reason": "length", "logprobs": None}


async def _chunks(
    base: dict[str, Any], results: list[Completion], chat: bool, s_per_token: float
) -> AsyncIterator[bytes]:
    """The SSE events, one per generated token, ``s_per_token`` apart (one decode step)."""
    for index, result in enumerate(results):
        for position, char in enumerate(result.text):
            if position and s_per_token:
                await asyncio.sleep(s_per_token)
            delta: dict[str, Any] = {"delta": {"content": char}} if chat else {"text": char}
            choice = {"index": index, "finish_reason": None, **delta}
            yield _sse({**base, "choices": [choice]})
        end: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
        yield _sse({**base, "choices": [{"index": index, "finish_reason": "length", **end}]})
    yield _sse({**base, "choices": [], "usage": _usage(results, chat)})
    yield b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _serve(worker: SimWorker, request: Request, chat: bool, faults: _Faults) -> Response:
    """Answer one completion request; the request counts as served until its last byte."""
    if faults.failing():
        return JSONResponse({"error": {"message": "injected fault", "code": 500}}, 500)
    span = contextlib.ExitStack()
    if worker.config.role != "prefill":
        span.enter_context(worker.serving())
    try:
        response = await _answer(worker, request, chat, span, faults.extra_s_per_token())
    except BaseException:
        span.close()
        raise
    if not isinstance(response, StreamingResponse):
        span.close()
    faults.served_ok += response.status_code == 200
    return response


async def _answer(
    worker: SimWorker,
    request: Request,
    chat: bool,
    span: contextlib.ExitStack,
    extra_s_per_token: float = 0.0,
) -> Response:
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise WorkerError(400, "the body must be a JSON object")
        seqs = sequences(body, chat, request.headers, worker.tokenizer)
        results = await _gather(worker, seqs, max_tokens(body), _disconnected(request))
    except WorkerError as exc:
        return JSONResponse(
            {"error": {"message": exc.message, "code": exc.status}}, status_code=exc.status
        )
    except (ValueError, TypeError) as exc:
        return JSONResponse({"error": {"message": str(exc), "code": 400}}, status_code=400)
    kind = "chat.completion" if chat else "text_completion"
    base = {
        "id": f"sim-{uuid.uuid4().hex[:12]}",
        "created": int(time.time()),
        "model": worker.config.model,
    }
    s_per_token = worker.config.decode_s_per_token + extra_s_per_token
    if body.get("stream") and worker.config.role != "prefill":
        events = _chunks({**base, "object": f"{kind}.chunk"}, results, chat, s_per_token)
        # the span ends with the stream, or after it when the client left (background runs)
        return StreamingResponse(
            _closing(events, span),
            media_type="text/event-stream",
            background=BackgroundTask(span.close),
        )
    if extra_s_per_token and worker.config.role != "prefill":
        await asyncio.sleep(extra_s_per_token * sum(r.completion_tokens for r in results))
    choices = [_choice(i, r, chat) for i, r in enumerate(results)]
    usage = _usage(results, chat)
    if not worker.config.report_cached_tokens:  # vLLM without --enable-prompt-tokens-details
        del usage["prompt_tokens_details"]
    answer = {**base, "object": kind, "choices": choices, "usage": usage}
    if "kv_transfer_params" in body:
        answer["kv_transfer_params"] = None  # vLLM >= 0.16's MooncakeConnector returns none
    return JSONResponse(answer)


async def _closing(
    events: AsyncIterator[bytes], span: contextlib.ExitStack
) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    finally:
        span.close()


async def _gather(
    worker: SimWorker, seqs: list[Seq], max_new: int, disconnected: Awaitable[None]
) -> list[Completion]:
    """Every sequence's completion; when ``disconnected`` ends first (the client went away), the
    sequences are cancelled (each gives its pages back, see ``SimWorker.complete``) and the
    answer, which nobody reads, is a 499 error."""
    tasks = [asyncio.create_task(worker.complete(seq, max_new)) for seq in seqs]
    gathered = asyncio.gather(*tasks)
    watch = asyncio.ensure_future(disconnected)
    watch.add_done_callback(lambda _: gathered.cancel())
    try:
        return list(await gathered)
    except asyncio.CancelledError:
        if not watch.done() or watch.cancelled():
            raise  # cancelled from outside: not by the client leaving
        raise WorkerError(499, "the client disconnected") from None
    finally:
        watch.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (its body was read: only the disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _health(worker: SimWorker) -> dict[str, Any]:
    return {
        "status": "ok",
        "role": worker.config.role,
        "free_pages": sum(pool.free_pages for pool in worker.pools),
        "quarantined_pages": sum(pool.quarantined for pool in worker.pools),
        "open_rooms": worker.open_rooms,
        "queues": worker.queues,
        "waiting_for_pages": worker.waiting_for_pages,
        "kv_bytes_sent": worker.kv_bytes_sent,
        "cached_pages": sum(pool.cache.cached_pages for pool in worker.pools),
        "kv_events": [{"endpoint": e, "replay": r} for e, r in worker.event_endpoints],
    }


def create_app(worker: SimWorker, *, fault_api: bool = False) -> FastAPI:
    """The worker's ASGI app; its lifespan runs ``worker.run()``; ``fault_api``: the
    ``/debug/fault`` routes (soak tests only)."""
    faults = _Faults()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with worker.run():
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        answer = _health(worker)
        tiers = worker.tier_status()
        if tiers is not None:
            answer["hicache"] = tiers
        return answer

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(worker.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/loads")
    async def loads(include: str | None = None, dp_rank: int | None = None) -> Response:
        try:
            wanted = parse_include(include)
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc), "code": 400}}, status_code=400)
        mode = {"prefill": "prefill", "decode": "decode"}.get(worker.config.role, "null")
        return JSONResponse(loads_report(worker.snapshots(), mode, wanted, dp_rank))

    @app.post("/reset_prefix_cache")
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def reset_prefix_cache() -> Response:
        worker.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": worker.config.model, "object": "model", "owned_by": "pd-worker"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(worker, request, False, faults)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _serve(worker, request, True, faults)

    if fault_api:
        _add_fault_routes(app, faults)
    return app


def _add_fault_routes(app: FastAPI, faults: _Faults) -> None:
    @app.get("/debug/fault", include_in_schema=False)
    async def fault_state() -> dict[str, Any]:
        return faults.state()

    @app.post("/debug/fault", include_in_schema=False)
    async def inject_fault(request: Request) -> Response:
        try:
            spec = await request.json()
            if not isinstance(spec, dict):
                raise ValueError("the body must be a JSON object")
            faults.inject(spec)
        except (ValueError, TypeError) as exc:
            return JSONResponse({"error": {"message": str(exc), "code": 400}}, status_code=400)
        return JSONResponse(faults.state())
