"""Did the decode use the prefill's KV? Read from the ``usage`` the decode reports.

Signals, by engine (docs/concepts/protocols.md 11; checked against vLLM 0.32 and SGLang 0.5
sources):

* vLLM >= 0.32 with ``--enable-prompt-tokens-details``, chat answers only:
  ``usage.prompt_tokens_details.created_cache_tokens`` is the prompt tokens the engine computed
  itself (and cached). A decode that received the KV computes (almost) none; one that recomputed
  the prompt computes it all. This is the signal used whenever it is present.
* ``prompt_tokens_details.cached_tokens`` (vLLM; SGLang ``meta_info.cached_tokens``) is the
  decode's own count of prompt tokens it did not compute only where the engine does not
  overwrite it with the prefill's cache hits: vLLM >= 0.32 does overwrite it when the decode's
  ``kv_transfer_params`` carry ``remote_prefill_cached_tokens`` (NIXL copies them from the
  prefill's answer), SGLang's decode always reports the prefill's. So it is trusted only where
  the adapter says the decode reports its own (vLLM Mooncake: the router writes the decode's
  ``kv_transfer_params`` itself).

The router never asks for usage it was not asked for: a stream carries it only when the client
set ``stream_options.include_usage``, so streams without it are not checked. ``/v1/responses``
answers carry ``usage`` always (a stream in its last event, ``response.completed``);
``/v1/messages`` whole answers too, but a Messages stream splits it (input tokens in its first
event, output tokens in its last), so such streams are not checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

__all__ = [
    "PromptUsage",
    "answer_usage",
    "prompt_usage",
    "prompt_usage_in_sse",
    "usage_in_sse",
    "used_tokens",
    "used_tokens_in_sse",
]

_decode = msgspec.json.Decoder().decode


class _Details(msgspec.Struct):
    cached_tokens: int | None = None
    created_cache_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int
    prompt_tokens_details: _Details | None = None


class _Meta(msgspec.Struct):
    cached_tokens: int | None = None


class _Answer(msgspec.Struct):
    """Only what ``PromptUsage`` needs: the rest of an answer is skipped, not built."""

    usage: _Usage | None = None
    meta_info: _Meta | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


def _from_typed(answer: _Answer) -> PromptUsage | None:
    usage = answer.usage
    if usage is None:
        return None
    details = usage.prompt_tokens_details or _Details()
    cached = details.cached_tokens
    if cached is None and answer.meta_info is not None:
        cached = answer.meta_info.cached_tokens
    return PromptUsage(usage.prompt_tokens, cached, details.created_cache_tokens)


@dataclass(frozen=True, slots=True)
class PromptUsage:
    prompt_tokens: int
    cached_tokens: int | None  # prompt tokens the engine reports as not computed
    created_cache_tokens: int | None  # prompt tokens the engine computed (vLLM >= 0.32)

    def computed_locally(self, trust_cached: bool) -> int | None:
        """Prompt tokens the decode computed itself, None when the answer does not say."""
        if self.created_cache_tokens is not None:
            return self.created_cache_tokens
        if trust_cached and self.cached_tokens is not None:
            return max(self.prompt_tokens - self.cached_tokens, 0)
        return None

    def recomputed(self, min_ratio: float, *, trust_cached: bool) -> bool:
        """Whether the decode computed at least ``min_ratio`` of the prompt itself."""
        computed = self.computed_locally(trust_cached)
        if computed is None or self.prompt_tokens <= 0:
            return False
        return computed >= min_ratio * self.prompt_tokens and computed > 0


def _from_object(data: Any) -> PromptUsage | None:
    if not isinstance(data, dict):
        return None
    if data.get("type") == "response.completed":  # a Responses stream's last event
        data = data.get("response")
        if not isinstance(data, dict):
            return None
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage:
        return _from_conversation_usage(usage)
    prompt = usage.get("prompt_tokens")
    if not isinstance(prompt, int):
        return None
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    cached = details.get("cached_tokens")
    meta = data.get("meta_info")
    if cached is None and isinstance(meta, dict):
        cached = meta.get("cached_tokens")
    created = details.get("created_cache_tokens")
    return PromptUsage(
        prompt,
        cached if isinstance(cached, int) else None,
        created if isinstance(created, int) else None,
    )


def _from_conversation_usage(usage: dict[str, Any]) -> PromptUsage | None:
    """Responses ``usage``: ``input_tokens`` (the whole prompt) with
    ``input_tokens_details.{cached_tokens, cache_write_tokens}``; Anthropic Messages: the
    uncached, uncreated rest in ``input_tokens`` beside ``cache_read_input_tokens`` and
    ``cache_creation_input_tokens`` (vLLM 0.32 fills both from the chat usage's
    ``cached_tokens`` and ``created_cache_tokens``)."""
    given = usage.get("input_tokens")
    if not isinstance(given, int):
        return None
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):
        cached, created = details.get("cached_tokens"), details.get("cache_write_tokens")
        prompt = given
    else:
        cached = usage.get("cache_read_input_tokens")
        created = usage.get("cache_creation_input_tokens")
        prompt = given + sum(value for value in (cached, created) if isinstance(value, int))
    return PromptUsage(
        prompt,
        cached if isinstance(cached, int) else None,
        created if isinstance(created, int) else None,
    )


def prompt_usage(body: bytes) -> PromptUsage | None:
    """From a whole JSON answer; None when it carries no usable ``usage``."""
    if b'"usage"' not in body:
        return None
    try:
        return _from_typed(_decode_answer(body))
    except msgspec.ValidationError:  # an odd shape: read it field by field
        pass
    except msgspec.DecodeError:
        return None
    try:
        return _from_object(_decode(body))
    except msgspec.DecodeError:
        return None


def prompt_usage_in_sse(tail: bytes) -> PromptUsage | None:
    """From the last events of a stream (the usage chunk comes just before ``[DONE]``)."""
    return _last_in_sse(tail, _from_object)


T = TypeVar("T")


def _last_in_sse(tail: bytes, read: Callable[[Any], T | None]) -> T | None:
    """What ``read`` finds in the last ``data:`` event of ``tail`` that mentions ``usage``."""
    if b'"usage"' not in tail:
        return None
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                found = read(_decode(line[5:].strip()))
            except msgspec.DecodeError:
                continue
            if found is not None:
                return found
    return None


class _Totals(msgspec.Struct):
    """Only what ``used_tokens`` reads of an answer: the rest is skipped, not built."""

    type: Any = None
    usage: Any = None
    response: Any = None  # a Responses answer's ``response.completed`` event


_decode_totals = msgspec.json.Decoder(_Totals).decode


def used_tokens(body: bytes) -> int | None:
    """The tokens a whole answer's ``usage`` counts (prompt and output), for a tenant's token
    limit: ``total_tokens``, else prompt plus completion (input plus output) tokens."""
    if b'"usage"' not in body:
        return None
    try:
        answer = _decode_totals(body)
    except msgspec.DecodeError:  # not JSON, or not an object (a ValidationError)
        return None
    if answer.type == "response.completed":
        response = answer.response
        return _usage_total(response.get("usage") if isinstance(response, dict) else None)
    return _usage_total(answer.usage)


def used_tokens_in_sse(tail: bytes) -> int | None:
    """The same from a stream's last events (its usage event, or Responses' last event)."""
    return _last_in_sse(tail, _total_of)


def _total_of(data: Any) -> int | None:
    if isinstance(data, dict) and data.get("type") == "response.completed":
        data = data.get("response")
    return _usage_total(data.get("usage") if isinstance(data, dict) else None)


def _usage_total(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = [usage.get(key) for key in ("prompt_tokens", "completion_tokens")]
    if not all(isinstance(part, int) for part in parts):
        parts = [usage.get(key) for key in ("input_tokens", "output_tokens")]
    ints = [part for part in parts if isinstance(part, int)]
    return sum(ints) if len(ints) == 2 else None


class _AllUsage(_Usage):
    """``_Usage`` with what ``used_tokens`` adds up."""

    completion_tokens: int | None = None
    total_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None


class _AnswerUsage(_Answer):
    """What ``prompt_usage`` and ``used_tokens`` read of an answer, in one decode."""

    usage: _AllUsage | None = None
    type: Any = None
    response: Any = None


_decode_answer_usage = msgspec.json.Decoder(_AnswerUsage).decode


def answer_usage(body: bytes) -> tuple[PromptUsage | None, int | None]:
    """``prompt_usage(body)`` and ``used_tokens(body)`` with the body decoded once where its
    usage has the usual shape (a completions or chat answer); the same answers as the two."""
    if b'"usage"' not in body:
        return None, None
    try:
        answer = _decode_answer_usage(body)
    except msgspec.ValidationError:  # another shape: each reads it its own way
        return prompt_usage(body), used_tokens(body)
    except msgspec.DecodeError:
        return None, None
    if answer.type == "response.completed":
        response = answer.response
        used = _usage_total(response.get("usage") if isinstance(response, dict) else None)
    else:
        used = None if answer.usage is None else _typed_total(answer.usage)
    return _from_typed(answer), used


def _typed_total(usage: _AllUsage) -> int | None:
    """``_usage_total`` of a usage decoded into ``_AllUsage``."""
    if usage.total_tokens is not None:
        return usage.total_tokens
    if usage.completion_tokens is not None:
        return usage.prompt_tokens + usage.completion_tokens
    if usage.input_tokens is not None and usage.output_tokens is not None:
        return usage.input_tokens + usage.output_tokens
    return None


def usage_in_sse(tail: bytes) -> tuple[PromptUsage | None, int | None]:
    """``prompt_usage_in_sse(tail)`` and ``used_tokens_in_sse(tail)``, each event decoded once."""
    prompt = used = None
    if b'"usage"' not in tail:
        return None, None
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                data = _decode(line[5:].strip())
            except msgspec.DecodeError:
                continue
            if prompt is None:
                prompt = _from_object(data)
            if used is None:
                used = _total_of(data)
            if prompt is not None and used is not None:
                break
    return prompt, used
