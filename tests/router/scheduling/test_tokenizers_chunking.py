"""Completions prompts (and long chat pieces) are cut at pre-tokenizer boundaries proven exact
for the loaded tokenizer, so a shared prefix is encoded once: the ids always equal whole-text
encoding, on random and real-looking text, for GPT-2, Llama 3 and Qwen 2 style byte-level BPEs;
any other tokenizer is not cut (never a wrong id)."""

from __future__ import annotations

import json
import random
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from router.scheduling import prompt_pieces
from router.scheduling.prompt_pieces import KNOWN_SPLIT_REGEXES, PromptSplitter
from router.scheduling.tokenizers import LocalTokenizer
from router.schemas import Endpoint, parse_request
from testkit.tokenizer_dir import build_tokenizer_dir

LLAMA3_REGEX, QWEN2_REGEX = sorted(KNOWN_SPLIT_REGEXES, key=lambda regex: "{1,3}" not in regex)
SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>"]
WORDS = [
    "the", "Quick", "brown", "fox", "a", "I", "x", "don't", "it's", "We'll", "THE'S", "caf\u00e9",
    "na\u00efve", "e\u0301t\u00e9", "\u4e2d\u6587", "\u03a9mega", "123", "4567", "3.14", "_id",
]  # fmt: skip
SEPARATORS = [
    " ", " ", " ", "  ", "   ", "\n", "\n", "\n\n", " \n", "\n ", "\t", "\r\n", ".", ", ", "!",
    "?", "'", '"', "-", "--", "(", ")", ": ", ";", "/", "\u00a0", "\u3000", "#", "`", ". ",
]  # fmt: skip


def corpus() -> list[str]:
    """Text to train on: a few stdlib modules, and random text, so that the vocabulary merges
    whitespace runs, newlines and punctuation the way a large one does (a cut in the wrong
    place then changes the ids)."""
    sources = [Path(json.__file__), Path(textwrap.__file__), Path(random.__file__)]
    rng = random.Random("corpus")
    return [path.read_text() for path in sources] + [random_text(rng, []) for _ in range(400)]


def train(
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    *,
    normalizer: normalizers.Normalizer | None = None,
    bos: bool = True,
) -> Tokenizer:
    """A small BPE (vocabulary 800) with ChatML specials, BOS prepended when ``bos``."""
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
        )
    return tokenizer


def split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def bench_tokenizer(tmp: Path) -> Tokenizer:
    return Tokenizer.from_file(str(build_tokenizer_dir(tmp / "testkit") / "tokenizer.json"))


def gpt2_style(tmp: Path) -> Tokenizer:
    return train(pre_tokenizers.ByteLevel(add_prefix_space=False))


def llama3_style(tmp: Path) -> Tokenizer:
    return train(split_then_bytes(LLAMA3_REGEX))


def qwen2_style(tmp: Path) -> Tokenizer:
    return train(split_then_bytes(QWEN2_REGEX), normalizer=normalizers.NFC(), bos=False)


PROVEN: dict[str, Callable[[Path], Tokenizer]] = {
    "bench": bench_tokenizer,
    "gpt2": gpt2_style,
    "llama3": llama3_style,
    "qwen2": qwen2_style,
}


