"""Prompt tokenizers: the toy byte tokenizer, or a Hugging Face tokenizer directory.

``load_tokenizer(None)`` is the byte tokenizer (one token per UTF-8 byte); chat messages render
as ``"{role}: {content}\\n"`` per message. ``load_tokenizer(DIR)`` reads ``DIR/tokenizer.json``
with the ``tokenizers`` library and ``DIR/tokenizer_config.json`` for the chat template, and
tokenizes as vLLM's OpenAI server does. The router tokenizes the same way to key prefix blocks,
so this rendering is a contract:

* completions: ``encode(prompt, add_special_tokens=True)``;
* chat: ``chat_template`` rendered by ``jinja2.sandbox.ImmutableSandboxedEnvironment(
  trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])`` (Hugging Face
  ``apply_chat_template``'s environment) with ``messages`` (a content list's text parts joined
  by newlines, as vLLM passes them),
  ``add_generation_prompt=True``, ``bos_token`` and ``eos_token`` (strings from the config, ""
  when absent) and a ``raise_exception(message)`` global, then
  ``encode(text, add_special_tokens=False)`` (the template writes its own special tokens).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "PromptTokenizer",
    "TokenizerError",
    "load_tokenizer",
    "render_plain",
]


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used, or messages its template refuses."""


class PromptTokenizer(Protocol):
    """Turns a request's prompt or chat messages into the token ids the engine computes."""

    def prompt(self, text: str) -> list[int]:
        """A completions prompt's tokens."""

    def chat(self, messages: Sequence[Any]) -> list[int]:
        """Chat messages rendered as the engine renders them, then tokenized."""


def render_plain(messages: Sequence[Any]) -> str:
    """The byte tokenizer's chat rendering: ``role: content`` lines (text parts joined)."""
    return "".join(
        f"{m.get('role', '')}: {_text(m.get('content'))}\n" for m in messages if isinstance(m, dict)
    )


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")


class ByteTokenizer:
    """One token per UTF-8 byte (the simulated model's own tokenizer)."""

    def prompt(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def chat(self, messages: Sequence[Any]) -> list[int]:
        return self.prompt(render_plain(messages))


def _string_content(message: Any) -> Any:
    """A message whose content is a list of parts, with its text parts joined by newlines (what
    vLLM's chat front end gives a template that expects string content)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = [p.get("text", "") for p in message["content"] if isinstance(p, dict)]
    return {**message, "content": "\n".join(str(p) for p in parts)}


def _raise(message: str) -> NoReturn:
    raise TokenizerError(message)


def _token_text(value: Any) -> str:
    """``bos_token``/``eos_token`` as written in tokenizer_config.json (a string or AddedToken)."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class HFTokenizer:
    """A Hugging Face tokenizer directory, tokenized as vLLM does (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any]) -> None:
        template = config.get("chat_template")
        if not isinstance(template, str):
            raise TokenizerError("tokenizer_config.json has no chat_template string")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        self._tokenizer = tokenizer
        self._template = env.from_string(template)
        self._specials = {
            "bos_token": _token_text(config.get("bos_token")),
            "eos_token": _token_text(config.get("eos_token")),
        }

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load ``path``; raises ``TokenizerError`` naming what is missing or malformed."""
        root = Path(path)
        try:
            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        except Exception as exc:  # OSError, JSON errors, and tokenizers' bare Exception
            raise TokenizerError(f"cannot load the tokenizer in {root}: {exc}") from exc
        if not isinstance(config, dict):
            raise TokenizerError(f"{root / 'tokenizer_config.json'} is not a JSON object")
        return cls(tokenizer, config)

    def render(self, messages: Sequence[Any]) -> str:
        """The chat template's text for ``messages`` with the generation prompt."""
        try:
            return self._template.render(
                messages=[_string_content(m) for m in messages],
                add_generation_prompt=True,
                **self._specials,
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def prompt(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def chat(self, messages: Sequence[Any]) -> list[int]:
        return list(self._tokenizer.encode(self.render(messages), add_special_tokens=False).ids)


def load_tokenizer(path: str | Path | None) -> PromptTokenizer:
    """The byte tokenizer for None, else the Hugging Face tokenizer in directory ``path``."""
    return ByteTokenizer() if path is None else HFTokenizer.from_dir(path)
