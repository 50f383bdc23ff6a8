"""The request envelope: what is accepted, what is a 400, and the batch arithmetic."""

from __future__ import annotations

import pytest

from router.errors import InvalidRequest
from router.schemas import Endpoint, parse_request


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
    import msgspec

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
