"""The fake engine's shared parts: knobs, records, the role-handler seam, request shapes and
the thread-safe rendezvous primitives. See `testkit/fake_engine.py` for the engine itself and
`testkit/fake_protocols.py` for the per-protocol checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeGuard, TypeVar

import httpx
import msgspec

__all__ = [
    "EOS_TOKEN_ID",
    "FIRST_TOKEN_ID",
    "Admission",
    "Call",
    "EngineContext",
    "EngineError",
    "FakeConfig",
    "Generation",
    "Received",
    "Reply",
    "RoleHandler",
    "RouteRequest",
    "Routes",
    "Shape",
    "Signal",
    "Slot",
    "SlotTable",
    "bad_request",
    "generate",
    "is_int",
    "request_shape",
    "run_all",
    "token_text",
    "wait_ready",
]

K = TypeVar("K", bound=Hashable)

FIRST_TOKEN_ID: Final = 1000  # generation step k emits token id FIRST_TOKEN_ID + k (" tok{k}")
EOS_TOKEN_ID: Final = 2  # the first token with FakeConfig.first_token_eos


@dataclass
class FakeConfig:
    """Runtime knobs; tests may change them while the engine serves."""

    model: str = "fake-model"
    # LoRA adapters served besides it: listed in /v1/models with their ``parent`` (as vLLM and
    # SGLang list them), and taken as a request's model
    adapters: tuple[str, ...] = ()
    serves_embeddings: bool = False  # /v1/embeddings (a generation model does not: 404)
    tokens: int = 16  # output tokens per choice, capped by max_tokens / max_completion_tokens
    token_delay: float = 0.0  # seconds between SSE events
    fail_status: int | None = None  # completions answer this status (an OpenAI error JSON)
    fail_after_events: int | None = None  # streaming: drop the connection after N events
    hang: bool = False  # completions never answer until the client disconnects
    headers_delay: float = 0.0  # sleep before sending the response headers
    kv_timeout: float = 60.0  # how long a KV rendezvous waits
    check_kv: bool = True  # False: validate PD fields but skip the P<->D rendezvous
    default_bootstrap_port: int = 8998  # sglang decode: used when bootstrap_port is null
    max_records: int | None = None  # keep only the newest N records (long benchmark runs)
    # What real engines do that a router must survive (docs/real-engines.md section 5):
    first_token_eos: bool = False  # the first generated token is EOS (unless min_tokens masks it)
    ignore_min_tokens: bool = False  # stop tokens are not masked before min_tokens (old engines)
    die_after_answer: bool = False  # prefill: after a 200 answer, die (ports refuse, KV never sent)
    withhold_kv: bool = False  # prefill: answer, but never hand this request's KV to the decode
    health_status: int = 200  # what /health answers
    # vLLM's --api-key: every /v1/* route answers 401 without `Authorization: Bearer KEY`
    api_key: str | None = None
    health_delay: float = 0.0  # /health answers after this many seconds
    health_delay_under_load: float = 0.0  # ... plus this many while completions are in flight
    sglang_n_hang: bool = True  # sglang decode: n > 1 waits for a KV that never comes (real)
    # usage carries prompt_tokens_details as vLLM >= 0.32 with --enable-prompt-tokens-details:
    # cached_tokens and created_cache_tokens (the prompt tokens the engine computed itself)
    prompt_tokens_details: bool = False
    # decode: uses no KV from the prefill and computes the prompt itself (PD silently did
    # nothing: vLLM's kv_load_failure_policy=recompute, a connector that fell back), as its
    # created_cache_tokens tells
    recompute_prompt: bool = False


@dataclass
class Received:
    """One completions request as the fake saw it."""

    path: str
    headers: dict[str, str]  # lower-cased names
    body: dict[str, Any]
    status: int | None = None  # the status the fake answered (None while in progress)
    disconnected: bool = False  # the client went away before the fake finished
    done: bool = False  # the fake finished handling (answered, failed, or saw a disconnect)
    aborted: bool = False  # fail_after_events dropped the connection mid-stream
    dp_ranks: list[int] = field(default_factory=list)  # DP rank(s) a prefill served


class EngineError(Exception):
    """A request failure; the engine answers it as an OpenAI error JSON with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def bad_request(message: str) -> EngineError:
    return EngineError(400, message)


# --------------------------------------------------------------------------- rendezvous


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Signal:
    """A set-once flag that coroutines on any thread's event loop can await."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._is_set = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def is_set(self) -> bool:
        return self._is_set

    def set(self) -> None:
        with self._lock:
            if self._is_set:
                return
            self._is_set = True
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is already closed
                loop.call_soon_threadsafe(_resolve, future)

    async def wait(self) -> None:
        """Return once set; cancellable."""
        loop = asyncio.get_running_loop()
        waiter = (loop, loop.create_future())
        with self._lock:
            if self._is_set:
                return
            self._waiters.append(waiter)
        try:
            await waiter[1]
        finally:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)


@dataclass
class Slot:
    """One correlation id: `ready` is set once `value` is known."""

    ready: Signal = field(default_factory=Signal)
    value: str = ""


class SlotTable(Generic[K]):
    """Slots keyed by a correlation id; whichever side comes first creates the slot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[K, Slot] = {}

    def get(self, key: K) -> Slot:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = Slot()
            return slot

    def fulfil(self, key: K, value: str = "") -> None:
        slot = self.get(key)
        slot.value = value
        slot.ready.set()

    def pop(self, key: K) -> None:
        with self._lock:
            self._slots.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()

    def __len__(self) -> int:
        return len(self._slots)


