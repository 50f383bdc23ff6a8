"""Real vLLM 0.32 (CPU) prefill and decode engines behind the router, MooncakeConnector and
NixlConnector, compared with a co-located engine serving the same tiny model.

Engines take 40-130 s to start, so they start once: the co-located reference for the module,
each P/D pair for its class (at most three engines run at once). The Mooncake class ends with the
tests that kill its prefill. Every test bounds its own run time (``func_only``: the fixtures have
their own deadlines, engine start included).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.real_engines.conversation_client import check_conversation_matches
from tests.real_engines.openai_client import (
    Answer,
    call,
    check_tokenize_passes_through,
    endpoint_path,
    request_body,
)
from tests.real_engines.vllm_engines import (
    Engine,
    Role,
    Router,
    kill,
    launch,
    metric,
    poll,
    queue_lengths,
    report_logs,
    run_router,
    stop,
    wait_healthy,
    warm_up,
)

pytestmark = pytest.mark.real_engine

PROMPTS = (
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived",
    "def main():\n    return",
)
ENDPOINTS = ("completions", "chat")
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
SHORT = 16  # tokens per conformance answer
LONG = 400  # tokens of a "long" answer (the decode makes ~300 tokens/s here: ~1.3 s)
IDLE_TIMEOUT_S = 30.0
KV_ARRIVAL_TIMEOUT_S = 10
NIXL_KV_ARRIVAL_TIMEOUT_S = 120  # NIXL pulls take up to ~40 s here; a loaded CI machine, more
NIXL_HEALTH_TIMEOUT_S = 60  # a NIXL decode's API server can stall ~30 s mid-pull here


def timeout(seconds: float) -> pytest.MarkDecorator:
    """The test function's own time limit; fixtures (engine start) keep their own deadlines."""
    return pytest.mark.timeout(seconds, func_only=True)


# --- engines ---------------------------------------------------------------------------------


@dataclass
class Fleet:
    """This module's engines by name: launched early (in parallel), stopped by whoever is done
    with them, and all stopped at module teardown."""

    model: Path
    log_dir: Path
    engines: dict[str, Engine] = field(default_factory=dict)

    def launch(self, name: str, role: Role) -> Engine:
        if name not in self.engines:
            self.engines[name] = launch(self.model, role, name, self.log_dir)
        return self.engines[name]

    def stop(self, name: str) -> None:
        engine = self.engines.pop(name, None)
        if engine is not None:
            stop(engine)

    def stop_all(self) -> None:
        for name in list(self.engines):
            self.stop(name)


def selected(session: pytest.Session, class_name: str) -> bool:
    """Whether this run selected any test of ``class_name`` (``-k`` may have left it out)."""
    return any(
        getattr(getattr(item, "cls", None), "__name__", None) == class_name
        for item in session.items
    )


@pytest.fixture(scope="module")
def fleet(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Fleet]:
    """Starts the reference engine and the first P/D pair this run needs, all at once (at
    most three engines run at a time)."""
    fleet = Fleet(tiny_model, tmp_path_factory.mktemp("vllm-logs"))
    failed_before = request.session.testsfailed
    fleet.launch("colocated", Role.COLOCATED)
    if selected(request.session, "TestMooncake"):
        fleet.launch("mooncake-prefill", Role.MOONCAKE_PREFILL)
        fleet.launch("mooncake-decode", Role.MOONCAKE_DECODE)
    elif selected(request.session, "TestNixl"):  # otherwise it starts after the Mooncake pair
        fleet.launch("nixl-prefill", Role.NIXL)
        fleet.launch("nixl-decode", Role.NIXL)
    try:
        yield fleet
    finally:
        if request.session.testsfailed > failed_before:
            report_logs(request, fleet.log_dir)
        fleet.stop_all()


@pytest.fixture(scope="module")
def colocated(fleet: Fleet) -> Engine:
    engine = fleet.engines["colocated"]
    wait_healthy([engine])
    return engine


@dataclass(frozen=True, eq=False)  # hashed by identity: its answers are cached per instance
class Reference:
    """The co-located engine's answers to the conformance requests."""

    engine: Engine

    @cache  # noqa: B019 - one per module (the fixture below), kept while the module runs
    def __call__(self, endpoint: str, prompt: str, stream: bool) -> Answer:
        """Its answer, asked once per request."""
        return self.fresh(endpoint, prompt, stream)

    def fresh(self, endpoint: str, prompt: str, stream: bool) -> Answer:
        """Its answer, asked now."""
        body = request_body(endpoint, prompt, stream=stream, max_tokens=SHORT)
        got = call(self.engine.url, endpoint, body)
        assert got.status == 200, got.body
        return got


