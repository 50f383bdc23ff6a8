"""The disaggregated prefill lifecycle of one rank, after SGLang's prefill scheduler (seed 002).

A request moves through four queues; ``counts`` shows how many are in each:

    bootstrap  waits for the decode's transfer info (``KVSender.bootstrap``, bounded by the
               sender's bootstrap timeout); it holds no pages and no forward time
    waiting    waits for its KV pages (``admit``: the rank's line, ``worker.page_queue``), then
               for the rank's forward pass (one at a time, first come first served)
    forward    computes one chunk of at most ``chunk_tokens`` uncached prompt tokens (the prefix
               cache's pages are reused, see ``worker.prefix_cache``; the KV content is a
               pure function of tokens and positions, plus ``compute_s_per_token`` of simulated
               time), then sends the chunk's full pages (``KVSender.send``; the partial last page
               waits for the next chunk) and goes back to ``waiting`` for the next chunk
    inflight   the last chunk and the aux slot are written; waits for Success or Failed

With a tiered cache (``worker.hicache.controller``) a job carries ``tiers``: it applies the
late-prefetch policy before the job first queues for the forward pass, and at the first chunk's
forward pass says where computing starts (the prefix loaded from L2/L3 is skipped) and which
load the pass waits for, layer by layer (``worker.hicache.layer_loading``); the compute time of a
chunk is
split evenly over the layers then.

Pages are taken after the bootstrap, as SGLang allocates them when it schedules a request from
its waiting queue: a prefill's pages are then only held by requests whose decode already holds
its own, so a full prefill pool and a full decode pool cannot wait on each other.

vLLM's MooncakeConnector has no bootstrap queue: the prefill takes its pages and computes at once
(its wait for pages counts as ``waiting``: ``queued``), answers the HTTP request, and serves the
decode's pull afterwards (``hand_off``: an inflight task that waits for
the transfer info, writes and reports, bounded by the sender's timeouts).

Whatever ends a request early (a failed transfer, a cancelled HTTP call) aborts its room, so the
decode hears of it at once, and the caller gets the pages back. A cancelled request lets the
sender call it is in end by itself first (``worker.settling``), so that its pages go back only
once no engine write reads them; the room's status reaches the decode either way (the sender
pushes it from a task of its own, which a cancelled call does not cut short).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from transfer.errors import TransferError
from transfer.sender import KVSender
from transfer.state import KVPoll
from worker.hicache.layer_loading import LayerLoad, simulate_forward
from worker.kv import KVPool
from worker.settling import settled

__all__ = ["PrefillJob", "PrefillScheduler", "Stage", "TierStart"]

logger = logging.getLogger(__name__)

Stage = Literal["bootstrap", "waiting", "forward", "inflight"]
STAGES: tuple[Stage, ...] = ("bootstrap", "waiting", "forward", "inflight")


class TierStart(Protocol):
    """A job's tiered-cache steps (``worker.rank.Progress``)."""

    async def ready(self) -> None:
        """Before the job first queues for the forward pass."""
        ...

    async def begin(self) -> tuple[int, LayerLoad | None]:
        """At its first forward pass: where computing starts, and the load to wait on."""
        ...


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """One prompt to prefill: positions ``[start, len(tokens))`` are computed (the rest came
    from the prefix cache; with ``tiers``, ``tiers.begin()`` says where instead);
    ``computed(end)`` runs after each forward chunk (KV of positions ``[0, end)`` now written),
    e.g. to cache the full pages. ``aux()`` is the aux slot's bytes, read when sent."""

    room: int
    tokens: Sequence[int]
    pages: Sequence[int]
    aux: Callable[[], bytes]
    start: int = 0
    computed: Callable[[int], None] | None = None
    tiers: TierStart | None = None


