"""Conformance of pd-router with real SGLang 0.5.23 prefill/decode engines (CPU, Mooncake TCP).

One prefill, one decode and one co-located reference engine (no disaggregation) serve the same
tiny random-weight model (``tiny_model``); the router runs as a subprocess in front of the PD
pair. Greedy decoding of fixed weights is deterministic, so PD output through the router must
equal the co-located engine's, byte for byte.

The engines are module-scoped (they take 20-60 s to start on 2 shared cores). The prefill-death
test kills the prefill, so it is the last test of this module.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.real_engines.conversation_client import check_conversation_matches
from tests.real_engines.openai_client import check_tokenize_passes_through
from tests.real_engines.sglang_engines import (
    Engine,
    Role,
    Router,
    busy,
    labelled,
    retry,
    router_process,
    scrape,
    sglang_engines,
    wait_idle,
)

pytestmark = pytest.mark.real_engine

PROMPTS = [
    "Permission is hereby granted, free of charge, to any person obtaining a copy",
    "The licenses for most software are designed to take away your freedom",
    "def parse(self, text):\n    return",
]
MAX_TOKENS = 12
REQUEST_TIMEOUT_S = 30.0  # per read; a hung PD leg fails the test instead of the suite
IDLE_TIMEOUT_S = 15.0
WARMUP_ATTEMPTS = 5
ENDPOINTS = ["completions", "chat"]


def timeout(seconds: float) -> pytest.MarkDecorator:
    """pytest-timeout on the test body only: the module's engines take 20-240 s to start (CPU
    shared with other suites), which ``sglang_engines`` bounds itself."""
    return pytest.mark.timeout(seconds, func_only=True)


# --- a small OpenAI client that keeps choices apart (n > 1, batched prompts) -----------------


@dataclass
class Answer:
    status: int
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> text
    finish: dict[int, str | None] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    body: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    done_count: int = 0  # ``data: [DONE]`` lines seen
    error: Any = None
    elapsed_s: float = 0.0

    @property
    def outcome(self) -> dict[int, tuple[str, str | None]]:
        """What two engines must agree on: each choice's text and finish_reason."""
        return {i: (text, self.finish.get(i)) for i, text in sorted(self.texts.items())}


def body_for(endpoint: str, prompt: str | list[str], stream: bool, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }
    if endpoint == "chat":
        assert isinstance(prompt, str)
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body | params


def choice_text(choice: dict[str, Any]) -> str:
    """A choice's text in any of the four shapes (completion / chat, whole / delta)."""
    if "text" in choice:
        return str(choice["text"] or "")
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "")


def _add_choices(answer: Answer, choices: list[dict[str, Any]]) -> None:
    for choice in choices:
        index = int(choice["index"])
        answer.texts[index] = answer.texts.get(index, "") + choice_text(choice)
        if choice.get("finish_reason") is not None or index not in answer.finish:
            answer.finish[index] = choice.get("finish_reason")


def ask(
    base_url: str,
    endpoint: str,
    body: dict[str, Any],
    timeout: float = REQUEST_TIMEOUT_S,
    on_event: Callable[[Answer], bool] | None = None,
) -> Answer:
    """POST one request and read it all; ``on_event`` returning False stops reading (the client
    walks away mid-stream: the connection is closed)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    started = time.monotonic()
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream("POST", base_url + path, json=body) as response,
    ):
        answer = Answer(status=response.status_code)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    answer.done_count += 1
                    continue
                event = json.loads(data)
                answer.events.append(event)
                if "error" in event:
                    answer.error = event["error"]
                _add_choices(answer, event.get("choices") or [])
                answer.usage = event.get("usage") or answer.usage
                if on_event is not None and not on_event(answer):
                    break
        else:
            response.read()
            answer.body = response.json()
            answer.error = answer.body.get("error")
            _add_choices(answer, answer.body.get("choices") or [])
            answer.usage = answer.body.get("usage")
    answer.elapsed_s = time.monotonic() - started
    return answer


# --- fixtures --------------------------------------------------------------------------------


@dataclass
class Cluster:
    prefill: Engine
    decode: Engine
    colocated: Engine
    router: Router
    log_dir: Path

    def describe(self) -> str:
        engines = (self.prefill, self.decode, self.colocated)
        router = (
            f"--- router {self.router.url}, {self.router.log_path} ---\n{self.router.log_tail()}"
        )
        return "\n".join([*(engine.describe() for engine in engines), router])


# Fast health probing (SGLang's /health runs a 1-token fake-transfer generation, ~1 s), and a
# bound on how long the decode leg may wait for its KV (used by the prefill-death test).
ROUTER_FLAGS = [
    "--health-interval", "1",
    "--kv-arrival-timeout", "10",
    "--health-unhealthy-threshold", "3",
    "--health-healthy-threshold", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("sglang-logs")
    roles: tuple[Role, ...] = ("prefill", "decode", "colocated")
    with contextlib.ExitStack() as stack:
        prefill, decode, colocated = stack.enter_context(sglang_engines(tiny_model, roles, log_dir))
        router = stack.enter_context(router_process(prefill, decode, log_dir, ROUTER_FLAGS))
        cluster = Cluster(prefill, decode, colocated, router, log_dir)
        warm_up(cluster)
        yield cluster


def warm_up(cluster: Cluster) -> None:
    """A fresh pair's first Mooncake transfers can stall or fail: retry one PD request (bounded)
    before any test asserts on it."""

    def one() -> bool:
        try:
            body = body_for("completions", "warm up", stream=False, max_tokens=2)
            return ask(cluster.router.url, "completions", body, timeout=60).status == 200
        except httpx.HTTPError:
            return False

    try:
        retry("PD warm-up through the router", WARMUP_ATTEMPTS, one)
    except AssertionError:
        print(cluster.describe())
        raise


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """On a failed test, print the engines' and router's log tails (shown with the failure)."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before and "cluster" in request.fixturenames:
        print(request.getfixturevalue("cluster").describe())


