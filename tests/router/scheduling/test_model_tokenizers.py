"""``--model-tokenizer MODEL=DIR`` and ``--model-render-url MODEL=URL``: with several models
behind the router, precise ``cache_aware`` tokenizes each request with its own model's tokenizer
(its chat template too) or render API, the others with ``--tokenizer``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec

from router.scheduling.tokenizers import LocalTokenizer, open_token_source
from router.schemas import Endpoint, ParsedRequest, parse_request
from router.settings import CacheAwareSettings
from testkit.servers import arun_server
from testkit.tokenizer_dir import build_tokenizer_dir
from tests.router.scheduling.test_prompt_tokens import render_app


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


async def test_a_models_render_api_tokenizes_its_requests(tmp_path: Path) -> None:
    """``--model-render-url b=URL``: model b's requests are rendered there (a vLLM engine or
    render server serving b), the others tokenized by ``--tokenizer``; a model with both its
    own tokenizer and a render URL uses its tokenizer."""
    path = build_tokenizer_dir(tmp_path / "a")
    calls: list[tuple[str, dict[str, Any]]] = []
    async with arun_server(render_app([9, 8, 7], calls)) as port:
        url = f"http://127.0.0.1:{port}"
        settings = CacheAwareSettings(
            tokenizer=str(path),
            model_tokenizers={"c": str(path)},
            model_render_urls={"b": url, "c": url},
        )
        source = open_token_source(settings)
        assert source is not None
        try:
            assert await source.tokens(_chat("b")) == [9, 8, 7]
            local = await LocalTokenizer.from_dir(path).tokens(_chat("a"))
            assert await source.tokens(_chat("a")) == local
            assert await source.tokens(_chat("c")) == await LocalTokenizer.from_dir(path).tokens(
                _chat("c")
            )
        finally:
            await source.aclose()
    assert [body["model"] for _, body in calls] == ["b"]