class PrefillScheduler:
    """Runs prefill jobs through the lifecycle on one rank's pool and sender."""

    def __init__(
        self,
        pool: KVPool,
        sender: KVSender,
        *,
        chunk_tokens: int,
        compute_s_per_token: float = 0.0,
        layerwise: bool = True,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self._pool = pool
        self._sender = sender
        self._chunk = chunk_tokens
        self._compute = compute_s_per_token
        self._layerwise = layerwise
        self._forward = asyncio.Lock()  # FIFO: the waiting queue
        self._counts: Counter[Stage] = Counter()
        self._handed_off: set[asyncio.Task[None]] = set()

    @property
    def counts(self) -> dict[str, int]:
        return {stage: self._counts[stage] for stage in STAGES}

    async def run(
        self, room: int, admit: Callable[[], AbstractAsyncContextManager[PrefillJob]]
    ) -> float:
        """SGLang: bootstrap, take the pages (``admit``: the job holds them while it runs),
        forward chunk by chunk, send; returns the transfer's seconds.

        Raises ``TransferFailed`` (the room failed; the decode has been told), or whatever
        ``admit`` raises (the room is aborted first).
        """
        with self._stage("bootstrap") as stage:
            await self._settled(room, self._sender.bootstrap(room))
            started = time.monotonic()
            with self._aborting(room):
                stage("waiting")
                async with admit() as job:
                    with self._aborting(room):  # before the pages go back
                        await self._compute_and_send(job, stage)
            return time.monotonic() - started

    async def _compute_and_send(self, job: PrefillJob, stage: Callable[[Stage], None]) -> None:
        await self._ready(job, stage)
        end, first = job.start, True
        while first or end < len(job.tokens):
            end = await self._forward_chunk(job, end, stage, first)
            first, last = False, end == len(job.tokens)
            if last:
                stage("inflight")
            await self._settled(
                job.room,
                self._sender.send(
                    job.room,
                    job.pages,
                    end,
                    is_last_chunk=last,
                    aux=job.aux() if last else None,
                ),
            )

    async def _settled(self, room: int, call: Coroutine[Any, Any, KVPoll]) -> KVPoll:
        """A sender call that a cancelled request does not cut short: the room is aborted and
        the call ends by itself (its engine write, reading the request's pages, over first)."""
        return await settled(
            asyncio.ensure_future(call),
            lambda: self._sender.abort(room, "the prefill request ended early"),
        )

    @contextlib.contextmanager
    def _aborting(self, room: int) -> Iterator[None]:
        """Whatever ends the request early aborts its room (the decode hears of it at once)."""
        try:
            yield
        except BaseException:
            self._sender.abort(room, "the prefill request ended early")
            raise

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        """Count a request waiting for its pages (vLLM: before ``compute``) as ``waiting``."""
        with self._stage("waiting"):
            yield

    async def compute(self, job: PrefillJob) -> None:
        """vLLM: the forward pass over the whole prompt, chunk by chunk, sending nothing yet."""
        with self._stage("waiting") as stage:
            await self._ready(job, stage)
            end, first = job.start, True
            while first or end < len(job.tokens):
                end = await self._forward_chunk(job, end, stage, first)
                first = False

    def hand_off(self, job: PrefillJob, done: Callable[[], None]) -> None:
        """vLLM: serve the decode's pull of a computed ``job`` in the background; ``done`` runs
        when the room ended (Success or Failed), to release the pages."""

        async def inflight() -> None:
            with self._stage("inflight"):
                try:
                    await self._sender.send(
                        job.room, job.pages, len(job.tokens), is_last_chunk=True, aux=job.aux()
                    )
                except TransferError as exc:
                    # the room failed (its decode has been told, the sender logged the reason
                    # at WARNING) or had already ended: nobody waits for this task
                    logger.info("room %d: handed-off KV transfer failed: %s", job.room, exc)

        task = asyncio.create_task(inflight(), name=f"prefill-inflight-{job.room}")
        self._handed_off.add(task)

        def finished(finished_task: asyncio.Task[None]) -> None:
            self._handed_off.discard(finished_task)
            done()
            error = None if finished_task.cancelled() else finished_task.exception()
            if error is not None:  # a bug: not a transfer outcome
                logger.error("room %d: handed-off KV transfer crashed", job.room, exc_info=error)

        task.add_done_callback(finished)

    async def aclose(self) -> None:
        """Cancel the handed-off transfers (their rooms fail; their pages come back)."""
        for task in list(self._handed_off):
            task.cancel()
        await asyncio.gather(*self._handed_off, return_exceptions=True)

    async def _ready(self, job: PrefillJob, stage: Callable[[Stage], None]) -> None:
        if job.tiers is not None:
            stage("waiting")
            await job.tiers.ready()

    async def _forward_chunk(
        self, job: PrefillJob, start: int, stage: Callable[[Stage], None], first: bool
    ) -> int:
        """One forward chunk from ``start`` (the first: from where ``tiers`` says); its end."""
        stage("waiting")
        async with self._forward:
            stage("forward")
            load = None
            if first and job.tiers is not None:
                start, load = await job.tiers.begin()
            end = min(start + self._chunk, len(job.tokens))
            compute_s = self._compute * (end - start)
            await simulate_forward(compute_s, self._pool.shape.layers, load, self._layerwise)
            self._pool.write(job.pages, job.tokens, start, end)
            if job.computed is not None:
                job.computed(end)
        stage("waiting")
        return end

    @contextlib.contextmanager
    def _stage(self, first: Stage) -> Iterator[Callable[[Stage], None]]:
        current: list[Stage] = [first]
        self._counts[first] += 1

        def move(stage: Stage) -> None:
            self._counts[current[0]] -= 1
            self._counts[stage] += 1
            current[0] = stage

        try:
            yield move
        finally:
            self._counts[current[0]] -= 1
