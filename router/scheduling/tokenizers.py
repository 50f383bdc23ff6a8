"""Loading the prompt's token ids as the engine will see them (precise routing): tokenizers
and chat templates.

Three sources, chosen by settings (``open_token_source``):

* ``--tokenizer DIR``: ``tokenizer.json`` through the ``tokenizers`` library, chat messages
  rendered with ``tokenizer_config.json``'s Jinja ``chat_template`` (else ``chat_template.jinja``,
  where newer transformers save it) the way Hugging Face does
  (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``add_generation_prompt=True``), then encoded
  without special tokens; a completions prompt is encoded with them. vLLM tokenizes these
  simple templates the same way, and so does ``pd-worker --tokenizer``.
* ``--render-url URL``: the engine's own render API (vLLM >= 0.32, docs/concepts/protocols.md
11.2), 5 s
  timeout; a failure leaves that request to approximate routing.
* neither: no token ids (approximate routing over ``features.request_text`` only).

Repeated prefixes (a long system prompt, earlier turns, a completions prompt's shared preamble)
are cheap: the text is cut at added tokens and, between them, at pre-tokenizer boundaries proven
exact for the loaded tokenizer (``router.scheduling.prompt_pieces``), and each piece's ids are
kept in a bounded LRU (``router.scheduling.segment_cache``). Encoding what the cache misses runs
inline when short and in a worker thread when long, so a huge prompt does not stall the event
loop.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

import httpx
import jinja2
import jinja2.ext
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from registry.models import redact_url
from router.conversations import conversation_messages
from router.scheduling.prompt_pieces import CHUNK_CHARS, PromptSplitter
from router.scheduling.segment_cache import INLINE_ENCODE_CHARS, CachedEncoder
from router.schemas import Endpoint, ParsedRequest
from router.settings import CacheAwareSettings

__all__ = [
    "INLINE_ENCODE_CHARS",
    "LocalTokenizer",
    "RenderTokenizer",
    "TokenSource",
    "message_text",
    "open_token_source",
    "token_id_prompt",
]

logger = logging.getLogger(__name__)

RENDER_TIMEOUT_S = 5.0
_CHAT_RENDER = "/v1/chat/completions/render"  # also for a Responses or Messages conversation
_RENDER_PATHS = {
    Endpoint.CHAT: _CHAT_RENDER,
    Endpoint.COMPLETIONS: "/v1/completions/render",
}


class TokenSource(Protocol):
    """Turns a request into the prompt token ids the engine will compute."""

    async def tokens(self, request: ParsedRequest) -> list[int] | None:
        """The ids, or None when they cannot be known (batched prompts, a failed render).
        Never raises for a bad request: routing then falls back to approximate."""
        ...

    async def aclose(self) -> None: ...


def message_text(content: Any) -> str:
    """A message's text: a string, or the ``text`` parts of a content list joined by newlines
    (what vLLM's chat front end passes to the template)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
            if isinstance(part.get("text"), str)
        ]
        return "\n".join(texts)
    return ""


def token_id_prompt(request: ParsedRequest) -> list[int] | None:
    """A completions prompt given as token ids is its own tokenization."""
    prompt = request.body.get("prompt")
    if (
        request.endpoint is Endpoint.COMPLETIONS
        and request.batch is None
        and isinstance(prompt, list)
    ):
        return [int(token) for token in prompt]
    return None


def _chat_body(request: ParsedRequest) -> dict[str, Any]:
    """The body as the chat request its engine makes of it: a Responses or Messages
    conversation as its chat messages (``router.conversations``), other bodies as they are."""
    conversation = conversation_messages(request)
    if conversation is None:
        return request.body
    return {"model": request.body.get("model"), "messages": conversation}


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {**message, "content": message_text(message.get("content"))}
        for message in body.get("messages", ())
    ]


