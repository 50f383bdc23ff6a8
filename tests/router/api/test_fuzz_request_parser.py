"""Hypothesis against the request parser (``router.schemas.parse_request``) and the router.

Bodies are OpenAI completion, chat and Responses bodies and Anthropic Messages bodies, valid or
nearly so (random extra fields, wrong types, huge and tiny numbers, unicode, brackets and escapes
inside strings, nesting around and far beyond the depth limit, n and batch around their bounds),
and raw bytes made from them (truncated, with invalid UTF-8, not an object). Properties:

* the parser returns a ``ParsedRequest`` or raises ``InvalidRequest`` (400), nothing else, and it
  accepts exactly the bodies ``_expected_valid`` (the rules, written out again here) accepts;
* a parsed request's body is the client's JSON as is, its features are the body's, and the body
  re-encoded (as the adapters forward it) parses to the same request;
* ``json_depth_within`` agrees with a recursive depth count for any JSON and any limit;
* through a real router, any body gets a 2xx or a 4xx error JSON in time, never a 5xx.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import msgspec
import pytest
from hypothesis import strategies as st

from router.errors import InvalidRequest, error_body
from router.schemas import (
    Endpoint,
    ParsedRequest,
    RequestLimits,
    json_depth_within,
    parse_request,
)
from testkit.fake_cluster import fake_cluster_factory

MODEL = "fake-model"  # what the fake engines serve
SETTINGS = hypothesis.settings(
    max_examples=400, derandomize=True, database=None, deadline=None, print_blob=True
)

# -- strategies ---------------------------------------------------------------------------------

# strings that trip up a scanner of raw JSON: brackets, quotes, backslashes, escapes, non-ASCII
_TRICKY = st.text(
    st.sampled_from('[]{}"\\/:,abc \n\t\x00\x1f\u00e9\u2028\U0001f600'), max_size=12
) | st.text(max_size=12)
_NUMBERS = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-3, max_value=10)
    | st.floats(allow_nan=False, allow_infinity=False)
)
_SCALARS = st.none() | st.booleans() | _NUMBERS | _TRICKY
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY, inner, max_size=4),
    max_leaves=20,
)
_TOKEN_IDS = st.lists(st.integers(min_value=0, max_value=2**31), min_size=1, max_size=5)
# each envelope field: (a valid value, a wrong or nearly right one)
_FIELDS = {
    "model": (st.sampled_from([MODEL, MODEL, "m"]), st.sampled_from([""]) | _SCALARS),
    "stream": (st.booleans() | st.none(), _SCALARS),
    "n": (st.integers(min_value=1, max_value=7), st.integers(-2, 0) | _SCALARS),
    "max_tokens": (st.integers(min_value=1, max_value=8), st.integers(1, 8)),
}
_PROMPTS = (
    st.one_of(
        _TRICKY,
        st.lists(_TRICKY, min_size=1, max_size=6),
        _TOKEN_IDS,
        st.lists(_TOKEN_IDS, min_size=1, max_size=6),
    ),
    st.one_of(
        # token-id lists gone wrong: empty, or holding other values
        st.lists(st.lists(st.integers(0, 9) | _SCALARS, max_size=2), min_size=1, max_size=3),
        st.lists(st.one_of(_TRICKY, st.integers(), st.booleans()), max_size=4),  # mixed
        JSON_VALUES,
    ),
)
_MESSAGES = (
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": _TRICKY}
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(JSON_VALUES, max_size=3) | JSON_VALUES,
)


_INPUTS = (  # /v1/responses
    _TRICKY | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _TRICKY})),
    st.sampled_from(["", []]) | JSON_VALUES,
)
_STATE = (  # Responses fields that ask for a stored response: absent or off is valid
    st.none() | st.just(False),
    st.just(True) | _TRICKY,
)
_Strategies = tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]
_PROMPT_FIELDS: dict[Endpoint, list[tuple[str, _Strategies]]] = {
    Endpoint.COMPLETIONS: [("prompt", _PROMPTS)],
    Endpoint.CHAT: [("messages", _MESSAGES)],
    Endpoint.MESSAGES: [("messages", _MESSAGES)],
    Endpoint.RESPONSES: [
        ("input", _INPUTS),
        ("previous_response_id", (st.none(), _TRICKY)),
        ("background", _STATE),
    ],
}


@st.composite
def bodies(draw: st.DrawFn, endpoint: Endpoint) -> dict[str, Any]:
    """A completion (chat, Responses, Messages) body: random extra fields, then each envelope
    field right (mostly), wrong, or absent."""
    body: dict[str, Any] = draw(st.dictionaries(_TRICKY, JSON_VALUES, max_size=3))
    prompt = _PROMPT_FIELDS[endpoint]
    for key, (valid, wrong) in [*_FIELDS.items(), *prompt]:
        right = 12 if key == prompt[0][0] else 17  # out of 20; the prompt goes wrong most often
        choice = draw(st.integers(0, 19))
        if choice < right:
            body[key] = draw(valid)
        elif choice < 19:
            body[key] = draw(wrong)
    return body


def _nest(depth: int, inner: bytes, objects: bool) -> bytes:
    """``inner`` inside ``depth`` arrays (or single-key objects)."""
    if objects:
        return b'{"k":' * depth + inner + b"}" * depth
    return b"[" * depth + inner + b"]" * depth


@st.composite
def raw_bodies(draw: st.DrawFn, endpoint: Endpoint, max_depth: int) -> bytes:
    """The bytes of a body: encoded as clients do, then maybe nested deep, cut or corrupted."""
    body = draw(bodies(endpoint))
    how = draw(
        st.sampled_from(["plain"] * 4 + ["indented", "ascii", "deep", "cut", "bytes", "scalar"])
    )
    if how == "indented":
        return json.dumps(body, indent=1).encode()
    if how == "ascii":
        return json.dumps(body, ensure_ascii=True).encode()
    raw = msgspec.json.encode(body)
    if how == "deep":  # around the limit, or past msgspec's own recursion limit
        depth = draw(
            st.sampled_from([max_depth - 2, max_depth - 1, max_depth, 1000, 1100, 5000])
            | st.integers(0, max_depth + 3)
        )
        nested = _nest(
            max(depth, 0), draw(st.sampled_from([b"", b"1", b'"]]"'])), draw(st.booleans())
        )
        return raw[:-1] + (b"," if len(raw) > 2 else b"") + b'"deep":' + nested + b"}"
    if how == "cut":
        return raw[: draw(st.integers(0, len(raw)))]
    if how == "bytes":  # anything at all, invalid UTF-8 included, somewhere in the body
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at:]
    if how == "scalar":
        return msgspec.json.encode(draw(JSON_VALUES))
    return raw


_LIMITS = st.builds(
    RequestLimits,
    max_n=st.integers(1, 6),
    max_batch=st.integers(1, 5),
    max_sequences=st.integers(1, 24),
    max_json_depth=st.integers(3, 10),
)

# -- the rules, written out again -----------------------------------------------------------------


def _depth(value: Any) -> int:
    """Nesting of arrays and objects, a scalar being 0 and ``[]`` 1 (a walk without recursion:
    the stdlib decodes ~1000 levels)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _batch(prompt: Any, limits: RequestLimits) -> int | None | bool:
    """The number of prompts (None: one), or False for an invalid prompt."""
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(map(_is_int, prompt))
    ):
        return None
    if not isinstance(prompt, list) or not prompt or len(prompt) > limits.max_batch:
        return False
    strings = all(isinstance(p, str) for p in prompt)
    token_lists = all(isinstance(p, list) and p and all(map(_is_int, p)) for p in prompt)
    return len(prompt) if strings or token_lists else False


