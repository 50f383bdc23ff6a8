"""Open-loop streaming load for ``bench.load.flow_control``: each stream sends requests at a
fixed rate (one every ``1 / rate`` seconds, whether or not the earlier ones were answered), each
one a streaming ``/v1/completions`` with its tenant's key and an optional ``X-Priority``.

Every loop is bounded: a stream sends at most ``ceil(rate * duration)`` requests (and never more
than ``MAX_REQUESTS_PER_STREAM``), and the phase waits for its requests at most ``drain_s`` after
its last send; whatever is still open then is cancelled and counted as ``cancelled``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from bench.common.process import LOOPBACK

__all__ = [
    "MAX_REQUESTS_PER_STREAM",
    "Outcome",
    "Stream",
    "fire_times",
    "run_phase",
]

MAX_REQUESTS_PER_STREAM = 20_000
_ERROR_BODY_CHARS = 200


@dataclass(frozen=True)
class Stream:
    """One tenant's open-loop requests in a phase."""

    label: str  # how the report names it (e.g. "A", "batch")
    key: str  # its API key (Bearer)
    rate: float  # requests per second
    priority: int | None = None  # sent as X-Priority when given


@dataclass(frozen=True)
class Outcome:
    """One request: when it was sent (s after the phase began), how it ended."""

    label: str
    sent_s: float
    status: int  # HTTP status; 0: no answer (connection error, cancelled)
    ttft_s: float | None  # to the first SSE event with text; None: no token
    done_s: float | None  # sent_s + the time to the stream's end; None: not completed
    error: str = ""

    @property
    def completed(self) -> bool:
        return self.done_s is not None


def fire_times(rate: float, duration_s: float, cap: int = MAX_REQUESTS_PER_STREAM) -> list[float]:
    """When a stream of ``rate`` requests/s sends during ``duration_s`` seconds: ``i / rate``
    for ``i`` below ``ceil(rate * duration_s)`` and below ``cap``; none for a rate or a duration
    that is not positive (or not finite)."""
    if not (math.isfinite(rate) and math.isfinite(duration_s)) or rate <= 0 or duration_s <= 0:
        return []
    count = min(math.ceil(rate * duration_s - 1e-9), max(cap, 0))
    return [i / rate for i in range(count)]


def prompt(rng: random.Random, tokens: int) -> str:
    """``tokens`` random ASCII characters (the toy tokenizer: one token each): no cache hits."""
    return "".join(rng.choices(string.ascii_lowercase + " ", k=tokens))


@dataclass(frozen=True)
class _Target:
    url: str
    model: str
    prompt_tokens: int
    max_tokens: int
    spread: float  # max_tokens drawn from max_tokens * [1 - spread, 1 + spread]

    def draw_max_tokens(self, rng: random.Random) -> int:
        low = max(1, round(self.max_tokens * (1 - self.spread)))
        return rng.randint(low, max(low, round(self.max_tokens * (1 + self.spread))))


async def _read_stream(response: aiohttp.ClientResponse, started: float) -> float | None:
    """Read an SSE completion stream to its end; the time to the first event with text."""
    ttft: float | None = None
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        if ttft is None:
            event = json.loads(data)
            if any(choice.get("text") for choice in event.get("choices") or ()):
                ttft = time.perf_counter() - started
    return ttft


async def _one(
    session: aiohttp.ClientSession,
    target: _Target,
    stream: Stream,
    body: dict[str, object],
    t0: float,
) -> Outcome:
    headers = {"Authorization": f"Bearer {stream.key}"}
    if stream.priority is not None:
        headers["X-Priority"] = str(stream.priority)
    started = time.perf_counter()
    sent = started - t0
    try:
        async with session.post(
            f"{target.url}/v1/completions", json=body, headers=headers
        ) as response:
            if response.status != 200:
                text = (await response.text())[:_ERROR_BODY_CHARS]
                return Outcome(stream.label, sent, response.status, None, None, text)
            ttft = await _read_stream(response, started)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return Outcome(stream.label, sent, 0, None, None, f"{type(exc).__name__}: {exc}")
    done = time.perf_counter() - t0
    if ttft is None:
        return Outcome(stream.label, sent, 200, None, None, "the stream ended without text")
    return Outcome(stream.label, sent, 200, ttft, done)


async def _send_stream(
    session: aiohttp.ClientSession,
    target: _Target,
    stream: Stream,
    times: Sequence[float],
    t0: float,
    seed: int,
) -> list[tuple[str, asyncio.Task[Outcome]]]:
    rng = random.Random(seed)
    tasks: list[tuple[str, asyncio.Task[Outcome]]] = []
    for at in times:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        body = {
            "model": target.model,
            "prompt": prompt(rng, target.prompt_tokens),
            "max_tokens": target.draw_max_tokens(rng),
            "stream": True,
        }
        task = asyncio.create_task(_one(session, target, stream, body, t0))
        tasks.append((stream.label, task))
    return tasks


async def _phase(
    target: _Target, streams: Sequence[Stream], duration_s: float, drain_s: float, seed: int
) -> list[Outcome]:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=duration_s + drain_s, sock_connect=10.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        senders = [
            _send_stream(session, target, s, fire_times(s.rate, duration_s), t0, seed + i)
            for i, s in enumerate(streams)
        ]
        sent = [pair for group in await asyncio.gather(*senders) for pair in group]
        if not sent:
            return []
        _done, pending = await asyncio.wait([task for _label, task in sent], timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [_outcome(label, task) for label, task in sent]


def _outcome(label: str, task: asyncio.Task[Outcome]) -> Outcome:
    if task.cancelled():
        return Outcome(label, math.nan, 0, None, None, "cancelled after the drain time")
    return task.result()


def run_phase(
    url: str,
    model: str,
    streams: Sequence[Stream],
    *,
    duration_s: float,
    drain_s: float,
    prompt_tokens: int,
    max_tokens: int,
    spread: float = 0.0,
    seed: int = 0,
) -> list[Outcome]:
    """Run ``streams`` against the router at ``url`` (loopback only) for ``duration_s`` seconds
    and at most ``drain_s`` more; every request's outcome. Each request asks for
    ``max_tokens * (1 +- spread)`` tokens (uniform), so completions do not stay in step."""
    if not url.startswith(f"http://{LOOPBACK}:"):
        raise ValueError(f"only {LOOPBACK} is loaded: {url}")
    target = _Target(url, model, prompt_tokens, max_tokens, spread)
    return asyncio.run(_phase(target, streams, duration_s, drain_s, seed))