async def wait_ready(slot: Slot, timeout: float) -> bool:
    """True when `slot` became ready within `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            await slot.ready.wait()
    except TimeoutError:
        return False
    return True


async def run_all(coros: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run concurrently; the first failure cancels the rest and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            for coro in coros:
                group.create_task(coro)
    except BaseExceptionGroup as failures:
        raise _first_leaf(failures) from None


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


# --------------------------------------------------------------------------- request shape


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _words(text: str) -> int:
    return max(1, len(text.split()))


def prompt_batch(prompt: object) -> int | None:
    """Batch size of a completions `prompt`: None for one prompt (a string or token ids)."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt:
        if all(is_int(token) for token in prompt):
            return None
        if all(isinstance(item, str) for item in prompt) or all(
            isinstance(item, list) and item and all(is_int(t) for t in item) for item in prompt
        ):
            return len(prompt)
    raise bad_request(
        "'prompt' must be a string, a list of token ids, a list of strings "
        "or a list of token-id lists"
    )


def prompt_tokens(prompt: object) -> int:
    """A rough token count of a validated completions prompt (for `usage`)."""
    if isinstance(prompt, str):
        return _words(prompt)
    if not isinstance(prompt, list):
        return 0
    if all(is_int(token) for token in prompt):
        return len(prompt)
    return sum(prompt_tokens(item) for item in prompt)


def _messages_tokens(messages: list[Any]) -> int:
    texts = (str(m.get("content") or "") for m in messages if isinstance(m, dict))
    return sum(_words(text) for text in texts)


