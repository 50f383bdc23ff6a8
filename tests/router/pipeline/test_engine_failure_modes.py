"""What real engines did to the router (issue 8; docs/real-engines.md), through the router.

vLLM 0.32 and SGLang 0.5.23 showed failure modes the router must survive: a prefill whose one
token is a stop token keeps no KV, a prefill killed after answering never sends it, a busy engine
answers /health slowly, and SGLang's decode hangs on n > 1. Real engines then wait 300-540 s for
a KV that never comes; the client must not. The fake engines reproduce each (`FakeConfig` knobs,
see testkit/fake_protocols.py), with `kv_timeout` at 60 s so that the old behaviour is a hang,
which the clients here bound at a few seconds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import msgspec
import pytest

from router.observability.logs import RequestIdFilter
from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FIRST_TOKEN_ID, FakeConfig, FakeEngine
from testkit.polling import wait_until

MODEL = "fake-model"
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 5}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
VLLM = ["vllm-mooncake", "vllm-nixl"]
ENGINES = ["vllm-mooncake", "vllm-nixl", "sglang"]
CLIENT_TIMEOUT_S = 8.0  # far below kv_timeout: a router that waits for the engines fails here
# (path, body, stream): both endpoints, streamed (with the usage event) and not
SHAPES = [
    ("/v1/completions", COMPLETION, False),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, True),
    ("/v1/chat/completions", CHAT, False),
    ("/v1/chat/completions", CHAT, True),
]
SHAPE_IDS = ["completions", "completions-stream", "chat", "chat-stream"]


def slow_kv() -> FakeConfig:
    """Engines that give up on a missing KV only after 60 s, like real ones after 300-540 s."""
    return FakeConfig(kv_timeout=60.0)


def post(cluster: FakeCluster, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(cluster.router_url + path, json=body, timeout=CLIENT_TIMEOUT_S, **kwargs)


def sse_data(response: httpx.Response) -> list[Any]:
    """The decoded `data:` events of a stream; `[DONE]` stays a string."""
    events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else msgspec.json.decode(e) for e in events]


def error_message(response: httpx.Response) -> str:
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    return str(error["message"])


def warm_up(cluster: FakeCluster) -> None:
    """One ordinary request first: the decode has read the prefill's bootstrap table, as in
    steady state (a decode that cannot read it fails at once, which is not what is tested)."""
    assert post(cluster, "/v1/completions", COMPLETION).status_code == 200


def decode_cancelled(decode: FakeEngine) -> None:
    wait_until(
        lambda: bool(decode.records) and all(r.done and r.disconnected for r in decode.records),
        3,
        "the decode leg to be cancelled",
    )


def healthy(cluster: FakeCluster, role: str = "prefill") -> bool:
    return bool(cluster.ready_body()[role][0]["healthy"])


# --------------------------------------------------------------------------- stop token on P


@pytest.mark.parametrize("engine", VLLM)
@pytest.mark.parametrize(("path", "body", "stream"), SHAPES, ids=SHAPE_IDS)
def test_prefill_ending_on_a_stop_token_answers_the_client_itself(
    make_cluster: FakeClusterFactory, engine: str, path: str, body: dict[str, Any], stream: bool
) -> None:
    """A vLLM prefill whose one token is EOS answers finish "stop" and frees the KV: the decode
    would wait 480 s for it. The router answers from the prefill's answer and cancels the decode.
    (The router's min_tokens=1 prevents this on vLLM; this prefill ignores it, as an engine that
    does not honour min_tokens would.)"""
    cluster = make_cluster(engine, config=slow_kv)
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    prefill.config.first_token_eos = prefill.config.ignore_min_tokens = True
    chat = path.endswith("chat/completions")
    started = time.monotonic()
    response = post(cluster, path, {**body, "stream": stream})
    assert time.monotonic() - started < 2.0
    assert response.status_code == 200, response.text
    if stream:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_data(response)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
        assert len(choices) == 1 and choices[0]["finish_reason"] == "stop"
        assert choices[0]["delta"]["content"] == "" if chat else choices[0]["text"] == ""
        usage = [e["usage"] for e in events[:-1] if not e["choices"]]
        assert usage == ([{"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}]
                         if "stream_options" in body else [])  # fmt: skip
    else:
        answer = response.json()
        assert answer.get("kv_transfer_params") is None
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
        assert (choice["message"]["content"] if chat else choice["text"]) == ""
    if engine == "vllm-nixl":
        assert decode.records == []  # sequential: the decode was never asked
    else:
        decode_cancelled(decode)
    cluster.wait_idle()


@pytest.mark.parametrize("engine", VLLM)
@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_id_first_is_masked_on_the_prefill_and_answered_by_the_decode(
    make_cluster: FakeClusterFactory, engine: str, stream: bool
) -> None:
    """The client stops on the first token's id; a vLLM prefill that honours min_tokens (the
    router sends min_tokens=1) does not stop on it, keeps the KV, and the decode answers with
    what a co-located engine says: the stop token, empty text."""
    cluster = make_cluster(engine, config=slow_kv)
    body = {**COMPLETION, "stream": stream, "stop_token_ids": [FIRST_TOKEN_ID]}
    response = post(cluster, "/v1/completions", body)
    assert response.status_code == 200, response.text
    if stream:
        finals = [e["choices"][0] for e in sse_data(response)[:-1]]
        assert [c["text"] for c in finals] == [""]
        choice = finals[-1]
    else:
        choice = response.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", FIRST_TOKEN_ID)
    (record,) = cluster.decodes[0].records
    assert record.status == 200 and not record.disconnected
    cluster.wait_idle()


@pytest.mark.parametrize("engine", VLLM)
def test_stop_string_on_the_prefill_still_goes_through_the_decode(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    """A stop string in the prefill's token is matched after the engine finished by length:
    the KV was kept, and the decode (not the prefill's answer) makes the client's answer."""
    cluster = make_cluster(engine, config=slow_kv)
    response = post(cluster, "/v1/completions", {**COMPLETION, "stop": "tok1"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == " tok0 "
    (p_record,) = cluster.prefills[0].records
    (d_record,) = cluster.decodes[0].records
    assert d_record.status == 200 and not d_record.disconnected
    assert p_record.body["stop"] == "tok1"
    cluster.wait_idle()


# --------------------------------------------------------------------------- P dies, KV late


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("stream", [False, True])
def test_prefill_killed_after_answering_fails_the_request_promptly(
    make_cluster: FakeClusterFactory, engine: str, stream: bool
) -> None:
    """A prefill killed right after its answer never sends the KV, and real decodes wait
    480-540 s for it. The router sees the prefill go (its port refuses the next probe) while the
    decode still waits, cancels the decode and answers 502/504 naming the prefill."""
    cluster = make_cluster(
        engine,
        config=slow_kv,
        health={"interval_s": 0.2},
        upstream={"kv_arrival_timeout_s": 2.0},
    )
    warm_up(cluster)
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    prefill.config.die_after_answer = True
    started = time.monotonic()
    response = post(cluster, "/v1/completions", {**COMPLETION, "stream": stream})
    assert time.monotonic() - started < 4.0
    assert prefill.dead
    assert response.status_code in (502, 504), response.text
    assert "prefill" in error_message(response)
    wait_until(
        lambda: decode.records[-1].done and decode.records[-1].disconnected,
        3,
        "the decode leg to be cancelled",
    )
    cluster.wait_idle()


@pytest.mark.parametrize("engine", ENGINES)
def test_kv_that_never_comes_after_the_prefill_answered_is_a_504(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    """The prefill answers and stays healthy but its KV never comes: a streaming decode's first
    byte does not come either. kv_arrival_timeout_s after the prefill's answer the client gets
    504 and the decode is cancelled."""
    cluster = make_cluster(engine, config=slow_kv, upstream={"kv_arrival_timeout_s": 1.0})
    cluster.prefills[0].config.withhold_kv = True
    started = time.monotonic()
    response = post(cluster, "/v1/completions", {**COMPLETION, "stream": True})
    assert time.monotonic() - started < 3.0
    assert response.status_code == 504, response.text
    assert "KV" in error_message(response)
    decode_cancelled(cluster.decodes[0])
    assert healthy(cluster)
    cluster.wait_idle()


def test_kv_arrival_deadline_counts_from_the_prefills_answer(
    make_cluster: FakeClusterFactory,
) -> None:
    """A prefill that takes longer than the deadline to answer does not trip it: the KV cannot
    be late before the prefill has computed it. (NIXL: the decode starts after the answer.)"""
    cluster = make_cluster("vllm-nixl", config=slow_kv, upstream={"kv_arrival_timeout_s": 1.0})
    cluster.prefills[0].config.headers_delay = 1.5
    response = post(cluster, "/v1/completions", {**COMPLETION, "stream": True})
    assert response.status_code == 200, response.text
    events = sse_data(response)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    cluster.wait_idle()


# --------------------------------------------------------------------------- health thresholds

HEALTH = {"interval_s": 0.2, "timeout_s": 0.1, "unhealthy_threshold": 3, "healthy_threshold": 2}


@pytest.mark.parametrize("engine", ["vllm-nixl", "vllm-mooncake"])
def test_prefill_slow_to_answer_health_under_load_keeps_serving(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    """Real NIXL engines answer /health in > 2 s while busy. A probe that times out then is no
    reason to stop sending work (one failed probe used to make every request 503)."""
    cluster = make_cluster(engine, health=HEALTH)
    prefill = cluster.prefills[0]
    prefill.config.health_delay_under_load = 0.5
    prefill.config.headers_delay = 0.15  # in flight during most probes
    statuses = [post(cluster, "/v1/completions", COMPLETION).status_code for _ in range(10)]
    assert statuses == [200] * 10
    assert healthy(cluster)
    cluster.wait_idle()


def test_failing_health_marks_down_after_three_probes_and_up_after_two(
    make_cluster: FakeClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """One bad probe is noise (a busy engine): three in a row take a worker out, two good ones
    in a row bring it back; each transition is logged with its reason."""
    caplog.set_level(logging.INFO, logger="router.fleet.health")
    cluster = make_cluster("vllm-mooncake", health=HEALTH)
    prefill = cluster.prefills[0]
    before = prefill.health_checks
    prefill.config.health_status = 503
    wait_until(lambda: not healthy(cluster), 3, "the prefill marked unhealthy")
    assert prefill.health_checks - before >= 3
    assert post(cluster, "/v1/completions", COMPLETION).status_code == 503
    before = prefill.health_checks
    prefill.config.health_status = 200
    wait_until(lambda: healthy(cluster), 3, "the prefill back")
    assert prefill.health_checks - before >= 2
    assert post(cluster, "/v1/completions", COMPLETION).status_code == 200
    url = cluster.prefill_urls[0]
    transitions = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    assert f"prefill worker {url} is now unhealthy: 3 probes in a row failed" in transitions
    assert f"prefill worker {url} is now healthy: 2 probes in a row succeeded" in transitions
    cluster.wait_idle()


def test_refused_health_probe_marks_down_at_once(make_cluster: FakeClusterFactory) -> None:
    """A refused connection is not a busy engine: the process is gone, and the next probe takes
    it out (three probes would take at least two intervals, 1.0 s here)."""
    cluster = make_cluster("vllm-mooncake", health={**HEALTH, "interval_s": 0.5})
    cluster.stop("prefill", 0)
    started = time.monotonic()
    wait_until(lambda: not healthy(cluster), 3, "the stopped prefill marked unhealthy")
    assert time.monotonic() - started < 0.9


def test_worker_serving_requests_is_not_marked_down_by_failing_probes(
    make_cluster: FakeClusterFactory,
) -> None:
    """Every probe times out, but the prefill keeps answering requests: a worker that served a
    request within the last probe interval stays in. Once the requests stop, the failing probes
    take it out."""
    cluster = make_cluster("vllm-mooncake", health=HEALTH)
    prefill = cluster.prefills[0]
    prefill.config.health_delay = 0.5
    before = prefill.health_checks
    deadline = time.monotonic() + 15
    # Back-to-back requests until 4 probes have reached the engine (3 whole failed probes, each
    # 0.1 + 0.2 s), bounded in count and time: a slow machine runs fewer probes per second.
    for _ in range(3000):
        assert post(cluster, "/v1/completions", COMPLETION).status_code == 200
        if prefill.health_checks - before >= 4 or time.monotonic() > deadline:
            break
    assert prefill.health_checks - before >= 4
    assert healthy(cluster)
    wait_until(lambda: not healthy(cluster), 3, "the idle prefill with failing probes out")
    cluster.wait_idle()


# --------------------------------------------------------------------------- debug line


@pytest.mark.parametrize("engine", ENGINES)
def test_one_debug_line_per_request_names_the_pair_and_the_transfer(
    make_cluster: FakeClusterFactory, engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    """At DEBUG the router logs one line per request with what it takes to find the request in
    both engines' logs: the request id, both URLs, the transfer id (Mooncake) or room (SGLang)."""
    cluster = make_cluster(engine)
    caplog.handler.addFilter(RequestIdFilter())
    caplog.set_level(logging.DEBUG, logger="router")
    response = post(cluster, "/v1/completions", COMPLETION, headers={"x-request-id": "abc123"})
    assert response.status_code == 200

    def lines() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if getattr(r, "request_id", None) == "abc123"
            and cluster.prefill_urls[0] in r.getMessage()
            and cluster.decode_urls[0] in r.getMessage()
        ]

    # the line is written as the request ends, which may be just after the client got its answer
    wait_until(lambda: bool(lines()), 3, "the request's debug line")
    assert len(lines()) == 1, caplog.text
    (p_record,) = cluster.prefills[0].records
    if engine == "vllm-mooncake":
        assert p_record.body["kv_transfer_params"]["transfer_id"] in lines()[0]
    elif engine == "sglang":
        assert f"bootstrap_room={p_record.body['bootstrap_room']}" in lines()[0]


