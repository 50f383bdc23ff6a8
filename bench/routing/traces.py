"""Deterministic request traces for the routing benchmark (``bench.routing.workload``).

A trace is a list of *sessions*: the requests of one session run one after another (the turns
of a conversation), sessions run concurrently, at most ``concurrency`` at a time, in trace order
(the arrival order). Three shapes, all seeded (the same arguments give the same trace, in any
process: ``random.Random`` seeded with a string hashes it with SHA-512, not ``hash()``):

* ``multi_turn``: conversations grouped under a long shared system prompt; each turn sends the
  whole history so far (system, then user / assistant pairs) plus a new user message, as a chat
  completion; the assistant answers are part of the trace (what the client remembers), so every
  turn's prompt extends the previous turn's prompt;
* ``shared_prefix``: groups of completions that share a long prefix and differ in a short
  unique tail, one request per session, shuffled;
* ``random_prompts``: completions with no reuse at all (the control).

Text is English words drawn from a fixed list; sizes are given in tokens and turned into
characters with ``chars_per_token`` (about 4 for a BPE tokenizer, 1 for the simulated engine's
byte tokens; the benchmark measures it with the engines' tokenizer).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Trace",
    "TraceRequest",
    "multi_turn",
    "random_prompts",
    "sample_text",
    "shared_prefix",
    "standard_traces",
]

Role = Literal["system", "user", "assistant"]

_WORD_LIST = """  # common English words: tokenizers see ~4 chars per token
the of and to in is was that for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which
do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water
than call first who may down side been now find any new work part take get place made live where
after back little only round man year came show every good me give our under name very through
just form sentence great think say help low line differ turn cause much mean before move right
boy old too same tell does set three want air well also play small end put home read hand port
large spell add even land here must big high such follow act why ask men change went light kind
off need house picture try us again animal point mother world near build self earth father head
stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story
saw far sea draw left late run while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those both mark often
letter until mile river car feet care second book carry took science eat room friend began idea
fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose
leave song measure door product black short numeral class wind question happen complete ship
area half rock order fire south problem piece told knew pass since top whole king space heard
best hour better true during hundred five remember step early hold west ground interest reach
fast verb sing listen six table travel less morning ten simple several vowel toward war lay
against pattern slow center love person money serve appear road map rain rule govern pull cold
notice voice unit power town fine certain fly fall lead cry dark machine note wait plan figure
star box noun field rest correct able pound done beauty drive stood contain front teach week
final gave green oh quick develop ocean warm free minute strong special mind behind clear tail
produce fact street inch multiply nothing course stay wheel full force blue object decide
surface deep moon island foot system busy test record boat common gold possible plane stead dry
wonder laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring yes
distant fill east paint language among
"""
_WORDS = tuple(_WORD_LIST.split())


def sample_text(rng: random.Random, tokens: int, chars_per_token: float) -> str:
    """About ``tokens`` tokens of sentences: words until ``tokens * chars_per_token`` chars."""
    want = max(1, math.ceil(tokens * chars_per_token))
    words: list[str] = []
    size = 0
    while size < want:
        word = rng.choice(_WORDS)
        if rng.random() < 0.08:
            word += "."
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: a chat completion (``messages``) or a completion (``prompt``)."""

    messages: tuple[tuple[Role, str], ...] = ()
    prompt: str = ""
    max_tokens: int = 16

    @property
    def chat(self) -> bool:
        return bool(self.messages)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        """The streaming OpenAI request body."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "stream": True}
        if self.chat:
            body["messages"] = [{"role": role, "content": text} for role, text in self.messages]
        else:
            body["prompt"] = self.prompt
        return body

    def text(self) -> str:
        """The prompt as one string (a chat's messages one per line), for sizing."""
        if not self.chat:
            return self.prompt
        return "".join(f"{role}: {text}\n" for role, text in self.messages)


@dataclass(frozen=True, slots=True)
class Trace:
    """Sessions of requests; a session's requests are sequential, sessions concurrent."""

    name: str
    description: str
    sessions: tuple[tuple[TraceRequest, ...], ...]
    concurrency: int

    @property
    def requests(self) -> int:
        return sum(len(session) for session in self.sessions)

    def max_prompt_chars(self) -> int:
        return max((len(r.text()) for s in self.sessions for r in s), default=0)

    def working_set_chars(self, block_chars: int = 64) -> int:
        """Distinct prompt characters over the whole trace, counted as a prefix cache does:
        chained hashes of ``block_chars``-sized blocks (a shared prefix counts once)."""
        seen: set[bytes] = set()
        for session in self.sessions:
            for request in session:
                text = request.text().encode()
                parent = b""
                for start in range(0, len(text), block_chars):
                    parent = hashlib.blake2b(parent + text[start : start + block_chars]).digest()
                    seen.add(parent)
        return len(seen) * block_chars


def multi_turn(
    *,
    conversations: int = 32,
    turns: int = 6,
    groups: int = 8,
    system_tokens: int = 1000,
    user_tokens: int = 80,
    answer_tokens: int = 400,
    max_tokens: int = 8,
    concurrency: int = 8,
    chars_per_token: float = 4.0,
    seed: int = 0,
) -> Trace:
    """Chats: conversation ``c`` uses system prompt ``c % groups``; turn ``t`` sends the history
    of turns 1..t-1 (user message and its answer) and a new user message."""
    rng = random.Random(f"multi_turn:{seed}")
    systems = [sample_text(rng, system_tokens, chars_per_token) for _ in range(groups)]
    sessions: list[tuple[TraceRequest, ...]] = []
    for conversation in range(conversations):
        history: list[tuple[Role, str]] = [("system", systems[conversation % groups])]
        requests = []
        for _ in range(turns):
            history.append(("user", sample_text(rng, user_tokens, chars_per_token)))
            requests.append(TraceRequest(messages=tuple(history), max_tokens=max_tokens))
            history.append(("assistant", sample_text(rng, answer_tokens, chars_per_token)))
        sessions.append(tuple(requests))
    description = (
        f"{conversations} conversations x {turns} turns, system prompt ~{system_tokens} tok "
        f"shared by {groups} groups, +{user_tokens} user +{answer_tokens} answer tok per turn"
    )
    return Trace("multi_turn", description, tuple(sessions), concurrency)


def shared_prefix(
    *,
    groups: int = 16,
    per_group: int = 16,
    prefix_tokens: int = 2000,
    tail_tokens: int = 100,
    max_tokens: int = 8,
    concurrency: int = 8,
    chars_per_token: float = 4.0,
    seed: int = 0,
) -> Trace:
    """Completions: ``groups`` prefixes, ``per_group`` unique tails each, shuffled arrival."""
    rng = random.Random(f"shared_prefix:{seed}")
    prefixes = [sample_text(rng, prefix_tokens, chars_per_token) for _ in range(groups)]
    requests = [
        TraceRequest(
            prompt=f"{prefix} {sample_text(rng, tail_tokens, chars_per_token)}",
            max_tokens=max_tokens,
        )
        for prefix in prefixes
        for _ in range(per_group)
    ]
    rng.shuffle(requests)
    description = (
        f"{groups} groups x {per_group} prompts, ~{prefix_tokens} tok shared prefix "
        f"+ ~{tail_tokens} tok unique tail, shuffled"
    )
    return Trace("shared_prefix", description, tuple((r,) for r in requests), concurrency)


def random_prompts(
    *,
    count: int = 128,
    tokens: int = 1024,
    max_tokens: int = 8,
    concurrency: int = 8,
    chars_per_token: float = 4.0,
    seed: int = 0,
) -> Trace:
    """Completions with nothing shared (the control)."""
    rng = random.Random(f"random:{seed}")
    requests = [
        TraceRequest(prompt=sample_text(rng, tokens, chars_per_token), max_tokens=max_tokens)
        for _ in range(count)
    ]
    description = f"{count} unrelated prompts of ~{tokens} tok"
    return Trace("random", description, tuple((r,) for r in requests), concurrency)


def standard_traces(
    *, quick: bool = False, chars_per_token: float = 4.0, seed: int = 0, concurrency: int = 8
) -> tuple[Trace, ...]:
    """The benchmark's three traces, full size or ``quick`` (smaller, same shapes)."""
    cpt, c = chars_per_token, concurrency
    if quick:
        return (
            multi_turn(
                conversations=16, turns=5, groups=4, chars_per_token=cpt, concurrency=c, seed=seed
            ),
            shared_prefix(groups=12, per_group=8, chars_per_token=cpt, concurrency=c, seed=seed),
            random_prompts(count=48, chars_per_token=cpt, concurrency=c, seed=seed),
        )
    return (
        multi_turn(chars_per_token=cpt, concurrency=c, seed=seed),
        shared_prefix(chars_per_token=cpt, concurrency=c, seed=seed),
        random_prompts(chars_per_token=cpt, concurrency=c, seed=seed),
    )
