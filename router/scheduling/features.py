"""The request features the policies read: the prompt's text (approximate matching) and, when a
choice needs them, its token ids (precise matching), with the chained block keys of those ids.

The token ids come from a token source (``router.scheduling.tokenizers``: a local tokenizer or
the engine's render API); its names stay importable from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.conversations import conversation_messages
from router.kv_cache.keys import adapter_root, chain_keys
from router.scheduling.tokenizers import (
    INLINE_ENCODE_CHARS,
    LocalTokenizer,
    RenderTokenizer,
    TokenSource,
    message_text,
    open_token_source,
    token_id_prompt,
)
from router.schemas import Endpoint, ParsedRequest

__all__ = [
    "INLINE_ENCODE_CHARS",
    "Featurizer",
    "LocalTokenizer",
    "RenderTokenizer",
    "RequestFeatures",
    "TokenSource",
    "estimate_tokens",
    "message_text",
    "open_token_source",
    "request_text",
]


def estimate_tokens(text: str) -> int:
    """A prompt's token count when no tokenizer is at hand: UTF-8 bytes / 4."""
    return (len(text) if text.isascii() else len(text.encode())) // 4


@dataclass(slots=True)
class RequestFeatures:
    """What routing sees of a request's prompt: its text (approximate matching) and its token
    ids (precise matching). Chained block keys are computed on first use per block size and
    kept for the request's retries."""

    text: str | None = None
    tokens: Sequence[int] | None = None
    adapter: str | None = None  # the LoRA adapter its model is on its pool's workers
    _keys: dict[int, list[int]] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's token count: exact with token ids, else estimated from the text."""
        if self.tokens is not None:
            return len(self.tokens)
        return None if self.text is None else estimate_tokens(self.text)

    def keys(self, block_size: int) -> list[int]:
        """The chained keys of the prompt's full blocks of ``block_size`` tokens."""
        keys = self._keys.get(block_size)
        if keys is None:
            root = adapter_root(self.adapter)
            keys = self._keys[block_size] = chain_keys(self.tokens or (), block_size, root)
        return keys

    @property
    def match_text(self) -> str | None:
        """The text the approximate prefix tree matches: an adapter's requests apart from the
        base model's and from other adapters' (their KV is not shared)."""
        text, adapter = self.text, self.adapter
        return text if adapter is None or text is None else f"\x00{adapter}\x00{text}"


def request_text(request: ParsedRequest) -> str | None:
    """The text approximate routing matches on: each chat message as ``role: content`` on its
    own line (a Responses or Messages conversation as its chat messages,
    ``router.conversations``), or the completions prompt. None for batched or token-id
    prompts."""
    body, endpoint = request.body, request.endpoint
    if endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else None
    if endpoint is Endpoint.CHAT:
        return "".join(
            f"{message.get('role', '')}: {message_text(message.get('content'))}\n"
            for message in body.get("messages", ())
        )
    conversation = conversation_messages(request)
    if conversation is not None:
        return "".join(f"{message['role']}: {message['content']}\n" for message in conversation)
    return None


class Featurizer:
    """Computes a request's :class:`RequestFeatures`, timing the tokenization."""

    def __init__(
        self, source: TokenSource | None, observe: Callable[[float], None] | None = None
    ) -> None:
        self.source = source
        self._observe = observe

    async def features(self, request: ParsedRequest, *, tokens: bool) -> RequestFeatures:
        """The text always; the token ids too when ``tokens`` and a source is configured."""
        features = RequestFeatures(text=request_text(request))
        if tokens and self.source is not None:
            started = time.perf_counter()
            features.tokens = await self.source.tokens(request)
            if self._observe is not None:
                self._observe(time.perf_counter() - started)
        elif tokens:
            features.tokens = token_id_prompt(request)
        return features

    async def aclose(self) -> None:
        if self.source is not None:
            await self.source.aclose()
