"""Minimal OpenAI request envelope: parse once, validate what routing needs, keep the rest as is."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from router.errors import InvalidRequest

__all__ = ["Endpoint", "ParsedRequest", "parse_request"]


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


@dataclass(slots=True, frozen=True)
class ParsedRequest:
    """The client's body plus the features routing and the adapters need."""

    endpoint: Endpoint
    body: dict[str, Any]
    stream: bool
    batch: int | None  # number of prompts of a batched /v1/completions request, else None
    n: int

    @property
    def sample_count(self) -> int:
        """How many sequences the engine generates (one bootstrap room each in SGLang)."""
        return (self.batch or 1) * self.n


_decoder = msgspec.json.Decoder()


def parse_request(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    """Decode and check the envelope; raises InvalidRequest with the offending parameter."""
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    stream = _check_stream(body.get("stream", False))
    n = _check_n(body.get("n", 1))
    if endpoint is Endpoint.CHAT:
        _check_messages(body.get("messages"))
        batch = None
    else:
        batch = _prompt_batch(body.get("prompt"))
    return ParsedRequest(endpoint=endpoint, body=body, stream=stream, batch=batch, n=n)


def _check_stream(value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    return value


def _check_n(value: Any) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest("'n' must be a positive integer", param="n")
    return value


def _check_messages(value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "'messages' is required and must be a non-empty list", param="messages"
        )
    if not all(isinstance(message, dict) for message in value):
        raise InvalidRequest("each entry of 'messages' must be an object", param="messages")


def _prompt_batch(prompt: Any) -> int | None:
    """None for a single prompt (a string or one list of token ids), else the batch size."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(
            "'prompt' is required: a string, a list of strings or a list of token ids",
            param="prompt",
        )
    first = prompt[0]
    if isinstance(first, int) and not isinstance(first, bool):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequest("'prompt' mixes token ids with other values", param="prompt")
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return len(prompt)
    raise InvalidRequest(
        "'prompt' must be a string, a list of strings or a list of token-id lists", param="prompt"
    )
