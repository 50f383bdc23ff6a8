"""End to end through the router: what each leg receives, per engine protocol.

The fake engines validate the PD fields the way the real engines need them and fail the request
otherwise, so a passing request is itself a protocol check; these tests add the cross-leg checks.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from testkit.fake_cluster import FakeClusterFactory
from testkit.polling import wait_until

ENGINES = ["vllm-mooncake", "vllm-nixl", "sglang"]
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 5}


def sse_events(text: str) -> list[Any]:
    events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text
    return [json.loads(event) for event in events[:-1]]


def completion_text(events: list[dict[str, Any]]) -> str:
    return "".join(
        choice.get("text") or choice.get("delta", {}).get("content") or ""
        for event in events
        for choice in event.get("choices", [])
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
@pytest.mark.parametrize("stream", [True, False])
def test_request_reaches_both_legs_and_decode_answers(
    make_cluster: FakeClusterFactory, engine: str, path: str, body: dict[str, Any], stream: bool
) -> None:
    cluster = make_cluster(engine)
    with cluster.client() as client:
        response = client.post(
            path,
            json={**body, "stream": stream},
            headers={"Authorization": "Bearer sk-test", "X-Request-Id": "r-1"},
        )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "r-1"
    if stream:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert len(completion_text(sse_events(response.text)).split()) == 5
    else:
        answer = response.json()
        assert answer["usage"]["completion_tokens"] == 5
    prefill, decode = cluster.prefills[0].records, cluster.decodes[0].records
    assert len(prefill) == 1 and len(decode) == 1
    for leg in (prefill[0], decode[0]):
        assert leg.path == path
        assert leg.headers["x-request-id"] == "r-1"
        assert leg.headers["authorization"] == "Bearer sk-test"
        assert leg.status == 200
    assert decode[0].body.get("stream", False) is stream
    assert decode[0].body["max_tokens"] == 5


def test_mooncake_legs_share_the_transfer_id_and_the_pinned_rank(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-mooncake", dp_size=2)
    engine_ids = cluster.prefills[0].engine_ids
    assert len(engine_ids) == 2
    with cluster.client() as client:
        for _ in range(4):
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    ranks = []
    for p, d in zip(cluster.prefills[0].records, cluster.decodes[0].records, strict=True):
        rank = int(p.headers["x-data-parallel-rank"])
        ranks.append(rank)
        d_params = d.body["kv_transfer_params"]
        assert d_params["transfer_id"] == p.body["kv_transfer_params"]["transfer_id"]
        assert d_params["remote_engine_id"] == engine_ids[rank]
        assert d_params["remote_bootstrap_addr"].startswith("http://127.0.0.1:")
    assert sorted(ranks) == [0, 0, 1, 1]  # both DP ranks get work
    ids = {p.body["kv_transfer_params"]["transfer_id"] for p in cluster.prefills[0].records}
    assert len(ids) == 4


def test_mooncake_prefill_restart_is_picked_up(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("vllm-mooncake")
    prefill = cluster.prefills[0]
    old = prefill.engine_ids[0]
    prefill.restart()
    assert prefill.engine_ids[0] != old

    def routed_to_new_engine() -> bool:
        body = cluster.ready_body()
        return bool(body["prefill"][0].get("engine_ids") == list(prefill.engine_ids))

    wait_until(routed_to_new_engine, 5, "router to re-query /query after the restart")
    with cluster.client() as client:
        response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200, response.text
    assert (
        cluster.decodes[0].records[-1].body["kv_transfer_params"]["remote_engine_id"]
        == (prefill.engine_ids[0])
    )


def test_mooncake_unknown_engine_id_on_decode_triggers_requery(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-mooncake", health={"interval_s": 60.0})
    cluster.prefills[0].restart()  # the router still holds the old engine id
    with cluster.client() as client:
        failed = client.post("/v1/completions", json=COMPLETION)
        assert failed.status_code >= 500
        assert "not found from bootstrap server" in failed.text

        def recovered() -> bool:
            return client.post("/v1/completions", json=COMPLETION).status_code == 200

        wait_until(recovered, 5, "a request to succeed after the decode reported a stale id")


def test_mooncake_min_tokens_reaches_only_the_decode(make_cluster: FakeClusterFactory) -> None:
    """A vLLM prefill refuses min_tokens above its max_tokens=1 (400): it gets min_tokens=1 (which
    keeps its one token from being a stop token); the decode honours the client's."""
    cluster = make_cluster("vllm-mooncake")
    with cluster.client() as client:
        for stream in (False, True):
            response = client.post(
                "/v1/completions", json={**COMPLETION, "min_tokens": 4, "stream": stream}
            )
            assert response.status_code == 200, response.text
    for p, d in zip(cluster.prefills[0].records, cluster.decodes[0].records, strict=True):
        assert p.body["min_tokens"] == 1
        assert d.body["min_tokens"] == 4