def reference(cluster: Cluster, endpoint: str, prompt: str | list[str], **params: Any) -> Answer:
    """The co-located engine's (non-stream) answer."""
    answer = ask(cluster.colocated.url, endpoint, body_for(endpoint, prompt, False, **params))
    assert answer.status == 200, answer.body
    return answer


# --- 1. PD output equals the co-located engine's ---------------------------------------------


@timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_pd_output_equals_colocated(cluster: Cluster, endpoint: str, stream: bool) -> None:
    for prompt in PROMPTS:
        expected = reference(cluster, endpoint, prompt)
        got = ask(cluster.router.url, endpoint, body_for(endpoint, prompt, stream))
        assert got.status == 200, got.body
        assert got.error is None
        assert got.outcome == expected.outcome, prompt
        assert got.texts[0], "an empty answer proves nothing"
        if stream:
            assert got.done_count == 1


@timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_batched_prompt_list(cluster: Cluster, stream: bool) -> None:
    """A prompt list on /v1/completions: one choice per prompt, in order, as co-located."""
    expected = reference(cluster, "completions", PROMPTS)
    got = ask(cluster.router.url, "completions", body_for("completions", PROMPTS, stream))
    assert got.status == 200, got.body
    assert sorted(got.texts) == list(range(len(PROMPTS)))
    assert got.outcome == expected.outcome


@timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_responses_and_messages_equal_colocated(
    cluster: Cluster, endpoint: str, stream: bool
) -> None:
    """``/v1/responses`` and ``/v1/messages`` through PD (both legs with the bootstrap room)
    answer as the co-located engine does."""
    check_conversation_matches(
        cluster.router.url,
        cluster.colocated.url,
        endpoint,
        PROMPTS[1],
        stream=stream,
        tokens=MAX_TOKENS,
    )


@timeout(60)
def test_tokenize_and_detokenize_pass_through(cluster: Cluster) -> None:
    """``/tokenize`` and ``/detokenize`` through the router answer as the engine does."""
    check_tokenize_passes_through(cluster.router.url, cluster.colocated.url, PROMPTS[0], "text")


# --- 2. the decode used the transferred KV ---------------------------------------------------


@timeout(60)
def test_decode_used_transferred_kv(cluster: Cluster) -> None:
    """The decode generated from KV computed by the prefill and moved by Mooncake, not from a
    prefill of its own.

    Signals (SGLang ``--enable-metrics`` and logs), strongest first:

    * the prefill's ``sglang:kv_transfer_total_mb`` histogram (observed by the Mooncake sender
      once per finished transfer) counts one more transfer per PD request, of non-zero size;
    * the decode ran no prefill forward: SGLang logs a ``Prefill batch`` line and adds
      ``sglang:realtime_tokens_total{mode="prefill_compute"}`` for every prefill/extend batch it
      runs, in every mode (the co-located engine shows both), and the decode has neither, while
      its ``sglang:generation_tokens_total`` grows;
    * with both, the decode's output equalling the co-located engine's (test 1) means it
      decoded from the transferred KV: without it, it had no prompt KV to decode from.

    (The prefill's own ``/health`` probes run 1-token prefills with SGLang's fake transfer
    backend, which moves nothing and records no transfer, so they do not blur the count.)
    """
    prompts = [f"{prompt} (kv check {i})" for i, prompt in enumerate(PROMPTS)]
    prefill_before, decode_before = scrape(cluster.prefill), scrape(cluster.decode)
    for prompt in prompts:
        got = ask(cluster.router.url, "completions", body_for("completions", prompt, False))
        assert got.status == 200, got.body
    wait_idle([cluster.prefill, cluster.decode], IDLE_TIMEOUT_S)
    prefill_after, decode_after = scrape(cluster.prefill), scrape(cluster.decode)

    def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    transfers = delta(prefill_before, prefill_after, "sglang:kv_transfer_total_mb_count")
    megabytes = delta(prefill_before, prefill_after, "sglang:kv_transfer_total_mb_sum")
    assert transfers == len(prompts)
    assert megabytes > 0
    assert delta(decode_before, decode_after, "sglang:generation_tokens_total") > 0

    def prefill_compute(metrics: dict[str, float]) -> float:
        return labelled(metrics, "sglang:realtime_tokens_total", mode="prefill_compute")

    assert prefill_compute(decode_after) == 0
    assert prefill_compute(prefill_after) > prefill_compute(prefill_before)
    assert "Prefill batch" not in cluster.decode.log_text()
    assert "Prefill batch" in cluster.colocated.log_text()  # the signal exists in this build


