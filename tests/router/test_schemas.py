"""The request envelope: what is accepted, what is a 400, and the batch arithmetic."""

from __future__ import annotations

import msgspec
import pytest

from router.errors import InvalidRequest
from router.schemas import LAZY_BODY_BYTES, Endpoint, parse_request


@pytest.mark.parametrize(
    ("endpoint", "raw", "param"),
    [
        (Endpoint.COMPLETIONS, b"{not json", None),
        (Endpoint.COMPLETIONS, b"[1, 2]", None),
        (Endpoint.COMPLETIONS, b'"text"', None),
        (Endpoint.COMPLETIONS, b'{"prompt": "x"}', "model"),
        (Endpoint.COMPLETIONS, b'{"model": "", "prompt": "x"}', "model"),
        (Endpoint.COMPLETIONS, b'{"model": 3, "prompt": "x"}', "model"),
        (Endpoint.COMPLETIONS, b'{"model": "m"}', "prompt"),
        (Endpoint.COMPLETIONS, b'{"model": "m", "prompt": []}', "prompt"),
        (Endpoint.COMPLETIONS, b'{"model": "m", "prompt": [1, "a"]}', "prompt"),
        (Endpoint.COMPLETIONS, b'{"model": "m", "prompt": {"a": 1}}', "prompt"),
        (Endpoint.COMPLETIONS, b'{"model": "m", "prompt": "x", "stream": "yes"}', "stream"),
        (Endpoint.COMPLETIONS, b'{"model": "m", "prompt": "x", "n": 0}', "n"),
        (Endpoint.CHAT, b'{"model": "m"}', "messages"),
        (Endpoint.CHAT, b'{"model": "m", "messages": []}', "messages"),
        (Endpoint.CHAT, b'{"model": "m", "messages": ["hi"]}', "messages"),
    ],
)
def test_bad_envelopes_are_invalid_requests(
    endpoint: Endpoint, raw: bytes, param: str | None
) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(endpoint, raw)
    assert info.value.status == 400
    assert info.value.param == param


@pytest.mark.parametrize(
    ("prompt", "batch"),
    [("x", None), ([1, 2, 3], None), (["a", "b"], 2), ([[1], [2], [3]], 3)],
)
def test_prompt_batch(prompt: object, batch: int | None) -> None:

    request = parse_request(
        Endpoint.COMPLETIONS, msgspec.json.encode({"model": "m", "prompt": prompt, "n": 2})
    )
    assert request.batch == batch
    assert request.sample_count == (batch or 1) * 2


def test_unknown_fields_are_kept() -> None:
    request = parse_request(
        Endpoint.CHAT,
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": 5, "x": null}',
    )
    assert request.body["top_k"] == 5 and "x" in request.body and request.stream is False


# ------------------------------------------------- large bodies (issue 21, finding 5)


def _large(**fields: object) -> bytes:
    """A completion body over LAZY_BODY_BYTES: a 2 MB logit_bias the router never reads."""
    bias = {str(token): -100 for token in range(150_000)}
    return msgspec.json.encode({"model": "m", "prompt": "x", "logit_bias": bias, **fields})


def test_a_large_field_the_router_does_not_read_stays_raw_and_goes_out_as_it_came() -> None:
    raw = _large(max_tokens=5, stop=["y" * 10_000])
    assert len(raw) > LAZY_BODY_BYTES
    request = parse_request(Endpoint.COMPLETIONS, raw)
    assert isinstance(request.body["logit_bias"], msgspec.Raw)  # no 150,000 Python objects
    assert request.body["max_tokens"] == 5  # small fields are decoded
    assert request.body["stop"] == ["y" * 10_000]  # read by no one, but small
    assert msgspec.json.encode(request.body) == raw
    assert msgspec.json.decode(msgspec.json.encode(request.body)) == msgspec.json.decode(raw)


def test_the_fields_the_router_reads_are_decoded_whatever_their_size() -> None:
    prompt = list(range(300_000))
    request = parse_request(Endpoint.COMPLETIONS, _large(prompt=prompt, n=2))
    assert request.body["prompt"] == prompt and request.n == 2


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (_large()[:-1] + b', "x": "\xff"}', "invalid UTF-8"),
        (_large()[:-1] + b', "x": [' + b"[" * 100 + b"]" * 100 + b"]}", "deeper than 64"),
        (b"[" + _large() + b"]", "must be a JSON object"),
        (_large()[:-2], "not valid JSON"),
    ],
)
def test_a_large_body_is_checked_as_a_small_one(raw: bytes, needle: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(Endpoint.COMPLETIONS, raw)
    assert needle in info.value.message
