"""Prompt token ids at the router: exactly the engine's, repeated prefixes served from cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from router.scheduling.features import Featurizer, estimate_tokens, request_text
from router.scheduling.tokenizers import LocalTokenizer, RenderTokenizer
from router.schemas import Endpoint, parse_request
from testkit.servers import arun_server

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "you are a helpful assistant that answers questions about routing",
    "prefill and decode disaggregation moves the kv cache between engines",
    "hello there, how are you today? tell me about caches and tokens.",
]


def tiny_tokenizer_dir(path: Path) -> Path:
    """A small byte-level BPE with ChatML specials and a BOS post-processor, as a Hugging Face
    tokenizer directory (tokenizer.json + tokenizer_config.json)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"chat_template": CHATML, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def chat(*messages: tuple[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}


def parsed(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    return parse_request(endpoint, json.dumps(body).encode())


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def local(tokenizer_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.from_dir(tokenizer_dir, cache_entries=64)


TEXTS = [
    "plain text without specials",
    "<|im_start|>system\nyou are helpful<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n",
    "<s>leading bos then text</s> and after the eos <|im_end|><|im_start|>",
    " spaces  around <|im_start|> specials <|im_end|>  ",
    "",
]


@pytest.mark.parametrize("special", [False, True])
def test_segment_cached_encoding_equals_whole_text_encoding(
    local: LocalTokenizer, tokenizer_dir: Path, special: bool
) -> None:
    reference = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for text in TEXTS * 2:  # the second round is served from the segment cache
        assert local.encode(text, add_special_tokens=special) == (
            reference.encode(text, add_special_tokens=special).ids
        )
    assert local.cache.hits > 0


def test_a_repeated_system_prompt_is_encoded_once(local: LocalTokenizer) -> None:
    system = "<|im_start|>system\nyou are a helpful assistant that answers questions<|im_end|>\n"
    local.encode(system + "<|im_start|>user\nfirst<|im_end|>\n", add_special_tokens=False)
    misses = local.cache.misses
    local.encode(system + "<|im_start|>user\nsecond<|im_end|>\n", add_special_tokens=False)
    assert local.cache.misses == misses + 1  # only the new user text was encoded


def test_the_segment_cache_is_a_bounded_lru(tokenizer_dir: Path) -> None:
    small = LocalTokenizer.from_dir(tokenizer_dir, cache_entries=3)
    for i in range(20):
        small.encode(f"<|im_start|>piece number {i}<|im_end|>", add_special_tokens=False)
        assert len(small.cache) <= 3
    small.encode("<|im_start|>piece number 19<|im_end|>", add_special_tokens=False)
    hits = small.cache.hits
    small.encode("<|im_start|>piece number 0<|im_end|>", add_special_tokens=False)
    assert small.cache.hits == hits + 2  # the two specials stayed; piece 0 was evicted


async def test_chat_is_rendered_with_the_template_then_encoded_without_specials(
    local: LocalTokenizer, tokenizer_dir: Path
) -> None:
    reference = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    body = chat(
        ("system", "be brief"),
        ("user", [{"type": "text", "text": "hi"}, {"type": "text", "text": "you"}]),
    )
    text = local.render_chat(body)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi\nyou<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tokens = await local.tokens(parsed(Endpoint.CHAT, body))
    assert tokens == reference.encode(text, add_special_tokens=False).ids


async def test_completions_get_the_special_tokens_and_token_prompts_pass_through(
    local: LocalTokenizer, tokenizer_dir: Path
) -> None:
    reference = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokens = await local.tokens(parsed(Endpoint.COMPLETIONS, {"model": "m", "prompt": "hello"}))
    assert tokens == reference.encode("hello", add_special_tokens=True).ids
    assert tokens[0] == reference.token_to_id("<s>")
    ids = await local.tokens(parsed(Endpoint.COMPLETIONS, {"model": "m", "prompt": [5, 6, 7]}))
    assert ids == [5, 6, 7]
    batch = parsed(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["a", "b"]})
    assert await local.tokens(batch) is None


async def test_long_uncached_text_is_encoded_off_the_event_loop_exactly(
    tokenizer_dir: Path,
) -> None:
    threaded = LocalTokenizer.from_dir(tokenizer_dir)
    threaded._inline_chars = 0  # every uncached piece goes through asyncio.to_thread
    text = "<|im_start|>user\n" + " ".join(CORPUS) * 50 + "<|im_end|>\n"
    expected = threaded.encode(text, add_special_tokens=False)
    threaded.cache = type(threaded.cache)(8)
    assert await threaded.aencode(text, add_special_tokens=False) == expected


def test_approximate_text_and_estimates() -> None:
    body = chat(("system", "S"), ("user", [{"type": "text", "text": "a"}, {"type": "image"}]))
    assert request_text(parsed(Endpoint.CHAT, body)) == "system: S\nuser: a\n"
    assert request_text(parsed(Endpoint.COMPLETIONS, {"model": "m", "prompt": "p"})) == "p"
    assert estimate_tokens("x" * 400) == 100
    assert estimate_tokens("é" * 4) == 2  # UTF-8 bytes, not characters


async def test_featurizer_times_tokenization(local: LocalTokenizer) -> None:
    seen: list[float] = []
    features = await Featurizer(local, seen.append).features(
        parsed(Endpoint.COMPLETIONS, {"model": "m", "prompt": "hello there"}), tokens=True
    )
    assert features.tokens and features.prompt_tokens == len(features.tokens)
    assert len(seen) == 1 and seen[0] >= 0


def render_app(token_ids: list[int], calls: list[tuple[str, dict[str, Any]]]) -> Starlette:
    """vLLM 0.32's render API shapes: chat -> one GenerateRequest, completions -> a list."""

    async def chat_render(request: Request) -> JSONResponse:
        calls.append((request.url.path, await request.json()))
        return JSONResponse({"request_id": "r1", "token_ids": token_ids, "sampling_params": {}})

    async def completion_render(request: Request) -> JSONResponse:
        calls.append((request.url.path, await request.json()))
        return JSONResponse([{"request_id": "r2", "token_ids": token_ids[:2], "features": None}])

    async def broken(request: Request) -> JSONResponse:
        return JSONResponse({"error": {"message": "no"}}, status_code=500)

    return Starlette(
        routes=[
            Route("/v1/chat/completions/render", chat_render, methods=["POST"]),
            Route("/v1/completions/render", completion_render, methods=["POST"]),
            Route("/broken/v1/chat/completions/render", broken, methods=["POST"]),
        ]
    )


async def test_render_mode_reads_token_ids_from_the_engine_and_falls_back_on_failure() -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    async with arun_server(render_app([9, 8, 7], calls)) as port:
        source = RenderTokenizer(f"http://127.0.0.1:{port}")
        broken = RenderTokenizer(f"http://127.0.0.1:{port}/broken")
        try:
            body = chat(("user", "hi"))
            assert await source.tokens(parsed(Endpoint.CHAT, body)) == [9, 8, 7]
            completion = {"model": "m", "prompt": "hello"}
            assert await source.tokens(parsed(Endpoint.COMPLETIONS, completion)) == [9, 8]
            assert await broken.tokens(parsed(Endpoint.CHAT, body)) is None
        finally:
            await source.aclose()
            await broken.aclose()
    assert calls == [
        ("/v1/chat/completions/render", body),
        ("/v1/completions/render", completion),
    ]


async def test_render_mode_sends_a_large_bodys_unread_fields_verbatim() -> None:
    """A body over the lazy-parse size keeps its unread fields as raw slices: the render call
    still sends the whole body, as JSON the engine can read."""
    calls: list[tuple[str, dict[str, Any]]] = []
    bias = {str(token): 1 for token in range(120_000)}  # > 1 MiB of logit_bias
    body = {**chat(("user", "hi")), "logit_bias": bias}
    async with arun_server(render_app([9, 8, 7], calls)) as port:
        source = RenderTokenizer(f"http://127.0.0.1:{port}")
        try:
            assert await source.tokens(parsed(Endpoint.CHAT, body)) == [9, 8, 7]
        finally:
            await source.aclose()
    assert calls == [("/v1/chat/completions/render", body)]
