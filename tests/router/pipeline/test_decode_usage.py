"""Reading the decode's prompt usage from a whole answer: the typed fast path (only ``usage``
and ``meta_info`` decoded) says what a field-by-field read says, for every shape engines send."""

from __future__ import annotations

import msgspec
import pytest

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
