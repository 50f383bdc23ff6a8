"""Minimal OpenAI request envelope: parse once, validate what routing needs, keep the rest as is.

The envelope is also where a request's size in sequences is bounded (``RequestLimits``): one
72-byte body with ``n: 10**9`` would otherwise make the router build 10^9 SGLang requests.

A body over ``LAZY_BODY_BYTES`` keeps each large top-level field that the router never reads (a
``logit_bias`` map, ``tools``, ...) as a ``msgspec.Raw`` slice of the body, which msgspec encodes
back verbatim for the engines: decoding 28 MB of ``logit_bias`` builds ~280 MB of Python objects
in ~0.85 s on the event loop, holding the GIL (a worker thread would stall the loop as long),
while slicing it takes ~17 ms and no memory. Smaller bodies take the one-call decode.
"""

from __future__ import annotations

import codecs
import itertools
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import msgspec

from router.errors import InvalidRequest

if TYPE_CHECKING:
    from router.settings import ServerSettings

__all__ = [
    "LAZY_BODY_BYTES",
    "CONVERSATIONS",
    "Endpoint",
    "ParsedRequest",
    "RequestLimits",
    "check_body",
    "json_depth_within",
    "parse_request",
]


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"  # OpenAI Responses, stateless (docs/concepts/protocols.md 13)
    MESSAGES = "/v1/messages"  # Anthropic Messages


# the endpoints whose body holds one conversation and asks for one sequence (no n, no batch)
CONVERSATIONS = frozenset({Endpoint.RESPONSES, Endpoint.MESSAGES})


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


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """Bounds on one request; the defaults are ``ServerSettings``' (a test keeps them equal)."""

    max_n: int = 128  # samples per prompt
    max_batch: int = 256  # prompts in one batched /v1/completions request
    max_sequences: int = 1024  # n x batch: the sequences the engines generate
    max_json_depth: int = 64  # nesting of arrays and objects, the body itself being level 1

    @classmethod
    def from_settings(cls, server: ServerSettings) -> RequestLimits:
        return cls(
            max_n=server.max_n,
            max_batch=server.max_batch,
            max_sequences=server.max_sequences,
            max_json_depth=server.max_json_depth,
        )


_decoder = msgspec.json.Decoder()
_fields_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_DEFAULT_LIMITS = RequestLimits()

LAZY_BODY_BYTES = 1 << 20  # bodies above this keep large fields the router never reads raw
_RAW_FIELD_BYTES = 64 << 10  # the size from which such a field stays raw
# the top-level fields the router (envelope, features, tokenizers, adapters) reads
_READ_FIELDS = frozenset(
    {"model", "stream", "n", "prompt", "messages", "stream_options"}
    | {"input", "instructions", "system", "max_tokens", "previous_response_id", "background"}
)
_UTF8_SLICE = 1 << 20  # invalid UTF-8 in a raw field is found slice by slice


def parse_request(
    endpoint: Endpoint,
    raw: bytes | bytearray,
    limits: RequestLimits = _DEFAULT_LIMITS,
    *,
    checked: bool = False,
) -> ParsedRequest:
    """Decode and check the envelope; raises InvalidRequest with the offending parameter.
    ``checked``: ``check_body`` passed already (a caller may run it in a loop step of its
    own)."""
    body = _decode(raw, limits.max_json_depth, checked)
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    stream = _check_stream(body.get("stream", False))
    if endpoint in CONVERSATIONS:
        _check_conversation(endpoint, body)
        return ParsedRequest(endpoint=endpoint, body=body, stream=stream, batch=None, n=1)
    n = _check_n(body.get("n", 1), limits.max_n)
    if endpoint is Endpoint.CHAT:
        _check_messages(body.get("messages"))
        batch = None
    else:
        batch = _prompt_batch(body.get("prompt"), limits.max_batch)
    sequences = (batch or 1) * n
    if sequences > limits.max_sequences:
        raise InvalidRequest(
            f"{batch or 1} prompt(s) x n={n} asks for {sequences} sequences; at most "
            f"{limits.max_sequences} per request",
            param="n",
        )
    return ParsedRequest(endpoint=endpoint, body=body, stream=stream, batch=batch, n=n)


def check_body(raw: bytes | bytearray, max_depth: int) -> None:
    """The checks of the whole body that decoding it does not make: its nesting depth and, for
    a body over ``LAZY_BODY_BYTES`` (whose large fields may stay raw, unchecked), its UTF-8.
    Raises InvalidRequest."""
    if not json_depth_within(raw, max_depth):
        raise InvalidRequest(_too_deep(max_depth))
    if len(raw) > LAZY_BODY_BYTES and not raw.isascii():
        try:
            _check_utf8(raw)
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: invalid UTF-8 ({exc})") from exc


def _decode(raw: bytes | bytearray, max_depth: int, checked: bool) -> Any:
    """The JSON value, or InvalidRequest: malformed JSON, invalid UTF-8 in a string (msgspec
    raises UnicodeDecodeError there), or nesting deeper than ``max_depth`` (msgspec itself raises
    RecursionError near Python's recursion limit, ~1000 levels)."""
    try:
        body = _decoder.decode(raw) if len(raw) <= LAZY_BODY_BYTES else _decode_lazily(raw)
    except msgspec.ValidationError as exc:  # only the lazy decoder's: not an object
        raise InvalidRequest("request body must be a JSON object") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: invalid UTF-8 ({exc})") from exc
    except RecursionError as exc:
        raise InvalidRequest(_too_deep(max_depth)) from exc
    if not checked:
        check_body(raw, max_depth)
    return body