# --- 3. idle again after requests ------------------------------------------------------------


def router_inflight(router: Router) -> list[int]:
    body = httpx.get(router.url + "/ready", timeout=5).json()
    return [int(worker["inflight"]) for role in ("prefill", "decode") for worker in body[role]]


@timeout(90)
def test_engines_idle_after_requests(cluster: Cluster) -> None:
    """After a mix of requests, both engines hold no running, waiting or PD-queued request
    (``/v1/loads``), and the router counts nothing in flight."""
    for endpoint in ENDPOINTS:
        for stream in (False, True):
            got = ask(cluster.router.url, endpoint, body_for(endpoint, PROMPTS[0], stream))
            assert got.status == 200, got.body
    wait_idle([cluster.prefill, cluster.decode], IDLE_TIMEOUT_S)
    assert router_inflight(cluster.router) == [0, 0]


# --- 4. client abort mid-stream --------------------------------------------------------------


@timeout(90)
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_client_abort_mid_stream_frees_engines(cluster: Cluster, endpoint: str) -> None:
    """The client walks away after a few events of a long stream: the router closes the decode
    leg, SGLang aborts the request, and both engines are idle again within IDLE_TIMEOUT_S."""
    seen_busy: list[dict[str, float]] = []

    def walk_away(answer: Answer) -> bool:
        # count token events only: a chat stream opens with a role-only event
        tokens = [e for e in answer.events for c in e.get("choices") or [] if choice_text(c)]
        if len(tokens) < 3:
            return True
        # the request really was in flight (running, or in a PD queue: /v1/loads lags ~0.5 s)
        seen_busy.append(busy(cluster.decode))
        return False

    body = body_for(endpoint, PROMPTS[1], True, max_tokens=400, ignore_eos=True)
    got = ask(cluster.router.url, endpoint, body, on_event=walk_away)
    assert got.status == 200 and got.done_count == 0
    assert seen_busy and seen_busy[0], "the decode held no request when the client left"
    took = wait_idle([cluster.prefill, cluster.decode], IDLE_TIMEOUT_S)
    print(f"idle {took:.1f}s after the client left")
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while router_inflight(cluster.router) != [0, 0]:
        assert time.monotonic() < deadline, "router still counts the aborted request"
        time.sleep(0.1)


# --- 6. n > 1 (split by the router into single-sequence PD requests) --------------------------


@timeout(90)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n2_greedy_equals_colocated(cluster: Cluster, endpoint: str, stream: bool) -> None:
    """``n: 2`` hangs on SGLang PD engines when sent as is (the engine's n > 1 prefix warm-up
    reuses the bootstrap room, the decode waits for a transfer that never comes); the router
    splits it. Greedy: both choices equal the co-located n=1 answer; usage sums completion
    tokens and counts the prompt once; a stream tags events with their choice and ends once."""
    prompt = PROMPTS[2]
    expected = reference(cluster, endpoint, prompt)
    params: dict[str, Any] = {"n": 2}
    if stream:
        params["stream_options"] = {"include_usage": True}
    got = ask(cluster.router.url, endpoint, body_for(endpoint, prompt, stream, **params))
    assert got.status == 200, got.body
    assert got.error is None
    assert got.outcome == {0: expected.outcome[0], 1: expected.outcome[0]}
    assert expected.usage is not None and got.usage is not None, got.events[-2:]
    assert got.usage["prompt_tokens"] == expected.usage["prompt_tokens"]
    assert got.usage["completion_tokens"] == 2 * expected.usage["completion_tokens"]
    if stream:
        assert got.done_count == 1
        indices = {c["index"] for e in got.events for c in e.get("choices") or []}
        assert indices == {0, 1}


