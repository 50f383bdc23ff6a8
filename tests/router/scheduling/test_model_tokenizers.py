"""``--model-tokenizer MODEL=DIR``: with several models behind the router, precise
``cache_aware`` tokenizes each request with its own model's tokenizer (its chat template too),
the others with ``--tokenizer``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec

from router.scheduling.tokenizers import LocalTokenizer, open_token_source
from router.schemas import Endpoint, ParsedRequest, parse_request
from router.settings import CacheAwareSettings
from testkit.tokenizer_dir import build_tokenizer_dir


def _chat(model: str) -> ParsedRequest:
    body = {"model": model, "messages": [{"role": "user", "content": "what is a KV cache?"}]}
    return parse_request(Endpoint.CHAT, msgspec.json.encode(body))


async def test_each_model_is_tokenized_with_its_own_tokenizer(tmp_path: Path) -> None:
    first = build_tokenizer_dir(tmp_path / "a")
    second = tmp_path / "b"
    shutil.copytree(first, second)  # the same vocabulary, another chat template
    config = json.loads((second / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}### {{ m['content'] }}\n{% endfor %}"
    (second / "tokenizer_config.json").write_text(json.dumps(config))
    source = open_token_source(
        CacheAwareSettings(tokenizer=str(first), model_tokenizers={"b": str(second)})
    )
    assert source is not None
    own = {name: LocalTokenizer.from_dir(path) for name, path in (("a", first), ("b", second))}
    expected = {name: await tokenizer.tokens(_chat(name)) for name, tokenizer in own.items()}
    assert expected["a"] != expected["b"]
    for model in ("a", "b"):
        assert await source.tokens(_chat(model)) == expected[model]
    assert await source.tokens(_chat("c")) == expected["a"]  # no own tokenizer: --tokenizer
    await source.aclose()


async def test_without_a_default_only_the_named_models_are_tokenized(tmp_path: Path) -> None:
    path = build_tokenizer_dir(tmp_path / "a")
    source = open_token_source(CacheAwareSettings(model_tokenizers={"a": str(path)}))
    assert source is not None
    assert await source.tokens(_chat("z")) is None
    assert await source.tokens(_chat("a")) == await LocalTokenizer.from_dir(path).tokens(_chat("a"))
