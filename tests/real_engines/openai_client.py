"""A small OpenAI-API client for the real-engine tests: one request, stream or not, reduced to
what two engines must agree on (text and finish_reason; ids and timestamps differ)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

SERVED_MODEL = "m"


@dataclass
class Answer:
    """What came back for one request."""

    status: int
    text: str = ""
    finish_reason: str | None = None
    body: dict[str, Any] = field(default_factory=dict)  # the JSON body (non-stream or error)
    events: list[dict[str, Any]] = field(default_factory=list)  # SSE data events, parsed
    done: bool = False  # the stream ended with ``data: [DONE]``
    error: dict[str, Any] | None = None  # the OpenAI error object, from a body or an SSE event
    elapsed_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)  # the response's, lower-cased names

    @property
    def outcome(self) -> tuple[str, str | None]:
        """(text, finish_reason): the comparable part of an answer."""
        return self.text, self.finish_reason


def request_body(endpoint: str, prompt: str, *, stream: bool, **params: Any) -> dict[str, Any]:
    """A greedy request for ``completions`` or ``chat``; ``params`` are added as they are."""
    body: dict[str, Any] = {"model": SERVED_MODEL, "temperature": 0, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body | params


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def choice_text(choice: dict[str, Any]) -> str:
    """A choice's new text, in any of the four shapes (completion / chat, whole / delta)."""
    if "text" in choice:
        return str(choice["text"] or "")
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "")


def add_event(answer: Answer, event: dict[str, Any]) -> None:
    answer.events.append(event)
    if "error" in event:
        answer.error = event["error"]
    for choice in event.get("choices") or []:
        answer.text += choice_text(choice)
        answer.finish_reason = choice.get("finish_reason") or answer.finish_reason


def read_stream(
    response: httpx.Response, answer: Answer, on_event: Callable[[], None] | None = None
) -> None:
    """Consume an SSE body into ``answer``: events in order, ``[DONE]`` noted; ``on_event`` is
    called after each event (a test's cue to act mid-stream)."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            answer.done = True
            continue
        add_event(answer, json.loads(data))
        if on_event is not None:
            on_event()


def read_json(response: httpx.Response, answer: Answer) -> None:
    response.read()
    try:
        answer.body = response.json()
    except ValueError:
        answer.body = {"raw": response.text}
    if "error" in answer.body:
        answer.error = answer.body["error"]
    for choice in answer.body.get("choices") or []:
        answer.text += choice_text(choice)
        answer.finish_reason = choice.get("finish_reason")


def call(
    base_url: str,
    endpoint: str,
    body: dict[str, Any],
    timeout: float = 120,
    on_event: Callable[[], None] | None = None,
) -> Answer:
    """POST one request and read the whole answer (a stream until it ends). ``timeout`` bounds
    the connect and each read, not the total: tests assert ``elapsed_s`` for that."""
    started = time.monotonic()
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream("POST", base_url + endpoint_path(endpoint), json=body) as response,
    ):
        answer = Answer(status=response.status_code, headers=dict(response.headers))
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
        if is_sse:
            read_stream(response, answer, on_event)
        else:
            read_json(response, answer)
    answer.elapsed_s = time.monotonic() - started
    return answer


def check_tokenize_passes_through(
    router_url: str, engine_url: str, prompt: str, text_field: str
) -> None:
    """The router's ``/tokenize`` and ``/detokenize`` answers equal the co-located engine's
    (the text: vLLM's ``prompt``, SGLang's ``text``)."""
    body = {"prompt": prompt}
    through = httpx.post(router_url + "/tokenize", json=body, timeout=30)
    direct = httpx.post(engine_url + "/tokenize", json=body, timeout=30)
    assert through.status_code == 200 == direct.status_code, through.text
    assert through.json() == direct.json() and through.json()["count"] > 0
    tokens = {"tokens": through.json()["tokens"]}
    back = httpx.post(router_url + "/detokenize", json=tokens, timeout=30)
    assert back.status_code == 200, back.text
    assert back.json() == httpx.post(engine_url + "/detokenize", json=tokens, timeout=30).json()
    assert prompt.strip()[:20] in back.json()[text_field]
