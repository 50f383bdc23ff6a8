"""Session affinity through the real app: requests naming one session (``X-Session-Id``) land on
one prefill and one decode under round_robin over two of each; a bad key is a 400 in OpenAI's
error shape; ``/admin/explain`` shows the pin."""

from __future__ import annotations

from testkit.fake_cluster import FakeClusterFactory

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}


def test_one_session_stays_on_one_prefill_and_decode(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("vllm-nixl", prefill=2, decode=2)
    session = {"x-session-id": "conversation-42"}
    with cluster.client() as client:
        routes = set()
        for _ in range(4):
            answer = client.post("/v1/completions", json=COMPLETION, headers=session)
            assert answer.status_code == 200, answer.text
            routes.add((answer.headers["x-pdr-prefill"], answer.headers["x-pdr-decode"]))
            other = client.post("/v1/completions", json=COMPLETION)  # round_robin moves on
            assert other.status_code == 200, other.text
        plain = {
            (answer.headers["x-pdr-prefill"], answer.headers["x-pdr-decode"])
            for answer in (client.post("/v1/completions", json=COMPLETION) for _ in range(4))
        }
        explained = client.post("/admin/explain", json=COMPLETION, headers=session).json()
        metrics = client.get("/metrics").text
    assert len(routes) == 1
    assert len(plain) == 2  # without the header, the requests rotate
    prefill, decode = routes.pop()
    assert prefill in cluster.prefill_urls and decode in cluster.decode_urls
    pin = explained["session"]["pin"]
    assert (pin["prefill"], pin["decode"]) == (prefill, decode)
    assert explained["choice"]["prefill"] == prefill
    assert explained["session"]["table"]["entries"] == 1
    assert 'pdr_session_pins_total{outcome="hit",reason=""} 3.0' in metrics


def test_a_bad_session_key_or_affinity_is_a_400_in_openai_shape(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-nixl", session={"max_key_bytes": 16})
    with cluster.client() as client:
        too_long = client.post(
            "/v1/completions", json=COMPLETION, headers={"x-session-id": "k" * 17}
        )
        unknown = client.post(
            "/v1/completions",
            json=COMPLETION,
            headers={"x-session-id": "k", "x-session-affinity": "sticky"},
        )
        fits = client.post(
            "/v1/completions",
            json=COMPLETION,
            headers={"x-session-id": "k" * 16, "x-session-affinity": "hard"},
        )
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["type"] == "invalid_request_error" and "session key" in error["message"]
    assert unknown.status_code == 400 and "X-Session-Affinity" in unknown.json()["error"]["message"]
    assert fits.status_code == 200, fits.text
    assert cluster.prefills[0].records and len(cluster.decodes[0].records) == 1


def test_a_configured_header_name_and_no_affinity_when_empty(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-nixl", prefill=2, session={"header": "X-Conversation"})
    with cluster.client() as client:
        prefills = {
            client.post(
                "/v1/completions", json=COMPLETION, headers={"x-conversation": "c1"}
            ).headers["x-pdr-prefill"]
            for _ in range(4)
        }
    assert len(prefills) == 1
    off = make_cluster("vllm-nixl", prefill=2, session={"header": ""})
    with off.client() as client:
        prefills = {
            client.post(
                "/v1/completions", json=COMPLETION, headers={"x-session-id": "k" * 1000}
            ).headers["x-pdr-prefill"]
            for _ in range(4)
        }
        assert "session" not in client.post("/admin/explain", json=COMPLETION).json()
    assert len(prefills) == 2  # no affinity: round_robin, and the key is not even read