@pytest.fixture(scope="module")
def expected(colocated: Engine) -> Reference:
    return Reference(colocated)


@dataclass
class Cluster:
    """A P/D pair behind a router."""

    prefill: Engine
    decode: Engine
    router: Router
    kind: str

    @property
    def engines(self) -> tuple[Engine, Engine]:
        return self.prefill, self.decode


@contextlib.contextmanager
def pd_cluster(
    fleet: Fleet,
    kind: str,
    prefill: tuple[str, Role],
    decode: tuple[str, Role],
    router_extra: tuple[str, ...] = (),
) -> Iterator[Cluster]:
    """Start (or adopt already launched) engines, wait for them, put a warmed-up router in
    front; stop the pair afterwards, whatever the tests did to it."""
    engines = fleet.launch(*prefill), fleet.launch(*decode)
    try:
        wait_healthy(engines)
        log = fleet.log_dir / f"router-{kind}.log"
        with run_router(kind, *engines, log, router_extra) as router:
            warm_up(router)
            yield Cluster(*engines, router, kind)
    finally:
        fleet.stop(prefill[0])
        fleet.stop(decode[0])


@pytest.fixture(scope="class")
def mooncake(fleet: Fleet) -> Iterator[Cluster]:
    with pd_cluster(
        fleet,
        "vllm-mooncake",
        ("mooncake-prefill", Role.MOONCAKE_PREFILL),
        ("mooncake-decode", Role.MOONCAKE_DECODE),
    ) as cluster:
        yield cluster


@pytest.fixture(scope="class")
def nixl(fleet: Fleet) -> Iterator[Cluster]:
    # NIXL's pull takes 2-40 s per request on this CPU machine (vLLM pins both engines' NIXL
    # workers to one core), past the router's 30 s production default for the KV's arrival;
    # meanwhile the decode's API server may not answer at all for ~30 s (seen in CI), which
    # the default 2 s health probes take for a dead decode.
    with pd_cluster(
        fleet,
        "vllm-nixl",
        ("nixl-prefill", Role.NIXL),
        ("nixl-decode", Role.NIXL),
        router_extra=(
            *("--kv-arrival-timeout", str(NIXL_KV_ARRIVAL_TIMEOUT_S)),
            *("--health-timeout", str(NIXL_HEALTH_TIMEOUT_S)),
        ),
    ) as cluster:
        yield cluster


# --- checks shared by both connectors ----------------------------------------------------------


def check_matches_colocated(
    cluster: Cluster,
    expected: Reference,
    endpoint: str,
    stream: bool,
    prompts: tuple[str, ...],
) -> None:
    """Greedy output through the router equals the co-located engine's (text, finish_reason).
    A mismatch is asked once more, both sides afresh, as ``check_conversation_matches`` does: a
    greedy pick can flip on a near tie between two processes' float sums."""
    for prompt in prompts:
        body = request_body(endpoint, prompt, stream=stream, max_tokens=SHORT)
        want = expected(endpoint, prompt, stream)
        mismatches: list[tuple[Any, Any]] = []  # (router's, engine's) outcome, per try
        for again in (False, True):
            if again:
                want = expected.fresh(endpoint, prompt, stream)
            got = call(cluster.router.url, endpoint, body)
            assert got.status == 200, (got.body, got.error)
            assert got.error is None, got.error
            assert got.done == stream, "a stream must end with data: [DONE]"
            if got.outcome == want.outcome:
                break
            mismatches.append((got.outcome, want.outcome))
        assert got.outcome == want.outcome, (prompt, mismatches)