def _expected_valid(endpoint: Endpoint, body: Any, limits: RequestLimits) -> bool:
    if not isinstance(body, dict) or _depth(body) > limits.max_json_depth:
        return False
    model, stream, n = body.get("model"), body.get("stream"), body.get("n")
    if not (isinstance(model, str) and model) or not (stream is None or isinstance(stream, bool)):
        return False
    if endpoint in (Endpoint.RESPONSES, Endpoint.MESSAGES):
        return _conversation_valid(endpoint, body)  # one sequence: n is not theirs
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= limits.max_n:
        return False
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        ok = isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
        return bool(ok) and n <= limits.max_sequences
    batch = _batch(body.get("prompt"), limits)
    return batch is not False and (batch or 1) * n <= limits.max_sequences


def _conversation_valid(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    if endpoint is Endpoint.MESSAGES:
        messages, limit = body.get("messages"), body.get("max_tokens")
        ok = isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
        return bool(ok) and isinstance(limit, int) and _is_int(limit) and limit >= 1
    given = body.get("input")
    stateless = body.get("previous_response_id") is None and body.get("background") is not True
    return bool(isinstance(given, str | list) and given) and stateless


def _decoded(raw: bytes) -> tuple[bool, Any]:
    """(True, the JSON value) if ``raw`` is JSON the stdlib reads, else (False, None)."""
    try:
        return True, json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False, None


# -- the parser ---------------------------------------------------------------------------------


def _parse(endpoint: Endpoint, raw: bytes, limits: RequestLimits) -> ParsedRequest | None:
    """The parsed request, or None for a 400; any other exception fails the test."""
    try:
        return parse_request(endpoint, raw, limits)
    except InvalidRequest as exc:
        assert exc.status == 400
        assert msgspec.json.decode(error_body(exc))["error"]["code"] == 400
        return None


def _check_parsed(parsed: ParsedRequest, endpoint: Endpoint, limits: RequestLimits) -> None:
    body = parsed.body
    assert parsed.endpoint is endpoint
    assert isinstance(body["model"], str) and body["model"]
    assert parsed.stream is (body.get("stream") is True)
    conversation = endpoint in (Endpoint.RESPONSES, Endpoint.MESSAGES)
    assert parsed.n == (1 if conversation else body.get("n") or 1)
    assert 1 <= parsed.n <= limits.max_n
    assert parsed.batch is None or 1 <= parsed.batch <= limits.max_batch
    assert parsed.sample_count <= limits.max_sequences
    # what the adapters forward: the body re-encoded, which parses to the same request
    assert parse_request(endpoint, msgspec.json.encode(body), limits) == parsed


@pytest.mark.parametrize("endpoint", list(Endpoint))
@SETTINGS
@hypothesis.given(data=st.data(), limits=_LIMITS)
def test_parser_accepts_exactly_the_valid_bodies(
    endpoint: Endpoint, data: st.DataObject, limits: RequestLimits
) -> None:
    raw = data.draw(raw_bodies(endpoint, limits.max_json_depth), "raw")
    parsed = _parse(endpoint, raw, limits)
    is_json, value = _decoded(raw)
    hypothesis.event("parsed" if parsed else "400")
    if parsed is None:
        assert not (is_json and _expected_valid(endpoint, value, limits)), value
        return
    assert is_json and parsed.body == value  # the client's JSON, as is
    assert _expected_valid(endpoint, value, limits)
    _check_parsed(parsed, endpoint, limits)


@SETTINGS
@hypothesis.given(value=JSON_VALUES, limit=st.integers(0, 8), style=st.integers(0, 2))
def test_json_depth_within_counts_like_a_recursive_walk(value: Any, limit: int, style: int) -> None:
    raw = [
        msgspec.json.encode(value),
        json.dumps(value, indent=2).encode(),
        json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(),
    ][style]
    assert json_depth_within(raw, limit) is (_depth(value) <= limit)


def test_depth_beyond_the_decoders_own_limit_is_a_400() -> None:
    """Far past the limit (and past msgspec's recursion limit): a 400, not a RecursionError."""
    for depth in (65, 1000, 100_000):
        raw = b'{"model": "m", "prompt": "x", "x": ' + _nest(depth, b"", False) + b"}"
        with pytest.raises(InvalidRequest, match="deeper than 64 levels"):
            parse_request(Endpoint.COMPLETIONS, raw)


def test_a_batch_of_token_id_lists_needs_token_ids_in_each() -> None:
    """What the fuzzer found: the router took ``[[]]`` and ``[["a"]]`` as a batch of token-id
    lists and sent them to both engines, which refused them; now the router answers 400."""
    prompts: list[Any] = [[[]], [["a"]], [[1], [True]], [[1], []], [[1.5]]]
    for prompt in prompts:
        raw = msgspec.json.encode({"model": "m", "prompt": prompt})
        with pytest.raises(InvalidRequest, match="non-empty token-id lists"):
            parse_request(Endpoint.COMPLETIONS, raw)
    parsed = parse_request(Endpoint.COMPLETIONS, b'{"model": "m", "prompt": [[1, 2], [3]]}')
    assert parsed.batch == 2


# -- through a real router ----------------------------------------------------------------------

ROUTER_LIMITS = RequestLimits(max_n=4, max_batch=3, max_sequences=6, max_json_depth=8)


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    limits = {
        "max_n": ROUTER_LIMITS.max_n,
        "max_batch": ROUTER_LIMITS.max_batch,
        "max_sequences": ROUTER_LIMITS.max_sequences,
        "max_json_depth": ROUTER_LIMITS.max_json_depth,
    }
    with contextlib.ExitStack() as stack:
        cluster = fake_cluster_factory(stack)("sglang", server=limits)
        yield cluster.router_url


@st.composite
def _router_requests(draw: st.DrawFn) -> tuple[Endpoint, bytes]:
    endpoint = draw(st.sampled_from(list(Endpoint)))
    return endpoint, draw(raw_bodies(endpoint, ROUTER_LIMITS.max_json_depth))


@hypothesis.settings(
    max_examples=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(request=_router_requests())
def test_the_router_answers_any_body_with_a_2xx_or_a_4xx_error(
    router_url: str, request: tuple[Endpoint, bytes]
) -> None:
    endpoint, raw = request
    headers = {"content-type": "application/json"}
    response = httpx.post(router_url + endpoint.value, content=raw, headers=headers, timeout=10)
    assert response.status_code < 500, response.text
    hypothesis.event(f"HTTP {response.status_code}")
    if response.status_code >= 400:
        error = response.json()["error"]
        # the router's errors, OpenAI's shape; an engine's on /v1/messages: Anthropic's
        assert error.get("code") == response.status_code or error["message"], response.text
        return
    assert response.status_code == 200
    stream = response.headers["content-type"].startswith("text/event-stream")
    if stream and endpoint in (Endpoint.RESPONSES, Endpoint.MESSAGES):
        last = response.text.rstrip().rsplit("\n", 1)[-1]  # event: ...\ndata: {...}
        assert '"type":"response.' in last or '"type":"message_stop"' in last, response.text
    elif stream:
        assert response.text.rstrip().endswith("data: [DONE]"), response.text
    else:
        answer = response.json()
        assert answer.get("choices") or answer.get("output") or answer.get("content"), answer