@timeout(90)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n2_sampled_has_two_choices(cluster: Cluster, endpoint: str, stream: bool) -> None:
    body = body_for(endpoint, PROMPTS[0], stream, n=2, temperature=0.8, seed=7)
    got = ask(cluster.router.url, endpoint, body)
    assert got.status == 200, got.body
    assert got.error is None
    assert sorted(got.texts) == [0, 1]
    assert all(got.texts.values())
    assert got.elapsed_s < REQUEST_TIMEOUT_S
    if stream:
        assert got.done_count == 1


# --- 5. prefill killed while the decode waits for its KV (kills prefills: keep last) ----------


def holds_request(engine: Engine, queue: str, deadline: float, hold_s: float = 1.0) -> None:
    """Until ``engine`` holds a request in ``queue`` (a ``busy`` key) for ``hold_s``: ours, stuck
    there because its peer is stopped (SGLang's own ``/health`` requests use the fake transfer
    backend and pass the PD queues at once)."""
    since: float | None = None
    while True:
        now = time.monotonic()
        if busy(engine).get(queue, 0) >= 1:
            since = now if since is None else since
            if now - since >= hold_s:
                return
        else:
            since = None
        assert now < deadline, f"no request held in the {engine.role}'s {queue}"
        time.sleep(0.1)


@contextlib.contextmanager
def live_prefill(cluster: Cluster, model: Path) -> Iterator[Engine]:
    """The shared prefill, or (once a previous test killed it) a fresh one: still at most three
    engines at a time."""
    if cluster.prefill.alive():
        yield cluster.prefill
        return
    with sglang_engines(model, ["prefill"], cluster.log_dir) as (prefill,):
        yield prefill


# Which engine is stopped while the request is placed, and where the request then waits.
STOPPED = {
    # the decode cannot ask for the KV: the request waits in the prefill's bootstrap queue
    "decode": ("prefill", "prefill_bootstrap_queue_reqs[0]"),
    # the prefill cannot serve the KV: the request waits in the decode's PD queues
    "prefill": ("decode", "num_waiting_reqs[0]"),
}


@timeout(240)
@pytest.mark.parametrize("stopped", list(STOPPED))
def test_prefill_killed_while_decode_waits(
    cluster: Cluster, tiny_model: Path, stopped: str
) -> None:
    """The prefill is SIGKILLed (its whole process group) while the request's KV is not yet in
    the decode. Made deterministic by SIGSTOPping one engine while the request is placed:

    * ``decode``: the decode cannot fetch, so the request waits in the prefill's bootstrap queue;
      the prefill is killed, then the decode resumes;
    * ``prefill``: the prefill cannot serve, so the decode holds the request, waiting for the
      KV (bootstrap/pre-allocation queues); the prefill is killed while stopped.

    The client must get an OpenAI error (502/503/504 JSON, or a final SSE error event) within
    30 s of the kill (router ``--kv-arrival-timeout 10 --health-interval 1``), and the decode must
    not keep a slot for KV that will never come: idle again within 30 s.
    """
    waiter_role, queue = STOPPED[stopped]
    with (
        live_prefill(cluster, tiny_model) as prefill,
        router_process(prefill, cluster.decode, cluster.log_dir, ROUTER_FLAGS) as router,
    ):
        stopped_engine = cluster.decode if stopped == "decode" else prefill
        waiter = prefill if waiter_role == "prefill" else cluster.decode
        result: list[tuple[float, Answer | BaseException]] = []
        body = body_for("completions", f"{PROMPTS[0]} ({stopped} stopped)", True, max_tokens=50)

        def client() -> None:
            try:
                answer: Answer | BaseException = ask(router.url, "completions", body, timeout=60)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                answer = exc
            result.append((time.monotonic(), answer))

        stopped_engine.signal_group(signal.SIGSTOP)
        try:
            thread = threading.Thread(target=client, daemon=True)
            thread.start()
            holds_request(waiter, queue, deadline=time.monotonic() + 20)
            prefill.signal_group(signal.SIGKILL)
            killed = time.monotonic()
            prefill.process.wait(timeout=10)
        finally:
            stopped_engine.signal_group(signal.SIGCONT)
        thread.join(timeout=45)
        assert not thread.is_alive(), f"no answer 45 s after the prefill died\n{router.log_tail()}"
        answered, answer = result[0]
        assert isinstance(answer, Answer), answer
        after_kill = answered - killed
        print(f"client answered {after_kill:.1f}s after the kill: {answer.status} {answer.error}")
        if answer.status == 200:  # the stream had started: the error is its final event
            assert answer.error is not None and answer.events[-1].get("error"), answer.events
        else:
            assert answer.status in (502, 503, 504), (answer.status, answer.body)
            assert isinstance(answer.body.get("error"), dict), answer.body
        assert after_kill < 30
        took = wait_idle([cluster.decode], 30)
        print(f"decode idle {took:.1f}s after the client's answer")