def check_prompt_came_over_transfer(cluster: Cluster, prompt: str) -> None:
    """The decode computed none of the prompt: every prompt token arrived by KV transfer."""
    before = cluster.decode.metrics()
    body = request_body("completions", prompt, stream=False, max_tokens=4)
    got = call(cluster.router.url, "completions", body)
    assert got.status == 200, got.body
    after = cluster.decode.metrics()

    def grew(source: str) -> float:
        name = "vllm:prompt_tokens_by_source_total"
        return metric(after, name, source=source) - metric(before, name, source=source)

    assert grew("external_kv_transfer") == got.body["usage"]["prompt_tokens"]
    assert grew("local_compute") == 0
    # what the router's recompute check reads (--enable-prompt-tokens-details): a completions
    # answer has cached_tokens only (Mooncake: the decode's own count, every token received;
    # NIXL: the prefill's cache hits), a chat answer also created_cache_tokens (computed here)
    details = got.body["usage"]["prompt_tokens_details"]
    if cluster.kind == "vllm-mooncake":
        assert details["cached_tokens"] == got.body["usage"]["prompt_tokens"], details
    chat = call(
        cluster.router.url, "chat", request_body("chat", prompt, stream=False, max_tokens=4)
    )
    assert chat.status == 200, chat.body
    assert chat.body["usage"]["prompt_tokens_details"]["created_cache_tokens"] == 0, chat.body
    # the router says where each went, and does not claim the decode recomputed the prompt
    assert got.headers["x-pdr-prefill"] == cluster.prefill.url
    assert got.headers["x-pdr-decode"] == cluster.decode.url
    router_metrics = httpx.get(f"{cluster.router.url}/metrics", timeout=10).text
    pair = {"prefill": cluster.prefill.url, "decode": cluster.decode.url}
    assert metric(router_metrics, "pdr_pd_requests_total", **pair) >= 2
    assert metric(router_metrics, "pdr_pd_recompute_total", **pair) == 0


