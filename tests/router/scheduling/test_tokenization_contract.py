"""The router's tokenizer (``router.scheduling.tokenizers``) and the simulated engine's
(``worker.tokenizer``) must give the same token ids for the same request: precise cache-aware
routing keys blocks by them, so one differing id makes every later block miss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.scheduling.tokenizers import LocalTokenizer
from router.schemas import Endpoint, parse_request
from testkit.tokenizer_dir import build_tokenizer_dir
from worker.tokenizer import HFTokenizer

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello there"}],
    [
        {"role": "system", "content": "You are terse.\n  Answer in one line."},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "Saved attention keys and values."},
        {"role": "user", "content": "And prefix caching?  "},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
        }
    ],
]
PROMPTS = ["plain prompt", "  leading spaces and <|end|> a marker", "ünïcödé text\n\nend"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("messages", CHATS)
async def test_chat_token_ids_agree(tokenizer_dir: Path, messages: list[dict[str, Any]]) -> None:
    router = LocalTokenizer.from_dir(tokenizer_dir)
    body = {"model": "m", "messages": messages}
    request = parse_request(Endpoint.CHAT, msgspec.json.encode(body))
    expected = HFTokenizer.from_dir(tokenizer_dir).chat(messages)
    assert await router.tokens(request) == expected
    assert await router.tokens(request) == expected  # again, from the segment cache


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_completion_token_ids_agree(tokenizer_dir: Path, prompt: str) -> None:
    router = LocalTokenizer.from_dir(tokenizer_dir)
    request = parse_request(
        Endpoint.COMPLETIONS, msgspec.json.encode({"model": "m", "prompt": prompt})
    )
    assert await router.tokens(request) == HFTokenizer.from_dir(tokenizer_dir).prompt(prompt)
