"""The soak's traffic: mixed OpenAI requests, each classified by what the client got back.

A request is ``ok`` (2xx with a complete answer: a JSON body with ``choices``, or an SSE stream
ending in ``[DONE]`` without an error event), a clean ``error`` (a non-2xx status with an
OpenAI error JSON body, or an SSE stream carrying an ``{"error": ...}`` event), ``unclean``
(anything else: a truncated stream without an error event, a body that is not an error JSON, a
connection reset) or ``hung`` (no outcome within its deadline). ``Traffic`` sends a budget of
them at a fixed rate from a bounded number of users (requests in flight never exceed it), and
goes on at that rate past the budget while told to (``run(until=...)``: the fault schedule ran
late), up to twice the budget.

The loop is httpx rather than ``bench.load.loadgen``'s lean parser: classifying needs each SSE
event's payload, which that parser does not keep; at the soak's rate the client's CPU is small.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

__all__ = ["Clock", "Outcome", "RequestSpec", "Traffic", "long_prompt", "mixed_request", "send"]

Kind = Literal["ok", "error", "unclean", "hung"]
_DETAIL_CHARS = 200
_WORDS = ["".join(random.Random(i).choices(string.ascii_lowercase, k=3 + i % 6)) for i in range(64)]


class Clock:
    """Seconds since it was made (the soak's clock: outcomes and samples are stamped with it)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0


@dataclass(frozen=True)
class RequestSpec:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    tag: str = "main"  # "main" traffic, or the fault that sent it ("kv_burst")

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    start: float  # seconds since the soak's t0
    end: float
    status: int  # 0: no status line (reset, hung)
    stream: bool
    tag: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(_WORDS, k=words))


def mixed_request(rng: random.Random, model: str) -> RequestSpec:
    """Stream or not, chat or completions, 5..80 words, 8..32 tokens: an even mix."""
    chat = rng.random() < 0.5
    text = _prompt(rng, rng.randint(5, 80))
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(8, 32),
        "stream": rng.random() < 0.5,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        return RequestSpec("/v1/chat/completions", body)
    body["prompt"] = text
    return RequestSpec("/v1/completions", body)


def long_prompt(
    rng: random.Random,
    model: str,
    chars: int,
    tag: str,
    *,
    max_tokens: int = 8,
    stream: bool | None = None,
) -> RequestSpec:
    """A ``/v1/completions`` request with a ``chars``-character prompt (one token per byte),
    streamed or not (None: at random)."""
    text = "".join(rng.choices(string.ascii_lowercase + " ", k=chars))
    streamed = rng.random() < 0.5 if stream is None else stream
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": streamed}
    return RequestSpec("/v1/completions", body, tag)


def _is_error_json(raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict)


async def _read_sse(response: httpx.Response) -> tuple[Kind, str]:
    events, done, error = 0, False, ""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        events += 1
        if _is_error_json(data.encode()):
            error = error or data[:_DETAIL_CHARS]
    if error:
        return "error", error
    if done and events:
        return "ok", ""
    return "unclean", f"stream ended after {events} events without [DONE] or an error event"


async def _exchange(
    client: httpx.AsyncClient, url: str, spec: RequestSpec
) -> tuple[Kind, int, str]:
    async with client.stream("POST", url + spec.path, json=spec.body) as response:
        status = response.status_code
        if not 200 <= status < 300:
            raw = await response.aread()
            kind: Kind = "error" if _is_error_json(raw) else "unclean"
            return kind, status, raw[:_DETAIL_CHARS].decode(errors="replace")
        if spec.stream:
            kind, detail = await _read_sse(response)
            return kind, status, detail
        raw = await response.aread()
        try:
            complete = isinstance(json.loads(raw).get("choices"), list)
        except (ValueError, AttributeError):
            complete = False
        return (
            ("ok" if complete else "unclean"),
            status,
            raw[:_DETAIL_CHARS].decode(errors="replace"),
        )


async def send(
    client: httpx.AsyncClient,
    url: str,
    spec: RequestSpec,
    deadline_s: float,
    clock: Callable[[], float],
) -> Outcome:
    """One request, classified; never raises for what the server does."""
    start = clock()
    try:
        async with asyncio.timeout(deadline_s):
            kind, status, detail = await _exchange(client, url, spec)
    except TimeoutError:
        kind, status, detail = "hung", 0, f"no outcome within {deadline_s:g} s"
    except httpx.HTTPError as exc:
        kind, status, detail = "unclean", 0, f"{type(exc).__name__}: {exc}"[:_DETAIL_CHARS]
    return Outcome(kind, start, clock(), status, spec.stream, spec.tag, detail)


def client(limit: int) -> httpx.AsyncClient:
    """No httpx timeouts (``send``'s deadline is the only one), at most ``limit`` connections."""
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits)


class Traffic:
    """``requests`` mixed requests at ``rate`` per second, at most ``users`` in flight."""

    def __init__(
        self,
        url: str,
        *,
        requests: int,
        rate: float,
        users: int,
        deadline_s: float,
        seed: int,
        model: str,
        clock: Callable[[], float],
    ) -> None:
        self.url = url
        self.requests = requests
        self.rate = rate
        self.users = users
        self.deadline_s = deadline_s
        self.model = model
        self.clock = clock
        self.outcomes: list[Outcome] = []
        self._rng = random.Random(seed)
        self._issued = 0
        self._t0 = 0.0

    async def run(self, until: asyncio.Event | None = None) -> list[Outcome]:
        """Send the whole budget, and more until ``until`` is set (at most the budget again);
        return every outcome (in completion order)."""
        self._t0 = time.monotonic()
        async with client(self.users) as http:
            await asyncio.gather(*(self._user(http, until) for _ in range(self.users)))
        return self.outcomes

    def _more(self, until: asyncio.Event | None) -> bool:
        if self._issued < self.requests:
            return True
        return until is not None and not until.is_set() and self._issued < 2 * self.requests

    async def _user(self, http: httpx.AsyncClient, until: asyncio.Event | None) -> None:
        while self._more(until):
            slot = self._t0 + self._issued / self.rate
            self._issued += 1
            spec = mixed_request(self._rng, self.model)
            await asyncio.sleep(max(slot - time.monotonic(), 0.0))
            self.outcomes.append(await send(http, self.url, spec, self.deadline_s, self.clock))