def wait_idle(*engines: Engine, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Each engine's running and waiting gauges return to 0 (nothing left holding a slot)."""
    seen: dict[str, tuple[float, float]] = {}

    def idle() -> bool:
        seen.update({engine.name: queue_lengths(engine) for engine in engines})
        return all(lengths == (0, 0) for lengths in seen.values())

    try:
        poll(idle, timeout_s, "engines idle")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; (running, waiting) last seen: {seen}") from None


# --- helpers of the Mooncake failure tests -----------------------------------------------------


def first_token_id(engine: Engine, prompt: str) -> int:
    """The id of the token greedy decoding generates first for ``prompt`` (completions)."""
    body = request_body(
        "completions",
        prompt,
        stream=False,
        max_tokens=1,
        logprobs=1,
        return_tokens_as_token_ids=True,
    )
    got = call(engine.url, "completions", body)
    assert got.status == 200, got.body
    token = got.body["choices"][0]["logprobs"]["tokens"][0]  # "token_id:712"
    return int(token.removeprefix("token_id:"))


def counter(engine: Engine, name: str, **labels: str) -> float:
    return metric(engine.metrics(), name, **labels)


def decode_inflight(router: Router) -> int:
    """The router's own in-flight count for its decode workers (``/ready`` body)."""
    workers = httpx.get(f"{router.url}/ready", timeout=5).json()["decode"]
    return sum(int(worker["inflight"]) for worker in workers)


class Background:
    """A request running on a thread, so that the test can act while it is in flight."""

    def __init__(self, name: str, target: Callable[[], Answer]) -> None:
        self.answer: Answer | None = None
        self.failure: BaseException | None = None
        self.ended_at: float | None = None
        self._target = target
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.answer = self._target()
        except BaseException as exc:  # noqa: BLE001 - kept for the test to report
            self.failure = exc
        self.ended_at = time.monotonic()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s``; a request still running then is a result, not an error."""
        self._thread.join(timeout_s)


@dataclass
class PrefillDeath:
    """What happened when the prefill was SIGKILLed at ``killed_at`` with two requests in flight:
    ``mid_stream`` (the decode streaming a long answer) and ``unpulled`` (the prefill had
    answered, the decode, frozen, had not pulled the KV yet)."""

    killed_at: float
    mid_stream: Background
    mid_stream_ended_before_kill: bool
    unpulled: Background


def long_stream_frozen_mid_way(router: Router, decode: Engine) -> Background:
    """A long stream, its decode frozen (whole group) once the stream sent its first event.

    The whole answer takes ~1.3 s here, so on a loaded machine it can be generated (and be in
    the sockets on its way) before the freeze takes hold: a stream that still ends within a
    moment of the freeze is not mid-way, and the scenario starts over (at most 6 times: on a
    quiet machine 3 in a row were seen to end first)."""
    long_body = request_body(
        "completions", PROMPTS[1], stream=True, max_tokens=LONG, ignore_eos=True
    )
    for _ in range(6):
        first_event = threading.Event()

        def stream_it(on_event: Callable[[], None] = first_event.set) -> Answer:
            return call(router.url, "completions", long_body, 60, on_event)

        stream = Background("mid-stream", stream_it)
        assert first_event.wait(60), "the long stream sent no event"
        decode.signal(signal.SIGSTOP)
        stream.join(1.0)  # a frozen decode sends nothing more: a running stream stays running
        if stream.running:
            return stream
        decode.signal(signal.SIGCONT)
    raise AssertionError("the long stream ended before its decode was frozen, 6 times")


def kill_prefill_with_requests_in_flight(cluster: Cluster, router: Router) -> PrefillDeath:
    """SIGSTOP the decode while a long stream is running, send a second request, wait until the
    prefill has answered it, SIGKILL the prefill, SIGCONT the decode. Freezing the decode makes
    the order deterministic: the long stream is mid-way, the second KV unpulled."""
    prefill, decode = cluster.engines
    mid_stream = long_stream_frozen_mid_way(router, decode)
    try:
        answered = counter(prefill, "vllm:request_success_total")
        body = request_body("completions", PROMPTS[2], stream=False, max_tokens=SHORT)
        unpulled = Background("unpulled", lambda: call(router.url, "completions", body, 60))
        poll(
            lambda: counter(prefill, "vllm:request_success_total") > answered,
            30,
            "prefill answered",
        )
        ended_before_kill = not mid_stream.running
        kill(prefill)
        killed_at = time.monotonic()
    finally:
        decode.signal(signal.SIGCONT)
    return PrefillDeath(killed_at, mid_stream, ended_before_kill, unpulled)


@pytest.fixture(scope="class")
def prefill_death(mooncake: Cluster, fleet: Fleet) -> Iterator[PrefillDeath]:
    """Kills the Mooncake pair's prefill (so its tests come last in the class), through a router
    with short failure detection."""
    extra = ["--kv-arrival-timeout", str(KV_ARRIVAL_TIMEOUT_S)]
    log = fleet.log_dir / "router-prefill-death.log"
    with run_router("vllm-mooncake", *mooncake.engines, log, extra) as router:
        death = kill_prefill_with_requests_in_flight(mooncake, router)
        death.unpulled.join(60)
        death.mid_stream.join(60)
        yield death


def ended_within(request: Background, start: float, bound_s: float) -> Answer:
    """The request's answer, asserting it ended less than ``bound_s`` after ``start``."""
    assert request.ended_at is not None, "the request never ended"
    assert request.failure is None, f"the request failed: {request.failure!r}"
    assert request.answer is not None
    assert request.ended_at - start < bound_s, f"ended {request.ended_at - start:.1f}s after"
    return request.answer


def is_openai_error(error: dict[str, Any] | None) -> bool:
    return isinstance(error, dict) and isinstance(error.get("message"), str)


@contextlib.contextmanager
def raw_post(base_url: str, path: str, body: dict[str, Any], request_id: str) -> Iterator[None]:
    """POST ``body`` over a plain socket and read nothing; leaving the block closes the
    connection, as a client that gives up does."""
    url = httpx.URL(base_url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        f"X-Request-Id: {request_id}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.host, url.port or 80), timeout=10) as sock:
        sock.sendall(head + payload)
        yield


# --- tests -------------------------------------------------------------------------------------


class TestMooncake:
    """MooncakeConnector: the decode pulls the KV while the prefill's one-token request runs."""

    @timeout(180)
    @STREAM
    @pytest.mark.parametrize("endpoint", ENDPOINTS)
    def test_output_matches_colocated(
        self,
        mooncake: Cluster,
        expected: Reference,
        endpoint: str,
        stream: bool,
    ) -> None:
        check_matches_colocated(mooncake, expected, endpoint, stream, PROMPTS)

    @timeout(60)
    def test_decode_received_the_prompt_over_the_transfer(self, mooncake: Cluster) -> None:
        # longer than a block (128 tokens on CPU): the decode's created_cache_tokens would count
        # a recomputed full block
        prompt = "A prompt no other test sends, about mooncakes and their orbits. " * 16
        check_prompt_came_over_transfer(mooncake, prompt)

    @timeout(60)
    def test_engines_idle_after_requests(self, mooncake: Cluster) -> None:
        wait_idle(*mooncake.engines)

    @timeout(60)
    def test_tokenize_and_detokenize_pass_through(
        self, mooncake: Cluster, colocated: Engine
    ) -> None:
        """``/tokenize`` and ``/detokenize`` through the router answer as the engine does."""
        check_tokenize_passes_through(mooncake.router.url, colocated.url, PROMPTS[0], "prompt")

    @timeout(180)
    @STREAM
    @pytest.mark.parametrize("endpoint", ["responses", "messages"])
    def test_responses_and_messages_match_colocated(
        self, mooncake: Cluster, colocated: Engine, endpoint: str, stream: bool
    ) -> None:
        """``/v1/responses`` and ``/v1/messages`` through PD answer as the co-located engine
        does (text, ending, the stream's events) and report their usage."""
        got = check_conversation_matches(
            mooncake.router.url, colocated.url, endpoint, PROMPTS[1], stream=stream, tokens=SHORT
        )
        assert got.usage is not None
        wait_idle(*mooncake.engines)

    @timeout(60)
    @pytest.mark.parametrize("endpoint", ENDPOINTS)
    def test_min_tokens(self, mooncake: Cluster, endpoint: str) -> None:
        """vLLM refuses ``min_tokens`` > ``max_tokens`` (400): the prefill leg must drop it."""
        body = request_body(endpoint, PROMPTS[0], stream=False, max_tokens=8, min_tokens=4)
        got = call(mooncake.router.url, endpoint, body)
        assert got.status == 200, got.body
        assert got.body["usage"]["completion_tokens"] >= 4

    @timeout(90)
    @STREAM
    def test_stop_token_on_the_prefills_token(
        self, mooncake: Cluster, colocated: Engine, stream: bool
    ) -> None:
        """The prefill's one token is a stop token: it finishes "stop" and never serves the
        pull, so the router must answer from the prefill's result (was a ~480 s hang)."""
        prompt = PROMPTS[0]
        stop_ids = [first_token_id(colocated, prompt)]
        reference = call(
            colocated.url,
            "completions",
            request_body("completions", prompt, stream=False, stop_token_ids=stop_ids),
        )
        assert (reference.finish_reason, reference.body["usage"]["completion_tokens"]) == (
            "stop",
            1,
        )
        body = request_body(
            "completions", prompt, stream=stream, max_tokens=SHORT, stop_token_ids=stop_ids
        )
        try:
            got = call(mooncake.router.url, "completions", body, timeout=20)
        except httpx.TimeoutException:
            pytest.fail("no answer within 20 s: the router waits for a KV pull that never comes")
        assert got.elapsed_s < 15
        assert got.status == 200, (got.body, got.error)
        assert got.error is None
        assert got.finish_reason == "stop"
        if stream:
            assert got.done, "the stream must end with data: [DONE]"
            finishes = [c.get("finish_reason") for e in got.events for c in e.get("choices") or []]
            assert finishes[-1] == "stop"
        wait_idle(*mooncake.engines)

    @timeout(90)
    def test_client_disconnect_aborts_the_decode(self, mooncake: Cluster) -> None:
        """A client leaving ends the request on both engines. The decode's EngineCore is
        frozen before the request is sent (else it finishes the answer in ~1.3 s, before anyone
        could tell an abort from a completion, however soon the client leaves); its API server
        stays up to take the request, notice the router hanging up and send the abort. The
        client leaves once the decode's API server has the request. (vLLM does not count client
        aborts in ``request_success_total{finished_reason="abort"}``: the generated-token count
        tells.)"""
        decode = mooncake.decode
        generated = counter(decode, "vllm:generation_tokens_total")
        aborted_before = decode.log_text().count(" aborted.")
        request_id = f"disconnect-{uuid.uuid4().hex}"
        body = request_body(
            "completions", PROMPTS[1], stream=True, max_tokens=LONG, ignore_eos=True
        )
        decode.signal_engine_core(signal.SIGSTOP)
        try:
            with raw_post(mooncake.router.url, endpoint_path("completions"), body, request_id):
                poll(
                    lambda: f"Added request cmpl-{request_id}" in decode.log_text(),
                    30,
                    "the decode's API server to take the request",
                )
            # the client has gone: the router cancels both legs
            poll(
                lambda: decode_inflight(mooncake.router) == 0, 10, "the router to drop the request"
            )
            poll(
                lambda: decode.log_text().count(" aborted.") > aborted_before,
                10,
                "the decode's API server to abort the request",
            )
        finally:
            decode.signal_engine_core(signal.SIGCONT)
        wait_idle(*mooncake.engines)
        assert counter(decode, "vllm:generation_tokens_total") - generated < LONG

    @timeout(120)
    def test_prefill_frozen_before_the_pull_ends_the_stream(
        self, mooncake: Cluster, fleet: Fleet
    ) -> None:
        """The prefill answered, then hangs (its port still open, so health probes only time
        out; the thresholds here never mark it down): the stream must end with an error at the
        router's --kv-arrival-timeout, not after the decode's ~540 s."""
        prefill, decode = mooncake.engines
        extra = ["--kv-arrival-timeout", str(KV_ARRIVAL_TIMEOUT_S)]
        extra += ["--health-unhealthy-threshold", "1000"]
        log = fleet.log_dir / "router-prefill-frozen.log"
        with run_router("vllm-mooncake", prefill, decode, log, extra) as router:
            body = request_body("completions", PROMPTS[2], stream=True, max_tokens=SHORT)
            decode.signal(signal.SIGSTOP)  # no pull before the prefill is frozen
            try:
                answered = counter(prefill, "vllm:request_success_total")
                stream = Background("frozen", lambda: call(router.url, "completions", body, 60))
                poll(
                    lambda: counter(prefill, "vllm:request_success_total") > answered,
                    30,
                    "prefill answered",
                )
                answered_at = time.monotonic()
                prefill.signal(signal.SIGSTOP)
            finally:
                decode.signal(signal.SIGCONT)
            try:
                stream.join(KV_ARRIVAL_TIMEOUT_S + 20)
            finally:
                prefill.signal(signal.SIGCONT)
            got = ended_within(stream, answered_at, KV_ARRIVAL_TIMEOUT_S + 10)
        assert got.status in (200, 502, 503, 504), (got.status, got.body)
        assert is_openai_error(got.error), (got.status, got.body, got.events[-1:])
        wait_idle(prefill, decode)

    # The prefill dies below: these tests come last in the class.

    @timeout(60)
    def test_prefill_killed_before_the_pull_fails_fast(self, prefill_death: PrefillDeath) -> None:
        """The prefill answered, then died before the decode pulled: the client gets an OpenAI
        error within the router's --kv-arrival-timeout (the decode alone would wait ~540 s)."""
        got = ended_within(prefill_death.unpulled, prefill_death.killed_at, 30)
        assert got.status in (502, 503, 504), (got.status, got.body)
        assert is_openai_error(got.error), got.body

    @timeout(60)
    def test_prefill_killed_mid_stream_ends_the_stream(self, prefill_death: PrefillDeath) -> None:
        """The decode already has the KV: the stream completes, or ends with an error event."""
        assert not prefill_death.mid_stream_ended_before_kill, "the stream was not mid-way"
        got = ended_within(prefill_death.mid_stream, prefill_death.killed_at, 30)
        assert got.status == 200
        completed = got.done and got.error is None and got.finish_reason == "length"
        assert completed or is_openai_error(got.error), (got.done, got.error, got.finish_reason)

    @timeout(60)
    def test_decode_idle_after_the_prefill_died(
        self, mooncake: Cluster, prefill_death: PrefillDeath
    ) -> None:
        wait_idle(mooncake.decode)


class TestNixl:
    """NixlConnector: the prefill answers first, then the decode pulls (slow here: 2-40 s per
    request, so few cases)."""

    @timeout(300)
    @pytest.mark.parametrize(
        ("endpoint", "stream"),
        [
            pytest.param("completions", False, id="completions-json"),
            pytest.param("chat", True, id="chat-sse"),
        ],
    )
    def test_output_matches_colocated(
        self,
        nixl: Cluster,
        expected: Reference,
        endpoint: str,
        stream: bool,
    ) -> None:
        check_matches_colocated(nixl, expected, endpoint, stream, PROMPTS[:2])

    @timeout(300)
    @pytest.mark.parametrize(
        ("endpoint", "stream"),
        [
            pytest.param("responses", True, id="responses-sse"),
            pytest.param("messages", False, id="messages-json"),
        ],
    )
    def test_responses_and_messages_match_colocated(
        self, nixl: Cluster, colocated: Engine, endpoint: str, stream: bool
    ) -> None:
        check_conversation_matches(
            nixl.router.url, colocated.url, endpoint, PROMPTS[0], stream=stream, tokens=SHORT
        )

    @timeout(180)
    def test_decode_received_the_prompt_over_the_transfer(self, nixl: Cluster) -> None:
        prompt = "A prompt no other test sends, about nixl and its side channels. " * 16
        check_prompt_came_over_transfer(nixl, prompt)  # longer than a 128-token block

    @timeout(120)
    def test_engines_idle_after_requests(self, nixl: Cluster) -> None:
        wait_idle(*nixl.engines)
