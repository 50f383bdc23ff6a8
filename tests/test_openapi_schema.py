"""The router's OpenAPI schema describes what it serves and answers: the completion routes
(served by the raw handler), 400 (not FastAPI's 422) for invalid input, an empty ``/health``;
and a 405 says which methods are allowed."""

from __future__ import annotations

import json

from testkit.fake_cluster import FakeClusterFactory


def test_schema_documents_the_completion_routes_and_400s(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        schema = client.get("/openapi.json").json()
        invalid = client.post("/admin/workers", json={"role": "nope"})
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert {"200", "400", "413", "502", "503", "504"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
    assert '"422"' not in json.dumps(schema)
    assert "400" in paths["/admin/workers"]["post"]["responses"]
    assert invalid.status_code == 400  # what the schema now says
    assert paths["/health"]["get"]["responses"]["200"]["content"] == {}


def test_a_405_names_the_allowed_methods(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        hot = client.get("/v1/completions")
        cold = client.delete("/health")
        health = client.get("/health")
    assert hot.status_code == 405 and hot.headers["allow"] == "POST"
    assert hot.json()["error"]["code"] == 405
    assert cold.status_code == 405 and cold.headers["allow"] == "GET"
    assert health.status_code == 200 and health.content == b""
