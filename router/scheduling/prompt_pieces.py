r"""Cutting a prompt into pieces whose encodings, concatenated, are the whole prompt's encoding,
so that each piece's token ids can be cached (``router.scheduling.segment_cache``).

Two kinds of cut, each used only where it is exact for the tokenizer actually loaded:

* at added tokens (``<|im_start|>`` and friends): the tokenizer itself splits there first.
  Checked once at load on a probe; else no cut at all.
* inside the text between them, at a *chunk boundary* the pre-tokenizer always splits at, so
  that no token spans it and each side pre-tokenizes alone as it does in the whole. Proven for
  the pre-tokenizers that byte-level BPE models ship with (``proven_chunk_boundary``), and
  checked once more at load on a probe; any other tokenizer (sentencepiece-style ``Metaspace``,
  a normalizer other than NFC, BPE dropout, added tokens that strip whitespace) gets no chunk
  cut, i.e. the whole text between added tokens is one piece (never a wrong id).

The boundaries (``CHUNK_BOUNDARY``), each between two ASCII characters so that NFC normalizes
each side as it does the whole (ASCII characters are starters and no composition ends with
one):

* A: before a space that follows a printable ASCII character, a space, a tab or a newline and
  precedes a printable ASCII character (``word| next``, ``end.| (x)``, ``\n   | "id"``);
* B: after a newline that follows a non-space character, before a printable ASCII character
  (``end.\n|Next``).

Why they are exact, for GPT-2's regex (``ByteLevel(use_regex=True)``, ``GPT2_REGEX``) and the
GPT-4-style ``Split`` regexes of Llama 3 and Qwen 2 (``KNOWN_SPLIT_REGEXES``). Matching is
leftmost-first with backtracking and the regexes have no lookbehind, so it suffices that in the
whole text a match ends at the cut (matching then restarts there exactly as on the right side
alone) and that no match attempt left of the cut decides differently when the text ends there:

* letter, digit and punctuation runs and contractions never take whitespace after their first
  character (`` ?`` and ``[^\r\n\p{L}\p{N}]?`` only open a match), and the trailing
  ``[\r\n]*`` stops at a non-newline; so the match of a non-space character before the cut
  ends at the cut (A) or at B's newline, and its attempts read one character past that at most:
  the space or the newline, which stops them as the end of the text would;
* a whitespace run that reaches the cut's space (A) continues with a non-space after it:
  ``\s+(?!\S)`` backs off one character, to the cut, and ``\s*[\r\n]+`` ends after the
  run's last newline, from where ``\s+(?!\S)`` again stops at the cut; on the left side alone
  both give the same matches (``\s+(?!\S)`` then takes the rest up to the end);
* B's newline is a one-character run: ``\s+`` (GPT-2; ``\s+(?!\S)`` on the left side alone)
  or ``\s*[\r\n]+`` or the ``[\r\n]*`` of a punctuation run takes exactly it. (After a
  longer run GPT-2's ``\s+(?!\S)`` would keep the whole run at the end of the left side but
  not in the whole text: not a boundary.)

Python's ``\S`` and ``[!-~]`` are non-space for the tokenizers' regex engine too. Byte-level
BPE then merges within a pre-token only.

Pieces are cut ``chunk_chars`` apart at least, at the first boundary past that, so two prompts
sharing a prefix share its pieces up to the one their difference falls in.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from tokenizers import Tokenizer

__all__ = [
    "CHUNK_BOUNDARY",
    "CHUNK_CHARS",
    "GPT2_REGEX",
    "KNOWN_SPLIT_REGEXES",
    "PromptSplitter",
    "proven_chunk_boundary",
    "special_wrapping",
]

logger = logging.getLogger(__name__)

# A piece between chunk cuts is at least this long (~70-100 tokens of English): a prompt that
# shares a long prefix with a cached one re-encodes at most this much of it, and a 2k-token
# prompt is ~30-40 cache lookups.
CHUNK_CHARS = 256
CHUNK_BOUNDARY = re.compile(r"(?<=[!-~ \t\n])(?= [!-~])|(?<=\S\n)(?=[!-~])")

# ByteLevel(use_regex=True)'s built-in regex, for the docs: it has no JSON form.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
KNOWN_SPLIT_REGEXES = frozenset(
    {
        # Llama 3 (and tiktoken's cl100k_base)
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        # Qwen 2, 2.5, 3
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)

_PROBES = (
    "The quick brown fox. Jumps over\nthe lazy dog's back, doesn't it? Yes:\nit does",
    "a  \nb \n\nc\td\r\ne 123 45678 x\n  y's z;\nA.B C--D (e) [f] {g} 'h' \"i\" j!\nk",
    "caf\u00e9 na\u0131ve e\u0301t\u00e9 \u4e2d\u6587 text\n\u00c9cole fin. Fin\n\u0391 alpha",
)


class PromptSplitter:
    """Cuts text into exactly-encodable pieces: at added tokens, then at chunk boundaries."""

    def __init__(self, tokenizer: Tokenizer, *, chunk_chars: int = CHUNK_CHARS) -> None:
        self._tokenizer = tokenizer
        self.chunk_chars = max(1, chunk_chars)
        self.prefix, self.suffix = special_wrapping(tokenizer)
        self.added = _splitting_tokens(tokenizer)
        self._added_splitter = (
            re.compile("(" + "|".join(re.escape(token) for token in self.added) + ")")
            if self.added
            else None
        )
        self.boundary: re.Pattern[str] | None = None
        if self._added_splitter is not None and not self._exact(chunk=False):
            logger.warning("tokenizer: encoding split at added tokens is not exact; no cache")
            self._added_splitter = None
            return  # a chunk could hold an added token the tokenizer does not split at
        self.boundary = proven_chunk_boundary(tokenizer)
        if self.boundary is not None and not self._exact(chunk=True):
            logger.warning("tokenizer: encoding split at chunk boundaries is not exact")
            self.boundary = None

    @property
    def splits(self) -> bool:
        """Whether text is cut at all (else every text is one piece, not worth caching)."""
        return self._added_splitter is not None or self.boundary is not None

    def split(self, text: str) -> list[str]:
        """The non-empty pieces of ``text``, in order; ``"".join`` gives ``text`` back."""
        if self._added_splitter is None:
            return self._chunks(text) if text else []
        pieces: list[str] = []
        for index, piece in enumerate(self._added_splitter.split(text)):
            if not piece:
                continue
            if index % 2:  # a captured added token
                pieces.append(piece)
            else:
                pieces.extend(self._chunks(piece))
        return pieces

    def _chunks(self, text: str) -> list[str]:
        size = self.chunk_chars
        if self.boundary is None or len(text) < 2 * size:
            return [text]
        search = self.boundary.search
        chunks: list[str] = []
        start = 0
        while (match := search(text, start + size)) is not None:
            cut = match.start()
            chunks.append(text[start:cut])
            start = cut
        chunks.append(text[start:])
        return chunks

    def _exact(self, *, chunk: bool) -> bool:
        """Piecewise encoding equals whole-text encoding on probes mixing added tokens, with
        chunks cut at every boundary when ``chunk``."""
        size, self.chunk_chars = self.chunk_chars, 1
        try:
            tokens = self.added[:3]
            probes = [
                "Start here" + " Hello world!\n".join(["", *tokens, ""]) + " tail\n\nend",
                *(probe + token for probe in _PROBES for token in ["", *tokens[:1]]),
            ]
            splits = [self.split(probe) for probe in probes]
            if chunk and sum(map(len, splits)) < len(probes) + len(_PROBES):
                return False  # the boundary must be exercised
            return all(map(self._exact_on, probes, splits))
        finally:
            self.chunk_chars = size

    def _exact_on(self, probe: str, pieces: list[str]) -> bool:
        encoded = self._tokenizer.encode_batch(pieces, add_special_tokens=False)
        joined = [token for encoding in encoded for token in encoding.ids]
        if joined != self._tokenizer.encode(probe, add_special_tokens=False).ids:
            return False
        whole = self._tokenizer.encode(probe, add_special_tokens=True).ids
        return [*self.prefix, *joined, *self.suffix] == whole


def special_wrapping(tokenizer: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the post-processor puts before and after a single sequence (BOS, EOS)."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return tuple(full[:start]), tuple(full[start + len(plain) :])
    return (), ()


def _splitting_tokens(tokenizer: Tokenizer) -> list[str]:
    """The added tokens text is split at (longest first). Tokens that strip whitespace, match
    single words or are normalized stay inside pieces: the tokenizer handles them."""
    added = tokenizer.get_added_tokens_decoder().values()
    return sorted({token.content for token in added if _splits(token)}, key=len, reverse=True)


def _splits(token: Any) -> bool:
    return bool(token.content) and not (
        token.lstrip or token.rstrip or token.single_word or token.normalized
    )


def proven_chunk_boundary(tokenizer: Tokenizer) -> re.Pattern[str] | None:
    """``CHUNK_BOUNDARY`` when the module docstring's proof covers ``tokenizer``: a BPE model
    without dropout, no normalizer or NFC, a known byte-level pre-tokenizer, and every added
    token one the text is split at (none that strips whitespace or is normalized); else None."""
    config = json.loads(tokenizer.to_str())
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") is not None:
        return None
    if not _nfc_or_none(config.get("normalizer")):
        return None
    if not _known_pre_tokenizer(config.get("pre_tokenizer")):
        return None
    if not all(_splits(token) for token in tokenizer.get_added_tokens_decoder().values()):
        return None
    return CHUNK_BOUNDARY


def _nfc_or_none(normalizer: Any) -> bool:
    if normalizer is None:
        return True
    if not isinstance(normalizer, dict):
        return False
    if normalizer.get("type") == "Sequence":
        return all(_nfc_or_none(step) for step in normalizer.get("normalizers") or ())
    return normalizer.get("type") == "NFC"


def _known_pre_tokenizer(pre: Any) -> bool:
    """GPT-2's ``ByteLevel(use_regex=True)``, or ``Split(known regex)`` then a regex-free
    ``ByteLevel``; never with ``add_prefix_space`` (it would add a space to every piece)."""
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "ByteLevel":
        return pre.get("use_regex", True) is True and _no_prefix_space(pre)
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2:
        return False
    split, byte_level = steps
    return (
        isinstance(split, dict)
        and split.get("type") == "Split"
        and (split.get("pattern") or {}).get("Regex") in KNOWN_SPLIT_REGEXES
        and split.get("behavior") == "Isolated"
        and split.get("invert") is False
        and isinstance(byte_level, dict)
        and byte_level.get("type") == "ByteLevel"
        and byte_level.get("use_regex") is False
        and _no_prefix_space(byte_level)
    )


def _no_prefix_space(byte_level: dict[str, Any]) -> bool:
    return byte_level.get("add_prefix_space") is False