# --------------------------------------------------------------------------- SGLang n > 1


def sglang_n_hangs() -> FakeConfig:
    return FakeConfig(kv_timeout=60.0, sglang_n_hang=True)


@pytest.mark.parametrize(("path", "body", "stream"), SHAPES, ids=SHAPE_IDS)
def test_sglang_n_above_one_is_split_into_single_sequence_requests(
    make_cluster: FakeClusterFactory, path: str, body: dict[str, Any], stream: bool
) -> None:
    """SGLang PD hangs on n > 1 (its prefix warm-up reuses the rooms). The router sends n
    requests with n = 1 and rooms of their own and merges the answers as one engine would."""
    cluster = make_cluster("sglang", config=sglang_n_hangs)
    single = post(cluster, path, body).json()["usage"]
    started = time.monotonic()
    response = post(cluster, path, {**body, "n": 3, "stream": stream})
    assert time.monotonic() - started < 2.0
    assert response.status_code == 200, response.text
    decodes = cluster.decodes[0].records[1:]
    assert len(decodes) == 3 and all(r.body.get("n", 1) == 1 for r in decodes)
    assert len({r.body["bootstrap_room"] for r in decodes}) == 3
    if stream:
        events = sse_data(response)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        indices = {c["index"] for e in events[:-1] for c in e["choices"]}
        assert indices == {0, 1, 2}
        usages = [e["usage"] for e in events[:-1] if "usage" in e and e["usage"]]
        assert len(usages) == (1 if "stream_options" in body else 0)
        usage = usages[0] if usages else None
    else:
        answer = response.json()
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
        usage = answer["usage"]
    if usage is not None:
        assert usage["completion_tokens"] == 3 * single["completion_tokens"]
        assert usage["prompt_tokens"] == single["prompt_tokens"]
    cluster.wait_idle()