def _optional_int(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_int(value) or value < minimum:
        raise bad_request(f"'{key}' must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _optional_bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean, got {value!r}")
    return value


def _token_limit(body: Mapping[str, Any]) -> int | None:
    limits = [
        limit
        for key in ("max_tokens", "max_completion_tokens")
        if (limit := _optional_int(body, key, 0)) is not None
    ]
    return min(limits) if limits else None


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


@dataclass(frozen=True)
class Shape:
    """The OpenAI envelope of one completions request, validated."""

    chat: bool
    batch: int | None  # completions prompt batch size; None for a single prompt
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None  # the smaller of max_tokens and max_completion_tokens
    prompt_tokens: int

    @property
    def choices(self) -> int:
        return (self.batch or 1) * self.n


def request_shape(chat: bool, body: Mapping[str, Any]) -> Shape:
    """Validate prompt/messages, n, stream and token limits; raise a 400 EngineError."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' is required and must be a non-empty list")
        batch, tokens = None, _messages_tokens(messages)
    else:
        if "prompt" not in body:
            raise bad_request("'prompt' is required")
        batch, tokens = prompt_batch(body["prompt"]), prompt_tokens(body["prompt"])
    return Shape(
        chat=chat,
        batch=batch,
        n=_optional_int(body, "n", 1) or 1,
        stream=_optional_bool(body, "stream"),
        include_usage=_include_usage(body),
        max_tokens=_token_limit(body),
        prompt_tokens=tokens,
    )


# --------------------------------------------------------------------------- generation


def token_text(step: int) -> str:
    """The text of generation step `step` (token id ``FIRST_TOKEN_ID + step``)."""
    return f" tok{step}"


@dataclass(frozen=True)
class Generation:
    """The tokens one choice generates, and why it ended (vLLM's semantics)."""

    token_ids: tuple[int, ...]
    texts: tuple[str, ...]  # per token, as the client sees it ("" for a stop token)
    finish_reason: str  # "length" (hit max_tokens) or "stop"
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS
    token_stop: bool = False  # ended on a stop token (EOS or stop_token_ids), not by length

    @property
    def text(self) -> str:
        return "".join(self.texts)


@dataclass(frozen=True)
class _StopRules:
    """The request's stop conditions (vLLM ``SamplingParams``)."""

    token_ids: frozenset[int]
    strings: tuple[str, ...]
    ignore_eos: bool
    min_tokens: int

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> _StopRules:
        ids = body.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(is_int(token) for token in ids):
            raise bad_request(f"'stop_token_ids' must be a list of integers, got {ids!r}")
        stop = body.get("stop") or []
        strings = [stop] if isinstance(stop, str) else stop
        if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
            raise bad_request(f"'stop' must be a string or a list of strings, got {stop!r}")
        min_tokens = body.get("min_tokens") or 0
        return cls(
            token_ids=frozenset(ids),
            strings=tuple(strings),
            ignore_eos=body.get("ignore_eos") is True,
            min_tokens=min_tokens if is_int(min_tokens) else 0,
        )


def _cut_at_stop_string(
    token_ids: list[int], texts: list[str], strings: tuple[str, ...]
) -> Generation | None:
    """vLLM's detokenizer: the text ends before the first stop string (finish "stop")."""
    text = "".join(texts)
    found = [(index, s) for s in strings if (index := text.find(s)) >= 0]
    if not found:
        return None
    end, stop = min(found)
    cut, start = [], 0
    for piece in texts:  # the same tokens, their text clipped at the stop string
        cut.append(text[start : start + len(piece)][: max(end - start, 0)])
        start += len(piece)
    return Generation(tuple(token_ids), tuple(cut), "stop", stop)


def generate(body: Mapping[str, Any], limit: int, capped: bool, config: FakeConfig) -> Generation:
    """The deterministic output of one choice: at most `limit` tokens.

    Step k emits ``FIRST_TOKEN_ID + k`` (text `token_text(k)`), or EOS first with
    `FakeConfig.first_token_eos`. As in vLLM: EOS (unless ``ignore_eos``) and the request's
    ``stop_token_ids`` end the choice with finish "stop" and an empty text for that token
    (``stop_reason`` the id, None for EOS), but not before ``min_tokens`` tokens (vLLM masks
    them); a ``stop`` string ends it with ``stop_reason`` the string, the text cut before it.
    `capped`: `limit` is the request's max_tokens (finish "length" when reached).
    """
    rules = _StopRules.of(body)
    token_ids: list[int] = []
    texts: list[str] = []
    for step in range(limit):
        masked = step < rules.min_tokens and not config.ignore_min_tokens
        eos = step == 0 and config.first_token_eos and not rules.ignore_eos and not masked
        token = EOS_TOKEN_ID if eos else FIRST_TOKEN_ID + step
        token_ids.append(token)
        if eos or (token in rules.token_ids and not masked):
            texts.append("")
            reason = None if eos else token
            return Generation(tuple(token_ids), tuple(texts), "stop", reason, token_stop=True)
        texts.append(token_text(step))
        cut = _cut_at_stop_string(token_ids, texts, rules.strings)
        if cut is not None:
            return cut
    return Generation(tuple(token_ids), tuple(texts), "length" if capped else "stop")


# --------------------------------------------------------------------------- handler seam


@dataclass
class Call:
    """One completions request as a role handler sees it."""

    chat: bool
    body: dict[str, Any]
    headers: dict[str, str]  # lower-cased names
    record: Received
    server: tuple[str, int]  # the host and port the request arrived on
    shape: Shape
    # the stop rules as the engine's request model has them (Responses / Messages: see
    # testkit/fake_formats.py); None: the body itself
    sampling: dict[str, Any] | None = None

    def sampling_body(self) -> Mapping[str, Any]:
        """What `generate` reads the request's stop rules from."""
        return self.body if self.sampling is None else self.sampling


@dataclass(frozen=True)
class Admission:
    """What a handler adds to the answer: vLLM's `kv_transfer_params` and a token cap."""

    echo_kv: bool = False  # put top-level `kv_transfer_params` in a non-stream answer
    kv_transfer_params: dict[str, Any] | None = None
    max_tokens: int | None = None  # a prefill answers with one token


@dataclass(frozen=True)
class RouteRequest:
    """A request to a small non-completions route (bootstrap and fake side channels)."""

    query: dict[str, str]
    body: bytes

    def json(self) -> dict[str, Any]:
        try:
            data = msgspec.json.decode(self.body)
        except msgspec.DecodeError as exc:
            raise bad_request(f"invalid JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request("the JSON body must be an object")
        return data


@dataclass(frozen=True)
class Reply:
    """A route's answer: bytes go out as text/plain, anything else as JSON."""

    status: int
    payload: object


RouteFn = Callable[[RouteRequest], Awaitable[Reply]]
Routes = dict[str, dict[str, RouteFn]]  # path -> method -> handler


class EngineContext(Protocol):
    """What a role handler needs from its FakeEngine."""

    @property
    def config(self) -> FakeConfig: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def engine_id(self) -> str: ...

    @property
    def engine_ids(self) -> list[str]: ...

    def http_client(self) -> httpx.AsyncClient:
        """The engine's client for the current event loop."""
        ...


class RoleHandler:
    """No PD checks: the base of every (protocol, role) handler."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    async def admit(self, call: Call) -> Admission:
        """Check the PD fields of `call`, do the KV rendezvous; raise EngineError on failure."""
        return Admission()

    def routes(self) -> Routes:
        """Extra routes on the engine's HTTP port."""
        return {}

    def bootstrap_routes(self) -> Routes | None:
        """Routes of the bootstrap port; None when this role has none."""
        return None

    def reset(self) -> None:
        """Forget all KV state (engine restart)."""
