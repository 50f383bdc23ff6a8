"""Per-request orchestration: pick a pair, rewrite, call both legs, relay, retry when safe.

Failure rules (PROTOCOLS.md 3.3, 5.7): if the prefill leg fails, the decode leg is cancelled at
once and the client gets the prefill's error; if the client goes away, both legs are cancelled.
Only connect errors are retried, and only before any byte reached the client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from router.adapters import LegPlan, PDAdapter
from router.errors import (
    NoWorkerAvailable,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from router.interrupt import Interrupt, failure_of, reap
from router.policies import Policy, least_loaded_rank
from router.relay import Responder
from router.schemas import ParsedRequest
from router.settings import HealthSettings, UpstreamSettings
from router.upstream import UpstreamClient, UpstreamPool, UpstreamResponse, is_worker_fault
from router.workers import Worker

__all__ = ["ClientDisconnected", "Pipeline"]

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_JSON = b"application/json"


class ClientDisconnected(Exception):
    """The client closed its connection; both legs were cancelled."""


def _error_detail(body: bytes) -> str:
    """The engine's error message if it sent an OpenAI/FastAPI error JSON, else the raw text."""
    try:
        data = _decode(body)
    except msgspec.DecodeError:
        return body[:500].decode(errors="replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(data.get("detail"), str):
            return str(data["detail"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
    return body[:500].decode(errors="replace")


def _prefill_json(answer: bytes, prefill: Worker) -> Any:
    try:
        return _decode(answer)
    except msgspec.DecodeError as exc:
        raise UpstreamUnavailable(
            f"answered invalid JSON: {answer[:200]!r}",
            role="prefill",
            url=prefill.url,
            connect=False,
        ) from exc


class Pipeline:
    """Routes one parsed request through a prefill and a decode worker."""

    def __init__(
        self,
        pool: UpstreamPool,
        adapter: PDAdapter,
        prefill_policy: Policy,
        decode_policy: Policy,
        upstream_settings: UpstreamSettings,
        health_settings: HealthSettings,
        on_stale_layout: Callable[[Worker], None],
    ) -> None:
        self._pool = pool
        self._adapter = adapter
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._settings = upstream_settings
        self._failure_threshold = health_settings.failure_threshold
        self._on_stale_layout = on_stale_layout

    async def handle(
        self,
        request: ParsedRequest,
        headers: dict[str, str],
        responder: Responder,
        disconnected: asyncio.Future[Any],
    ) -> None:
        """Serve ``request``; raises RouterError for the caller to render, or ClientDisconnected."""
        self._adapter.check(request)
        attempts = self._settings.max_retries + 1
        failed: set[str] = set()
        last_error: UpstreamUnavailable | None = None
        for attempt in range(1, attempts + 1):
            try:
                prefill, rank, decode = self._select(failed)
            except NoWorkerAvailable:
                if last_error is None:
                    raise
                raise last_error from None  # retries used up every healthy worker
            plan = self._adapter.plan(request, prefill, rank, decode)
            try:
                await self._attempt(
                    request, plan, headers, (prefill, rank, decode), responder, disconnected
                )
                return
            except UpstreamUnavailable as exc:
                if not exc.connect or responder.started or attempt == attempts:
                    raise
                last_error = exc
                failed.add(prefill.id if exc.role == "prefill" else decode.id)
                logger.warning(
                    "attempt %d failed before any byte was sent, retrying: %s",
                    attempt,
                    exc.message,
                )

    def _select(self, failed: set[str]) -> tuple[Worker, int, Worker]:
        prefills = self._pool.available_prefill()
        decodes = self._pool.available_decode()
        if not prefills:
            raise NoWorkerAvailable("no healthy prefill worker is available")
        if not decodes:
            raise NoWorkerAvailable("no healthy decode worker is available")
        if failed:
            prefills = [w for w in prefills if w.id not in failed] or prefills
            decodes = [w for w in decodes if w.id not in failed] or decodes
        prefill = self._prefill_policy.choose(prefills)
        decode = self._decode_policy.choose(decodes)
        rank = least_loaded_rank(prefill) if prefill.dp_size > 1 else 0
        return prefill, rank, decode

    async def _attempt(
        self,
        request: ParsedRequest,
        plan: LegPlan,
        headers: dict[str, str],
        pair: tuple[Worker, int, Worker],
        responder: Responder,
        disconnected: asyncio.Future[Any],
    ) -> None:
        prefill, rank, decode = pair
        prefill_headers = {**headers, **plan.prefill_headers} if plan.prefill_headers else headers
        prefill_body = _encode(plan.prefill_body)
        prefill_call = self._prefill(request, prefill, rank, prefill_body, prefill_headers)
        if plan.decode_body is None:
            answer = await self._until_disconnect(prefill_call, disconnected)
            body = self._adapter.decode_after_prefill(request, _prefill_json(answer, prefill))
            decode_call = self._decode(request, decode, _encode(body), headers, responder, prefill)
            await self._until_disconnect(decode_call, disconnected)
            return
        # SGLang sends the very same body to both legs: encode it once.
        same = plan.decode_body is plan.prefill_body
        decode_body = prefill_body if same else _encode(plan.decode_body)
        decode_call = self._decode(request, decode, decode_body, headers, responder, prefill)
        await self._concurrent(prefill_call, decode_call, disconnected)

    async def _until_disconnect(
        self, call: Coroutine[Any, Any, Any], disconnected: asyncio.Future[Any]
    ) -> Any:
        """Await ``call`` in this task; a client disconnect cancels it."""
        interrupt = Interrupt()
        with interrupt.on_done(disconnected, lambda _: ClientDisconnected()):
            return await interrupt.guard(call)

    async def _concurrent(
        self,
        prefill_call: Coroutine[Any, Any, bytes],
        decode_call: Coroutine[Any, Any, None],
        disconnected: asyncio.Future[Any],
    ) -> None:
        """Run both legs; a prefill failure or a disconnect cancels the decode at once.

        The decode leg runs in this task (it owns the client response); the prefill leg in a
        child task whose failure interrupts this one.
        """
        prefill_task = asyncio.create_task(prefill_call)
        interrupt = Interrupt()
        try:
            with (
                interrupt.on_done(prefill_task, failure_of),
                interrupt.on_done(disconnected, lambda _: ClientDisconnected()),
            ):
                await interrupt.guard(decode_call)
            try:
                await prefill_task
            except UpstreamError as exc:  # the client is served already
                logger.warning("prefill failed after the decode answered: %s", exc.message)
        finally:
            await reap(prefill_task)

    async def _prefill(
        self,
        request: ParsedRequest,
        worker: Worker,
        rank: int,
        body: bytes,
        headers: dict[str, str],
    ) -> bytes:
        upstream = self._pool.client(worker)
        with worker.load(rank):
            try:
                status, content = await self._post_whole(upstream, request, body, headers)
                if status >= 400:
                    raise UpstreamStatusError(
                        status, _error_detail(content), role="prefill", url=worker.url
                    )
            except UpstreamError as exc:
                self._record(worker, exc)
                raise
        self._record(worker, None)
        return content

    async def _post_whole(
        self,
        upstream: UpstreamClient,
        request: ParsedRequest,
        body: bytes,
        headers: dict[str, str],
    ) -> tuple[int, bytes]:
        """POST and read the whole answer within the prefill's total deadline."""
        try:
            async with asyncio.timeout(self._settings.prefill_timeout_s):
                response = await upstream.open(request.endpoint.value, body, headers)
                return response.status, await response.read()
        except TimeoutError as exc:
            worker = upstream.worker
            raise UpstreamTimeout(
                f"no complete answer within {self._settings.prefill_timeout_s:g}s",
                role=worker.role.value,
                url=worker.url,
            ) from exc

    async def _decode(
        self,
        request: ParsedRequest,
        worker: Worker,
        body: bytes,
        headers: dict[str, str],
        responder: Responder,
        prefill: Worker,
    ) -> None:
        upstream = self._pool.client(worker)
        with worker.load():
            try:
                response = await upstream.open(request.endpoint.value, body, headers)
                if request.stream and response.status < 400:
                    await self._relay(worker, response, responder, prefill)
                else:
                    content = await response.read()
                    self._check_decode_status(response.status, content, worker, prefill)
                    await responder.whole(response.status, response.content_type, content)
            except UpstreamError as exc:
                self._record(worker, exc)
                raise

    async def _relay(
        self, worker: Worker, response: UpstreamResponse, responder: Responder, prefill: Worker
    ) -> None:
        """Move decode's SSE bytes to the client as they come.

        The client's response starts with the first body chunk, not with decode's headers: until
        then nothing has reached the client, so a failing prefill can still be retried.
        """
        try:
            chunks = response.chunks()
            chunk = await anext(chunks, b"")
            self._check_stale_layout(chunk, worker, prefill)
            await responder.start(response.status, response.content_type, sse=True)
            while chunk:
                if response.at_eof():  # the last chunk: send it with the end of the body
                    break
                await responder.chunk(chunk)
                chunk = await anext(chunks, b"")
            await responder.finish(chunk)
        finally:
            await response.aclose()
        self._record(worker, None)

    def _check_decode_status(
        self, status: int, content: bytes, worker: Worker, prefill: Worker
    ) -> None:
        if status < 500:
            self._record(worker, None)
            return
        self._check_stale_layout(content, worker, prefill)
        worker.record_failure(self._failure_threshold)

    def _check_stale_layout(self, content: bytes, worker: Worker, prefill: Worker) -> None:
        """A decode error naming an unknown engine id: re-read the prefill's layout now."""
        if self._adapter.is_stale_layout(content):
            logger.warning(
                "decode %s does not know prefill %s's engine id; re-querying",
                worker.url,
                prefill.url,
            )
            self._on_stale_layout(prefill)

    def _record(self, worker: Worker, exc: UpstreamError | None) -> None:
        if exc is None:
            worker.record_success()
        elif is_worker_fault(exc):
            worker.record_failure(self._failure_threshold)
