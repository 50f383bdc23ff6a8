"""A PD attempt: the prefill leg too, before the decode (``sequential``: the decode's body comes
from the prefill's answer) or beside it (``concurrent``: the same body to both), and the watch on
the KV cache between them.

Failure rules (docs/concepts/protocols.md 3.3, 5.7): if the prefill leg fails, the decode leg is
cancelled at
once and the client gets the prefill's error; if the client goes away, both legs are cancelled.

Real engines never give up on a KV that does not come before 480-540 s, so the router does:
- the prefill's answer ends the generation (a stop token; ``completed_by_prefill``): the client
  gets that answer and the decode leg is cancelled;
- the prefill is lost (marked down, restarted) while the decode may still wait for its KV: the
  decode leg is cancelled with an error;
- a streaming decode's first byte has not come ``kv_arrival_timeout_s`` after the prefill
  answered (``LegClock``): the decode leg is cancelled with a 504.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import msgspec

from router.errors import UpstreamError, UpstreamStatusError, UpstreamTimeout, UpstreamUnavailable
from router.interrupt import ClientDisconnected, Interrupt, failure_of, reap
from router.observability.agreement import UNKNOWN
from router.pipeline.attempt import Attempt
from router.pipeline.decode_usage import prompt_usage
from router.pipeline.prefill_answer import prefill_answer_body, prefill_answer_events
from router.pipeline.verdicts import error_detail
from router.scheduling.policies.cache_aware import PRECISE
from router.schemas import Endpoint
from router.workers import Worker

__all__ = ["PDAttempt"]

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_JSON = b"application/json"


class PDAttempt(Attempt):
    """A prefill leg and a decode leg: the prefill computes the KV cache, the decode gets it and
    generates."""

    __slots__ = ()
    prefill: Worker  # a PD attempt's route has a prefill

    async def run(self) -> None:
        """Both legs in the shape the adapter's plan asks for; the pair's verdict once served."""
        kit, request, headers, clock = self._kit, self.request, self.headers, self.clock
        plan = kit.adapter.plan(request, self.prefill, self.rank, self.decode)
        self.receipt.transfer_ref = plan.transfer_ref or None
        prefill_headers = {**headers, **plan.prefill_headers} if plan.prefill_headers else headers
        prefill_body = _encode(plan.prefill_body)
        prefill_call = self._prefill(prefill_body, prefill_headers)
        try:
            if plan.decode_body is None:
                await self._sequential(prefill_call)
            else:
                # SGLang sends the very same body to both legs: encode it once.
                same = plan.decode_body is plan.prefill_body
                decode_body = prefill_body if same else _encode(plan.decode_body)
                await self._concurrent(prefill_call, self._decode(decode_body))
        except _PrefillCompleted as done:
            await self._answer_from_prefill(done.answer)
        finally:
            clock.close()
        if request.stream and clock.prefill_done is not None and clock.first_byte is not None:
            # SGLang's decode may start before its prefill answers: the KV was there already
            self.receipt.kv_wait_s = max(clock.first_byte - clock.prefill_done, 0.0)
        kit.verdicts.pd_served(self.prefill, self.decode, self.receipt)

    async def _sequential(self, prefill_call: Coroutine[Any, Any, bytes]) -> None:
        """Prefill first; then the decode, built from the prefill's answer."""
        interrupt = Interrupt(self.loop)  # guards one leg at a time
        with interrupt.on_done(self.disconnected, lambda _: ClientDisconnected()):
            answer = _prefill_json(await interrupt.guard(prefill_call), self.prefill)
        self.clock.prefill_answered()
        adapter = self._kit.adapter
        if adapter.completed_by_prefill(answer):
            raise _PrefillCompleted(answer)
        body = adapter.decode_after_prefill(self.request, answer)
        decode_call = self._decode(_encode(body))
        with self._kv_watch(interrupt):
            await interrupt.guard(decode_call)

    async def _concurrent(
        self, prefill_call: Coroutine[Any, Any, bytes], decode_call: Coroutine[Any, Any, None]
    ) -> None:
        """Run both legs; a prefill failure or a disconnect cancels the decode at once.

        The decode leg runs in this task (it owns the client response); the prefill leg in a
        child task whose failure (or answer that ends the generation) interrupts this one.
        """
        clock, responder, adapter = self.clock, self.responder, self._kit.adapter

        def prefill_outcome(task: asyncio.Future[bytes]) -> BaseException | None:
            failure = failure_of(task)
            if failure is not None or task.cancelled():
                return failure
            clock.prefill_answered()
            answer = task.result()
            if responder.started or not _may_have_ended(answer):
                return None  # the common case: no stop at all, decoded by nobody
            try:
                data = _decode(answer)
            except msgspec.DecodeError:
                return None
            return _PrefillCompleted(data) if adapter.completed_by_prefill(data) else None

        prefill_task = self.loop.create_task(prefill_call)
        interrupt = Interrupt(self.loop)
        try:
            with interrupt.on_done(prefill_task, prefill_outcome), self._kv_watch(interrupt):
                try:
                    await decode_call
                except asyncio.CancelledError as cancelled:
                    raise interrupt.reason(cancelled) from None
            if not prefill_task.done():
                await _ended_or_after(prefill_task, self._kit.settings.prefill_grace_s)
            self._after_decode(prefill_task)
        finally:
            await reap(prefill_task)

    def _after_decode(self, prefill_task: asyncio.Task[bytes]) -> None:
        """The decode's answer went to the client; its prefill leg, if it still runs after
        ``prefill_grace_s`` (its connection is kept when it answers in that time), is cancelled
        (by the caller), so that the request's admission slot and in-flight counts are released
        then, not when the prefill answers (up to --prefill-timeout). That is safe:
        a decode that generated had the KV (SGLang's prefill answers only once the transfer
        ended, vLLM Mooncake's once it finished and waits for the pull), so the prefill's
        request holds nothing the decode still needs. A 2xx decode counts as the prefill's
        success (for its breaker and outlier detection); a prefill that failed late is logged
        and counted."""
        if not prefill_task.done():
            if self.responder.status < 400:
                self._kit.verdicts.delivered(self.prefill)
            return
        failure = None if prefill_task.cancelled() else prefill_task.exception()
        if isinstance(failure, UpstreamError):  # the client is served already
            metrics = self._kit.metrics
            metrics.count(metrics.upstream_errors, failure.role, failure.kind)
            logger.warning("prefill failed after the decode answered: %s", failure.message)

    def _kv_watch(self, interrupt: Interrupt) -> AbstractContextManager[None]:
        """While the decode leg runs: the client leaving, the prefill being lost while the KV may
        still be on its way, or the KV-arrival deadline passing interrupt it."""
        prefill, decode, clock = self.prefill, self.decode, self.clock

        def lost(signal: asyncio.Future[str]) -> BaseException | None:
            if not clock.kv_pending():
                return None  # the decode has the KV: it can finish without the prefill
            return UpstreamUnavailable(
                f"{signal.result()} before the decode received this request's KV cache",
                role="prefill",
                url=prefill.public_url,
                connect=False,
                kind="kv_lost",
            )

        def expired(deadline: asyncio.Future[float]) -> BaseException:
            return UpstreamTimeout(
                f"no first byte {deadline.result():g}s after prefill {prefill.public_url} "
                "answered: the KV cache did not arrive",
                role="decode",
                url=decode.public_url,
                kind="kv_timeout",
            )

        disconnected = interrupt.on_done(self.disconnected, lambda _: ClientDisconnected())
        prefill_lost = interrupt.on_done(prefill.loss_signal(), lost)
        if clock.expired is None:  # no KV-arrival deadline (not a stream)
            return interrupt.together(disconnected, prefill_lost)
        return interrupt.together(
            disconnected, prefill_lost, interrupt.on_done(clock.expired, expired)
        )

    async def _answer_from_prefill(self, answer: dict[str, Any]) -> None:
        logger.info("the prefill's one token ended the generation: answering with it")
        request, responder = self.request, self.responder
        if request.stream:
            await responder.whole(200, b"text/event-stream", prefill_answer_events(request, answer))
        else:
            await responder.whole(200, _JSON, prefill_answer_body(request, answer))

    async def _prefill(self, body: bytes, headers: dict[str, str]) -> bytes:
        """The prefill leg: its whole answer (the KV's whereabouts), or its error."""
        worker, rank = self.prefill, self.rank
        upstream = self._kit.pool.client(worker)
        span = self._leg_span("pdr.prefill", worker)
        if span is not None:
            span.set("pdr.dp_rank", rank)
            headers = {**headers, **span.headers()}
        started = time.perf_counter()
        timeout_s = self._kit.settings.prefill_timeout_s
        with worker.load(rank, self.prefill_tokens), self._leg(worker, span):
            # a prefill marked down (frozen, gone), or the leg's deadline passing, ends it now
            interrupt = Interrupt(self.loop)
            with (
                interrupt.on_done(worker.loss_signal(), partial(_lost_during_prefill, worker)),
                interrupt.after(timeout_s, partial(_overdue, worker, timeout_s)),
            ):
                try:
                    path = self.request.endpoint.value
                    response = await upstream.open(path, body, headers, whole=True)
                    content = await response.read()
                except asyncio.CancelledError as cancelled:
                    raise interrupt.reason(cancelled) from None
            status = response.status
            if span is not None:
                span.set("http.response.status_code", status)
            if status >= 400:
                raise UpstreamStatusError(
                    status, error_detail(content), role="prefill", url=worker.public_url
                )
        self.receipt.prefill_s = time.perf_counter() - started
        self._kit.verdicts.record(worker, None)
        choice, agreement = self.choice, self._kit.agreement
        if agreement is not None and choice is not None and choice.predicted:
            self._agreement(content, choice.cached_tokens, choice.mode == PRECISE)
        return content

    def _agreement(self, answer: bytes, predicted: int, precise: bool) -> None:
        """The prefill's answer against the prediction: its cached and prompt tokens (its
        ``usage``) into the receipt and the rank's agreement window."""
        usage = prompt_usage(answer)
        cached = UNKNOWN if usage is None or usage.cached_tokens is None else usage.cached_tokens
        self.receipt.cached_tokens = None if cached == UNKNOWN else cached
        own = self.exact_prompt_tokens
        assert self._kit.agreement is not None
        self._kit.agreement.rank(self.prefill.id, self.rank, self.prefill.public_url).record(
            predicted,
            cached,
            UNKNOWN if usage is None else usage.prompt_tokens,
            UNKNOWN if own is None else own,
            self.request.endpoint is not Endpoint.COMPLETIONS,
            precise,
        )


