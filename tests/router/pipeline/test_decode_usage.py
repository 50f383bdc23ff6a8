"""Reading the decode's prompt usage from a whole answer: the typed fast path (only ``usage``
and ``meta_info`` decoded) says what a field-by-field read says, for every shape engines send."""

from __future__ import annotations

import msgspec
import pytest

from router.pipeline import decode_usage as readers
from router.pipeline.decode_usage import PromptUsage, prompt_usage, used_tokens

TEXT = {"choices": [{"index": 0, "text": " tok" * 200, "finish_reason": "length"}]}


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"usage": {"prompt_tokens": 7}}, PromptUsage(7, None, None)),
        (
            {"usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 5}}},
            PromptUsage(7, 5, None),
        ),
        (
            {
                "usage": {
                    "prompt_tokens": 9,
                    "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 9},
                }
            },
            PromptUsage(9, 0, 9),
        ),
        (
            {"usage": {"prompt_tokens": 4}, "meta_info": {"cached_tokens": 3}},
            PromptUsage(4, 3, None),
        ),
        (
            {"usage": {"prompt_tokens": 4, "prompt_tokens_details": None}},
            PromptUsage(4, None, None),
        ),
        # odd shapes: read field by field, as before
        ({"usage": {"prompt_tokens": 4, "prompt_tokens_details": "?"}}, PromptUsage(4, None, None)),
        (
            {"usage": {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": "2"}}},
            PromptUsage(4, None, None),
        ),
        ({"usage": {"prompt_tokens": "4"}}, None),
        ({"usage": None}, None),
        ({"usage": []}, None),
    ],
)
def test_prompt_usage(answer: dict[str, object], expected: PromptUsage | None) -> None:
    assert prompt_usage(msgspec.json.encode({**TEXT, **answer})) == expected


def test_no_usage_or_no_json_is_none() -> None:
    assert prompt_usage(msgspec.json.encode(TEXT)) is None
    assert prompt_usage(b'{"usage": ') is None


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({**TEXT, "usage": {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}}, 21),
        ({**TEXT, "usage": {"prompt_tokens": 5, "completion_tokens": 16}}, 21),
        ({"usage": {"input_tokens": 3, "output_tokens": 4}}, 7),  # Messages, Responses
        ({"usage": {"prompt_tokens": 5, "completion_tokens": "16"}}, None),
        ({"usage": {"total_tokens": 9.0}}, None),
        ({"usage": None}, None),
        ({"usage": [1, 2]}, None),
        ({"type": "response.completed", "response": {"usage": {"total_tokens": 12}}}, 12),
        ({"type": "response.completed", "usage": {"total_tokens": 3}}, None),  # the response's
        ({"type": "response.completed", "response": "usage"}, None),
        ({"type": "message", "response": {"usage": {"total_tokens": 12}}, "usage": None}, None),
        ({"type": 1, "usage": {"total_tokens": 8}}, 8),
        (["usage"], None),  # not an object
    ],
)
def test_used_tokens(body: object, expected: int | None) -> None:
    assert used_tokens(msgspec.json.encode(body)) == expected


def test_used_tokens_of_no_usage_or_no_json_is_none() -> None:
    assert used_tokens(msgspec.json.encode(TEXT)) is None
    assert used_tokens(b'{"usage": {"total_tokens": 3}') is None
    assert used_tokens(b'{"choices": [}, "usage": {"total_tokens": 3}}') is None


_BOTH_READ = [
    {**TEXT, "usage": {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}},
    {**TEXT, "usage": {"prompt_tokens": 5, "completion_tokens": 16}},
    {"usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 5}}},
    {"usage": {"prompt_tokens": 7, "total_tokens": 9, "prompt_tokens_details": None}},
    {"usage": {"prompt_tokens": 9, "input_tokens": 2, "output_tokens": 3}},
    {"usage": {"prompt_tokens": 4}, "meta_info": {"cached_tokens": 3}},
    {"usage": {"input_tokens": 3, "output_tokens": 4}},
    {"usage": {"input_tokens": 3, "cache_read_input_tokens": 2, "output_tokens": 4}},
    {"usage": {"prompt_tokens": 5, "completion_tokens": "16"}},
    {"usage": {"prompt_tokens": 5, "total_tokens": 9.0}},
    {"usage": {"prompt_tokens": True, "total_tokens": 3}},
    {"usage": None},
    {"usage": [1, 2]},
    {"type": "response.completed", "response": {"usage": {"total_tokens": 12}}},
    {"type": "response.completed", "usage": {"prompt_tokens": 5, "total_tokens": 3}},
    {"type": "response.completed", "response": "usage"},
    {"type": 1, "usage": {"prompt_tokens": 2, "total_tokens": 8}},
    ["usage"],
]


@pytest.mark.parametrize("body", _BOTH_READ)
def test_one_decode_reads_what_both_readers_read(body: object) -> None:
    """``answer_usage`` (one decode) answers as ``prompt_usage`` and ``used_tokens`` each do."""
    raw = msgspec.json.encode(body)
    assert readers.answer_usage(raw) == (prompt_usage(raw), used_tokens(raw))


def test_one_decode_of_no_usage_or_no_json_is_none() -> None:
    for raw in (msgspec.json.encode(TEXT), b'{"usage": {"total_tokens": 3}', b'{"usage": '):
        assert readers.answer_usage(raw) == (None, None) == (prompt_usage(raw), used_tokens(raw))


@pytest.mark.parametrize("last", _BOTH_READ)
def test_one_read_of_a_streams_end_reads_what_both_readers_read(last: object) -> None:
    """``usage_in_sse`` answers as ``prompt_usage_in_sse`` and ``used_tokens_in_sse`` each do,
    the last event mentioning usage first, an earlier one where the last says nothing."""
    earlier = {"usage": {"prompt_tokens": 3, "total_tokens": 11}}
    events = [earlier, {"choices": []}, last]
    tail = b"".join(b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events)
    tail += b"data: [DONE]\n\n"
    both = (readers.prompt_usage_in_sse(tail), readers.used_tokens_in_sse(tail))
    assert readers.usage_in_sse(tail) == both
