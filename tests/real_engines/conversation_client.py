"""``/v1/responses`` and Anthropic ``/v1/messages`` for the real-engine tests: one greedy
request, whole or streamed, reduced to what two engines must agree on (the text and how it
ended; ids and timestamps differ)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.real_engines.openai_client import SERVED_MODEL

PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass
class Conversation:
    """What came back for one request."""

    status: int
    text: str = ""
    ended: str | None = None  # Responses: status (reason); Messages: stop_reason
    usage: dict[str, Any] | None = None
    event_types: list[str] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)

    @property
    def outcome(self) -> tuple[str, str | None]:
        return self.text, self.ended


def conversation_body(endpoint: str, prompt: str, *, stream: bool, tokens: int) -> dict[str, Any]:
    """A greedy request for ``responses`` or ``messages``."""
    body: dict[str, Any] = {"model": SERVED_MODEL, "temperature": 0, "stream": stream}
    if endpoint == "responses":
        return body | {"input": prompt, "max_output_tokens": tokens}
    return body | {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}


def _response_ended(response: dict[str, Any]) -> str:
    details = response.get("incomplete_details") or {}
    reason = details.get("reason")
    return f"{response.get('status')}" + (f" ({reason})" if reason else "")


def _whole(answer: Conversation, endpoint: str, body: dict[str, Any]) -> None:
    answer.body = body
    answer.usage = body.get("usage")
    if endpoint == "responses":
        for item in body.get("output") or []:
            for part in item.get("content") or []:
                if part.get("type") == "output_text":
                    answer.text += part.get("text") or ""
        answer.ended = _response_ended(body)
    else:
        answer.text = "".join(b.get("text") or "" for b in body.get("content") or [])
        answer.ended = body.get("stop_reason")


def _event(answer: Conversation, event: dict[str, Any]) -> None:
    kind = event.get("type", "")
    answer.event_types.append(kind)
    if kind == "response.output_text.delta":
        answer.text += event.get("delta") or ""
    elif kind in ("response.completed", "response.incomplete"):
        answer.ended = _response_ended(event["response"])
        answer.usage = event["response"].get("usage")
    elif kind == "content_block_delta":
        answer.text += (event.get("delta") or {}).get("text") or ""
    elif kind == "message_delta":  # the usage of a Messages stream's end: its output tokens
        answer.ended = (event.get("delta") or {}).get("stop_reason")
        answer.usage = event.get("usage")


def converse(
    base_url: str, endpoint: str, body: dict[str, Any], timeout: float = 120
) -> Conversation:
    """POST one request and read the whole answer (a stream until it ends)."""
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream("POST", base_url + PATHS[endpoint], json=body) as response,
    ):
        answer = Conversation(status=response.status_code)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            response.read()
            _whole(answer, endpoint, response.json())
            return answer
        for line in response.iter_lines():
            if line.startswith("data:"):
                _event(answer, json.loads(line[len("data:") :].strip()))
    return answer


def check_conversation_matches(
    router_url: str, engine_url: str, endpoint: str, prompt: str, *, stream: bool, tokens: int
) -> Conversation:
    """The router's answer equals the co-located engine's (text and ending); returns it.

    A mismatch is asked once more, both sides afresh: the CPU engines' greedy pick can flip on
    a near tie between two processes' float sums (seen once in CI, 0 in 50 tries here), while
    a router that mangles the answer fails both times."""
    body = conversation_body(endpoint, prompt, stream=stream, tokens=tokens)
    mismatches: list[tuple[Any, Any]] = []  # (router's, engine's) outcome, per try
    for _ in range(2):
        want = converse(engine_url, endpoint, body)
        assert want.status == 200 and want.text, want.body
        got = converse(router_url, endpoint, body)
        assert got.status == 200, got.body
        if got.outcome == want.outcome:
            break
        mismatches.append((got.outcome, want.outcome))
    assert got.outcome == want.outcome, mismatches
    if stream:  # the same events, in the same order (the deltas' count may differ)
        assert _kinds(got.event_types) == _kinds(want.event_types)
    return got


def _kinds(types: list[str]) -> list[str]:
    """Event types with repeats of one type in a row folded (one delta or many)."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]
