"""One attempt at a request: the route's legs, run in the shape its adapter asks for.

``Attempt`` carries what an attempt needs (the request, its headers, the client's responder, the
disconnect signal, the route's workers, the legs' clock, the trace) and runs the decode leg and
its relay to the client; on its own it is the direct shape, the decode alone (the prefill
skipped: it prefills locally). ``router.pipeline.pd_attempt.PDAttempt`` adds the prefill leg.
An attempt lives as long as its legs; retrying on other workers is ``router.pipeline.serve``'s,
and what an outcome means is ``router.pipeline.verdicts``'.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec

from router.adapters import PDAdapter
from router.errors import (
    CAPACITY_STATUSES,
    UpstreamError,
    UpstreamStatusError,
    UpstreamUnavailable,
)
from router.interrupt import ClientDisconnected, Interrupt
from router.observability.agreement import AgreementBoard
from router.observability.metrics import RouterMetrics
from router.observability.receipt import RoutingReceipt
from router.observability.tracing import TraceSpan
from router.pipeline.decode_usage import (
    PromptUsage,
    answer_usage,
    prompt_usage,
    prompt_usage_in_sse,
    usage_in_sse,
    used_tokens,
    used_tokens_in_sse,
)
from router.pipeline.leg_clock import LegClock
from router.pipeline.responder import Responder
from router.pipeline.verdicts import Verdicts, error_detail
from router.scheduling.chooser import Route
from router.schemas import ParsedRequest
from router.settings import UpstreamSettings
from router.upstream.base import UpstreamPool, UpstreamResponse
from router.workers import Worker

__all__ = ["Attempt", "AttemptKit"]

_encode = msgspec.json.Encoder().encode
_SSE_ERROR = b'data: {"error"'  # a stream whose first event is an error (vLLM, SGLang)


@dataclass(frozen=True, slots=True)
class AttemptKit:
    """What every attempt of a pipeline works with."""

    pool: UpstreamPool
    adapter: PDAdapter
    settings: UpstreamSettings
    verdicts: Verdicts
    metrics: RouterMetrics
    # predicted against actual cached tokens per prefill rank (None: not recorded)
    agreement: AgreementBoard | None = None


class Attempt:
    """One attempt's decode leg and its relay to the client; on its own, the direct shape."""

    __slots__ = (
        "_kit",
        "choice",
        "clock",
        "decode",
        "disconnected",
        "exact_prompt_tokens",
        "headers",
        "loop",
        "prefill",
        "prefill_tokens",
        "rank",
        "receipt",
        "request",
        "responder",
        "trace",
        "trial",
    )

    def __init__(
        self,
        kit: AttemptKit,
        request: ParsedRequest,
        headers: dict[str, str],
        responder: Responder,
        disconnected: asyncio.Future[Any],
        receipt: RoutingReceipt,
        trace: TraceSpan | None,
        route: Route,
    ) -> None:
        self._kit = kit
        self.request = request
        self.headers = headers
        self.responder = responder
        self.disconnected = disconnected
        self.loop = disconnected.get_loop()  # (not get_running_loop(): a getpid system call)
        self.receipt = receipt
        self.trace = trace
        self.prefill: Worker | None = route.prefill  # the PD attempt's prefill, None: direct
        self.rank = route.rank
        self.decode = route.decode
        self.prefill_tokens = route.prefill_tokens
        self.choice = route.choice  # the prefill policy's, with its cache prediction
        self.exact_prompt_tokens = route.exact_prompt_tokens
        # a half-open breaker's trial: a 5xx goes to another route, not to the client
        self.trial = bool(route.trials)
        # only a PD stream's decode has a KV-arrival deadline
        watch = request.stream and route.prefill is not None
        self.clock = LegClock(self.loop, kit.settings.kv_arrival_timeout_s, watch_first_byte=watch)

    async def run(self) -> None:
        """The decode alone, with the client's body unchanged: it prefills locally (a vLLM
        request without kv_transfer_params). Same relay, errors and retries as a PD attempt."""
        call = self._decode(_encode(self.request.body))
        interrupt = Interrupt(self.loop)
        try:
            with interrupt.on_done(self.disconnected, lambda _: ClientDisconnected()):
                await interrupt.guard(call)
        finally:
            self.clock.close()

    async def _decode(self, body: bytes) -> None:
        """The decode leg (of a PD attempt when ``prefill`` is set; else it prefills alone)."""
        worker = self.decode
        upstream = self._kit.pool.client(worker)
        span = self._leg_span("pdr.decode", worker)
        headers = self.headers
        if span is not None:
            headers = {**headers, **span.headers()}
        with worker.load(), self._leg(worker, span):
            stream = self.request.stream
            response = await upstream.open(
                self.request.endpoint.value, body, headers, whole=not stream
            )
            if span is not None:
                span.set("http.response.status_code", response.status)
            if stream and response.status < 400:
                tail = await self._relay(response)
                self._read_usage(tail)
            else:
                await self._whole(response)

    async def _whole(self, response: UpstreamResponse) -> None:
        """A decode's answer read whole: relayed as is, unless the engine is full (then another
        decode may take the request)."""
        worker, prefill, verdicts = self.decode, self.prefill, self._kit.verdicts
        content = await response.read()
        self.clock.decode_answered()
        status = response.status
        # full: another decode may take it; a trial's 5xx: another route may
        if status in CAPACITY_STATUSES or (self.trial and status >= 500):
            raise UpstreamStatusError(
                status, error_detail(content), role="decode", url=worker.public_url
            )
        self._check_kv_failure(status, content)
        verdicts.decode_status(status, content, worker, prefill)
        if response.status >= 400:  # relayed to the client as the engine's answer
            error = verdicts.decode_refused(response.status, content, prefill, worker)
            if error is not None:
                self.receipt.decode_error = error
        elif prefill is not None or self.receipt.wants_usage:
            self._read_usage(content, whole=True)
        await self.responder.whole(response.status, response.content_type, content)

    def _read_usage(self, answer: bytes, *, whole: bool = False) -> None:
        """The decode's usage in its successful ``answer`` (``whole``, or a stream's last
        events): did it recompute the prompt (PD), and the tokens a tenant's limit counts."""
        wants_usage = self.receipt.wants_usage  # a tenant's token limit
        if self.prefill is None:
            if wants_usage:
                self.receipt.used_tokens = (used_tokens if whole else used_tokens_in_sse)(answer)
            return
        if wants_usage:
            usage, self.receipt.used_tokens = (answer_usage if whole else usage_in_sse)(answer)
        else:
            usage = (prompt_usage if whole else prompt_usage_in_sse)(answer)
        self._check_recompute(usage)

    async def _relay(self, response: UpstreamResponse) -> bytes:
        """Move decode's SSE bytes to the client as they come; returns the last chunk that
        mentions ``usage`` and the final one (where the usage is, when the client asked for it).

        The client's response starts with the first body chunk, not with decode's headers: until
        then nothing has reached the client, so a failing prefill can still be retried.
        """
        worker = self.decode
        try:
            chunks = response.chunks()
            chunk = await anext(chunks, b"")
            self.clock.decode_answered()
            if chunk.startswith(_SSE_ERROR):  # failed before its first token: the KV's fault?
                self._check_kv_failure(500, chunk)
            self._kit.verdicts.stale_layout(chunk, worker, self.prefill)
            tail = await self.responder.relay(response, chunks, chunk)
        finally:
            await response.aclose()
        self._kit.verdicts.record(worker, None)
        return tail

    def _check_kv_failure(self, status: int, content: bytes) -> None:
        """A PD attempt's decode failing because its KV did not come from the prefill: raise
        ``kv_failed`` (the prefill's and the pair's fault, retried elsewhere) instead of giving
        the client the decode's error. Not for an unknown engine id (``stale_layout``)."""
        prefill, kit = self.prefill, self._kit
        if prefill is None or status < 500 or kit.adapter.is_stale_layout(content):
            return  # (a 2xx or 4xx is never a KV failure: its body is not scanned)
        if not kit.verdicts.kv_failure(status, content):
            return
        when = "after" if self.clock.prefill_done is not None else "before"
        detail = error_detail(content.removeprefix(b"data: ").strip())
        raise UpstreamUnavailable(
            f"decode {self.decode.public_url} answered HTTP {status} {when} this prefill "
            f"answered: the KV cache did not arrive ({detail})",
            role="prefill",
            url=prefill.public_url,
            connect=False,
            kind="kv_failed",
        )

    def _check_recompute(self, usage: PromptUsage | None) -> None:
        if self._kit.verdicts.recomputed(usage):
            self.receipt.recomputed = True

    def _leg_span(self, name: str, worker: Worker) -> TraceSpan | None:
        trace = self.trace
        if trace is None:
            return None
        span = trace.child(name)
        span.set("pdr.worker", worker.public_url)
        return span

    def _leg(self, worker: Worker, span: TraceSpan | None) -> _Leg:
        """One leg's call: a failure counts against its worker (when it is the worker's fault)
        and ends its span as failed; the span ends with the leg."""
        return _Leg(self._kit.verdicts, worker, span)


class _Leg:
    """``Attempt._leg``'s block (a plain class: no generator per leg)."""

    __slots__ = ("_span", "_verdicts", "_worker")

    def __init__(self, verdicts: Verdicts, worker: Worker, span: TraceSpan | None) -> None:
        self._verdicts = verdicts
        self._worker = worker
        self._span = span

    def __enter__(self) -> None:
        pass

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        span = self._span
        if exc is not None:
            if isinstance(exc, UpstreamError):
                self._verdicts.record(self._worker, exc)
            if span is not None:
                span.fail(exc)
        if span is not None:
            span.end()