@pytest.fixture(scope="module", params=sorted(PROVEN))
def proven(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return PROVEN[request.param](tmp_path_factory.mktemp("tok"))


def random_text(rng: random.Random, specials: list[str]) -> str:
    parts: list[str] = []
    for _ in range(rng.randint(1, 120)):
        roll = rng.random()
        if roll < 0.5:
            parts.append(rng.choice(WORDS))
        elif roll < 0.97 or not specials:
            parts.append(rng.choice(SEPARATORS))
        else:
            parts.append(rng.choice(specials))
    return "".join(parts)


def real_looking_texts() -> list[str]:
    """Source code, JSON, markdown and prose, as prompts carry them."""
    code = Path(textwrap.__file__).read_text()[:12_000]
    data = json.dumps({"rows": [{"id": i, "name": f"item {i}", "ok": i % 2} for i in range(60)]})
    markdown = "# Title\n\nSome *text* here.\n\n- one\n- two\n\n```python\nx = 1\n```\n" * 20
    prose = " ".join(["It was the best of times, it was the worst of times."] * 80)
    return [code, json.dumps(json.loads(data), indent=2), markdown, prose, code.upper()]


@pytest.mark.parametrize("chunk_chars", [1, 5, 64])
def test_cut_encoding_equals_whole_text_encoding_on_random_text(
    proven: Tokenizer, chunk_chars: int
) -> None:
    local = LocalTokenizer(proven, chunk_chars=chunk_chars, cache_entries=4096)
    assert local.splitter.boundary is not None
    rng = random.Random(f"chunking:{chunk_chars}")
    for _ in range(150):
        text = random_text(rng, SPECIALS)
        for special in (True, False):
            expected = proven.encode(text, add_special_tokens=special).ids
            assert local.encode(text, add_special_tokens=special) == expected, repr(text)
    assert local.cache.hits > 150  # the second encoding of each text came from the cache


def test_cut_encoding_equals_whole_text_encoding_on_real_looking_text(proven: Tokenizer) -> None:
    local = LocalTokenizer(proven, chunk_chars=16)
    for text in real_looking_texts():
        assert len(local.splitter.split(text)) > 10
        assert local.encode(text, add_special_tokens=True) == proven.encode(text).ids


def test_a_shared_completions_prefix_is_encoded_once(tmp_path: Path) -> None:
    tokenizer_dir = build_tokenizer_dir(tmp_path / "tok")
    local = LocalTokenizer.from_dir(tokenizer_dir)  # the defaults the router runs with
    reference = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    rng = random.Random("shared")
    prefix = " ".join(rng.choice(WORDS[:7]) for _ in range(1500))
    first, second = prefix + " one tail here", prefix + " another tail, different"
    assert local.encode(first, add_special_tokens=True) == reference.encode(first).ids
    hits, misses = local.cache.hits, local.cache.misses
    assert local.encode(second, add_special_tokens=True) == reference.encode(second).ids
    chunks = len(local.splitter.split(second))
    assert chunks > 10
    assert local.cache.hits - hits == chunks - 1  # only the piece holding the tails missed
    assert local.cache.misses - misses == 1


async def test_completions_requests_are_cut_and_cached_on_and_off_the_event_loop(
    tmp_path: Path,
) -> None:
    local = LocalTokenizer.from_dir(build_tokenizer_dir(tmp_path / "tok"))
    local._inline_chars = 0  # every miss through asyncio.to_thread
    reference = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    prefix = "You are a careful assistant.\nAnswer briefly. " * 40
    for tail in ("First question?", "Second question, longer than that!"):
        body = msgspec.json.encode({"model": "m", "prompt": prefix + tail})
        ids = await local.tokens(parse_request(Endpoint.COMPLETIONS, body))
        assert ids == reference.encode(prefix + tail).ids
    assert local.cache.hits >= len(prefix) // local.splitter.chunk_chars - 1


def lstrip_token(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.add_tokens([AddedToken("<mask>", lstrip=True)])
    return tokenizer


UNPROVEN: dict[str, Callable[[], Tokenizer]] = {
    "prefix space": lambda: train(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "metaspace": lambda: train(pre_tokenizers.Metaspace()),
    "unknown regex": lambda: train(split_then_bytes(r"\w+|\s+|[^\w\s]+")),
    "lowercase": lambda: train(split_then_bytes(LLAMA3_REGEX), normalizer=normalizers.Lowercase()),
    "lstrip token": lambda: lstrip_token(train(pre_tokenizers.ByteLevel(add_prefix_space=False))),
}


@pytest.mark.parametrize("kind", sorted(UNPROVEN))
def test_a_tokenizer_the_proof_does_not_cover_is_not_cut(kind: str) -> None:
    tokenizer = UNPROVEN[kind]()
    local = LocalTokenizer(tokenizer, chunk_chars=1)
    assert local.splitter.boundary is None
    rng = random.Random(f"unproven:{kind}")
    for text in [random_text(rng, ["<mask>", *SPECIALS]) for _ in range(40)]:
        assert local.encode(text, add_special_tokens=True) == tokenizer.encode(text).ids


def test_the_load_probe_rejects_a_boundary_that_is_not_exact(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """GPT-2's ``\\s+(?!\\S)`` keeps ``"  \\n"`` whole at the end of a piece but not before a
    letter, and ``" ?\\p{L}+"`` takes the space before a word: cuts there change the ids."""
    tokenizer = gpt2_style(tmp_path)
    for unsafe in (r"(?<=\n)(?=[!-~])", r"(?<= )(?=[!-~])"):
        monkeypatch.setattr(prompt_pieces, "CHUNK_BOUNDARY", re.compile(unsafe))
        assert PromptSplitter(tokenizer, chunk_chars=1).boundary is None


def test_a_directory_saved_with_truncation_or_padding_still_encodes_whole_prompts(
    tmp_path: Path,
) -> None:
    """transformers turns a ``tokenizer.json``'s truncation and padding off unless a call asks
    for them, so the engines see every token; so must the router, piece by piece."""
    tokenizer = gpt2_style(tmp_path)
    reference = tokenizer.encode(" ".join(WORDS * 20)).ids
    tokenizer.enable_truncation(max_length=8)
    tokenizer.enable_padding(length=64)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    local = LocalTokenizer.from_dir(tmp_path, chunk_chars=16)
    assert local.encode(" ".join(WORDS * 20), add_special_tokens=True) == reference
    assert len(reference) > 64