class _PrefillCompleted(Exception):
    """The prefill's answer already ends the generation; the decode leg is cancelled."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__("the prefill's answer ends the generation")
        self.answer = answer


def _prefill_json(answer: bytes, prefill: Worker) -> Any:
    try:
        return _decode(answer)
    except msgspec.DecodeError as exc:
        raise UpstreamUnavailable(
            f"answered invalid JSON: {answer[:200]!r}",
            role="prefill",
            url=prefill.public_url,
            connect=False,
            kind="invalid_answer",
        ) from exc


async def _ended_or_after(task: asyncio.Task[Any], delay_s: float) -> None:
    """Until ``task`` ended or ``delay_s`` passed (``asyncio.wait`` for one task, lighter)."""
    loop = task.get_loop()
    waiter = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    task.add_done_callback(wake)
    timer = loop.call_later(delay_s, wake)
    try:
        await waiter
    finally:
        timer.cancel()
        task.remove_done_callback(wake)


def _overdue(worker: Worker, timeout_s: float) -> BaseException:
    """The prefill leg's total deadline passed."""
    return UpstreamTimeout(
        f"no complete answer within {timeout_s:g}s",
        role=worker.role.value,
        url=worker.public_url,
    )


def _lost_during_prefill(worker: Worker, signal: asyncio.Future[str]) -> BaseException:
    """The prefill was marked down while its leg waited: the request may go elsewhere, rather
    than wait out the prefill timeout on an engine that may never answer."""
    return UpstreamUnavailable(
        f"{signal.result()} while its prefill leg ran",
        role="prefill",
        url=worker.public_url,
        connect=False,
        kind="worker_lost",
    )


def _may_have_ended(answer: bytes) -> bool:
    """Whether a prefill's answer may say the generation ended (then it is decoded and asked):
    a choice's finish "stop", a message's stop_reason "end_turn" (or "tool_use"), a response's
    status "completed"."""
    return (
        b'"stop"' in answer
        or b'"end_turn"' in answer
        or b'"completed"' in answer
        or b'"tool_use"' in answer
    )