def _decode_lazily(raw: bytes | bytearray) -> dict[str, Any]:
    """The body's fields, those the router reads and the small ones decoded, the other large
    ones kept raw (valid JSON, as msgspec checks while slicing; their UTF-8: ``check_body``)."""
    fields = _fields_decoder.decode(raw)
    return {
        name: _decoder.decode(value)
        if name in _READ_FIELDS or len(value) <= _RAW_FIELD_BYTES
        else value
        for name, value in fields.items()
    }


def _check_utf8(raw: bytes | bytearray) -> None:
    """Raises UnicodeDecodeError for invalid UTF-8, holding at most a slice's text at once."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(raw)
    for start in range(0, len(raw), _UTF8_SLICE):
        decoder.decode(view[start : start + _UTF8_SLICE])
    decoder.decode(b"", final=True)


def _too_deep(max_depth: int) -> str:
    return f"request body nests arrays and objects deeper than {max_depth} levels"


_NOT_OPENERS = bytes(range(256)).translate(None, b"[{")
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'[]{}"')
_BRACKET_STEPS = bytes.maketrans(b"[]{}", b"\x01\xff\x01\xff")  # +1 / -1 as signed bytes


def json_depth_within(raw: bytes | bytearray, max_depth: int) -> bool:
    """Whether the nesting of arrays and objects in valid JSON ``raw`` is at most ``max_depth``.

    No recursion and no work per JSON value in Python: bytes methods drop escapes, everything
    but brackets and quotes, then string contents, and the depth is the largest prefix sum of
    +1/-1 steps. Most bodies have fewer ``[``/``{`` than the limit and stop at the first check
    (~10 us for 32 KB); a 30 KB chat body of 100 messages with content parts takes ~30 us
    (msgspec decodes it in ~40 us), 33 KB of 11,000 arrays ~0.5 ms (decoding: ~0.4 ms)."""
    if len(raw.translate(None, _NOT_OPENERS)) <= max_depth:
        return True
    if b"\\" in raw:  # an escaped backslash first, so that what is left of \" is a quote
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    # "" is an empty string or the end of one string and the start of the next: either way
    # dropping it keeps what lies outside strings
    structure = raw.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in structure:  # strings holding brackets: every other piece is outside them
        structure = b"".join(structure.split(b'"')[::2])
    if len(structure) <= 2 * max_depth:  # balanced: half of them open
        return True
    steps = memoryview(structure.translate(_BRACKET_STEPS)).cast("b")
    return max(itertools.accumulate(steps), default=0) <= max_depth


def _check_stream(value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    return value


def _check_n(value: Any, max_n: int) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest("'n' must be a positive integer", param="n")
    if value > max_n:
        raise InvalidRequest(f"'n' must be at most {max_n}, got {value}", param="n")
    return value


def _check_messages(value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "'messages' is required and must be a non-empty list", param="messages"
        )
    if not all(isinstance(message, dict) for message in value):
        raise InvalidRequest("each entry of 'messages' must be an object", param="messages")


def _check_conversation(endpoint: Endpoint, body: dict[str, Any]) -> None:
    """A Responses body: an ``input`` and no server-side state (the engine that would hold a
    stored conversation is one of several, chosen per request). A Messages body: ``messages``
    and the ``max_tokens`` Anthropic's API requires."""
    if endpoint is Endpoint.MESSAGES:
        _check_messages(body.get("messages"))
        limit = body.get("max_tokens")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidRequest(
                "'max_tokens' is required and must be a positive integer", param="max_tokens"
            )
        return
    given = body.get("input")
    if not (isinstance(given, str) and given) and not (isinstance(given, list) and given):
        raise InvalidRequest(
            "'input' is required: a non-empty string or a non-empty list of items", param="input"
        )
    if body.get("previous_response_id") is not None:
        raise InvalidRequest(
            "'previous_response_id' is not supported through the PD router: responses are not "
            "stored (each request may reach another engine); send the whole conversation in "
            "'input'",
            param="previous_response_id",
        )
    if body.get("background") is True:
        raise InvalidRequest(
            "'background' responses are not supported through the PD router: they need a "
            "stored response on one engine",
            param="background",
        )


def _prompt_batch(prompt: Any, max_batch: int) -> int | None:
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
        if not _token_ids(prompt):
            raise InvalidRequest("'prompt' mixes token ids with other values", param="prompt")
        return None
    if len(prompt) > max_batch:  # before looking at every entry
        raise InvalidRequest(
            f"'prompt' holds {len(prompt)} prompts; at most {max_batch} per request",
            param="prompt",
        )
    if all(isinstance(p, str) for p in prompt):
        return len(prompt)
    if all(isinstance(p, list) and p and _token_ids(p) for p in prompt):
        return len(prompt)
    raise InvalidRequest(
        "'prompt' must be a string, a list of strings or a list of non-empty token-id lists",
        param="prompt",
    )


def _token_ids(values: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)
