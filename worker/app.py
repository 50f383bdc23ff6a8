"""The simulated engine's HTTP app: OpenAI endpoints over the SGLang PD request fields.

Roles: ``prefill`` computes the prompt's KV into its pool and sends it with ``KVSender`` to the
decode named by ``bootstrap_room`` (answering once the transfer reached Success, 500 with the
reason otherwise); ``decode`` allocates pages, receives the KV with ``KVReceiver`` from the
bootstrap API at ``bootstrap_host:bootstrap_port``, verifies it and generates tokens from it;
``both`` computes the KV locally (the co-located reference output). Pages are released on
every path (withheld only when the transfer library says writes may still land in them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from transfer.bootstrap import PrefillRank
from transfer.engine.base import TransferEngine
from transfer.errors import TransferError
from transfer.receiver import KVReceiver, ReceiveFailed
from transfer.sender import KVSender
from worker.kv import KVPool, PoolExhausted, PoolShape, detokenize, generate, tokenize

__all__ = ["EngineFactory", "SimWorker", "WorkerConfig", "WorkerError", "create_app"]

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both"]
EngineFactory = Callable[[], Awaitable[TransferEngine]]
_AUX_LEN = 16
_AUX_SLOTS = 256


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: Role
    model: str = "sim-model"
    shape: PoolShape = field(default_factory=PoolShape)
    registry: str | None = None  # the bootstrap API a prefill registers with
    namespace: str | None = None
    host: str = "127.0.0.1"  # control-plane bind address
    max_prompt_tokens: int = 8192
    transfer_timeout_s: float = 30.0
    compute_s_per_token: float = 0.0


class WorkerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class _Seq:
    """One sequence of a request: its prompt tokens and its PD room (None: co-located)."""

    index: int
    tokens: list[int]
    room: int | None
    bootstrap: str | None


@dataclass(frozen=True, slots=True)
class _Result:
    text: str
    prompt_tokens: int
    completion_tokens: int
    kv_bytes: int
    transfer_s: float


class SimWorker:
    """One simulated engine rank; ``run()`` opens its engine, pool and transfer side."""

    def __init__(self, config: WorkerConfig, engine: EngineFactory | None) -> None:
        self.config = config
        self.pool = KVPool(config.shape)
        self._engine_factory = engine
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._aux_free = list(range(_AUX_SLOTS))

    @property
    def open_rooms(self) -> int:
        """Transfer rooms started and not yet released on this worker's side."""
        if self.sender is not None:
            return self.sender.open_rooms
        return self.receiver.open_rooms if self.receiver is not None else 0

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        if self.config.role == "both" or self._engine_factory is None:
            yield
            return
        engine = await self._engine_factory()
        context = zmq.asyncio.Context()
        try:
            async with self._transfer_side(context, engine):
                yield
        finally:
            await engine.close()
            context.term()

    @contextlib.asynccontextmanager
    async def _transfer_side(self, context: zmq.asyncio.Context,
                             engine: TransferEngine) -> AsyncIterator[None]:
        cfg = self.config
        if cfg.role == "prefill":
            rank = PrefillRank(page_size=cfg.shape.page_size)
            async with KVSender(context, engine, self.pool.layout, rank, registry=cfg.registry,
                                namespace=cfg.namespace, host=cfg.host, aux_item_len=_AUX_LEN,
                                aux_slots=_AUX_SLOTS, bootstrap_timeout_s=cfg.transfer_timeout_s,
                                transfer_timeout_s=cfg.transfer_timeout_s) as sender:
                self.sender = sender
                yield
        else:
            async with KVReceiver(context, engine, self.pool.layout, host=cfg.host,
                                  aux_item_len=_AUX_LEN, aux_slots=_AUX_SLOTS) as receiver:
                self.receiver = receiver
                yield

    # --- requests ------------------------------------------------------------------------------

    async def complete(self, seq: _Seq, max_tokens: int) -> _Result:
        if not seq.tokens:
            raise WorkerError(400, "empty prompt")
        if len(seq.tokens) > min(self.config.max_prompt_tokens, self.pool.max_tokens):
            raise WorkerError(400, f"prompt of {len(seq.tokens)} tokens is longer than "
                                   f"{min(self.config.max_prompt_tokens, self.pool.max_tokens)}")
        try:
            pages = self.pool.allocate(len(seq.tokens))
        except PoolExhausted as exc:
            raise WorkerError(503, str(exc)) from exc
        keep = True
        try:
            if self.config.role == "prefill":
                return await self._prefill(seq, pages)
            if self.config.role == "decode":
                return await self._decode(seq, pages, max_tokens)
            return await self._colocated(seq, pages, max_tokens)
        except _Unsafe as exc:
            keep = exc.pages_safe
            raise
        finally:
            if keep:
                self.pool.release(pages)
            else:
                self.pool.quarantine(pages)

    async def _forward(self, seq: _Seq, pages: list[int]) -> None:
        if self.config.compute_s_per_token:
            await asyncio.sleep(self.config.compute_s_per_token * len(seq.tokens))
        self.pool.write(pages, seq.tokens)

    async def _colocated(self, seq: _Seq, pages: list[int], max_tokens: int) -> _Result:
        await self._forward(seq, pages)
        return self._decode_tokens(seq, pages, max_tokens, 0, 0.0)

    async def _prefill(self, seq: _Seq, pages: list[int]) -> _Result:
        if self.sender is None or seq.room is None:
            raise WorkerError(400, "a prefill request needs bootstrap_room")
        await self._forward(seq, pages)
        started = time.monotonic()
        aux = struct.pack("<QQ", len(seq.tokens), seq.room & ((1 << 64) - 1))
        try:
            await self.sender.send(seq.room, pages, len(seq.tokens), is_last_chunk=True, aux=aux)
        except TransferError as exc:
            raise WorkerError(500, f"KV transfer failed: {exc}") from exc
        return _Result("", len(seq.tokens), 0, 0, time.monotonic() - started)

    async def _decode(self, seq: _Seq, pages: list[int], max_tokens: int) -> _Result:
        if self.receiver is None or seq.room is None or seq.bootstrap is None:
            raise WorkerError(400, "a decode request needs bootstrap_host/port/room")
        if not self._aux_free:
            raise WorkerError(503, "no free aux slot")
        aux_index = self._aux_free.pop()
        try:
            got = await self.receiver.request(seq.room, seq.bootstrap, pages, aux_index,
                                              self.config.transfer_timeout_s)
        except ReceiveFailed as exc:
            if exc.pages_safe:
                self._aux_free.append(aux_index)
            raise _Unsafe(exc.pages_safe, f"KV transfer failed: {exc}") from exc
        except (TransferError, ValueError) as exc:
            self._aux_free.append(aux_index)
            raise WorkerError(500, f"KV transfer failed: {exc}") from exc
        self._aux_free.append(aux_index)
        if struct.unpack("<Q", got.aux[:8])[0] != len(seq.tokens):
            raise WorkerError(500, "aux from the prefill names another prompt length")
        return self._decode_tokens(seq, pages, max_tokens, got.kv_bytes, got.elapsed_s)

    def _decode_tokens(self, seq: _Seq, pages: list[int], max_tokens: int, kv_bytes: int,
                       transfer_s: float) -> _Result:
        digest, bad = self.pool.read_digest(pages, seq.tokens)
        if bad >= 0:
            raise WorkerError(500, f"received KV does not match the prompt at position {bad}")
        tokens = generate(digest, max_tokens)
        return _Result(detokenize(tokens), len(seq.tokens), len(tokens), kv_bytes, transfer_s)