def test_nixl_decode_gets_prefill_params_verbatim_and_min_tokens_back(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-nixl")
    with cluster.client() as client:
        response = client.post(
            "/v1/completions", json={**COMPLETION, "min_tokens": 2, "stream": True}
        )
    assert response.status_code == 200, response.text
    p, d = cluster.prefills[0].records[0], cluster.decodes[0].records[0]
    assert p.body["min_tokens"] == 1
    assert d.body["min_tokens"] == 2
    assert d.body["kv_transfer_params"]["some_future_field"] == "x"
    assert d.body["kv_transfer_params"]["remote_host"] == "127.0.0.1"


def test_sglang_batched_prompts_get_room_lists(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        response = client.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b", "c"]})
    assert response.status_code == 200, response.text
    p, d = cluster.prefills[0].records[0], cluster.decodes[0].records[0]
    assert isinstance(p.body["bootstrap_room"], list) and len(set(p.body["bootstrap_room"])) == 3
    assert p.body == d.body


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {**COMPLETION, "n": 2}),
        ("/v1/completions", {**COMPLETION, "n": 2, "prompt": ["a", "b"]}),
        ("/v1/chat/completions", {**CHAT, "n": 3}),
    ],
)
def test_sglang_n_goes_out_as_single_sequence_requests_with_rooms_of_their_own(
    make_cluster: FakeClusterFactory, path: str, body: dict[str, Any]
) -> None:
    """SGLang PD hangs on n > 1 (its n > 1 warm-up reuses the rooms): n requests with n=1."""
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    n, batch = body["n"], len(body.get("prompt", [])) if isinstance(body.get("prompt"), list) else 1
    assert [c["index"] for c in response.json()["choices"]] == list(range(n * batch))
    prefills, decodes = cluster.prefills[0].records, cluster.decodes[0].records
    assert len(prefills) == len(decodes) == n
    rooms = [str(r.body["bootstrap_room"]) for r in prefills]
    assert len(set(rooms)) == n
    assert all(r.body["n"] == 1 for r in prefills + decodes)


def test_sglang_dp_prefill_rooms_follow_the_chosen_rank(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", dp_size=2)
    assert cluster.ready_body()["prefill"][0]["dp_size"] == 2
    with cluster.client() as client:
        for _ in range(4):
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    ranks = []
    for p, d in zip(cluster.prefills[0].records, cluster.decodes[0].records, strict=True):
        rank = p.body["routed_dp_rank"]
        ranks.append(rank)
        assert p.body["bootstrap_room"] % 2 == rank
        assert d.body["disagg_prefill_dp_rank"] == rank
    assert sorted(ranks) == [0, 0, 1, 1]


@pytest.mark.parametrize("engine", ["vllm-mooncake", "sglang"])
def test_every_dp_rank_of_every_prefill_gets_work_when_idle(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    """Sequential requests (every rank idle, so every pick is a tie) over two DP2 prefills
    round-robin: each of the four ranks serves two of eight requests."""
    cluster = make_cluster(engine, prefill=2, dp_size=2, policy={"policy": "round_robin"})
    with cluster.client() as client:
        for _ in range(8):
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    for prefill in cluster.prefills:
        ranks = [
            int(r.headers["x-data-parallel-rank"])
            if engine == "vllm-mooncake"
            else r.body["routed_dp_rank"]
            for r in prefill.records
        ]
        assert sorted(ranks) == [0, 0, 1, 1], ranks


@pytest.mark.parametrize("engine", ENGINES)
def test_x_request_id_is_generated_when_absent(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    cluster = make_cluster(engine)
    response = httpx.post(cluster.router_url + "/v1/completions", json=COMPLETION, timeout=10)
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    assert len(rid) >= 16
    assert cluster.prefills[0].records[0].headers["x-request-id"] == rid
    assert cluster.decodes[0].records[0].headers["x-request-id"] == rid