def _token_text(value: Any) -> str | None:
    """``bos_token`` and friends: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class LocalTokenizer(CachedEncoder):
    """A Hugging Face tokenizer directory, used exactly as the engines use it: a
    :class:`CachedEncoder` (``encode``/``aencode``, the piece cache) plus the chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        cache_entries: int = 8192,
        inline_chars: int = INLINE_ENCODE_CHARS,
        chunk_chars: int = CHUNK_CHARS,
    ) -> None:
        splitter = PromptSplitter(tokenizer, chunk_chars=chunk_chars)
        super().__init__(
            tokenizer, splitter, cache_entries=cache_entries, inline_chars=inline_chars
        )
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._template = (
            None if chat_template is None else _environment().from_string(chat_template)
        )

    @classmethod
    def from_dir(
        cls, path: str | Path, *, cache_entries: int = 8192, chunk_chars: int = CHUNK_CHARS
    ) -> LocalTokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json``; raises ValueError when the
        directory does not hold a usable tokenizer."""
        root = Path(path)
        try:
            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
            raise ValueError(f"cannot load {root / 'tokenizer.json'}: {exc}") from exc
        # transformers turns these off per call unless asked for; so do the engines
        tokenizer.no_truncation()
        tokenizer.no_padding()
        config: dict[str, Any] = {}
        config_path = root / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read {config_path}: {exc}") from exc
        template = config.get("chat_template")
        jinja_file = root / "chat_template.jinja"  # where newer transformers save it
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(
            tokenizer,
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            cache_entries=cache_entries,
            chunk_chars=chunk_chars,
        )

    async def tokens(self, request: ParsedRequest) -> list[int] | None:
        ids = token_id_prompt(request)
        if ids is not None or request.batch is not None:
            return ids
        if request.endpoint is not Endpoint.COMPLETIONS:
            text = self.render_chat(_chat_body(request))
            if text is None:
                return None
            return await self.aencode(text, add_special_tokens=False)
        prompt = request.body.get("prompt")
        if not isinstance(prompt, str):
            return None
        return await self.aencode(prompt, add_special_tokens=True)

    async def aclose(self) -> None:
        return None

    def render_chat(self, body: dict[str, Any]) -> str | None:
        """The chat template applied to the body's messages; None without a template or when
        the template refuses them."""
        if self._template is None:
            return None
        try:
            return self._template.render(
                messages=_messages(body), add_generation_prompt=True, **self._specials
            )
        except jinja2.TemplateError as exc:
            logger.debug("chat template failed, routing approximately: %s", exc)
            return None


def _environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment Hugging Face ``apply_chat_template`` uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, indent=indent, ensure_ascii=False
    )
    return env


class RenderTokenizer:
    """The engine's render API: ``POST {url}/v1/chat/completions/render`` answers one
    ``GenerateRequest`` (``{"token_ids": [...], ...}``), ``/v1/completions/render`` a list of
    them (vLLM 0.32 ``entrypoints/scale_out/render``)."""

    def __init__(self, url: str, *, client: httpx.AsyncClient | None = None) -> None:
        self._url = url.rstrip("/")
        self._client = client or httpx.AsyncClient(timeout=RENDER_TIMEOUT_S)

    async def tokens(self, request: ParsedRequest) -> list[int] | None:
        ids = token_id_prompt(request)
        if ids is not None or request.batch is not None:
            return ids
        url = self._url + _RENDER_PATHS.get(request.endpoint, _CHAT_RENDER)
        try:
            # msgspec: a large body's unread fields are msgspec.Raw slices (router.schemas)
            content = msgspec.json.encode(_chat_body(request))
            response = await self._client.post(url, content=content, headers=_JSON_HEADERS)
            response.raise_for_status()
            return _render_ids(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            public = redact_url(url)  # an error's text names the URL, password and all
            error = str(exc).replace(url, public)
            logger.warning("render at %s failed, routing approximately: %s", public, error)
            return None

    async def aclose(self) -> None:
        await self._client.aclose()


_JSON_HEADERS = {"content-type": "application/json"}


def _render_ids(answer: Any) -> list[int]:
    """The token ids in a render answer (one object, or a one-element list of them)."""
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    ids = answer.get("token_ids") if isinstance(answer, dict) else None
    if not isinstance(ids, list) or not all(type(token) is int for token in ids):
        raise ValueError(f"the render answer carries no token_ids list: {str(answer)[:200]}")
    return ids


class ModelTokenSources:
    """Each request tokenized by its model's source (several models with their own
    tokenizers or render APIs, ``--model-tokenizer``, ``--model-render-url``), else by
    ``default`` (None: its ids are not known)."""

    def __init__(self, default: TokenSource | None, by_model: dict[str, TokenSource]) -> None:
        self.default = default
        self.by_model = by_model

    async def tokens(self, request: ParsedRequest) -> list[int] | None:
        model = request.body.get("model")
        source = (self.by_model.get(model) if isinstance(model, str) else None) or self.default
        return None if source is None else await source.tokens(request)

    async def aclose(self) -> None:
        for source in (*self.by_model.values(), self.default):
            if source is not None:
                await source.aclose()


def open_token_source(settings: CacheAwareSettings) -> TokenSource | None:
    """The configured token source: a local tokenizer (preferred), the render API, or None;
    with ``model_tokenizers`` or ``model_render_urls``, each of those models' own first (its
    tokenizer before its render API)."""
    default: TokenSource | None = None
    if settings.tokenizer is not None:
        default = LocalTokenizer.from_dir(
            settings.tokenizer, cache_entries=settings.tokenize_cache_entries
        )
    elif settings.render_url is not None:
        default = RenderTokenizer(settings.render_url)
    if not settings.model_tokenizers and not settings.model_render_urls:
        return default
    by_model: dict[str, TokenSource] = {
        model: RenderTokenizer(url)
        for model, url in settings.model_render_urls.items()
        if model not in settings.model_tokenizers
    }
    for model, path in settings.model_tokenizers.items():
        by_model[model] = LocalTokenizer.from_dir(
            path, cache_entries=settings.tokenize_cache_entries
        )
    return ModelTokenSources(default, by_model)