class _Unsafe(WorkerError):
    """A failed receive; ``pages_safe`` False keeps the request's pages out of the pool."""

    def __init__(self, pages_safe: bool, message: str) -> None:
        super().__init__(500, message)
        self.pages_safe = pages_safe


# --- request parsing -------------------------------------------------------------------------


def _prompts(body: dict[str, Any], chat: bool) -> list[str]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise WorkerError(400, "messages must be a non-empty list")
        return ["".join(f"{m.get('role', '')}: {_content(m.get('content'))}\n"
                        for m in messages if isinstance(m, dict))]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    raise WorkerError(400, "prompt must be a string or a list of strings")


def _content(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")


def _as_list(value: Any, count: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise WorkerError(400, f"{len(value)} bootstrap values for {count} sequences")
        return value
    if count != 1 and value is not None:
        raise WorkerError(400, "batched requests need list bootstrap fields")
    return [value] * count


def _sequences(body: dict[str, Any], chat: bool) -> list[_Seq]:
    n = int(body.get("n") or 1)
    texts = [text for text in _prompts(body, chat) for _ in range(n)]
    rooms = _as_list(body.get("bootstrap_room"), len(texts))
    hosts = _as_list(body.get("bootstrap_host"), len(texts))
    ports = _as_list(body.get("bootstrap_port"), len(texts))
    return [
        _Seq(i, tokenize(text), None if room is None else int(room),
             None if host is None or port is None else f"{host}:{port}")
        for i, (text, room, host, port) in enumerate(zip(texts, rooms, hosts, ports, strict=True))
    ]


# --- HTTP ------------------------------------------------------------------------------------


def _usage(results: list[_Result]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "kv_bytes_received": sum(r.kv_bytes for r in results),
        "kv_transfer_s": max((r.transfer_s for r in results), default=0.0),
    }


def _choice(index: int, result: _Result, chat: bool) -> dict[str, Any]:
    if chat:
        return {"index": index, "finish_reason": "length",
                "message": {"role": "assistant", "content": result.text}}
    return {"index": index, "text": result.text, "finish_reason": "length", "logprobs": None}


def _chunks(base: dict[str, Any], results: list[_Result], chat: bool) -> Iterator[bytes]:
    for index, result in enumerate(results):
        for char in result.text:
            delta: dict[str, Any] = ({"delta": {"content": char}} if chat else {"text": char})
            choice = {"index": index, "finish_reason": None, **delta}
            yield _sse({**base, "choices": [choice]})
        end: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
        yield _sse({**base, "choices": [{"index": index, "finish_reason": "length", **end}]})
    yield _sse({**base, "choices": [], "usage": _usage(results)})
    yield b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _serve(worker: SimWorker, request: Request, chat: bool) -> Response:
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise WorkerError(400, "the body must be a JSON object")
        seqs = _sequences(body, chat)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        results = await _gather(worker, seqs, max_tokens)
    except WorkerError as exc:
        return JSONResponse({"error": {"message": exc.message, "code": exc.status}},
                            status_code=exc.status)
    except (ValueError, TypeError) as exc:
        return JSONResponse({"error": {"message": str(exc), "code": 400}}, status_code=400)
    kind = "chat.completion" if chat else "text_completion"
    base = {"id": f"sim-{uuid.uuid4().hex[:12]}", "created": int(time.time()),
            "model": worker.config.model}
    if body.get("stream") and worker.config.role != "prefill":
        return StreamingResponse(_chunks({**base, "object": f"{kind}.chunk"}, results, chat),
                                 media_type="text/event-stream")
    choices = [_choice(i, r, chat) for i, r in enumerate(results)]
    return JSONResponse({**base, "object": kind, "choices": choices, "usage": _usage(results)})


async def _gather(worker: SimWorker, seqs: list[_Seq], max_tokens: int) -> list[_Result]:
    tasks = [asyncio.create_task(worker.complete(seq, max_tokens)) for seq in seqs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def create_app(worker: SimWorker) -> FastAPI:
    """The worker's ASGI app; its lifespan runs ``worker.run()``."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with worker.run():
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "role": worker.config.role,
                "free_pages": worker.pool.free_pages,
                "quarantined_pages": worker.pool.quarantined,
                "open_rooms": worker.open_rooms}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": worker.config.model, "object": "model",
                                            "owned_by": "pd-worker"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(worker, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _serve(worker, request, chat=True)

    return app
